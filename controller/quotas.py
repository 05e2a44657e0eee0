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
ledger's sum, which never grows past the limit. Claims Allocated before a
quota existed are entered without a check (``used`` may then exceed the limit,
and nothing more is admitted until it falls back).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

from gpualloc.api import codecs, models

REASON = "QuotaExceeded"


def claim_gpus(claim: models.GpuClaim) -> int:
    """The GPUs a claim counts for: ``count`` per replica."""
    return claim.spec.devices.count * max(1, claim.spec.replicas)


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


def merged(quota: models.GpuQuota, uid: str, gpus: int, product: str) -> models.QuotaEntry:
    """The ledger entry that covers claim ``uid`` as ``gpus`` of ``product`` and whatever its entry
    covers already: an entry only grows while its claim lives, so it covers every attempt of it."""
    entry = quota.status.claims.get(uid)
    if entry is None:
        return models.QuotaEntry(name="", gpus=gpus, product=product)
    names = {n for n in f"{entry.product},{product}".split(",") if n}
    return models.QuotaEntry(name=entry.name, gpus=max(gpus, entry.gpus), product=",".join(sorted(names)))


def covers(quota: models.GpuQuota, uid: str, gpus: int, product: str) -> bool:
    """Does the ledger hold claim ``uid`` for at least this?"""
    entry = quota.status.claims.get(uid)
    return entry is not None and merged(quota, uid, gpus, product) == entry


def verdict(quota: models.GpuQuota, uid: str, entry: models.QuotaEntry) -> str:
    """Why ``quota`` cannot hold claim ``uid`` as ``entry`` (in place of its entry, if any); "" when
    it can. An entry with no product (no plan yet) is checked against the total only."""
    others = [e for u, e in quota.status.claims.items() if u != uid]
    namespace = quota.metadata.namespace
    used = sum(e.gpus for e in others) + entry.gpus
    if used > quota.spec.gpus:
        return f"namespace {namespace} would use {used} of {quota.spec.gpus} GPUs ({_label(quota)})"
    for limit in quota.spec.products:
        if _matches(entry.product, limit.pattern):
            used = sum(e.gpus for e in others if _matches(e.product, limit.pattern)) + entry.gpus
            if used > limit.gpus:
                return (
                    f"namespace {namespace} would use {used} of {limit.gpus} {limit.pattern} GPUs "
                    f"({_label(quota)})"
                )
    return ""


def admissible(quotas: Iterable[models.GpuQuota], claim: models.GpuClaim, product: str) -> str:
    """Why one of the namespace's ``quotas`` would not admit ``claim`` counted for ``product``; ""
    when every one would. The check ``Ledger.admit`` makes: a quota that holds the claim for this
    already admits it."""
    gpus, uid = claim_gpus(claim), claim.metadata.uid
    for quota in quotas:
        if covers(quota, uid, gpus, product):
            continue
        why = verdict(quota, uid, merged(quota, uid, gpus, product))
        if why:
            return why
    return ""


def _status(quota: models.GpuQuota, claims: Mapping[str, models.QuotaEntry]) -> dict[str, Any]:
    by_product = {
        limit.pattern: sum(e.gpus for e in claims.values() if _matches(e.product, limit.pattern))
        for limit in quota.spec.products
    }
    return {"used": sum(e.gpus for e in claims.values()), "usedByProduct": by_product}


def entry_patch(quota: models.GpuQuota, claim: models.GpuClaim, entry: models.QuotaEntry) -> dict[str, Any]:
    """The status merge patch that enters (or updates) ``claim`` in the ledger as ``entry``."""
    entry = models.QuotaEntry(name=claim.metadata.name, gpus=entry.gpus, product=entry.product)
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
