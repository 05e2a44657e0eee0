"""Building the control plane's binaries: cache keys, reuse, atomic builds, progress, errors.

A fake ``go`` on PATH stands in for the toolchain, so these tests build nothing real.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest

from gpualloc.devcluster import binaries

FAKE_GO = """#!/bin/sh
# fake go: `go build ... -o OUT PKG` writes an executable OUT after $FAKE_GO_SLEEP seconds
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; shift; fi
  shift
done
echo "compiling into $out"
sleep "${FAKE_GO_SLEEP:-0}"
if [ -n "$FAKE_GO_FAIL" ]; then echo "cannot find module providing package" >&2; exit 1; fi
printf '#!/bin/sh\\necho fake\\n' > "$out"
chmod +x "$out"
echo "$out" >> "$FAKE_GO_CALLS"
"""


@pytest.fixture
def fake_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "gobin"
    bin_dir.mkdir()
    go = bin_dir / "go"
    go.write_text(FAKE_GO)
    go.chmod(go.stat().st_mode | stat.S_IEXEC)
    calls = tmp_path / "calls"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GO_CALLS", str(calls))
    monkeypatch.setenv("GPUALLOC_CACHE_DIR", str(tmp_path / "cache"))
    return calls


def test_cache_key_names_the_version_and_changes_with_go_sum(tmp_path: Path) -> None:
    (module,) = [m for m in binaries.MODULES if m.name == "etcd"]
    hack = tmp_path / "hack"
    shutil.copytree(binaries.HACK_DIR / module.directory, hack / module.directory)

    before = binaries.module_key(module, hack)
    (hack / module.directory / "go.sum").write_text("changed\n")
    after = binaries.module_key(module, hack)

    assert before.startswith(f"etcd-{binaries.ETCD_VERSION}-")
    assert before != after


def test_binaries_are_cached_outside_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUALLOC_CACHE_DIR", raising=False)

    paths = binaries.locate()

    assert set(paths) == set(binaries.NAMES)
    for path in paths.values():
        assert path.is_relative_to(Path.home() / ".cache" / "gpualloc" / "bin")
        assert not path.is_relative_to(binaries.REPO_ROOT)


def test_kubernetes_binaries_carry_the_version_in_ldflags() -> None:
    (module,) = [m for m in binaries.MODULES if m.name == "kubernetes"]

    assert "-X k8s.io/component-base/version.gitVersion=v1.36.3" in module.ldflags
    assert {name for name, _ in module.packages} == {
        "kube-apiserver",
        "kube-scheduler",
        "kube-controller-manager",
    }


def _assert_pinned(name: str, packages: dict[str, str], ldflag: str, requirement: str) -> None:
    """Module ``name`` builds ``packages`` (binary -> Go package) with ``ldflag``, and its go.mod
    (with a go.sum) requires ``requirement``."""
    (module,) = [m for m in binaries.MODULES if m.name == name]

    assert dict(module.packages) == packages
    assert ldflag in module.ldflags
    go_mod = (binaries.HACK_DIR / module.directory / "go.mod").read_text()
    assert requirement in go_mod
    assert (binaries.HACK_DIR / module.directory / "go.sum").is_file()
    assert set(packages) <= set(binaries.NAMES)


def test_toxiproxy_server_is_built_from_its_pinned_module_with_its_version() -> None:
    _assert_pinned(
        "toxiproxy",
        {"toxiproxy-server": "github.com/Shopify/toxiproxy/v2/cmd/server"},
        f"-X github.com/Shopify/toxiproxy/v2.Version={binaries.TOXIPROXY_VERSION}",
        f"github.com/Shopify/toxiproxy/v2 {binaries.TOXIPROXY_VERSION}",
    )


def test_ensure_builds_what_is_missing_then_reuses_the_cache(fake_go: Path) -> None:
    lines: list[str] = []

    first = binaries.ensure(["etcd", "kwok"], progress=lines.append)
    built = fake_go.read_text().split()
    second_lines: list[str] = []
    second = binaries.ensure(["etcd", "kwok"], progress=second_lines.append)

    assert first == second
    assert all(os.access(path, os.X_OK) for path in first.values())
    assert len(built) == 2 and all(".tmp-" in path for path in built)  # built under a temporary name
    assert any(line.startswith("built etcd in ") for line in lines)
    assert any(line.startswith("built kwok in ") for line in lines)
    assert fake_go.read_text().split() == built  # nothing built the second time
    assert len(second_lines) == 1 and second_lines[0].startswith("reusing cached binaries")
    assert not list(first["etcd"].parent.glob(".etcd.tmp-*"))


def test_ensure_prints_a_heartbeat_during_a_long_build(
    fake_go: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(binaries, "HEARTBEAT_SECONDS", 0.1)
    monkeypatch.setenv("FAKE_GO_SLEEP", "0.5")
    lines: list[str] = []

    binaries.ensure(["etcd"], progress=lines.append)

    assert any(line.strip().startswith("still building etcd") for line in lines)


def test_failed_build_raises_with_go_output_and_leaves_no_binary(
    fake_go: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_GO_FAIL", "1")

    with pytest.raises(binaries.BuildError, match="cannot find module providing package"):
        binaries.ensure(["etcd"], progress=lambda _: None)

    target = binaries.locate(["etcd"])["etcd"]
    assert not target.exists()
    assert not list(target.parent.glob(".etcd.tmp-*"))


def test_missing_go_toolchain_is_a_build_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUALLOC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(binaries.shutil, "which", lambda _: None)

    with pytest.raises(binaries.BuildError, match="Go toolchain"):
        binaries.ensure(["helm"], progress=lambda _: None)


def test_unknown_binary_name_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown binary"):
        binaries.locate(["kube-proxy"])


def test_vegeta_is_built_from_its_pinned_module_with_its_version() -> None:
    _assert_pinned(
        "vegeta",
        {"vegeta": "github.com/tsenart/vegeta/v12"},
        f"-X main.Version={binaries.VEGETA_VERSION}",
        f"github.com/tsenart/vegeta/v12 {binaries.VEGETA_VERSION}",
    )


def test_the_real_nodes_containerd_is_built_static_without_btrfs_from_its_pinned_module() -> None:
    _assert_pinned(
        "containerd",
        {
            "containerd": "github.com/containerd/containerd/v2/cmd/containerd",
            "containerd-shim-runc-v2": "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
            "ctr": "github.com/containerd/containerd/v2/cmd/ctr",
        },
        f"version.Version={binaries.CONTAINERD_VERSION}",
        f"github.com/containerd/containerd/v2 {binaries.CONTAINERD_VERSION}",
    )
    (module,) = [m for m in binaries.MODULES if m.name == "containerd"]
    assert module.tags == "no_btrfs" and dict(module.env) == {"CGO_ENABLED": "0"}


def test_the_real_nodes_kubelet_and_cni_plugins_are_built_from_their_pinned_modules() -> None:
    _assert_pinned(
        "kubelet",
        {"kubelet": "k8s.io/kubernetes/cmd/kubelet"},
        f"gitVersion={binaries.KUBERNETES_VERSION}",
        f"k8s.io/kubernetes {binaries.KUBERNETES_VERSION}",
    )
    _assert_pinned(
        "cni-plugins",
        {
            "bridge": "github.com/containernetworking/plugins/plugins/main/bridge",
            "host-local": "github.com/containernetworking/plugins/plugins/ipam/host-local",
            "loopback": "github.com/containernetworking/plugins/plugins/main/loopback",
        },
        f"BuildVersion={binaries.CNI_PLUGINS_VERSION}",
        f"github.com/containernetworking/plugins {binaries.CNI_PLUGINS_VERSION}",
    )
    assert set(binaries.NODE_NAMES) <= set(binaries.NAMES)


def test_the_kubelets_module_maps_the_staging_modules_as_the_control_planes_does() -> None:
    def replaces(directory: str) -> list[str]:
        text = (binaries.HACK_DIR / directory / "go.mod").read_text()
        return [line.strip() for line in text.split("replace (", 1)[1].splitlines() if "=>" in line]

    assert replaces("kubelet") == replaces("controlplane")


def test_a_module_without_tags_or_env_keeps_the_cache_key_it_had_before_they_existed() -> None:
    (module,) = [m for m in binaries.MODULES if m.name == "etcd"]
    digest = hashlib.sha256()
    for filename in ("go.mod", "go.sum"):
        digest.update(filename.encode() + b"\0")
        digest.update((binaries.HACK_DIR / module.directory / filename).read_bytes())
    digest.update(repr((module.packages, module.ldflags)).encode())

    assert binaries.module_key(module) == f"etcd-{module.version}-{digest.hexdigest()[:12]}"
