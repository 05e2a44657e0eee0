"""Which Pending claims a change can help, and which claims a namespace's count limit leaves out (pure).

``State`` keeps these indexes from its events; this module decides nothing by itself.

**Waking by need.** A Pending claim is worth trying again when devices are given back, or a
node appears or changes, only where one replica of it could fit on that node if the node were
empty: ``Capacity.fits``. That is an upper bound, deliberately coarse (when in doubt, wake): it
looks at a node's healthy whole GPUs, their product names (``devices.product``) and a claim's
``nodeName`` pin, and nothing else (not taints, labels, memory, compute capability or
readiness, which the allocator judges). A claim of 64 GPUs per replica is never woken by an
8-GPU node; a claim for ``*B200*`` never by an H100 node. MIG and Shared claims are woken by
any node that has a GPU in MIG mode or a shared GPU. ``PendingIndex`` groups the Pending claims
by ``Need``, so a change visits the groups, not the claims, and wakes only those it can help.

**Claims that fit nowhere** even on an empty node (``State.fits_nowhere``) are woken only by a
node that could now hold them, and the work queue serves them after every other claim.

**A count limit per namespace** (``GpuQuota.spec.maxClaims``). ``Ranks`` orders each
namespace's claims by creationTimestamp, then name: the first ``maxClaims`` are considered for
allocation, the newer ones wait with reason ``TooManyClaims``, out of ``PendingIndex``, and
are woken only when they come inside the limit (an older claim deleted, the limit raised).
"""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
from collections.abc import Iterator

from controller import nodes
from gpualloc.api import constants, models

REASON_TOO_MANY_CLAIMS = "TooManyClaims"


@dataclasses.dataclass(frozen=True, slots=True)
class Need:
    """What one replica of a claim needs of a single node, as far as waking goes."""

    exclusive: bool  # whole GPUs; otherwise MIG instances or slots of shared GPUs
    count: int  # GPUs per replica (whole GPUs only; 0 otherwise)
    product: str | None = None  # the glob on the product name, whole GPUs only
    node_name: str | None = None  # the claim's pin


def need_of(claim: models.GpuClaim) -> Need:
    devices = claim.spec.devices
    if devices.exclusivity != "Exclusive":
        return Need(exclusive=False, count=0, node_name=claim.spec.node_name or None)
    return Need(
        exclusive=True,
        count=devices.count,
        product=devices.product or None,
        node_name=claim.spec.node_name or None,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    """What a node could give one replica if nothing on it were taken."""

    whole: tuple[str, ...] = ()  # the product names of its healthy GPUs not in MIG mode and not shared
    partial: bool = False  # it has a GPU in MIG mode or a shared GPU

    def fits(self, need: Need, node: str) -> bool:
        """Could one replica of ``need`` fit on this node (``node``), empty? (An upper bound.)"""
        if need.node_name is not None and need.node_name != node:
            return False
        if not need.exclusive:
            return self.partial
        if need.count > len(self.whole):
            return False
        if need.product is None:
            return True
        product = need.product
        return sum(1 for name in self.whole if fnmatch.fnmatchcase(name, product)) >= need.count


NO_CAPACITY = Capacity()


def capacity_of(status: models.GpuNodeStatus | None) -> Capacity:
    """A node's ``Capacity`` from its GpuNodeStatus (none without one); one device per host index,
    as the allocator counts them (``nodes.prepare``)."""
    if status is None:
        return NO_CAPACITY
    by_index: dict[int, models.Device] = {}
    for device in status.status.devices:
        by_index.setdefault(device.index, device)
    whole = tuple(
        sorted(
            d.product
            for d in by_index.values()
            if d.health == constants.HEALTHY and not nodes.in_mig_mode(d) and not d.shared
        )
    )
    partial = any(nodes.in_mig_mode(d) or d.shared for d in by_index.values())
    return Capacity(whole=whole, partial=partial)


class PendingIndex:
    """Pending claims (those the count limit admits) by ``Need``; ``helped_by`` names those one
    replica of which could fit on a node, visiting groups of claims rather than claims."""

    def __init__(self) -> None:
        self._need: dict[str, Need] = {}
        # pin ("" for none) -> need -> keys: a change on a node visits the unpinned groups and its own.
        self._groups: dict[str, dict[Need, set[str]]] = {}
        self._by_namespace: dict[str, set[str]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._need

    def __len__(self) -> int:
        return len(self._need)

    def add(self, key: str, need: Need) -> None:
        if self._need.get(key) == need:
            return
        self.discard(key)
        self._need[key] = need
        self._groups.setdefault(need.node_name or "", {}).setdefault(need, set()).add(key)
        self._by_namespace.setdefault(key.partition("/")[0], set()).add(key)

    def discard(self, key: str) -> None:
        need = self._need.pop(key, None)
        if need is None:
            return
        pin = need.node_name or ""
        groups = self._groups[pin]
        groups[need].discard(key)
        if not groups[need]:
            del groups[need]
            if not groups:
                del self._groups[pin]
        namespace = key.partition("/")[0]
        self._by_namespace[namespace].discard(key)
        if not self._by_namespace[namespace]:
            del self._by_namespace[namespace]

    def helped_by(self, node: str, capacity: Capacity) -> Iterator[str]:
        """The keys of the claims that could fit on ``node`` (``capacity``) if it were empty."""
        for pin in ("", node) if node else ("",):
            for need, keys in list(self._groups.get(pin, {}).items()):
                if capacity.fits(need, node):
                    yield from sorted(keys)

    def in_namespace(self, namespace: str) -> list[str]:
        return sorted(self._by_namespace.get(namespace, ()))


class Ranks:
    """Each namespace's claims ordered by (creationTimestamp, name): a claim's place among them."""

    def __init__(self) -> None:
        self._sorted: dict[str, list[tuple[str, str]]] = {}  # namespace -> (creationTimestamp, name)
        self._of: dict[str, tuple[str, str]] = {}  # key -> its entry

    def __contains__(self, key: str) -> bool:
        return key in self._of

    def put(self, key: str, creation_timestamp: str) -> int:
        """Place ``key`` (``namespace/name``); its rank (0: the oldest)."""
        namespace, _, name = key.partition("/")
        entry = (creation_timestamp, name)
        old = self._of.get(key)
        if old == entry:
            return self.rank(key)
        if old is not None:
            self.remove(key)
        self._of[key] = entry
        ordered = self._sorted.setdefault(namespace, [])
        index = bisect.bisect_left(ordered, entry)
        ordered.insert(index, entry)
        return index

    def remove(self, key: str) -> int | None:
        """Drop ``key``; the rank it had, or None if it was not there."""
        entry = self._of.pop(key, None)
        if entry is None:
            return None
        namespace = key.partition("/")[0]
        ordered = self._sorted[namespace]
        index = bisect.bisect_left(ordered, entry)
        del ordered[index]
        if not ordered:
            del self._sorted[namespace]
        return index

    def rank(self, key: str) -> int:
        """The claim's place in its namespace (0: the oldest); the namespace's count if unknown."""
        namespace = key.partition("/")[0]
        ordered = self._sorted.get(namespace, [])
        entry = self._of.get(key)
        return len(ordered) if entry is None else bisect.bisect_left(ordered, entry)

    def count(self, namespace: str) -> int:
        return len(self._sorted.get(namespace, ()))

    def keys(self, namespace: str, start: int, stop: int) -> list[str]:
        """The keys of the claims of ranks ``start`` to ``stop - 1``."""
        ordered = self._sorted.get(namespace, [])
        return [f"{namespace}/{name}" for _, name in ordered[max(0, start) : max(0, stop)]]


def max_claims(quotas: list[models.GpuQuota]) -> tuple[int, str] | None:
    """The smallest ``spec.maxClaims`` among a namespace's quotas, and the quota's name; None: no limit."""
    limits = [(q.spec.max_claims, q.metadata.name) for q in quotas if q.spec.max_claims is not None]
    return min(limits) if limits else None


def too_many_message(namespace: str, quota: str, limit: int, count: int) -> str:
    return (
        f"namespace {namespace} has {count} GpuClaims and GpuQuota {quota} allows {limit} (spec.maxClaims): "
        f"this claim is among the {count - limit} newest, which are not considered for allocation "
        "until older claims are deleted"
    )
