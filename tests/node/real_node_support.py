"""What a real node could leave on the machine, observed from outside the node's own code.

``snapshot()`` reads the machine as it is: network interfaces, mount points, iptables rules and
chains (through the same Debian iptables the node uses, legacy tables), network namespaces
(named, and those any process is in), kernel settings under /proc/sys (the ones that move on
their own left out), the host paths a kubelet or containerd writes, cgroups, and processes
running a node program. ``differences(before, after)`` lists what changed.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from gpualloc.devcluster import cdi, cluster, node, pki

# Under /proc/sys: counters, random values and clocks that change whatever the node does.
_VOLATILE_SETTINGS = (
    "kernel.random.",
    "kernel.ns_last_pid",
    "kernel.pty.nr",
    "kernel.tainted",
    "kernel.sched_domain",
    "kernel.perf_event_max_sample_rate",
    "kernel.keys.maxkeys",
    "kernel.keys.maxbytes",
    "fs.",
    "net.core.netdev_rss_key",
    "vm.stat_refresh",
    "vm.drop_caches",
    "vm.compact_memory",
    "net.ipv4.route.flush",
    "net.ipv6.route.flush",
    "net.ipv4.tcp_fastopen_key",
    "net.netfilter.nf_conntrack_count",
    "net.netfilter.nf_conntrack_buckets",
    "net.netfilter.nf_conntrack_max",
    "net.nf_conntrack_max",
)
_SETTING_TREES = (
    "vm",
    "kernel",
    "net/ipv4",
    "net/ipv6/conf/all",
    "net/ipv6/conf/default",
    "net/bridge",
    "net/core",
)
_HOST_PATHS = (
    *node.HOST_PATHS,
    "/etc/cdi",
    "/var/run/cdi",
    "/run/xtables.lock",
    "/usr/libexec/kubernetes",
)
_NODE_PROGRAMS = frozenset({"kubelet", "containerd", "containerd-shim-runc-v2", "runc", "pause", "ctr"})


def _settings() -> dict[str, str]:
    values: dict[str, str] = {}
    for tree in _SETTING_TREES:
        root = Path("/proc/sys") / tree
        if not root.is_dir():
            continue
        for directory, dirs, files in os.walk(root):
            relative = Path(directory).relative_to("/proc/sys")
            # per-interface settings come and go with the interfaces, which are compared on their own
            dirs[:] = [d for d in dirs if str(relative / d).count("/") < 3 or d in ("all", "default")]
            if str(relative).startswith(("net/ipv4/conf/", "net/ipv4/neigh/")) and relative.name not in (
                "all",
                "default",
            ):
                continue
            for name in files:
                key = str(relative / name).replace("/", ".")
                if key.startswith(_VOLATILE_SETTINGS):
                    continue
                try:
                    values[key] = (Path(directory) / name).read_text().strip()
                except OSError:
                    continue
    return values


def _iptables(programs: node.Programs) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for family in ("iptables-save", "ip6tables-save"):
        argv = node.iptables_argv(programs, family)
        text = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rules = [line for line in text.splitlines() if line.startswith("-A ")]
        chains = [line.split()[0] for line in text.splitlines() if line.startswith(":") and " - " in line]
        out[family] = {"rules": sorted(rules), "chains": sorted(chains)}
    return out


def _processes() -> Iterator[tuple[int, str, str]]:
    """(pid, program name, network namespace) of every process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
            netns = os.readlink(entry / "ns" / "net")
        except OSError:
            continue
        yield int(entry.name), Path(argv0).name, netns


def node_memory_mib() -> dict[str, float]:
    """Resident memory of the node's programs now, per program name (shims summed)."""
    totals: dict[str, float] = {}
    for pid, name, _ in _processes():
        if name not in _NODE_PROGRAMS:
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                totals[name] = round(totals.get(name, 0.0) + int(line.split()[1]) / 1024, 1)
    return totals


def _cgroups() -> list[str]:
    found: list[str] = []
    root = Path("/sys/fs/cgroup")
    for controller in sorted(root.iterdir()):
        if not controller.is_dir() or controller.is_symlink():
            continue
        for directory, dirs, _ in os.walk(controller):
            depth = Path(directory).relative_to(controller).parts
            if len(depth) >= 2:
                dirs[:] = []
            found.extend(str(Path(directory) / d) for d in dirs)
    return sorted(found)


def _path_listing(path: str) -> Any:
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        return None
    if target.is_dir():
        return sorted(os.listdir(target))
    return "file"


def snapshot(programs: node.Programs) -> dict[str, Any]:
    """The parts of the machine a real node touches, as they are now."""
    processes = list(_processes())
    return {
        "interfaces": sorted(os.listdir("/sys/class/net")),
        "mounts": sorted(node.mount_points()),
        "iptables": _iptables(programs),
        "named netns": _path_listing("/run/netns"),
        "netns of processes": sorted({netns for _, _, netns in processes}),
        "settings": _settings(),
        "host paths": {path: _path_listing(path) for path in _HOST_PATHS},
        "cdi spec": Path(cdi.SPEC_DIR, cdi.SPEC_NAME).exists(),
        "cgroups": _cgroups(),
        "node programs running": sorted(
            f"{name}[{pid}]" for pid, name, _ in processes if name in _NODE_PROGRAMS
        ),
    }


# Other programs on the machine start and end processes (and their cgroups) meanwhile: only what
# appeared there is the node's.
_ONLY_ADDED = frozenset({"netns of processes", "node programs running", "cgroups"})


def differences(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """One line per aspect that changed, saying what appeared and what went."""
    lines: list[str] = []
    for key in before:
        old, new = before[key], after.get(key)
        if old == new:
            continue
        if key in _ONLY_ADDED:
            added = sorted(set(new or []) - set(old))
            if added:
                lines.append(f"{key}: added {added}")
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            changed = {
                k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
            }
            lines.append(f"{key}: {changed}")
        elif isinstance(old, list) and isinstance(new, list):
            lines.append(f"{key}: added {sorted(set(new) - set(old))}, removed {sorted(set(old) - set(new))}")
        else:
            lines.append(f"{key}: {old!r} -> {new!r}")
    return lines


def request(
    state_dir: Path, method: str, path: str, body: Any = None, *, accept: str = "application/json"
) -> Any:
    """One call, as the admin, to the API server a `gpualloc dev up` in ``state_dir`` runs."""
    server = urllib.parse.urlsplit(str(cluster.load_state(state_dir)["server"]))
    files = pki.Pki(directory=state_dir / "pki")
    context = ssl.create_default_context(cafile=str(files.ca_cert))
    context.load_cert_chain(str(files.admin_cert), str(files.admin_key))
    connection = http.client.HTTPSConnection(server.hostname or "", server.port, context=context, timeout=30)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": accept, **({"Content-Type": "application/json"} if data else {})}
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    if response.status >= 400:
        raise AssertionError(f"{method} {path}: HTTP {response.status}: {raw[:300]!r}")
    return json.loads(raw) if accept == "application/json" else raw.decode()
