"""What the controller knows of the cluster: its caches and the indexes kept from their events.

Eight feeds (``FEEDS``): every GpuClaim, every GpuNodeStatus, every Node, the
device Leases (``managed-by=gpualloc`` in the controller's namespace), the
agents' heartbeat Leases (in their own namespace; optional), the pods the
webhook gated, every live pod (not Succeeded or Failed; a few fields of each,
``gates.kept_of_live_pod``) and every GpuQuota. On a real API server each is a
``watching.Reflector``; in the deterministic simulation, an in-memory stand-in
with the same ``cache`` / ``synced`` / ``on_event`` / ``get``. Each event
updates the indexes here in O(what changed) and names the claims worth looking
at again (``wake``).

**One mechanism for "my cache is behind my own write".** The object a write of
this process returns is written through into the cache at once
(``remember``), as if its watch event had come, unless the cache already holds
a newer version; a Lease this process deleted is forgotten at once. The watch
event that follows changes nothing. In-flight acquisitions of this process
are ``reserved`` so two of its workers never plan the same device.

**Safety never rests on the caches.** A device is locked by creating its
Lease (atomic), a claim's status is written only at the resourceVersion its
decision was made from, and Leases are released only under the rules in
``locking``. A cache that lags only costs a conflict and a retry.

The allocator's view of the nodes is a ``nodes.NodeIndex`` kept here: an event
marks the nodes it changes (a status, a Node, a Lease or reservation of one of
its devices, a claim listing one), and ``node_index`` rebuilds only those, and
the ready nodes whose heartbeat has just grown too old.

"Taken", for planning, is the union of: every device Lease in the cache,
whoever holds it (Leases the claim being planned holds but does not record
are left over from another attempt and are not adopted, see ``locking``); the
devices every live claim's status lists, whether or not their Leases are
there; the devices being acquired right now by this process; and the devices
live pods were given that their own claim does not list (``held_by_pods_alone``):
pods are the ground truth of use, so a GPU a running pod was given stays taken
whatever happened to its claim (deleted with its finalizer stripped, restored
from a backup) or to its Lease, until the pod ends.
"""

from __future__ import annotations

import collections
import datetime
import heapq
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from controller import fragmentation, gates, locks, unplaceable, views, waking
from controller import metrics as controller_metrics
from controller.nodes import NodeIndex
from gpualloc.api import codecs, constants, leases, models, requests
from gpualloc.kube import watching

log = logging.getLogger(__name__)

Obj = dict[str, Any]

FEEDS = ("claims", "node_statuses", "nodes", "leases", "heartbeats", "pods", "live_pods", "quotas")
OPTIONAL_FEEDS = frozenset({"heartbeats"})  # without it, a node's heartbeat is its GpuNodeStatus's
LIVE_PODS = "status.phase!=Succeeded,status.phase!=Failed"
GONE_KEPT = 10_000  # deleted uids remembered, against late answers to our own writes
FITS_KEPT = 10_000  # answers of fits_nowhere remembered (one per distinct need) until capacity changes


class Feed(Protocol):
    """A cache of one kind, kept by someone else (``watching.Reflector``, or the simulation's)."""

    cache: dict[str, Obj]
    synced: Any  # an asyncio.Event
    on_event: Callable[[str, Obj], None] | None

    def get(self, key: str) -> Obj | None: ...


# What the caches keep of the objects that are not gpualloc's own, rather than all of it: a
# tenant's large annotations or labels cost the controller nothing, nor does the status a
# kubelet writes to its Node. The write-through (``State.remember``) keeps the same part of
# the answers to the controller's own writes.
KEPT: dict[str, Callable[[Obj], Obj]] = {
    "claims": codecs.kept_of_claim,
    "nodes": views.kept_of_node,
    "pods": gates.kept_of_pod,
    "live_pods": gates.kept_of_live_pod,
}


def reflectors(
    api: Any, namespace: str, claim_selector: str = "", *, heartbeat_namespace: str = ""
) -> dict[str, watching.Reflector]:
    """The feeds on a real API server (the heartbeat Leases' only with ``heartbeat_namespace``)."""
    feeds = {
        "claims": watching.Reflector(
            api, watching.CLAIMS, label_selector=claim_selector, transform=KEPT["claims"]
        ),
        "node_statuses": watching.Reflector(api, watching.NODE_STATUSES),
        "nodes": watching.Reflector(api, watching.NODES, transform=KEPT["nodes"]),
        "leases": watching.Reflector(
            api, watching.LEASES, namespace=namespace, label_selector=leases.MANAGED
        ),
        # Only the pods the webhook gated (it labels them), never every pod in the cluster, and
        # only the few fields gate mode reads (``gates.kept_of_pod``).
        "pods": watching.Reflector(
            api, watching.PODS, label_selector=f"{constants.LABEL_GATED}=true", transform=KEPT["pods"]
        ),
        # Every pod that is not Succeeded or Failed (one that ends leaves the field selector, which
        # the watch reports as DELETED), kept as a few fields: the GPUs each was given.
        "live_pods": watching.Reflector(
            api, watching.PODS, field_selector=LIVE_PODS, transform=KEPT["live_pods"]
        ),
        "quotas": watching.Reflector(api, watching.QUOTAS),
    }
    if heartbeat_namespace:
        feeds["heartbeats"] = watching.Reflector(
            api, watching.LEASES, namespace=heartbeat_namespace, label_selector=leases.MANAGED
        )
    return feeds


def _meta(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = raw.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _newer(cached: Mapping[str, Any] | None, obj: Mapping[str, Any]) -> bool:
    """The cache holds a later version of ``obj`` than ``obj`` (resourceVersions compared as the
    etcd revisions they are; when either is not a number, nothing is known to be newer)."""
    if cached is None:
        return False
    have, new = watching.resource_version_of(cached), watching.resource_version_of(obj)
    return have.isdigit() and new.isdigit() and int(have) > int(new)


def _heartbeat_of(raw: Mapping[str, Any]) -> str:
    return str((raw.get("status") or {}).get("lastHeartbeatTime") or "")


def only_heartbeat_moved(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether GpuNodeStatus ``new`` differs from ``old`` only in its heartbeat (or its metadata)."""
    old_status = {**(old.get("status") or {}), "lastHeartbeatTime": None}
    new_status = {**(new.get("status") or {}), "lastHeartbeatTime": None}
    return old.get("spec") == new.get("spec") and old_status == new_status


def _note_beat(beats: dict[str, tuple[str, float]], node: str, beat: str, now: float) -> None:
    """In ``beats``, when ``node``'s heartbeat text was first seen as it is (``heartbeat_age``)."""
    seen = beats.get(node)
    if not beat:
        beats.pop(node, None)
    elif seen is None or seen[0] != beat:
        beats[node] = (beat, now)


class State:
    """The caches and their indexes. ``wake(key)`` is called for each claim worth reconciling."""

    def __init__(
        self,
        feeds: Mapping[str, Feed],
        *,
        lease_namespace: str,
        node_stale_after: float,
        wake: Callable[[str], None],
        now: Callable[[], datetime.datetime],
        monotonic: Callable[[], float] = time.monotonic,
        cost_label: str = constants.LABEL_COST_TIER,
    ) -> None:
        self.feeds = {name: feeds[name] for name in FEEDS if name in feeds or name not in OPTIONAL_FEEDS}
        self.lease_namespace = lease_namespace
        self.node_stale_after = node_stale_after
        self.wake = wake
        self.now = now
        self.monotonic = monotonic
        handlers = {
            "claims": self._on_claim,
            "node_statuses": self._on_node_status,
            "nodes": self._on_node,
            "leases": self._on_lease,
            "heartbeats": self._on_heartbeat,
            "pods": self._on_pod,
            "live_pods": self._on_live_pod,
            "quotas": self._on_quota,
        }
        for name, feed in self.feeds.items():
            feed.on_event = handlers[name]
        # Claims.
        self._parsed: dict[str, tuple[str, models.GpuClaim | None]] = {}  # key -> (resourceVersion, model)
        self._uid_to_key: dict[str, str] = {}
        self._key_to_uid: dict[str, str] = {}
        self.pending: set[str] = set()
        # Waking (``waking``): the Pending claims that the count limit admits, by what they need of
        # a node; each namespace's claims by age; what each node could give; and, until that
        # changes, whether some node could hold a need at all.
        self._waitlist = waking.PendingIndex()
        self._ranks = waking.Ranks()
        self._capacity: dict[str, waking.Capacity] = {}
        self._fits: dict[waking.Need, bool] = {}
        self._allocated_on: dict[str, set[str]] = collections.defaultdict(set)  # node -> claim keys
        self._claim_nodes: dict[str, frozenset[str]] = {}
        self._listed: dict[str, str] = {}  # lock id -> uid of the claim whose status lists it whole
        # GPU UUID -> {uid of a live claim whose status lists a share of it: its milli-GPU}
        self._listed_shares: dict[str, dict[str, int]] = collections.defaultdict(dict)
        self._claim_listed: dict[str, tuple[str, frozenset[str]]] = {}  # key -> (uid, lock ids)
        # Nodes.
        self.statuses: dict[str, models.GpuNodeStatus] = {}  # node name -> parsed
        self._status_node: dict[str, str] = {}  # GpuNodeStatus name -> node name
        # GpuNodeStatus name -> the cached object last parsed or compared with the one before.
        self._status_raw: dict[str, Obj] = {}
        self._fingerprints: dict[str, Any] = {}
        self.facts: dict[str, views.NodeFacts] = {}
        self.ready_nodes: dict[str, bool] = {}
        # When this process last saw each node's heartbeat move: node -> (heartbeat text, monotonic),
        # one table for the GpuNodeStatus's lastHeartbeatTime and one for the heartbeat Lease's renewTime.
        self._beats: dict[str, tuple[str, float]] = {}
        self._lease_beats: dict[str, tuple[str, float]] = {}
        self._devices_of: dict[str, tuple[str, ...]] = {}  # node -> its device UUIDs
        self._device_node: dict[str, str] = {}  # device UUID -> node
        self._lease_node: dict[str, str] = {}  # device Lease name -> node
        # The allocator's view of every GPU node (``node_index``), rebuilt node by node: the nodes
        # an event changed are marked stale, and so is a ready node once its heartbeat is too old.
        self._index = NodeIndex(cost_label=cost_label)
        self._stale: set[str] = set()
        self._ready_until: list[tuple[float, str]] = []  # heap: (monotonic, node)
        # Leases.
        self.leases: dict[str, leases.LeaseInfo] = {}  # lease name -> info
        self._held: dict[str, dict[str, leases.LeaseInfo]] = collections.defaultdict(dict)  # holder uid ->
        self.reserved: dict[str, str] = {}  # lease name -> claim uid, being acquired by this process
        self._muted = ""  # a claim key not to wake while its own write is remembered
        self._gone: dict[str, None] = {}  # uids of claims and Leases seen DELETED, the newest GONE_KEPT
        # Gated pods.
        self._pod_claim: dict[str, str] = {}
        self._pods_by_claim: dict[str, set[str]] = collections.defaultdict(set)
        # Live pods: the devices each was given, and those its own claim does not list, which are
        # held by the pods alone (``held_by_pods_alone``).
        self._pod_uses: dict[str, tuple[str, frozenset[str]]] = {}  # pod key -> (claim key, UUIDs)
        self._pods_of_claim: dict[str, set[str]] = collections.defaultdict(set)  # claim key -> pod keys
        self._claim_uuids: dict[str, frozenset[str]] = {}  # claim key -> the UUIDs its status lists
        self._pod_alone: dict[str, frozenset[str]] = {}  # pod key -> its UUIDs no claim of it lists
        self._held_by_pods: dict[str, set[str]] = collections.defaultdict(set)  # UUID -> those pods
        # What the live pods bound to each node request (kube-scheduler's NodeResourcesFit sums):
        # one running sum per node, kept from the pods' own cached requests.
        self._claim_pods: dict[str, dict[str, Obj]] = collections.defaultdict(dict)  # claim -> pod -> kept
        self._pod_claim_of: dict[str, str] = {}  # live claim pod -> its claim key
        self._pod_load: dict[str, tuple[str, Mapping[str, int]]] = {}  # pod key -> (node, requests)
        self._node_requested: dict[str, dict[str, int]] = {}  # node -> summed requests
        # The shapes of the claims allocated lately and of the pods without claims bound lately:
        # strategy leastFragmentation's workload (the claims: ``Allocating``; the pods: ``_count_load``).
        self.recent = fragmentation.Recent()
        # Quotas.
        self._quotas: dict[str, dict[str, models.GpuQuota]] = collections.defaultdict(dict)  # namespace ->

    # ------------------------------------------------------------------ reading

    def synced(self) -> bool:
        return all(feed.synced.is_set() for feed in self.feeds.values())

    async def wait_synced(self) -> None:
        for feed in self.feeds.values():
            await feed.synced.wait()

    def claim_keys(self) -> list[str]:
        return list(self.feeds["claims"].cache)

    def raw_claim(self, key: str) -> Obj | None:
        return self.feeds["claims"].get(key)

    def claim(self, key: str) -> models.GpuClaim | None:
        """The cached claim as a model, parsed once per resourceVersion; None if gone or unreadable."""
        raw = self.raw_claim(key)
        if raw is None:
            return None
        version = watching.resource_version_of(raw)
        cached = self._parsed.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        claim: models.GpuClaim | None
        try:
            claim = codecs.parse_claim(raw)
        except codecs.DecodeError as exc:
            log.error("unreadable GpuClaim skipped", extra={"claim": key, "error": str(exc)})
            claim = None
        self._parsed[key] = (version, claim)
        return claim

    def claim_key_of(self, uid: str) -> str | None:
        return self._uid_to_key.get(uid)

    def held_by(self, uid: str) -> dict[str, leases.LeaseInfo]:
        """The cached device Leases held by claim ``uid``, by name."""
        return dict(self._held.get(uid, {}))

    def holders(self) -> dict[str, dict[str, leases.LeaseInfo]]:
        """Every holder's Leases (a copy: the caller may await while walking it)."""
        return {holder: dict(held) for holder, held in self._held.items()}

    def listed_by(self, lock_id: str) -> str | None:
        """The uid of the live claim whose status lists ``lock_id`` (a device UUID or a slot)."""
        return self._listed.get(lock_id)

    def gated_pods(self, claim_key: str) -> Iterator[tuple[str, Obj]]:
        pods = self.feeds["pods"]
        for pod_key in sorted(self._pods_by_claim.get(claim_key, ())):
            pod = pods.get(pod_key)
            if pod is not None and gates.is_gated(pod):
                yield pod_key, pod

    def quotas(self, namespace: str) -> list[models.GpuQuota]:
        """The namespace's GpuQuotas, by name."""
        held = self._quotas.get(namespace, {})
        return [held[key] for key in sorted(held)]

    def all_quotas(self) -> list[models.GpuQuota]:
        return [quota for namespace in sorted(self._quotas) for quota in self.quotas(namespace)]

    def quota_figures(self) -> Iterable[tuple[str, str, int, int]]:
        """(namespace, name, used, hard) of every quota, for the metrics."""
        for quota in self.all_quotas():
            yield quota.metadata.namespace, quota.metadata.name, quota.status.used, quota.spec.gpus

    def heartbeat_age(self, node: str) -> float | None:
        """Seconds since this process saw the node's heartbeat change, in its GpuNodeStatus or its
        heartbeat Lease (on its own clock, not the agent's: a first sight counts as a change);
        None without a heartbeat."""
        seen = [beat[1] for beat in (self._beats.get(node), self._lease_beats.get(node)) if beat is not None]
        return self.monotonic() - max(seen) if seen else None

    def node_ready(self, node: str) -> bool:
        status = self.statuses.get(node)
        return status is not None and views.node_ready(
            status.status, heartbeat_age=self.heartbeat_age(node), stale_after=self.node_stale_after
        )

    def node_index(self) -> NodeIndex:
        """Every GPU node as the allocator sees it, with every taken device marked (module
        docstring). Only the nodes changed since the last call are rebuilt."""
        now = self.monotonic()
        while self._ready_until and self._ready_until[0][0] < now:
            self._stale.add(heapq.heappop(self._ready_until)[1])
        if not self._stale:
            return self._index
        held, listed, reserved, pods = self.leases, self._listed, self.reserved, self._held_by_pods
        listed_shares = self._listed_shares

        def is_taken(uuid: str) -> bool:
            name = constants.lease_name(uuid)
            return name in held or name in reserved or uuid in listed or uuid in pods or uuid in listed_shares

        def milli_used(uuid: str) -> int | None:
            """What the shares take of a taken GPU: the union, by claim, of its Lease's ledger and
            the statuses that list a share of it; None when anything holds it whole (a whole Lease
            or status, this process's reservation, a pod no share explains)."""
            lease = held.get(constants.lease_name(uuid))
            shares = dict(listed_shares.get(uuid, {}))
            for entry in lease.shares if lease is not None else ():
                shares[entry.holder] = max(entry.milli, shares.get(entry.holder, 0))
            whole = (
                (lease is not None and not lease.ledger) or uuid in listed or (uuid in pods and not shares)
            )
            if whole or constants.lease_name(uuid) in reserved:
                return None
            return min(leases.WHOLE_MILLI, sum(shares.values()))

        for node in sorted(self._stale):
            status = self.statuses.get(node)
            if status is None:
                self._index.remove(node)
                continue
            age = self.heartbeat_age(node)
            view = views.node_view(
                node,
                status,
                self.facts.get(node),
                is_taken=is_taken,
                milli_used=milli_used,
                heartbeat_age=age,
                stale_after=self.node_stale_after,
                requested=self._node_requested.get(node, {}),
            )
            self._index.put(view)
            if view.ready and age is not None:  # not ready any more once the heartbeat is too old
                heapq.heappush(self._ready_until, (now - age + self.node_stale_after, node))
        self._stale.clear()
        return self._index

    def reserve(self, names: Iterable[str], uid: str) -> None:
        """Device Leases claim ``uid`` is acquiring: taken for this process's other workers."""
        for name in names:
            self.reserved[name] = uid
            self._mark_lease_node(name)

    def unreserve(self, names: Iterable[str], uid: str) -> None:
        for name in names:
            if self.reserved.get(name) == uid:
                del self.reserved[name]
                self._mark_lease_node(name)

    def _mark_lease_node(self, lease_name: str, label: str = "") -> None:
        node = self._lease_node.get(lease_name, label)
        if node:
            self._stale.add(node)

    def _mark_device_nodes(self, uuids: Iterable[str]) -> None:
        for uuid in uuids:
            node = self._device_node.get(uuid)
            if node is not None:
                self._stale.add(node)

    def device_counts(self) -> Iterable[tuple[str, str, int]]:
        """(node, state, count) for ``gpualloc_devices``."""
        for node, status in sorted(self.statuses.items()):
            counts = dict.fromkeys(controller_metrics.DEVICE_STATES, 0)
            for device in status.status.devices:
                if (
                    device.uuid in self._held_by_pods
                    or device.uuid in self._listed_shares
                    or any(
                        constants.lease_name(lock_id) in self.leases or lock_id in self._listed
                        for lock_id in device.lock_ids
                    )
                ):
                    counts["allocated"] += 1
                elif device.health != constants.HEALTHY:
                    counts["unhealthy"] += 1
                else:
                    counts["free"] += 1
            for state, count in counts.items():
                yield node, state, count

    # ------------------------------------------------------------------ this process's writes

    def remember(self, feed: str, obj: Obj, *, reconciling: str) -> None:
        """Write ``obj``, as a write of ours returned it, through into the cache ``feed``.

        ``reconciling`` is the key of the claim whose reconcile made the write: it
        is not queued again for its own write (nor for the watch event that echoes it).
        An answer that arrives after the object's DELETED event never brings it back
        (the deterministic simulation found that one, seed 103609).
        """
        cache = self.feeds[feed].cache
        obj = watching.without_managed_fields(obj)  # as the feeds keep their objects
        if feed in KEPT:
            obj = KEPT[feed](obj)
        key = watching.object_key(obj)
        if _newer(cache.get(key), obj) or str(_meta(obj).get("uid", "")) in self._gone:
            return
        meta = _meta(obj)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            # The write removed the last finalizer: the API server has deleted the object.
            type_ = watching.DELETED
            cache.pop(key, None)
        else:
            type_ = watching.MODIFIED if key in cache else watching.ADDED
            cache[key] = obj
        handler = self.feeds[feed].on_event
        if handler is not None:
            self._muted = reconciling
            try:
                handler(type_, obj)
            finally:
                self._muted = ""

    def forget_lease(self, name: str, uid: str) -> None:
        """A Lease this process deleted (and whose finalizer it removed) is gone."""
        feed = self.feeds["leases"]
        key = f"{self.lease_namespace}/{name}"
        cached = feed.cache.get(key)
        if cached is None or str(_meta(cached).get("uid", "")) != uid:
            return
        del feed.cache[key]
        if feed.on_event is not None:
            feed.on_event(watching.DELETED, cached)

    # ------------------------------------------------------------------ event handlers

    def _bury(self, uid: str) -> None:
        if uid:
            self._gone[uid] = None
            if len(self._gone) > GONE_KEPT:
                del self._gone[next(iter(self._gone))]

    def _wake_claim(self, key: str) -> None:
        if key != self._muted:
            self.wake(key)

    def _on_claim(self, type_: str, raw: Obj) -> None:
        key = watching.object_key(raw)
        parsed = self._parsed.get(key)
        if (
            type_ != watching.DELETED
            and parsed is not None
            and parsed[0] == watching.resource_version_of(raw)
        ):
            return  # the watch event of a write of ours that was remembered already
        meta = _meta(raw)
        uid = str(meta.get("uid", ""))
        for node in self._claim_nodes.pop(key, frozenset()):
            self._allocated_on[node].discard(key)
        old_uid, old_listed = self._claim_listed.pop(key, ("", frozenset()))
        for uuid in old_listed:
            if self._listed.get(uuid) == old_uid:
                del self._listed[uuid]
            shares = self._listed_shares.get(uuid)
            if shares is not None:
                shares.pop(old_uid, None)
                if not shares:
                    del self._listed_shares[uuid]
        self._mark_device_nodes(old_listed)
        if type_ == watching.DELETED:
            self._bury(uid)
            self._parsed.pop(key, None)
            self.pending.discard(key)
            if self._uid_to_key.get(uid) == key:
                del self._uid_to_key[uid]
            self._key_to_uid.pop(key, None)
            self._claim_uuids.pop(key, None)
            self._judge_pods_of(key)  # its pods' devices are theirs alone now
            self._claim_gone(key)
            self._wake_for_devices(old_listed)  # its devices are free for the others now
            self.wake(key)  # gone: the controller forgets what it kept about it
            return
        previous = self._key_to_uid.get(key)
        if previous is not None and previous != uid:  # re-created under its name; its DELETED was missed
            self._bury(previous)
            if self._uid_to_key.get(previous) == key:
                del self._uid_to_key[previous]
        self._uid_to_key[uid] = key
        self._key_to_uid[key] = uid
        status = raw.get("status") or {}
        phase = status.get("phase") or constants.PHASE_PENDING
        if meta.get("deletionTimestamp") or phase in (constants.PHASE_ALLOCATED, constants.PHASE_FAILED):
            self.pending.discard(key)
        else:
            self.pending.add(key)
        claim = self.claim(key)
        if claim is not None:
            listed = locks.listed_devices(claim)
            if listed:
                self._claim_listed[key] = (uid, listed)
                for uuid in locks.listed_whole(claim):
                    self._listed[uuid] = uid
                for uuid, milli in locks.listed_shares(claim).items():
                    self._listed_shares[uuid][uid] = milli
                self._mark_device_nodes(listed)
            self._claim_uuids[key] = frozenset(d.uuid for a in claim.status.allocations for d in a.devices)
            nodes = frozenset(a.node_name for a in claim.status.allocations)
            if nodes:
                self._claim_nodes[key] = nodes
                for node in nodes:
                    self._allocated_on[node].add(key)
        if claim is None:
            self._claim_uuids.pop(key, None)
        self._judge_pods_of(key)
        self._claim_placed(key, str(meta.get("creationTimestamp") or ""))
        self._wake_for_devices(old_listed - self._claim_listed.get(key, ("", frozenset()))[1])  # given back
        self._wake_claim(key)

    def _on_lease(self, type_: str, raw: Obj) -> None:
        info = leases.parse(raw)
        self._mark_lease_node(info.name, info.node)
        old = self.leases.pop(info.name, None)
        before = {h.holder: h for h in leases.holdings(old)} if old is not None else {}
        for holder in before:
            held = self._held.get(holder)
            if held is not None:
                held.pop(info.name, None)
                if not held:
                    del self._held[holder]
        if type_ == watching.DELETED:
            self._bury(info.uid)
            self._wake_for_node(self._lease_node.get(info.name, info.node))  # capacity freed
            for holder in sorted({*before, *(h.holder for h in leases.holdings(info))}):
                key = self._uid_to_key.get(holder)
                if key is not None:
                    self._wake_claim(key)  # an Allocated claim may have lost a recorded Lease
            return
        self.leases[info.name] = info
        for holding in leases.holdings(info):
            self._held[holding.holder][info.name] = holding
            seen = before.get(holding.holder)
            if seen is None or seen.deleting != holding.deleting:
                key = self._uid_to_key.get(holding.holder)
                if key is not None:
                    self._wake_claim(key)
        if old is not None and old.used_milli > info.used_milli:
            self._wake_for_node(self._lease_node.get(info.name, info.node))  # a share given back

    def _on_node_status(self, type_: str, raw: Obj) -> None:
        name = str(_meta(raw).get("name", ""))
        old_raw = self._status_raw.pop(name, None)
        node = self._status_node.get(name)
        if (
            type_ != watching.DELETED
            and node is not None
            and old_raw is not None
            and only_heartbeat_moved(old_raw, raw)
        ):
            # Most writes are the agent's heartbeat alone: the parsed inventory, its place in
            # the index and its allocator tables (``nodes.prepare``) stay as they are.
            self._status_raw[name] = raw
            _note_beat(self._beats, node, _heartbeat_of(raw), self.monotonic())
            self._beat_seen(node)
            return
        self._status_node.pop(name, None)
        if node is not None:
            self.statuses.pop(node, None)
        if type_ != watching.DELETED:
            try:
                parsed = codecs.parse_node_status(raw)
            except codecs.DecodeError as exc:
                log.warning("unreadable GpuNodeStatus ignored", extra={"node": name, "error": str(exc)})
                parsed = None
            if parsed is not None:
                node = parsed.spec.node_name or name
                self.statuses[node] = parsed
                self._status_node[name] = node
                self._status_raw[name] = raw
                _note_beat(self._beats, node, parsed.status.last_heartbeat_time or "", self.monotonic())
        node = node or name
        if node not in self.statuses:
            self._beats.pop(node, None)
        self._index_devices(node)
        self._stale.add(node)
        status = self.statuses.get(node)
        fingerprint = None
        if status is not None:
            inv = status.status
            offered = [(d.sharing.strategy, d.sharing.replicas) if d.sharing else None for d in inv.devices]
            fingerprint = (tuple((d.uuid, d.health, d.index, d.mig) for d in inv.devices), offered, inv.links)
        if self._fingerprints.get(node) != fingerprint:
            self._fingerprints[node] = fingerprint
            self.ready_nodes[node] = self.node_ready(node)
            self.node_changed(node)
        else:
            self._readiness_changed(node)

    def _on_heartbeat(self, type_: str, raw: Obj) -> None:
        """A node's heartbeat Lease (named after the node) was renewed, created or deleted."""
        node = str(_meta(raw).get("name", ""))
        beat = "" if type_ == watching.DELETED else leases.renewed_at(raw)
        _note_beat(self._lease_beats, node, beat, self.monotonic())
        if node in self.statuses:
            self._beat_seen(node)

    def _beat_seen(self, node: str) -> None:
        """After a heartbeat alone: the node's view is rebuilt only if that changed its readiness."""
        view = self._index.get(node)
        if view is None or view.ready != self.node_ready(node):
            self._stale.add(node)
        self._readiness_changed(node)

    def _readiness_changed(self, node: str) -> None:
        ready = self.node_ready(node)
        if self.ready_nodes.get(node) != ready:
            self.ready_nodes[node] = ready
            self.node_changed(node)

    def _index_devices(self, node: str) -> None:
        """Which node each device (and its Lease) of ``node``'s GpuNodeStatus is on."""
        for uuid in self._devices_of.pop(node, ()):
            if self._device_node.get(uuid) == node:
                del self._device_node[uuid]
                self._lease_node.pop(constants.lease_name(uuid), None)
        status = self.statuses.get(node)
        if status is None:
            return
        uuids = tuple(uuid for d in status.status.devices for uuid in d.lock_ids)
        self._devices_of[node] = uuids
        for uuid in uuids:
            self._device_node[uuid] = node
            self._lease_node[constants.lease_name(uuid)] = node

    def _on_node(self, type_: str, raw: Obj) -> None:
        facts = views.node_facts(raw)
        old = self.facts.pop(facts.name, None)
        if type_ != watching.DELETED:
            self.facts[facts.name] = facts
        if old != self.facts.get(facts.name):
            self._stale.add(facts.name)
            self.node_changed(facts.name)

    def node_changed(self, node: str) -> None:
        """Node ``node`` (its Node, GpuNodeStatus or readiness) changed: wake the claims allocated
        there, and the pending claims that could fit there (``waking``)."""
        capacity = waking.capacity_of(self.statuses.get(node))
        if self._capacity.get(node, waking.NO_CAPACITY) != capacity:
            self._fits.clear()
            if capacity == waking.NO_CAPACITY:
                self._capacity.pop(node, None)
            else:
                self._capacity[node] = capacity
        self._wake_for_node(node)
        for key in self._allocated_on.get(node, ()):
            self.wake(key)

    def _on_pod(self, type_: str, raw: Obj) -> None:
        key = watching.object_key(raw)
        old = self._pod_claim.pop(key, None)
        if old is not None:
            self._pods_by_claim[old].discard(key)
            if not self._pods_by_claim[old]:
                del self._pods_by_claim[old]
        if type_ == watching.DELETED or not gates.is_gated(raw):
            return
        claim_key = gates.pod_claim(raw)
        if claim_key is None:
            return
        self._pod_claim[key] = claim_key
        self._pods_by_claim[claim_key].add(key)
        self.wake(claim_key)

    def _on_live_pod(self, type_: str, raw: Obj) -> None:
        """A live pod was added, changed or ended (or was deleted): the devices it was given."""
        key = watching.object_key(raw)
        old = self._pod_uses.pop(key, None)
        if old is not None:
            self._pods_of_claim[old[0]].discard(key)
            if not self._pods_of_claim[old[0]]:
                del self._pods_of_claim[old[0]]
        given = None if type_ == watching.DELETED or gates.is_gated(raw) else gates.given_devices(raw)
        if given is not None:
            claim_key = f"{_meta(raw).get('namespace', '')}/{given[0]}"
            self._pod_uses[key] = (claim_key, given[1])
            self._pods_of_claim[claim_key].add(key)
        self._judge_pod(key)
        self._count_load(key, None if type_ == watching.DELETED else raw)
        self._note_claim_pod(key, None if type_ == watching.DELETED else raw)

    def _note_claim_pod(self, pod_key: str, raw: Obj | None) -> None:
        """Index a live claim pod by its claim; wake the claim when the scheduler's verdict on the
        pod (``unplaceable``) or its node changed, or an Unschedulable one went away."""
        claim_key = gates.pod_claim(raw) if raw is not None else None
        before_key = self._pod_claim_of.pop(pod_key, None)
        old = self._claim_pods[before_key].pop(pod_key, None) if before_key is not None else None
        if before_key is not None and not self._claim_pods[before_key]:
            del self._claim_pods[before_key]
        if old is not None and before_key != claim_key and old.get(unplaceable.UNSCHEDULABLE):
            self.wake(before_key or "")
        if raw is None or claim_key is None:
            return
        self._pod_claim_of[pod_key] = claim_key
        self._claim_pods[claim_key][pod_key] = raw

        def verdict(pod: Obj | None) -> tuple[Any, Any]:
            return (
                (None, None)
                if pod is None
                else (pod.get(unplaceable.UNSCHEDULABLE), (pod.get("spec") or {}).get("nodeName"))
            )

        if verdict(old) != verdict(raw) and (verdict(raw)[0] or verdict(old)[0]):
            self.wake(claim_key)

    def live_pods_of(self, claim_key: str) -> list[Obj]:
        """The live pods (as cached) that name claim ``claim_key``."""
        return list(self._claim_pods.get(claim_key, {}).values())

    def _count_load(self, pod_key: str, raw: Obj | None) -> None:
        """Keep the node sums true to a live pod's change: off its old node, onto its new one. A
        node whose pods asked less now wakes the pending claims that could fit there."""
        node = str(((raw or {}).get("spec") or {}).get("nodeName") or "")
        new = (node, gates.requests_of(raw or {})) if node else None
        old = self._pod_load.pop(pod_key, None)
        if new is not None:
            self._pod_load[pod_key] = new
        if old == new:
            return
        if old is not None:
            requests.add(self._node_requested.setdefault(old[0], {}), old[1], -1)
            if not self._node_requested[old[0]]:
                del self._node_requested[old[0]]
            self._stale.add(old[0])
            self._wake_for_node(old[0])
        if new is not None:
            requests.add(self._node_requested.setdefault(node, {}), new[1])
            self._stale.add(node)
            if old is None and gates.workload_pod(raw or {}):
                self.recent.observe_pod(new[1])  # bound just now, or first seen bound

    def _judge_pods_of(self, claim_key: str) -> None:
        for pod_key in sorted(self._pods_of_claim.get(claim_key, ())):
            self._judge_pod(pod_key)

    def _judge_pod(self, pod_key: str) -> None:
        """Which devices a live pod holds alone: those it was given that its claim (the claim of
        its name in the cache now, whatever its phase) does not list. A gated pod uses none yet."""
        claim_key, uuids = self._pod_uses.get(pod_key, ("", frozenset()))
        alone = uuids - self._claim_uuids.get(claim_key, frozenset())
        before = self._pod_alone.pop(pod_key, frozenset())
        if alone:
            self._pod_alone[pod_key] = alone
        for uuid in before - alone:
            self._held_by_pods[uuid].discard(pod_key)
            if not self._held_by_pods[uuid]:
                del self._held_by_pods[uuid]
        for uuid in alone - before:
            self._held_by_pods[uuid].add(pod_key)
        self._mark_device_nodes(before ^ alone)
        self._wake_for_devices(before - alone)  # devices a pod held alone are free now

    def held_by_pods_alone(self, uuid: str) -> list[str]:
        """The live pods (``namespace/name``) that were given device ``uuid`` and whose claim does
        not list it (gone, re-created, or moved on): they hold it until they end."""
        return sorted(self._held_by_pods.get(uuid, ()))

    def _on_quota(self, type_: str, raw: Obj) -> None:
        """Index the quota; when it may admit more than before, wake its namespace's pending claims."""
        namespace = str(_meta(raw).get("namespace", ""))
        key = watching.object_key(raw)
        limit_before = waking.max_claims(self.quotas(namespace))
        held = self._quotas[namespace]
        old = held.pop(key, None)
        quota: models.GpuQuota | None = None
        if type_ != watching.DELETED:
            try:
                quota = codecs.parse_quota(raw)
            except codecs.DecodeError as exc:
                log.error("unreadable GpuQuota skipped", extra={"quota": key, "error": str(exc)})
            else:
                held[key] = quota
        if not held:
            del self._quotas[namespace]
        more_room = (
            old is None
            or quota is None
            or quota.spec != old.spec
            or any(uid not in quota.status.claims for uid in old.status.claims)
        )
        self._limit_changed(namespace, limit_before, waking.max_claims(self.quotas(namespace)))
        if more_room:
            for claim_key in self._waitlist.in_namespace(namespace):
                self._wake_claim(claim_key)

    def refresh_readiness(self) -> None:
        """Nodes whose heartbeat went stale or fresh since the last look are changed nodes
        (``node_changed``)."""
        ready = {node: self.node_ready(node) for node in self.statuses}
        if ready != self.ready_nodes:
            changed = sorted(
                n for n in ready.keys() | self.ready_nodes.keys() if ready.get(n) != self.ready_nodes.get(n)
            )
            self.ready_nodes = ready
            for node in changed:
                self.node_changed(node)

    # ------------------------------------------------------------------ waking (``waking``)

    def fits_nowhere(self, claim: models.GpuClaim) -> bool:
        """No node could hold one replica of the claim even with nothing taken (``waking``)."""
        need = waking.need_of(claim)
        fits = self._fits.get(need)
        if fits is None:
            if len(self._fits) >= FITS_KEPT:
                self._fits.clear()
            fits = self._fits[need] = any(cap.fits(need, node) for node, cap in self._capacity.items())
        return not fits

    def too_many_claims(self, claim: models.GpuClaim) -> str | None:
        """Why the claim is not considered for allocation (reason ``TooManyClaims``): it is among
        its namespace's claims beyond ``GpuQuota.spec.maxClaims``, the newest first; else None."""
        namespace = claim.metadata.namespace
        limit = waking.max_claims(self.quotas(namespace))
        if limit is None or self._ranks.rank(claim.key) < limit[0]:
            return None
        return waking.too_many_message(namespace, limit[1], limit[0], self._ranks.count(namespace))

    def _over_limit(self, key: str) -> bool:
        limit = waking.max_claims(self.quotas(key.partition("/")[0]))
        return limit is not None and self._ranks.rank(key) >= limit[0]

    def _list_pending(self, key: str) -> bool:
        """Put the claim on the wait list if it is Pending and inside its namespace's count limit,
        else take it off; whether it is on it."""
        claim = self.claim(key) if key in self.pending else None
        if claim is None or self._over_limit(key):
            self._waitlist.discard(key)
            return False
        self._waitlist.add(key, waking.need_of(claim))
        return True

    def _claim_placed(self, key: str, creation_timestamp: str) -> None:
        """A claim was seen (new or changed): its rank in its namespace and its place on the wait list.
        A new claim older than the limit's last pushes that one out."""
        namespace = key.partition("/")[0]
        new = key not in self._ranks
        rank = self._ranks.put(key, creation_timestamp)
        limit = waking.max_claims(self.quotas(namespace))
        if new and limit is not None and rank < limit[0]:
            for pushed in self._ranks.keys(namespace, limit[0], limit[0] + 1):
                self._list_pending(pushed)
        self._list_pending(key)

    def _claim_gone(self, key: str) -> None:
        """A claim was deleted: the next claim of its namespace may come inside the count limit."""
        self._waitlist.discard(key)
        namespace = key.partition("/")[0]
        rank = self._ranks.remove(key)
        limit = waking.max_claims(self.quotas(namespace))
        if rank is not None and limit is not None and rank < limit[0]:
            for entered in self._ranks.keys(namespace, limit[0] - 1, limit[0]):
                if self._list_pending(entered):
                    self.wake(entered)

    def _limit_changed(
        self, namespace: str, before: tuple[int, str] | None, after: tuple[int, str] | None
    ) -> None:
        """The namespace's count limit moved: the claims between the two limits come in (and are
        woken) or go out."""
        count = self._ranks.count(namespace)
        old = count if before is None else min(before[0], count)
        new = count if after is None else min(after[0], count)
        for key in self._ranks.keys(namespace, min(old, new), max(old, new)):
            if self._list_pending(key) and new > old:
                self.wake(key)

    def _wake_for_node(self, node: str) -> None:
        """Wake the listed pending claims one replica of which could fit on ``node`` if it were empty."""
        if not node:
            return
        for key in list(self._waitlist.helped_by(node, self._capacity.get(node, waking.NO_CAPACITY))):
            self.wake(key)

    def _wake_for_devices(self, lock_ids: Iterable[str]) -> None:
        """Devices (lock ids) were given back: wake for the nodes they are on."""
        for node in sorted({self._device_node.get(lock_id, "") for lock_id in lock_ids}):
            self._wake_for_node(node)
