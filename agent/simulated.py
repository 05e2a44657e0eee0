"""A stand-in for NVML where there is no GPU: profiles shipped as YAML data.

A profile describes a machine at the level NVML does: per GPU its PCI bus id,
NUMA node and PCIe path (host bridge, then PCIe switches down to the GPU), per
GPU its NVLinks to NVSwitches (``nvlink.switches``, links per GPU to each) or to
a peer (``nvlink.bridges``). ``SimulatedSource.scan`` turns that into the same
``inventory.NodeFacts`` NVML produces, common-ancestor levels included, so the
one derivation in ``inventory`` serves both.

UUIDs are derived from the node name and index (uuid5), so each simulated node
has stable, distinct, CRD-valid ``GPU-xxxxxxxx-...`` identities.

XID injection (``--xid-inject-file``): each line is ``<index> <what>``, where
``what`` is an XID number, ``ecc`` (a double-bit ECC error) or ``lost`` (the
GPU falls off the bus and vanishes from later scans), or ``<index> process
<pid> [<pod uid>]``: a process with a CUDA context on that GPU, for the usage
audit and the GPU's ``idleSince``; ``#`` starts a comment. The file is polled
every 0.2 s and re-read at once on SIGUSR1. Marks are sticky, so re-reading
lines already applied changes nothing; the processes are those the file lists
now (remove a line: the process has exited).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import time
import uuid as uuidlib
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from agent import health, inventory
from gpualloc.api import models

log = logging.getLogger(__name__)


UUID_NAMESPACE = uuidlib.uuid5(uuidlib.NAMESPACE_DNS, "gpu.scheduling")


class ProfileError(ValueError):
    """A profile file is missing or malformed."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SimMig:
    profile: str
    memory_mib: int
    placement_start: int
    memory_slices: int
    compute_slices: int


MEMORY_SLICES = 8  # of an A100 or H100


def place_mig(profiles: list[dict[str, object]], where: str) -> tuple[SimMig, ...]:
    """The MIG devices of a profile's GPU, placed as NVML would: each GPU instance on the first free
    run of memory slices aligned to its size, in the order given (``start`` and ``memorySlices``
    in the profile override). ``3g.20gb`` has 3 compute slices and takes 4 memory slices: the
    smallest power of two that holds its compute slices, as on an A100 or H100."""
    used = [False] * MEMORY_SLICES
    out = []
    for j, m in enumerate(profiles):
        profile = str(m["profile"])
        head = profile.split("g.", 1)[0]
        if not head.isdigit():
            raise ProfileError(f"{where}: mig[{j}]: profile {profile!r} is not of the form 3g.20gb")
        compute = int(head)
        size = int(str(m.get("memorySlices", 1 << (compute - 1).bit_length())))
        starts = [int(str(m["start"]))] if "start" in m else range(0, MEMORY_SLICES - size + 1, size)
        start = next((s for s in starts if not any(used[s : s + size])), None)
        if start is None or start + size > MEMORY_SLICES:
            raise ProfileError(f"{where}: mig[{j}]: no room for {profile} ({size} memory slices)")
        used[start : start + size] = [True] * size
        out.append(
            SimMig(
                profile=profile,
                memory_mib=int(str(m.get("memoryMiB", 0))),
                placement_start=start,
                memory_slices=size,
                compute_slices=compute,
            )
        )
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SimDevice:
    bus_id: str
    numa: int
    pcie_path: tuple[str, ...]  # host bridge, then switches down to the GPU
    product: str
    memory_mib: int
    compute_capability: str
    pcie_generation: int
    pcie_width: int
    mig: tuple[SimMig, ...] | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SimSwitch:
    bus_id: str
    links_per_gpu: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SimBridge:
    a: int
    b: int
    links: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Profile:
    name: str
    description: str
    driver_version: str
    cuda_version: str
    devices: tuple[SimDevice, ...]
    nvlink_version: int = 0  # nvmlNvlinkVersion_t
    switches: tuple[SimSwitch, ...] = ()
    bridges: tuple[SimBridge, ...] = ()


# ------------------------------------------------------------------ profiles


def profile_names() -> list[str]:
    """The profiles shipped with the agent."""
    folder = resources.files("agent") / "profiles"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ProfileError(f"cannot read profile {name_or_path}: {exc}") from exc
    else:
        shipped = resources.files("agent") / "profiles" / f"{name_or_path}.yaml"
        if not shipped.is_file():
            raise ProfileError(f"no profile named {name_or_path!r}; shipped: {', '.join(profile_names())}")
        text = shipped.read_text()
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"profile {name_or_path}: {exc}") from exc
    return parse_profile(raw, origin=name_or_path)


def _need(raw: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in raw:
        raise ProfileError(f"{where}: {key} is required")
    return raw[key]


def parse_profile(raw: Any, *, origin: str = "<profile>") -> Profile:
    if not isinstance(raw, dict):
        raise ProfileError(f"{origin}: expected a mapping")
    defaults = dict(raw.get("defaults") or {})
    devices: list[SimDevice] = []
    for i, d in enumerate(_need(raw, "devices", origin) or []):
        where = f"{origin}: devices[{i}]"
        if not isinstance(d, dict):
            raise ProfileError(f"{where}: expected a mapping")
        merged = {**defaults, **d}
        mig_raw = merged.get("mig")
        mig = None if mig_raw is None else place_mig(list(mig_raw), where)
        devices.append(
            SimDevice(
                bus_id=inventory.normalize_bus_id(str(_need(merged, "busId", where))),
                numa=int(merged.get("numa", -1)),
                pcie_path=tuple(str(p) for p in merged.get("pcie", [f"hb{i}"])),
                product=str(merged.get("product", "")),
                memory_mib=int(merged.get("memoryMiB", 0)),
                compute_capability=str(merged.get("computeCapability", "")),
                pcie_generation=int(merged.get("pcieGeneration", 0)),
                pcie_width=int(merged.get("pcieWidth", 0)),
                mig=mig,
            )
        )
    nvlink = dict(raw.get("nvlink") or {})
    version_text = str(nvlink.get("version", "")) if nvlink else ""
    if version_text and version_text not in inventory.NVLINK_VERSION_ENUM:
        raise ProfileError(
            f"{origin}: nvlink.version {version_text!r} is not one of {list(inventory.NVLINK_VERSION_ENUM)}"
        )
    switches = tuple(
        SimSwitch(bus_id=inventory.normalize_bus_id(str(s["busId"])), links_per_gpu=int(s["linksPerGpu"]))
        for s in nvlink.get("switches") or []
    )
    bridges = tuple(
        SimBridge(a=int(b["a"]), b=int(b["b"]), links=int(b["links"])) for b in nvlink.get("bridges") or []
    )
    for bridge in bridges:
        if not (0 <= bridge.a < len(devices) and 0 <= bridge.b < len(devices)) or bridge.a == bridge.b:
            raise ProfileError(f"{origin}: bridge {bridge.a}-{bridge.b} names no pair of devices")
    return Profile(
        name=str(raw.get("name", origin)),
        description=str(raw.get("description", "")),
        driver_version=str(raw.get("driverVersion", "")),
        cuda_version=str(raw.get("cudaVersion", "")),
        devices=tuple(devices),
        nvlink_version=inventory.NVLINK_VERSION_ENUM.get(version_text, 0),
        switches=switches,
        bridges=bridges,
    )


# -------------------------------------------------------------- NVML-level facts


def device_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuidlib.uuid5(UUID_NAMESPACE, f'{node_name}/{index}')}"


def mig_uuid(node_name: str, index: int, mig_index: int) -> str:
    return f"MIG-{uuidlib.uuid5(UUID_NAMESPACE, f'{node_name}/{index}/mig/{mig_index}')}"


# The driver's ``mig-minors`` table: ``config`` 1, ``monitor`` 2, then for each GPU minor 15 GPU
# instances, each one ``gi<g>/access`` followed by 8 ``ci<c>/access`` (gpu0/gi0 3, gpu0/gi0/ci0 4,
# gpu0/gi1 12). The simulated MIG devices' capability minors are laid out the same way.
MIG_MINORS_FIRST = 3
MIG_GPU_INSTANCES = 15
MIG_COMPUTE_INSTANCES = 8


def mig_cap_minor(gpu_minor: int, gpu_instance: int, compute_instance: int | None = None) -> int:
    """The minor of a MIG capability in the driver's ``mig-minors`` layout."""
    per_gi = 1 + MIG_COMPUTE_INSTANCES
    gi = MIG_MINORS_FIRST + (gpu_minor * MIG_GPU_INSTANCES + gpu_instance) * per_gi
    return gi if compute_instance is None else gi + 1 + compute_instance


def mig_instance(node_name: str, index: int, mig_index: int) -> inventory.MigInstance:
    """Where simulated MIG device ``mig_index`` of GPU ``index`` (whose minor is its index) lives:
    GPU instance ``mig_index + 1`` (each simulated MIG device is a GPU instance of its own),
    compute instance 0 (one taking the whole GPU instance, as ``nvidia-smi mig -cgi ... -C`` makes
    it), and their capability minors in the driver's layout. A real GPU's ids are NVML's; these
    are only stable and distinct."""
    gi = mig_index + 1
    return inventory.MigInstance(
        uuid=mig_uuid(node_name, index, mig_index),
        gpu_instance=gi,
        compute_instance=0,
        gpu_instance_cap=mig_cap_minor(index, gi),
        compute_instance_cap=mig_cap_minor(index, gi, 0),
    )


def common_ancestor(a: SimDevice, b: SimDevice) -> int:
    """The NVML topology level between two simulated GPUs."""
    if a.numa != b.numa:
        return inventory.TOPOLOGY_SYSTEM
    if not a.pcie_path or not b.pcie_path or a.pcie_path[0] != b.pcie_path[0]:
        return inventory.TOPOLOGY_NODE
    shared = 0
    for x, y in zip(a.pcie_path[1:], b.pcie_path[1:], strict=False):
        if x != y:
            break
        shared += 1
    if shared == 0:
        return inventory.TOPOLOGY_HOSTBRIDGE
    if a.pcie_path == b.pcie_path:
        return inventory.TOPOLOGY_SINGLE
    return inventory.TOPOLOGY_MULTIPLE


def nvlink_endpoints(profile: Profile) -> list[list[inventory.NvLinkEndpoint]]:
    """Per GPU, its NVLinks numbered from 0: switch links first, then bridges."""
    per_gpu: list[list[inventory.NvLinkEndpoint]] = [[] for _ in profile.devices]

    def add(gpu: int, remote_bus_id: str, remote_type: int) -> None:
        per_gpu[gpu].append(
            inventory.NvLinkEndpoint(
                link=len(per_gpu[gpu]),
                active=True,
                remote_bus_id=remote_bus_id,
                remote_type=remote_type,
                version=profile.nvlink_version,
            )
        )

    for gpu in range(len(profile.devices)):
        for switch in profile.switches:
            for _ in range(switch.links_per_gpu):
                add(gpu, switch.bus_id, inventory.REMOTE_SWITCH)
    for bridge in profile.bridges:
        for _ in range(bridge.links):
            add(bridge.a, profile.devices[bridge.b].bus_id, inventory.REMOTE_GPU)
            add(bridge.b, profile.devices[bridge.a].bus_id, inventory.REMOTE_GPU)
    return per_gpu


class SimulatedSource:
    """``inventory.Source`` over a profile. Devices can be made to vanish (``lose``)."""

    def __init__(
        self, profile: Profile, node_name: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.profile = profile
        self.node_name = node_name
        self._clock = clock
        self._start = clock()
        self._lost: set[int] = set()
        self._processes: dict[int, dict[int, inventory.GpuProcess]] = {}  # index -> pid -> process
        endpoints = nvlink_endpoints(profile)
        self._facts = [
            inventory.DeviceFacts(
                index=i,
                minor=i,
                uuid=device_uuid(node_name, i),
                product=d.product,
                memory_mib=d.memory_mib,
                compute_capability=d.compute_capability,
                pci_bus_id=d.bus_id,
                numa_node=d.numa,
                pcie_generation=d.pcie_generation,
                pcie_width=d.pcie_width,
                mig=self._mig(i, d),
                mig_instances=tuple(mig_instance(node_name, i, j) for j in range(len(d.mig or ()))),
                nvlinks=tuple(endpoints[i]),
            )
            for i, d in enumerate(profile.devices)
        ]
        n = len(profile.devices)
        self._ancestors = {
            (a, b): common_ancestor(profile.devices[a], profile.devices[b])
            for a in range(n)
            for b in range(a + 1, n)
        }

    def _mig(self, index: int, device: SimDevice) -> models.MigInfo | None:
        if device.mig is None:
            return None
        return models.MigInfo(
            enabled=True,
            devices=tuple(
                models.MigDevice(
                    index=j,
                    uuid=mig_uuid(self.node_name, index, j),
                    profile=m.profile,
                    memory_mib=m.memory_mib,
                    placement_start=m.placement_start,
                    memory_slices=m.memory_slices,
                    compute_slices=m.compute_slices,
                )
                for j, m in enumerate(device.mig)
            ),
        )

    @property
    def name(self) -> str:
        return "simulated"

    def uuid_of(self, index: int) -> str | None:
        return self._facts[index].uuid if 0 <= index < len(self._facts) else None

    def lose(self, index: int) -> bool:
        """The GPU at ``index`` falls off the bus: later scans no longer see it."""
        if not 0 <= index < len(self._facts) or index in self._lost:
            return False
        self._lost.add(index)
        return True

    def set_processes(self, running: Mapping[int, Sequence[inventory.GpuProcess]]) -> bool:
        """The processes with a CUDA context on each GPU (by index) from now on, as the usage audit
        will see them; whether that changed anything."""
        new = {index: {p.pid: p for p in procs} for index, procs in running.items() if procs}
        changed = new != self._processes
        self._processes = new
        return changed

    def scan(self) -> inventory.NodeFacts:
        present = [f for f in self._facts if f.index not in self._lost]
        indices = {f.index for f in present}
        return inventory.NodeFacts(
            source="simulated",
            driver_version=self.profile.driver_version,
            cuda_version=self.profile.cuda_version,
            devices=tuple(present),
            common_ancestors={
                p: lvl for p, lvl in self._ancestors.items() if p[0] in indices and p[1] in indices
            },
        )

    def samples(self) -> list[inventory.DeviceSample]:
        """Plausible, smoothly varying readings: a slow wave per GPU."""
        t = self._clock() - self._start
        out = []
        for f in self._facts:
            if f.index in self._lost:
                continue
            util = 50.0 + 45.0 * math.sin(t / 60.0 + f.index)
            total = f.memory_mib * 1024 * 1024
            out.append(
                inventory.DeviceSample(
                    index=f.index,
                    uuid=f.uuid,
                    utilization_percent=round(util, 1),
                    memory_used_bytes=int(total * util / 100.0),
                    memory_total_bytes=total,
                    temperature_celsius=round(32.0 + 0.45 * util, 1),
                    power_watts=round(70.0 + 6.3 * util, 1),
                    processes=tuple(self._processes.get(f.index, {}).values()),
                )
            )
        return out

    def close(self) -> None:
        return None


# ------------------------------------------------------------- XID injection


PROCESS = "process"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Injection:
    index: int
    kind: str  # health.KIND_*, or PROCESS
    xid: int = 0
    process: inventory.GpuProcess | None = None  # PROCESS


def parse_injections(text: str) -> list[Injection]:
    """``"3 79\\n1 ecc\\n5 lost\\n2 process 4242 <pod uid>"`` -> injections; malformed lines are
    logged and skipped."""
    out: list[Injection] = []
    for number, line in enumerate(text.splitlines(), start=1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        parts = body.split()
        try:
            if len(parts) in (3, 4) and parts[1].lower() == PROCESS:
                pod_uid = parts[3].lower() if len(parts) == 4 else ""
                process = inventory.GpuProcess(pid=int(parts[2]), pod_uid=pod_uid)
                out.append(Injection(index=int(parts[0]), kind=PROCESS, process=process))
                continue
            if len(parts) != 2:
                raise ValueError("expected '<index> <xid|ecc|lost>' or '<index> process <pid> [<pod uid>]'")
            index = int(parts[0])
            what = parts[1].lower()
            if what == "ecc":
                out.append(Injection(index=index, kind=health.KIND_ECC))
            elif what == "lost":
                out.append(Injection(index=index, kind=health.KIND_LOST))
            else:
                out.append(Injection(index=index, kind=health.KIND_XID, xid=int(what)))
        except ValueError as exc:
            log.warning("bad XID injection line", extra={"line": number, "text": line, "error": str(exc)})
    return out


class InjectionWatcher:
    """Watches the injection file and applies what it says to a SimulatedSource.

    ``on_event`` receives XID/ECC events for the health tracker; ``on_rescan`` is
    called after a device was made to vanish or the processes changed, so the
    agent scans at once.
    """

    def __init__(
        self,
        path: str,
        source: SimulatedSource,
        *,
        on_event: Callable[[health.HealthEvent], object],
        on_rescan: Callable[[], None],
        poll_seconds: float = 0.2,
    ) -> None:
        self.path = Path(path)
        self.source = source
        self._on_event = on_event
        self._on_rescan = on_rescan
        self._poll = poll_seconds
        self._seen: tuple[int, int, int] | None = None
        self._kick = asyncio.Event()

    def kick(self) -> None:
        """Re-read now (the SIGUSR1 handler)."""
        self._seen = None
        self._kick.set()

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def check(self) -> int:
        """Apply the file if it changed; the number of injections applied."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return 0
        self._seen = stamp
        try:
            text = self.path.read_text()
        except OSError:
            return 0
        return self.apply(parse_injections(text))

    def apply(self, injections: Sequence[Injection]) -> int:
        rescan = False
        running: dict[int, list[inventory.GpuProcess]] = {}
        for inj in injections:
            uuid = self.source.uuid_of(inj.index)
            if uuid is None:
                log.warning("XID injection names no device", extra={"index": inj.index})
                continue
            if inj.process is not None:
                running.setdefault(inj.index, []).append(inj.process)
            elif inj.kind == health.KIND_LOST:
                rescan = self.source.lose(inj.index) or rescan
            else:
                self._on_event(health.HealthEvent(uuid=uuid, kind=inj.kind, xid=inj.xid))
        rescan = self.source.set_processes(running) or rescan
        if rescan:
            self._on_rescan()
        return len(injections)

    async def run(self) -> None:
        """Poll until cancelled; SIGUSR1 re-reads immediately."""
        loop = asyncio.get_running_loop()
        installed = False
        try:
            loop.add_signal_handler(signal.SIGUSR1, self.kick)
            installed = True
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals
            log.info("SIGUSR1 not available; polling the XID injection file only")
        try:
            while True:
                self.check()
                self._kick.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), self._poll)
        finally:
            if installed:
                loop.remove_signal_handler(signal.SIGUSR1)
