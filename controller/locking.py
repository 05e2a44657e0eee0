"""Device locks: one ``coordination.k8s.io/v1`` Lease per GPU, named from its UUID.

Creating a Lease is atomic in the API server, so the first claim to create
``gpu-<uuid>`` holds that GPU; a second create gets ``AlreadyExists``. The
holderIdentity is the claim UID, so re-creating a Lease the claim holds
already is success (a retry after a crash adopts it). Leases are created in
UUID order and an attempt that meets another holder deletes what it created
(with a uid precondition, so it never deletes a Lease someone else re-created
meanwhile) before it reports the conflict.

``Overlay`` remembers Leases this process created, or learned are held, for a
short while, because its Lease cache sees them only when the watch event
arrives: planning a second claim in that gap must not pick the same GPUs.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from controller import cluster as kube
from controller import planning
from gpualloc.api import models
from gpualloc.kube import errors, leases

log = logging.getLogger(__name__)

# An overlay entry older than this is dropped even if the cache never showed the Lease.
OVERLAY_TTL_SECONDS = 60.0


@dataclasses.dataclass(slots=True)
class _Entry:
    holder: str
    uid: str  # the Lease's metadata.uid when known ("" while only reserved)
    expires: float


class Overlay:
    """Leases this process knows of before its cache does: lease name -> holder (and uid)."""

    def __init__(
        self, *, ttl: float = OVERLAY_TTL_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ttl = ttl
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def note(self, name: str, holder: str, uid: str = "") -> None:
        """``name`` is (or is about to be) held by ``holder``."""
        self._entries[name] = _Entry(holder=holder, uid=uid, expires=self._clock() + self._ttl)

    def reserve(self, names: Iterable[str], holder: str) -> None:
        """Mark ``names`` as held by ``holder`` before creating them (planning sees them taken)."""
        for name in names:
            current = self._entries.get(name)
            if current is None or current.holder != holder:
                self.note(name, holder)

    def drop_reserved(self, names: Iterable[str], holder: str) -> None:
        """Forget reservations of ``holder`` among ``names`` that never became a created Lease."""
        for name in names:
            current = self._entries.get(name)
            if current is not None and current.holder == holder and not current.uid:
                del self._entries[name]

    def forget(self, name: str, holder: str | None = None) -> None:
        """Drop the entry for ``name`` (only if ``holder`` holds it, when given)."""
        current = self._entries.get(name)
        if current is not None and (holder is None or current.holder == holder):
            del self._entries[name]

    def observed(self, name: str, holder: str, uid: str) -> None:
        """The cache now shows ``name`` held by ``holder``: the entry has done its job."""
        current = self._entries.get(name)
        if current is not None and current.holder == holder and (not current.uid or current.uid == uid):
            del self._entries[name]

    def expire(self) -> None:
        now = self._clock()
        for name in [n for n, e in self._entries.items() if e.expires <= now]:
            del self._entries[name]

    def holders(self) -> dict[str, str]:
        self.expire()
        return {name: entry.holder for name, entry in self._entries.items()}

    def held_by(self, holder: str) -> dict[str, str]:
        """Lease name -> Lease uid ("" when unknown) of the entries held by ``holder``."""
        self.expire()
        return {name: e.uid for name, e in self._entries.items() if e.holder == holder}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LockResult:
    ok: bool
    held: Mapping[str, str]  # lease name -> Lease uid, every Lease of the plan (ok) or nothing


async def acquire(
    cluster: kube.Cluster,
    namespace: str,
    plan: Sequence[planning.LockItem],
    claim: models.GpuClaim,
    overlay: Overlay,
) -> LockResult:
    """Create the Leases of ``plan`` (already sorted by UUID) for ``claim``, all or none.

    A Lease the claim holds already counts as acquired. On another holder, the
    Leases created by this call are deleted again and the conflict reported;
    Leases the claim held before the call are left alone (the caller decides).
    API errors other than a conflict propagate after the same rollback.
    """
    uid = claim.metadata.uid
    created: dict[str, str] = {}  # by this call: rolled back on failure
    held: dict[str, str] = {}
    try:
        for item in plan:
            lease_uid, holder, made = await _create_or_read(cluster, namespace, item, claim)
            if holder != uid:
                overlay.note(item.lease, holder, lease_uid)
                log.info(
                    "device taken meanwhile, rolling back",
                    extra={"claim": claim.key, "lease": item.lease, "holder": holder},
                )
                await _quiet_release(cluster, created, overlay, holder=uid)
                return LockResult(ok=False, held={})
            held[item.lease] = lease_uid
            overlay.note(item.lease, uid, lease_uid)
            if made:
                created[item.lease] = lease_uid
    except errors.KubeError:
        await _quiet_release(cluster, created, overlay, holder=uid)
        raise
    return LockResult(ok=True, held=held)


async def _create_or_read(
    cluster: kube.Cluster, namespace: str, item: planning.LockItem, claim: models.GpuClaim
) -> tuple[str, str, bool]:
    """(Lease uid, holder, created by this call) after trying to create the Lease."""
    uid = claim.metadata.uid
    for _ in range(3):
        try:
            body = leases.lease_body(
                namespace,
                item.lease,
                holder=uid,
                labels=planning.lease_labels(item, claim),
                annotations=planning.lease_annotations(claim),
                duration_seconds=None,
                now=datetime.datetime.now(datetime.UTC),
            )
            raw = await cluster.create_lease(body)
            return planning.lease_info(raw).uid, uid, True
        except errors.AlreadyExists:
            pass
        try:
            raw = await cluster.get_lease(item.lease)  # the one GET: only on a conflict
        except errors.NotFound:
            continue  # released between our create and our read: try again
        info = planning.lease_info(raw)
        return info.uid, info.holder, False
    raise errors.Conflict(409, "Conflict", f"lease {item.lease} keeps appearing and vanishing")


async def _quiet_release(
    cluster: kube.Cluster, held: Mapping[str, str], overlay: Overlay, *, holder: str
) -> None:
    try:
        await release(cluster, held, overlay, holder=holder)
    except errors.KubeError as exc:
        # The Leases stay held by the claim's UID; the next reconcile or the sweep releases them.
        log.warning("rollback incomplete", extra={"error": str(exc), "leases": sorted(held)})


async def release(
    cluster: kube.Cluster,
    held: Mapping[str, str],
    overlay: Overlay,
    *,
    holder: str,
) -> int:
    """Delete the Leases ``held`` (name -> Lease uid); the number deleted.

    Every delete carries the uid as a precondition, so a Lease that was
    released and re-created by another claim meanwhile is never deleted; one
    without a known uid (reserved, never seen created) is skipped. Missing
    Leases are skipped too. Other errors propagate after the rest were tried.
    """
    deleted = 0
    failure: errors.KubeError | None = None
    for name in sorted(held):
        uid = held[name]
        if not uid:
            overlay.forget(name, holder)
            continue
        try:
            await cluster.delete_lease(name, uid=uid)
            deleted += 1
        except errors.NotFound:
            pass
        except errors.Conflict:
            log.info("lease changed hands before release, left alone", extra={"lease": name})
        except errors.KubeError as exc:
            failure = exc
            continue
        overlay.forget(name, holder)
    if failure is not None:
        raise failure
    return deleted
