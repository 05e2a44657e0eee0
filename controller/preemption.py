"""Which Allocated claims a claim that fits nowhere takes its GPUs from (pure).

A Pending claim whose ``preemptionPolicy`` is ``PreemptLowerPriority`` (the
default) and that fits nowhere may preempt **candidates**: Allocated claims
(not being deleted, not fenced for release) of strictly lower priority, in its
own namespace or, with ``--preemption-scope Cluster``, in any. Priorities are
compared capped by each namespace's quotas (``quotas.max_priority``), as the
queue orders them, so a tenant cannot out-rank another by writing a big number.

**Admission before preemption.** A plan counts only if the claim would then be
admitted: ``choose`` takes an ``admit`` check (the caller's: every quota of the
preemptor's namespace, total and per product, ``quotas.admissible``) and treats
a placement it refuses as not fitting. So the search finds an admissible plan
(A100 holders rather than H100 holders, when the namespace may have no H100) or
none, and no victim is chosen for a claim its quotas would hold back.
Preemption frees GPUs, never quota: the victims' entries still count, as they
do until their GPUs are free, so the controller can enter the preemptor in its
ledgers before it marks any victim (``reconciling``).

``choose`` finds the victims, minimal in this order: fewest GPUs displaced,
then the lowest top priority among them, then the fewest claims, then names.
Each search adds candidates lowest priority first (then fewest GPUs, then
name) until the claim fits (and is admitted) on the nodes with their devices
freed, then takes each back out, highest priority first, where the claim still
fits without it, so no victim is needless. A search where the claim does not
fit even with every candidate gone stops there.

A one-replica claim is searched node by node, each search placing it on that
node alone with only the candidates there (found by node, not by scanning every
candidate per node). Nodes are tried in order of the fewest GPUs a plan there
must displace (for whole GPUs: ``count`` less the node's free GPUs), then the
most GPUs their candidates hold, then name; nodes whose free and candidates'
GPUs together fall short of ``count`` are skipped, the search stops once no
later node can beat the best plan, and **at most ``MAX_NODES`` nodes are
searched** (so the plan is minimal among those: with more nodes in reach, a
better plan on a later node may be missed). A gang is searched on every node at
once, over its first ``MAX_GANG_CANDIDATES`` candidates. Before any of this,
the caller skips a claim that asks more GPUs per replica than any node has
(``exceeds_every_node``): it never fits, whoever is preempted.

The controller then marks the victims ``Preempted`` (naming the preemptor),
evicts their pods (the Eviction API: PodDisruptionBudgets hold), releases their
Leases once the pods are gone, and the preemptor is allocated by its next try.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

from controller import allocator, locks
from controller.nodes import in_mig_mode
from gpualloc.api import constants, models

MAX_NODES = 64  # nodes a one-replica claim's search tries at most
MAX_GANG_CANDIDATES = 256  # candidates a gang's search considers at most (lowest priority first)

Place = Callable[[Sequence[allocator.NodeView]], allocator.Decision]
# Why the claim placed so would not be admitted ("" when it would).
Admit = Callable[[allocator.Decision], str]


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


def exceeds_every_node(claim: models.GpuClaim, totals: Iterable[int]) -> bool:
    """Does one replica ask for more GPUs than any node has (``totals``: each node's GPU count, or
    any bound above its usable GPUs)? Such a claim fits nowhere whoever is preempted. A MIG claim
    counts instances, several to a GPU: never ruled out here."""
    if claim.spec.devices.exclusivity == "MIG":
        return False
    return claim.spec.devices.count > max(totals, default=0)


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
    admit: Admit | None = None,
    max_nodes: int = MAX_NODES,
) -> Plan | None:
    """The victims to preempt so that ``claim`` fits and is admitted (``pool``: ``candidates``, in
    that order; ``admit``: None admits every placement), or None.

    ``views``: every node for a gang; for a one-replica claim, the nodes holding candidates suffice.
    """
    if claim.spec.replicas != 1:
        return _minimal(list(pool)[:MAX_GANG_CANDIDATES], views, place, priority=priority, admit=admit)
    by_node: dict[str, list[models.GpuClaim]] = {}
    freeable: dict[str, int] = {}
    for candidate in pool:
        for alloc in candidate.status.allocations:
            on_node = by_node.setdefault(alloc.node_name, [])
            if not on_node or on_node[-1] is not candidate:
                on_node.append(candidate)
            freeable[alloc.node_name] = freeable.get(alloc.node_name, 0) + len(alloc.devices)
    whole = claim.spec.devices.exclusivity == "Exclusive"
    count = claim.spec.devices.count
    ranked: list[tuple[int, int, str, allocator.NodeView]] = []
    for view in views:
        if view.name not in by_node:
            continue
        free = _free_whole(view) if whole else 0
        if whole and free + freeable[view.name] < count:
            continue  # even every candidate there gone leaves too few GPUs
        ranked.append((max(0, count - free), -freeable[view.name], view.name, view))
    ranked.sort(key=lambda r: r[:3])
    best: Plan | None = None
    for least, _, name, view in ranked[:max_nodes]:
        if best is not None and least > best.gpus:
            break  # nodes are in order of the least they displace: none beats the best any more
        plan = _minimal(by_node[name], [view], place, priority=priority, admit=admit)
        if plan is not None and (best is None or _rank(plan, priority) < _rank(best, priority)):
            best = plan
    return best


def _free_whole(view: allocator.NodeView) -> int:
    """The node's free whole GPUs: healthy, not in MIG mode, not shared, not taken."""
    if view.inventory is None:
        return 0
    return sum(
        1
        for d in view.inventory.devices
        if d.health == constants.HEALTHY and not in_mig_mode(d) and not d.shared and d.uuid not in view.taken
    )


def _rank(plan: Plan, priority: Callable[[models.GpuClaim], int]) -> tuple[int, int, int, tuple[str, ...]]:
    top = max(priority(v) for v in plan.victims)
    return (plan.gpus, top, len(plan.victims), tuple(v.key for v in plan.victims))


def _freed(
    views: Sequence[allocator.NodeView], victims: Iterable[models.GpuClaim]
) -> list[allocator.NodeView]:
    free = {d.lock_id for v in victims for a in v.status.allocations for d in a.devices if not d.milli}
    shares: dict[str, int] = {}
    for victim in victims:
        for uuid, milli in locks.listed_shares(victim).items():
            shares[uuid] = shares.get(uuid, 0) + milli
    out = []
    for view in views:
        used = dict(view.milli_used)
        gone = set(free)
        for uuid, milli in shares.items():
            if uuid in used:  # a GPU its shares leave entirely is free whole
                used[uuid] -= milli
                if used[uuid] <= 0:
                    del used[uuid]
                    gone.add(uuid)
        if view.taken & gone or used != view.milli_used:
            view = dataclasses.replace(view, taken=view.taken - gone, milli_used=used)
        out.append(view)
    return out


def _fits(
    views: Sequence[allocator.NodeView],
    victims: Sequence[models.GpuClaim],
    place: Place,
    admit: Admit | None,
) -> allocator.Decision | None:
    """Where the claim goes with ``victims`` gone, if it fits there and would be admitted."""
    decision = place(_freed(views, victims))
    if not decision.ok or (admit is not None and admit(decision)):
        return None
    return decision


def _minimal(
    pool: Sequence[models.GpuClaim],
    views: Sequence[allocator.NodeView],
    place: Place,
    *,
    priority: Callable[[models.GpuClaim], int],
    admit: Admit | None,
) -> Plan | None:
    if not pool or (len(pool) > 1 and not place(_freed(views, pool)).ok):
        return None  # not even with every candidate gone
    chosen: list[models.GpuClaim] = []
    decision: allocator.Decision | None = None
    for victim in pool:
        chosen.append(victim)
        decision = _fits(views, chosen, place, admit)
        if decision is not None:
            break
    if decision is None:
        return None
    for victim in sorted(chosen, key=lambda c: (-priority(c), -gpus(c), c.key)):
        rest = [c for c in chosen if c is not victim]
        if rest and (fits := _fits(views, rest, place, admit)) is not None:
            chosen, decision = rest, fits
    return Plan(tuple(sorted(chosen, key=lambda c: c.key)), decision)
