"""GPU quotas: how many GPUs a namespace's claims may hold, and the ledger that keeps it so.

Why two controllers never admit past a quota
============================================

Every ``GpuQuota`` keeps a **ledger** in its status: the claims it admitted, by
UID, each with the GPUs it counts for (``count x replicas``) and the product
of its devices. ``used`` is the ledger's sum.

1. **A claim takes no GPU before every quota of its namespace admitted it.**
   Once a plan is found, and before any Lease is created, the claim is
   entered in each ledger by a status write **conditional on the quota's
   resourceVersion**, computed from exactly that version: the write fails if
   anyone changed the ledger since. So each stored ledger is within the limit
   when it grows (``verdict``), whoever writes it, however many controllers.

2. **An entry leaves the ledger only after its claim can no longer hold
   GPUs**: when the claim is being deleted and its Leases are released (it
   keeps its finalizer until then), or when the claim is gone (the sweep reads
   it to make sure). A claim that waits for devices after it was admitted
   keeps its share: an attempt may be about to record its devices, and a
   claim's status is written only at the version its attempt planned from,
   which a deletion moves on.

So the GPUs that live Allocated claims of a namespace list never exceed the
ledger's sum, which never grows past the limit. The ledger counts in milli-GPU:
a claim for milli-GPU shares (``sharing.milli``) counts for its shares, 460 of
them 0.46 GPU; its entry says so in ``milli`` (an entry without one counts for
``gpus`` whole GPUs). Claims Allocated before a
quota existed are entered without a check (``used`` may then exceed the limit,
and nothing more is admitted until it falls back).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from gpualloc.api import codecs, leases, models

REASON = "QuotaExceeded"


def claim_gpus(claim: models.GpuClaim) -> int:
    """The devices a claim asks for: ``count`` per replica."""
    return claim.spec.devices.count * max(1, claim.spec.replicas)


def claim_milli(claim: models.GpuClaim) -> int:
    """What a claim counts for, in milli-GPU: its share per replica (``sharing.milli``), else 1000
    per device."""
    sharing = claim.spec.devices.sharing
    if claim.spec.devices.exclusivity == "Shared" and sharing is not None and sharing.milli is not None:
        return sharing.milli * max(1, claim.spec.replicas)
    return claim_gpus(claim) * leases.WHOLE_MILLI


def entry_milli(entry: models.QuotaEntry) -> int:
    """What a ledger entry counts for, in milli-GPU."""
    return entry.milli if entry.milli is not None else entry.gpus * leases.WHOLE_MILLI


def _entry(name: str, milli: int, product: str) -> models.QuotaEntry:
    """An entry for ``milli`` milli-GPU: whole GPUs as ``gpus`` alone, a fraction in ``milli`` too
    (``gpus`` then rounded up)."""
    gpus = -(-milli // leases.WHOLE_MILLI)
    fraction = milli if milli % leases.WHOLE_MILLI else None
    return models.QuotaEntry(name=name, gpus=gpus, milli=fraction, product=product)


def _gpus(milli: int) -> str:
    """Milli-GPU as GPUs for a message: ``3``, ``2.46``."""
    return f"{milli / leases.WHOLE_MILLI:g}"


def products_of(
    allocations: Iterable[models.Allocation], statuses: Mapping[str, models.GpuNodeStatus]
) -> str:
    """The product names of the allocated devices, sorted and comma-separated."""
    names: set[str] = set()
    for alloc in allocations:
        status = statuses.get(alloc.node_name)
        devices = status.status.devices if status is not None else ()
        by_uuid = {uuid: d.product for d in devices for uuid in d.lock_ids}  # a MIG instance: its GPU's
        names.update(by_uuid.get(d.uuid, "") for d in alloc.devices)
    names.discard("")
    return ",".join(sorted(names))


def _matches(product: str, pattern: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in product.split(",") if name)


def _label(quota: models.GpuQuota) -> str:
    return f"quota {quota.metadata.namespace}/{quota.metadata.name}"


def merged(quota: models.GpuQuota, uid: str, milli: int, product: str) -> models.QuotaEntry:
    """The ledger entry that covers claim ``uid`` as ``milli`` milli-GPU (``claim_milli``) of
    ``product`` and whatever its entry covers already: an entry only grows while its claim lives,
    so it covers every attempt of it."""
    entry = quota.status.claims.get(uid)
    if entry is None:
        return _entry("", milli, product)
    names = {n for n in f"{entry.product},{product}".split(",") if n}
    return _entry(entry.name, max(milli, entry_milli(entry)), ",".join(sorted(names)))


def covers(quota: models.GpuQuota, uid: str, milli: int, product: str) -> bool:
    """Does the ledger hold claim ``uid`` for at least this?"""
    entry = quota.status.claims.get(uid)
    return entry is not None and merged(quota, uid, milli, product) == entry


def verdict(quota: models.GpuQuota, uid: str, entry: models.QuotaEntry) -> str:
    """Why ``quota`` cannot hold claim ``uid`` as ``entry`` (in place of its entry, if any); "" when
    it can. An entry with no product (no plan yet) is checked against the total only."""
    others = [e for u, e in quota.status.claims.items() if u != uid]
    namespace = quota.metadata.namespace
    used = sum(map(entry_milli, others)) + entry_milli(entry)
    if used > quota.spec.gpus * leases.WHOLE_MILLI:
        return f"namespace {namespace} would use {_gpus(used)} of {quota.spec.gpus} GPUs ({_label(quota)})"
    for limit in quota.spec.products:
        if _matches(entry.product, limit.pattern):
            used = sum(entry_milli(e) for e in others if _matches(e.product, limit.pattern)) + entry_milli(
                entry
            )
            if used > limit.gpus * leases.WHOLE_MILLI:
                return (
                    f"namespace {namespace} would use {_gpus(used)} of {limit.gpus} {limit.pattern} GPUs "
                    f"({_label(quota)})"
                )
    return ""


def admissible(quotas: Iterable[models.GpuQuota], claim: models.GpuClaim, product: str) -> str:
    """Why one of the namespace's ``quotas`` would not admit ``claim`` counted for ``product``; ""
    when every one would. The check ``Ledger.admit`` makes: a quota that holds the claim for this
    already admits it."""
    milli, uid = claim_milli(claim), claim.metadata.uid
    for quota in quotas:
        if covers(quota, uid, milli, product):
            continue
        why = verdict(quota, uid, merged(quota, uid, milli, product))
        if why:
            return why
    return ""


def _status(quota: models.GpuQuota, claims: Mapping[str, models.QuotaEntry]) -> dict[str, Any]:
    by_product = {
        limit.pattern: _rounded_up(
            sum(entry_milli(e) for e in claims.values() if _matches(e.product, limit.pattern))
        )
        for limit in quota.spec.products
    }
    milli = sum(map(entry_milli, claims.values()))
    return {"used": _rounded_up(milli), "usedMilli": milli, "usedByProduct": by_product}


def _rounded_up(milli: int) -> int:
    return -(-milli // leases.WHOLE_MILLI)


def entry_patch(quota: models.GpuQuota, claim: models.GpuClaim, entry: models.QuotaEntry) -> dict[str, Any]:
    """The status merge patch that enters (or updates) ``claim`` in the ledger as ``entry``."""
    entry = dataclasses.replace(entry, name=claim.metadata.name)
    claims = {**quota.status.claims, claim.metadata.uid: entry}
    return {"status": {**_status(quota, claims), "claims": {claim.metadata.uid: codecs.encode(entry)}}}


def removal_patch(quota: models.GpuQuota, uids: Iterable[str]) -> dict[str, Any]:
    """The status merge patch that takes these claims out of the ledger."""
    gone = set(uids)
    claims = {u: e for u, e in quota.status.claims.items() if u not in gone}
    return {"status": {**_status(quota, claims), "claims": dict.fromkeys(sorted(gone))}}


def max_priority(quotas: Iterable[models.GpuQuota]) -> int | None:
    """The lowest ``maxPriority`` of a namespace's quotas; None when none sets one."""
    caps = [q.spec.max_priority for q in quotas if q.spec.max_priority is not None]
    return min(caps) if caps else None
