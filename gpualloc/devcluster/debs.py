"""Debian packages the real node needs, fetched and unpacked into the cache (nothing installed).

runc, iptables and busybox-static are not Go modules the project pins: they come from the
machine's Debian archive with ``apt-get download`` and are unpacked with ``dpkg -x`` into
``${GPUALLOC_CACHE_DIR:-~/.cache/gpualloc}/debian/<set>-<hash>/root``, where the hash covers
the package names; ``versions.txt`` beside it records what was fetched. Nothing is written
outside the cache, and no package is installed: the node's programs run them through small
wrappers that point ``LD_LIBRARY_PATH`` (and iptables' ``XTABLES_LIBDIR``) into that root.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from gpualloc.devcluster import binaries

Progress = binaries.Progress


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PackageSet:
    """Packages unpacked together into one root (a program and the libraries it links)."""

    name: str
    packages: tuple[str, ...]


# runc links libseccomp; iptables (xtables-legacy-multi and -nft-multi) its netfilter libraries.
RUNC = PackageSet(name="runc", packages=("runc", "libseccomp2"))
IPTABLES = PackageSet(
    name="iptables",
    packages=(
        "iptables",
        "libip4tc2",
        "libip6tc2",
        "libxtables12",
        "libnetfilter-conntrack3",
        "libnfnetlink0",
        "libnftnl11",
        "libmnl0",
    ),
)
BUSYBOX = PackageSet(name="busybox-static", packages=("busybox-static",))
SETS: tuple[PackageSet, ...] = (RUNC, IPTABLES, BUSYBOX)


class PackageError(RuntimeError):
    """A package could not be fetched or unpacked; the message says what to run instead."""


def root_of(package_set: PackageSet) -> Path:
    """Where the set is (or will be) unpacked; fetches nothing."""
    digest = hashlib.sha256("\0".join(package_set.packages).encode()).hexdigest()[:12]
    return binaries.cache_dir() / "debian" / f"{package_set.name}-{digest}" / "root"


def library_path(root: Path) -> str:
    """``LD_LIBRARY_PATH`` for programs unpacked in ``root`` (multiarch and plain lib dirs)."""
    dirs = [*sorted(root.glob("usr/lib/*-linux-gnu")), *sorted(root.glob("lib/*-linux-gnu"))]
    return ":".join(str(d) for d in dirs if d.is_dir())


def _run(argv: list[str], cwd: Path) -> str:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PackageError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise PackageError(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout


def ensure(package_set: PackageSet, *, progress: Progress = print) -> Path:
    """Fetch and unpack ``package_set`` unless it is cached; return its root."""
    root = root_of(package_set)
    done_marker = root.parent / "versions.txt"
    if done_marker.exists():
        return root
    apt_get, dpkg = shutil.which("apt-get"), shutil.which("dpkg")
    if apt_get is None or dpkg is None:
        raise PackageError(
            f"apt-get and dpkg are needed once to fetch {', '.join(package_set.packages)} into "
            f"{root.parent} (a Debian or Ubuntu machine); none is installed on the system"
        )
    started = time.monotonic()
    with binaries.build_lock(root.parent.parent / ".fetch.lock", progress):
        if done_marker.exists():
            return root
        progress(f"fetching {', '.join(package_set.packages)} (apt-get download, dpkg -x into {root.parent})")
        root.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root.parent) as scratch:
            work = Path(scratch)
            work.chmod(0o755)  # apt drops to the _apt user to download
            try:
                _run([apt_get, "download", "-q", *package_set.packages], work)
            except PackageError as exc:
                raise PackageError(
                    f"{exc}\n(try `apt-get update` first: they come from the machine's Debian archive)"
                ) from exc
            unpacked = work / "root"
            versions: list[str] = []
            for deb in sorted(work.glob("*.deb")):
                _run([dpkg, "-x", str(deb), str(unpacked)], work)
                versions.append(deb.name)
            if root.exists():
                shutil.rmtree(root)
            unpacked.rename(root)
            done_marker.write_text("\n".join(versions) + "\n")
    progress(f"fetched {package_set.name} in {time.monotonic() - started:.0f} s: {', '.join(versions)}")
    return root
