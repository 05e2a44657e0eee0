"""A claim whose pods kube-scheduler cannot place on its node moves (issue 41, part 2): the pure rules."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from controller import allocator, gates, statuses, unplaceable
from gpualloc.api import constants, models
from tests.unit.test_allocator import claim, node, nvswitch

NOW = datetime.datetime(2026, 11, 27, 12, 0, 0, tzinfo=datetime.UTC)
SCHEDULER = (
    "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match Pod's node affinity/selector."
)


def pod(
    name: str, *, stuck_for: float | None, owner: str | None = "Job", node_name: str = ""
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"u-{name}"}
    meta["annotations"] = {constants.ANNOTATION_CLAIM: "c"}
    if owner:
        meta["ownerReferences"] = [
            {"kind": owner, "name": "w", "controller": True, "apiVersion": "x", "uid": "o"}
        ]
    status: dict[str, Any] = {"phase": "Pending"}
    if stuck_for is not None:
        since = (NOW - datetime.timedelta(seconds=stuck_for)).strftime("%Y-%m-%dT%H:%M:%SZ")
        status["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": SCHEDULER,
                "lastTransitionTime": since,
            }
        ]
    spec = {"nodeName": node_name} if node_name else {}
    return gates.kept_of_live_pod({"metadata": meta, "spec": spec, "status": status})


def test_a_pod_unschedulable_for_the_grace_period_moves_the_claim_with_the_schedulers_message() -> None:
    verdict = unplaceable.judge([pod("p", stuck_for=61)], grace=60, now=NOW)
    assert verdict is not None and verdict.moves
    assert verdict.pods == ("p",) and verdict.message == SCHEDULER


def test_before_the_grace_period_ends_it_waits_the_rest() -> None:
    verdict = unplaceable.judge([pod("p", stuck_for=15)], grace=60, now=NOW)
    assert verdict is not None and not verdict.moves and verdict.wait == 45


def test_a_bound_pod_of_the_claim_keeps_it_where_it_is() -> None:
    stuck, running = pod("p", stuck_for=600), pod("q", stuck_for=None, node_name="gpu-a")
    assert unplaceable.judge([stuck, running], grace=60, now=NOW) is None


def test_a_pod_the_scheduler_has_not_refused_asks_for_nothing() -> None:
    assert unplaceable.judge([pod("p", stuck_for=None)], grace=60, now=NOW) is None


def test_a_bare_pod_cannot_move_and_says_so() -> None:
    verdict = unplaceable.judge([pod("p", stuck_for=120, owner=None)], grace=60, now=NOW)
    assert verdict is not None and not verdict.moves and verdict.bare == ("p",)
    allocated = models.GpuClaim(
        metadata=models.ObjectMeta(name="c", namespace="ns"),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=1)),
        status=models.GpuClaimStatus(
            phase="Allocated", allocations=(models.Allocation(replica=0, node_name="gpu-a", devices=()),)
        ),
    )
    condition = statuses.unplaceable_condition(allocated, verdict.bare, verdict.message, now=NOW)
    assert (
        condition is not None and condition.reason == statuses.REASON_BARE_POD and condition.status == "True"
    )
    assert "pod p cannot be scheduled on gpu-a" in condition.message and "bare pod" in condition.message


def test_only_workload_controllers_make_a_pod_movable() -> None:
    assert pod("p", stuck_for=1, owner="ReplicaSet")[unplaceable.OWNED]
    assert not pod("p", stuck_for=1, owner="ConfigMap")[unplaceable.OWNED]
    assert not pod("p", stuck_for=1, owner=None)[unplaceable.OWNED]


def test_the_move_sends_the_claim_to_pending_without_devices_and_records_the_node() -> None:
    allocated = models.GpuClaim(
        metadata=models.ObjectMeta(name="c", namespace="ns", generation=1),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=1)),
        status=models.GpuClaimStatus(
            phase="Allocated",
            allocations=(models.Allocation(replica=0, node_name="gpu-a", devices=()),),
            unplaceable_nodes=("gpu-z",),
        ),
    )
    fence = statuses.unplaceable_fence(allocated, ["p"], SCHEDULER, now=NOW)
    assert fence.reason == statuses.REASON_UNPLACEABLE and fence.status == "True"
    fenced = dataclasses.replace(allocated, status=dataclasses.replace(allocated.status, conditions=(fence,)))
    assert statuses.fence_reason(fenced) == statuses.REASON_UNPLACEABLE
    patch = statuses.unplaceable_status(fenced, now=NOW)["status"]
    assert patch["phase"] == constants.PHASE_PENDING and patch["allocations"] is None
    assert patch["unplaceableNodes"] == ["gpu-z", "gpu-a"]
    allocated_condition = next(c for c in patch["conditions"] if c["type"] == constants.CONDITION_ALLOCATED)
    assert allocated_condition["reason"] == statuses.REASON_UNPLACEABLE
    assert patch["message"].startswith("allocating afresh without gpu-a: pod p could not be scheduled")
    assert SCHEDULER in patch["message"] and not statuses.fence_reason(
        dataclasses.replace(fenced, status=dataclasses.replace(fenced.status, conditions=()))
    )


def test_the_allocator_passes_over_the_nodes_the_pods_could_not_run_on() -> None:
    moved = claim(1)
    moved = type(moved)(
        metadata=moved.metadata,
        spec=moved.spec,
        status=models.GpuClaimStatus(unplaceable_nodes=("a",)),
    )
    decision = allocator.allocate(moved, [node("a", nvswitch("a"), taken=range(6)), node("b", nvswitch("b"))])
    assert decision.allocations[0].node_name == "b"
    alone = allocator.allocate(moved, [node("a", nvswitch("a"))])
    assert "kube-scheduler could not place the claim's pods here" in alone.per_node["a"]


def test_the_nodes_kept_are_the_most_recent_without_repeats() -> None:
    many = [f"n{i:02d}" for i in range(20)]
    assert (
        unplaceable.recorded_nodes(many, ["n05"]) == [*many[:5], *many[6:], "n05"][-unplaceable.NODES_KEPT :]
    )
