"""The simulated source: profiles as data, XID injection, lost devices."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent import health, inventory, simulated


def _source(profile: str = "h100-sxm-8", node: str = "sim-1") -> simulated.SimulatedSource:
    return simulated.SimulatedSource(simulated.load_profile(profile), node)


def test_profile_loads_by_path_as_well_as_by_name(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(
        """
name: two
driverVersion: "550.1"
cudaVersion: "12.4"
defaults: {product: Test GPU, memoryMiB: 1000, computeCapability: "8.6", pcieGeneration: 4, pcieWidth: 8}
devices:
  - {busId: "00000000:0A:00.0", numa: 0, pcie: [hb0, sw0]}
  - {busId: "0000:0b:00.0", numa: 0, pcie: [hb0, sw0]}
nvlink:
  version: "3.0"
  bridges: [{a: 0, b: 1, links: 4}]
"""
    )
    profile = simulated.load_profile(str(path))
    assert [d.bus_id for d in profile.devices] == ["0000:0a:00.0", "0000:0b:00.0"]
    inv = inventory.derive(simulated.SimulatedSource(profile, "n").scan())
    assert (inv.links[0].type, inv.links[0].bandwidth_gbps) == ("NV4", 200)
    assert inv.devices[0].pcie_width == 8


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("devices: [{numa: 0}]", "busId is required"),
        ("[1, 2]", "expected a mapping"),
        ("devices: [{busId: '0000:01:00.0'}]\nnvlink: {version: '9.9'}", "nvlink.version"),
        ("devices: [{busId: '0000:01:00.0'}]\nnvlink: {bridges: [{a: 0, b: 3, links: 1}]}", "bridge 0-3"),
        ("devices: [{busId: '0000:01:00.0', mig: [{profile: big}]}]", "not of the form 3g.20gb"),
        (
            "devices: [{busId: '0000:01:00.0', mig: [{profile: 7g.40gb}, {profile: 1g.5gb}]}]",
            "no room for 1g.5gb",
        ),
    ],
)
def test_malformed_profiles_are_rejected_with_a_reason(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(simulated.ProfileError, match=message):
        simulated.load_profile(str(path))


def test_unknown_profile_name_lists_the_shipped_ones() -> None:
    with pytest.raises(simulated.ProfileError, match="h100-sxm-8"):
        simulated.load_profile("no-such-profile")


def test_simulated_pcie_paths_give_nvml_levels() -> None:
    def dev(numa: int, *path: str) -> simulated.SimDevice:
        return simulated.SimDevice(
            bus_id="0000:01:00.0",
            numa=numa,
            pcie_path=path,
            product="",
            memory_mib=0,
            compute_capability="",
            pcie_generation=4,
            pcie_width=16,
        )

    level = simulated.common_ancestor
    assert level(dev(0, "hb0", "sw0"), dev(0, "hb0", "sw0")) == inventory.TOPOLOGY_SINGLE
    assert level(dev(0, "hb0", "sw0", "a"), dev(0, "hb0", "sw0", "b")) == inventory.TOPOLOGY_MULTIPLE
    assert level(dev(0, "hb0", "sw0"), dev(0, "hb0", "sw1")) == inventory.TOPOLOGY_HOSTBRIDGE
    assert level(dev(0, "hb0"), dev(0, "hb1")) == inventory.TOPOLOGY_NODE
    assert level(dev(0, "hb0"), dev(1, "hb0")) == inventory.TOPOLOGY_SYSTEM


def test_simulated_samples_are_plausible_and_cover_every_device() -> None:
    samples = _source().samples()
    assert [s.index for s in samples] == list(range(8))
    for s in samples:
        assert s.utilization_percent is not None and 0 <= s.utilization_percent <= 100
        assert s.memory_total_bytes == 81559 * 1024 * 1024
        assert s.memory_used_bytes is not None and 0 <= s.memory_used_bytes <= s.memory_total_bytes
        assert s.power_watts is not None and s.power_watts > 0


def test_injection_lines_parse_xids_ecc_and_lost_and_skip_junk() -> None:
    parsed = simulated.parse_injections("3 79\n# comment\n\n1 ecc  # trailing\n5 lost\nbogus\n2 x\n")
    assert parsed == [
        simulated.Injection(index=3, kind=health.KIND_XID, xid=79),
        simulated.Injection(index=1, kind=health.KIND_ECC),
        simulated.Injection(index=5, kind=health.KIND_LOST),
    ]


def test_lost_injection_removes_the_device_from_scans_and_carry_lost_keeps_it_unhealthy() -> None:
    source = _source("consumer-8")
    before = source.scan()
    assert source.lose(4)
    after = source.scan()
    assert [d.index for d in after.devices] == [0, 1, 2, 3, 5, 6, 7]
    inv = inventory.derive(health.carry_lost(before, after))
    assert (inv.devices[4].health, inv.devices[4].health_reason) == (
        "Unhealthy",
        "lost: missing from re-scan",
    )
    assert {(ln.a, ln.b): ln.type for ln in inv.links}[(4, 5)] == "PIX"


async def _until(predicate: Callable[[], bool], seconds: float = 2.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)


async def _watch(
    path: Path, source: simulated.SimulatedSource
) -> tuple[simulated.InjectionWatcher, health.HealthTracker, list[str], asyncio.Task[None]]:
    tracker = health.HealthTracker()
    lost_calls: list[str] = []
    watcher = simulated.InjectionWatcher(
        str(path), source, on_event=tracker.apply, on_rescan=lambda: lost_calls.append("lost")
    )
    task = asyncio.create_task(watcher.run())
    await asyncio.sleep(0.05)
    return watcher, tracker, lost_calls, task


async def test_injected_xid_is_applied_within_one_second(tmp_path: Path) -> None:
    path = tmp_path / "xids"
    source = _source()
    _watcher, tracker, lost_calls, task = await _watch(path, source)
    try:
        uuids = [d.uuid for d in source.scan().devices]
        started = time.monotonic()
        path.write_text("3 79\n2 13\n")
        await _until(lambda: bool(tracker.marks(uuids)))
        assert time.monotonic() - started < 1.0
        assert tracker.marks(uuids) == {uuids[3]: "XID 79"}  # 13 is an application XID
        with path.open("a") as f:
            f.write("6 lost\n")
        await _until(lambda: bool(lost_calls))
        assert lost_calls == ["lost"]
        assert 6 not in [d.index for d in source.scan().devices]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_sigusr1_rereads_the_injection_file_at_once(tmp_path: Path) -> None:
    path = tmp_path / "xids"
    source = _source()
    tracker = health.HealthTracker()
    watcher = simulated.InjectionWatcher(
        str(path), source, on_event=tracker.apply, on_rescan=lambda: None, poll_seconds=30.0
    )
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.sleep(0.05)  # first check done; next poll is 30 s away
        path.write_text("1 ecc\n")
        os.kill(os.getpid(), signal.SIGUSR1)
        uuids = [d.uuid for d in source.scan().devices]
        for _ in range(50):
            if tracker.marks(uuids):
                break
            await asyncio.sleep(0.02)
        assert tracker.marks(uuids) == {uuids[1]: "double-bit ECC error"}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_mig_instances_are_published_with_placement_and_slices_as_nvml_places_them() -> None:
    inv = inventory.derive(_source("a100-mig", "mig-node").scan())
    mig = inv.devices[0].mig
    assert mig is not None and mig.enabled
    # 3g.20gb takes 4 memory slices from 0, 2g.10gb 2 from 4, each 1g.5gb one after that.
    assert [(m.profile, m.placement_start, m.memory_slices, m.compute_slices) for m in mig.devices] == [
        ("3g.20gb", 0, 4, 3),
        ("2g.10gb", 4, 2, 2),
        ("1g.5gb", 6, 1, 1),
        ("1g.5gb", 7, 1, 1),
    ]
    assert len({m.uuid for m in mig.devices}) == 4
    assert all(m.uuid.startswith("MIG-") for m in mig.devices)
    assert inv.devices[1].mig is None  # GPU 1 runs without MIG


def test_mig_instances_get_stable_distinct_instance_ids_and_cap_minors_in_the_drivers_layout() -> None:
    facts = _source("a100-mig", "mig-node").scan()
    again = _source("a100-mig", "mig-node").scan()
    gpu = facts.devices[0]
    assert gpu.mig is not None
    instances = gpu.mig_instances

    assert [i.uuid for i in instances] == [m.uuid for m in gpu.mig.devices]
    assert [(i.gpu_instance, i.compute_instance) for i in instances] == [(1, 0), (2, 0), (3, 0), (4, 0)]
    # mig-minors: gpu0/gi0/access 3, its ci0..ci7 4..11, gpu0/gi1/access 12, gpu0/gi1/ci0/access 13.
    assert [(i.gpu_instance_cap, i.compute_instance_cap) for i in instances] == [
        (12, 13),
        (21, 22),
        (30, 31),
        (39, 40),
    ]
    assert again.devices[0].mig_instances == instances
    assert facts.devices[1].mig_instances == ()  # GPU 1 runs without MIG


def test_the_simulated_cap_minors_follow_the_drivers_mig_minors_table() -> None:
    assert simulated.mig_cap_minor(0, 0) == 3
    assert simulated.mig_cap_minor(0, 0, 0) == 4
    assert simulated.mig_cap_minor(0, 0, 7) == 11
    assert simulated.mig_cap_minor(0, 1) == 12
    assert simulated.mig_cap_minor(1, 0) == 3 + 15 * 9  # each GPU: 15 GPU instances of 1 + 8 caps
