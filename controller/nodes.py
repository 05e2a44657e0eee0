"""A GPU node as the allocator sees it, and every node indexed for the allocator's search (pure).

``NodeView`` is what the caller knows of one node. ``prepare`` turns its
inventory into the tables screening and set search need, once per inventory
object. ``NodeIndex`` keeps every node's view, changed one node at a time, and
groups the nodes by ``Bucket``: what the ranking strategies and the quality
bound look at. With it ``allocator.allocate`` visits nodes in the strategy's
order, best first, and stops at the winner, instead of screening every node
(see ``allocator``, "Indexed nodes").
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from controller import topology
from gpualloc.api import constants, models, quantities

MIG_MODE = "in MIG mode (use a MIG claim)"
SHARED = "shared (use a Shared claim)"
# A node is busy (its gpu.scheduling/busy label "true") once its pods request this share of its
# allocatable CPU and memory, averaged (``requested_percent``), and stays busy until they request
# BUSY_HYSTERESIS points less: pods coming and going around the line do not rewrite the label.
BUSY_PERCENT = 75
BUSY_HYSTERESIS = 5


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeView:
    """What the allocator may know about one node, assembled by the caller."""

    name: str
    labels: Mapping[str, str]
    unschedulable: bool
    node_present: bool
    ready: bool
    inventory: models.NodeInventory | None
    taken: frozenset[str]
    taints: tuple[models.Taint, ...] = ()  # the blocking ones (NoSchedule, NoExecute)
    # The Node's allocatable of the resources gpualloc counts (``requests.counted``), and what is
    # left of it once the non-terminal pods bound to the node are counted; empty: not known, the
    # pods' fit is not checked.
    allocatable: Mapping[str, int] = dataclasses.field(default_factory=dict)
    free: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # Taken GPUs (UUIDs) that hold milli-GPU shares and nothing whole, and how much of each the
    # shares take (up to 1000); a taken GPU not here is held whole.
    milli_used: Mapping[str, int] = dataclasses.field(default_factory=dict)


def in_mig_mode(device: models.Device) -> bool:
    return device.mig is not None and device.mig.enabled


@dataclasses.dataclass(slots=True)
class Prepared:
    """What screening and set search need from an inventory, computed once per inventory object."""

    inventory: models.NodeInventory
    healthy: tuple[models.Device, ...]  # healthy, not in MIG mode, not shared (whole GPUs to give), by index
    in_mig: int  # GPUs in MIG mode: never given whole, a CUDA program would see no usable device
    shared: int  # GPUs the agent offers for sharing (``--sharing``): never given whole
    by_index: Mapping[int, models.Device]
    max_bw: int  # the fastest link on the node: no set can have a higher least bandwidth
    # Filled on the first set search: index -> index -> GB/s (0 for a missing link), index -> island.
    matrix: Mapping[int, Mapping[int, int]] | None = None
    island: Mapping[int, int] | None = None
    # The allocator's set searches on this inventory, by the usable devices and what the claim
    # asks (``sets.best_set``): a node ranked first for many claims in a row is searched once.
    searches: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def topology(self) -> tuple[Mapping[int, Mapping[int, int]], Mapping[int, int]]:
        if self.matrix is None or self.island is None:
            ordered = sorted(self.by_index)
            table = topology.bandwidths(self.inventory.links)
            self.matrix = {
                a: {b: topology.bandwidth(table, a, b) if a != b else 0 for b in ordered} for a in ordered
            }
            self.island = topology.island_ids(self.inventory)
        return self.matrix, self.island

    def free(self, taken: frozenset[str]) -> int:
        """Healthy GPUs, not in MIG mode and not shared, whose UUID is not in ``taken``."""
        return sum(1 for d in self.healthy if d.uuid not in taken)

    def free_by_numa(self, taken: frozenset[str]) -> tuple[int, ...]:
        """Those GPUs counted per NUMA node, most first."""
        return per_numa(d for d in self.healthy if d.uuid not in taken)


def per_numa(devices: Iterable[models.Device]) -> tuple[int, ...]:
    """How many of ``devices`` each NUMA node has, most first (the NUMA nodes named, not which)."""
    counts: dict[int, int] = {}
    for d in devices:
        counts[d.numa_node] = counts.get(d.numa_node, 0) + 1
    return tuple(sorted(counts.values(), reverse=True))


def fewest_numa_nodes(free_per_numa: Sequence[int], count: int) -> int:
    """The fewest NUMA nodes a set of ``count`` of these GPUs can span (``per_numa``'s counts).

    A bound for the set search's NUMA term: no set of ``count`` spans fewer."""
    spanned, gathered = 0, 0
    for free in free_per_numa:
        if gathered >= count:
            break
        spanned, gathered = spanned + 1, gathered + free
    return max(spanned, 1)


# A memo of one entry per node name, used while the node's inventory is the very
# same object. Inventories are frozen, so decisions depend only on the arguments;
# the memo saves rebuilding the same tables for every decision when the caller
# keeps its parsed inventories between decisions. A node's new inventory (every
# GpuNodeStatus heartbeat is parsed anew) replaces its old one, so the memo never
# holds more than one inventory per node name; it is emptied when it holds more
# than twice the nodes of the current call (at least PREPARED_MIN), which bounds
# what nodes that went away leave behind.
PREPARED: dict[str, Prepared] = {}
PREPARED_MIN = 1024


def prepare(name: str, inv: models.NodeInventory, nodes: int) -> Prepared:
    """The tables of node ``name``'s inventory ``inv``, for a caller that looks at ``nodes`` nodes."""
    cached = PREPARED.get(name)
    if cached is not None and cached.inventory is inv:
        return cached
    by_index: dict[int, models.Device] = {}
    for d in inv.devices:
        by_index.setdefault(d.index, d)
    ordered = sorted(by_index.values(), key=lambda d: d.index)
    prepared = Prepared(
        inventory=inv,
        healthy=tuple(
            d for d in ordered if d.health == constants.HEALTHY and not in_mig_mode(d) and not d.shared
        ),
        in_mig=sum(1 for d in ordered if in_mig_mode(d)),
        shared=sum(1 for d in ordered if d.shared),
        by_index=by_index,
        max_bw=max((link.bandwidth_gbps for link in inv.links), default=0),
    )
    if name not in PREPARED and len(PREPARED) >= max(PREPARED_MIN, 2 * nodes):
        PREPARED.clear()
    PREPARED[name] = prepared
    return prepared


# ------------------------------------------------------------------ the index


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Bucket:
    """Nodes alike for ranking and for the quality bound: as many GPUs, as many free, as many free
    on each NUMA node, the same fastest link and cost tier."""

    total: int
    free: int  # healthy, not in MIG mode, not taken
    max_bw: int
    tier: str  # the value of the cost label ("" without it)
    free_per_numa: tuple[int, ...]  # those free GPUs per NUMA node, most first (sums to ``free``)


class NodeIndex:
    """Every GPU node's ``NodeView``, by name, and the nodes with an inventory by ``Bucket``.

    ``put`` and ``remove`` change one node in O(log n) (plus a short list
    insert); ``views`` is the sorted list ``allocator.allocate`` would take.
    ``cost_label`` is the label whose value ``costOptimized`` ranks by: an index
    answers only for that label (``allocate`` searches every node otherwise).
    """

    def __init__(
        self, views: Iterable[NodeView] = (), *, cost_label: str = constants.LABEL_COST_TIER
    ) -> None:
        self.cost_label = cost_label
        self._views: dict[str, NodeView] = {}
        self._names: list[str] = []  # sorted
        self._bucket_of: dict[str, Bucket] = {}
        self._buckets: dict[Bucket, list[str]] = {}  # names, sorted
        self._sorted: list[NodeView] | None = None
        for view in views:
            self.put(view)

    def __len__(self) -> int:
        return len(self._views)

    def put(self, view: NodeView) -> None:
        """Add node ``view.name``, or replace what the index knew of it."""
        name = view.name
        if name in self._views:
            self._leave_bucket(name)
        else:
            bisect.insort(self._names, name)
        self._views[name] = view
        self._sorted = None
        if view.inventory is None:
            return
        prep = prepare(name, view.inventory, len(self._views))
        bucket = Bucket(
            total=len(prep.by_index),
            free=prep.free(view.taken),
            max_bw=prep.max_bw,
            tier=view.labels.get(self.cost_label, ""),
            free_per_numa=prep.free_by_numa(view.taken),
        )
        self._bucket_of[name] = bucket
        bisect.insort(self._buckets.setdefault(bucket, []), name)

    def remove(self, name: str) -> None:
        if name not in self._views:
            return
        self._leave_bucket(name)
        del self._views[name]
        del self._names[bisect.bisect_left(self._names, name)]
        self._sorted = None

    def _leave_bucket(self, name: str) -> None:
        bucket = self._bucket_of.pop(name, None)
        if bucket is None:
            return
        names = self._buckets[bucket]
        del names[bisect.bisect_left(names, name)]
        if not names:
            del self._buckets[bucket]

    def get(self, name: str) -> NodeView | None:
        return self._views.get(name)

    def views(self) -> list[NodeView]:
        """Every node's view, sorted by name (the same list until the index changes)."""
        if self._sorted is None:
            self._sorted = [self._views[name] for name in self._names]
        return self._sorted

    def position(self, name: str) -> int:
        """The node's place among the sorted names (as in ``views``)."""
        return bisect.bisect_left(self._names, name)

    def buckets(self) -> Mapping[Bucket, Sequence[str]]:
        return self._buckets

    def free_gpus(self, name: str) -> int:
        """The node's whole GPUs free for a claim (healthy, not in MIG mode, not shared, not
        taken); 0 for a node without an inventory or not in the index."""
        bucket = self._bucket_of.get(name)
        return bucket.free if bucket is not None else 0

    def most_free(self) -> int:
        """The most free GPUs on any one node."""
        return max((bucket.free for bucket in self._buckets), default=0)


def requested_percent(view: NodeView) -> float | None:
    """How much of the node's allocatable CPU and memory its pods request, in percent, averaged
    over the two (kube-scheduler's NodeResourcesFit measure); None where gpualloc does not know
    the node's allocatable or its pods."""
    shares: list[float] = []
    for resource in (quantities.CPU, quantities.MEMORY):
        total = view.allocatable.get(resource, 0)
        if total <= 0 or resource not in view.free:
            return None
        shares.append((total - view.free[resource]) / total)
    return 50 * sum(shares)


def busy(percent: float, label: str | None) -> bool:
    """Whether a node whose pods request ``percent`` (``requested_percent``) and whose busy label is
    ``label`` is busy: from ``BUSY_PERCENT`` on, and while labelled busy down to
    ``BUSY_HYSTERESIS`` points below."""
    if label == "true":
        return percent >= BUSY_PERCENT - BUSY_HYSTERESIS
    return percent >= BUSY_PERCENT


def steering_labels(
    free: Mapping[str, int],
    labels: Mapping[str, Mapping[str, str]],
    *,
    share_room: Collection[str] = frozenset(),
    requested: Mapping[str, float] | None = None,
) -> dict[str, dict[str, str]]:
    """The steering labels each node must be given (``controller.labelling``), for the nodes with
    a label that differs, only those labels. ``gpu.scheduling/free-gpus``: ``"true"`` where
    ``free`` counts at least one whole GPU free for a claim, ``"shares"`` where none is but the
    node is in ``share_room`` (a GPU holding fractional shares has room for more), ``"false"``
    otherwise. ``gpu.scheduling/busy``: ``"true"`` or ``"false"`` as ``busy`` says of the node's
    ``requested`` percent (``requested_percent``; a node not in it keeps the value it has).
    ``free`` names the GPU nodes gpualloc knows (every other node is left alone), ``labels`` each
    Node's current labels (a node without a Node is left alone: there is nothing to label)."""
    requested = requested or {}
    out: dict[str, dict[str, str]] = {}
    for name in sorted(free):
        current = labels.get(name)
        if current is None:
            continue
        if free[name] > 0:
            room = constants.FREE_GPUS_WHOLE
        elif name in share_room:
            room = constants.FREE_GPUS_SHARES
        else:
            room = constants.FREE_GPUS_NONE
        wanted = {constants.LABEL_FREE_GPUS: room}
        if name in requested:
            is_busy = busy(requested[name], current.get(constants.LABEL_BUSY))
            wanted[constants.LABEL_BUSY] = "true" if is_busy else "false"
        changed = {key: value for key, value in wanted.items() if current.get(key) != value}
        if changed:
            out[name] = changed
    return out
