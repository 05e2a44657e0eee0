"""Which claims a claim that fits nowhere preempts (``controller.preemption``, pure)."""

from __future__ import annotations

import dataclasses

from controller import allocator, preemption
from gpualloc.api import constants, models
from tests.unit.test_allocator import claim, node, nvswitch


def holding(
    name: str, node_name: str, indices: tuple[int, ...], *, priority: int, ns: str = "ns"
) -> models.GpuClaim:
    base = claim(len(indices), name=name, namespace=ns, priority=priority)
    devices = tuple(models.DeviceRef(index=i, minor=i, uuid=f"GPU-{node_name}-{i}") for i in indices)
    return dataclasses.replace(
        base,
        metadata=dataclasses.replace(base.metadata, uid=f"uid-{name}"),
        status=models.GpuClaimStatus(
            phase=constants.PHASE_ALLOCATED,
            allocations=(models.Allocation(replica=0, node_name=node_name, devices=devices),),
        ),
    )


def views_of(*claims: models.GpuClaim) -> list[allocator.NodeView]:
    taken: dict[str, list[int]] = {"a": [], "b": []}
    for c in claims:
        for alloc in c.status.allocations:
            taken[alloc.node_name] += [d.index for d in alloc.devices]
    return [node(name, nvswitch(name), taken=indices) for name, indices in taken.items()]


def plan_for(
    wanted: models.GpuClaim, *held: models.GpuClaim, cluster: bool = False
) -> preemption.Plan | None:
    def priority(c: models.GpuClaim) -> int:
        return c.spec.priority

    pool = preemption.candidates(wanted, held, priority=priority, cluster_scope=cluster)
    views = views_of(*held)
    return preemption.choose(wanted, pool, views, lambda v: allocator.allocate(wanted, v), priority=priority)


def victims(plan: preemption.Plan | None) -> list[str]:
    assert plan is not None
    return [v.metadata.name for v in plan.victims]


FULL = (
    holding("a-big", "a", (0, 1, 2, 3), priority=1),
    holding("a-rest", "a", (4, 5, 6, 7), priority=0),
    holding("b-1", "b", (0, 1), priority=0),
    holding("b-2", "b", (2, 3), priority=0),
    holding("b-3", "b", (4, 5, 6, 7), priority=2),
)


def test_the_fewest_gpus_are_displaced_then_the_lowest_priorities_then_the_fewest_claims() -> None:
    # 4 GPUs: a-rest (4 GPUs, top priority 0) beats b-1 + b-2 (4 GPUs, also 0) by fewer claims,
    # and a-big (priority 1).
    assert victims(plan_for(claim(4, name="high", namespace="ns", priority=5), *FULL)) == ["a-rest"]
    # 2 GPUs: one 2-GPU claim on b, not a 4-GPU one.
    assert victims(plan_for(claim(2, name="high", namespace="ns", priority=5), *FULL)) == ["b-1"]


def test_never_a_claim_of_equal_or_higher_priority_nor_one_of_another_namespace_by_default() -> None:
    assert plan_for(claim(4, name="low", namespace="ns", priority=0), *FULL) is None  # all >= 0
    # Priority 1: only the priority-0 claims are candidates, so 8 GPUs on one node cannot be had.
    assert plan_for(claim(8, name="mid", namespace="ns", priority=1), *FULL) is None
    assert victims(plan_for(claim(4, name="mid", namespace="ns", priority=1), *FULL)) == ["a-rest"]
    others = [
        dataclasses.replace(c, metadata=dataclasses.replace(c.metadata, namespace="other")) for c in FULL
    ]
    assert plan_for(claim(2, name="high", namespace="ns", priority=5), *others) is None
    assert plan_for(claim(2, name="high", namespace="ns", priority=5), *others, cluster=True) is not None


def test_no_victim_is_needless() -> None:
    # Lowest priority first takes the 1-GPU a-x, then the 4-GPU a-y, and 4 GPUs are free: a-x is
    # then taken back out, as 4 GPUs are free without it.
    held = (
        holding("a-x", "a", (0,), priority=0),
        holding("a-y", "a", (1, 2, 3, 4), priority=0),
        holding("a-z", "a", (5, 6, 7), priority=1),
        holding("b-all", "b", tuple(range(8)), priority=3),
    )
    plan = plan_for(claim(4, name="high", namespace="ns", priority=5), *held)
    assert victims(plan) == ["a-y"]
    assert plan is not None and plan.gpus == 4
    assert {d.uuid for d in plan.decision.allocations[0].devices} == {f"GPU-a-{i}" for i in (1, 2, 3, 4)}
