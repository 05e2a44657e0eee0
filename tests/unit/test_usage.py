"""GPU-seconds per tenant: the pure accounting (gpualloc.usage), the controller's counter
(controller.usage, controller.metrics) and `gpualloc get usage`'s table."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import prometheus_client
import pytest

from controller import metrics as controller_metrics
from controller import usage as gpu_seconds
from gpualloc import usage, usage_view
from gpualloc.api import constants, leases, models
from tests.unit.test_controller_pure import status

T0 = dt.datetime(2026, 11, 27, 12, 0, 0, tzinfo=dt.UTC)
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-00000000-0000-0000-0000-000000000001"
MIG = "MIG-11111111-0000-0000-0000-000000000000"


def _node() -> models.GpuNodeStatus:
    mig = models.MigInfo(enabled=True, devices=(models.MigDevice(index=0, uuid=MIG, profile="1g.10gb"),))
    devices = (
        models.Device(index=0, minor=0, uuid=GPU0, product="NVIDIA H100 80GB HBM3", mig=mig),
        models.Device(
            index=1,
            minor=1,
            uuid=GPU1,
            product="NVIDIA A100-SXM4-40GB",
            sharing=models.DeviceSharing(strategy="TimeSlicing", replicas=4),
        ),
    )
    return status("gpu-a", models.NodeInventory(devices=devices, total=2, healthy=2))


def _lease(lock_id: str, claim: str, acquired: dt.datetime, *, uid: str = "") -> dict[str, Any]:
    raw = leases.device_lease(
        "gpualloc-system",
        lock_id=lock_id,
        node="gpu-a",
        claim_namespace="ml",
        claim_name=claim,
        claim_uid=f"uid-{claim}",
        claim_resource_version="1",
        now=acquired,
    )
    raw["metadata"]["uid"] = uid or f"lease-{lock_id}"
    return raw


def _held(lock_id: str, claim: str, acquired: dt.datetime, **kw: str) -> usage.Holding:
    held = usage.holding(_lease(lock_id, claim, acquired, **kw), usage.device_kinds([_node()]))
    assert held is not None
    return held


def _claim(
    name: str,
    phase: str,
    *,
    count: int = 1,
    replicas: int = 1,
    last_schedule_time: str | None = None,
    released_time: str | None = None,
) -> models.GpuClaim:
    return models.GpuClaim(
        metadata=models.ObjectMeta(name=name, namespace="ml"),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=count), replicas=replicas),
        status=models.GpuClaimStatus(
            phase=phase, last_schedule_time=last_schedule_time, released_time=released_time
        ),
    )


def test_device_kinds_names_whole_gpus_mig_instances_and_sharing_slots() -> None:
    kinds = usage.device_kinds([_node()])
    assert kinds[constants.lease_name(GPU0)] == ("NVIDIA H100 80GB HBM3", "")
    assert kinds[constants.lease_name(MIG)] == ("NVIDIA H100 80GB HBM3", "1g.10gb")
    assert kinds[constants.lease_name(constants.slot_id(GPU1, 3))] == ("NVIDIA A100-SXM4-40GB", "share/4")


def test_holding_reads_the_lease_acquire_time_to_the_microsecond_and_its_claim() -> None:
    acquired = T0 + dt.timedelta(microseconds=123456)
    held = _held(MIG, "train", acquired)
    assert held.acquired == acquired
    assert held.key == ("ml", "train", "NVIDIA H100 80GB HBM3", "1g.10gb")
    assert held.node == "gpu-a"


def test_holding_ignores_a_lease_naming_no_claim() -> None:
    raw = leases.heartbeat_lease("gpualloc-system-heartbeats", node="gpu-a", now=T0)
    assert usage.holding(raw, {}) is None


def test_a_held_lease_counts_now_minus_its_acquire_time_whoever_counts() -> None:
    held = [_held(GPU0, "train", T0)]
    # Two tallies: a controller running since before the allocation, and one started after it.
    assert gpu_seconds.Tally().totals(held, T0 + dt.timedelta(seconds=90)) == {held[0].key: 90.0}
    fresh = gpu_seconds.Tally()
    assert fresh.totals(held, T0 + dt.timedelta(seconds=90.5)) == {held[0].key: 90.5}


def test_a_released_lease_keeps_its_lifetime_and_is_counted_once() -> None:
    tally = gpu_seconds.Tally()
    held = _held(GPU0, "train", T0)
    assert tally.totals([held], T0 + dt.timedelta(seconds=30)) == {held.key: 30.0}
    tally.release(held, T0 + dt.timedelta(seconds=40))
    tally.release(held, T0 + dt.timedelta(seconds=45))  # the watch's DELETED after our own
    assert tally.totals([], T0 + dt.timedelta(seconds=60)) == {held.key: 40.0}


def test_a_second_allocation_of_the_same_claim_adds_to_its_series() -> None:
    tally = gpu_seconds.Tally()
    first = _held(GPU0, "train", T0)
    tally.release(first, T0 + dt.timedelta(seconds=10))
    again = _held(GPU0, "train", T0 + dt.timedelta(seconds=20), uid="lease-2")
    assert tally.totals([again], T0 + dt.timedelta(seconds=25)) == {first.key: 15.0}


def test_a_deletion_seen_late_counts_until_its_deletion_timestamp_and_a_second() -> None:
    raw = _lease(GPU0, "train", T0)
    raw["metadata"]["deletionTimestamp"] = "2026-11-27T12:01:00Z"
    held = usage.holding(raw, {})
    assert held is not None
    tally = gpu_seconds.Tally()
    tally.release(held, T0 + dt.timedelta(minutes=5))  # a watch that re-listed five minutes on
    assert tally.totals([], T0 + dt.timedelta(minutes=6)) == {held.key: 61.0}


def test_a_series_never_goes_down_while_exported() -> None:
    tally = gpu_seconds.Tally()
    raw = _lease(GPU0, "train", T0)
    raw["metadata"]["deletionTimestamp"] = "2026-11-27T12:00:10Z"
    held = usage.holding(raw, {})
    assert held is not None
    assert tally.totals([held], T0 + dt.timedelta(seconds=30)) == {held.key: 30.0}
    tally.release(held, T0 + dt.timedelta(seconds=31))  # its deletionTimestamp says 11 s
    assert tally.totals([], T0 + dt.timedelta(seconds=40)) == {held.key: 30.0}


def test_a_released_series_is_dropped_after_it_was_kept() -> None:
    tally = gpu_seconds.Tally(kept=600)
    held = _held(GPU0, "train", T0)
    tally.release(held, T0 + dt.timedelta(seconds=10))
    assert tally.totals([], T0 + dt.timedelta(seconds=609)) == {held.key: 10.0}
    assert tally.totals([], T0 + dt.timedelta(seconds=611)) == {}


def test_the_counter_is_exported_as_gpu_seconds_total_per_namespace_claim_product_and_profile() -> None:
    metrics = controller_metrics.Metrics()
    metrics.set_usage_source(lambda: [(("ml", "train", "NVIDIA H100 80GB HBM3", "1g.10gb"), 12.5)])
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert (
        'gpualloc_gpu_seconds_total{claim="train",namespace="ml",'
        'product="NVIDIA H100 80GB HBM3",profile="1g.10gb"} 12.5'
    ) in text


def test_claim_usage_sums_held_leases_and_released_claims_after_since() -> None:
    now = T0 + dt.timedelta(hours=2)
    held = [_held(GPU0, "live", T0), _held(constants.slot_id(GPU1, 0), "live", T0 + dt.timedelta(hours=1))]
    done = _claim(
        "done",
        constants.PHASE_RELEASED,
        count=2,
        replicas=2,
        last_schedule_time="2026-11-27T12:00:00Z",
        released_time="2026-11-27T13:30:00Z",
    )
    pending = _claim("waiting", constants.PHASE_PENDING)
    found = usage.claim_usage(held, [done, pending], now)
    assert [(c.claim, c.gpus, c.seconds) for c in found] == [("done", 4, 4 * 5400.0), ("live", 2, 3 * 3600.0)]
    since = usage.claim_usage(held, [done], now, since=now - dt.timedelta(hours=1))
    assert [(c.claim, c.seconds) for c in since] == [("done", 4 * 1800.0), ("live", 2 * 3600.0)]


def test_claim_usage_counts_the_leases_of_a_deleted_claim_under_its_name() -> None:
    found = usage.claim_usage([_held(GPU0, "gone", T0)], [], T0 + dt.timedelta(seconds=5))
    assert [(c.claim, c.phase, c.seconds) for c in found] == [("gone", "Deleted", 5.0)]


def test_without_the_leases_an_allocated_claim_counts_from_its_last_schedule_time() -> None:
    allocation = models.Allocation(
        replica=0,
        node_name="gpu-a",
        devices=tuple(models.DeviceRef(index=i, minor=i, uuid=u) for i, u in enumerate((GPU0, GPU1))),
    )
    claim = dataclasses.replace(
        _claim("live", constants.PHASE_ALLOCATED, last_schedule_time="2026-11-27T12:00:00Z"),
        status=models.GpuClaimStatus(
            phase=constants.PHASE_ALLOCATED,
            allocations=(allocation,),
            last_schedule_time="2026-11-27T12:00:00Z",
        ),
    )
    found = usage.claim_usage(None, [claim], T0 + dt.timedelta(minutes=1))
    assert [(c.claim, c.gpus, c.seconds) for c in found] == [("live", 2, 120.0)]
    assert usage.claim_usage([], [claim], T0 + dt.timedelta(minutes=1)) == []  # the Leases say none


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("30m", 1800), ("24h", 86400), ("7d", 604800), ("1h30m", 5400)]
)
def test_durations_read_like_kubectl(text: str, seconds: int) -> None:
    assert usage_view.parse_duration(text) == dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "24", "h", "1x", "-1h", "1h 2m"])
def test_a_malformed_duration_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        usage_view.parse_duration(text)


def test_usage_table_shows_gpu_hours_per_claim_then_per_namespace() -> None:
    found = usage.claim_usage([_held(GPU0, "train", T0)], [], T0 + dt.timedelta(hours=3))
    claims, totals = usage_view.format_usage(found, all_namespaces=True).split("\n\n")
    assert claims.splitlines()[0].split() == ["NAMESPACE", "CLAIM", "PHASE", "GPUS", "PRODUCT", "GPU-HOURS"]
    assert claims.splitlines()[1].split()[-1] == "3.00"
    assert totals.splitlines()[1].split() == ["ml", "3.00"]
    out = json.loads(usage_view.as_json(found, now=T0, since=None))
    assert out["namespaces"] == {"ml": {"gpuSeconds": 10800.0}}
    assert out["claims"][0]["products"] == ["NVIDIA H100 80GB HBM3"]


def _allocated(name: str, scheduled: str) -> models.GpuClaim:
    allocation = models.Allocation(
        replica=0, node_name="gpu-a", devices=(models.DeviceRef(index=0, minor=0, uuid=GPU0),)
    )
    return models.GpuClaim(
        metadata=models.ObjectMeta(name=name, namespace="ml"),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=1)),
        status=models.GpuClaimStatus(
            phase=constants.PHASE_ALLOCATED, allocations=(allocation,), last_schedule_time=scheduled
        ),
    )


def _pod(claim: str, phase: str, finished: str = "") -> dict[str, Any]:
    state = {"terminated": {"finishedAt": finished}} if finished else {"running": {}}
    return {
        "metadata": {
            "name": f"{claim}-pod",
            "namespace": "ml",
            "annotations": {constants.ANNOTATION_CLAIM: claim},
        },
        "status": {"phase": phase, "containerStatuses": [{"name": "main", "state": state}]},
    }


def test_an_allocated_claim_without_a_running_pod_is_idle_since_its_last_pod_finished() -> None:
    claims = [
        _allocated("never-used", "2026-11-27T11:00:00Z"),
        _allocated("running", "2026-11-27T11:00:00Z"),
        _allocated("done-long-ago", "2026-11-27T11:00:00Z"),
        _allocated("done-lately", "2026-11-27T11:00:00Z"),
        _allocated("new", "2026-11-27T11:50:00Z"),
        _claim("released", constants.PHASE_RELEASED, last_schedule_time="2026-11-27T11:00:00Z"),
    ]
    pods = [
        _pod("running", "Running"),
        _pod("done-long-ago", "Succeeded", "2026-11-27T11:10:00Z"),
        _pod("done-lately", "Failed", "2026-11-27T11:45:00Z"),
    ]
    idle = usage.idle_claims(claims, pods, T0, idle_after=dt.timedelta(minutes=30))
    assert [(c.claim, c.idle_since) for c in idle] == [
        ("done-long-ago", dt.datetime(2026, 11, 27, 11, 10, tzinfo=dt.UTC)),
        ("never-used", dt.datetime(2026, 11, 27, 11, 0, tzinfo=dt.UTC)),
    ]
    assert idle[0].gpus == 1 and idle[0].nodes == ("gpu-a",)


def test_idle_table_says_for_how_long_and_says_so_when_there_is_none() -> None:
    idle = usage.idle_claims([_allocated("nb", "2026-11-27T09:00:00Z")], [], T0, idle_after=dt.timedelta(0))
    out = usage_view.format_idle(idle, T0, dt.timedelta(minutes=30)).splitlines()
    assert out[0] == "Allocated but idle (no pod running for 30m or more):"
    assert out[2].split() == ["ml", "nb", "1", "gpu-a", "3h"]
    assert usage_view.format_idle([], T0, dt.timedelta(minutes=30)).startswith("No Allocated claim")
