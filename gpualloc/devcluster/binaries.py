"""Build the local control plane's programs from pinned Go modules, once per machine.

No published package ships kube-apiserver, so it is compiled from the Kubernetes
Go modules pinned in ``hack/controlplane``; etcd comes from ``hack/etcd``, kwok, helm
toxiproxy-server (the race test's faulty network) and vegeta (the webhook
benchmark's load generator) from ``hack/tools/kwok``, ``hack/tools/helm``,
``hack/tools/toxiproxy`` and ``hack/tools/vegeta``. The real node's programs
(``gpualloc dev up --real-node``) come the same way: the kubelet from ``hack/kubelet``
(the control plane's module set plus ``cmd/kubelet``), containerd, its runc shim and
ctr from ``hack/tools/containerd``, the CNI plugins from ``hack/tools/cni`` and the
sandbox's pause program from ``hack/pause``. Each module's binaries land
in ``${GPUALLOC_CACHE_DIR:-~/.cache/gpualloc}/bin/<name>-<version>-<hash>/``, where
the hash covers the module's go.mod and go.sum and the build flags, so a change to
a pin builds again and everything else is reused. Go's own module and build caches
stay where Go keeps them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

Progress = Callable[[str], None]

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK_DIR = REPO_ROOT / "hack"

KUBERNETES_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
HELM_VERSION = "v3.21.4"
TOXIPROXY_VERSION = "v2.5.0"
VEGETA_VERSION = "v12.13.0"
CONTAINERD_VERSION = "v2.4.2"
CNI_PLUGINS_VERSION = "v1.10.0"
PAUSE_VERSION = "v1"

HEARTBEAT_SECONDS = 30.0

_MAJOR, _MINOR = KUBERNETES_VERSION.lstrip("v").split(".")[:2]
# The same flags as the documented manual build, so Go's build cache is shared with it.
KUBERNETES_LDFLAGS = " ".join(
    [
        "-s -w",
        f"-X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}",
        f"-X k8s.io/component-base/version.gitMajor={_MAJOR}",
        f"-X k8s.io/component-base/version.gitMinor={_MINOR}",
        "-X k8s.io/component-base/version.gitTreeState=clean",
    ]
)

# As helm's own release build: without the k8sVersion flags, ``helm template`` (no cluster to
# ask) assumes Kubernetes v1.20 and refuses the chart's ``kubeVersion: >=1.30.0-0``.
HELM_LDFLAGS = " ".join(
    [
        "-s -w",
        f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
        *(
            f"-X helm.sh/helm/v3/pkg/{package}.k8sVersion{part}={value}"
            for package in ("chartutil", "lint/rules")
            for part, value in (("Major", _MAJOR), ("Minor", _MINOR))
        ),
    ]
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Module:
    """A small Go module in ``hack/`` and the commands built from it."""

    name: str
    version: str
    directory: str  # relative to hack/
    packages: tuple[tuple[str, str], ...]  # (binary name, Go package)
    ldflags: str = "-s -w"
    tags: str = ""  # go build -tags
    env: tuple[tuple[str, str], ...] = ()  # added to go build's environment


MODULES: tuple[Module, ...] = (
    Module(
        name="kubernetes",
        version=KUBERNETES_VERSION,
        directory="controlplane",
        packages=(
            ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
            ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
            ("kube-controller-manager", "k8s.io/kubernetes/cmd/kube-controller-manager"),
        ),
        ldflags=KUBERNETES_LDFLAGS,
    ),
    Module(name="etcd", version=ETCD_VERSION, directory="etcd", packages=(("etcd", "."),)),
    Module(
        name="kwok",
        version=KWOK_VERSION,
        directory="tools/kwok",
        packages=(("kwok", "sigs.k8s.io/kwok/cmd/kwok"),),
    ),
    Module(
        name="helm",
        version=HELM_VERSION,
        directory="tools/helm",
        packages=(("helm", "helm.sh/helm/v3/cmd/helm"),),
        ldflags=HELM_LDFLAGS,
    ),
    # Only the server: the race test drives it through its HTTP API.
    Module(
        name="toxiproxy",
        version=TOXIPROXY_VERSION,
        directory="tools/toxiproxy",
        packages=(("toxiproxy-server", "github.com/Shopify/toxiproxy/v2/cmd/server"),),
        ldflags=f"-s -w -X github.com/Shopify/toxiproxy/v2.Version={TOXIPROXY_VERSION}",
    ),
    # The load generator of bench/webhook_vegeta.py.
    Module(
        name="vegeta",
        version=VEGETA_VERSION,
        directory="tools/vegeta",
        packages=(("vegeta", "github.com/tsenart/vegeta/v12"),),
        ldflags=f"-s -w -X main.Version={VEGETA_VERSION}",
    ),
    # The real node (gpualloc dev up --real-node): a module of its own, so that the control
    # plane's cache key does not change with it.
    Module(
        name="kubelet",
        version=KUBERNETES_VERSION,
        directory="kubelet",
        packages=(("kubelet", "k8s.io/kubernetes/cmd/kubelet"),),
        ldflags=KUBERNETES_LDFLAGS,
    ),
    # Static (no cgo), without the btrfs snapshotter's C headers; the shim must be on containerd's PATH.
    Module(
        name="containerd",
        version=CONTAINERD_VERSION,
        directory="tools/containerd",
        packages=(
            ("containerd", "github.com/containerd/containerd/v2/cmd/containerd"),
            ("containerd-shim-runc-v2", "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"),
            ("ctr", "github.com/containerd/containerd/v2/cmd/ctr"),
        ),
        ldflags=(
            f"-s -w -X github.com/containerd/containerd/v2/version.Version={CONTAINERD_VERSION}"
            " -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2"
        ),
        tags="no_btrfs",
        env=(("CGO_ENABLED", "0"),),
    ),
    Module(
        name="cni-plugins",
        version=CNI_PLUGINS_VERSION,
        directory="tools/cni",
        packages=(
            ("bridge", "github.com/containernetworking/plugins/plugins/main/bridge"),
            ("host-local", "github.com/containernetworking/plugins/plugins/ipam/host-local"),
            ("loopback", "github.com/containernetworking/plugins/plugins/main/loopback"),
        ),
        ldflags=(
            "-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion="
            f"{CNI_PLUGINS_VERSION}"
        ),
        env=(("CGO_ENABLED", "0"),),
    ),
    # The pod sandbox's pause program: static, standard library only (hack/pause/main.go).
    Module(
        name="pause",
        version=PAUSE_VERSION,
        directory="pause",
        packages=(("pause", "."),),
        env=(("CGO_ENABLED", "0"),),
    ),
)

# What `gpualloc dev up --real-node` runs beside the control plane.
NODE_NAMES: tuple[str, ...] = (
    "kubelet",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "bridge",
    "host-local",
    "loopback",
    "pause",
)

NAMES: tuple[str, ...] = tuple(name for module in MODULES for name, _ in module.packages)


class BuildError(RuntimeError):
    """A binary could not be built; the message carries the tail of Go's output."""


def cache_dir() -> Path:
    """``$GPUALLOC_CACHE_DIR``, else ``~/.cache/gpualloc``."""
    configured = os.environ.get("GPUALLOC_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "gpualloc"


def module_key(module: Module, hack_dir: Path = HACK_DIR) -> str:
    """``<name>-<version>-<hash>``: the hash covers go.mod, go.sum and the build flags."""
    digest = hashlib.sha256()
    for filename in ("go.mod", "go.sum"):
        path = hack_dir / module.directory / filename
        digest.update(filename.encode() + b"\0")
        digest.update(path.read_bytes() if path.exists() else b"<missing>")
    flags: tuple[object, ...] = (module.packages, module.ldflags)
    if module.tags or module.env:  # only then: the keys of the modules without them stay as they were
        flags = (*flags, module.tags, module.env)
    digest.update(repr(flags).encode())
    return f"{module.name}-{module.version}-{digest.hexdigest()[:12]}"


def _module_of(name: str) -> Module:
    for module in MODULES:
        if any(binary == name for binary, _ in module.packages):
            return module
    raise ValueError(f"unknown binary {name!r}; known: {', '.join(NAMES)}")


def locate(names: Iterable[str] | None = None, *, hack_dir: Path = HACK_DIR) -> dict[str, Path]:
    """Where each binary lives (or will live) in the cache; builds nothing."""
    root = cache_dir() / "bin"
    out: dict[str, Path] = {}
    for name in NAMES if names is None else names:
        out[name] = root / module_key(_module_of(name), hack_dir) / name
    return out


def _present(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


@contextlib.contextmanager
def build_lock(path: Path, progress: Progress) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"another process is building into {path.parent}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of the text file at ``path`` ("" when it cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _build_one(
    go: str, module: Module, name: str, package: str, target: Path, hack_dir: Path, progress: Progress
) -> float:
    module_dir = hack_dir / module.directory
    temporary = target.with_name(f".{name}.tmp-{os.getpid()}")
    log_path = target.with_name(f".{name}.build.log")
    tags = ["-tags", module.tags] if module.tags else []
    argv = [go, "build", "-trimpath", *tags, "-ldflags", module.ldflags, "-o", str(temporary), package]
    env = {**os.environ, **dict(module.env)}
    progress(f"building {name} {module.version} (go build in hack/{module.directory})")
    started = time.monotonic()
    with log_path.open("w") as log:
        log.write(" ".join([*(f"{k}={v}" for k, v in module.env), *argv]) + "\n")
        log.flush()
        try:
            process = subprocess.Popen(argv, cwd=module_dir, stdout=log, stderr=subprocess.STDOUT, env=env)
        except OSError as exc:
            raise BuildError(f"cannot run {go}: {exc}") from exc
        try:
            while True:
                try:
                    returncode = process.wait(timeout=HEARTBEAT_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    progress(f"  still building {name} ... {time.monotonic() - started:.0f} s")
        except BaseException:
            process.kill()
            process.wait()
            temporary.unlink(missing_ok=True)
            raise
    elapsed = time.monotonic() - started
    if returncode != 0:
        temporary.unlink(missing_ok=True)
        raise BuildError(
            f"building {name} failed (exit {returncode}) after {elapsed:.0f} s; "
            f"full log: {log_path}\n{tail(log_path)}"
        )
    os.replace(temporary, target)
    progress(f"built {name} in {elapsed:.0f} s")
    return elapsed


def ensure(names: Iterable[str] | None = None, *, progress: Progress = print) -> dict[str, Path]:
    """Build whichever of ``names`` (default: all) is not cached yet; return name -> path.

    Raises BuildError when Go is missing or a build fails. A file lock keeps two
    processes from building at once; the second one waits, then reuses the result.
    """
    wanted = list(NAMES if names is None else names)
    paths = locate(wanted)
    missing = [name for name in wanted if not _present(paths[name])]
    if not missing:
        progress(f"reusing cached binaries in {cache_dir() / 'bin'} ({', '.join(wanted)})")
        return paths
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "the Go toolchain (go 1.26 or newer) is not on PATH; it is needed once to build "
            f"{', '.join(missing)} into {cache_dir() / 'bin'}"
        )
    started = time.monotonic()
    with build_lock(cache_dir() / "bin" / ".build.lock", progress):
        for name in missing:
            target = paths[name]
            if _present(target):  # built by another process while we waited for the lock
                progress(f"reusing {name} built by another process")
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            module = _module_of(name)
            package = dict(module.packages)[name]
            _build_one(go, module, name, package, target, HACK_DIR, progress)
    progress(f"binaries ready in {cache_dir() / 'bin'} ({time.monotonic() - started:.0f} s)")
    return paths
