"""The controller's one writer: every write to a claim, a quota's ledger, a device Lease or a pod,
and the cache update that follows it.

A write's answer is entered in the caches in the same call (``State.remember``,
``State.forget_lease``), so the next plan, made before the watch event arrives,
sees it: kueue's assume-then-patch. Nobody else updates a cache after a write.

A claim write whose precondition failed (Conflict: someone wrote the claim
since) has the claim looked at again shortly, through the ``requeue`` callback
its owner passes in; the writer never imports a reconciler. Events about
claims are emitted here too, with the claim as cached.
"""

from __future__ import annotations

import datetime
import logging
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from controller import cluster as kube
from controller import locking, locks
from controller.state import State
from gpualloc.api import codecs, constants, leases, models
from gpualloc.kube import errors, watching

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Emit = Callable[[Obj, str, str, str], None]


class Writer:
    def __init__(
        self,
        cluster: kube.Cluster,
        state: State,
        *,
        emit: Emit,
        requeue: Callable[[str, float], None],
        rng: random.Random,
    ) -> None:
        self.cluster = cluster
        self.state = state
        self.emit = emit  # an Event about an object (the pod or claim as read)
        self.requeue = requeue  # look at a claim key again after so many seconds
        self.rng = rng

    def retry_soon(self, key: str) -> None:
        """Look at a claim again shortly: a write of ours met another's (a Conflict)."""
        self.requeue(key, 0.05 + 0.2 * self.rng.random())

    # ------------------------------------------------------------------ claims

    def _written(self, raw: Obj) -> models.GpuClaim:
        """Remember a claim one of our writes returned, and parse it (an authoritative view)."""
        raw.setdefault("apiVersion", constants.API_VERSION)
        raw.setdefault("kind", constants.CLAIM_KIND)
        self.state.remember("claims", raw, reconciling=watching.object_key(raw))
        return codecs.parse_claim(raw)

    async def claim_status(self, claim: models.GpuClaim, patch: Obj) -> models.GpuClaim | None:
        """Patch the status at the resourceVersion ``claim`` was read at; None when it moved on or is gone.

        On Conflict someone wrote the claim since: it is looked at again shortly.
        """
        meta = claim.metadata
        try:
            raw = await self.cluster.patch_claim_status(
                meta.namespace, meta.name, patch, resource_version=meta.resource_version
            )
        except errors.Conflict:
            self.retry_soon(claim.key)
            return None
        except errors.NotFound:
            return None
        return self._written(raw)

    async def claim_finalizers(self, claim: models.GpuClaim, finalizers: list[str]) -> models.GpuClaim:
        """Set the claim's finalizers at the resourceVersion it was read at (NotFound and Conflict
        propagate)."""
        meta = claim.metadata
        raw = await self.cluster.patch_claim_metadata(
            meta.namespace,
            meta.name,
            {"metadata": {"finalizers": finalizers}},
            resource_version=meta.resource_version,
        )
        return self._written(raw)

    def claim_event(self, claim: models.GpuClaim, reason: str, message: str, type_: str) -> None:
        """An Event about the claim as cached (none when it is no longer cached)."""
        self.emit(self.state.raw_claim(claim.key) or {}, reason, message, type_)

    # ------------------------------------------------------------------ quotas

    async def quota_status(self, quota: models.GpuQuota, patch: Obj, *, reconciling: str) -> bool:
        """Patch a quota's ledger at the resourceVersion it was read at; False when it changed
        meanwhile (the claim ``reconciling``, if any, is looked at again shortly)."""
        meta = quota.metadata
        try:
            raw = await self.cluster.patch_quota_status(
                meta.namespace, meta.name, patch, resource_version=meta.resource_version
            )
        except (errors.Conflict, errors.NotFound):
            if reconciling:
                self.retry_soon(reconciling)
            return False
        self.state.remember("quotas", raw, reconciling=reconciling)
        return True

    # ------------------------------------------------------------------ device Leases

    async def lock(
        self,
        namespace: str,
        plan: Sequence[locks.LockItem],
        claim: models.GpuClaim,
        *,
        now: datetime.datetime,
    ) -> locking.LockResult:
        """``locking.acquire``, the Leases it created remembered."""
        result = await locking.acquire(self.cluster, namespace, plan, claim, now=now)
        for raw in result.created.values():
            self.state.remember("leases", raw, reconciling=claim.key)
        return result

    async def lease(self, name: str, *, reconciling: str) -> leases.LeaseInfo:
        """Read a Lease from the API server and remember it (NotFound propagates)."""
        raw = await self.cluster.get_lease(name)
        self.state.remember("leases", raw, reconciling=reconciling)
        return leases.parse(raw)

    async def release(self, held: Iterable[leases.LeaseInfo]) -> list[leases.LeaseInfo]:
        """``locking.release``, the Leases now gone forgotten."""
        gone = await locking.release(self.cluster, held, self._ledger_written)
        for info in gone:
            if not info.milli:  # a ledger entry's Lease may stay: its PUTs were remembered
                self.state.forget_lease(info.name, info.uid)
        return gone

    def _ledger_written(self, raw: dict[str, Any]) -> None:
        self.state.remember("leases", raw, reconciling="")

    async def release_leftovers(
        self,
        claim: models.GpuClaim,
        leftovers: Iterable[leases.LeaseInfo],
        view: models.GpuClaim | None = None,
    ) -> None:
        """Release the leftovers (seen before ``view``) that no attempt can record any more
        (``locking``, rule 3). Those an attempt at this very version may still record are kept, and
        the claim is looked at again a little later.

        ``view`` is an authoritative read of the claim made after they were seen:
        the answer to our own write, or else a GET made here.
        """
        recorded = locks.recorded(claim)
        leftovers = [info for info in leftovers if info.name not in recorded]
        if not leftovers:
            return
        if view is None:
            try:
                raw = await self.cluster.get_claim(claim.metadata.namespace, claim.metadata.name)
            except errors.NotFound:
                return  # the sweep releases Leases of claims that are gone
            view = codecs.parse_claim(raw)
            if view.metadata.uid != claim.metadata.uid:
                return
        free = locks.releasable(leftovers, view)
        if free:
            released = await self.release(free)
            log.info("released leftover leases", extra={"claim": claim.key, "leases": len(released)})
        if len(free) < len(leftovers):
            self.requeue(claim.key, 1.0 + self.rng.random())  # an attempt at this very version may be alive

    # ------------------------------------------------------------------ pods

    async def pod(self, namespace: str, name: str, operations: Sequence[Mapping[str, Any]]) -> None:
        """A JSON patch of a pod (its own watch brings the change in)."""
        await self.cluster.patch_pod(namespace, name, operations)

    async def evict(self, namespace: str, name: str, *, uid: str = "") -> None:
        """Evict a pod through the Eviction API (its PodDisruptionBudgets hold)."""
        await self.cluster.evict_pod(namespace, name, uid=uid)
