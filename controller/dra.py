"""The DRA mirror (``--dra``): each Allocated GpuClaim's ResourceClaims follow its status (issue 42).

A loop of its own beside the reconciler, which it never touches: it reads the claim cache
(``State``), keeps a cache of the ResourceClaims it wrote (a watch on ``resourceclaims.MANAGED``),
and has its own work queue, keyed by GpuClaim (``namespace/name``). Any event of a claim or of
one of its ResourceClaims queues the claim; a worker then computes ``resourceclaims.plan`` from
the two caches and makes its calls, one after the other. It writes nothing while the plan is
empty, which is the case for almost every claim event (a claim's status changes far more often
than its allocation).

The GpuClaim's Leases remain the lock; a ResourceClaim only tells kube-scheduler and the kubelet
what the claim already holds. It lags the claim by a watch event and a couple of writes:
normally milliseconds, well before the controller has checked the pods at the gate and lifted it
(``controller.gating``). A pod that reaches kube-scheduler first waits as unschedulable until the
ResourceClaim is there, and is tried again on its event.

Writes are counted by kind (``writes``), for the benchmark's cost per allocation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from controller import queue as work_queue
from controller import resourceclaims
from controller.state import Feed, State
from controller.workers import Workers
from gpualloc.api import timestamps
from gpualloc.kube import errors, watching
from gpualloc.kube.client import Api

log = logging.getLogger(__name__)

Obj = dict[str, Any]

RESOURCE_CLAIMS = watching.ResourceKind(
    group="resource.k8s.io", version="v1", plural="resourceclaims", kind="ResourceClaim", namespaced=True
)
WORKERS = 2


class ResourceClaims(Protocol):
    """The calls the mirror makes (``cluster.KubeCluster`` has them). Errors are ``gpualloc.kube.errors``."""

    async def create_resource_claim(self, namespace: str, body: Mapping[str, Any]) -> Obj: ...

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj: ...

    async def delete_resource_claim(self, namespace: str, name: str, *, uid: str) -> None: ...


def reflector(api: Api) -> watching.Reflector:
    """The cache of gpualloc's ResourceClaims, in every namespace."""
    return watching.Reflector(api, RESOURCE_CLAIMS, label_selector=resourceclaims.MANAGED)


def _rv(obj: Mapping[str, Any]) -> int:
    text = watching.resource_version_of(obj)
    return int(text) if text.isdigit() else 0


class Mirror:
    """Keeps every claim's ResourceClaims as ``resourceclaims.plan`` says, from ``state``'s claims and
    ``feed`` (``reflector``'s cache, or a test's)."""

    def __init__(
        self,
        cluster: ResourceClaims,
        state: State,
        feed: Feed,
        *,
        workers: int = WORKERS,
        rng: random.Random | None = None,
        now: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self.cluster = cluster
        self.now = now
        self.state = state
        self.feed = feed
        self.workers = workers
        self.rng = rng or random.Random()
        self.queue = work_queue.WorkQueue()
        self.writes: collections.Counter[str] = collections.Counter()  # create, status, clear, delete
        self._by_claim: dict[str, set[str]] = {}  # claim key -> its ResourceClaims' keys
        self._answers: dict[str, Obj] = {}  # our writes' answers the watch has not shown yet
        self._workers = Workers(
            self.queue,
            self.sync,
            what="resourceclaim sync",
            stale=(
                errors.Conflict,
                errors.AlreadyExists,
            ),  # our cache was behind (our write, or kube-scheduler's)
            rng=self.rng,
        )
        claims = state.feeds["claims"]
        handler = claims.on_event

        def on_claim(type_: str, raw: Obj) -> None:
            if handler is not None:
                handler(type_, raw)
            self.queue.add(watching.object_key(raw))

        claims.on_event = on_claim
        feed.on_event = self._on_resource_claim

    # ------------------------------------------------------------------ caches

    def _on_resource_claim(self, type_: str, raw: Obj) -> None:
        key, claim = watching.object_key(raw), resourceclaims.claim_key(raw)
        if not claim:
            return
        if type_ == watching.DELETED:
            self._answers.pop(key, None)
            keys = self._by_claim.get(claim)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_claim[claim]
        else:
            self._by_claim.setdefault(claim, set()).add(key)
            answer = self._answers.get(key)
            if answer is not None and _rv(raw) >= _rv(answer):
                del self._answers[key]
        self.queue.add(claim)

    def existing(self, claim_key: str) -> dict[str, Obj]:
        """The claim's ResourceClaims by name: the cached ones, or our later answers where the watch
        has not caught up with our own writes."""
        out: dict[str, Obj] = {}
        for key in self._by_claim.get(claim_key, ()):
            cached = self.feed.get(key)
            answer = self._answers.get(key)
            obj = answer if answer is not None and (cached is None or _rv(answer) > _rv(cached)) else cached
            if obj is not None:
                out[str(obj["metadata"]["name"])] = obj
        return out

    def synced(self) -> bool:
        return bool(self.feed.synced.is_set())

    # ------------------------------------------------------------------ one claim

    async def sync(self, key: str) -> None:
        """Carry out the plan of the claim ``namespace/name``."""
        namespace = key.partition("/")[0]
        claim = self.state.claim(key)
        if claim is None and self.state.raw_claim(key) is not None:
            return  # unreadable: the reconciler logs it; leave its ResourceClaims as they are
        latest = self.existing(key)
        for step in resourceclaims.plan(claim, latest):
            if isinstance(step, resourceclaims.Wait):
                log.debug("resourceclaim reserved, waiting", extra={"claim": key, "resourceclaim": step.name})
                continue
            if isinstance(step, resourceclaims.Create):
                name = str(step.body["metadata"]["name"])
                answer = await self.cluster.create_resource_claim(namespace, step.body)
                self.writes["create"] += 1
            elif isinstance(step, resourceclaims.Delete):
                name = step.name
                with contextlib.suppress(errors.NotFound):  # gone already (the garbage collector)
                    await self.cluster.delete_resource_claim(namespace, name, uid=step.uid)
                self.writes["delete"] += 1
                latest.pop(name, None)
                continue
            elif isinstance(step, resourceclaims.ClearAllocation):
                name = step.name
                patch: Obj = {"status": {"allocation": None}}
                answer = await self.cluster.patch_resource_claim_status(
                    namespace, name, patch, resource_version=step.resource_version
                )
                self.writes["clear"] += 1
            else:
                name = step.name
                stamp = timestamps.format_time(self.now())
                patch = {"status": {"allocation": resourceclaims.allocation_json(step.allocated, stamp)}}
                version = watching.resource_version_of(latest[name])
                answer = await self.cluster.patch_resource_claim_status(
                    namespace, name, patch, resource_version=version
                )
                self.writes["status"] += 1
            latest[name] = answer
            self._remember(answer)

    def _remember(self, answer: Obj) -> None:
        key = watching.object_key(answer)
        cached = self.feed.get(key)
        if cached is None or _rv(answer) > _rv(cached):
            self._answers[key] = watching.without_managed_fields(answer)
            claim = resourceclaims.claim_key(answer)
            if claim:
                self._by_claim.setdefault(claim, set()).add(key)

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Mirror every claim until cancelled (the leader's part). The caches must be synced."""
        await self.state.wait_synced()
        await self.feed.synced.wait()
        for key in {*self.state.claim_keys(), *self._by_claim}:
            self.queue.add(key)
        async with asyncio.TaskGroup() as group:
            for i in range(max(1, self.workers)):
                group.create_task(self._workers.run(), name=f"dra-worker-{i}")
