"""The controller loop: caches, work queue, reconcile, sweep, gate mode.

Caches
    Reflectors (list -> watch -> re-list) keep GpuClaims (all namespaces),
    GpuNodeStatuses, Nodes, the device Leases (``managed-by=gpualloc`` in the
    controller's namespace) and Pods. Decisions are made from the caches; the
    only GET in a reconcile is the one ``locking`` makes when a Lease create
    meets ``AlreadyExists``, and the sweep's check of a claim before deleting
    Leases it seems to have left behind.

Reconciling a claim (``namespace/name`` keys, highest priority then oldest first)
    * being deleted: delete every Lease held by its UID, emit ``Released``,
      remove the finalizer ``gpu.scheduling/release-devices``;
    * otherwise add that finalizer first (before any Lease is taken);
    * Allocated: release Leases it holds beyond its status, re-create a
      recorded Lease that vanished (if nobody took it meanwhile), keep the
      ``DevicesLost`` condition true to the devices' state, and un-gate its
      gated pods;
    * Pending: build NodeViews from the caches, ``allocator.allocate``, lock
      the chosen devices (``locking.acquire``: Leases in UUID order, roll back
      on another holder, re-plan up to ``LOCK_ATTEMPTS`` times), then write the
      status with the cached resourceVersion, then release Leases it held
      beyond the new allocation. When nothing fits: Pending with the reason,
      ``AllocationFailed`` (at most once a minute per claim unless the reason
      changes), retry with backoff (``retryPolicy``), Failed after
      ``maxRetries`` retries. Freed capacity (a Lease deleted, a node or GPU
      changing) re-queues every pending claim at once.

Why a crash cannot double-book
    A device is held exactly when its Lease exists, and a status lists only
    devices whose Leases its claim created before the status was written, with
    the resourceVersion read before they were created. Leases a claim holds
    beyond its status are released only once that cannot change any more: after
    a status write this process made (which makes every older concurrent
    writer's ``Conflict``), or when the claim is Allocated, Failed or being
    deleted. Leases of claims that no longer exist (checked with a GET) are
    deleted by the sweep. So a controller killed anywhere leaves at worst
    Leases that are adopted by the next attempt (held by the same UID, they are
    free for it) or released by a later reconcile or the sweep.

Lost or unhealthy devices
    A running claim is never re-allocated automatically: its pods are bound to
    the node and see the devices. When a device of an Allocated claim turns
    Unhealthy or vanishes (device, GpuNodeStatus or Node gone), or its Lease is
    found held by another claim, the claim keeps its Leases, gets the condition
    ``DevicesLost`` (True, reason ``DeviceUnhealthy`` or ``DevicesMissing``)
    and a ``DeviceUnhealthy`` Warning event; the condition turns False again
    when the devices recover. To move, delete and re-create the claim.

Gate mode
    A pod with the scheduling gate ``gpu.scheduling/claim-allocated`` and the
    annotation ``gpu.scheduling/claim`` waits for its claim; once the claim is
    Allocated the pod gets the ``gpu.scheduling/devices`` annotation (its
    replica's UUIDs), a ``kubernetes.io/hostname`` nodeSelector, and loses the gate.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import datetime
import logging
import random
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

from controller import allocator, locking, planning
from controller import cluster as kube
from controller import metrics as controller_metrics
from controller import queue as work_queue
from gpualloc.api import codecs, constants, models, timestamps
from gpualloc.kube import errors, watching

log = logging.getLogger(__name__)

Obj = dict[str, Any]

LOCK_ATTEMPTS = 3  # plans tried per reconcile when another controller wins a device
EVENT_INTERVAL = 60.0  # AllocationFailed at most this often per claim, unless the reason changes
# The Warning on a gated pod the controller cannot release (no replica, a conflicting pin, a Failed
# or deleted claim); at most once per EVENT_INTERVAL per pod for the same message.
EVENT_STILL_GATED = "StillGated"
LEASE_GRACE = 10.0  # a recorded Lease missing from the cache this soon after allocation is cache lag
EXPECTATION_TIMEOUT = 10.0  # wait this long for our own write to reach the cache
ERROR_BACKOFF_BASE = 0.5
ERROR_BACKOFF_CAP = 60.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    namespace: str  # where the device Leases live
    workers: int = 4
    node_stale_after: float = planning.NODE_STALE_AFTER_S
    cost_label: str = constants.LABEL_COST_TIER
    sweep_interval: float = 30.0
    event_interval: float = EVENT_INTERVAL
    claim_selector: str = ""  # label selector: handle only these claims (shards, tests); "" = all


def _meta(raw: Obj) -> Obj:
    meta = raw.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


FEEDS = ("claims", "node_statuses", "nodes", "leases", "pods")


def reflectors(api: Any, settings: Settings) -> dict[str, watching.Reflector]:
    """The caches the controller keeps, by feed name, on a real API server."""
    return {
        "claims": watching.Reflector(api, watching.CLAIMS, label_selector=settings.claim_selector),
        "node_statuses": watching.Reflector(api, watching.NODE_STATUSES),
        "nodes": watching.Reflector(api, watching.NODES),
        "leases": watching.Reflector(
            api,
            watching.LEASES,
            namespace=settings.namespace,
            label_selector=f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}",
        ),
        # Only the pods the webhook gated (it labels them), never every pod in the cluster.
        "pods": watching.Reflector(api, watching.PODS, label_selector=f"{constants.LABEL_GATED}=true"),
    }


class Controller:
    """All of the controller's state in one process; ``run_caches`` always, ``run_active`` when leading.

    ``cluster`` is every read and write it makes; ``feeds`` are its caches
    (``reflectors`` on a real API server, or the simulation's), by name in ``FEEDS``.
    """

    def __init__(
        self,
        cluster: kube.Cluster,
        settings: Settings,
        metrics: controller_metrics.Metrics | None = None,
        *,
        rng: random.Random | None = None,
        feeds: Mapping[str, Any] | None = None,
    ) -> None:
        self.cluster = cluster
        self.settings = settings
        self.metrics = metrics or controller_metrics.Metrics()
        self._rng = rng or random.Random()
        if feeds is None:
            feeds = reflectors(getattr(cluster, "api"), settings)  # noqa: B009
        self.claims = feeds["claims"]
        self.node_statuses = feeds["node_statuses"]
        self.nodes = feeds["nodes"]
        self.leases = feeds["leases"]
        self.pods = feeds["pods"]
        self.claims.on_event = self._on_claim
        self.node_statuses.on_event = self._on_node_status
        self.nodes.on_event = self._on_node
        self.leases.on_event = self._on_lease
        self.pods.on_event = self._on_pod
        self.reflectors = (self.claims, self.node_statuses, self.nodes, self.leases, self.pods)
        self.queue = work_queue.WorkQueue(order=self._order)
        self.overlay = locking.Overlay()
        # Indexes kept by the event handlers.
        self._uid_to_key: dict[str, str] = {}
        self._pending: set[str] = set()
        self._allocated_on: dict[str, set[str]] = collections.defaultdict(set)  # node -> claim keys
        self._claim_nodes: dict[str, frozenset[str]] = {}
        self._statuses: dict[str, models.GpuNodeStatus] = {}  # node name -> parsed
        self._status_node: dict[str, str] = {}  # GpuNodeStatus name -> node name
        self._fingerprints: dict[str, Any] = {}
        self._facts: dict[str, planning.NodeFacts] = {}
        self._lease_info: dict[str, planning.LeaseInfo] = {}  # lease name -> info
        self._held: dict[str, dict[str, str]] = collections.defaultdict(dict)  # holder -> name -> uid
        self._parsed: dict[str, tuple[str, models.GpuClaim | None]] = {}  # key -> (resourceVersion, model)
        self._pod_claim: dict[str, str] = {}
        self._pods_by_claim: dict[str, set[str]] = collections.defaultdict(set)
        # Per-claim memory.
        self._retry: dict[str, planning.RetryState] = {}
        self._failed_event: dict[str, tuple[str, float]] = {}
        self._pod_event: dict[str, tuple[str, float]] = {}
        self._expect: dict[str, tuple[str, float]] = {}
        self._errors: collections.Counter[str] = collections.Counter()
        self._ready_nodes: dict[str, bool] = {}
        self._rr_cursor = 0
        self._background: set[asyncio.Task[None]] = set()
        self.active = False
        self.sweeps = 0
        self.metrics.set_device_source(self.device_counts)
        self.metrics.set_pending_source(lambda: len(self._pending))

    # ------------------------------------------------------------------ running

    def synced(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors)

    async def run_caches(self) -> None:
        """Keep every cache until cancelled."""
        await watching.run_reflectors(*self.reflectors)

    async def wait_synced(self) -> None:
        for reflector in self.reflectors:
            await reflector.synced.wait()

    async def run_active(self) -> None:
        """Reconcile and sweep until cancelled (the leader's part). The caches must be running."""
        await self.wait_synced()
        self.active = True
        self.metrics.leader.set(1)
        try:
            try:
                await self.sweep()
            except errors.KubeError as exc:  # the periodic sweep tries again
                log.warning("startup sweep failed", extra={"error": str(exc)})
            for key in self.claims.cache:
                self.queue.add(key)
            async with asyncio.TaskGroup() as group:
                for i in range(max(1, self.settings.workers)):
                    group.create_task(self._worker(), name=f"reconcile-worker-{i}")
                group.create_task(self._sweep_loop(), name="sweep")
        finally:
            self.active = False
            self.metrics.leader.set(0)
            for task in list(self._background):
                task.cancel()
            for task in list(self._background):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            started = time.perf_counter()
            try:
                await self.reconcile(key)
                self._errors.pop(key, None)
            except asyncio.CancelledError:
                raise
            except errors.Conflict as exc:
                # Our cache was behind a write (another controller's, or the user's); its watch
                # event re-queues the key too. Not an error worth a backoff.
                log.debug("stale claim, retrying", extra={"claim": key, "error": str(exc)})
                self.queue.add_after(key, 0.05 + 0.2 * self._rng.random())
            except Exception as exc:
                self._errors[key] += 1
                delay = work_queue.backoff_delay(
                    self._errors[key],
                    base=ERROR_BACKOFF_BASE,
                    cap=ERROR_BACKOFF_CAP,
                    jitter=self._rng.random(),
                )
                if isinstance(exc, errors.KubeError):
                    log.warning(
                        "reconcile failed", extra={"claim": key, "error": str(exc), "retry_in": delay}
                    )
                else:
                    log.exception("reconcile crashed", extra={"claim": key, "retry_in": delay})
                self.queue.add_after(key, delay)
            finally:
                self.queue.done(key)
                self.metrics.reconcile_duration.observe(time.perf_counter() - started)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval)
            try:
                await self.sweep()
            except errors.KubeError as exc:
                log.warning("sweep failed", extra={"error": str(exc)})
            except Exception:
                log.exception("sweep crashed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _emit(self, obj: Obj, reason: str, message: str, type_: str = "Normal") -> None:
        """Record an Event without holding up the reconcile."""
        self._spawn(self.cluster.emit_event(obj, reason, message, type_))

    # ------------------------------------------------------------------ event handlers

    def _claim(self, key: str, raw: Obj) -> models.GpuClaim | None:
        """The cached claim as a model, parsed once per resourceVersion; None if unreadable."""
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

    def _order(self, key: str) -> tuple[Any, ...]:
        raw = self.claims.get(key)
        claim = None if raw is None else self._claim(key, raw)
        if claim is None:
            return (0, 0, "", "", key)
        deleting = 0 if claim.metadata.deletion_timestamp else 1  # releasing first frees capacity first
        return (deleting, *allocator.order_key(claim))

    def _on_claim(self, type_: str, raw: Obj) -> None:
        key = watching.object_key(raw)
        meta = _meta(raw)
        uid = str(meta.get("uid", ""))
        for node in self._claim_nodes.pop(key, frozenset()):
            self._allocated_on[node].discard(key)
        if type_ == watching.DELETED:
            self._parsed.pop(key, None)
            self._pending.discard(key)
            if self._uid_to_key.get(uid) == key:
                del self._uid_to_key[uid]
            self._retry.pop(key, None)
            self._failed_event.pop(key, None)
            self._expect.pop(key, None)
            self.queue.forget(key)
            return
        self._uid_to_key[uid] = key
        status = raw.get("status") or {}
        phase = status.get("phase") or constants.PHASE_PENDING
        if meta.get("deletionTimestamp") or phase in (constants.PHASE_ALLOCATED, constants.PHASE_FAILED):
            self._pending.discard(key)
        else:
            self._pending.add(key)
        nodes = frozenset(
            str(a.get("nodeName", "")) for a in status.get("allocations") or [] if isinstance(a, dict)
        )
        if nodes:
            self._claim_nodes[key] = nodes
            for node in nodes:
                self._allocated_on[node].add(key)
        expected = self._expect.get(key)
        if expected is not None and expected[0] == watching.resource_version_of(raw):
            del self._expect[key]
        self.queue.add(key)

    def _on_lease(self, type_: str, raw: Obj) -> None:
        info = planning.lease_info(raw)
        old = self._lease_info.pop(info.name, None)
        if old is not None:
            held = self._held.get(old.holder)
            if held is not None:
                held.pop(old.name, None)
                if not held:
                    del self._held[old.holder]
        if type_ == watching.DELETED:
            self.enqueue_pending()  # capacity freed
            key = self._uid_to_key.get(info.holder)
            if key is not None:
                self.queue.add(key)  # an Allocated claim may have lost a recorded Lease
            return
        self._lease_info[info.name] = info
        self._held[info.holder][info.name] = info.uid
        self.overlay.observed(info.name, info.holder, info.uid)

    def _on_node_status(self, type_: str, raw: Obj) -> None:
        name = str(_meta(raw).get("name", ""))
        node = self._status_node.pop(name, None)
        if node is not None:
            self._statuses.pop(node, None)
        if type_ != watching.DELETED:
            try:
                parsed = codecs.parse_node_status(raw)
            except codecs.DecodeError as exc:
                log.warning("unreadable GpuNodeStatus ignored", extra={"node": name, "error": str(exc)})
                parsed = None
            if parsed is not None:
                node = parsed.spec.node_name or name
                self._statuses[node] = parsed
                self._status_node[name] = node
        node = node or name
        status = self._statuses.get(node)
        fingerprint = None
        if status is not None:
            inv = status.status
            fingerprint = (
                tuple((d.uuid, d.health, d.index) for d in inv.devices),
                inv.links,
                self._is_ready(inv),
            )
        if self._fingerprints.get(node) != fingerprint:
            self._fingerprints[node] = fingerprint
            self._node_changed(node)

    def _on_node(self, type_: str, raw: Obj) -> None:
        facts = planning.node_facts(raw)
        old = self._facts.pop(facts.name, None)
        if type_ != watching.DELETED:
            self._facts[facts.name] = facts
        if old != self._facts.get(facts.name):
            self._node_changed(facts.name)

    def _node_changed(self, node: str) -> None:
        self.enqueue_pending()
        for key in self._allocated_on.get(node, ()):
            self.queue.add(key)

    def _on_pod(self, type_: str, raw: Obj) -> None:
        key = watching.object_key(raw)
        old = self._pod_claim.pop(key, None)
        if old is not None:
            self._pods_by_claim[old].discard(key)
            if not self._pods_by_claim[old]:
                del self._pods_by_claim[old]
        if type_ == watching.DELETED:
            self._pod_event.pop(key, None)
            return
        if not planning.is_gated(raw):
            return
        claim_key = planning.pod_claim(raw)
        if claim_key is None:
            return
        self._pod_claim[key] = claim_key
        self._pods_by_claim[claim_key].add(key)
        self.queue.add(claim_key)

    def enqueue_pending(self) -> None:
        for key in self._pending:
            self.queue.add(key)

    # ------------------------------------------------------------------ views of the caches

    def _is_ready(self, inventory: models.NodeInventory) -> bool:
        return planning.node_ready(inventory, now=_now(), stale_after=self.settings.node_stale_after)

    def held_by(self, uid: str) -> dict[str, str]:
        """Lease name -> Lease uid of every Lease ``uid`` holds, as far as this process knows."""
        held = dict(self.overlay.held_by(uid))
        held.update(self._held.get(uid, {}))
        return held

    async def _release(self, held: Mapping[str, str], uid: str) -> int:
        """Delete the Leases ``held`` (name -> Lease uid) that ``uid`` holds; the number deleted."""
        return await locking.release(self.cluster, held, self.overlay, holder=uid)

    def _devices_lost(self, claim: models.GpuClaim, lost: Sequence[str] = ()) -> models.Condition | None:
        """The DevicesLost condition an Allocated claim needs written, or None (``planning``)."""
        problems = planning.allocation_problems(
            claim.status.allocations, statuses=self._statuses, nodes=self._facts
        )
        return planning.devices_lost_condition(claim, problems, lost_leases=lost, now=_now())

    def node_views(self, claim_uid: str) -> list[allocator.NodeView]:
        leases = self._lease_info
        overlay = self.overlay.holders()

        def is_taken(name: str) -> bool:
            """The cache or the overlay knows ``name`` held by anyone but ``claim_uid``."""
            info = leases.get(name)
            if info is not None and info.holder != claim_uid:
                return True
            holder = overlay.get(name)
            return holder is not None and holder != claim_uid

        return planning.build_node_views(
            statuses=self._statuses,
            nodes=self._facts,
            is_taken=is_taken,
            now=_now(),
            stale_after=self.settings.node_stale_after,
        )

    def device_counts(self) -> Iterable[tuple[str, str, int]]:
        """(node, state, count) for ``gpualloc_devices``."""
        leased = set(self._lease_info)
        for node, status in sorted(self._statuses.items()):
            counts = dict.fromkeys(controller_metrics.DEVICE_STATES, 0)
            for device in status.status.devices:
                if constants.lease_name(device.uuid) in leased:
                    counts["allocated"] += 1
                elif device.health != constants.HEALTHY:
                    counts["unhealthy"] += 1
                else:
                    counts["free"] += 1
            for state, count in counts.items():
                yield node, state, count

    # ------------------------------------------------------------------ reconcile

    async def reconcile(self, key: str) -> None:
        raw = self.claims.get(key)
        if raw is None:
            return
        expected = self._expect.get(key)
        if expected is not None:
            remaining = expected[1] - time.monotonic()
            if remaining > 0:
                # Our own last write has not reached the cache yet; its event re-queues the key.
                self.queue.add_after(key, remaining)
                return
            del self._expect[key]
        claim = self._claim(key, raw)
        if claim is None:
            return
        if claim.metadata.deletion_timestamp:
            await self._finalize(claim, raw)
            return
        if constants.FINALIZER not in claim.metadata.finalizers:
            raw = await self._add_finalizer(claim, raw)
            claim = self._claim(key, raw)  # parsed once: the watch event of this write hits the cache
            if claim is None:
                return
        if planning.allocation_complete(claim):
            if await self._maintain(claim, raw):
                await self._ungate(claim)
            return
        if claim.status.phase == constants.PHASE_FAILED and (
            claim.status.observed_generation >= claim.metadata.generation
        ):
            held = self.held_by(claim.metadata.uid)
            if held:  # a Failed status is final: nothing it holds can be recorded any more
                await self._release(held, claim.metadata.uid)
            self._warn_gated(
                claim,
                f"claim {claim.metadata.name} is Failed ({claim.status.message or 'no message'}); "
                "the pod stays gated: delete it, or delete and re-create the claim",
            )
            return
        await self._allocate(claim, raw)

    def _expect_write(self, key: str, written: Obj) -> None:
        rv = watching.resource_version_of(written)
        cached = self.claims.get(key)
        if cached is not None and watching.resource_version_of(cached) == rv:
            return
        self._expect[key] = (rv, time.monotonic() + EXPECTATION_TIMEOUT)

    async def _add_finalizer(self, claim: models.GpuClaim, raw: Obj) -> Obj:
        finalizers = [*claim.metadata.finalizers, constants.FINALIZER]
        written = await self._patch_finalizers(claim, finalizers)
        written.setdefault("apiVersion", raw.get("apiVersion", constants.API_VERSION))
        written.setdefault("kind", raw.get("kind", constants.CLAIM_KIND))
        self._expect_write(claim.key, written)
        return written

    async def _patch_finalizers(self, claim: models.GpuClaim, finalizers: list[str]) -> Obj:
        """Set the claim's finalizers, only if it is still the version the cache saw (else Conflict)."""
        meta = claim.metadata
        body = {"metadata": {"finalizers": finalizers}}
        return await self.cluster.patch_claim_metadata(
            meta.namespace, meta.name, body, resource_version=meta.resource_version
        )

    async def _finalize(self, claim: models.GpuClaim, raw: Obj) -> None:
        self._warn_gated(claim, f"claim {claim.metadata.name} is being deleted; the pod stays gated")
        uid = claim.metadata.uid
        held = self.held_by(uid)
        released = await self._release(held, uid)
        if constants.FINALIZER not in claim.metadata.finalizers:
            return
        if held or claim.status.allocations:
            count = sum(len(a.devices) for a in claim.status.allocations) or released
            self._emit(raw, "Released", f"released {count} GPU{'s' if count != 1 else ''}")
        finalizers = [f for f in claim.metadata.finalizers if f != constants.FINALIZER]
        with contextlib.suppress(errors.NotFound):
            await self._patch_finalizers(claim, finalizers)
        log.info("released", extra={"claim": claim.key, "leases": released})

    # ---------------------------------------------------------------- allocate

    async def _allocate(self, claim: models.GpuClaim, raw: Obj) -> None:
        key = claim.key
        uid = claim.metadata.uid
        state = self._retry.get(key)
        if state is None or state.generation != claim.metadata.generation:
            if state is not None:  # the spec changed: a fresh start
                state = planning.RetryState(generation=claim.metadata.generation)
            else:
                state = planning.initial_retry_state(claim)
            self._retry[key] = state
        result: locking.LockResult | None = None
        decision: allocator.Decision | None = None
        for _ in range(LOCK_ATTEMPTS):
            views = self.node_views(uid)
            decision = allocator.allocate(
                claim,
                views,
                seed=planning.seed_for(uid),
                round_robin_cursor=self._rr_cursor,
                cost_label=self.settings.cost_label,
            )
            if not decision.allocations:
                await self._unfit(claim, raw, decision.reason)
                return
            plan = planning.lock_plan(decision.allocations)
            names = [item.lease for item in plan]
            # Planning and this reservation happen without an await in between, so two workers
            # of this process never pick the same GPU; another process is stopped by the Lease itself.
            self.overlay.reserve(names, uid)
            try:
                result = await locking.acquire(
                    self.cluster, self.settings.namespace, plan, claim, self.overlay
                )
            finally:
                self.overlay.drop_reserved(names, uid)
            if result.ok:
                self._advance_cursor(views, decision.allocations)
                break
            self.metrics.allocation_failures.labels(reason="LockConflict").inc()
        if result is None or decision is None or not result.ok:
            self.queue.add_after(key, 0.2 + self._rng.random())
            return
        now = _now()
        patch = planning.allocated_status(claim, decision.allocations, now=now)
        written = await self._write_status(claim, patch)
        if written is None:
            return
        extras = {n: u for n, u in self.held_by(uid).items() if n not in result.held}
        if extras:
            await self._release(extras, uid)
        self._retry.pop(key, None)
        self._failed_event.pop(key, None)
        self.metrics.claims_allocated.labels(strategy=claim.spec.strategy).inc()
        created = timestamps.parse_time(claim.metadata.creation_timestamp)
        if created is not None:
            self.metrics.time_to_allocated.observe(max(0.0, (now - created).total_seconds()))
        status = patch["status"]
        log.info(
            "allocated",
            extra={"claim": key, "nodes": status["nodes"], "devices": status["devices"], "uid": uid},
        )
        written.setdefault("apiVersion", constants.API_VERSION)
        written.setdefault("kind", constants.CLAIM_KIND)
        self._emit(written, "Allocated", f"{status['message']}: devices {status['devices']}")
        again = self._claim(key, written)
        if again is not None:
            await self._ungate(again)

    async def _write_status(self, claim: models.GpuClaim, patch: Obj) -> Obj | None:
        """Patch the claim's status at the resourceVersion our cache saw; None when it moved on.

        On Conflict someone wrote the claim since the cache saw it: the claim is retried
        shortly, and any Leases stay held by its UID for the next attempt to adopt or release
        once the status is settled. On NotFound the claim is gone.
        """
        try:
            written = await self.cluster.patch_claim_status(
                claim.metadata.namespace,
                claim.metadata.name,
                patch,
                resource_version=claim.metadata.resource_version,
            )
        except errors.Conflict:
            self.queue.add_after(claim.key, 0.05)
            return None
        except errors.NotFound:
            return None
        self._expect_write(claim.key, written)
        return written

    def _advance_cursor(
        self, views: list[allocator.NodeView], allocations: Iterable[models.Allocation]
    ) -> None:
        names = [v.name for v in views]
        last = list(allocations)[-1].node_name
        if last in names:
            self._rr_cursor = names.index(last) + 1

    async def _unfit(self, claim: models.GpuClaim, raw: Obj, reason: str) -> None:
        key = claim.key
        uid = claim.metadata.uid
        policy = claim.spec.retry_policy
        held = self.held_by(uid)  # taken before the status write: see the module docstring
        mono = time.monotonic()
        state, counted = planning.record_failure(
            self._retry[key], now=mono, policy=policy, jitter=self._rng.random()
        )
        self._retry[key] = state
        exhausted = planning.retries_exhausted(state, policy)
        if exhausted:
            phase, cond_reason = constants.PHASE_FAILED, planning.REASON_RETRIES_EXHAUSTED
            message = f"{reason} (gave up after {state.retry_count} retries)"
        else:
            phase, cond_reason = constants.PHASE_PENDING, planning.REASON_INSUFFICIENT
            message = reason
        patch = planning.unallocated_status(
            claim, phase=phase, reason=cond_reason, message=message, retry_count=state.retry_count, now=_now()
        )
        current = next((c for c in claim.status.conditions if c.type == constants.CONDITION_ALLOCATED), None)
        must_write = (
            counted
            or claim.status.phase != phase
            or current is None
            or current.reason != cond_reason
            or claim.status.observed_generation != claim.metadata.generation
        )
        if must_write and planning.status_differs(claim, patch):
            written = await self._write_status(claim, patch)
            if written is None:
                return
            bumped = watching.resource_version_of(written) != claim.metadata.resource_version
            if held and bumped:
                await self._release(held, uid)
        if counted and not exhausted:
            self.metrics.allocation_retries.inc()  # one more retry scheduled with backoff
        if counted:
            self.metrics.allocation_failures.labels(reason=cond_reason).inc()
            last = self._failed_event.get(key)
            if last is None or last[0] != message or mono - last[1] >= self.settings.event_interval:
                self._failed_event[key] = (message, mono)
                self._emit(raw, "AllocationFailed", message, "Warning")
            log.info("not allocated", extra={"claim": key, "reason": message, "retry": state.retry_count})
        if not exhausted:
            self.queue.add_after(key, max(0.0, state.not_before - mono))

    # ---------------------------------------------------------------- allocated claims

    async def _maintain(self, claim: models.GpuClaim, raw: Obj) -> bool:
        """Keep an Allocated claim's locks and its DevicesLost condition true; False when its
        status write did not land (the claim moved on or is gone) and the caller should stop."""
        uid = claim.metadata.uid
        recorded = planning.recorded_leases(claim.status)
        held = self.held_by(uid)
        extras = {n: u for n, u in held.items() if n not in recorded}
        if extras:  # the allocation is final: anything else it holds is left from a lost race or a crash
            await self._release(extras, uid)
        lost: list[str] = []
        missing = sorted(recorded - held.keys())
        if missing:
            scheduled = timestamps.parse_time(claim.status.last_schedule_time)
            age = (_now() - scheduled).total_seconds() if scheduled else LEASE_GRACE
            if age < LEASE_GRACE:
                self.queue.add_after(claim.key, LEASE_GRACE - age)
            else:
                lost = await self._relock(claim, missing)
        condition = self._devices_lost(claim, lost)
        if condition is None:
            return True
        if await self._write_status(claim, planning.condition_patch(claim, condition)) is None:
            return False
        if condition.status == "True":
            log.warning("devices lost", extra={"claim": claim.key, "reason": condition.message})
            self._emit(raw, "DeviceUnhealthy", condition.message, "Warning")
        else:
            log.info("devices recovered", extra={"claim": claim.key})
        return True

    async def _relock(self, claim: models.GpuClaim, missing: list[str]) -> list[str]:
        """Re-create recorded Leases that vanished; the names now held by someone else."""
        wanted = set(missing)
        plan = [item for item in planning.lock_plan(claim.status.allocations) if item.lease in wanted]
        lost: list[str] = []
        for item in plan:
            result = await locking.acquire(self.cluster, self.settings.namespace, [item], claim, self.overlay)
            if not result.ok:
                lost.append(item.lease)
            else:
                log.warning(
                    "re-created a vanished device lease", extra={"claim": claim.key, "lease": item.lease}
                )
        return lost

    # ---------------------------------------------------------------- gate mode

    async def _ungate(self, claim: models.GpuClaim) -> None:
        for pod_key in sorted(self._pods_by_claim.get(claim.key, ())):
            pod = self.pods.get(pod_key)
            if pod is None or not planning.is_gated(pod):
                continue
            allocation, why = planning.pod_allocation(pod, claim)
            if allocation is None:
                self._pod_warning(pod_key, pod, why)
                continue
            conflict = planning.placement_conflict(pod, claim, allocation)
            if conflict is not None:
                self._pod_warning(pod_key, pod, conflict)
                continue
            meta = _meta(pod)
            try:
                await self.cluster.patch_pod(
                    str(meta.get("namespace", "")),
                    str(meta.get("name", "")),
                    planning.ungate_patch(pod, allocation),
                )
            except errors.NotFound:
                continue
            except (errors.Invalid, errors.BadRequest, errors.Conflict) as exc:
                # The gates changed under us (the patch's test failed): try again with a fresh cache.
                log.info("pod changed while un-gating, retrying", extra={"pod": pod_key, "error": str(exc)})
                self.queue.add_after(claim.key, 1.0)
                continue
            log.info(
                "pod un-gated",
                extra={
                    "pod": pod_key,
                    "claim": claim.key,
                    "node": allocation.node_name,
                    "replica": allocation.replica,
                },
            )

    def _warn_gated(self, claim: models.GpuClaim, message: str) -> None:
        """A Warning event on each pod still gated for a claim that will not release it."""
        for pod_key in sorted(self._pods_by_claim.get(claim.key, ())):
            pod = self.pods.get(pod_key)
            if pod is not None and planning.is_gated(pod):
                self._pod_warning(pod_key, pod, message)  # events.emit cuts it to 1024

    def _pod_warning(self, pod_key: str, pod: Obj, message: str) -> None:
        mono = time.monotonic()
        last = self._pod_event.get(pod_key)
        if last is not None and last[0] == message and mono - last[1] < self.settings.event_interval:
            return
        self._pod_event[pod_key] = (message, mono)
        log.warning("gated pod cannot be released", extra={"pod": pod_key, "reason": message})
        self._emit(pod, EVENT_STILL_GATED, message, "Warning")

    # ---------------------------------------------------------------- sweep

    async def sweep(self) -> None:
        """Delete Leases of vanished claims; re-queue claims whose Leases, devices or nodes changed."""
        if not self.synced():
            return
        self.sweeps += 1
        self.overlay.expire()
        # The holder index with each Lease's cached info, copied: the loop awaits.
        by_holder = {holder: [self._lease_info[n] for n in names] for holder, names in self._held.items()}
        orphans = 0
        for holder, infos in sorted(by_holder.items()):
            if holder in self._uid_to_key or await self._claim_exists(holder, infos):
                continue
            orphans += await self._release({i.name: i.uid for i in infos}, holder)
        if orphans:
            log.info("released leases of vanished claims", extra={"leases": orphans})
        # Claims holding Leases their status does not explain, and Allocated claims whose devices changed.
        for key, raw in list(self.claims.cache.items()):
            uid = str(_meta(raw).get("uid", ""))
            if self._needs_attention(key, raw, set(self._held.get(uid, {}))):
                self.queue.add(key)
        # Nodes whose heartbeat went stale or fresh since the last sweep.
        ready = {node: self._is_ready(s.status) for node, s in self._statuses.items()}
        if ready != self._ready_nodes:
            self._ready_nodes = ready
            self.enqueue_pending()

    def _needs_attention(self, key: str, raw: Obj, held: set[str]) -> bool:
        claim = self._claim(key, raw)
        if claim is None:
            return False
        if claim.metadata.deletion_timestamp or claim.status.phase != constants.PHASE_ALLOCATED:
            return bool(held)  # a reconcile adopts or releases them
        if planning.recorded_leases(claim.status) != held:
            return True
        return self._devices_lost(claim) is not None

    async def _claim_exists(self, uid: str, infos: list[planning.LeaseInfo]) -> bool:
        """Ask the API server (not the cache) whether the claim holding these Leases still exists."""
        named = next((i for i in infos if i.claim_namespace and i.claim_name), None)
        if named is None:
            return False  # a managed Lease naming no claim is nobody's
        try:
            raw = await self.cluster.get_claim(named.claim_namespace, named.claim_name)
        except errors.NotFound:
            return False
        return str(_meta(raw).get("uid", "")) == uid


def make_ready_check(controller: Controller, lost: Callable[[], bool] = lambda: False) -> Callable[[], bool]:
    """Ready when the caches have synced and this process is leader or a healthy standby."""
    return lambda: controller.synced() and not lost()
