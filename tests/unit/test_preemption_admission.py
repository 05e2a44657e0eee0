"""Admission before preemption, and the bounds of the victim search (``controller.preemption`` with
``quotas.admissible``, pure): no plan counts whose placement the preemptor's quotas would refuse."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from controller import allocator, preemption, quotas
from gpualloc.api import models
from tests.unit.test_allocator import claim, node, nvswitch
from tests.unit.test_controller_preemption import holding

A100 = "NVIDIA A100-SXM4-80GB"


def a100(name: str) -> models.NodeInventory:
    inv = nvswitch(name)
    return dataclasses.replace(inv, devices=tuple(dataclasses.replace(d, product=A100) for d in inv.devices))


def views_of(
    inventories: dict[str, models.NodeInventory], *held: models.GpuClaim
) -> list[allocator.NodeView]:
    taken: dict[str, list[int]] = {name: [] for name in inventories}
    for c in held:
        for alloc in c.status.allocations:
            taken[alloc.node_name] += [d.index for d in alloc.devices]
    return [node(name, inv, taken=taken[name]) for name, inv in inventories.items()]


def quota(
    *limits: tuple[str, int], gpus: int = 64, ledger: dict[str, models.QuotaEntry] | None = None
) -> models.GpuQuota:
    return models.GpuQuota(
        metadata=models.ObjectMeta(name="q", namespace="ns"),
        spec=models.GpuQuotaSpec(
            gpus=gpus, products=tuple(models.ProductLimit(pattern=p, gpus=n) for p, n in limits)
        ),
        status=models.GpuQuotaStatus(claims=dict(ledger or {})),
    )


def priority(c: models.GpuClaim) -> int:
    return c.spec.priority


def plan_with_quotas(
    wanted: models.GpuClaim,
    inventories: dict[str, models.NodeInventory],
    held: Sequence[models.GpuClaim],
    namespace_quotas: Sequence[models.GpuQuota],
) -> tuple[preemption.Plan | None, list[str]]:
    """The plan and the refusals met on the way, checked as the reconciler checks them."""
    refused: list[str] = []

    def admit(decision: allocator.Decision) -> str:
        product = ",".join(
            sorted(
                {
                    d.product
                    for a in decision.allocations
                    for d in inventories[a.node_name].devices
                    if d.uuid in {ref.uuid for ref in a.devices}
                }
            )
        )
        why = quotas.admissible(namespace_quotas, wanted, product)
        if why:
            refused.append(why)
        return why

    pool = preemption.candidates(wanted, held, priority=priority, cluster_scope=True)
    views = views_of(inventories, *held)
    plan = preemption.choose(
        wanted, pool, views, lambda v: allocator.allocate(wanted, v), priority=priority, admit=admit
    )
    return plan, refused


def victims(plan: preemption.Plan | None) -> list[str]:
    assert plan is not None
    return [v.metadata.name for v in plan.victims]


# Node h (H100): 4 GPUs of priority 0 in another namespace, 4 of priority 3. Node a (A100): 8 GPUs of
# priority 1. Without quotas the 4 H100s are the minimal plan (fewest GPUs displaced).
HELD = (
    holding("h-low", "h", (0, 1, 2, 3), priority=0, ns="other"),
    holding("h-high", "h", (4, 5, 6, 7), priority=3, ns="other"),
    holding("a-all", "a", tuple(range(8)), priority=1, ns="other"),
)
BOXES = {"h": nvswitch("h"), "a": a100("a")}


def test_without_quotas_the_h100_holder_is_the_minimal_plan() -> None:
    plan, refused = plan_with_quotas(claim(4, namespace="ns", priority=2), BOXES, HELD, [])
    assert victims(plan) == ["h-low"] and not refused


def test_a_plan_on_products_the_quota_refuses_is_skipped_for_an_admissible_one() -> None:
    plan, refused = plan_with_quotas(
        claim(4, namespace="ns", priority=2), BOXES, HELD, [quota(("*H100*", 0))]
    )
    assert victims(plan) == ["a-all"]
    assert plan is not None and {a.node_name for a in plan.decision.allocations} == {"a"}
    assert refused and "0 *H100* GPUs" in refused[0]


def test_no_plan_when_every_placement_is_refused_by_the_quota_and_the_refusal_is_said() -> None:
    only_h100 = {"h": nvswitch("h")}
    held = HELD[:2]
    plan, refused = plan_with_quotas(
        claim(4, namespace="ns", priority=2), only_h100, held, [quota(("*H100*", 0))]
    )
    assert plan is None
    assert refused[0] == "namespace ns would use 4 of 0 *H100* GPUs (quota ns/q)"
    # The total counts too: 4 more GPUs where 2 are left is refused whatever the product.
    plan, refused = plan_with_quotas(claim(4, namespace="ns", priority=2), BOXES, HELD, [quota(gpus=2)])
    assert plan is None and refused[0] == "namespace ns would use 4 of 2 GPUs (quota ns/q)"


def test_preemption_frees_gpus_not_quota_so_the_own_namespaces_victims_still_count() -> None:
    # The preemptor is entered in its ledgers before any victim is marked (reconciling), while the
    # victims' entries stay until their GPUs are free: so its quota must hold it with them counted.
    mine = holding("mine-a100", "a", tuple(range(8)), priority=0, ns="ns")
    ledger = {mine.metadata.uid: models.QuotaEntry(name="mine-a100", gpus=8, product=A100)}
    capped = quota(("*A100*", 8), ("*H100*", 0), gpus=8, ledger=ledger)
    wanted = claim(4, namespace="ns", priority=2)
    assert quotas.admissible([capped], wanted, A100) == "namespace ns would use 12 of 8 GPUs (quota ns/q)"
    plan, refused = plan_with_quotas(wanted, {"h": nvswitch("h"), "a": a100("a")}, (HELD[0], mine), [capped])
    assert plan is None and refused[0] == "namespace ns would use 12 of 8 GPUs (quota ns/q)"
    roomy = quota(("*A100*", 12), ("*H100*", 0), gpus=12, ledger=ledger)
    plan, _ = plan_with_quotas(wanted, {"h": nvswitch("h"), "a": a100("a")}, (HELD[0], mine), [roomy])
    assert victims(plan) == ["mine-a100"], "with room for both, its own claim's GPUs are preempted"


def test_a_claim_the_ledger_holds_for_that_product_already_is_admitted_as_the_ledger_would() -> None:
    wanted = dataclasses.replace(
        claim(2, namespace="ns", priority=2),
        metadata=models.ObjectMeta(name="c", namespace="ns", uid="uid-c"),
    )
    held_before = {"uid-c": models.QuotaEntry(name="c", gpus=2, product="NVIDIA H100 80GB HBM3")}
    # Admitted before the H100 limit was lowered to 0: the ledger holds it, and so Ledger.admit would.
    assert (
        quotas.admissible([quota(("*H100*", 0), ledger=held_before)], wanted, "NVIDIA H100 80GB HBM3") == ""
    )


# ------------------------------------------------------------------ the bounds


def test_a_claim_larger_than_every_node_is_ruled_out_before_any_search() -> None:
    assert preemption.exceeds_every_node(claim(64, priority=1), [8, 8, 4])
    assert not preemption.exceeds_every_node(claim(8, priority=1), [8, 4])
    assert preemption.exceeds_every_node(claim(1, priority=1), [])  # no node at all
    # MIG instances are counted, several to a GPU: not ruled out by GPU counts.
    assert not preemption.exceeds_every_node(claim(64, priority=1, exclusivity="MIG"), [8])


def many_nodes(n: int) -> tuple[dict[str, models.NodeInventory], list[models.GpuClaim]]:
    """``n`` full 8-GPU nodes, each held by one 8-GPU claim of priority 0 in namespace ns."""
    inventories = {f"n{i:03d}": nvswitch(f"n{i:03d}") for i in range(n)}
    held = [holding(f"c{i:03d}", name, tuple(range(8)), priority=0) for i, name in enumerate(inventories)]
    return inventories, held


def counting_place(wanted: models.GpuClaim, tried: set[str]) -> preemption.Place:
    def place(views: Sequence[allocator.NodeView]) -> allocator.Decision:
        tried.update(v.name for v in views)
        return allocator.allocate(wanted, views)

    return place


def test_one_search_tries_at_most_max_nodes_nodes() -> None:
    wanted = claim(8, namespace="ns", priority=1, product="*A100*")  # fits on no node: all are H100
    inventories, held = many_nodes(100)
    tried: set[str] = set()
    pool = preemption.candidates(wanted, held, priority=priority, cluster_scope=False)
    plan = preemption.choose(
        wanted, pool, views_of(inventories, *held), counting_place(wanted, tried), priority=priority
    )
    assert plan is None
    assert len(tried) == preemption.MAX_NODES
    tried.clear()
    preemption.choose(
        wanted,
        pool,
        views_of(inventories, *held),
        counting_place(wanted, tried),
        priority=priority,
        max_nodes=5,
    )
    assert len(tried) == 5


def test_the_search_stops_once_no_later_node_can_displace_fewer_gpus() -> None:
    # Node n000 has 6 GPUs free and a 2-GPU claim of priority 0: a 2-GPU plan. Every other node is
    # full, so a plan there displaces at least 8 GPUs: none of them is searched.
    inventories, held = many_nodes(10)
    held[0] = holding("small", "n000", (0, 1), priority=0)
    wanted = claim(8, namespace="ns", priority=1)
    tried: set[str] = set()
    pool = preemption.candidates(wanted, held, priority=priority, cluster_scope=False)
    plan = preemption.choose(
        wanted, pool, views_of(inventories, *held), counting_place(wanted, tried), priority=priority
    )
    assert victims(plan) == ["small"]
    assert tried == {"n000"}


def test_nodes_whose_free_and_candidate_gpus_fall_short_are_not_searched() -> None:
    inventories, held = many_nodes(3)
    held[1] = holding("half", "n001", (0, 1, 2, 3), priority=0)  # and 4 more held by a higher one
    held.append(holding("keeper", "n001", (4, 5, 6, 7), priority=5))
    held[0] = dataclasses.replace(held[0], spec=dataclasses.replace(held[0].spec, priority=5))
    held[2] = dataclasses.replace(held[2], spec=dataclasses.replace(held[2].spec, priority=5))
    wanted = claim(8, namespace="ns", priority=1)
    tried: set[str] = set()
    pool = preemption.candidates(wanted, held, priority=priority, cluster_scope=False)
    assert [c.metadata.name for c in pool] == ["half"]
    plan = preemption.choose(
        wanted, pool, views_of(inventories, *held), counting_place(wanted, tried), priority=priority
    )
    assert plan is None and not tried
