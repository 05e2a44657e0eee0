"""Support of ``tests/e2e/test_upgrade.py``: the previous release's source tree, its components run
as host processes standing in for the chart's pods, and the difference between two CRDs.

- ``previous_release_tree``: a ``git worktree`` of the tagged release (``v0.1.0``), falling back to
  its commit hash; a clone without that commit (a shallow one) is an error that says how to fetch it.
- ``StandIn``: ``python -m gpualloc.cli`` from a given source tree, with the arguments the release's
  live Deployment or DaemonSet gives its container, the downward-API variables filled in, local
  ports and TLS files, and a kubeconfig holding the component's own ServiceAccount token.
- ``spec_fields``, ``added_fields``, ``example_value``: the GpuClaim ``spec`` property paths of a
  CRD, those one CRD has and another lacks, and a value the schema accepts for one of them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_SUBDIR = Path("helm") / "gpualloc"
# Flags a stand-in sets itself: its own ports, TLS files and credentials.
_LOCAL_FLAGS = (
    "--port=",
    "--metrics-port=",
    "--health-port=",
    "--tls-cert-file=",
    "--tls-key-file=",
    "--kubelet-root=",  # with DRA on, the agent's host paths: the stand-in's own directories
    "--cdi-dir=",
)
_DOWNWARD = re.compile(r"\$\(([A-Z_]+)\)")


# ----------------------------------------------------------------------------- the previous release


def _git(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def release_commit(tag: str, commit: str) -> str:
    """The full hash of ``tag``, else of ``commit``; AssertionError (never a skip) when the clone
    has neither, as a shallow clone may not."""
    for ref in (tag, commit):
        found = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
        if found.returncode == 0:
            return found.stdout.strip()
    raise AssertionError(
        f"the previous release ({tag}, commit {commit}) is not in this clone of {REPO_ROOT}"
        f" (a shallow clone?): run `git fetch --tags --unshallow origin` (or `git fetch origin tag {tag}`)"
        " and run the upgrade test again"
    )


def previous_release_tree(tag: str, commit: str, directory: Path) -> Iterator[Path]:
    """A detached ``git worktree`` of the release at ``directory``; removed afterwards."""
    full = release_commit(tag, commit)
    added = _git("worktree", "add", "--detach", str(directory), full)
    assert added.returncode == 0, f"git worktree add {directory} {full}:\n{added.stderr}"
    try:
        yield directory
    finally:
        _git("worktree", "remove", "--force", str(directory))
        _git("worktree", "prune")


def imported_from(source: Path) -> dict[str, str]:
    """Where ``python -m`` run in ``source`` (as ``StandIn`` runs it) imports the five packages from."""
    code = "import agent, certs, controller, gpualloc, webhook as w; print(*(m.__file__ for m in (agent, certs, controller, gpualloc, w)))"  # noqa: E501
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=source, env=_env(source, {}), capture_output=True, text=True,
        timeout=120, check=True,
    )  # fmt: skip
    names = ("agent", "certs", "controller", "gpualloc", "webhook")
    return dict(zip(names, done.stdout.split(), strict=True))


def _env(source: Path, extra: Mapping[str, str]) -> dict[str, str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUALLOC_", "KUBECONFIG", "POD_", "NODE_", "PYTHONPATH"))
    }
    # The source tree first: the venv's editable install of the working tree comes after it.
    return {**keep, "PYTHONPATH": str(source), **extra}


# ----------------------------------------------------------------------------- stand-in processes


def stand_in_args(
    container: Mapping[str, Any], downward: Mapping[str, str], local: list[str], kubeconfig: Path
) -> list[str]:
    """The container's args with ``$(VAR)`` filled from ``downward``, the flags in ``_LOCAL_FLAGS``
    replaced by ``local``, and the kubeconfig added."""
    args = [_DOWNWARD.sub(lambda m: downward[m.group(1)], str(a)) for a in container["args"]]
    return [*(a for a in args if not a.startswith(_LOCAL_FLAGS)), *local, f"--kubeconfig={kubeconfig}"]


class StandIn:
    """One component of a release as a host process run from ``source`` (its log in ``log_dir``)."""

    def __init__(
        self,
        name: str,
        source: Path,
        args: list[str],
        downward: Mapping[str, str],
        log_dir: Path,
        *,
        port: int,
    ) -> None:
        self.name = name
        self.port = port  # where it answers /readyz
        self.source = source
        self.args = args
        self.identity = downward.get("POD_NAME", "")
        self.log = log_dir / f"{name}.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpualloc.cli", *args],
                cwd=source,
                env=_env(source, downward),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def alive(self) -> None:
        assert self.process.poll() is None, f"{self.name} exited {self.process.returncode}:\n{self.tail()}"

    def terminate(self) -> None:
        """SIGTERM, as the kubelet sends a container of a pod being replaced."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> int:
        self.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return self.process.returncode


# ----------------------------------------------------------------------------- CRD schemas


def crd_documents(chart: Path) -> list[dict[str, Any]]:
    """The CustomResourceDefinitions in ``chart``'s crds/ folder."""
    out = []
    for path in sorted((chart / "crds").glob("*.yaml")):
        out += [
            d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "CustomResourceDefinition"
        ]
    return out


def spec_schema(crd: Mapping[str, Any], version: str) -> dict[str, Any]:
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: dict[str, Any] = served["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def spec_fields(schema: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Every property path under ``schema`` (an object schema), with its schema."""
    out: dict[tuple[str, ...], Any] = {}
    for name, sub in (schema.get("properties") or {}).items():
        path = (*prefix, name)
        out[path] = sub
        out.update(spec_fields(sub, path))
    return out


def added_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    """The paths of ``new`` that ``old`` lacks and whose parent ``old`` has (the new subtrees' roots)."""
    before, after = spec_fields(old), spec_fields(new)
    return {p: s for p, s in after.items() if p not in before and (len(p) == 1 or p[:-1] in before)}


def example_value(schema: Mapping[str, Any]) -> Any:
    """A value ``schema`` accepts, other than its default where it can be (so that reading it back
    shows it was kept, not defaulted)."""
    default = schema.get("default")
    if "enum" in schema:
        return next((v for v in schema["enum"] if v != default), schema["enum"][0])
    kind = schema.get("type")
    if kind in ("integer", "number"):
        low, high = schema.get("minimum", 0), schema.get("maximum", 1 << 30)
        wanted = low + 1 if default is None else default + 1
        return wanted if low <= wanted <= high else low
    if kind == "boolean":
        return not default
    if kind == "string":
        return "x" * max(1, int(schema.get("minLength", 1)))
    if kind == "array":
        return [example_value(schema["items"]) for _ in range(int(schema.get("minItems", 0)))]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: example_value(props[name]) for name in schema.get("required") or []}
    raise AssertionError(f"no example value for the schema {dict(schema)}")


def put_path(spec: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        spec = spec.setdefault(name, {})
    spec[path[-1]] = value


def get_path(spec: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for name in path:
        spec = spec.get(name) if isinstance(spec, Mapping) else None  # type: ignore[assignment]
    return spec
