"""A GPU that fails under an Allocated claim (``controller.failures``): the condition, which replica
moves, where it may go, and the status that records the move."""

from __future__ import annotations

import dataclasses
import datetime

from controller import failures, statuses
from gpualloc.api import codecs, constants, models
from tests.unit.test_controller_pure import NOW, alloc, claim, uuid

LATER = NOW + datetime.timedelta(seconds=45)


def _gang(on_failure: str = constants.DEVICE_FAILURE_REALLOCATE, **topology: str) -> models.GpuClaim:
    allocations = tuple(alloc(r, f"n{r % 2}", r % 2, (2 * (r // 2), 2 * (r // 2) + 1)) for r in range(4))
    c = claim(replicas=4, status_=models.GpuClaimStatus(phase="Allocated", allocations=allocations))
    spec = dataclasses.replace(
        c.spec,
        on_device_failure=on_failure,
        device_failure_grace_period_seconds=30,
        topology=models.Topology(**topology),  # type: ignore[arg-type]
    )
    return dataclasses.replace(c, spec=spec)


def _sick(node_no: int, index: int) -> statuses.Problem:
    detail = f"gpu-{index}/{uuid(node_no, index)} on n{node_no}: unhealthy (XID 79)"
    return statuses.Problem(
        node=f"n{node_no}", uuid=uuid(node_no, index), reason=statuses.REASON_DEVICE_UNHEALTHY, detail=detail
    )


def _with(c: models.GpuClaim, *conditions: models.Condition) -> models.GpuClaim:
    return dataclasses.replace(c, status=dataclasses.replace(c.status, conditions=conditions))


def test_only_the_replica_holding_an_unhealthy_gpu_fails_and_a_missing_gpu_is_not_a_failure() -> None:
    c = _gang()
    missing = statuses.Problem(node="n0", uuid=uuid(0, 0), reason=statuses.REASON_DEVICES_MISSING, detail="x")
    assert failures.failed(c, [_sick(1, 3), missing]) == [3]  # replica 3: n1, GPUs 2 and 3
    assert failures.failed(c, [missing]) == []


def test_the_condition_names_the_gpu_and_its_xid_and_says_what_happens_next() -> None:
    keep = failures.condition(_gang(constants.DEVICE_FAILURE_KEEP), [_sick(1, 3)], now=NOW)
    assert keep is not None and keep.type == "DevicesUnhealthy" and keep.status == "True"
    assert "XID 79" in keep.message and uuid(1, 3) in keep.message
    assert keep.message.endswith("keeps its GPUs until a person acts (onDeviceFailure: Keep)")
    move = failures.condition(_gang(), [_sick(1, 3)], now=NOW)
    assert move is not None and "replica 3 moves to other GPUs 30 s after" in move.message


def test_the_condition_is_written_once_and_turns_false_when_the_gpu_is_healthy_again() -> None:
    c = _gang()
    assert failures.condition(c, [], now=NOW) is None  # never had a problem
    first = failures.condition(c, [_sick(1, 3)], now=NOW)
    assert first is not None
    c = _with(c, first)
    assert failures.condition(c, [_sick(1, 3)], now=LATER) is None  # unchanged: nothing to write
    assert failures.unhealthy_since(c) and failures.unhealthy_for(c, LATER) == 45.0
    healed = failures.condition(c, [], now=LATER)
    assert healed is not None and healed.status == "False" and healed.reason == "DevicesHealthy"
    assert failures.unhealthy_for(_with(c, healed), LATER) == 0.0


def test_the_replacement_stays_in_the_kept_replicas_same_node_label_domain() -> None:
    c = _gang(same_node_label="clique", same_node_label_mode="Required")
    labels = {"n0": {"clique": "a"}, "n1": {"clique": "a"}, "n9": {"clique": "b"}}
    asked = failures.replacement(c, [3], labels)
    assert asked.spec.replicas == 1
    assert asked.spec.selector is not None and asked.spec.selector.match_labels["clique"] == "a"
    assert asked.spec.topology.same_node_label == ""  # the domain is fixed by the selector
    assert failures.unbound(c, [3]) is None  # Required: no placement outside the domain
    preferred = _gang(same_node_label="clique", same_node_label_mode="Preferred")
    loose = failures.unbound(preferred, [3])
    assert loose is not None and loose.spec.selector == c.spec.selector and loose.spec.replicas == 1


def test_a_one_replica_claim_is_placed_anywhere_the_claim_allows() -> None:
    c = claim(status_=models.GpuClaimStatus(phase="Allocated", allocations=(alloc(0, "n0", 0, (0, 1)),)))
    asked = failures.replacement(c, [0], {"n0": {}})
    assert asked.spec == c.spec


def test_the_replaced_status_moves_only_the_failed_replica_and_lifts_the_fence() -> None:
    c = _gang()
    fence = statuses.releasing_condition(c, on=True, now=NOW, why="x", reason=failures.REASON_DEVICE_FAILED)
    c = _with(c, fence)
    new = failures.renumbered([alloc(0, "n2", 2, (0, 1))], [3])
    patch = failures.replaced_status(c, new, why="gpu-3 unhealthy (XID 79)", now=LATER)
    status = patch["status"]
    assert isinstance(status, dict)
    got = [codecs.decode(models.Allocation, a) for a in status["allocations"]]
    assert got[:3] == list(c.status.allocations[:3])  # the kept replicas, unchanged
    assert got[3].replica == 3 and got[3].node_name == "n2"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Releasing"]["status"] == "False" and conditions["Releasing"]["reason"] == "Reallocated"
    assert conditions["DevicesUnhealthy"]["status"] == "False"
    assert status["message"].startswith("moved replica 3 to n2 [gpu-0/")
