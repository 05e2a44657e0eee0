"""Device locks: one ``coordination.k8s.io/v1`` Lease per GPU, taken and let go through the API.

The rules below are the argument; the pure decisions that apply them (which Leases a plan takes,
which leftovers may go) are in ``locks``, and this module does the API calls.

Why no GPU is ever held by two claims
=====================================

1. **A Lease is created by exactly one allocation attempt.** Creating
   ``gpu-<uuid>`` is atomic in the API server; ``AlreadyExists`` means the
   device is taken, *whoever* holds it, the same claim included. An attempt
   never adopts a Lease it did not create: the claim UID names a claim, not an
   attempt, and two attempts of one claim (two controllers, a restarted one,
   overlapping leaders) would each believe such a Lease theirs, so one could
   roll back or release what the other is about to record. (That is how the
   old adoption rule double-booked a GPU in the race test.)

2. **A claim's status lists only devices whose Leases its own attempt
   created.** The attempt reads the claim at resourceVersion *R*, creates its
   Leases (in UUID order; on ``AlreadyExists`` it deletes what it created and
   gives up), stamping *R* on each (``gpu.scheduling/claim-resource-version``),
   and then writes the status **conditional on R**. At most one attempt per
   version can succeed, and an attempt whose write failed with a Conflict
   deletes the Leases it created at once: nobody else can be relying on them.

3. **A Lease its claim's status does not list (a leftover: a crash, a lost
   answer, an attempt that lost the race) is released only when its attempt
   can no longer record it**: when an authoritative view of the claim (the
   answer to one of our writes, or a GET), taken *after* the Lease was seen,
   shows a resourceVersion other than the Lease's *R* and does not list it
   (``releasable``). The attempt's write is conditional on *R* and versions
   only grow, so it has failed or will fail; or it succeeded, and a later
   write dropped the device on purpose. Leases of a claim that no longer
   exists (GET says NotFound, or another UID) are released by the sweep.

4. **A claim in use is not released**, and a claim being deleted releases
   only after its pods are gone (``reconciling``).

5. **A Lease deleted by hand does not unlock the device**: device Leases carry
   the finalizer ``gpu.scheduling/device-lock``, so a deletion only marks them,
   and the create of another claim still meets ``AlreadyExists``. Releasing is
   a delete with a uid precondition followed by removing the finalizer with a
   PUT, whose removal of the Lease is conditional on the uid too (never a
   PATCH: see ``_drop_finalizer``). And planning counts the devices every live
   claim's status lists as taken, whether or not their Leases exist.

A controller killed anywhere therefore leaves at worst leftover Leases, which
rule 3 or the sweep releases, and never a device listed by two claims.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Iterable
from typing import Any

from controller import cluster as kube
from controller.locks import LockItem
from gpualloc.api import leases, models
from gpualloc.kube import errors

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockResult:
    created: dict[str, dict[str, Any]]  # name -> the Lease as created: every one of the plan when ok
    conflict: str = ""  # the Lease name found taken, when not ok

    @property
    def ok(self) -> bool:
        return not self.conflict


async def acquire(
    cluster: kube.Cluster,
    namespace: str,
    plan: Iterable[LockItem],
    claim: models.GpuClaim,
    *,
    now: datetime.datetime,
) -> LockResult:
    """Create the Leases of ``plan`` (sorted by lock id) for this attempt at ``claim``'s version, all or none.

    On ``AlreadyExists`` the Leases this call created are deleted again and the
    taken name reported. Other API errors propagate after the same rollback; a
    create whose answer was lost may have left a Lease, which is a leftover.
    """
    meta = claim.metadata
    created: dict[str, dict[str, Any]] = {}
    try:
        for item in plan:
            body = leases.device_lease(
                namespace,
                lock_id=item.lock_id,
                node=item.node,
                claim_namespace=meta.namespace,
                claim_name=meta.name,
                claim_uid=meta.uid,
                claim_resource_version=meta.resource_version,
                now=now,
            )
            try:
                raw = await cluster.create_lease(body)
            except errors.AlreadyExists:
                log.info(
                    "device taken meanwhile, rolling back", extra={"claim": claim.key, "lease": item.lease}
                )
                await release_quietly(cluster, (leases.parse(c) for c in created.values()))
                return LockResult(created={}, conflict=item.lease)
            created[item.lease] = raw
    except errors.KubeError:
        await release_quietly(cluster, (leases.parse(c) for c in created.values()))
        raise
    return LockResult(created=created)


FINALIZER_TRIES = 3  # reads and PUTs of a Lease that keeps changing under us, before leaving it


async def release(cluster: kube.Cluster, held: Iterable[leases.LeaseInfo]) -> list[leases.LeaseInfo]:
    """Delete these Leases and remove their finalizers; the ones now gone.

    Both steps are conditional on the Lease's uid, so a Lease that was released
    and created again by another claim meanwhile is never touched. Errors other
    than NotFound / Conflict propagate after the rest were tried.
    """
    gone: list[leases.LeaseInfo] = []
    failure: errors.KubeError | None = None
    for info in sorted(held, key=lambda i: i.name):
        try:
            try:
                await cluster.delete_lease(info.name, uid=info.uid)
            except errors.NotFound:
                gone.append(info)
                continue
            if await _drop_finalizer(cluster, info):
                gone.append(info)
        except errors.NotFound:
            gone.append(info)
        except errors.Conflict:
            log.info("lease changed hands before release, left alone", extra={"lease": info.name})
        except errors.KubeError as exc:
            failure = exc
    if failure is not None:
        raise failure
    return gone


async def _drop_finalizer(cluster: kube.Cluster, info: leases.LeaseInfo) -> bool:
    """Empty the finalizers of the Terminating Lease ``info``, which removes it; False when it kept
    changing (a leftover for later).

    This is a PUT of the Lease as just read, never a PATCH. When an update empties
    the finalizers of an object being deleted, the API server removes the object
    in a second storage operation, conditional on the uid the *request body*
    carries. A PUT's body carries the uid; a PATCH has none, so a slow PATCH can
    remove whatever Lease has the name by then: two releases of one Lease race,
    the first one's removal lets another claim create the Lease again, and the
    second one's removal deletes that new Lease, which no longer locks its GPU.
    """
    for _ in range(FINALIZER_TRIES):
        lease = await cluster.get_lease(info.name)
        meta = lease.get("metadata") or {}
        if meta.get("uid") != info.uid:
            return True  # ours is gone; this one is another claim's
        try:
            await cluster.replace_lease({**lease, "metadata": {**meta, "finalizers": []}})
            return True
        except errors.Conflict:
            continue  # changed since read: read it again
    log.warning("lease kept changing, finalizer left for a later release", extra={"lease": info.name})
    return False


async def release_quietly(cluster: kube.Cluster, held: Iterable[leases.LeaseInfo]) -> list[leases.LeaseInfo]:
    """``release``, logging instead of raising: what stays is a leftover for rule 3 or the sweep."""
    held = list(held)
    try:
        return await release(cluster, held)
    except errors.KubeError as exc:
        log.warning("release incomplete", extra={"error": str(exc), "leases": sorted(i.name for i in held)})
        return []
