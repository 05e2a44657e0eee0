"""A stand-in for the ``pynvml`` module (nvidia-ml-py) that behaves like NVML.

``FakeNvml(machine)`` exposes the functions ``agent.nvml`` calls, under their
pynvml names, plus the constants and the ``NVMLError`` class tree: as in
pynvml, ``NVMLError(code)`` returns the matching subclass
(``NVMLError_NotSupported``, ``NVMLError_GpuIsLost``, ...), each carrying
``.value``. Strings come back as ``str`` (nvidia-ml-py decodes them), PCI bus
ids as ``bytes`` in the 8-digit-domain upper-case NVML form, as ctypes gives.

Behaviours modelled: init failure with a chosen code; NOT_SUPPORTED from
optional calls (NUMA, MIG, NVLink on consumer cards, remote device type,
power); INVALID_ARGUMENT past a device's last NVLink; GPU_IS_LOST from every
call on a lost GPU; devices that vanish from the count; XID and ECC events
through an event set with a blocking, timing-out wait.
"""

from __future__ import annotations

import dataclasses
import string
import threading
import types
from typing import Any

# ---------------------------------------------------------------- constants

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_UNKNOWN = 999

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}

NVML_TOPOLOGY_INTERNAL = 0
NVML_TOPOLOGY_SINGLE = 10
NVML_TOPOLOGY_MULTIPLE = 20
NVML_TOPOLOGY_HOSTBRIDGE = 30
NVML_TOPOLOGY_NODE = 40
NVML_TOPOLOGY_SYSTEM = 50

NVML_NVLINK_MAX_LINKS = 36
NVML_NVLINK_DEVICE_TYPE_GPU = 0x00
NVML_NVLINK_DEVICE_TYPE_IBMNPU = 0x01
NVML_NVLINK_DEVICE_TYPE_SWITCH = 0x02
NVML_NVLINK_DEVICE_TYPE_UNKNOWN = 0xFF
NVML_NVLINK_VERSION_3_1 = 5
NVML_NVLINK_VERSION_4_0 = 6

NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
NVML_TEMPERATURE_GPU = 0
NVML_AFFINITY_SCOPE_NODE = 0
NVML_AFFINITY_SCOPE_SOCKET = 1

nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8


# ------------------------------------------------------------------- errors


class NVMLError(Exception):
    """As in pynvml: ``NVMLError(code)`` is an instance of the code's subclass."""

    _valClassMapping: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


def _make_error_classes() -> None:
    for name, code in list(globals().items()):
        if not name.startswith("NVML_ERROR_"):
            continue
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls: type[NVMLError], *args: Any, _code: int = code) -> NVMLError:
            return NVMLError.__new__(cls, _code)

        def init(self: NVMLError, *args: Any, _code: int = code) -> None:
            Exception.__init__(self, _code)

        klass = type(class_name, (NVMLError,), {"__new__": new, "__init__": init})
        globals()[class_name] = klass
        NVMLError._valClassMapping[code] = klass


_make_error_classes()


# ------------------------------------------------------------------ machine


@dataclasses.dataclass
class FakeLink:
    remote_bus_id: str  # NVML form, e.g. "00000000:05:00.0"
    remote_type: int = NVML_NVLINK_DEVICE_TYPE_GPU
    version: int = NVML_NVLINK_VERSION_4_0
    active: bool = True


@dataclasses.dataclass
class FakeMig:
    uuid: str
    profile: str
    memory_mib: int
    slices: int = 1  # compute slices of its GPU instance
    start: int = 0  # its GPU instance's placement: first memory slice, and how many
    size: int = 1
    ci: int = 0  # its compute instance's id inside its GPU instance


@dataclasses.dataclass
class FakeGpu:
    uuid: str
    name: str
    bus_id: str  # NVML form, e.g. "00000000:18:00.0"
    minor: int
    memory_mib: int
    cc: tuple[int, int] = (9, 0)
    numa: int | None = None  # the CPU-side node; None: nvmlDeviceGetMemoryAffinity is NOT_SUPPORTED
    numa_nodes: tuple[int, ...] = ()  # several nodes at once (overrides numa when set)
    gpu_numa_id: int | None = None  # the GPU's own node (Grace Hopper); None: NOT_SUPPORTED
    pcie_gen: int = 5
    pcie_width: int = 16
    nvlinks: list[FakeLink] | None = None  # None: NVLink NOT_SUPPORTED (consumer card)
    mig: list[FakeMig] | None = None  # None: MIG NOT_SUPPORTED; [] MIG disabled
    mig_enabled: bool = False
    remote_type_supported: bool = True
    power_supported: bool = True
    events_supported: bool = True
    lost: bool = False
    utilization: int = 37
    temperature: int = 41
    power_mw: int = 312_000
    memory_used_mib: int = 1024
    processes: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)  # (pid, bytes used)


@dataclasses.dataclass
class FakeMachine:
    gpus: list[FakeGpu]
    driver: str = "580.95.05"
    cuda: int = 13000
    topology: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (a, b) a<b
    init_error: int | None = None


class Handle:
    def __init__(self, index: int, mig: int | None = None) -> None:
        self.index = index
        self.mig = mig

    def __repr__(self) -> str:
        return f"Handle({self.index}, mig={self.mig})"


class EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # gpu index -> mask
        self.queue: list[Any] = []
        self.cond = threading.Condition()
        self.freed = False


class FakeNvml:
    """The module stand-in. Pass it as ``NvmlSource(nvml_module=FakeNvml(machine))``."""

    def __init__(self, machine: FakeMachine) -> None:
        self.machine = machine
        self.initialised = False
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []
        self.event_sets: list[EventSet] = []
        # Constants and error classes, as module attributes.
        for name, value in globals().items():
            if name.startswith(("NVML_", "nvmlEventType")) or name.startswith("NVMLError"):
                setattr(self, name, value)

    # -- helpers ---------------------------------------------------------

    def _check(self) -> None:
        if not self.initialised:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def _gpu(self, handle: Handle) -> FakeGpu:
        self._check()
        gpu = self.machine.gpus[handle.index]
        if gpu.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return gpu

    def present(self) -> list[int]:
        return list(range(len(self.machine.gpus)))

    # -- library ---------------------------------------------------------

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.machine.init_error is not None:
            raise NVMLError(self.machine.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._check()
        self.shutdown_calls += 1
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check()
        return self.machine.driver

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        self._check()
        return self.machine.cuda

    def nvmlDeviceGetCount(self) -> int:
        self._check()
        return len(self.machine.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle:
        self._check()
        if not 0 <= index < len(self.machine.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if self.machine.gpus[index].lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return Handle(index)

    # -- identity --------------------------------------------------------

    def nvmlDeviceGetUUID(self, handle: Handle) -> str:
        gpu = self._gpu(handle)
        if handle.mig is not None:
            assert gpu.mig is not None
            return gpu.mig[handle.mig].uuid
        return gpu.uuid

    def nvmlDeviceGetName(self, handle: Handle) -> str:
        gpu = self._gpu(handle)
        if handle.mig is not None:
            assert gpu.mig is not None
            return f"{gpu.name} MIG {gpu.mig[handle.mig].profile}"
        return gpu.name

    def nvmlDeviceGetMinorNumber(self, handle: Handle) -> int:
        return self._gpu(handle).minor

    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: Any = None) -> Any:
        gpu = self._gpu(handle)
        mib = gpu.memory_mib
        if handle.mig is not None:
            assert gpu.mig is not None
            mib = gpu.mig[handle.mig].memory_mib
        total = mib * 1024 * 1024
        used = min(total, gpu.memory_used_mib * 1024 * 1024)
        return types.SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: Handle) -> tuple[int, int]:
        return self._gpu(handle).cc

    def nvmlDeviceGetPciInfo(self, handle: Handle) -> Any:
        gpu = self._gpu(handle)
        return types.SimpleNamespace(busId=gpu.bus_id.encode(), busIdLegacy=gpu.bus_id[4:].encode())

    nvmlDeviceGetPciInfo_v3 = nvmlDeviceGetPciInfo

    def nvmlDeviceGetNumaNodeId(self, handle: Handle) -> int:
        gpu = self._gpu(handle)
        if gpu.gpu_numa_id is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.gpu_numa_id

    def nvmlDeviceGetMemoryAffinity(self, handle: Handle, node_set_size: int, scope: int) -> list[int]:
        gpu = self._gpu(handle)
        nodes = gpu.numa_nodes or (() if gpu.numa is None else (gpu.numa,))
        if not nodes or scope != NVML_AFFINITY_SCOPE_NODE:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        words = [0] * node_set_size
        for node in nodes:
            words[node // 64] |= 1 << (node % 64)
        return words

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Handle) -> int:
        return self._gpu(handle).pcie_gen

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Handle) -> int:
        return self._gpu(handle).pcie_width

    # -- MIG -------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: Handle) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        mode = NVML_DEVICE_MIG_ENABLE if gpu.mig_enabled else NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Handle) -> int:
        gpu = self._gpu(handle)
        if gpu.mig is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Handle, index: int) -> Handle:
        gpu = self._gpu(handle)
        if gpu.mig is None or not gpu.mig_enabled:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if index >= len(gpu.mig):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return Handle(handle.index, mig=index)

    def _mig_of(self, handle: Handle) -> FakeMig:
        gpu = self._gpu(handle)
        if handle.mig is None or gpu.mig is None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.mig[handle.mig]

    def nvmlDeviceGetAttributes(self, handle: Handle) -> Any:
        mig = self._mig_of(handle)
        return types.SimpleNamespace(
            gpuInstanceSliceCount=mig.slices,
            computeInstanceSliceCount=mig.slices,
            memorySizeMB=mig.memory_mib,
        )

    def nvmlDeviceGetGpuInstanceId(self, handle: Handle) -> int:
        self._mig_of(handle)
        assert handle.mig is not None
        return 10 + handle.mig  # GPU instance ids are not the MIG device indices

    def nvmlDeviceGetComputeInstanceId(self, handle: Handle) -> int:
        return self._mig_of(handle).ci

    def nvmlDeviceGetGpuInstanceById(self, handle: Handle, gi_id: int) -> Handle:
        if handle.mig is not None:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)  # asked of the parent GPU
        return Handle(handle.index, mig=gi_id - 10)

    def nvmlGpuInstanceGetInfo(self, gpu_instance: Handle) -> Any:
        mig = self._mig_of(gpu_instance)
        placement = types.SimpleNamespace(start=mig.start, size=mig.size)
        return types.SimpleNamespace(id=10 + (gpu_instance.mig or 0), placement=placement)

    # -- NVLink and topology -----------------------------------------------

    def _link(self, handle: Handle, link: int) -> FakeLink:
        gpu = self._gpu(handle)
        if gpu.nvlinks is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(gpu.nvlinks):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, handle: Handle, link: int) -> int:
        self.calls.append("nvmlDeviceGetNvLinkState")
        return NVML_SUCCESS + 1 if self._link(handle, link).active else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Handle, link: int) -> Any:
        ln = self._link(handle, link)
        if not ln.active:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(busId=ln.remote_bus_id.encode())

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Handle, link: int) -> int:
        gpu = self._gpu(handle)
        if not gpu.remote_type_supported:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        return self._link(handle, link).remote_type

    def nvmlDeviceGetNvLinkVersion(self, handle: Handle, link: int) -> int:
        return self._link(handle, link).version

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: Handle, h2: Handle) -> int:
        self._gpu(h1)
        self._gpu(h2)
        a, b = sorted((h1.index, h2.index))
        return self.machine.topology.get((a, b), NVML_TOPOLOGY_SYSTEM)

    # -- metrics ---------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Handle) -> Any:
        return types.SimpleNamespace(gpu=self._gpu(handle).utilization, memory=10)

    def nvmlDeviceGetTemperature(self, handle: Handle, sensor: int) -> int:
        return self._gpu(handle).temperature

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> list[Any]:
        return [
            types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self._gpu(handle).processes
        ]

    def nvmlDeviceGetPowerUsage(self, handle: Handle) -> int:
        gpu = self._gpu(handle)
        if not gpu.power_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.power_mw

    # -- events ----------------------------------------------------------

    def nvmlEventSetCreate(self) -> EventSet:
        self._check()
        es = EventSet()
        self.event_sets.append(es)
        return es

    def nvmlDeviceRegisterEvents(self, handle: Handle, mask: int, event_set: EventSet) -> None:
        gpu = self._gpu(handle)
        if not gpu.events_supported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        event_set.registered[handle.index] = mask

    def nvmlEventSetWait_v2(self, event_set: EventSet, timeout_ms: int) -> Any:
        self._check()
        with event_set.cond:
            if not event_set.queue:
                event_set.cond.wait(timeout_ms / 1000.0)
            if not event_set.queue:
                raise NVMLError(NVML_ERROR_TIMEOUT)
            item = event_set.queue.pop(0)
        if isinstance(item, NVMLError):
            raise item
        return item

    nvmlEventSetWait = nvmlEventSetWait_v2

    def nvmlEventSetFree(self, event_set: EventSet) -> None:
        event_set.freed = True

    # -- test controls ---------------------------------------------------

    def _post(self, index: int | None, event_type: int, data: int) -> None:
        for es in self.event_sets:
            if es.freed:
                continue
            if index is not None and not (es.registered.get(index, 0) & event_type):
                continue
            device = Handle(index) if index is not None else None
            event = types.SimpleNamespace(
                device=device,
                eventType=event_type,
                eventData=data,
                gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0,
            )
            with es.cond:
                es.queue.append(event)
                es.cond.notify_all()

    def inject_xid(self, index: int | None, xid: int) -> None:
        """An XID critical error on GPU ``index`` (None: a device NVML cannot name)."""
        self._post(index, nvmlEventTypeXidCriticalError, xid)

    def inject_double_bit_ecc(self, index: int) -> None:
        self._post(index, nvmlEventTypeDoubleBitEccError, 0)


# ----------------------------------------------------------------- machines


def _uuid(box: int, i: int) -> str:
    return f"GPU-{box:08x}-0000-4000-8000-{i:012x}"


def h100_nvswitch_box() -> FakeMachine:
    """HGX H100: 8 GPUs, 18 NVLink 4.0 links each to 4 NVSwitches (5/4/4/5), NUMA 0/1."""
    buses = ["1B", "43", "52", "61", "9D", "C3", "D1", "DF"]
    switches = ["00000000:05:00.0", "00000000:06:00.0", "00000000:07:00.0", "00000000:08:00.0"]
    per_switch = [5, 4, 4, 5]
    gpus = []
    for i, bus in enumerate(buses):
        links = [
            FakeLink(
                remote_bus_id=sw, remote_type=NVML_NVLINK_DEVICE_TYPE_SWITCH, version=NVML_NVLINK_VERSION_4_0
            )
            for sw, n in zip(switches, per_switch, strict=True)
            for _ in range(n)
        ]
        gpus.append(
            FakeGpu(
                uuid=_uuid(0xA, i),
                name="NVIDIA H100 80GB HBM3",
                bus_id=f"00000000:{bus}:00.0",
                minor=i,
                memory_mib=81559,
                cc=(9, 0),
                numa=i // 4,
                nvlinks=links,
                mig=[],
            )
        )
    topology = {
        (a, b): NVML_TOPOLOGY_NODE if a // 4 == b // 4 else NVML_TOPOLOGY_SYSTEM
        for a in range(8)
        for b in range(a + 1, 8)
    }
    return FakeMachine(gpus=gpus, topology=topology)


def pcie_bridged_box() -> FakeMachine:
    """4x A100 PCIe, NVLink bridges 0-2 and 1-3 (12 links, NVLink 3.1), no NUMA API."""
    buses = ["00000000:17:00.0", "00000000:18:00.0", "00000000:CA:00.0", "00000000:CB:00.0"]
    peers = {0: 2, 2: 0, 1: 3, 3: 1}
    gpus = []
    for i, bus in enumerate(buses):
        links = [
            FakeLink(remote_bus_id=buses[peers[i]], remote_type=NVML_NVLINK_DEVICE_TYPE_GPU, version=5)
            for _ in range(12)
        ]
        gpus.append(
            FakeGpu(
                uuid=_uuid(0xB, i),
                name="NVIDIA A100 80GB PCIe",
                bus_id=bus,
                minor=i,
                memory_mib=81920,
                cc=(8, 0),
                numa=None,
                pcie_gen=4,
                nvlinks=links,
                mig=[],
            )
        )
    topology = {
        (0, 1): NVML_TOPOLOGY_SINGLE,
        (2, 3): NVML_TOPOLOGY_SINGLE,
        (0, 2): NVML_TOPOLOGY_SYSTEM,
        (0, 3): NVML_TOPOLOGY_SYSTEM,
        (1, 2): NVML_TOPOLOGY_SYSTEM,
        (1, 3): NVML_TOPOLOGY_SYSTEM,
    }
    return FakeMachine(gpus=gpus, topology=topology, cuda=12080, driver="570.172.08")


def consumer_box() -> FakeMachine:
    """2x RTX 4090: no NVLink, no MIG, no NUMA API, no power reading, PIX."""
    gpus = [
        FakeGpu(
            uuid=_uuid(0xC, i),
            name="NVIDIA GeForce RTX 4090",
            bus_id=f"00000000:0{i + 1}:00.0",
            minor=i,
            memory_mib=24564,
            cc=(8, 9),
            pcie_gen=4,
            nvlinks=None,
            mig=None,
            power_supported=False,
            events_supported=False,
        )
        for i in range(2)
    ]
    return FakeMachine(gpus=gpus, topology={(0, 1): NVML_TOPOLOGY_SINGLE})


def a100_mig_box() -> FakeMachine:
    """One A100 40GB with MIG on: 3g.20gb and 2x 1g.5gb."""
    gpu = FakeGpu(
        uuid=_uuid(0xD, 0),
        name="NVIDIA A100-SXM4-40GB",
        bus_id="00000000:07:00.0",
        minor=0,
        memory_mib=40960,
        cc=(8, 0),
        numa=0,
        pcie_gen=4,
        nvlinks=[],
        mig=[
            FakeMig(
                uuid="MIG-11111111-2222-3333-4444-555555555555",
                profile="3g.20gb",
                memory_mib=19968,
                slices=3,
                start=4,
                size=4,
            ),
            FakeMig(
                uuid="MIG-11111111-2222-3333-4444-666666666666", profile="1g.5gb", memory_mib=4864, start=0
            ),
            FakeMig(
                uuid="MIG-11111111-2222-3333-4444-777777777777", profile="1g.5gb", memory_mib=4864, start=1
            ),
        ],
        mig_enabled=True,
    )
    return FakeMachine(gpus=[gpu])
