"""Each GPU's idleSince: set when its last process goes, cleared while one runs, moved only on a
transition (agent.idleness, and the agent publishing it; no API server)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from agent import idleness, inventory, main, nvml, simulated
from tests.unit import fake_pynvml as fake

T0 = dt.datetime(2026, 11, 27, 9, 0, 0, tzinfo=dt.UTC)
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def _sample(uuid: str, *pids: int, listed: bool = True) -> inventory.DeviceSample:
    return inventory.DeviceSample(
        index=0 if uuid == GPU_A else 1,
        uuid=uuid,
        processes=tuple(inventory.GpuProcess(pid=p) for p in pids),
        processes_listed=listed,
    )


def test_a_gpu_never_busy_is_idle_since_first_seen_and_a_busy_one_has_no_value() -> None:
    tracker = idleness.IdleTracker()
    assert tracker.observe([_sample(GPU_A), _sample(GPU_B, 42)], _at(0))
    assert tracker.published() == {GPU_A: "2026-11-27T09:00:00Z"}
    assert tracker.since(GPU_B) is None


def test_idle_since_is_the_first_scan_after_the_last_process_went_and_clears_when_one_starts() -> None:
    tracker = idleness.IdleTracker()
    tracker.observe([_sample(GPU_A, 42)], _at(0))
    assert not tracker.observe([_sample(GPU_A, 42, 43)], _at(10))  # still busy: nothing moves
    assert tracker.observe([_sample(GPU_A)], _at(20))  # the processes went away
    assert tracker.since(GPU_A) == _at(20)
    assert tracker.observe([_sample(GPU_A, 7)], _at(30))  # a new one
    assert tracker.published() == {}


def test_scans_that_find_what_the_last_one_found_change_nothing() -> None:
    tracker = idleness.IdleTracker()
    tracker.observe([_sample(GPU_A), _sample(GPU_B, 1)], _at(0))
    published = tracker.published()
    for tick in range(1, 100):
        assert not tracker.observe([_sample(GPU_A), _sample(GPU_B, 1)], _at(10 * tick))
    assert tracker.published() == published  # the status the publisher compares is the same


def test_a_gpu_missing_from_the_samples_keeps_its_value() -> None:
    tracker = idleness.IdleTracker()
    tracker.observe([_sample(GPU_A), _sample(GPU_B)], _at(0))
    assert not tracker.observe([_sample(GPU_B)], _at(10))  # GPU A not sampled (lost, or a failed read)
    assert tracker.since(GPU_A) == _at(0)


def test_a_gpu_whose_processes_cannot_be_listed_is_not_idle() -> None:
    tracker = idleness.IdleTracker()
    tracker.observe([_sample(GPU_A, listed=False)], _at(0))
    assert tracker.published() == {}
    tracker.observe([_sample(GPU_A)], _at(10))  # listed again, and empty: idle from now, not before
    assert tracker.since(GPU_A) == _at(10)


def test_a_restarted_agent_keeps_the_earlier_idle_since_of_a_gpu_still_idle() -> None:
    tracker = idleness.IdleTracker()
    tracker.observe([_sample(GPU_A), _sample(GPU_B, 9)], _at(600))
    previous = {GPU_A: _at(0), GPU_B: _at(0)}
    assert tracker.carry(previous)
    assert tracker.since(GPU_A) == _at(0)
    assert tracker.since(GPU_B) is None  # busy now: what the old status said no longer holds


def test_a_carried_value_waits_for_the_first_scan_and_never_moves_a_value_later() -> None:
    tracker = idleness.IdleTracker()
    assert not tracker.carry({GPU_A: _at(0), GPU_B: _at(900)})  # nothing scanned yet
    tracker.observe([_sample(GPU_A), _sample(GPU_B)], _at(600))
    assert tracker.since(GPU_A) == _at(0)
    assert tracker.since(GPU_B) == _at(600)  # a future value (a skewed clock) is not taken


def test_a_carried_value_does_not_apply_to_a_gpu_seen_busy_since_the_start() -> None:
    tracker = idleness.IdleTracker()
    tracker.observe([_sample(GPU_A, 5)], _at(600))
    tracker.observe([_sample(GPU_A)], _at(610))
    assert not tracker.carry({GPU_A: _at(0)})
    assert tracker.since(GPU_A) == _at(610)


class _Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now


async def test_the_agent_publishes_idle_since_from_the_simulated_processes() -> None:
    clock = _Clock()
    args = main.parse_args(
        ["--node-name", "sim-1", "--source", "simulated", "--profile", "a100-pcie-4-nvlink"]
    )
    agent = main.Agent(args, wall_clock=clock)
    assert isinstance(agent.source, simulated.SimulatedSource)
    agent.source.set_processes({1: [inventory.GpuProcess(pid=4242)]})
    await agent.scan_once()
    devices = agent.desired().devices
    assert [d.idle_since for d in devices] == [
        "2026-11-27T09:00:00Z",
        None,
        "2026-11-27T09:00:00Z",
        "2026-11-27T09:00:00Z",
    ]
    clock.now = _at(75)
    agent.source.set_processes({})
    await agent.scan_once()
    assert agent.desired().devices[1].idle_since == "2026-11-27T09:01:15Z"
    assert agent.desired().devices[0].idle_since == "2026-11-27T09:00:00Z"


def test_nvml_samples_say_when_a_gpus_processes_cannot_be_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = fake.consumer_box()
    machine.gpus[1].processes = [(4242, None)]
    lib = fake.FakeNvml(machine)
    source = nvml.NvmlSource(nvml_module=lib, sysfs_root="/nonexistent-sysfs")
    source.scan()
    listed = {s.index: (s.processes_listed, len(s.processes)) for s in source.samples()}
    assert listed[0] == (True, 0) and listed[1] == (True, 1)

    def not_supported(handle: Any) -> Any:
        raise fake.NVMLError(fake.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(lib, "nvmlDeviceGetComputeRunningProcesses", not_supported)
    assert {s.processes_listed for s in source.samples()} == {False}
