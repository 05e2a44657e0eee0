"""From raw per-GPU facts to the published ``NodeInventory`` (pure).

Both sources (NVML and simulated) report the same NVML-level facts: for each
GPU its identity, memory, PCIe link and, per NVLink, whether it is up and what
sits at the far end (a GPU or an NVSwitch, by PCI bus id); for each pair of GPUs
the NVML "common ancestor" level. ``derive`` turns those facts into devices,
one link per unordered pair, NVLink islands and counts, so the topology rules
below are exercised by every simulated profile as well as by real hardware.

Link type, as ``nvidia-smi topo -m`` prints it:

* ``NV<n>``: the pair shares ``n`` NVLinks. Direct links are counted from both
  ends (the larger count wins, in case one side could not be read). GPUs whose
  links end at NVSwitches are connected through the switch fabric: two GPUs on
  the same fabric (switches reachable from both, found as connected components
  of the GPU-switch graph) get ``min(switch links of a, switch links of b)``,
  which is how ``nvidia-smi`` shows NV18 on an HGX H100 and NV12 on an A100.
* otherwise the PCIe path from ``nvmlDeviceGetTopologyCommonAncestor``:
  INTERNAL and SINGLE -> ``PIX`` (at most one PCIe switch; nvidia-smi's legend
  has no separate "same board" entry), MULTIPLE -> ``PXB``, HOSTBRIDGE ->
  ``PHB``, NODE -> ``NODE``, SYSTEM -> ``SYS``. An unknown level is ``SYS``.

Bandwidth, bidirectional GB/s (the figure people quote):

========================  ==============================================
NVLink 1.x                40 per link (P100: 4 links = 160)
NVLink 2.x, 3.x, 4.x      50 per link (V100 6 = 300, A100 12 = 600,
                          H100 18 = 900)
NVLink 5.x and later      100 per link (B200 18 = 1800)
NVLink version unknown    50 per link
PCIe, per x16 link        gen1 8, gen2 16, gen3 32, gen4 64, gen5 128,
                          gen6 256; scaled by width/16; the slower of
                          the two GPUs' links; unknown gen3, unknown x16
PCIe path SYS             half the PCIe figure: the traffic crosses the
                          inter-socket link and peer-to-peer is usually
                          staged through host memory
PCIe path PIX/PXB/PHB/    the PCIe figure
NODE
========================  ==============================================

``nvmlDeviceGetNvLinkVersion`` returns the ``nvmlNvlinkVersion_t`` enum, not the
major version (an A100 reports 5, "3.1"): ``NVLINK_VERSION_MAJOR`` maps it.

Islands are the connected components of the NVLink graph, a partition of the
devices: a GPU with no NVLink is an island of one. They are sorted, each by
its smallest index.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from gpualloc.api import constants, islands, models

# nvmlGpuTopologyLevel_t values (the pynvml names are NVML_TOPOLOGY_*).
TOPOLOGY_INTERNAL = 0
TOPOLOGY_SINGLE = 10
TOPOLOGY_MULTIPLE = 20
TOPOLOGY_HOSTBRIDGE = 30
TOPOLOGY_NODE = 40
TOPOLOGY_SYSTEM = 50

TOPOLOGY_TYPE: Mapping[int, str] = {
    TOPOLOGY_INTERNAL: "PIX",
    TOPOLOGY_SINGLE: "PIX",
    TOPOLOGY_MULTIPLE: "PXB",
    TOPOLOGY_HOSTBRIDGE: "PHB",
    TOPOLOGY_NODE: "NODE",
    TOPOLOGY_SYSTEM: "SYS",
}

# nvmlIntNvLinkDeviceType_t values (NVML_NVLINK_DEVICE_TYPE_*).
REMOTE_GPU = 0
REMOTE_IBMNPU = 1
REMOTE_SWITCH = 2
REMOTE_UNKNOWN = 0xFF

# nvmlNvlinkVersion_t -> NVLink major version.
NVLINK_VERSION_MAJOR: Mapping[int, int] = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6}
# "3.1" -> nvmlNvlinkVersion_t, for sources that describe links in human terms.
NVLINK_VERSION_ENUM: Mapping[str, int] = {
    "1.0": 1,
    "2.0": 2,
    "2.2": 3,
    "3.0": 4,
    "3.1": 5,
    "4.0": 6,
    "5.0": 7,
    "6.0": 8,
}
NVLINK_GBPS_PER_LINK: Mapping[int, int] = {1: 40, 2: 50, 3: 50, 4: 50, 5: 100}
NVLINK_GBPS_UNKNOWN = 50
PCIE_X16_GBPS: Mapping[int, int] = {1: 8, 2: 16, 3: 32, 4: 64, 5: 128, 6: 256}
PCIE_UNKNOWN_GENERATION = 3
PCIE_UNKNOWN_WIDTH = 16

PRODUCT_SUMMARY_MAX = 256


# ------------------------------------------------------------------ raw facts


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NvLinkEndpoint:
    """One NVLink of one GPU, as NVML describes it."""

    link: int
    active: bool
    remote_bus_id: str = ""  # sysfs form; the peer GPU's or the switch's
    remote_type: int | None = None  # REMOTE_*; None when NVML cannot say
    version: int = 0  # nvmlNvlinkVersion_t; 0 unknown


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MigInstance:
    """Where a MIG device lives in the driver: the ids of its GPU instance and compute instance
    (NVML's ``nvmlDeviceGetGpuInstanceId`` and ``nvmlDeviceGetComputeInstanceId`` of the MIG
    device), and the minor numbers of their ``/dev/nvidia-caps/nvidia-cap<N>`` nodes, which a
    container needs besides its GPU's ``/dev/nvidia<minor>`` to use the instance (None: not
    known)."""

    uuid: str
    gpu_instance: int
    compute_instance: int
    gpu_instance_cap: int | None = None
    compute_instance_cap: int | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeviceFacts:
    index: int
    minor: int
    uuid: str
    product: str = ""
    memory_mib: int = 0
    compute_capability: str = ""
    pci_bus_id: str = ""
    numa_node: int = -1
    pcie_generation: int = 0
    pcie_width: int = 0
    mig: models.MigInfo | None = None
    mig_instances: tuple[MigInstance, ...] = ()  # of the MIG devices in ``mig``, where known
    nvlinks: tuple[NvLinkEndpoint, ...] = ()
    # Set by the source when the device is gone (GPU_IS_LOST, missing from a
    # re-scan): "lost: <why>". The facts are then the last ones seen.
    lost: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeFacts:
    source: str
    driver_version: str = ""
    cuda_version: str = ""
    devices: tuple[DeviceFacts, ...] = ()
    # nvmlDeviceGetTopologyCommonAncestor level per (index a, index b), a < b.
    common_ancestors: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuProcess:
    """A process with a CUDA context on a GPU (NVML's compute processes)."""

    pid: int
    used_memory_mib: int = 0
    pod_uid: str = ""  # from the process's cgroup (``pod_uid_of_cgroup``); "" when not known


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSample:
    """Utilisation and the like, for /metrics, and the processes on the GPU, for the usage audit
    (``agent.audit``) and the idle times (``agent.idleness``)."""

    index: int
    uuid: str
    utilization_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    processes: tuple[GpuProcess, ...] = ()
    processes_listed: bool = True  # False when the source could not list them (``processes`` is then empty)


# A pod's UID in a cgroup path: "pod<uid>" (cgroupfs driver) or "pod<uid with _>.slice" (systemd).
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


def pod_uid_of_cgroup(text: str) -> str:
    """The UID of the pod whose container a process runs in, from ``/proc/<pid>/cgroup`` (cgroup v1
    or v2, the kubelet's cgroupfs or systemd driver); "" for a process outside any pod."""
    for line in text.splitlines():
        match = _POD_UID.search(line.rsplit(":", 1)[-1])
        if match:
            return match.group(1).replace("_", "-")
    return ""


# Where the driver tells a MIG instance's capability minors, under /proc (NVIDIA's MIG user guide;
# nvidia-container-toolkit reads the same files): one ``access`` file per GPU instance and per
# compute instance, whose ``DeviceFileMinor: <N>`` line names ``/dev/nvidia-caps/nvidia-cap<N>``,
# and the driver's whole table, one ``gpu<minor>/gi<g>/access <N>`` or
# ``gpu<minor>/gi<g>/ci<c>/access <N>`` a line.
MIG_CAPABILITIES = "driver/nvidia/capabilities"
MIG_MINORS = "driver/nvidia-caps/mig-minors"


def mig_cap_name(gpu_minor: int, gpu_instance: int, compute_instance: int | None = None) -> str:
    """A MIG capability's name in ``mig-minors``: ``gpu0/gi1/access``, ``gpu0/gi1/ci0/access``."""
    ci = "" if compute_instance is None else f"/ci{compute_instance}"
    return f"gpu{gpu_minor}/gi{gpu_instance}{ci}/access"


def mig_cap_access_path(gpu_minor: int, gpu_instance: int, compute_instance: int | None = None) -> str:
    """The capability's ``access`` file, relative to /proc:
    ``driver/nvidia/capabilities/gpu0/mig/gi1/ci0/access``."""
    gpu, _, rest = mig_cap_name(gpu_minor, gpu_instance, compute_instance).partition("/")
    return f"{MIG_CAPABILITIES}/{gpu}/mig/{rest}"


def parse_cap_access(text: str) -> int | None:
    """The ``DeviceFileMinor`` of a capability's ``access`` file; None when it has none."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "DeviceFileMinor" and value.strip().isdigit():
            return int(value.strip())
    return None


def parse_mig_minors(text: str) -> dict[str, int]:
    """``mig-minors`` as capability name -> minor; malformed lines are left out."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[1].isdigit():
            found[fields[0]] = int(fields[1])
    return found


def parse_sharing(text: str) -> models.DeviceSharing | None:
    """The agent's ``--sharing``: ``""`` (none), or ``<strategy>:<slots>`` such as ``TimeSlicing:4``
    or ``MPS:2``; ValueError with what is wrong otherwise."""
    if not text.strip():
        return None
    strategy, _, slots = text.strip().partition(":")
    known = ", ".join(constants.SHARING_STRATEGIES)
    if strategy not in constants.SHARING_STRATEGIES:
        raise ValueError(f"sharing strategy {strategy!r} is not one of {known} (as in TimeSlicing:4)")
    if not slots.isdigit() or not 1 <= int(slots) <= constants.MAX_SHARING_SLOTS:
        raise ValueError(
            f"sharing slots {slots!r} must be a number from 1 to {constants.MAX_SHARING_SLOTS}"
            f" (as in {strategy}:4)"
        )
    return models.DeviceSharing(strategy=strategy, replicas=int(slots))


def parse_sharing_label(value: str) -> models.DeviceSharing | None:
    """A Node's ``gpu.scheduling/sharing`` label (a label value has no ``:``): ``None`` for whole
    GPUs, else ``<strategy>-<slots>`` such as ``TimeSlicing-4`` or ``MPS-2``."""
    if value == "None":
        return None
    return parse_sharing(value.replace("-", ":", 1))


class SourceUnavailable(Exception):
    """The source cannot be read now (NVML not initialised, driver gone)."""


class Source(Protocol):
    """What the agent needs from NVML or the simulator."""

    @property
    def name(self) -> str: ...

    def scan(self) -> NodeFacts:
        """Read the devices. Raises SourceUnavailable; initialises on demand."""
        ...

    def samples(self) -> list[DeviceSample]: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------- derivation


_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-9a-fA-F])$")


def normalize_bus_id(raw: str | bytes) -> str:
    """NVML's ``00000000:18:00.0`` -> sysfs ``0000:18:00.0`` (lower case).

    A domain that does not fit four hex digits keeps all eight. Unparseable
    input is returned lower-cased and stripped.
    """
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    text = text.strip().rstrip("\x00")
    match = _BUS_ID.match(text)
    if not match:
        return text.lower()
    domain_s, bus, dev, fn = match.groups()
    domain = int(domain_s or "0", 16)
    domain_text = f"{domain:04x}" if domain <= 0xFFFF else f"{domain:08x}"
    return f"{domain_text}:{int(bus, 16):02x}:{int(dev, 16):02x}.{fn.lower()}"


def cuda_version_text(version: int) -> str:
    """``nvmlSystemGetCudaDriverVersion_v2``'s 13000 -> "13.0", 12040 -> "12.4"."""
    if version <= 0:
        return ""
    return f"{version // 1000}.{(version % 1000) // 10}"


def nvlink_gbps(version_enum: int) -> int:
    major = NVLINK_VERSION_MAJOR.get(version_enum, 0)
    if major == 0:
        return NVLINK_GBPS_UNKNOWN
    if major in NVLINK_GBPS_PER_LINK:
        return NVLINK_GBPS_PER_LINK[major]
    return NVLINK_GBPS_PER_LINK[max(NVLINK_GBPS_PER_LINK)]


def pcie_gbps(generation: int, width: int) -> int:
    gen = generation if generation in PCIE_X16_GBPS else PCIE_UNKNOWN_GENERATION
    lanes = width if width > 0 else PCIE_UNKNOWN_WIDTH
    return PCIE_X16_GBPS[gen] * lanes // 16


def pair_pcie_gbps(a: DeviceFacts, b: DeviceFacts, link_type: str) -> int:
    figure = min(pcie_gbps(a.pcie_generation, a.pcie_width), pcie_gbps(b.pcie_generation, b.pcie_width))
    return figure // 2 if link_type == "SYS" else figure


def _remote_kind(endpoint: NvLinkEndpoint, gpu_bus_ids: set[str]) -> int:
    if endpoint.remote_type is not None and endpoint.remote_type != REMOTE_UNKNOWN:
        return endpoint.remote_type
    # NVML could not say: a peer GPU is one of ours, anything else is a switch.
    if endpoint.remote_bus_id in gpu_bus_ids:
        return REMOTE_GPU
    return REMOTE_SWITCH


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _PairLinks:
    count: int
    version: int  # the lowest NVLink version enum seen on the pair's links, 0 unknown


def nvlink_pairs(devices: Sequence[DeviceFacts]) -> dict[tuple[int, int], _PairLinks]:
    """NVLinks per unordered pair of device indices (a < b), direct and via NVSwitch."""
    by_bus = {d.pci_bus_id: d for d in devices if d.pci_bus_id}
    gpu_bus_ids = set(by_bus)
    direct: dict[tuple[int, int], list[int]] = {}  # pair -> [count seen from a, count seen from b]
    versions: dict[tuple[int, int], set[int]] = {}
    switch_links: dict[int, int] = {}
    switch_versions: dict[int, set[int]] = {}
    fabric: islands.DisjointSets[str] = islands.DisjointSets()
    for device in devices:
        for ep in device.nvlinks:
            if not ep.active:
                continue
            kind = _remote_kind(ep, gpu_bus_ids)
            if kind == REMOTE_GPU:
                peer = by_bus.get(ep.remote_bus_id)
                if peer is None or peer.index == device.index:
                    continue
                pair = (min(device.index, peer.index), max(device.index, peer.index))
                seen = direct.setdefault(pair, [0, 0])
                seen[0 if device.index == pair[0] else 1] += 1
                if ep.version:
                    versions.setdefault(pair, set()).add(ep.version)
            elif kind == REMOTE_SWITCH:
                switch_links[device.index] = switch_links.get(device.index, 0) + 1
                if ep.version:
                    switch_versions.setdefault(device.index, set()).add(ep.version)
                fabric.union(f"gpu:{device.index}", f"switch:{ep.remote_bus_id}")
    out: dict[tuple[int, int], _PairLinks] = {}
    indices = sorted(d.index for d in devices)
    for i, a in enumerate(indices):
        for b in indices[i + 1 :]:
            count = max(direct.get((a, b), [0, 0]))
            seen_versions = set(versions.get((a, b), set()))
            if a in switch_links and b in switch_links and fabric.find(f"gpu:{a}") == fabric.find(f"gpu:{b}"):
                count += min(switch_links[a], switch_links[b])
                seen_versions |= switch_versions.get(a, set()) | switch_versions.get(b, set())
            if count:
                out[(a, b)] = _PairLinks(count=count, version=min(seen_versions) if seen_versions else 0)
    return out


def product_summary(devices: Sequence[models.Device]) -> str:
    """``8x NVIDIA H100 80GB HBM3``; several products in order of first index."""
    counts: dict[str, int] = {}
    for device in sorted(devices, key=lambda d: d.index):
        name = device.product or "unknown"
        counts[name] = counts.get(name, 0) + 1
    text = ", ".join(f"{n}x {name}" for name, n in counts.items())
    return text if len(text) <= PRODUCT_SUMMARY_MAX else text[: PRODUCT_SUMMARY_MAX - 3] + "..."


def derive_links(facts: NodeFacts) -> tuple[models.Link, ...]:
    by_index = {d.index: d for d in facts.devices}
    nv = nvlink_pairs(facts.devices)
    links: list[models.Link] = []
    indices = sorted(by_index)
    for i, a in enumerate(indices):
        for b in indices[i + 1 :]:
            pair = nv.get((a, b))
            if pair is not None:
                links.append(
                    models.Link(
                        a=a,
                        b=b,
                        type=f"NV{pair.count}",
                        nvlinks=pair.count,
                        bandwidth_gbps=pair.count * nvlink_gbps(pair.version),
                    )
                )
                continue
            level = facts.common_ancestors.get((a, b), TOPOLOGY_SYSTEM)
            link_type = TOPOLOGY_TYPE.get(level, "SYS")
            links.append(
                models.Link(
                    a=a,
                    b=b,
                    type=link_type,
                    nvlinks=0,
                    bandwidth_gbps=pair_pcie_gbps(by_index[a], by_index[b], link_type),
                )
            )
    return tuple(links)


def derive(
    facts: NodeFacts,
    *,
    unhealthy: Mapping[str, str] | None = None,
    held: Collection[str] = (),
    sharing: models.DeviceSharing | None = None,
    idle: Mapping[str, str] | None = None,
) -> models.NodeInventory:
    """The status to publish. ``unhealthy`` maps UUID -> reason (from health events); ``held`` has
    the lock ids (``Device.lock_ids``) whose device Lease exists; every GPU not in MIG mode is
    offered for ``sharing``, when given; ``idle`` maps UUID -> ``idleSince`` (``agent.idleness``)."""
    marks = unhealthy or {}
    idle_since = idle or {}
    devices: list[models.Device] = []
    for d in sorted(facts.devices, key=lambda d: d.index):
        offered = None
        if sharing is not None and not (d.mig is not None and d.mig.enabled):
            slots = [constants.slot_id(d.uuid, k) for k in range(sharing.replicas)]
            offered = models.DeviceSharing(
                strategy=sharing.strategy,
                replicas=sharing.replicas,
                in_use=sum(1 for slot in slots if slot in held),
            )
        if d.lost:
            health, reason = constants.UNHEALTHY, d.lost
        elif d.uuid in marks:
            health, reason = constants.UNHEALTHY, marks[d.uuid]
        else:
            health, reason = constants.HEALTHY, ""
        devices.append(
            models.Device(
                index=d.index,
                minor=d.minor,
                uuid=d.uuid,
                product=d.product,
                memory_mib=d.memory_mib,
                compute_capability=d.compute_capability,
                pci_bus_id=d.pci_bus_id,
                numa_node=d.numa_node,
                health=health,
                health_reason=reason[:1024],
                pcie_generation=d.pcie_generation,
                pcie_width=d.pcie_width,
                mig=d.mig,
                sharing=offered,
                idle_since=idle_since.get(d.uuid),
            )
        )
    links = derive_links(facts)
    return models.NodeInventory(
        source=facts.source,
        driver_version=facts.driver_version,
        cuda_version=facts.cuda_version,
        devices=tuple(devices),
        links=links,
        islands=islands.islands((d.index for d in devices), ((ln.a, ln.b) for ln in links if ln.nvlinks > 0)),
        total=len(devices),
        healthy=sum(1 for d in devices if d.health == constants.HEALTHY),
        allocated=sum(1 for d in devices if any(lock_id in held for lock_id in d.lock_ids)),
        product=product_summary(devices),
    )
