"""Choose a node and a set of GPUs for each replica of a claim (pure).

``allocate(claim, nodes)`` is a function of its arguments only: no I/O, no
clock, no global randomness (``strategy: random`` draws from
``random.Random(seed)``). Equal inputs give equal decisions.

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
    fastest link) until none can win, unless ``explain=True``; the decision is
    the same either way. Per-inventory tables (bandwidth matrix, islands) are
    memoised by object identity: keep parsed inventories between decisions.

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
import fnmatch
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from controller import nodes
from controller.nodes import MIG_MODE, SHARED, NodeIndex, in_mig_mode
from controller.nodes import NodeView as NodeView  # the allocator's input, by its long-standing name
from gpualloc.api import constants, models, taints

EXHAUSTIVE_LIMIT = 5000
BEAM_WIDTH = 48
MAX_REASON_GROUPS = 6
_NO_PAIRS = 1 << 40  # "least pairwise bandwidth" of a set with a single device

_Key = tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    allocations: tuple[models.Allocation, ...]
    reason: str  # why nothing fits ("" when it does)
    per_node: Mapping[str, str]
    note: str = ""  # what to know about a placement (one below a preferred bandwidth)

    @property
    def ok(self) -> bool:
        return bool(self.allocations)


# ------------------------------------------------------------------ selectors


def matches_selector(selector: models.LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics; ``None`` and an empty selector match everything.

    ``Gt``/``Lt`` need the label and the single value to parse as integers;
    an unknown operator matches nothing.
    """
    if selector is None:
        return True
    for key, value in selector.match_labels.items():
        if labels.get(key) != value:
            return False
    for req in selector.match_expressions:
        present = req.key in labels
        value = labels.get(req.key, "")
        op = req.operator
        if op == "In":
            ok = present and value in req.values
        elif op == "NotIn":
            ok = not present or value not in req.values
        elif op == "Exists":
            ok = present
        elif op == "DoesNotExist":
            ok = not present
        elif op in ("Gt", "Lt"):
            ok = present and len(req.values) == 1 and _int_compare(value, req.values[0], op)
        else:
            ok = False
        if not ok:
            return False
    return True


def _int_compare(label: str, bound: str, op: str) -> bool:
    try:
        left, right = int(label), int(bound)
    except ValueError:
        return False
    return left > right if op == "Gt" else left < right


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


# ------------------------------------------------------------- parsed request


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Ask:
    count: int
    exclusivity: str  # Exclusive: whole GPUs; MIG: MIG instances; Shared: slots of shared GPUs
    mig_profiles: tuple[str, ...]  # MIG: the acceptable profiles (empty: any)
    sharing: models.SharingRequest  # Shared: the strategy and most sharers it accepts
    policy: str
    prefer_ids: tuple[int, ...]
    product: str | None
    min_memory_mib: int | None
    min_cc: tuple[int, int] | None
    mode: str
    min_bw: int
    strategy: str
    node_name: str | None
    selector: models.LabelSelector | None
    filters: str  # ' matching product "X", >=N MiB' or ""
    tolerations: tuple[models.Toleration, ...]  # the claim's and the defaults


def parse_compute_capability(text: str) -> tuple[int, int] | None:
    """``"8.6"`` -> ``(8, 6)``; ``"9"`` -> ``(9, 0)``; anything else -> ``None``."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def _parse(claim: models.GpuClaim) -> _Ask | str:
    spec = claim.spec
    dev = spec.devices
    if dev.count < 1:
        return f"devices.count must be at least 1 (got {dev.count})"
    if spec.replicas < 1:
        return f"replicas must be at least 1 (got {spec.replicas})"
    if dev.exclusivity not in constants.EXCLUSIVITIES:
        return f"unknown exclusivity {dev.exclusivity!r}; use one of {', '.join(constants.EXCLUSIVITIES)}"
    if dev.exclusivity != "Exclusive" and dev.policy == "preferIds":
        return f"policy preferIds names whole GPUs; a {dev.exclusivity} claim cannot use it"
    sharing = dev.sharing or models.SharingRequest()
    if dev.exclusivity == "Shared" and sharing.strategy not in constants.SHARING_STRATEGIES:
        known = ", ".join(constants.SHARING_STRATEGIES)
        return f"unknown sharing.strategy {sharing.strategy!r}; use one of {known}"
    if dev.policy not in constants.POLICIES:
        return f"unknown devices.policy {dev.policy!r}; use one of {', '.join(constants.POLICIES)}"
    if spec.strategy not in constants.STRATEGIES:
        return f"unknown strategy {spec.strategy!r}; use one of {', '.join(constants.STRATEGIES)}"
    mode = spec.topology.mode
    if mode not in constants.TOPOLOGY_MODES:
        return f"unknown topology.mode {mode!r}; use one of {', '.join(constants.TOPOLOGY_MODES)}"
    min_cc = None
    if dev.min_compute_capability:
        min_cc = parse_compute_capability(dev.min_compute_capability)
        if min_cc is None:
            return f'minComputeCapability "{dev.min_compute_capability}" is not of the form "8.0"'
    prefer_ids: tuple[int, ...] = ()
    if dev.policy == "preferIds":
        prefer_ids = tuple(sorted(set(dev.prefer_ids)))
        if len(prefer_ids) < dev.count:
            return (
                f"policy preferIds lists {len(prefer_ids)} distinct indices but count is {dev.count};"
                " list at least count indices"
            )
    filters = []
    if dev.product:
        filters.append(f'product "{dev.product}"')
    if dev.min_memory_mib:
        filters.append(f">={dev.min_memory_mib} MiB")
    if min_cc is not None:
        filters.append(f"compute capability >={min_cc[0]}.{min_cc[1]}")
    mig = dev.exclusivity == "MIG"
    if mig and dev.mig_profiles:
        filters.insert(0, f"MIG profile {' or '.join(dev.mig_profiles)}")
    whole = dev.exclusivity == "Exclusive"  # topology ranks sets of whole GPUs only
    return _Ask(
        count=dev.count,
        exclusivity=dev.exclusivity,
        mig_profiles=dev.mig_profiles if mig else (),
        sharing=sharing,
        policy=dev.policy,
        prefer_ids=prefer_ids,
        product=dev.product or None,
        min_memory_mib=dev.min_memory_mib or None,
        min_cc=min_cc,
        mode=mode if whole else "Ignore",  # instances and slots are not ranked by links
        min_bw=max(0, spec.topology.min_bandwidth_gbps) if whole else 0,
        strategy=spec.strategy,
        node_name=spec.node_name or None,
        selector=spec.selector,
        filters=(" matching " + ", ".join(filters)) if filters else "",
        tolerations=taints.claim_tolerations(spec),
    )


def _matches(ask: _Ask, device: models.Device) -> bool:
    if ask.product is not None and not fnmatch.fnmatchcase(device.product, ask.product):
        return False
    if ask.min_memory_mib is not None and device.memory_mib < ask.min_memory_mib:
        return False
    if ask.min_cc is not None:
        cc = parse_compute_capability(device.compute_capability)
        if cc is None or cc < ask.min_cc:
            return False
    return True


# ------------------------------------------------------------ per-node results


@dataclasses.dataclass(frozen=True, slots=True)
class _Miss:
    """Why a node cannot take the replica: the summary phrase and the node's own line."""

    rank: int  # order among summary groups with equal counts
    one: str  # "is cordoned"
    many: str  # "are cordoned"
    detail: str


@dataclasses.dataclass(slots=True)
class _Screened:
    """A node that passed the node checks and has at least ``count`` usable devices."""

    view: NodeView
    prep: nodes.Prepared
    position: int  # in sorted node names
    total: int
    free: int  # healthy and not taken
    usable: list[models.Device]  # free, matching, (preferIds), sorted by index


@dataclasses.dataclass(frozen=True, slots=True)
class _Choice:
    devices: tuple[models.Device, ...]
    least_bw: int  # _NO_PAIRS for a single device
    numa: int
    islands: int
    key: _Key

    @property
    def reported_bw(self) -> int:
        return 0 if self.least_bw == _NO_PAIRS else self.least_bw

    def describe(self) -> str:
        if isinstance(self.devices[0], _SlotDevice):
            slots = [d for d in self.devices if isinstance(d, _SlotDevice)]
            return ", ".join(f"slot {d.slot} of gpu {d.index}" for d in slots)
        if self.devices[0].uuid.startswith("MIG-"):
            return ", ".join(f"{d.product} of gpu {d.index}" for d in self.devices)
        idx = ",".join(str(d.index) for d in self.devices)
        if len(self.devices) == 1:
            return f"gpu {idx}"
        return f"gpus {idx} (min {self.least_bw} GB/s, {self.numa} NUMA node{'s' if self.numa != 1 else ''})"


def _screen(
    view: NodeView, ask: _Ask, position: int, extra_taken: set[str], n_nodes: int
) -> _Screened | _Miss:
    miss = _node_miss(view, ask)
    if miss is not None:
        return miss
    assert view.inventory is not None
    if ask.exclusivity == "MIG":
        return _screen_mig(view, ask, position, extra_taken, n_nodes)
    if ask.exclusivity == "Shared":
        return _screen_shared(view, ask, position, extra_taken, n_nodes)
    prep = nodes.prepare(view.name, view.inventory, n_nodes)
    taken = view.taken
    if extra_taken:
        free_devs = [d for d in prep.healthy if d.uuid not in taken and d.uuid not in extra_taken]
    else:
        free_devs = [d for d in prep.healthy if d.uuid not in taken]
    usable = [d for d in free_devs if _matches(ask, d)] if ask.filters else free_devs
    total, free = len(prep.by_index), len(free_devs)

    if ask.prefer_ids:
        return _screen_prefer_ids(view, prep, ask, position, free, usable, extra_taken)

    if len(usable) < ask.count:
        counts = (
            (len(prep.healthy) - free, "taken"),
            (total - len(prep.healthy) - prep.in_mig - prep.shared, "unhealthy"),
            (prep.in_mig, MIG_MODE),
            (prep.shared, SHARED),
            (free - len(usable), "not" + ask.filters if ask.filters else "not matching"),
        )
        parts = [f"{n} {what}" for n, what in counts if n]
        extra = f" ({', '.join(parts)})" if parts else ""
        phrase = f"fewer than {ask.count} free healthy GPUs{ask.filters}"
        return _Miss(
            6,
            f"has {phrase}",
            f"have {phrase}",
            f"{len(usable)} of {total} GPUs usable{extra}; need {ask.count}",
        )
    return _Screened(view, prep, position, total, free, usable)


def _node_miss(view: NodeView, ask: _Ask) -> _Miss | None:
    """Why the node itself cannot take the claim, before its devices are looked at."""
    if not view.node_present:
        return _Miss(0, "has no Node object", "have no Node object", "the Node object does not exist")
    if view.unschedulable:
        return _Miss(1, "is cordoned", "are cordoned", "cordoned (spec.unschedulable)")
    taint = taints.untolerated(view.taints, ask.tolerations)
    if taint is not None:
        phrase = f"tainted {taint}"
        return _Miss(1, f"is {phrase}", f"are {phrase}", f"{phrase}, which the claim does not tolerate")
    inv = view.inventory
    if inv is None:
        return _Miss(
            2, "has no GpuNodeStatus", "have no GpuNodeStatus", "no GpuNodeStatus (agent not running?)"
        )
    if not view.ready:
        return _Miss(
            3, "is not ready", "are not ready", "GpuNodeStatus not Ready or heartbeat stale (agent down?)"
        )
    if ask.node_name is not None and view.name != ask.node_name:
        phrase = f'the requested nodeName "{ask.node_name}"'
        return _Miss(4, f"is not {phrase}", f"are not {phrase}", f"not {phrase}")
    if not matches_selector(ask.selector, view.labels):
        return _Miss(
            5, "does not match the selector", "do not match the selector", "labels do not match selector"
        )
    return None


def _screen_mig(
    view: NodeView, ask: _Ask, position: int, extra_taken: set[str], n_nodes: int
) -> _Screened | _Miss:
    """A MIG claim's screening: the node's free MIG instances that match, as pseudo-devices (the
    parent's index and minor, the instance's UUID, "MIG <profile>" as product), parent by parent
    in placement order, so that a claim of several packs onto one GPU."""
    assert view.inventory is not None
    taken = view.taken
    total = 0
    free: list[tuple[models.Device, models.MigDevice]] = []
    for parent in sorted(view.inventory.devices, key=lambda d: d.index):
        if not in_mig_mode(parent):
            continue
        assert parent.mig is not None
        total += len(parent.mig.devices)
        if parent.health != constants.HEALTHY:
            continue  # (held whole, every instance of it is in ``taken``: views.taken_on)
        for m in sorted(parent.mig.devices, key=lambda m: (m.placement_start, m.index)):
            if m.uuid not in taken and m.uuid not in extra_taken:
                free.append((parent, m))
    usable = [
        models.Device(
            index=parent.index,
            minor=parent.minor,
            uuid=m.uuid,
            product=f"MIG {m.profile}",
            memory_mib=m.memory_mib,
            compute_capability=parent.compute_capability,
        )
        for parent, m in free
        if (not ask.mig_profiles or m.profile in ask.mig_profiles)
        and _matches(ask, dataclasses.replace(parent, memory_mib=m.memory_mib))
    ]
    if len(usable) < ask.count:
        if total == 0:
            return _Miss(6, "has no GPU in MIG mode", "have no GPU in MIG mode", "no GPU in MIG mode")
        phrase = f"fewer than {ask.count} free MIG instances{ask.filters}"
        detail = f"{len(usable)} of {total} MIG instances usable ({total - len(free)} taken or unhealthy)"
        return _Miss(6, f"has {phrase}", f"have {phrase}", f"{detail}; need {ask.count}")
    prep = nodes.prepare(view.name, view.inventory, n_nodes)
    return _Screened(view, prep, position, total, len(free), usable)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _SlotDevice(models.Device):
    """A slot of a shared GPU, as screening offers it: the GPU, and which of its slots."""

    slot: int


def _screen_shared(
    view: NodeView, ask: _Ask, position: int, extra_taken: set[str], n_nodes: int
) -> _Screened | _Miss:
    """A Shared claim's screening: one free slot (the lowest) of each healthy shared GPU whose
    strategy is the claim's and whose slots are at most its ``maxClaimsPerGPU``, fullest GPU first,
    so claims pack onto GPUs already shared. A gang's replicas never share a GPU (``extra_taken``
    holds the UUIDs of the GPUs its earlier replicas took). ``total`` and ``free`` count slots."""
    assert view.inventory is not None
    taken, most = view.taken, ask.sharing.max_claims_per_gpu
    total, free, offered = 0, 0, []
    for gpu in view.inventory.devices:
        if not gpu.shared or gpu.health != constants.HEALTHY:
            continue
        assert gpu.sharing is not None
        if gpu.sharing.strategy != ask.sharing.strategy or (most is not None and gpu.sharing.replicas > most):
            continue
        open_slots = [k for k, slot in enumerate(gpu.slot_ids) if slot not in taken]
        total += gpu.sharing.replicas
        free += len(open_slots)
        if open_slots and gpu.uuid not in extra_taken and _matches(ask, gpu):
            offered.append((len(open_slots), gpu.index, gpu, open_slots[0]))
    usable: list[models.Device] = [
        _SlotDevice(
            index=gpu.index,
            minor=gpu.minor,
            uuid=gpu.uuid,
            product=gpu.product,
            memory_mib=gpu.memory_mib,
            compute_capability=gpu.compute_capability,
            slot=slot,
        )
        for _, _, gpu, slot in sorted(offered, key=lambda o: o[:2])
    ]
    if len(usable) < ask.count:
        limit = f" of at most {most} claims" if most is not None else ""
        if total == 0:
            phrase = f"no GPU shared by {ask.sharing.strategy}{limit}"
            return _Miss(6, f"has {phrase}", f"have {phrase}", phrase)
        phrase = f"fewer than {ask.count} {ask.sharing.strategy} GPUs with a free slot{ask.filters}"
        detail = f"{len(usable)} shared GPUs usable ({total - free} of {total} slots taken); need {ask.count}"
        return _Miss(6, f"has {phrase}", f"have {phrase}", detail)
    prep = nodes.prepare(view.name, view.inventory, n_nodes)
    return _Screened(view, prep, position, total, free, usable)


def _screen_prefer_ids(
    view: NodeView,
    prep: nodes.Prepared,
    ask: _Ask,
    position: int,
    free: int,
    usable: list[models.Device],
    extra_taken: set[str],
) -> _Screened | _Miss:
    by_index = prep.by_index
    usable_idx = {d.index for d in usable}
    wanted = set(ask.prefer_ids)
    pinned = [d for d in usable if d.index in wanted]
    if len(pinned) >= ask.count:
        return _Screened(view, prep, position, len(by_index), free, pinned)
    problems: dict[str, list[int]] = {
        "missing": [],
        MIG_MODE: [],
        SHARED: [],
        "unhealthy": [],
        "taken": [],
        "not matching": [],
    }
    for i in ask.prefer_ids:
        d = by_index.get(i)
        if d is None:
            problems["missing"].append(i)
        elif in_mig_mode(d):
            problems[MIG_MODE].append(i)
        elif d.shared:
            problems[SHARED].append(i)
        elif d.health != constants.HEALTHY:
            problems["unhealthy"].append(i)
        elif d.uuid in view.taken or d.uuid in extra_taken:
            problems["taken"].append(i)
        elif i not in usable_idx:
            problems["not matching"].append(i)
    what = "; ".join(f"{'/'.join(map(str, ids))} {kind}" for kind, ids in problems.items() if ids)
    ids = ",".join(map(str, ask.prefer_ids))
    phrase = f"cannot give preferIds {ids} ({what})"
    return _Miss(7, phrase, phrase, f"preferIds {ids}: {what}; {len(pinned)} usable, need {ask.count}")


# ------------------------------------------------------------------ set search


SEARCHES_KEPT = 64  # set searches remembered per inventory (``nodes.Prepared.searches``)


def _best_set(node: _Screened, ask: _Ask) -> _Choice | _Miss:
    """The best set of ``ask.count`` of the node's usable devices, or why there is none.

    The answer depends only on the inventory, the usable devices and the ask's
    set terms, so it is remembered on the prepared inventory: the nodes a
    strategy ranks first are searched again for claim after claim until their
    free devices change."""
    if ask.exclusivity != "Exclusive":  # instances and slots in screening's order (packing)
        return _Choice(tuple(node.usable[: ask.count]), _NO_PAIRS, 1, 1, ())
    searches = node.prep.searches
    key = (tuple(d.index for d in node.usable), ask.count, ask.mode, ask.policy, ask.min_bw)
    found: _Choice | _Miss | None = searches.get(key)
    if found is None:
        if len(searches) >= SEARCHES_KEPT:
            searches.clear()
        found = searches[key] = _search_set(node, ask)
    return found


def _search_set(node: _Screened, ask: _Ask) -> _Choice | _Miss:
    devs = node.usable
    m, k = len(devs), ask.count
    matrix, isl = node.prep.topology()
    idx = [d.index for d in devs]
    bw = [[matrix[a][b] for b in idx] for a in idx]
    numa = [d.numa_node for d in devs]
    island = [isl[i] for i in idx]
    rowsum = [sum(row) for row in bw]
    topo = ask.mode != "Ignore"
    required = ask.mode == "Required" and k > 1
    policy = ask.policy

    def key(combo: Sequence[int], least: int, internal: int) -> tuple[_Key, int, int]:
        n_numa = len({numa[p] for p in combo})
        n_isl = len({island[p] for p in combo})
        cut = sum(rowsum[p] for p in combo) - 2 * internal
        order = tuple(idx[p] for p in combo)
        bw_term = -least if topo else 0
        numa_term = n_numa if topo else 0
        if policy == "spread":
            full: _Key = (-n_numa, bw_term, cut, order)
        elif policy == "contiguous":
            full = (n_isl, bw_term, numa_term, cut, order)
        else:
            full = (bw_term, numa_term, cut, order)
        return full, n_numa, n_isl

    def meets(least: int, n_isl: int) -> bool:
        if not required:
            return True
        return least >= ask.min_bw if ask.min_bw > 0 else n_isl == 1

    best: _Choice | None = None
    best_least_any = -1  # best least bandwidth seen, for the failure message
    if math.comb(m, k) <= EXHAUSTIVE_LIMIT:
        for combo in itertools.combinations(range(m), k):
            least, internal = _NO_PAIRS, 0
            for i, p in enumerate(combo):
                row = bw[p]
                for q in combo[i + 1 :]:
                    b = row[q]
                    internal += b
                    if b < least:
                        least = b
            full, n_numa, n_isl = key(combo, least, internal)
            best_least_any = max(best_least_any, least)
            if not meets(least, n_isl):
                continue
            if best is None or full < best.key:
                best = _Choice(tuple(devs[p] for p in combo), least, n_numa, n_isl, full)
    else:
        best, best_least_any = _beam(devs, bw, k, key, meets)

    if best is None:
        if ask.min_bw > 0:
            phrase = f"no {k}-GPU set with >={ask.min_bw} GB/s"
            detail = f"{phrase} among {m} usable GPUs (best {max(best_least_any, 0)} GB/s)"
        else:
            phrase = f"no {k}-GPU set inside one NVLink island"
            detail = f"{phrase} among {m} usable GPUs"
        return _Miss(8, f"has {phrase}", f"have {phrase}", detail)
    return best


def _beam(
    devs: list[models.Device],
    bw: list[list[int]],
    k: int,
    key: Any,
    meets: Any,
) -> tuple[_Choice | None, int]:
    """Grow sets one device at a time, keeping the ``BEAM_WIDTH`` best partial sets."""
    m = len(devs)
    # (key, combo sorted, least, internal)
    beam: list[tuple[_Key, tuple[int, ...], int, int]] = []
    for p in range(m):
        full, _, _ = key((p,), _NO_PAIRS, 0)
        beam.append((full, (p,), _NO_PAIRS, 0))
    beam.sort()
    beam = beam[:BEAM_WIDTH]
    best_least = -1
    for size in range(2, k + 1):
        grown: dict[tuple[int, ...], tuple[_Key, tuple[int, ...], int, int]] = {}
        for _, combo, least, internal in beam:
            for p in range(m):
                if p in combo:
                    continue
                new = tuple(sorted((*combo, p)))
                if new in grown:
                    continue
                row = bw[p]
                n_least = min(least, *(row[q] for q in combo))
                n_internal = internal + sum(row[q] for q in combo)
                full, _, n_isl = key(new, n_least, n_internal)
                if size == k:
                    best_least = max(best_least, n_least)
                if not meets(n_least, n_isl):
                    continue  # the least bandwidth only falls and islands only grow: prune
                grown[new] = (full, new, n_least, n_internal)
        beam = sorted(grown.values())[:BEAM_WIDTH]
        if not beam:
            return None, best_least
    full, combo, least, _ = beam[0]
    _, n_numa, n_isl = key(combo, least, 0)
    return _Choice(tuple(devs[p] for p in combo), least, n_numa, n_isl, full), best_least


# ----------------------------------------------------------------- node choice


LOAD_STRATEGIES = ("binpack", "leastLoaded", "spread", "bestFit", "costOptimized")  # rank by load alone


def _load_key(strategy: str, total: int, free: int, count: int, tier: int) -> _Key:
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
    node: _Screened,
    ask: _Ask,
    *,
    n_nodes: int,
    cursor: int,
    random_rank: Mapping[str, int],
    cost_label: str,
    cost_rank: Mapping[str, int],
) -> _Key:
    if ask.strategy == "random":
        return (random_rank[node.view.name],)
    if ask.strategy == "roundRobin":
        return ((node.position - cursor) % n_nodes,)
    tier = cost_rank.get(node.view.labels.get(cost_label, ""), len(cost_rank))
    return _load_key(ask.strategy, node.total, node.free, ask.count, tier)


def _cost_rank(cost_preference: Sequence[str]) -> dict[str, int]:
    return {tier: r for r, tier in reversed(list(enumerate(cost_preference)))}


def _quality_bound(node: _Screened, ask: _Ask) -> _Key:
    """A key no worse than ``(*_quality(best set), name)`` for any set on this node."""
    return _bound(ask, node.view.name, node.position, node.prep.max_bw)


def _bound(ask: _Ask, name: str, position: int, max_bw: int) -> _Key:
    if ask.mode == "Ignore":
        return (name, position)
    least = _NO_PAIRS if ask.count == 1 else max_bw
    return (-least, 1, name, position)


def _quality(choice: _Choice, ask: _Ask) -> _Key:
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
) -> Decision:
    """Place every replica of ``claim`` on ``nodes`` or none; see the module docstring.

    ``nodes`` as a ``NodeIndex`` gives the same decision, found without
    screening every node where the claim allows (see "Indexed nodes").
    """
    index = nodes if isinstance(nodes, NodeIndex) else None

    def every_view() -> Sequence[NodeView]:  # an index's list is built only when it is needed
        return nodes.views() if isinstance(nodes, NodeIndex) else nodes

    def place(c: models.GpuClaim, candidates: Sequence[NodeView] | None) -> Decision:
        """``c`` on ``candidates``, or on every node (None), through the index where it serves."""
        if index is not None and candidates is None and index.cost_label == cost_label:
            found = (_explain_indexed if explain else _allocate_indexed)(c, index, cost_preference)
            if found is not None:
                return found
        return _allocate(
            c,
            every_view() if candidates is None else candidates,
            seed=seed,
            round_robin_cursor=round_robin_cursor,
            cost_label=cost_label,
            cost_preference=cost_preference,
            explain=explain,
        )

    def route(c: models.GpuClaim) -> Decision:
        if c.spec.topology.same_node_label and c.spec.replicas > 1:
            return _allocate_in_domains(c, every_view(), place)
        return place(c, None)

    topology = claim.spec.topology
    if topology.mode == "Preferred" and topology.min_bandwidth_gbps > 0 and claim.spec.devices.count > 1:
        # A soft threshold: the placement Required would make, else the best there is.
        strict = route(_with_mode(claim, "Required"))
        if strict.ok:
            return strict
        best = route(claim)
        if best.ok:
            note = f"below the preferred {topology.min_bandwidth_gbps} GB/s: {strict.reason}"
            return dataclasses.replace(best, note=note)
        return best
    return route(claim)


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
) -> Decision:
    """``allocate`` on one set of nodes."""
    ask = _parse(claim)
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
    extra: dict[str, set[str]] = {v.name: set() for v in views}
    screened: list[_Screened | _Miss] = [
        _screen(v, ask, i, extra[v.name], len(views)) for i, v in enumerate(views)
    ]
    chosen_notes: dict[str, list[str]] = {}
    results: dict[str, _Choice | _Miss] = {}
    allocations: list[models.Allocation] = []
    cursor = round_robin_cursor % len(views)

    for replica in range(replicas):
        random_rank: dict[str, int] = {}
        if ask.strategy == "random":
            shuffled = list(names)
            rng.shuffle(shuffled)
            random_rank = {n: r for r, n in enumerate(shuffled)}
        results = {}
        fits = [s for s in screened if isinstance(s, _Screened)]
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
                ),
                s.view.name,
                s.position,
                s,
            )
            for s in fits
        )
        winner: tuple[_Screened, _Choice] | None = None
        i = 0
        while i < len(ranked):
            j = i
            while j < len(ranked) and ranked[j][0] == ranked[i][0]:
                j += 1
            group_best: tuple[_Key, _Screened, _Choice] | None = None
            # Search the tied nodes in order of the best quality they could reach, and stop
            # once no remaining node can beat the best set found (``explain`` searches all).
            for bound, s in sorted((_quality_bound(s, ask), s) for *_, s in ranked[i:j]):
                if group_best is not None and not explain and bound >= group_best[0]:
                    break
                res = _best_set(s, ask)
                results[s.view.name] = res
                if isinstance(res, _Choice):
                    cand = ((*_quality(res, ask), s.view.name, s.position), s, res)
                    if group_best is None or cand[0] < group_best[0]:
                        group_best = cand
            i = j
            if group_best is not None and winner is None:
                winner = (group_best[1], group_best[2])
                if not explain:
                    break

        if winner is None:
            misses = [s if isinstance(s, _Miss) else results[s.view.name] for s in screened]
            summary = _summarise([m for m in misses if isinstance(m, _Miss)])
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
        screened[node.position] = _screen(node.view, ask, node.position, extra[name], len(views))
        cursor = (node.position + 1) % len(views)

    per_node = _lines(names, screened, results, ask)
    for name, notes in chosen_notes.items():
        per_node[name] = "chosen: " + "; ".join(notes)
    return Decision(allocations=tuple(allocations), reason="", per_node=per_node)


def _allocation(replica: int, node: str, choice: _Choice) -> models.Allocation:
    return models.Allocation(
        replica=replica,
        node_name=node,
        devices=tuple(
            models.DeviceRef(
                index=d.index, minor=d.minor, uuid=d.uuid, slot=d.slot if isinstance(d, _SlotDevice) else None
            )
            for d in choice.devices
        ),
        min_bandwidth_gbps=choice.reported_bw,
    )


# ------------------------------------------------------------------ indexed nodes


def _in_rank_order(
    ask: _Ask, index: NodeIndex, cost_preference: Sequence[str]
) -> Iterator[Iterator[tuple[_Key, str]]]:
    """The nodes with at least ``ask.count`` free GPUs as ``_allocate`` ranks them: one group per
    strategy key, best key first, each group's nodes in order of their quality bound (with the
    bound). Only the index's buckets are read: a node is looked at when its turn comes."""
    cost_rank = _cost_rank(cost_preference)
    groups: dict[_Key, list[tuple[int, Sequence[str]]]] = {}
    for bucket, names in index.buckets().items():
        if bucket.free < ask.count:
            continue
        tier = cost_rank.get(bucket.tier, len(cost_rank))
        key = _load_key(ask.strategy, bucket.total, bucket.free, ask.count, tier)
        groups.setdefault(key, []).append((bucket.max_bw, names))

    def in_bound_order(max_bw: int, names: Sequence[str]) -> Iterator[tuple[_Key, str]]:
        for name in names:
            yield _bound(ask, name, index.position(name), max_bw), name

    for key in sorted(groups):
        yield heapq.merge(*(in_bound_order(max_bw, names) for max_bw, names in groups[key]))


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
    on its GPUs, free GPUs, fastest link and cost tier), buckets with fewer
    free GPUs than the claim asks are never visited, and a node is screened
    only when its turn comes. Nodes that fail screening are skipped, as
    ``_allocate`` leaves them out of the ranking.
    """
    ask = _parse(claim)
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
        best: tuple[_Key, _Screened, _Choice] | None = None
        for bound, name in ranked:
            if best is not None and bound >= best[0]:
                break
            view = index.get(name)
            assert view is not None
            screened = _screen(view, ask, index.position(name), set(), n_nodes)
            if isinstance(screened, _Miss):
                continue
            found = _best_set(screened, ask)
            if isinstance(found, _Choice):
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
    ask = _parse(claim)
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
    misses: list[_Miss] = []
    for bucket, names in index.buckets().items():
        if bucket.free >= ask.count:
            continue
        phrase = f"fewer than {ask.count} free healthy GPUs{ask.filters}"
        detail = f"{bucket.free} of {bucket.total} GPUs free; need {ask.count}"
        short = _Miss(6, f"has {phrase}", f"have {phrase}", detail)
        for name in names:
            lines[name] = short.detail
            misses.append(short)
    n_nodes, fits = len(index), 0
    for ranked in _in_rank_order(ask, index, cost_preference):
        for _, name in ranked:
            if chosen is not None and fits > EXPLAIN_SEARCHED:
                lines[name] = "enough free GPUs; not examined (ranked below the nodes searched)"
                continue
            view = index.get(name)
            assert view is not None
            screened = _screen(view, ask, index.position(name), set(), n_nodes)
            found = _best_set(screened, ask) if isinstance(screened, _Screened) else screened
            if isinstance(found, _Miss):
                lines[name] = found.detail
                misses.append(found)
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
    screened: Sequence[_Screened | _Miss],
    results: Mapping[str, _Choice | _Miss],
    ask: _Ask,
) -> dict[str, str]:
    """Each node's line for ``per_node``, from the last round of the search."""
    lines: dict[str, str] = {}
    for name, entry in zip(names, screened, strict=True):
        if isinstance(entry, _Miss):
            lines[name] = entry.detail
            continue
        found = results.get(name)
        if isinstance(found, _Choice):
            lines[name] = f"fits: {found.describe()}"
        elif isinstance(found, _Miss):
            lines[name] = found.detail
        else:
            lines[name] = (
                f"{len(entry.usable)} usable GPUs; not searched "
                f"(a node ranked higher by {ask.strategy} was chosen)"
            )
    return lines


def _summarise(misses: Sequence[_Miss]) -> str:
    groups: dict[tuple[int, str, str], int] = {}
    for m in misses:
        k = (m.rank, m.one, m.many)
        groups[k] = groups.get(k, 0) + 1
    ordered = sorted(groups.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"{n} {one if n == 1 else many}" for (_, one, many), n in ordered[:MAX_REASON_GROUPS]]
    rest = sum(n for _, n in ordered[MAX_REASON_GROUPS:])
    if rest:
        parts.append(f"{rest} for other reasons")
    return ", ".join(parts)
