"""The controller process's parts, put together: caches, work queue, workers, sweep.

``Controller`` owns the ``State`` (caches and indexes), the work queue, the
``Reconciler`` (one claim at a time per key), the ``PodGate`` and the
``Sweeper``, and talks to Kubernetes only through a ``cluster.Cluster``.
``run_caches`` keeps the caches (always, leader or not); ``run_active``
reconciles and sweeps while this process leads. The deterministic simulation
builds the same object on an in-memory API server and drives ``reconcile``
and ``sweep`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import random
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from controller import allocator, dra, labelling, quotas
from controller import cluster as kube
from controller import metrics as controller_metrics
from controller import queue as work_queue
from controller import usage as gpu_seconds
from controller.gating import PodGate
from controller.ledger import Ledger
from controller.reconciling import Reconciler
from controller.settings import Settings
from controller.state import Feed, State, reflectors
from controller.sweeping import Sweeper
from controller.workers import Workers
from controller.writer import Writer
from gpualloc import usage
from gpualloc.api import leases
from gpualloc.kube import errors, watching

log = logging.getLogger(__name__)

Obj = dict[str, Any]

# Events waiting for a connection (cluster.EVENT_CONNECTIONS) beyond this are dropped: a burst of
# allocations is not allowed to pile up tasks and memory for what is only a record.
MAX_PENDING_EVENTS = 1000


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Controller:
    """One controller process. ``feeds`` default to reflectors on ``cluster.api`` (a ``KubeCluster``)."""

    def __init__(
        self,
        cluster: kube.Cluster,
        settings: Settings,
        metrics: controller_metrics.Metrics | None = None,
        *,
        rng: random.Random | None = None,
        feeds: Mapping[str, Feed] | None = None,
        now: Callable[[], datetime.datetime] = _now,
    ) -> None:
        self.cluster = cluster
        self.settings = settings
        self.metrics = metrics or controller_metrics.Metrics()
        self.rng = rng or random.Random()
        self.queue = work_queue.WorkQueue(order=self._order)
        if feeds is None:
            feeds = reflectors(
                getattr(cluster, "api"),  # noqa: B009
                settings.namespace,
                settings.claim_selector,
                heartbeat_namespace=settings.heartbeat_namespace,
            )
        self.feeds = feeds
        self.state = State(
            feeds,
            lease_namespace=settings.namespace,
            node_stale_after=settings.node_stale_after,
            wake=self._wake,
            now=now,
            cost_label=settings.cost_label,
        )
        self.writer = Writer(cluster, self.state, emit=self._emit, requeue=self.queue.add_after, rng=self.rng)
        self.ledger = Ledger(cluster, self.state, self.writer)
        self.gate = PodGate(
            cluster,
            self.state,
            self.writer,
            requeue=self.queue.add_after,
            event_interval=settings.event_interval,
        )
        self.reconciler = Reconciler(
            cluster,
            self.state,
            self.writer,
            self.ledger,
            self.gate,
            settings,
            self.metrics,
            rng=self.rng,
            requeue=self.queue.add_after,
        )
        self.sweeper = Sweeper(cluster, self.state, self.gate, self.ledger, self.writer, wake=self.queue.add)
        # With --dra, the ResourceClaims mirror: a loop of its own, on the claim cache and its watch.
        self.dra: dra.Mirror | None = None
        self._dra_feed: watching.Reflector | None = None
        if settings.dra:
            if not isinstance(cluster, kube.KubeCluster):
                raise ValueError("the DRA mirror (--dra) runs on a real API server only")
            self._dra_feed = dra.reflector(cluster.api)
            self.dra = dra.Mirror(cluster, self.state, self._dra_feed, rng=self.rng)
        # With --label-free-gpus, the free-GPUs label on the GPU nodes: a loop of its own, on the caches.
        self.labeller: labelling.Labeller | None = None
        if settings.label_free_gpus:
            if not isinstance(cluster, kube.KubeCluster):
                raise ValueError("the free-GPUs label (--label-free-gpus) runs on a real API server only")
            self.labeller = labelling.Labeller(cluster, self.state, interval=settings.label_interval)
        self.workers = Workers(
            self.queue,
            self.reconcile,
            what="reconcile",
            rng=self.rng,
            observe=self.metrics.reconcile_duration.observe,
        )
        self._background: set[asyncio.Task[None]] = set()
        self._pending_events = 0
        self.active = False
        self.metrics.set_device_source(self.state.device_counts)
        self.metrics.set_quota_source(self.state.quota_figures)
        self.metrics.set_pending_source(lambda: len(self.state.pending))
        self.usage = gpu_seconds.Tally()
        self._count_releases(now)
        self.metrics.set_usage_source(lambda: self.usage.totals(self._holdings(), now()).items())

    def _holdings(self) -> list[usage.Holding]:
        kinds = usage.device_kinds(self.state.statuses.values())
        return usage.holdings(self.state.feeds["leases"].cache.values(), kinds)

    def _count_releases(self, now: Callable[[], datetime.datetime]) -> None:
        """Every device Lease seen DELETED is counted as released (``controller.usage``), then
        handed to the State."""
        feed = self.state.feeds["leases"]
        handler = feed.on_event

        def on_lease(type_: str, raw: Obj) -> None:
            if type_ == watching.DELETED:
                status = self.state.statuses.get(leases.parse(raw).node)
                held = usage.holding(raw, usage.device_kinds([status] if status is not None else []))
                if held is not None:
                    self.usage.release(held, now())
            if handler is not None:
                handler(type_, raw)

        feed.on_event = on_lease

    # ------------------------------------------------------------------ what the simulation drives

    async def reconcile(self, key: str) -> None:
        await self.reconciler.reconcile(key)

    async def sweep(self) -> None:
        await self.sweeper.sweep()

    @property
    def sweeps(self) -> int:
        return self.sweeper.sweeps

    # ------------------------------------------------------------------ running

    def synced(self) -> bool:
        return self.state.synced() and (self.dra is None or self.dra.synced())

    async def run_caches(self) -> None:
        """Keep every cache until cancelled (real API server only)."""
        extra = [self._dra_feed] if self._dra_feed is not None else []
        await watching.run_reflectors(*self.feeds.values(), *extra)

    async def run_active(self) -> None:
        """Reconcile and sweep until cancelled (the leader's part). The caches must be running."""
        await self.state.wait_synced()
        self.active = True
        self.metrics.leader.set(1)
        try:
            try:
                await self.sweep()
            except errors.KubeError as exc:  # the periodic sweep tries again
                log.warning("startup sweep failed", extra={"error": str(exc)})
            for key in self.state.claim_keys():
                self.queue.add(key)
            async with asyncio.TaskGroup() as group:
                for i in range(max(1, self.settings.workers)):
                    group.create_task(self.workers.run(), name=f"reconcile-worker-{i}")
                group.create_task(self._sweep_loop(), name="sweep")
                if self.dra is not None:
                    group.create_task(self.dra.run(), name="dra")
                if self.labeller is not None:
                    group.create_task(self.labeller.run(), name="labelling")
        finally:
            self.active = False
            self.metrics.leader.set(0)
            for task in list(self._background):
                task.cancel()
            for task in list(self._background):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _wake(self, key: str) -> None:
        if self.state.raw_claim(key) is None:  # deleted
            self.queue.forget(key)
            self.reconciler.forget(key)
            self.workers.forget(key)
            return
        self.queue.add(key)

    def _order(self, key: str) -> work_queue.Rank:
        """Claims being deleted first (releasing frees capacity first); then by priority (high
        first, capped by the namespace's quota), the namespaces taking turns within a priority,
        each namespace's oldest first; last, whatever the priority, the claims that cannot be
        allocated however the cluster's GPUs are used now: those that fit on no node even empty,
        and those over their namespace's ``maxClaims``."""
        claim = self.state.claim(key)
        if claim is None:
            return work_queue.Rank(band=(0, 0, 0), tenant=key.partition("/")[0], age=("", key))
        deleting = bool(claim.metadata.deletion_timestamp)
        cap = quotas.max_priority(self.state.quotas(claim.metadata.namespace))
        priority, *age = allocator.order_key(claim, priority_cap=cap)
        parked = (
            not deleting
            and key in self.state.pending
            and (self.state.fits_nowhere(claim) or self.state.too_many_claims(claim) is not None)
        )
        return work_queue.Rank(
            band=(0 if deleting else 1, int(parked), priority),
            tenant=claim.metadata.namespace,
            age=tuple(age),
        )

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
        """Record an Event without holding up the reconcile; dropped (and counted) when
        ``MAX_PENDING_EVENTS`` are already waiting to be sent, as client-go drops them."""
        if not obj:
            return
        if self._pending_events >= MAX_PENDING_EVENTS:
            self.metrics.events_dropped.inc()
            return
        self._pending_events += 1
        self._spawn(self._send_event(obj, reason, message, type_))

    async def _send_event(self, obj: Obj, reason: str, message: str, type_: str) -> None:
        try:
            await self.cluster.emit_event(obj, reason, message, type_)
        finally:
            self._pending_events -= 1


def make_ready_check(controller: Controller, lost: Callable[[], bool] = lambda: False) -> Callable[[], bool]:
    """Ready when the caches have synced and this process is leader or a healthy standby."""
    return lambda: controller.synced() and not lost()
