"""``agent.nvml`` against ``fake_pynvml``: NVSwitch and bridged boxes, failures, events."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent import health, inventory, nvml
from gpualloc.api import constants
from tests.unit import fake_pynvml as fake


def _source(
    machine: fake.FakeMachine, sysfs: Path | str = "/nonexistent-sysfs"
) -> tuple[nvml.NvmlSource, fake.FakeNvml]:
    lib = fake.FakeNvml(machine)
    return nvml.NvmlSource(nvml_module=lib, sysfs_root=sysfs), lib


def test_fake_errors_are_subclasses_by_code_like_pynvml() -> None:
    err = fake.NVMLError(fake.NVML_ERROR_NOT_SUPPORTED)
    assert type(err).__name__ == "NVMLError_NotSupported"
    assert isinstance(err, fake.NVMLError) and err.value == 3
    lost = fake.NVMLError_GpuIsLost()  # type: ignore[attr-defined]
    assert lost.value == fake.NVML_ERROR_GPU_IS_LOST
    assert str(fake.NVMLError(fake.NVML_ERROR_LIBRARY_NOT_FOUND)) == "NVML Shared Library Not Found"


def test_nvswitch_h100_box_reads_every_pair_as_nv18_900_one_island() -> None:
    source, _ = _source(fake.h100_nvswitch_box())
    facts = source.scan()
    inv = inventory.derive(facts)
    assert (inv.driver_version, inv.cuda_version, inv.source) == ("580.95.05", "13.0", "nvml")
    assert {(ln.type, ln.bandwidth_gbps) for ln in inv.links} == {("NV18", 900)}
    assert inv.islands == ((0, 1, 2, 3, 4, 5, 6, 7),)
    first = inv.devices[0]
    assert first.pci_bus_id == "0000:1b:00.0"  # NVML's 00000000:1B:00.0, sysfs form
    assert (first.product, first.memory_mib, first.compute_capability) == (
        "NVIDIA H100 80GB HBM3",
        81559,
        "9.0",
    )
    assert (first.pcie_generation, first.pcie_width) == (5, 16)
    assert [d.numa_node for d in inv.devices] == [0, 0, 0, 0, 1, 1, 1, 1]  # nvmlDeviceGetMemoryAffinity
    assert facts.devices[0].nvlinks[0].remote_type == fake.NVML_NVLINK_DEVICE_TYPE_SWITCH
    assert len(facts.devices[0].nvlinks) == 18


def test_nvswitch_box_without_remote_device_type_still_finds_the_switches() -> None:
    machine = fake.h100_nvswitch_box()
    for gpu in machine.gpus:
        gpu.remote_type_supported = False  # FUNCTION_NOT_FOUND on old drivers
    source, _ = _source(machine)
    facts = source.scan()
    assert facts.devices[0].nvlinks[0].remote_type is None
    assert {ln.type for ln in inventory.derive(facts).links} == {"NV18"}


def test_pcie_box_with_bridges_on_0_2_and_1_3_and_numa_from_sysfs(tmp_path: Path) -> None:
    for bus, node in [("0000:17:00.0", 0), ("0000:18:00.0", 0), ("0000:ca:00.0", 1)]:  # 0000:cb missing
        folder = tmp_path / "bus" / "pci" / "devices" / bus
        folder.mkdir(parents=True)
        (folder / "numa_node").write_text(f"{node}\n")
    source, _ = _source(fake.pcie_bridged_box(), sysfs=tmp_path)
    inv = inventory.derive(source.scan())
    links = {(ln.a, ln.b): ln for ln in inv.links}
    assert sorted(p for p, ln in links.items() if ln.nvlinks) == [(0, 2), (1, 3)]
    assert (links[(0, 2)].type, links[(0, 2)].bandwidth_gbps) == ("NV12", 600)  # NVLink 3.1, 12 links
    assert (links[(0, 1)].type, links[(0, 1)].bandwidth_gbps) == ("PIX", 64)
    assert (links[(1, 2)].type, links[(1, 2)].bandwidth_gbps) == ("SYS", 32)
    assert [d.numa_node for d in inv.devices] == [0, 0, 1, -1]
    assert inv.cuda_version == "12.8"
    assert inv.islands == ((0, 2), (1, 3))


def test_numa_node_is_the_cpu_side_node_not_the_gpus_own_nor_an_ambiguous_set(tmp_path: Path) -> None:
    """Grace Hopper: nvmlDeviceGetNumaNodeId is the GPU memory's own node, not the socket's.

    Memory affinity naming several nodes says nothing about one socket: sysfs decides,
    and its -1 (no NUMA information, as in many VMs) stays unknown.
    """
    machine = fake.pcie_bridged_box()
    gh, wide, vm, plain = machine.gpus
    gh.numa, gh.gpu_numa_id = 0, 4
    wide.numa, wide.numa_nodes = None, (0, 1)
    vm.numa = None
    plain.numa = 65  # a node in the second word of the node set
    for gpu, node in [(wide, 1), (vm, -1)]:
        folder = tmp_path / "bus" / "pci" / "devices" / inventory.normalize_bus_id(gpu.bus_id)
        folder.mkdir(parents=True)
        (folder / "numa_node").write_text(f"{node}\n")
    source, _ = _source(machine, sysfs=tmp_path)
    inv = inventory.derive(source.scan())
    assert [d.numa_node for d in inv.devices] == [0, 1, -1, 65]


def test_optional_calls_that_are_not_supported_leave_fields_unknown() -> None:
    source, lib = _source(fake.consumer_box())
    facts = source.scan()
    inv = inventory.derive(facts)
    assert all(d.nvlinks == () for d in facts.devices)  # NVLink NOT_SUPPORTED
    assert all(d.mig is None for d in inv.devices)  # MIG NOT_SUPPORTED
    assert [d.numa_node for d in inv.devices] == [-1, -1]  # no NUMA API, no sysfs
    assert inv.links[0].type == "PIX"
    # One NVLink state call per GPU: NOT_SUPPORTED on link 0 ends the walk.
    assert lib.calls.count("nvmlDeviceGetNvLinkState") == 2
    samples = source.samples()
    assert [s.power_watts for s in samples] == [None, None]  # power NOT_SUPPORTED
    assert samples[0].utilization_percent == 37.0
    assert samples[0].temperature_celsius == 41.0
    assert samples[0].memory_total_bytes == 24564 * 1024 * 1024


def test_mig_devices_are_read_with_uuid_profile_memory_placement_and_slices() -> None:
    source, _ = _source(fake.a100_mig_box())
    device = inventory.derive(source.scan()).devices[0]
    assert device.mig is not None and device.mig.enabled
    # (index, profile, MiB, first memory slice, memory slices, compute slices): the placement comes
    # from the GPU instance (its id is not the MIG device's index), asked of the parent GPU.
    assert [
        (m.index, m.profile, m.memory_mib, m.placement_start, m.memory_slices, m.compute_slices)
        for m in device.mig.devices
    ] == [
        (0, "3g.20gb", 19968, 4, 4, 3),
        (1, "1g.5gb", 4864, 0, 1, 1),
        (2, "1g.5gb", 4864, 1, 1, 1),
    ]
    assert device.mig.devices[0].uuid == "MIG-11111111-2222-3333-4444-555555555555"


def test_mig_placement_is_unknown_where_the_driver_does_not_say(monkeypatch: pytest.MonkeyPatch) -> None:
    source, lib = _source(fake.a100_mig_box())
    monkeypatch.delattr(type(lib), "nvmlGpuInstanceGetInfo")
    device = inventory.derive(source.scan()).devices[0]
    assert device.mig is not None
    assert {(m.placement_start, m.memory_slices) for m in device.mig.devices} == {(-1, 0)}
    assert [m.compute_slices for m in device.mig.devices] == [3, 1, 1]


def _access_file(proc: Path, relative: str, minor: int) -> None:
    path = proc / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")


def test_mig_instances_carry_nvmls_instance_ids_and_the_cap_minors_of_their_access_files(
    tmp_path: Path,
) -> None:
    machine = fake.a100_mig_box()
    machine.gpus[0].minor = 3
    assert machine.gpus[0].mig is not None
    machine.gpus[0].mig[1].ci = 2
    # The fake's GPU instance ids are 10 + the MIG device's index.
    _access_file(tmp_path, "driver/nvidia/capabilities/gpu3/mig/gi10/access", 408)
    _access_file(tmp_path, "driver/nvidia/capabilities/gpu3/mig/gi10/ci0/access", 409)
    _access_file(tmp_path, "driver/nvidia/capabilities/gpu3/mig/gi11/access", 417)
    _access_file(tmp_path, "driver/nvidia/capabilities/gpu3/mig/gi11/ci2/access", 420)
    lib = fake.FakeNvml(machine)
    source = nvml.NvmlSource(nvml_module=lib, sysfs_root="/nonexistent-sysfs", proc_root=tmp_path)

    facts = source.scan().devices[0]

    assert [
        (i.uuid[-4:], i.gpu_instance, i.compute_instance, i.gpu_instance_cap, i.compute_instance_cap)
        for i in facts.mig_instances
    ] == [
        ("5555", 10, 0, 408, 409),
        ("6666", 11, 2, 417, 420),
        ("7777", 12, 0, None, None),  # no access files, no mig-minors: not known
    ]


def test_mig_cap_minors_come_from_mig_minors_where_the_access_files_are_missing(tmp_path: Path) -> None:
    (tmp_path / "driver" / "nvidia-caps").mkdir(parents=True)
    (tmp_path / "driver" / "nvidia-caps" / "mig-minors").write_text(
        "config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\n"
        "gpu1/gi2/access 156\ngpu1/gi2/ci0/access 157\ngpu1/gi2/ci1/access 158\n"
    )
    _access_file(tmp_path, "driver/nvidia/capabilities/gpu1/mig/gi2/access", 156)

    assert nvml.read_mig_caps(tmp_path, 1, 2, 1) == (156, 158)
    assert nvml.read_mig_caps(tmp_path, 0, 0, 0) == (3, 4)
    assert nvml.read_mig_caps(tmp_path, 0, 5, 0) == (None, None)
    assert nvml.read_mig_caps(tmp_path / "missing", 0, 0, 0) == (None, None)


def test_a_driver_without_compute_instance_ids_leaves_the_instances_unknown_not_the_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source, lib = _source(fake.a100_mig_box())
    monkeypatch.delattr(type(lib), "nvmlDeviceGetComputeInstanceId")

    facts = source.scan().devices[0]

    assert facts.mig is not None and len(facts.mig.devices) == 3
    assert facts.mig_instances == ()


def test_mig_capable_gpu_with_mig_off_says_disabled() -> None:
    source, _ = _source(fake.h100_nvswitch_box())
    device = inventory.derive(source.scan()).devices[0]
    assert device.mig is not None and not device.mig.enabled


@pytest.mark.parametrize(
    ("code", "text"),
    [
        (fake.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found"),
        (fake.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"),
    ],
)
def test_init_failure_raises_source_unavailable_with_the_nvml_error_then_recovers(
    code: int, text: str
) -> None:
    machine = fake.h100_nvswitch_box()
    machine.init_error = code
    source, lib = _source(machine)
    with pytest.raises(inventory.SourceUnavailable, match=text):
        source.scan()
    with pytest.raises(inventory.SourceUnavailable):
        source.scan()
    assert lib.init_calls == 2  # every scan tries again
    machine.init_error = None
    assert len(source.scan().devices) == 8
    assert source.generation == 1


def test_gpu_is_lost_keeps_the_device_with_its_last_facts_and_a_lost_reason() -> None:
    machine = fake.h100_nvswitch_box()
    source, _ = _source(machine)
    first = source.scan()
    machine.gpus[3].lost = True
    facts = health.carry_lost(first, source.scan())
    inv = inventory.derive(facts)
    lost = inv.devices[3]
    assert (lost.uuid, lost.health, lost.health_reason) == (
        machine.gpus[3].uuid,
        constants.UNHEALTHY,
        "lost: GPU is lost",
    )
    assert lost.pci_bus_id == "0000:61:00.0"
    assert (inv.total, inv.healthy) == (8, 7)
    links = {(ln.a, ln.b): ln for ln in inv.links}
    assert links[(3, 4)].type == "NV18"  # its last known wiring is kept
    assert [s.index for s in source.samples()] == [0, 1, 2, 4, 5, 6, 7]


def test_gpu_missing_from_a_rescan_is_published_as_lost() -> None:
    machine = fake.pcie_bridged_box()
    source, _ = _source(machine)
    first = source.scan()
    gone = machine.gpus.pop()  # fell off the bus: NVML no longer counts it
    facts = health.carry_lost(first, source.scan())
    inv = inventory.derive(facts)
    assert [d.uuid for d in inv.devices][-1] == gone.uuid
    assert (inv.devices[-1].health, inv.devices[-1].health_reason) == (
        constants.UNHEALTHY,
        "lost: missing from re-scan",
    )
    assert {(ln.a, ln.b) for ln in inv.links if ln.nvlinks} == {(0, 2), (1, 3)}


def test_device_count_failure_resets_so_the_next_scan_initialises_again() -> None:
    machine = fake.h100_nvswitch_box()
    source, lib = _source(machine)
    source.scan()

    def broken() -> int:
        raise fake.NVMLError(fake.NVML_ERROR_UNKNOWN)

    lib.nvmlDeviceGetCount = broken  # type: ignore[method-assign]
    with pytest.raises(inventory.SourceUnavailable, match="Unknown Error"):
        source.scan()
    del lib.nvmlDeviceGetCount
    source.scan()
    assert (lib.init_calls, lib.shutdown_calls, source.generation) == (2, 1, 2)


# ------------------------------------------------------------------- events


@contextlib.asynccontextmanager
async def _collecting(
    machine: fake.FakeMachine, tracker: health.HealthTracker
) -> AsyncIterator[tuple[fake.FakeNvml, health.EventThread]]:
    """``machine``'s NVML events applied to ``tracker`` by an EventThread, stopped afterwards."""
    source, lib = _source(machine)
    source.scan()
    loop = asyncio.get_running_loop()
    thread = health.EventThread(source.open_events(), loop, tracker.apply, timeout_ms=50)
    thread.start()
    try:
        yield lib, thread
    finally:
        thread.stop()
        await asyncio.to_thread(thread.join, 2.0)


async def _wait_for(condition: object, seconds: float = 2.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_xid_and_ecc_events_mark_devices_unhealthy_and_application_xids_are_ignored() -> None:
    machine = fake.h100_nvswitch_box()
    tracker = health.HealthTracker()
    async with _collecting(machine, tracker) as (lib, thread):
        uuids = [g.uuid for g in machine.gpus]
        lib.inject_xid(2, 13)  # application XID: ignored
        lib.inject_xid(3, 79)  # fell off the bus
        lib.inject_double_bit_ecc(5)
        await _wait_for(lambda: len(tracker.marks(uuids)) == 2)
        await asyncio.sleep(0.2)
        assert tracker.marks(uuids) == {uuids[3]: "XID 79", uuids[5]: "double-bit ECC error"}
    assert not thread.alive
    assert lib.event_sets[0].freed
    assert sorted(lib.event_sets[0].registered) == list(range(8))
    assert (
        lib.event_sets[0].registered[0]
        == fake.nvmlEventTypeXidCriticalError | fake.nvmlEventTypeDoubleBitEccError
    )


async def test_xid_from_a_device_nvml_cannot_name_marks_every_device() -> None:
    machine = fake.pcie_bridged_box()
    tracker = health.HealthTracker()
    async with _collecting(machine, tracker) as (lib, _):
        lib.inject_xid(None, 48)
        uuids = [g.uuid for g in machine.gpus]
        await _wait_for(lambda: len(tracker.marks(uuids)) == 4)
        assert set(tracker.marks(uuids).values()) == {"XID 48"}


async def test_configured_ignored_xids_replace_the_default_list() -> None:
    machine = fake.pcie_bridged_box()
    tracker = health.HealthTracker(health.parse_xids("79"))
    async with _collecting(machine, tracker) as (lib, _):
        lib.inject_xid(0, 79)
        lib.inject_xid(1, 13)
        await _wait_for(lambda: bool(tracker.marks([machine.gpus[1].uuid])))
        await asyncio.sleep(0.2)
        assert tracker.marks([g.uuid for g in machine.gpus]) == {machine.gpus[1].uuid: "XID 13"}


def test_devices_without_event_support_are_listed_not_fatal() -> None:
    source, _ = _source(fake.consumer_box())
    source.scan()
    events = source.open_events()
    assert events.registered == [] and len(events.unsupported) == 2
    assert events.wait(10) == []  # a timeout is no event
    events.close()


async def test_event_thread_stops_within_one_wait_timeout() -> None:
    source, _lib = _source(fake.h100_nvswitch_box())
    source.scan()
    thread = health.EventThread(
        source.open_events(), asyncio.get_running_loop(), lambda e: None, timeout_ms=200
    )
    thread.start()
    await asyncio.sleep(0.05)
    started = time.monotonic()
    thread.stop()
    await asyncio.to_thread(thread.join, 2.0)
    assert not thread.alive
    assert time.monotonic() - started < 0.6


def test_compute_processes_are_sampled_with_their_pod_from_the_hosts_proc(tmp_path: Path) -> None:
    machine = fake.consumer_box()
    machine.gpus[1].processes = [(4242, 2 * 1024**3), (77, None)]
    pod = "0c4b7a8e-1111-4222-8333-944455556666"
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{pod}/abc\n")
    lib = fake.FakeNvml(machine)
    source = nvml.NvmlSource(nvml_module=lib, sysfs_root="/nonexistent-sysfs", proc_root=tmp_path)
    source.scan()
    processes = {s.index: s.processes for s in source.samples()}
    assert processes[0] == ()
    # 77's /proc entry is not there (another PID namespace): its pod is not known.
    assert processes[1] == (
        inventory.GpuProcess(pid=4242, used_memory_mib=2048, pod_uid=pod),
        inventory.GpuProcess(pid=77, used_memory_mib=0, pod_uid=""),
    )
