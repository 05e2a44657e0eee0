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

Why the shares of a GPU never add up past it
============================================

A fractional claim (``sharing.milli``) is locked by the GPU's *own* Lease
``gpu-<uuid>``, which then holds a ledger: one entry per claim UID, with the
share in milli-GPU and the resourceVersion its attempt planned from
(``leases``: the ``gpu.scheduling/shares`` annotation).

6. **The ledger changes only atomically.** The first share *creates* the
   Lease with its entry (create-if-absent, as rule 1); every other change is
   a PUT of the Lease as just read (GET, not the cache), conditional on its
   resourceVersion, so each change applies to the ledger it was checked
   against, and a Conflict means nothing was written: read again and
   re-check. An entry is added only if the Lease is a ledger, is not being
   deleted, has no entry of the same claim UID (never adopted: rule 1), and
   its entries plus the new share are at most 1000. The checks and the write
   are one linearizable step, so *every* ledger the API server ever stores
   sums to at most 1000, whatever the interleaving of racing controllers,
   restarts and lost answers. A lost answer leaves at worst an entry stamped
   with its attempt's resourceVersion: a leftover for rule 3.

7. **Whole and shares exclude each other in the lock itself.** A whole claim
   creates ``gpu-<uuid>``, which exists (``AlreadyExists``) while any share
   is held; a share is never added to a Lease that is not a ledger. Planning
   counts the same (``views``), but does not have to be right.

8. **Entries go by rules 2 to 5, one entry at a time.** An attempt's status
   lists a share only when its own entry went in (rule 2), and a leftover
   entry is removed under rule 3 (``releasable`` reads the entry's own
   resourceVersion). Removing an entry is a PUT under the resourceVersion,
   and removes only an entry stamped with the version the releaser saw, so a
   stale release never removes a later attempt's entry. Two attempts at one
   version are not told apart, and need not be: an attempt releases as its
   own only what it added, while it stands (no other attempt of the claim can
   add one meanwhile), and the other releases (rule 3, the sweep, a deletion)
   hold for every attempt at that version alike. The last entry is not
   PUT away: the Lease is deleted with a resourceVersion precondition while
   that entry still stands (rule 5's finalizer keeps it, Terminating), so no
   share can slip in between the check and the delete, and a Terminating
   ledger is never added to (rule 6); then the PUT that empties the
   finalizers drops the entry too. A ledger that an admin deleted by hand
   stays Terminating until its last entry is released.

Rules 1 to 5 then hold for each entry as they hold for a whole Lease, and the
planner's count of what is used (Leases' ledgers, statuses and pods) only
decides where a share is *tried*: the ledger decides whether it goes in.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Iterable
from typing import Any

from controller import cluster as kube
from controller.locks import LockItem
from gpualloc.api import leases, models
from gpualloc.kube import errors

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockResult:
    created: dict[str, dict[str, Any]]  # name -> the Lease as written: every one of the plan when ok
    conflict: str = ""  # the Lease name found taken, when not ok
    held: tuple[leases.LeaseInfo, ...] = ()  # what the attempt holds of ``created``: Leases or entries

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

    def mine() -> list[leases.LeaseInfo]:
        return [h for raw in created.values() if (h := leases.held_by(raw, meta.uid)) is not None]

    try:
        for item in plan:
            raw = await (
                _add_share(cluster, namespace, item, claim, now=now)
                if item.milli
                else _create_whole(cluster, namespace, item, claim, now=now)
            )
            if raw is None:
                log.info(
                    "device taken meanwhile, rolling back", extra={"claim": claim.key, "lease": item.lease}
                )
                await release_quietly(cluster, mine())
                return LockResult(created={}, conflict=item.lease)
            created[item.lease] = raw
    except errors.KubeError:
        await release_quietly(cluster, mine())
        raise
    return LockResult(created=created, held=tuple(mine()))


async def _create_whole(
    cluster: kube.Cluster, namespace: str, item: LockItem, claim: models.GpuClaim, *, now: datetime.datetime
) -> dict[str, Any] | None:
    """Create the Lease of a whole device (rule 1); None when it exists."""
    meta = claim.metadata
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
        return await cluster.create_lease(body)
    except errors.AlreadyExists:
        return None


SHARE_TRIES = 5  # reads and PUTs of a ledger that keeps changing under us, before giving up (retried later)


async def _add_share(
    cluster: kube.Cluster, namespace: str, item: LockItem, claim: models.GpuClaim, *, now: datetime.datetime
) -> dict[str, Any] | None:
    """Put this attempt's entry in the ledger of the GPU ``item.lock_id`` (rule 6); the Lease as
    written, or None when the share does not fit, the GPU is held whole, its Lease is being deleted,
    the claim has an entry there already, or the ledger kept changing."""
    meta = claim.metadata
    entry = leases.share_entry(
        milli=item.milli,
        claim_namespace=meta.namespace,
        claim_name=meta.name,
        claim_resource_version=meta.resource_version,
    )
    for _ in range(SHARE_TRIES):
        try:
            return await cluster.create_lease(
                leases.share_lease(
                    namespace, uuid=item.lock_id, node=item.node, entries={meta.uid: entry}, now=now
                )
            )
        except errors.AlreadyExists:
            pass
        try:
            raw = await cluster.get_lease(item.lease)
        except errors.NotFound:
            continue  # released meanwhile: create it
        if not fits(leases.parse(raw), meta.uid, item.milli):
            return None
        try:
            return await cluster.replace_lease(
                leases.with_ledger(raw, {**leases.ledger(raw), meta.uid: entry})
            )
        except (errors.Conflict, errors.NotFound):
            continue  # changed meanwhile: nothing was written, read it again
    return None


def fits(lease: leases.LeaseInfo, uid: str, milli: int) -> bool:
    """Whether claim ``uid``'s share of ``milli`` may go into this Lease (rules 6 and 7): a ledger,
    not being deleted, without an entry of ``uid``, with room for the share."""
    return (
        lease.ledger
        and not lease.deleting
        and all(s.holder != uid for s in lease.shares)
        and lease.used_milli + milli <= leases.WHOLE_MILLI
    )


FINALIZER_TRIES = 3  # reads and PUTs of a Lease that keeps changing under us, before leaving it


Written = Callable[[dict[str, Any]], None]  # told each Lease as a PUT of ours answered it


def _ignore(raw: dict[str, Any]) -> None:
    return None


async def release(
    cluster: kube.Cluster, held: Iterable[leases.LeaseInfo], written: Written = _ignore
) -> list[leases.LeaseInfo]:
    """Delete these Leases and remove their finalizers, or remove these ledger entries (rule 8);
    the ones now gone.

    Both steps are conditional on the Lease's uid, so a Lease that was released
    and created again by another claim meanwhile is never touched. Errors other
    than NotFound / Conflict propagate after the rest were tried. ``written`` is
    told the answer of every PUT of a ledger.
    """
    gone: list[leases.LeaseInfo] = []
    failure: errors.KubeError | None = None
    for info in sorted(held, key=lambda i: i.name):
        try:
            if info.milli:
                if await _remove_share(cluster, info, written):
                    gone.append(info)
                continue
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


async def _remove_share(cluster: kube.Cluster, entry: leases.LeaseInfo, written: Written) -> bool:
    """Remove the ledger entry ``entry`` (rule 8); False when the ledger kept changing (a leftover
    for later). An entry of the same claim with another resourceVersion is another attempt's, and
    stays."""
    for _ in range(FINALIZER_TRIES):
        raw = await cluster.get_lease(entry.name)
        meta = raw.get("metadata") or {}
        entries = leases.ledger(raw)
        stored = entries.get(entry.holder)
        if meta.get("uid") != entry.uid or stored is None:
            return True  # ours is gone
        if str(stored.get("claimResourceVersion", "")) != entry.claim_resource_version:
            return True  # another attempt's entry: ours is gone
        del entries[entry.holder]
        try:
            if entries:
                written(await cluster.replace_lease(leases.with_ledger(raw, entries)))
            elif meta.get("deletionTimestamp"):
                emptied = leases.with_ledger(raw, entries)
                written(
                    await cluster.replace_lease(
                        {**emptied, "metadata": {**emptied["metadata"], "finalizers": []}}
                    )
                )
            else:
                # The last entry: delete while it still stands, then empty the finalizers above.
                await cluster.delete_lease(
                    entry.name, uid=entry.uid, resource_version=str(meta.get("resourceVersion"))
                )
                continue
            return True
        except errors.Conflict:
            continue  # changed since read: read it again
    log.warning("ledger kept changing, share left for a later release", extra={"lease": entry.name})
    return False


async def release_quietly(cluster: kube.Cluster, held: Iterable[leases.LeaseInfo]) -> list[leases.LeaseInfo]:
    """``release``, logging instead of raising: what stays is a leftover for rule 3 or the sweep."""
    held = list(held)
    try:
        return await release(cluster, held)
    except errors.KubeError as exc:
        log.warning("release incomplete", extra={"error": str(exc), "leases": sorted(i.name for i in held)})
        return []
