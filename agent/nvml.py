"""The NVML source: the only module that imports ``pynvml`` (from nvidia-ml-py).

``NvmlSource`` reads what ``inventory`` needs, per device: index, minor, UUID,
name, memory, compute capability, PCI bus id (normalised to the sysfs form),
NUMA node (NVML's memory affinity, else sysfs), max PCIe generation and
width, MIG mode and MIG devices (with each one's GPU and compute instance ids,
and the minors of their ``/dev/nvidia-caps`` nodes from /proc: ``read_mig_caps``),
and every NVLink's state, far end (PCI bus id and device type) and version; per
pair of devices the common-ancestor level.

Calls that some devices do not support (NUMA, MIG, NVLink on consumer cards,
remote device type on old drivers, power and temperature) tolerate
NOT_SUPPORTED, FUNCTION_NOT_FOUND and the like and leave the field unknown.
``GPU_IS_LOST`` (or any failure to read a device that was seen before) reports
that device as lost with its last known facts; ``health.carry_lost`` keeps the
PCIe levels of its pairs from the previous scan. Failures of the library itself
(init, device count) raise ``inventory.SourceUnavailable`` and make the next
``scan`` initialise again.

The module to use can be injected (``nvml_module=``), which is how the unit
tests drive it with ``tests/unit/fake_pynvml.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from agent import health, inventory
from gpualloc.api import models

log = logging.getLogger(__name__)

T = TypeVar("T")

MIB = 1024 * 1024
DEFAULT_MAX_NVLINKS = 18
NODE_SET_WORDS = 4  # 64-bit words of the node set asked of nvmlDeviceGetMemoryAffinity: 256 NUMA nodes


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace").rstrip("\x00")
    return str(value)


def read_mig_caps(
    proc_root: Path, gpu_minor: int, gpu_instance: int, compute_instance: int
) -> tuple[int | None, int | None]:
    """The minors of the ``nvidia-cap`` nodes of GPU instance ``gpu_instance`` of GPU ``gpu_minor``
    and of its compute instance ``compute_instance``: from their ``access`` files under
    ``proc_root``, else from the driver's ``mig-minors``; None for one that neither tells."""

    def read(relative: str) -> str:
        try:
            return (proc_root / relative).read_text()
        except OSError:
            return ""

    gi_cap = inventory.parse_cap_access(read(inventory.mig_cap_access_path(gpu_minor, gpu_instance)))
    ci_cap = inventory.parse_cap_access(
        read(inventory.mig_cap_access_path(gpu_minor, gpu_instance, compute_instance))
    )
    if gi_cap is None or ci_cap is None:
        table = inventory.parse_mig_minors(read(inventory.MIG_MINORS))
        if gi_cap is None:
            gi_cap = table.get(inventory.mig_cap_name(gpu_minor, gpu_instance))
        if ci_cap is None:
            ci_cap = table.get(inventory.mig_cap_name(gpu_minor, gpu_instance, compute_instance))
    return gi_cap, ci_cap


class NvmlSource:
    """``inventory.Source`` over NVML."""

    def __init__(
        self,
        *,
        nvml_module: Any | None = None,
        sysfs_root: str | Path = "/sys",
        proc_root: str | Path = "/proc",
    ) -> None:
        self._module = nvml_module
        self._sysfs = Path(sysfs_root)
        self._proc = Path(proc_root)  # the host's: a GPU process's pod (needs hostPID), MIG caps
        self._initialised = False
        self._lock = threading.Lock()
        self.generation = 0  # incremented on every successful init
        self._handles: dict[int, tuple[str, Any]] = {}  # index -> (uuid, handle) from the last scan
        self._known: dict[int, inventory.DeviceFacts] = {}  # index -> last facts read

    # ------------------------------------------------------------- library

    @property
    def name(self) -> str:
        return "nvml"

    @property
    def nvml(self) -> Any:
        if self._module is None:
            try:
                import pynvml  # the only import of pynvml in gpualloc

                self._module = pynvml
            except ImportError as exc:
                raise inventory.SourceUnavailable(
                    f"the pynvml module (nvidia-ml-py) is missing: {exc}"
                ) from exc
        return self._module

    def _code(self, exc: BaseException) -> int | None:
        value = getattr(exc, "value", None)
        return value if isinstance(exc, self.nvml.NVMLError) and isinstance(value, int) else None

    def _is(self, exc: BaseException, *names: str) -> bool:
        code = self._code(exc)
        return code is not None and any(code == getattr(self.nvml, n, object()) for n in names)

    def _describe(self, exc: BaseException) -> str:
        code = self._code(exc)
        if code is None:
            return f"{type(exc).__name__}: {exc}"
        return f"{exc} (NVML error {code})"

    def _optional(self, fn_name: str, *args: Any) -> Any:
        """Call an NVML function a device may not support; None when it does not."""
        fn: Callable[..., Any] | None = getattr(self.nvml, fn_name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            if self._is(exc, "NVML_ERROR_GPU_IS_LOST"):
                raise
            if not self._is(
                exc,
                "NVML_ERROR_NOT_SUPPORTED",
                "NVML_ERROR_FUNCTION_NOT_FOUND",
                "NVML_ERROR_NOT_FOUND",
                "NVML_ERROR_NO_PERMISSION",
                "NVML_ERROR_INVALID_ARGUMENT",
                "NVML_ERROR_NO_DATA",
                "NVML_ERROR_NOT_READY",
            ):
                log.debug("optional NVML call failed", extra={"call": fn_name, "error": self._describe(exc)})
            return None

    def init(self) -> None:
        """``nvmlInit``; raises SourceUnavailable with NVML's error."""
        with self._lock:
            if self._initialised:
                return
            nvml = self.nvml  # SourceUnavailable when pynvml is missing
            try:
                nvml.nvmlInit()
            except Exception as exc:
                raise inventory.SourceUnavailable(f"nvmlInit failed: {self._describe(exc)}") from exc
            self._initialised = True
            self.generation += 1
            log.info("NVML initialised", extra={"generation": self.generation})

    def close(self) -> None:
        with self._lock:
            if self._initialised:
                try:
                    self.nvml.nvmlShutdown()
                except Exception:
                    log.warning("nvmlShutdown failed", exc_info=True)
                self._initialised = False

    # ---------------------------------------------------------------- scan

    def scan(self) -> inventory.NodeFacts:
        self.init()
        nvml = self.nvml
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            self.close()  # the next scan initialises again
            raise inventory.SourceUnavailable(f"NVML unavailable: {self._describe(exc)}") from exc
        cuda_raw = self._optional("nvmlSystemGetCudaDriverVersion_v2")
        if cuda_raw is None:
            cuda_raw = self._optional("nvmlSystemGetCudaDriverVersion")
        cuda = inventory.cuda_version_text(int(cuda_raw)) if cuda_raw is not None else ""

        devices: list[inventory.DeviceFacts] = []
        handles: dict[int, tuple[str, Any]] = {}
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                facts = self._device(index, handle)
            except nvml.NVMLError as exc:
                lost = self._lost(index, exc)
                if lost is not None:
                    devices.append(lost)
                continue
            devices.append(facts)
            handles[index] = (facts.uuid, handle)

        ancestors: dict[tuple[int, int], int] = {}
        indices = sorted(handles)
        for i, a in enumerate(indices):
            for b in indices[i + 1 :]:
                level = self._optional("nvmlDeviceGetTopologyCommonAncestor", handles[a][1], handles[b][1])
                if level is not None:
                    ancestors[(a, b)] = int(level)
        self._handles = handles
        self._known.update({d.index: d for d in devices if not d.lost})
        return inventory.NodeFacts(
            source="nvml",
            driver_version=driver,
            cuda_version=cuda,
            devices=tuple(devices),
            common_ancestors=ancestors,
        )

    def _lost(self, index: int, exc: BaseException) -> inventory.DeviceFacts | None:
        reason = (
            "lost: GPU is lost" if self._is(exc, "NVML_ERROR_GPU_IS_LOST") else f"lost: {self._describe(exc)}"
        )
        known = self._known.get(index)
        log.error(
            "cannot read GPU",
            extra={"index": index, "error": self._describe(exc), "known": known is not None},
        )
        if known is None:
            return None
        return dataclasses.replace(known, lost=reason)

    def _device(self, index: int, handle: Any) -> inventory.DeviceFacts:
        nvml = self.nvml
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        product = _text(nvml.nvmlDeviceGetName(handle))
        memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB
        pci = nvml.nvmlDeviceGetPciInfo(handle)
        bus_id = inventory.normalize_bus_id(pci.busId)
        minor = self._optional("nvmlDeviceGetMinorNumber", handle)
        cc = self._optional("nvmlDeviceGetCudaComputeCapability", handle)
        numa = self._numa(handle, bus_id)
        gen = self._optional("nvmlDeviceGetMaxPcieLinkGeneration", handle)
        width = self._optional("nvmlDeviceGetMaxPcieLinkWidth", handle)
        mig, instances = self._mig(handle, int(minor) if minor is not None else index)
        return inventory.DeviceFacts(
            index=index,
            minor=int(minor) if minor is not None else index,
            uuid=uuid,
            product=product,
            memory_mib=memory,
            compute_capability=f"{cc[0]}.{cc[1]}" if cc is not None else "",
            pci_bus_id=bus_id,
            numa_node=numa,
            pcie_generation=int(gen) if gen is not None else 0,
            pcie_width=int(width) if width is not None else 0,
            mig=mig,
            mig_instances=instances,
            nvlinks=self._nvlinks(handle),
        )

    def _numa(self, handle: Any, bus_id: str) -> int:
        """The NUMA node of the CPUs and memory nearest the GPU; -1 when not known.

        NVML's memory affinity at node scope (what ``nvidia-smi topo -m`` prints as
        "NUMA Affinity") when it names exactly one node, else the PCI device's
        ``numa_node`` in sysfs. Not ``nvmlDeviceGetNumaNodeId``: that is the GPU's
        own node on platforms where GPU memory is a NUMA node (Grace Hopper,
        "GPU NUMA ID" in topo -m), not the CPU socket the GPU hangs off.
        """
        scope = getattr(self.nvml, "NVML_AFFINITY_SCOPE_NODE", 0)
        words = self._optional("nvmlDeviceGetMemoryAffinity", handle, NODE_SET_WORDS, scope)
        if words is not None:
            mask = sum(int(word) << 64 * w for w, word in enumerate(words))
            if mask and not mask & (mask - 1):  # exactly one node
                return mask.bit_length() - 1
        try:
            node = int((self._sysfs / "bus" / "pci" / "devices" / bus_id / "numa_node").read_text().strip())
        except (OSError, ValueError):
            return -1
        return max(node, -1)

    def _mig(
        self, handle: Any, minor: int
    ) -> tuple[models.MigInfo | None, tuple[inventory.MigInstance, ...]]:
        """The GPU's MIG mode and devices, and where each device lives in the driver (its GPU and
        compute instance ids, and their capability minors from /proc: ``read_mig_caps``)."""
        mode = self._optional("nvmlDeviceGetMigMode", handle)
        if mode is None:
            return None, ()
        current = int(mode[0])
        if current != getattr(self.nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            return models.MigInfo(enabled=False), ()
        count = self._optional("nvmlDeviceGetMaxMigDeviceCount", handle) or 0
        found: list[models.MigDevice] = []
        instances: list[inventory.MigInstance] = []
        for j in range(int(count)):
            mig_handle = self._optional("nvmlDeviceGetMigDeviceHandleByIndex", handle, j)
            if mig_handle is None:
                continue
            uuid = _text(self.nvml.nvmlDeviceGetUUID(mig_handle))
            mem = self._optional("nvmlDeviceGetMemoryInfo", mig_handle)
            attrs = self._optional("nvmlDeviceGetAttributes", mig_handle)
            gi_id = self._optional("nvmlDeviceGetGpuInstanceId", mig_handle)
            ci_id = self._optional("nvmlDeviceGetComputeInstanceId", mig_handle)
            start, size = self._mig_placement(handle, gi_id)
            if gi_id is not None and ci_id is not None:
                gi_cap, ci_cap = read_mig_caps(self._proc, minor, int(gi_id), int(ci_id))
                instances.append(
                    inventory.MigInstance(
                        uuid=uuid,
                        gpu_instance=int(gi_id),
                        compute_instance=int(ci_id),
                        gpu_instance_cap=gi_cap,
                        compute_instance_cap=ci_cap,
                    )
                )
            found.append(
                models.MigDevice(
                    index=j,
                    uuid=uuid,
                    profile=self._mig_profile(mig_handle, attrs),
                    memory_mib=int(mem.total) // MIB if mem is not None else 0,
                    placement_start=start,
                    memory_slices=size,
                    compute_slices=int(attrs.gpuInstanceSliceCount) if attrs is not None else 0,
                )
            )
        return models.MigInfo(enabled=True, devices=tuple(found)), tuple(instances)

    def _mig_profile(self, mig_handle: Any, attrs: Any) -> str:
        """``1g.10gb``: from the MIG device's name, else from its attributes."""
        name = self._optional("nvmlDeviceGetName", mig_handle)
        if name is not None:
            text = _text(name)
            if " MIG " in text:
                return text.rsplit(" MIG ", 1)[1].strip()[:64]
        if attrs is not None:
            gb = round(int(attrs.memorySizeMB) / 1024)
            return f"{int(attrs.gpuInstanceSliceCount)}g.{gb}gb"
        return ""

    def _mig_placement(self, handle: Any, gi_id: Any) -> tuple[int, int]:
        """(first memory slice, memory slices) of GPU instance ``gi_id``; (-1, 0) if unknown."""
        gpu_instance = (
            None if gi_id is None else self._optional("nvmlDeviceGetGpuInstanceById", handle, gi_id)
        )
        info = None if gpu_instance is None else self._optional("nvmlGpuInstanceGetInfo", gpu_instance)
        if info is None:
            return -1, 0
        return int(info.placement.start), int(info.placement.size)

    def _nvlinks(self, handle: Any) -> tuple[inventory.NvLinkEndpoint, ...]:
        nvml = self.nvml
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", DEFAULT_MAX_NVLINKS))
        out: list[inventory.NvLinkEndpoint] = []
        for link in range(max_links):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(handle, link)
            except nvml.NVMLError as exc:
                if self._is(exc, "NVML_ERROR_GPU_IS_LOST"):
                    raise
                if link == 0 and self._is(exc, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND"):
                    break  # no NVLink on this device
                if self._is(exc, "NVML_ERROR_INVALID_ARGUMENT"):
                    break  # past the device's last link
                continue
            except AttributeError:
                break
            if not state:
                out.append(inventory.NvLinkEndpoint(link=link, active=False))
                continue
            pci = self._optional("nvmlDeviceGetNvLinkRemotePciInfo_v2", handle, link)
            if pci is None:
                pci = self._optional("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            remote_type = self._optional("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            version = self._optional("nvmlDeviceGetNvLinkVersion", handle, link)
            out.append(
                inventory.NvLinkEndpoint(
                    link=link,
                    active=True,
                    remote_bus_id=inventory.normalize_bus_id(pci.busId) if pci is not None else "",
                    remote_type=int(remote_type) if remote_type is not None else None,
                    version=int(version) if version is not None else 0,
                )
            )
        return tuple(out)

    # ------------------------------------------------------------- samples

    def samples(self) -> list[inventory.DeviceSample]:
        if not self._initialised:
            return []
        out: list[inventory.DeviceSample] = []
        temp_sensor = getattr(self.nvml, "NVML_TEMPERATURE_GPU", 0)
        for index, (uuid, handle) in sorted(self._handles.items()):
            try:
                util = self._optional("nvmlDeviceGetUtilizationRates", handle)
                mem = self._optional("nvmlDeviceGetMemoryInfo", handle)
                temp = self._optional("nvmlDeviceGetTemperature", handle, temp_sensor)
                power_mw = self._optional("nvmlDeviceGetPowerUsage", handle)
                running = self._optional("nvmlDeviceGetComputeRunningProcesses", handle)
            except self.nvml.NVMLError:  # lost since the scan; the next scan says so
                continue
            out.append(
                inventory.DeviceSample(
                    index=index,
                    uuid=uuid,
                    utilization_percent=float(util.gpu) if util is not None else None,
                    memory_used_bytes=int(mem.used) if mem is not None else None,
                    memory_total_bytes=int(mem.total) if mem is not None else None,
                    temperature_celsius=float(temp) if temp is not None else None,
                    power_watts=float(power_mw) / 1000.0 if power_mw is not None else None,
                    processes=tuple(self._process(p) for p in running or ()),
                    processes_listed=running is not None,
                )
            )
        return out

    def _process(self, info: Any) -> inventory.GpuProcess:
        """One of NVML's process records; its pod from ``/proc/<pid>/cgroup`` where readable."""
        pid = int(info.pid)
        used = getattr(info, "usedGpuMemory", None)  # bytes; None where the driver does not say
        try:
            pod_uid = inventory.pod_uid_of_cgroup((self._proc / str(pid) / "cgroup").read_text())
        except OSError:  # another PID namespace (no hostPID), or the process is gone
            pod_uid = ""
        return inventory.GpuProcess(
            pid=pid, used_memory_mib=int(used) // (1024 * 1024) if used else 0, pod_uid=pod_uid
        )

    # -------------------------------------------------------------- events

    def open_events(self) -> NvmlEvents:
        """An event set registered for XID and double-bit ECC events on every device."""
        return NvmlEvents(self, dict(self._handles))


class NvmlEvents:
    """``health.EventWaiter`` over ``nvmlEventSetWait_v2``."""

    def __init__(self, source: NvmlSource, handles: dict[int, tuple[str, Any]]) -> None:
        self._source = source
        nvml = source.nvml
        self._nvml = nvml
        self._xid = int(nvml.nvmlEventTypeXidCriticalError)
        self._dbe = int(nvml.nvmlEventTypeDoubleBitEccError)
        self._set = nvml.nvmlEventSetCreate()
        self.registered: list[str] = []
        self.unsupported: list[str] = []
        for _index, (uuid, handle) in sorted(handles.items()):
            try:
                nvml.nvmlDeviceRegisterEvents(handle, self._xid | self._dbe, self._set)
                self.registered.append(uuid)
            except nvml.NVMLError as exc:
                # Some devices support XID events but not ECC ones: try XIDs alone.
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, self._xid, self._set)
                    self.registered.append(uuid)
                    continue
                except nvml.NVMLError:
                    pass
                self.unsupported.append(uuid)
                log.warning(
                    "device does not support health events",
                    extra={"uuid": uuid, "error": source._describe(exc)},
                )

    def wait(self, timeout_ms: int) -> list[health.HealthEvent]:
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait_v2(self._set, timeout_ms)
        except nvml.NVMLError as exc:
            if self._source._is(exc, "NVML_ERROR_TIMEOUT"):
                return []
            raise
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
        except Exception:
            uuid = health.ALL_DEVICES
        event_type = int(data.eventType)
        if event_type & self._xid:
            return [health.HealthEvent(uuid=uuid, kind=health.KIND_XID, xid=int(data.eventData))]
        if event_type & self._dbe:
            return [health.HealthEvent(uuid=uuid, kind=health.KIND_ECC)]
        return []

    def close(self) -> None:
        try:
            self._nvml.nvmlEventSetFree(self._set)
        except Exception:
            log.debug("nvmlEventSetFree failed", exc_info=True)
