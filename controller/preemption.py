"""Which Allocated claims a claim that fits nowhere takes its GPUs from (pure).

A Pending claim whose ``preemptionPolicy`` is ``PreemptLowerPriority`` (the
default) and that fits nowhere may preempt **candidates**: Allocated claims
(not being deleted, not fenced for release) of strictly lower priority, in its
own namespace or, with ``--preemption-scope Cluster``, in any. Priorities are
compared capped by each namespace's quotas (``quotas.max_priority``), as the
queue orders them, so a tenant cannot out-rank another by writing a big number.

``choose`` finds the victims, minimal in this order: fewest GPUs displaced,
then the lowest top priority among them, then the fewest claims, then names.
Each search adds candidates lowest priority first (then fewest GPUs, then
name) until the claim fits on the nodes with their devices freed, then takes
each back out, highest priority first, where the claim still fits without it,
so no victim is needless. A one-replica claim is searched node by node, each
search placing it on that node alone with only the candidates there (so the
work grows with the nodes that hold candidates, not with their square); a
gang, on every node at once.

The controller then marks the victims ``Preempted`` (naming the preemptor),
evicts their pods (the Eviction API: PodDisruptionBudgets hold), releases their
Leases once the pods are gone, and the preemptor is allocated by its next try.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from controller import allocator
from gpualloc.api import constants, models

Place = Callable[[Sequence[allocator.NodeView]], allocator.Decision]


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    victims: tuple[models.GpuClaim, ...]
    decision: allocator.Decision  # where the claim fits once they are gone

    @property
    def gpus(self) -> int:
        return sum(gpus(v) for v in self.victims)

    def describe(self) -> str:
        names = ", ".join(f"{v.key} ({gpus(v)} GPUs, priority {v.spec.priority})" for v in self.victims)
        return f"preempting {names}"


def gpus(claim: models.GpuClaim) -> int:
    return sum(len(a.devices) for a in claim.status.allocations)


def candidates(
    claim: models.GpuClaim,
    claims: Iterable[models.GpuClaim],
    *,
    priority: Callable[[models.GpuClaim], int],
    cluster_scope: bool,
) -> list[models.GpuClaim]:
    """The Allocated claims ``claim`` may preempt, lowest priority first (then fewest GPUs, key)."""
    mine = priority(claim)
    found = [
        other
        for other in claims
        if other.status.phase == constants.PHASE_ALLOCATED
        and other.status.allocations
        and not other.metadata.deletion_timestamp
        and not other.releasing
        and other.metadata.uid != claim.metadata.uid
        and (cluster_scope or other.metadata.namespace == claim.metadata.namespace)
        and priority(other) < mine
    ]
    return sorted(found, key=lambda c: (priority(c), gpus(c), c.key))


def choose(
    claim: models.GpuClaim,
    pool: Sequence[models.GpuClaim],
    views: Sequence[allocator.NodeView],
    place: Place,
    *,
    priority: Callable[[models.GpuClaim], int],
) -> Plan | None:
    """The victims to preempt so that ``claim`` fits (``pool``: ``candidates``, in that order), or None."""
    searches: list[tuple[list[models.GpuClaim], Sequence[allocator.NodeView]]] = []
    if claim.spec.replicas == 1:
        for view in views:
            on_node = [c for c in pool if any(a.node_name == view.name for a in c.status.allocations)]
            if on_node:
                searches.append((on_node, [view]))
    else:
        searches.append((list(pool), views))
    best: Plan | None = None
    for search, search_views in searches:
        plan = _minimal(search, search_views, place, priority=priority)
        if plan is not None and (best is None or _rank(plan, priority) < _rank(best, priority)):
            best = plan
    return best


def _rank(plan: Plan, priority: Callable[[models.GpuClaim], int]) -> tuple[int, int, int, tuple[str, ...]]:
    top = max(priority(v) for v in plan.victims)
    return (plan.gpus, top, len(plan.victims), tuple(v.key for v in plan.victims))


def _freed(
    views: Sequence[allocator.NodeView], victims: Iterable[models.GpuClaim]
) -> list[allocator.NodeView]:
    free = {d.lock_id for v in victims for a in v.status.allocations for d in a.devices}
    return [
        dataclasses.replace(view, taken=view.taken - free) if view.taken & free else view for view in views
    ]


def _minimal(
    pool: Sequence[models.GpuClaim],
    views: Sequence[allocator.NodeView],
    place: Place,
    *,
    priority: Callable[[models.GpuClaim], int],
) -> Plan | None:
    chosen: list[models.GpuClaim] = []
    decision: allocator.Decision | None = None
    for victim in pool:
        chosen.append(victim)
        decision = place(_freed(views, chosen))
        if decision.ok:
            break
    if decision is None or not decision.ok:
        return None
    for victim in sorted(chosen, key=lambda c: (-priority(c), -gpus(c), c.key)):
        rest = [c for c in chosen if c is not victim]
        if rest and (fits := place(_freed(views, rest))).ok:
            chosen, decision = rest, fits
    return Plan(tuple(sorted(chosen, key=lambda c: c.key)), decision)
