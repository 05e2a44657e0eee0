"""A real node beside the local control plane: containerd and a kubelet named ``gpualloc-node-0``.

``RealNode.start()`` brings it up in ``<state-dir>/node``: a veth pair whose first end carries
the node's address (``198.18.0.1``, in 198.18.0.0/15, the range set aside for benchmarks and
never routed off a machine), containerd with the CNI bridge (``gpualloc-br0``, pods on
``198.18.128.0/24``), the node's images imported without a registry (its own pause program,
and ``gpualloc/toolbox:dev`` from Debian's busybox-static), then the kubelet, and waits until
the Node is Ready (lifting the not-ready taint, as the node-lifecycle controller this cluster
runs without would). With a GPU profile it also runs the simulated agent for the node and
exposes its GPUs as CDI devices (``gpualloc.devcluster.cdi``). With ``external_agent`` it runs
no agent: the node is labelled ``nvidia.com/gpu.present=true`` and keeps a device directory for
an agent run elsewhere (the chart's DaemonSet), its ``nvidia<minor>`` files following the GPUs
the node's GpuNodeStatus lists (``follow_published_gpus``).

What the probe on this kind of machine found, and what is done about it:

- runc cannot lower ``oom_score_adj`` without CAP_SYS_RESOURCE: containerd runs with
  ``restrict_oom_score_adj``.
- The kubelet refuses a loopback node IP: the node's address sits on the run's own veth.
- ``kubectl logs``/``exec`` reach the kubelet by its InternalIP (the control plane is started
  with ``real_node=True``: ``--kubelet-preferred-address-types`` and a kubelet client cert).
- No kube-proxy: pods reach the API server at the ``kubernetes`` Service (10.96.0.1:443)
  through one NAT rule (chain ``GPUALLOC-SERVICES``, from OUTPUT and PREROUTING) to its
  loopback port; the bridge is made up front with ``route_localnet=1`` so that works.
- cgroup v1: ``failCgroupV1: false``, ``cgroupDriver: cgroupfs``, ``cgroupsPerQOS: false``,
  ``enforceNodeAllocatable: []``.

``stop()`` (and ``teardown()``, which ``gpualloc dev down`` calls for a run that was killed)
undoes everything the node did to the machine, from what ``node.json`` recorded before it
started: containers killed and removed, kubelet and containerd stopped, every mount they
made unmounted, the interfaces and iptables rules and chains that were not there before
removed, the kernel settings the kubelet and the CNI bridge change restored to their old
values, and the host paths they create (``/run/containerd``, ``/var/lib/kubelet``,
``/var/lib/cni``, ``/var/log/pods`` ...) removed, or emptied of what was added.

One real node runs per machine at a time (``LOCK``, one file for the whole machine, whoever's
home the binaries are cached in): it uses fixed host paths, the node address and the kubelet's
port 10250.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import functools
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from gpualloc import certificates
from gpualloc.api import constants, leases
from gpualloc.devcluster import binaries, cdi, cluster, debs, images, pki

Progress = Callable[[str], None]

NODE_NAME = "gpualloc-node-0"
NODE_INTERFACE = "gpualloc0"
NODE_PEER = "gpualloc0p"
NODE_IP = "198.18.0.1"
NODE_PREFIX = 30
BRIDGE = "gpualloc-br0"
POD_SUBNET = "198.18.128.0/24"
KUBELET_PORT = 10250
SERVICE_CHAIN = "GPUALLOC-SERVICES"
AGENT_NAMESPACE = "gpualloc-system"
# As NVIDIA GPU feature discovery labels a GPU node; the chart's agent selects it.
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
STATE_FILE = "node.json"
UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path, 108 with its NUL)

# The kernel settings the kubelet (vm.*, kernel.*) and the CNI bridge (ip_forward) change.
KERNEL_SETTINGS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.forwarding",
    "net.ipv4.conf.default.forwarding",
    "net.ipv6.conf.all.forwarding",
    "net.ipv6.conf.default.forwarding",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
)

# The machine's one real node: a lock under /run/lock, not in a home's cache, so that runs with
# other homes (a cold-cache CI beside a warm one) wait for each other too.
LOCK = "/run/lock/gpualloc-real-node.lock"
# Host paths containerd, the CNI plugins and the kubelet write whatever they are told.
HOST_PATHS = (
    "/run/containerd",
    "/run/netns",
    "/run/nri",
    "/run/cdi",
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/var/lib/containerd",
    "/var/log/pods",
    "/var/log/containers",
    "/opt/containerd",
    "/opt/cni",
    "/etc/cni",
    "/etc/containerd",
    "/run/xtables.lock",
)

# The kubelet's device-plugin socket, whatever its --root-dir: another kubelet's if it is there.
KUBELET_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
# Chains the node's programs make (kubelet: KUBE-*, CNI plugins: CNI-*, the Service rule): teardown
# touches no other, whatever else changes on the machine meanwhile.
OWN_CHAIN_PREFIXES = ("KUBE-", "CNI-", "GPUALLOC-")

IPTABLES_COMMANDS = ("iptables", "iptables-save", "iptables-restore")
IP6TABLES_COMMANDS = ("ip6tables", "ip6tables-save", "ip6tables-restore")


class NodeError(RuntimeError):
    """The node could not be started, or one of its programs died."""


def unable_reason() -> str | None:
    """Why this machine cannot run a real node (None: it can): root, Linux, overlayfs, cgroups."""
    if sys.platform != "linux":
        return f"a real node needs Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "a real node needs root (containerd, runc, network interfaces, mounts)"
    try:
        filesystems = Path("/proc/filesystems").read_text()
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc}"
    if "\toverlay\n" not in filesystems and not filesystems.rstrip().endswith("\toverlay"):
        return "the kernel has no overlay filesystem (containerd's overlayfs snapshotter needs it)"
    if not Path("/sys/fs/cgroup").is_dir():
        return "no /sys/fs/cgroup"
    for tool in ("ip", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Programs:
    """Where the node's programs are: the built Go binaries and the unpacked Debian packages."""

    binaries: Mapping[str, Path]
    runc_root: Path
    iptables_root: Path
    busybox_root: Path


def ensure_programs(progress: Progress = print) -> Programs:
    """Build the node's Go binaries and fetch its Debian packages unless cached."""
    paths = binaries.ensure(binaries.NODE_NAMES, progress=progress)
    return Programs(
        binaries=paths,
        runc_root=debs.ensure(debs.RUNC, progress=progress),
        iptables_root=debs.ensure(debs.IPTABLES, progress=progress),
        busybox_root=debs.ensure(debs.BUSYBOX, progress=progress),
    )


# ------------------------------------------------------------------ host facts


def iptables_argv(programs: Programs, command: str) -> list[str]:
    """argv running ``command`` (iptables, ip6tables-save ...) of the unpacked Debian iptables, on
    the legacy (x_tables) backend, whose built-in tables a run cannot leave behind."""
    root = programs.iptables_root
    lib = debs.library_path(root)
    xtables = next((d for d in lib.split(":") if Path(d, "xtables").is_dir()), lib.split(":")[0])
    return [
        "env",
        f"LD_LIBRARY_PATH={lib}",
        f"XTABLES_LIBDIR={xtables}/xtables",
        str(root / "usr" / "sbin" / "xtables-legacy-multi"),
        command,
    ]


def _run(argv: Sequence[str], *, check: bool = True, env: Mapping[str, str] | None = None) -> str:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False, env=env, timeout=120)
    if check and done.returncode != 0:
        raise NodeError(f"{shlex.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
    return done.stdout


def _setting_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def read_settings(keys: Sequence[str] = KERNEL_SETTINGS) -> dict[str, str]:
    """key -> value of each kernel setting that exists here."""
    values: dict[str, str] = {}
    for key in keys:
        with contextlib.suppress(OSError):
            values[key] = _setting_path(key).read_text().strip()
    return values


def mount_points() -> list[str]:
    """Every mount point in this mount namespace, in /proc/self/mountinfo's order."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            points.append(fields[4].encode().decode("unicode_escape"))
    return points


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def interfaces() -> list[str]:
    """Names of the network interfaces in this network namespace."""
    return sorted(os.listdir("/sys/class/net"))


def _path_record(path: str) -> Any:
    """None if absent, the sorted entries of a directory, else "file"."""
    target = Path(path)
    if not target.exists() and not target.is_symlink():
        return None
    if target.is_dir() and not target.is_symlink():
        return sorted(os.listdir(target))
    return "file"


def iptables_rules(save: Sequence[str]) -> dict[str, dict[str, list[str]]]:
    """table -> {"chains": [user-defined chains], "rules": ["-A ..." lines]} from an iptables-save run."""
    tables: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in _run(save).splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:], {"chains": [], "rules": []})
        elif current is None:
            continue
        elif line.startswith(":"):
            name, policy = line[1:].split(" ", 2)[:2]
            if policy == "-":
                current["chains"].append(name)
        elif line.startswith("-A "):
            current["rules"].append(line)
    return tables


# ------------------------------------------------------------------ the node


class RealNode:
    """containerd + kubelet registered with ``plane`` as ``gpualloc-node-0``."""

    def __init__(
        self,
        plane: cluster.ControlPlane,
        programs: Programs,
        *,
        progress: Progress | None = None,
        gpu_profile: str | None = None,
        external_agent: bool = False,
        ready_timeout: float = 120.0,
    ) -> None:
        if not plane.real_node:
            raise NodeError("the control plane must be started with real_node=True")
        if external_agent and gpu_profile:
            raise NodeError("a node whose agent runs elsewhere has no GPU profile of its own")
        self.plane = plane
        self.programs = programs
        self.dir = plane.state_dir / "node"
        self.gpu_profile = gpu_profile
        self.external_agent = external_agent
        self.gpus: list[cdi.Gpu] = []
        self.timings: dict[str, float] = {}
        self._progress: Progress = progress or (lambda message: None)
        self._ready_timeout = ready_timeout
        self._processes: dict[str, cluster.Process] = {}
        self._lock_file: IO[str] | None = None

    # paths
    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def address(self) -> Path:
        return self.dir / "containerd" / "containerd.sock"

    @property
    def device_dir(self) -> Path:
        return self.dir / "dev"

    @property
    def cdi_spec(self) -> Path:
        return Path(cdi.SPEC_DIR) / cdi.SPEC_NAME

    @property
    def kubelet_log(self) -> Path:
        return self.plane.logs_dir / "kubelet.log"

    def __enter__(self) -> RealNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bring the node up and wait until its Node is Ready (and its GPUs published)."""
        reason = unable_reason()
        if reason is not None:
            raise NodeError(reason)
        started = time.monotonic()
        self._acquire_lock()
        try:
            teardown(self.dir, progress=self._progress)  # whatever a killed run left
            if KUBELET_SOCKET.exists():
                raise NodeError(f"another kubelet runs on this machine ({KUBELET_SOCKET} exists)")
            self.dir.mkdir(parents=True, exist_ok=True)
            self._record()
            self._make_network()
            self._add_service_rule()
            self._start_containerd()
            self._import_images()
            self._start_kubelet()
            self.timings["node_ready_s"] = time.monotonic() - started
            self._progress(f"node {NODE_NAME} Ready in {self.timings['node_ready_s']:.1f} s")
            if self.gpu_profile:
                self._start_agent()
            elif self.external_agent:
                self.make_device_files([])  # nvidiactl, which the agent's spec names if present
        except BaseException:
            self.stop()
            raise

    def stop(self) -> list[str]:
        """Stop everything and undo what the node changed on the machine; what is still left
        (empty when the machine is as it was)."""
        try:
            for name in ("agent", "kubelet"):
                process = self._processes.pop(name, None)
                if process is not None:
                    process.stop(10.0)
            self._save()
            left = teardown(self.dir, progress=self._progress)
            for process in self._processes.values():
                process.stop(1.0)  # already stopped by teardown; reaps it
            self._processes.clear()
            return left
        finally:
            self._release_lock()

    def check_alive(self) -> None:
        """Raise NodeError if containerd, the kubelet or the agent has exited."""
        for process in self._processes.values():
            if not process.running():
                raise NodeError(str(process.failure("exited")))

    # ------------------------------------------------------------- pieces

    def _acquire_lock(self, timeout: float = 180.0) -> None:
        """The machine's one real node: wait for another run's to stop (``timeout`` s at most); then
        undo whatever the last holder left, if it was killed before it could."""
        path = Path(LOCK)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = path.open("a+")
        deadline = time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                if time.monotonic() > deadline:
                    handle.close()
                    raise NodeError(
                        f"another real node still runs on this machine after {timeout:.0f} s ({holder}); "
                        "one at a time (`gpualloc dev down --state-dir ...` stops it)"
                    ) from None
                if not told:
                    self._progress(f"waiting for the real node of another run to stop ({holder})")
                    told = True
                time.sleep(0.5)
        handle.seek(0)
        previous = handle.read().strip()
        if previous.startswith("{"):
            with contextlib.suppress(ValueError, TypeError, KeyError):
                last_dir = Path(json.loads(previous)["node_dir"])
                if last_dir != self.dir and load_state(last_dir):
                    self._progress(f"undoing what the real node of a killed run left ({last_dir})")
                    teardown(last_dir, progress=self._progress)
        handle.seek(0)
        handle.truncate(0)
        handle.write(json.dumps({"pid": os.getpid(), "node_dir": str(self.dir)}) + "\n")
        handle.flush()
        self._lock_file = handle

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def _record(self) -> None:
        """What the machine looks like before the node touches it, for teardown."""
        record = {
            "owner": os.getpid(),
            "settings": read_settings(),
            "host_paths": {path: _path_record(path) for path in HOST_PATHS},
            "interfaces": interfaces(),
            "mounts": mount_points(),
            "cdi_spec": str(self.cdi_spec),
            "cdi_spec_existed": self.cdi_spec.exists(),
            "cdi_spec_text": _read_or_none(self.cdi_spec),  # put back at teardown
            "bin_dir": str(self.bin_dir),
            "address": str(self.address),
            "ctr": str(self.programs.binaries["ctr"]),
            "shim": str(self.programs.binaries["containerd-shim-runc-v2"]),
            "created_interfaces": [NODE_INTERFACE, BRIDGE],
            "processes": {},
        }
        self._write_state(record)
        self._write_wrappers()
        record["iptables"] = {
            "iptables": iptables_rules([str(self.bin_dir / "iptables-save")]),
            "ip6tables": iptables_rules([str(self.bin_dir / "ip6tables-save")]),
        }
        self._write_state(record)

    def _write_state(self, record: Mapping[str, Any]) -> None:
        path = self.dir / STATE_FILE
        temporary = path.with_name(STATE_FILE + ".tmp")
        temporary.write_text(json.dumps(record, indent=2) + "\n")
        temporary.replace(path)

    def _save(self) -> None:
        record = load_state(self.dir)
        if not record:
            return
        record["processes"] = {
            name: {"pid": process.pid, "executable": process.argv[0]}
            for name, process in self._processes.items()
            if process.pid is not None
        }
        self._write_state(record)

    def _write_wrappers(self) -> None:
        """bin/: runc and iptables from the unpacked Debian packages, the shim on containerd's PATH."""
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        runc = self.programs.runc_root
        lock = f"XTABLES_LOCKFILE={self.dir / 'xtables.lock'}"
        runc_argv = ["env", f"LD_LIBRARY_PATH={debs.library_path(runc)}", str(runc / "usr" / "sbin" / "runc")]
        scripts = {"runc": f'exec {shlex.join(runc_argv)} "$@"'}
        for command in (*IPTABLES_COMMANDS, *IP6TABLES_COMMANDS):
            env, *argv = iptables_argv(self.programs, command)
            scripts[command] = f'exec {shlex.join([env, lock, *argv])} "$@"'
        for name, line in scripts.items():
            path = self.bin_dir / name
            path.write_text(f"#!/bin/sh\n{line}\n")
            path.chmod(0o755)
        shim = self.bin_dir / "containerd-shim-runc-v2"
        if shim.is_symlink() or shim.exists():
            shim.unlink()
        shim.symlink_to(self.programs.binaries["containerd-shim-runc-v2"])

    def _env(self) -> dict[str, str]:
        path = os.environ.get("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        return {
            **os.environ,
            "PATH": f"{self.bin_dir}:{path}",
            "XTABLES_LOCKFILE": str(self.dir / "xtables.lock"),
        }

    def _make_network(self) -> None:
        """The node's address on a veth of its own; the CNI bridge made up front with route_localnet."""
        _run(["ip", "link", "add", NODE_INTERFACE, "type", "veth", "peer", "name", NODE_PEER])
        _run(["ip", "addr", "add", f"{NODE_IP}/{NODE_PREFIX}", "dev", NODE_INTERFACE])
        _run(["ip", "link", "set", NODE_PEER, "up"])
        _run(["ip", "link", "set", NODE_INTERFACE, "up"])
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "link", "set", BRIDGE, "up"])
        # Pods' packets to 10.96.0.1:443 are DNATed to 127.0.0.1, which the kernel routes only with this.
        _setting_path(f"net.ipv4.conf.{BRIDGE}.route_localnet").write_text("1\n")

    def _add_service_rule(self) -> None:
        """The ``kubernetes`` Service without kube-proxy: 10.96.0.1:443 -> the API server's port."""
        iptables = str(self.bin_dir / "iptables")
        port = self.plane.ports["apiserver"]
        _run([iptables, "-w", "-t", "nat", "-N", SERVICE_CHAIN])
        rule = f"-d {pki.SERVICE_CLUSTER_IP}/32 -p tcp --dport 443 -j DNAT --to-destination 127.0.0.1:{port}"
        _run([iptables, "-w", "-t", "nat", "-A", SERVICE_CHAIN, *rule.split()])
        for chain in ("OUTPUT", "PREROUTING"):
            _run([iptables, "-w", "-t", "nat", "-I", chain, "1", "-j", SERVICE_CHAIN])

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> cluster.Process:
        process = cluster.Process(name, argv, self.plane.logs_dir / f"{name}.log", env)
        process.start()
        self._processes[name] = process
        self._save()
        return process

    def _wait(self, process: cluster.Process, probe: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            if not process.running():
                raise NodeError(str(process.failure("exited at start")))
            if time.monotonic() > deadline:
                raise NodeError(str(process.failure(f"{what} after {timeout:.0f} s")))
            time.sleep(0.1)

    # containerd

    def _ctr(self, *args: str, check: bool = True) -> str:
        argv = [str(self.programs.binaries["ctr"]), "--address", str(self.address), "--namespace", "k8s.io"]
        return _run([*argv, *args], check=check)

    def _containerd_config(self) -> str:
        base = self.dir / "containerd"
        cni_bin = self.programs.binaries["bridge"].parent
        disabled = [
            "io.containerd.nri.v1.nri",
            "io.containerd.snapshotter.v1.blockfile",
            "io.containerd.snapshotter.v1.btrfs",
            "io.containerd.snapshotter.v1.devmapper",
            "io.containerd.snapshotter.v1.erofs",
            "io.containerd.snapshotter.v1.zfs",
            "io.containerd.image-verifier.v1.bindir",
        ]

        def q(value: object) -> str:
            return json.dumps(str(value))

        return "\n".join(
            [
                "version = 4",
                f"root = {q(base / 'root')}",
                f"state = {q(base / 'state')}",
                f"temp = {q(base / 'tmp')}",
                "imports = []",
                f"disabled_plugins = {json.dumps(disabled)}",
                "",
                "[plugins.'io.containerd.server.v1.grpc']",
                f"  address = {q(self.address)}",
                "[plugins.'io.containerd.server.v1.ttrpc']",
                f"  address = {q(str(self.address) + '.ttrpc')}",
                "[plugins.'io.containerd.server.v1.debug']",
                "  address = ''",
                "[plugins.'io.containerd.internal.v1.opt']",
                f"  path = {q(base / 'opt')}",
                "[plugins.'io.containerd.cri.v1.images']",
                "  snapshotter = 'overlayfs'",
                "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
                f"  sandbox = {q(images.full_name(images.PAUSE_IMAGE))}",
                "[plugins.'io.containerd.cri.v1.runtime']",
                "  restrict_oom_score_adj = true",  # runc cannot lower it without CAP_SYS_RESOURCE
                "  netns_mounts_under_state_dir = true",
                "  disable_apparmor = true",
                f"  cdi_spec_dirs = [{q(cdi.SPEC_DIR)}]",
                "[plugins.'io.containerd.cri.v1.runtime'.containerd]",
                "  default_runtime_name = 'runc'",
                "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]",
                "  runtime_type = 'io.containerd.runc.v2'",
                "[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]",
                f"  BinaryName = {q(self.bin_dir / 'runc')}",
                "  SystemdCgroup = false",
                "[plugins.'io.containerd.cri.v1.runtime'.cni]",
                f"  bin_dirs = [{q(cni_bin)}]",
                f"  conf_dir = {q(self.dir / 'cni' / 'net.d')}",
                "  max_conf_num = 1",
                "[plugins.'io.containerd.grpc.v1.cri']",
                "  stream_server_address = '127.0.0.1'",
                "",
            ]
        )

    def _cni_config(self) -> dict[str, Any]:
        return {
            "cniVersion": "1.0.0",
            "name": "gpualloc",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,  # nothing leaves the machine
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.dir / "cni" / "ipam"),
                    },
                },
                {"type": "loopback"},
            ],
        }

    def _start_containerd(self) -> None:
        started = time.monotonic()
        # containerd's CDI cache watches its spec directory from its start when it exists; made
        # here, not by the first pod's hostPath, and removed at teardown (/run/cdi is recorded).
        Path(cdi.SPEC_DIR).mkdir(parents=True, exist_ok=True)
        config = self.dir / "containerd" / "config.toml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(self._containerd_config())
        net_d = self.dir / "cni" / "net.d"
        net_d.mkdir(parents=True, exist_ok=True)
        (net_d / "10-gpualloc.conflist").write_text(json.dumps(self._cni_config(), indent=2) + "\n")
        argv = [str(self.programs.binaries["containerd"]), "--config", str(config), "--log-level", "warn"]
        process = self._spawn("containerd", argv, self._env())

        def serving() -> bool:
            if not self.address.exists():
                return False
            done = subprocess.run(
                [str(self.programs.binaries["ctr"]), "--address", str(self.address), "version"],
                capture_output=True,
                check=False,
                timeout=30,
            )
            return done.returncode == 0

        self._wait(process, serving, "not serving", 60.0)
        self.timings["containerd_s"] = time.monotonic() - started

    def _import_images(self) -> None:
        started = time.monotonic()
        busybox = self.programs.busybox_root / "bin" / "busybox"
        applets = _run([str(busybox), "--list-full"]).split()
        archives = {
            "pause": images.build_archive(images.pause_image(self.programs.binaries["pause"].read_bytes())),
            "toolbox": images.build_archive(images.toolbox_image(busybox.read_bytes(), applets)),
        }
        directory = self.dir / "images"
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in archives.items():
            path = directory / f"{name}.oci.tar"
            path.write_bytes(data)
            self._ctr("images", "import", "--local", "--platform", "linux/amd64", str(path))
        # The kubelet's image GC never removes a pinned image.
        self._ctr("images", "label", images.full_name(images.PAUSE_IMAGE), "io.cri-containerd.pinned=pinned")
        self.timings["images_s"] = time.monotonic() - started
        self._progress(
            f"imported {images.PAUSE_IMAGE} and {images.TOOLBOX_IMAGE} in {self.timings['images_s']:.1f} s"
        )

    # kubelet

    def _kubelet_pki(self) -> tuple[Path, Path, Path]:
        """The kubelet's client kubeconfig (system:node:<name>) and its serving certificate and key."""
        directory = self.dir / "pki"
        directory.mkdir(parents=True, exist_ok=True)
        ca, ca_key = pki.load_ca(self.plane.pki)
        now = datetime.datetime.now(datetime.UTC)
        client, client_key = pki.issue_leaf(
            ca,
            ca_key,
            common_name=f"system:node:{NODE_NAME}",
            organization="system:nodes",
            server=False,
            now=now,
        )
        serving, serving_key = pki.issue_leaf(
            ca, ca_key, common_name=NODE_NAME, dns_names=(NODE_NAME,), ips=(NODE_IP,), server=True, now=now
        )
        files = {
            "kubelet-client.crt": certificates.cert_pem(client),
            "kubelet-client.key": certificates.key_pem(client_key),
            "kubelet.crt": certificates.cert_pem(serving),
            "kubelet.key": certificates.key_pem(serving_key),
        }
        for name, data in files.items():
            (directory / name).write_bytes(data)
            (directory / name).chmod(0o600)
        kubeconfig = self.dir / "kubelet.kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "local",
                            "cluster": {
                                "server": self.plane.server,
                                "certificate-authority": str(self.plane.pki.ca_cert),
                            },
                        }
                    ],
                    "users": [
                        {
                            "name": NODE_NAME,
                            "user": {
                                "client-certificate": str(directory / "kubelet-client.crt"),
                                "client-key": str(directory / "kubelet-client.key"),
                            },
                        }
                    ],
                    "contexts": [{"name": "local", "context": {"cluster": "local", "user": NODE_NAME}}],
                    "current-context": "local",
                },
                indent=2,
            )
        )
        return kubeconfig, directory / "kubelet.crt", directory / "kubelet.key"

    def _kubelet_config(self, cert: Path, key: Path, healthz_port: int) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz_port,
            "tlsCertFile": str(cert),
            "tlsPrivateKeyFile": str(key),
            # Only client certificates of the cluster's CA (the API server's is the admin's).
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.plane.pki.ca_cert)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.address}",
            # cgroup v1 (this kind of machine): allowed, with no QoS or node-allocatable cgroups.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "podLogsDir": str(self.dir / "pod-logs"),
            "volumePluginDir": str(self.dir / "volume-plugins"),
            "resolvConf": "/etc/resolv.conf",
            "serializeImagePulls": False,
            # Imported images cannot be pulled again: never collect them.
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "registerNode": True,
            "nodeStatusUpdateFrequency": "5s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "logging": {"format": "text"},
        }

    def _start_kubelet(self) -> None:
        started = time.monotonic()
        kubeconfig, cert, key = self._kubelet_pki()
        healthz_port = cluster.free_port()
        config = self.dir / "kubelet-config.json"
        config.write_text(json.dumps(self._kubelet_config(cert, key, healthz_port), indent=2) + "\n")
        root = self.dir / "kubelet"
        root.mkdir(parents=True, exist_ok=True)
        argv = [
            str(self.programs.binaries["kubelet"]),
            f"--config={config}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={root}",
            f"--cert-dir={self.dir / 'pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--node-labels={','.join(self._labels())}",
            "--v=1",
        ]
        self._spawn("kubelet", argv, self._env())
        self.plane.wait_node_ready(
            NODE_NAME,
            timeout=self._ready_timeout,
            hint=f"see {self.kubelet_log}",
            alive=self._alive_or_raise,
        )
        self.timings["kubelet_ready_s"] = time.monotonic() - started

    def _labels(self) -> list[str]:
        labels = ["gpualloc.dev/real-node=true"]
        if self.external_agent:
            labels.append(f"{GPU_PRESENT_LABEL}=true")
        return labels

    def _alive_or_raise(self) -> None:
        self.check_alive()
        self.plane.check_alive()

    # GPUs

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    @property
    def agent_log(self) -> Path:
        return self.plane.logs_dir / "agent.log"

    def _start_agent(self) -> None:
        """The simulated agent of this node, as the kubelet's DRA plugin of ``gpu.gpualloc.dev``.

        It writes the node's CDI spec (``--cdi-dir``, the default ``/var/run/cdi``) naming the
        device files in ``device_dir``: ``nvidiactl`` is made before it starts (the spec names the
        control devices it finds), each GPU's ``nvidia<minor>`` once it has published them. Ready
        when the GpuNodeStatus is published, the spec written and the kubelet has registered it.
        """
        assert self.gpu_profile is not None
        longest = self.kubelet_root / "plugins" / constants.DRA_DRIVER / "dra.sock"
        if len(str(longest).encode()) > UNIX_PATH_MAX:
            raise NodeError(
                f"the state directory's path is too long for the DRA plugin's socket ({longest}: "
                f"{len(str(longest).encode())} bytes, a unix socket path has {UNIX_PATH_MAX} at most)"
            )
        for namespace in (AGENT_NAMESPACE, leases.heartbeat_namespace(AGENT_NAMESPACE)):
            with contextlib.suppress(cluster.RequestError):
                self.plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        self.make_device_files([])
        metrics, health = cluster.free_ports(2)
        argv = [sys.executable, "-m", "gpualloc.cli", "agent", "--source", "simulated"]
        argv += ["--profile", self.gpu_profile, "--node-name", NODE_NAME, "--log-format", "text"]
        argv += ["--kubeconfig", str(self.plane.kubeconfig), "--lease-namespace", AGENT_NAMESPACE]
        argv += ["--metrics-port", str(metrics), "--health-port", str(health)]
        argv += ["--kubelet-plugin", "--kubelet-root", str(self.kubelet_root)]
        argv += ["--device-dir", str(self.device_dir), "--cdi-dir", str(self.cdi_spec.parent)]
        started = time.monotonic()
        process = self._spawn("agent", argv)
        path = f"/apis/gpu.scheduling/v1/gpunodestatuses/{NODE_NAME}"
        found: list[dict[str, Any]] = []

        def published() -> bool:
            try:
                status = self.plane.request("GET", path)
            except cluster.RequestError as exc:
                if exc.status == 404:
                    return False
                raise
            devices = (status.get("status") or {}).get("devices") or []
            found[:] = devices
            return bool(devices)

        self._wait(process, published, "published no GpuNodeStatus", 60.0)
        self.gpus = [cdi.Gpu(minor=int(d["minor"]), uuid=str(d["uuid"])) for d in found]
        self.make_device_files(self.gpus)

        def registered() -> bool:
            log = self.agent_log.read_text(errors="replace") if self.agent_log.exists() else ""
            return self.cdi_spec.exists() and "registered with the kubelet" in log

        self._wait(process, registered, "was not registered as the kubelet's DRA plugin", 60.0)
        self.make_device_files(self.gpus)  # and the MIG caps the spec names
        self.timings["agent_registered_s"] = time.monotonic() - started
        self._progress(
            f"{len(self.gpus)} simulated GPUs ({self.gpu_profile}) as CDI devices in {self.cdi_spec}; "
            f"the agent is the kubelet's DRA plugin of {constants.DRA_DRIVER}"
        )

    def follow_published_gpus(self) -> list[cdi.Gpu]:
        """For an agent run elsewhere (``external_agent``): make the ``nvidia<minor>`` file of each
        GPU the node's GpuNodeStatus lists, whoever published it; those GPUs (none before one is
        published). Files of GPUs no longer listed are kept: a container may still hold them."""
        try:
            status = self.plane.request("GET", f"/apis/gpu.scheduling/v1/gpunodestatuses/{NODE_NAME}")
        except cluster.RequestError as exc:
            if exc.status == 404:
                return []
            raise
        listed = (status.get("status") or {}).get("devices") or []
        gpus = [cdi.Gpu(minor=int(d["minor"]), uuid=str(d["uuid"])) for d in listed if "minor" in d]
        self.make_device_files(gpus)
        self.gpus = gpus
        return gpus

    def make_device_files(self, gpus: Sequence[cdi.Gpu]) -> None:
        """``nvidiactl``, each GPU's ``nvidia<minor>`` and its MIG instances' capability nodes
        (``nvidia-caps/nvidia-cap<N>``) in ``device_dir``, and every other file there that the
        node's CDI spec names (the agent's, once written: its MIG instances' caps): character
        devices with ``/dev/null``'s numbers."""
        null = os.stat("/dev/null")
        self.device_dir.mkdir(parents=True, exist_ok=True)
        names = [cdi.CONTROL_DEVICE, *(cdi.device_file(gpu.minor) for gpu in gpus)]
        names += [cdi.cap_file(n) for gpu in gpus for mig in gpu.migs for n in mig.caps or ()]
        with contextlib.suppress(OSError, ValueError):
            names += cdi.host_files(json.loads(self.cdi_spec.read_text()), str(self.device_dir))
        for name in dict.fromkeys(names):
            path = self.device_dir / name
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                os.mknod(path, 0o666 | stat.S_IFCHR, null.st_rdev)

    def expose_gpus(self, gpus: Sequence[cdi.Gpu]) -> Path:
        """Make the GPUs' device files and write the CDI spec, as the agent does; its path. For a
        node started without a GPU profile, whose DRA plugin is run by hand."""
        self.make_device_files(gpus)
        spec = cdi.build_spec(gpus, str(self.device_dir))
        self.cdi_spec.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.cdi_spec.with_name(f".{cdi.SPEC_NAME}.tmp")
        temporary.write_text(json.dumps(spec, indent=2) + "\n")
        temporary.replace(self.cdi_spec)
        return self.cdi_spec


# ------------------------------------------------------------------ teardown


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


def load_state(node_dir: Path) -> dict[str, Any]:
    """The contents of ``node.json`` in ``node_dir`` ({} if there is none)."""
    try:
        data = json.loads((node_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stop_recorded(record: Mapping[str, Any], names: Sequence[str]) -> None:
    processes = record.get("processes") or {}
    for name in names:
        entry = processes.get(name)
        if not isinstance(entry, dict):
            continue
        pid, executable = entry.get("pid"), entry.get("executable")
        if isinstance(pid, int) and isinstance(executable, str) and cluster.process_matches(pid, executable):
            alive = functools.partial(cluster.process_matches, pid, executable)
            cluster.terminate_group(pid, timeout=10.0, is_alive=alive)


def _remove_containers(record: Mapping[str, Any]) -> None:
    """Kill and remove every container of the k8s.io namespace while containerd still runs."""
    address = str(record.get("address", ""))
    ctr = str(record.get("ctr", ""))
    if not address or not Path(address).exists() or not Path(ctr).exists():
        return
    base = [ctr, "--address", address, "--namespace", "k8s.io"]

    def tasks() -> list[str]:
        return _run([*base, "tasks", "list", "--quiet"], check=False).split()

    running = tasks()
    for task in running:
        _run([*base, "tasks", "kill", "--all", "--signal", "SIGKILL", task], check=False)
    for task in running:
        _run([*base, "tasks", "delete", "--force", task], check=False)
    deadline = time.monotonic() + 10
    while tasks() and time.monotonic() < deadline:
        time.sleep(0.1)
    containers = _run([*base, "containers", "list", "--quiet"], check=False).split()
    if containers:
        _run([*base, "containers", "delete", *containers], check=False)


def _kill_shims(record: Mapping[str, Any]) -> None:
    """Shims (and so their containers' reapers) of this node's containerd that outlived it."""
    shim, address = str(record.get("shim", "")), str(record.get("address", ""))
    if not shim or not address:
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [word.decode(errors="replace") for word in argv]
        if words and Path(words[0]).name == Path(shim).name and address in words:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)


def _unmount_new(record: Mapping[str, Any], node_dir: Path) -> None:
    before = set(record.get("mounts") or [])
    roots = [str(node_dir), *(str(Path(p).resolve()) for p in HOST_PATHS)]
    for _ in range(5):
        points = [p for p in mount_points() if _under(p, roots) and p not in before]
        if not points:
            return
        for point in sorted(set(points), key=lambda p: (-p.count("/"), p)):
            if subprocess.run(["umount", point], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)


def _restore_iptables(record: Mapping[str, Any], bin_dir: Path) -> None:
    """Remove the node's chains (OWN_CHAIN_PREFIXES) that were not there before, and the rules
    jumping to them; nothing else."""
    recorded = record.get("iptables") or {}
    for family in ("iptables", "ip6tables"):
        command, save = bin_dir / family, bin_dir / f"{family}-save"
        if family not in recorded or not command.exists():
            continue  # never recorded: nothing is known to be the node's
        before = recorded[family]
        for table, current in iptables_rules([str(save)]).items():
            old = before.get(table) or {"chains": [], "rules": []}
            new_chains = [
                c for c in current["chains"] if c not in old["chains"] and c.startswith(OWN_CHAIN_PREFIXES)
            ]
            for rule in reversed(current["rules"]):
                words = shlex.split(rule)
                target = words[words.index("-j") + 1] if "-j" in words[:-1] else ""
                if rule in old["rules"] or words[1] in new_chains or target not in new_chains:
                    continue
                _run([str(command), "-w", "-t", table, "-D", *words[1:]], check=False)
            for chain in new_chains:
                _run([str(command), "-w", "-t", table, "-F", chain], check=False)
            for chain in new_chains:
                _run([str(command), "-w", "-t", table, "-X", chain], check=False)


def _restore_paths(record: Mapping[str, Any]) -> None:
    for path, before in (record.get("host_paths") or {}).items():
        target = Path(path)
        if before is None:
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            elif target.exists() or target.is_symlink():
                target.unlink(missing_ok=True)
        elif isinstance(before, list) and target.is_dir():
            for name in sorted(set(os.listdir(target)) - set(before)):
                entry = target / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def teardown(node_dir: Path, *, progress: Progress | None = None) -> list[str]:
    """Undo what the node recorded in ``node_dir/node.json`` changed; idempotent. Returns what is
    still left (an empty list when the machine is as it was)."""
    record = load_state(node_dir)
    if not record:
        return []
    say = progress or (lambda message: None)
    _stop_recorded(record, ("agent", "kubelet"))
    _remove_containers(record)
    _stop_recorded(record, ("containerd",))
    _kill_shims(record)
    _unmount_new(record, node_dir)
    existed = set(record.get("interfaces") or [])
    # Pods' veths go with their network namespaces; any still on the bridge go with it.
    for name in interfaces():
        master = Path(f"/sys/class/net/{name}/master")
        if name not in existed and master.exists() and master.resolve().name == BRIDGE:
            _run(["ip", "link", "delete", name], check=False)
    for name in record.get("created_interfaces") or []:
        if name not in existed and Path(f"/sys/class/net/{name}").exists():
            _run(["ip", "link", "delete", name], check=False)
    bin_dir = Path(str(record.get("bin_dir", node_dir / "bin")))
    _restore_iptables(record, bin_dir)
    for key, value in (record.get("settings") or {}).items():
        current = read_settings([key]).get(key)
        if current is not None and current != value:
            with contextlib.suppress(OSError):
                _setting_path(key).write_text(value + "\n")
    spec = record.get("cdi_spec")
    if isinstance(spec, str):
        before = record.get("cdi_spec_text")
        if not record.get("cdi_spec_existed"):
            Path(spec).unlink(missing_ok=True)
        elif isinstance(before, str) and _read_or_none(Path(spec)) != before:
            # The run's agent replaced a spec found at start (one a killed run left): the one found
            # goes back, so the machine is as it was; never left naming this run's device files.
            temporary = Path(spec).with_name(f".{Path(spec).name}.tmp")
            with contextlib.suppress(OSError):
                temporary.write_text(before)
                temporary.replace(spec)
    _restore_paths(record)
    for name in ("containerd", "kubelet", "dev", "cni"):
        shutil.rmtree(node_dir / name, ignore_errors=True)
    left = leftovers(record, node_dir)
    if not left:
        (node_dir / STATE_FILE).unlink(missing_ok=True)
        say("real node stopped; the machine is as it was")
    else:
        say(f"real node stopped, but left: {'; '.join(left)}")
    return left


def leftovers(record: Mapping[str, Any], node_dir: Path) -> list[str]:
    """What the node left on the machine, compared with its record."""
    left: list[str] = []
    extra = sorted(set(interfaces()) - set(record.get("interfaces") or []))
    if extra:
        left.append(f"interfaces {extra}")
    roots = [str(node_dir), *(str(Path(p).resolve()) for p in HOST_PATHS)]
    mounts = [p for p in mount_points() if _under(p, roots) and p not in set(record.get("mounts") or [])]
    if mounts:
        left.append(f"mounts {mounts}")
    changed = {
        key: value for key, value in read_settings(list(record.get("settings") or [])).items()
        if (record.get("settings") or {}).get(key) != value
    }  # fmt: skip
    if changed:
        left.append(f"kernel settings {changed}")
    for path, before in (record.get("host_paths") or {}).items():
        if _path_record(path) != before:
            left.append(f"{path} changed")
    return left


@contextlib.contextmanager
def running(plane: cluster.ControlPlane, programs: Programs, **options: Any) -> Iterator[RealNode]:
    """A started RealNode, stopped on exit."""
    node = RealNode(plane, programs, **options)
    node.start()
    try:
        yield node
    finally:
        node.stop()


def import_image(node_dir: Path, archive: Path) -> list[str]:
    """Import an OCI archive into the node's containerd (namespace k8s.io); the image names added."""
    record = load_state(node_dir)
    address, ctr = str(record.get("address", "")), str(record.get("ctr", ""))
    if not address or not Path(address).exists():
        raise NodeError(f"no real node runs in {node_dir} (start one with `gpualloc dev up --real-node`)")
    base = [ctr, "--address", address, "--namespace", "k8s.io"]
    before = set(_run([*base, "images", "list", "--quiet"]).split())
    _run([*base, "images", "import", "--local", "--platform", "linux/amd64", str(archive)])
    after = _run([*base, "images", "list", "--quiet"]).split()
    return [name for name in after if name not in before and not name.startswith("sha256:")]
