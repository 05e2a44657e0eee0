"""Choose a node and a set of GPUs for each replica of a claim (pure).

``allocate(claim, nodes)`` is a function of its arguments only: no I/O, no
clock, no global randomness (``strategy: random`` draws from
``random.Random(seed)``). Equal inputs give equal decisions.

Where the code is: ``asks`` parses the claim (what it asks for, what a device
or a node's labels must match), ``screening`` checks each node and picks its
usable devices, ``sets`` finds a node's best set, and this module ranks the
nodes, places the replicas and writes the reasons.

Nodes
    A node is a candidate when its Node object exists, is not cordoned, has no
    NoSchedule/NoExecute taint the claim's pods would not tolerate (its
    ``tolerations`` and ``taints.DEFAULT_TOLERATIONS``), has a
    GpuNodeStatus, is ready (the caller judges heartbeat freshness), matches
    ``spec.nodeName`` when set and ``spec.selector`` (``matches_selector``).

Devices
    A device is a candidate when it is Healthy, not in MIG mode, not shared, its UUID is not in ``taken``,
    and it matches ``product`` (``fnmatch.fnmatchcase``: shell glob,
    case-sensitive, as NVML reports the name, like label values),
    ``minMemoryMiB`` and ``minComputeCapability`` (compared as ``(major, minor)``
    integers; a device with no reported capability does not meet a minimum).
    ``policy: preferIds`` pins the set to those host indices: every replica's
    set is chosen among them and the node fails, naming the taken, unhealthy,
    missing or non-matching indices, when fewer than ``count`` are usable.

Sets (within one node)
    Every set of ``count`` candidate devices is scored when there are at most
    ``EXHAUSTIVE_LIMIT`` of them (every node up to 8 GPUs, and most beyond),
    otherwise a beam search of width ``BEAM_WIDTH`` grows sets one device at a
    time (not guaranteed optimal). Measures of a set: its least pairwise
    bandwidth (a missing link is 0 GB/s; a single device has no pairs and meets
    every bar), the NUMA nodes and NVLink islands it spans, and its *cut*: the
    bandwidth of the links between the set and the node's remaining candidate
    devices. A small cut takes devices whose neighbours are already gone and
    leaves the remaining free devices best connected (packing). Lower keys win:

    * ``packed``/``preferIds``: (-least bandwidth, NUMA nodes, cut, indices)
    * ``spread``: (-NUMA nodes, -least bandwidth, cut, indices)
    * ``contiguous``: (NVLink islands, -least bandwidth, NUMA nodes, cut, indices).
      Contiguous means one NVLink island and then the fastest links (fewest
      hops); it never means neighbouring indices (bridges 0-2/1-3 exist).

    ``topology.mode: Ignore`` drops the bandwidth and NUMA terms (packing by cut
    only, except the NUMA/island terms the policy itself asks for).
    ``Required`` keeps only sets whose least pairwise bandwidth reaches
    ``minBandwidthGBps``; with ``minBandwidthGBps: 0`` it keeps sets inside one
    NVLink island. ``Preferred`` with ``minBandwidthGBps`` is a soft threshold:
    the placement ``Required`` would make when there is one, otherwise the
    ``Preferred`` placement, its ``note`` saying that it is below the bar.
    The last tie-break is the lowest indices (lexicographic).

Nodes (choice)
    Among nodes that have a set, the strategy ranks first, then set quality
    (higher least bandwidth, then fewer NUMA nodes; skipped for ``Ignore``),
    then the node name. Topology therefore never overrides the strategy across
    nodes: ``Required`` is a bar a set either meets or not, and ``Preferred``
    picks the best set on the node the strategy prefers, using bandwidth to
    break the strategy's ties. Strategies, with *free* = healthy and not taken:

    * ``binpack``: highest allocated fraction ``(total - free) / total``, then fewest free
    * ``leastLoaded``: lowest allocated fraction, then most free
    * ``spread``: most free GPUs
    * ``bestFit``: fewest free GPUs left over after the placement
    * ``random``: a ``random.Random(seed)`` shuffle of the node names
    * ``roundRobin``: the first node at or after ``round_robin_cursor`` in
      sorted-name order (wrapping); a gang's next replica starts after the last node used
    * ``costOptimized``: the node label ``cost_label`` ranked by ``cost_preference``
      (nodes without the label, or with another value, last), then ``binpack``
    * ``leastFragmentation``: the least pressure on the node's GPU product from the claims that
      need it, then the least fragmentation the claim adds to the node's free GPUs, both against
      ``workload``, the claims seen lately, then the node name (first fit;
      ``controller.fragmentation``); fractional shares too

Gangs
    ``replicas: N`` places replica 0..N-1 in turn against a local copy of the
    taken devices, so no device serves two replicas; replicas may share or
    split nodes. All replicas are placed or none (``allocations`` is empty).
    Placement is greedy: a gang that would fit only with a different order of
    choices is reported as not fitting.

Reasons
    When nothing fits, ``reason`` is one line: nodes counted by their first
    failing check, most common first, e.g. ``0/12 nodes fit: 7 have fewer than
    4 free healthy GPUs, 4 have no 4-GPU set with >=600 GB/s, 1 is cordoned``;
    for gangs ``only 4 of 5 replicas fit: of 12 nodes, ...``. ``per_node``
    has each node's own line (``fits: ...`` for nodes that could take it).
    For speed, nodes ranked below the winner are not searched, and nodes tied
    with it are searched in order of the best set they could reach (their
    fastest link, the fewest NUMA nodes their free GPUs allow) until none can
    win, unless ``explain=True``; the decision is the same either way.
    Per-inventory tables (bandwidth matrix, islands) are memoised by object
    identity: keep parsed inventories between decisions.

MIG claims
    ``exclusivity: MIG`` asks for ``count`` MIG instances per replica: free
    instances (of a healthy GPU in MIG mode) of an accepted profile
    (``migProfile``; any when absent), taken in placement order GPU by GPU, so
    several pack onto one GPU. ``minMemoryMiB`` applies to the instance,
    ``product`` and ``minComputeCapability`` to its GPU; topology does not
    apply. The caller marks a GPU's instances taken when the GPU is held whole,
    and the GPU taken when one of its instances is (``views.taken_on``).

Shared claims
    ``exclusivity: Shared`` asks for one slot on each of ``count`` different
    GPUs per replica, of GPUs the node's agent offers for sharing
    (``Device.sharing``: a strategy and a number of slots) with the claim's
    ``sharing.strategy`` and at most ``sharing.maxClaimsPerGPU`` slots. Each
    slot has its own Lease (``constants.slot_id``), so at most that many
    claims ever hold the GPU. The fullest GPUs are taken first; ``total`` and
    *free* count slots for the strategies. A shared GPU is never handed out
    whole, a GPU in MIG mode is never shared, and topology does not apply.

Fractional shares
    ``exclusivity: Shared`` with ``sharing.milli`` asks for that many milli-GPU
    of one GPU per replica, of the healthy whole GPUs (not in MIG mode, not
    offered as slots) that are free or hold only shares with that much left
    (``NodeView.milli_used``); best fit first (the least left once placed), so
    shares pack and whole GPUs stay whole: on a node, the tightest GPU, and across
    nodes, for the packing strategies (``binpack``, ``bestFit``), the node whose
    tightest GPU is left with least, then the first by name (``_share_left``);
    ``leastFragmentation`` ranks them as it ranks whole GPUs. The GPU's own Lease holds the
    shares' ledger (``locking``, rules 6 to 8): a GPU with a share is never
    free for a whole claim, nor the other way round. ``total`` and *free*
    count the GPUs shares may go on and those with room.

Indexed nodes
    Given a ``nodes.NodeIndex`` instead of a list, a one-replica claim ranked by
    load (binpack, leastLoaded, spread, bestFit, costOptimized, without
    ``nodeName``) is placed by visiting nodes in the order the full search would
    rank them, from the index's buckets, and stopping at the winner: nodes with
    fewer free GPUs than asked are never looked at (``_allocate_indexed``). The
    decision is the full search's (``tests/property/test_node_index.py``), and
    ``per_node`` then names only the chosen node. Anything else, and every claim
    that does not fit (whose reason needs every node), takes the full search.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from controller import fragmentation
from controller.asks import Ask, parse
from controller.nodes import Bucket, NodeIndex, fewest_numa_nodes, in_mig_mode, per_numa
from controller.nodes import NodeView as NodeView  # the allocator's input, by its long-standing name
from controller.screening import Miss, Screened, ShareDevice, SlotDevice, screen, taking_pods
from controller.sets import NO_PAIRS, Choice, Key, best_set
from gpualloc.api import constants, leases, models

MAX_REASON_GROUPS = 6


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    allocations: tuple[models.Allocation, ...]
    reason: str  # why nothing fits ("" when it does)
    per_node: Mapping[str, str]
    note: str = ""  # what to know about a placement (one below a preferred bandwidth)

    @property
    def ok(self) -> bool:
        return bool(self.allocations)


def order_key(claim: models.GpuClaim, *, priority_cap: int | None = None) -> tuple[int, str, str, str]:
    """Allocation order: priority (high first, at most ``priority_cap``: its namespace's quota), then
    creationTimestamp, then namespace/name."""
    priority = claim.spec.priority if priority_cap is None else min(claim.spec.priority, priority_cap)
    return (
        -priority,
        claim.metadata.creation_timestamp,
        claim.metadata.namespace,
        claim.metadata.name,
    )


def order_pending(claims: Iterable[models.GpuClaim]) -> list[models.GpuClaim]:
    """Claims in allocation order (``order_key``); the controller's work queue uses the same key."""
    return sorted(claims, key=order_key)


# ----------------------------------------------------------------- node choice


LOAD_STRATEGIES = ("binpack", "leastLoaded", "spread", "bestFit", "costOptimized")  # rank by load alone


def _load_key(strategy: str, total: int, free: int, count: int, tier: int) -> Key:
    """The rank of a node by its load, for the ``LOAD_STRATEGIES`` (``tier``: its cost tier's rank)."""
    used = (total - free) / total  # equal fractions give equal floats: division is correctly rounded
    if strategy == "binpack":
        return (-used, free)
    if strategy == "leastLoaded":
        return (used, -free)
    if strategy == "spread":
        return (-free,)
    if strategy == "bestFit":
        return (free - count,)
    # costOptimized
    return (tier, -used, free)


def _strategy_key(
    node: Screened,
    ask: Ask,
    *,
    n_nodes: int,
    cursor: int,
    random_rank: Mapping[str, int],
    cost_label: str,
    cost_rank: Mapping[str, int],
    workload: fragmentation.Workload | None = None,
    pressures: Mapping[str, int] | None = None,
) -> Key:
    if ask.strategy == fragmentation.STRATEGY:
        return fragmentation.node_key(node, ask, workload, pressures)
    if ask.strategy == "random":
        return (random_rank[node.view.name],)
    if ask.strategy == "roundRobin":
        return ((node.position - cursor) % n_nodes,)
    if ask.sharing.milli is not None and ask.strategy in PACKING:
        return (_share_left(node, ask.sharing.milli), node.position)
    tier = cost_rank.get(node.view.labels.get(cost_label, ""), len(cost_rank))
    return _load_key(ask.strategy, node.total, node.free, ask.count, tier)


PACKING = ("binpack", "bestFit")  # the load strategies that fill nodes up


def _share_left(node: Screened, milli: int) -> int:
    """The milli-GPU a fractional share leaves on the node's tightest GPU that holds it (screening
    sorts it first). The packing strategies rank a share by it, then by node name: the GPU in the
    cluster it fills best, and among equals the first node (first fit, which keeps the last nodes
    whole; on the openb trace a point more GPU placed than ranking equals by load)."""
    return leases.WHOLE_MILLI - node.view.milli_used.get(node.usable[0].uuid, 0) - milli


def _cost_rank(cost_preference: Sequence[str]) -> dict[str, int]:
    return {tier: r for r, tier in reversed(list(enumerate(cost_preference)))}


def _quality_bound(node: Screened, ask: Ask) -> Key:
    """A key no worse than ``(*_quality(best set), name)`` for any set on this node."""
    numa = fewest_numa_nodes(per_numa(node.usable), ask.count)
    return _bound(ask, node.view.name, node.position, node.prep.max_bw, numa)


def _bound(ask: Ask, name: str, position: int, max_bw: int, numa: int) -> Key:
    """No set of the node has a higher least bandwidth than its fastest link, nor spans fewer NUMA
    nodes than its free GPUs allow: without the second term, a claim whose every set spans two
    NUMA nodes (8 GPUs of a two-socket box) would search every tied node for a set on one."""
    if ask.mode == "Ignore":
        return (name, position)
    least = NO_PAIRS if ask.count == 1 else max_bw
    return (-least, numa, name, position)


def _quality(choice: Choice, ask: Ask) -> Key:
    if ask.mode == "Ignore":
        return ()
    return (-choice.least_bw, choice.numa)


def allocate(
    claim: models.GpuClaim,
    nodes: Sequence[NodeView] | NodeIndex,
    *,
    seed: int = 0,
    round_robin_cursor: int = 0,
    cost_label: str = constants.LABEL_COST_TIER,
    cost_preference: Sequence[str] = ("low", "medium", "high"),
    explain: bool = False,
    workload: fragmentation.Workload | None = None,
) -> Decision:
    """Place every replica of ``claim`` on ``nodes`` or none; see the module docstring.

    ``nodes`` as a ``NodeIndex`` gives the same decision, found without
    screening every node where the claim allows (see "Indexed nodes").
    """
    search = _Search(
        nodes=nodes,
        seed=seed,
        round_robin_cursor=round_robin_cursor,
        cost_label=cost_label,
        cost_preference=cost_preference,
        explain=explain,
        workload=workload,
    )
    topology = claim.spec.topology
    if topology.mode == "Preferred" and topology.min_bandwidth_gbps > 0 and claim.spec.devices.count > 1:
        # A soft threshold: the placement Required would make, else the best there is.
        strict = search.route(_with_mode(claim, "Required"))
        if strict.ok:
            return strict
        best = search.route(claim)
        if best.ok:
            note = f"below the preferred {topology.min_bandwidth_gbps} GB/s: {strict.reason}"
            return dataclasses.replace(best, note=note)
        return best
    return search.route(claim)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Search:
    """One ``allocate`` call's nodes and settings: where a claim (or a part of a gang) is placed."""

    nodes: Sequence[NodeView] | NodeIndex
    seed: int
    round_robin_cursor: int
    cost_label: str
    cost_preference: Sequence[str]
    explain: bool
    workload: fragmentation.Workload | None = None  # leastFragmentation's (``fragmentation``)

    def views(self) -> Sequence[NodeView]:
        """Every node (an index's list is built only when it is needed)."""
        return self.nodes.views() if isinstance(self.nodes, NodeIndex) else self.nodes

    def route(self, claim: models.GpuClaim) -> Decision:
        """``claim`` on every node: domain by domain for a gang with ``sameNodeLabel``."""
        if claim.spec.topology.same_node_label and claim.spec.replicas > 1:
            return _allocate_in_domains(claim, self.views(), self.place)
        return self.place(claim, None)

    def place(self, claim: models.GpuClaim, candidates: Sequence[NodeView] | None) -> Decision:
        """``claim`` on ``candidates``, or on every node (None), through the index where it serves."""
        index = self.nodes if isinstance(self.nodes, NodeIndex) else None
        if index is not None and candidates is None and index.cost_label == self.cost_label:
            found = (_explain_indexed if self.explain else _allocate_indexed)(
                claim, index, self.cost_preference
            )
            if found is not None:
                return found
        return _allocate(
            claim,
            self.views() if candidates is None else candidates,
            seed=self.seed,
            round_robin_cursor=self.round_robin_cursor,
            cost_label=self.cost_label,
            cost_preference=self.cost_preference,
            explain=self.explain,
            workload=self.workload,
        )


# ------------------------------------------------------------------ gangs across nodes


def _free_gpus(views: Iterable[NodeView]) -> int:
    return sum(
        1
        for v in views
        if v.inventory is not None
        for d in v.inventory.devices
        if d.health == constants.HEALTHY and not in_mig_mode(d) and not d.shared and d.uuid not in v.taken
    )


def _with_mode(claim: models.GpuClaim, mode: str) -> models.GpuClaim:
    topology = dataclasses.replace(claim.spec.topology, mode=mode)
    return dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, topology=topology))


def _with_replicas(claim: models.GpuClaim, replicas: int) -> models.GpuClaim:
    return dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, replicas=replicas))


def _allocate_in_domains(
    claim: models.GpuClaim,
    nodes: Sequence[NodeView],
    place: Callable[[models.GpuClaim, Sequence[NodeView]], Decision],
) -> Decision:
    """A gang whose replicas should share a node label's value (``topology.sameNodeLabel``: an
    NVLink clique such as ``nvidia.com/gpu.clique``, a rack, an InfiniBand leaf).

    Domains (the label's values) are tried fullest first, so that the emptier ones stay whole
    for larger gangs; the first that takes every replica wins. ``Required``: no such domain, no
    allocation, and the reason gives each domain's. ``Preferred``: the domain that takes the most
    replicas gets them, and the rest go wherever they fit.
    """
    key, replicas = claim.spec.topology.same_node_label, claim.spec.replicas
    domains: dict[str, list[NodeView]] = {}
    outside: list[NodeView] = []
    for view in nodes:
        value = view.labels.get(key)
        (domains.setdefault(value, []) if value is not None else outside).append(view)
    order = sorted(domains, key=lambda value: (_free_gpus(domains[value]), value))
    per_node = {v.name: f"has no label {key}" for v in outside}
    tried: list[tuple[str, Decision]] = []
    for value in order:
        decision = place(claim, domains[value])
        if decision.ok:
            return Decision(
                allocations=decision.allocations, reason="", per_node={**per_node, **decision.per_node}
            )
        tried.append((value, decision))
        per_node.update({name: f"{key}={value}: {line}" for name, line in decision.per_node.items()})
    if claim.spec.topology.same_node_label_mode == "Preferred" and domains:
        return _place_most_in_one_domain(claim, nodes, domains, order, place, per_node)
    parts = [f"{key}={value}: {decision.reason}" for value, decision in tried]
    if outside:
        parts.append(f"{len(outside)} node{'s' if len(outside) != 1 else ''} without {key}")
    reason = f"no {key} domain takes all {replicas} replicas ({'; '.join(parts) or 'no nodes'})"
    return Decision(allocations=(), reason=reason, per_node=per_node)


def _place_most_in_one_domain(
    claim: models.GpuClaim,
    nodes: Sequence[NodeView],
    domains: Mapping[str, Sequence[NodeView]],
    order: Sequence[str],
    place: Callable[[models.GpuClaim, Sequence[NodeView]], Decision],
    per_node: dict[str, str],
) -> Decision:
    replicas, key = claim.spec.replicas, claim.spec.topology.same_node_label
    best: tuple[int, Decision] | None = None
    for value in order:
        low, high, found = 1, replicas - 1, None  # how many replicas fit here (a monotone question)
        while low <= high:
            middle = (low + high) // 2
            decision = place(_with_replicas(claim, middle), domains[value])
            if decision.ok:
                low, found = middle + 1, (middle, decision)
            else:
                high = middle - 1
        if found is not None and (best is None or found[0] > best[0]):
            best = found
    if best is None:
        return Decision(
            allocations=(),
            reason=f"no replica fits in any {key} domain",
            per_node=per_node,
        )
    held, first = best
    used = {d.uuid for a in first.allocations for d in a.devices}
    rest_views = [dataclasses.replace(v, taken=v.taken | used) for v in nodes]
    rest = place(_with_replicas(claim, replicas - held), rest_views)
    if not rest.ok:
        reason = f"{held} of {replicas} replicas fit in one {key} domain; the rest: {rest.reason}"
        return Decision(allocations=(), reason=reason, per_node=per_node)
    moved = tuple(dataclasses.replace(a, replica=a.replica + held) for a in rest.allocations)
    return Decision(
        allocations=(*first.allocations, *moved), reason="", per_node={**per_node, **rest.per_node}
    )


def _allocate(
    claim: models.GpuClaim,
    nodes: Sequence[NodeView],
    *,
    seed: int,
    round_robin_cursor: int,
    cost_label: str,
    cost_preference: Sequence[str],
    explain: bool,
    workload: fragmentation.Workload | None = None,
) -> Decision:
    """``allocate`` on one set of nodes."""
    ask = parse(claim)
    if isinstance(ask, str):
        return Decision(allocations=(), reason=ask, per_node={})
    replicas = claim.spec.replicas
    views = sorted(nodes, key=lambda v: v.name)
    names = [v.name for v in views]
    if ask.node_name is not None and ask.node_name not in names:
        return Decision(
            allocations=(),
            reason=f'nodeName "{ask.node_name}" is not a known GPU node (0/{len(views)} nodes fit)',
            per_node={v.name: f'not the requested nodeName "{ask.node_name}"' for v in views},
        )
    if not views:
        return Decision(allocations=(), reason="0/0 nodes fit: no GPU nodes are known", per_node={})

    cost_rank = _cost_rank(cost_preference)
    rng = random.Random(seed)
    pressures = None  # leastFragmentation's pressure on each product (once per decision)
    if ask.strategy == fragmentation.STRATEGY and workload is not None and workload.names_products:
        pressures = fragmentation.pressures(workload, fragmentation.free_milli(views))
    extra: dict[str, set[str]] = {v.name: set() for v in views}
    screened: list[Screened | Miss] = [
        screen(v, ask, i, extra[v.name], len(views)) for i, v in enumerate(views)
    ]
    chosen_notes: dict[str, list[str]] = {}
    results: dict[str, Choice | Miss] = {}
    allocations: list[models.Allocation] = []
    cursor = round_robin_cursor % len(views)

    for replica in range(replicas):
        random_rank: dict[str, int] = {}
        if ask.strategy == "random":
            shuffled = list(names)
            rng.shuffle(shuffled)
            random_rank = {n: r for r, n in enumerate(shuffled)}
        results = {}
        fits = [s for s in screened if isinstance(s, Screened)]
        ranked = sorted(
            (
                _strategy_key(
                    s,
                    ask,
                    n_nodes=len(views),
                    cursor=cursor,
                    random_rank=random_rank,
                    cost_label=cost_label,
                    cost_rank=cost_rank,
                    workload=workload,
                    pressures=pressures,
                ),
                s.view.name,
                s.position,
                s,
            )
            for s in fits
        )
        winner: tuple[Screened, Choice] | None = None
        i = 0
        while i < len(ranked):
            j = i
            while j < len(ranked) and ranked[j][0] == ranked[i][0]:
                j += 1
            group_best: tuple[Key, Screened, Choice] | None = None
            # Search the tied nodes in order of the best quality they could reach, and stop
            # once no remaining node can beat the best set found (``explain`` searches all).
            for bound, s in sorted((_quality_bound(s, ask), s) for *_, s in ranked[i:j]):
                if group_best is not None and not explain and bound >= group_best[0]:
                    break
                res = best_set(s, ask)
                results[s.view.name] = res
                if isinstance(res, Choice):
                    cand = ((*_quality(res, ask), s.view.name, s.position), s, res)
                    if group_best is None or cand[0] < group_best[0]:
                        group_best = cand
            i = j
            if group_best is not None and winner is None:
                winner = (group_best[1], group_best[2])
                if not explain:
                    break

        if winner is None:
            misses = [s if isinstance(s, Miss) else results[s.view.name] for s in screened]
            summary = _summarise([(n, m) for n, m in zip(names, misses, strict=True) if isinstance(m, Miss)])
            if replicas > 1:
                of_nodes = f"{len(views)} node{'s' if len(views) != 1 else ''}"
                reason = f"only {replica} of {replicas} replicas fit: of {of_nodes}, {summary}"
            else:
                reason = f"0/{len(views)} nodes fit: {summary}"
            per_node = _lines(names, screened, results, ask)
            for name, notes in chosen_notes.items():
                per_node[name] = f"{per_node[name]} (after {'; '.join(notes)})"
            return Decision(allocations=(), reason=reason, per_node=per_node)

        node, choice = winner
        name = node.view.name
        allocations.append(_allocation(replica, name, choice))
        chosen_notes.setdefault(name, []).append(f"replica {replica} took {choice.describe()}")
        extra[name].update(d.uuid for d in choice.devices)
        placed = taking_pods(node.view, ask)
        screened[node.position] = screen(placed, ask, node.position, extra[name], len(views))
        cursor = (node.position + 1) % len(views)

    per_node = _lines(names, screened, results, ask)
    for name, notes in chosen_notes.items():
        per_node[name] = "chosen: " + "; ".join(notes)
    return Decision(allocations=tuple(allocations), reason="", per_node=per_node)


def _allocation(replica: int, node: str, choice: Choice) -> models.Allocation:
    return models.Allocation(
        replica=replica,
        node_name=node,
        devices=tuple(
            models.DeviceRef(
                index=d.index,
                minor=d.minor,
                uuid=d.uuid,
                slot=d.slot if isinstance(d, SlotDevice) else None,
                milli=d.milli if isinstance(d, ShareDevice) else None,
                memory_mib=d.memory_mib * d.milli // 1000
                if isinstance(d, ShareDevice) and d.memory_mib
                else None,
            )
            for d in choice.devices
        ),
        min_bandwidth_gbps=choice.reported_bw,
    )


# ------------------------------------------------------------------ indexed nodes


def _in_rank_order(
    ask: Ask, index: NodeIndex, cost_preference: Sequence[str]
) -> Iterator[Iterator[tuple[Key, str]]]:
    """The nodes with at least ``ask.count`` free GPUs as ``_allocate`` ranks them: one group per
    strategy key, best key first, each group's nodes in order of their quality bound (with the
    bound). Only the index's buckets are read: a node is looked at when its turn comes."""
    cost_rank = _cost_rank(cost_preference)
    groups: dict[Key, list[tuple[Bucket, Sequence[str]]]] = {}
    for bucket, names in index.buckets().items():
        if bucket.free < ask.count:
            continue
        tier = cost_rank.get(bucket.tier, len(cost_rank))
        key = _load_key(ask.strategy, bucket.total, bucket.free, ask.count, tier)
        groups.setdefault(key, []).append((bucket, names))

    def in_bound_order(bucket: Bucket, names: Sequence[str]) -> Iterator[tuple[Key, str]]:
        numa = fewest_numa_nodes(bucket.free_per_numa, ask.count)  # the same for the bucket's nodes
        for name in names:
            yield _bound(ask, name, index.position(name), bucket.max_bw, numa), name

    for key in sorted(groups):
        yield heapq.merge(*(in_bound_order(bucket, names) for bucket, names in groups[key]))


def _allocate_indexed(
    claim: models.GpuClaim, index: NodeIndex, cost_preference: Sequence[str]
) -> Decision | None:
    """``_allocate``'s decision for a one-replica claim ranked by load, when it places the claim;
    None when it would not, or for a claim this search does not cover (the caller then runs
    ``_allocate``, which says why). A claim of whole GPUs asking more than any node has free is
    refused at once, with a reason of its own.

    ``_allocate`` screens every node, ranks those that pass by strategy key, and
    searches the tied nodes of the best key in order of their quality bound,
    stopping once no node left can beat the best set found; the first key with
    a set wins. This visits nodes in that same order without screening the
    rest: the index's buckets give each node's key and bound (they depend only
    on its GPUs, free GPUs and their NUMA nodes, fastest link and cost tier),
    buckets with fewer free GPUs than the claim asks are never visited, and a node is screened
    only when its turn comes. Nodes that fail screening are skipped, as
    ``_allocate`` leaves them out of the ranking.
    """
    ask = parse(claim)
    if isinstance(ask, str) or ask.exclusivity != "Exclusive":
        return None  # buckets count whole GPUs
    most = index.most_free()
    if most < ask.count:
        # No node has that many free GPUs, so none passes screening: say so without visiting any.
        n = len(index)
        gpus = f"{ask.count} free healthy GPU{'s' if ask.count != 1 else ''}"
        reason = f"0/{n} nodes fit: none has {gpus} (at most {most} on one node)"
        return Decision(allocations=(), reason=reason, per_node={})
    if claim.spec.replicas != 1 or ask.strategy not in LOAD_STRATEGIES or ask.node_name is not None:
        return None
    n_nodes = len(index)
    for ranked in _in_rank_order(ask, index, cost_preference):
        best: tuple[Key, Screened, Choice] | None = None
        for bound, name in ranked:
            if best is not None and bound >= best[0]:
                break
            view = index.get(name)
            assert view is not None
            screened = screen(view, ask, index.position(name), set(), n_nodes)
            if isinstance(screened, Miss):
                continue
            found = best_set(screened, ask)
            if isinstance(found, Choice):
                candidate = ((*_quality(found, ask), name, screened.position), screened, found)
                if best is None or candidate[0] < best[0]:
                    best = candidate
        if best is not None:
            _, node, choice = best
            name = node.view.name
            return Decision(
                allocations=(_allocation(0, name, choice),),
                reason="",
                per_node={name: f"chosen: replica 0 took {choice.describe()}"},
            )
    return None


EXPLAIN_SEARCHED = 16  # fitting nodes an explain over the index searches besides the chosen one


def _explain_indexed(
    claim: models.GpuClaim, index: NodeIndex, cost_preference: Sequence[str]
) -> Decision | None:
    """``explain`` over the index, for the claims ``_allocate_indexed`` covers; None for the others.

    The decision is ``_allocate_indexed``'s. The lines: a node with fewer free GPUs than asked
    is told so from its bucket, without screening it (so a node that is also cordoned, say,
    counts as short of GPUs); the others are screened and searched in the order the decision
    visits them, until the chosen node and ``EXPLAIN_SEARCHED`` more that fit have been found.
    The rest are "not examined". When nothing fits, every node with enough free GPUs is
    screened and searched, so each has its own reason, and the summary counts them all.
    """
    ask = parse(claim)
    if (
        isinstance(ask, str)
        or ask.exclusivity != "Exclusive"
        or claim.spec.replicas != 1
        or ask.strategy not in LOAD_STRATEGIES
        or ask.node_name is not None
    ):
        return None
    decision = _allocate_indexed(claim, index, cost_preference)
    chosen = decision.allocations[0].node_name if decision is not None and decision.ok else None
    lines: dict[str, str] = {}
    misses: list[tuple[str, Miss]] = []
    for bucket, names in index.buckets().items():
        if bucket.free >= ask.count:
            continue
        phrase = f"fewer than {ask.count} free healthy GPUs{ask.filters}"
        detail = f"{bucket.free} of {bucket.total} GPUs free; need {ask.count}"
        short = Miss(6, f"has {phrase}", f"have {phrase}", detail)
        for name in names:
            lines[name] = short.detail
            misses.append((name, short))
    n_nodes, fits = len(index), 0
    for ranked in _in_rank_order(ask, index, cost_preference):
        for _, name in ranked:
            if chosen is not None and fits > EXPLAIN_SEARCHED:
                lines[name] = "enough free GPUs; not examined (ranked below the nodes searched)"
                continue
            view = index.get(name)
            assert view is not None
            screened = screen(view, ask, index.position(name), set(), n_nodes)
            found = best_set(screened, ask) if isinstance(screened, Screened) else screened
            if isinstance(found, Miss):
                lines[name] = found.detail
                misses.append((name, found))
                continue
            fits += 1
            lines[name] = f"fits: {found.describe()}"
    if decision is not None and decision.ok:
        assert chosen is not None
        lines[chosen] = decision.per_node[chosen]
        return dataclasses.replace(decision, per_node=lines)
    reason = (
        f"0/{n_nodes} nodes fit: {_summarise(misses)}" if n_nodes else "0/0 nodes fit: no GPU nodes are known"
    )
    return Decision(allocations=(), reason=reason, per_node=lines)


def _lines(
    names: Sequence[str],
    screened: Sequence[Screened | Miss],
    results: Mapping[str, Choice | Miss],
    ask: Ask,
) -> dict[str, str]:
    """Each node's line for ``per_node``, from the last round of the search."""
    lines: dict[str, str] = {}
    for name, entry in zip(names, screened, strict=True):
        if isinstance(entry, Miss):
            lines[name] = entry.detail
            continue
        found = results.get(name)
        if isinstance(found, Choice):
            lines[name] = f"fits: {found.describe()}"
        elif isinstance(found, Miss):
            lines[name] = found.detail
        else:
            lines[name] = (
                f"{len(entry.usable)} usable GPUs; not searched "
                f"(a node ranked higher by {ask.strategy} was chosen)"
            )
    return lines


def _summarise(misses: Sequence[tuple[str, Miss]]) -> str:
    """The nodes' misses counted by phrase, and node by node what the pods lack where only their
    CPU, memory or pod slots kept a node out."""
    groups: dict[tuple[int, str, str], int] = {}
    for _, m in misses:
        k = (m.rank, m.one, m.many)
        groups[k] = groups.get(k, 0) + 1
    ordered = sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{n} {one if n == 1 else many}" for (_, one, many), n in ordered[:MAX_REASON_GROUPS]]
    rest = sum(n for _, n in ordered[MAX_REASON_GROUPS:])
    if rest:
        parts.append(f"{rest} for other reasons")
    summary = ", ".join(parts)
    lacking = sorted(f"{name}: {m.detail}" for name, m in misses if m.pods_lack)
    if lacking:
        more = f"; {len(lacking) - MAX_REASON_GROUPS} more" if len(lacking) > MAX_REASON_GROUPS else ""
        summary = f"{summary} ({'; '.join(lacking[:MAX_REASON_GROUPS])}{more})"
    return summary
