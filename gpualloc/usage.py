"""GPU-seconds per tenant, from the API server's own records (pure).

A claim holds a device from its Lease's ``spec.acquireTime`` (written with
microseconds by the controller that created it) until the Lease is gone. So
the seconds of every allocation still held are ``now - acquireTime``, whoever
computes them and whenever: a restarted or new controller, or the CLI, gets
the same figure. A released claim that still exists (phase ``Released``) keeps
``status.lastScheduleTime`` and ``status.releasedTime`` (whole seconds), and
its spec says how many GPUs it held: that is what is left of an allocation
once its Leases are gone. The controller's counter and ``gpualloc get usage``
are both built from these functions.

Each device Lease is one thing held: a whole GPU (``profile`` ""), a MIG
instance (``profile`` its MIG profile, e.g. ``1g.10gb``) or a slot of a shared
GPU (``profile`` ``share/<slots>``). Its seconds count once whatever it is;
the labels say what it was.

What is allocated but idle, two ways: ``idle_claims``, the Allocated claims no
pod has used for a while (from the pods), and ``idle_gpus``, their GPUs with no
compute process for a while (from each node agent's ``idleSince``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

from gpualloc.api import constants, models, timestamps

# namespace, claim, product, profile
Key = tuple[str, str, str, str]

SHARE_PREFIX = "share/"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """One device Lease, as accounting reads it."""

    lease: str
    uid: str  # the Lease's
    namespace: str  # the claim's
    claim: str
    node: str
    product: str  # "" when the node's GpuNodeStatus does not (or no longer) list the device
    profile: str
    acquired: dt.datetime
    deleting_since: dt.datetime | None = None  # metadata.deletionTimestamp (whole seconds)

    @property
    def key(self) -> Key:
        return (self.namespace, self.claim, self.product, self.profile)


def device_kinds(statuses: Iterable[models.GpuNodeStatus]) -> dict[str, tuple[str, str]]:
    """Lease name -> (product, profile) of every device, MIG instance and sharing slot the nodes list."""
    kinds: dict[str, tuple[str, str]] = {}
    for status in statuses:
        for device in status.status.devices:
            kinds[constants.lease_name(device.uuid)] = (device.product, "")
            for instance in device.mig.devices if device.mig is not None else ():
                kinds[constants.lease_name(instance.uuid)] = (device.product, instance.profile)
            if device.shared:
                profile = f"{SHARE_PREFIX}{len(device.slot_ids)}"
                for slot in device.slot_ids:
                    kinds[constants.lease_name(slot)] = (device.product, profile)
    return kinds


def holding(raw: Mapping[str, Any], kinds: Mapping[str, tuple[str, str]]) -> Holding | None:
    """The device Lease ``raw`` as a holding; None for a Lease that names no claim or has no time."""
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    namespace, claim = constants.lease_claim(metadata)
    acquired = timestamps.parse_time(spec.get("acquireTime")) or timestamps.parse_time(
        metadata.get("creationTimestamp")
    )
    if not namespace or not claim or acquired is None:
        return None
    name = str(metadata.get("name", ""))
    product, profile = kinds.get(name, ("", ""))
    return Holding(
        lease=name,
        uid=str(metadata.get("uid", "")),
        namespace=namespace,
        claim=claim,
        node=str((metadata.get("labels") or {}).get(constants.LABEL_NODE, "")),
        product=product,
        profile=profile,
        acquired=acquired,
        deleting_since=timestamps.parse_time(metadata.get("deletionTimestamp")),
    )


def holdings(raw_leases: Iterable[Mapping[str, Any]], kinds: Mapping[str, tuple[str, str]]) -> list[Holding]:
    """The holdings of the device Leases among ``raw_leases``."""
    found = (holding(raw, kinds) for raw in raw_leases)
    return [h for h in found if h is not None]


def seconds_between(start: dt.datetime, end: dt.datetime, *, since: dt.datetime | None = None) -> float:
    """The seconds of [start, end] after ``since`` (all of them without it); never negative."""
    if since is not None and since > start:
        start = since
    return max(0.0, (end - start).total_seconds())


def released_at(held: Holding, observed: dt.datetime) -> dt.datetime:
    """When a Lease seen gone at ``observed`` was released: ``observed``, unless its
    deletionTimestamp says it was deleted more than a second earlier (a deletion seen late, by a
    watch that re-listed). The deletionTimestamp has whole seconds, hence the second's slack."""
    if held.deleting_since is not None:
        return min(observed, held.deleting_since + dt.timedelta(seconds=1))
    return observed


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClaimUsage:
    """A claim's GPU-seconds: those of its Leases held now, and those of a release its status records."""

    namespace: str
    claim: str
    phase: str
    gpus: int  # devices held now (its Leases), or held before its release
    held_seconds: float  # of the Leases held now
    released_seconds: float  # from lastScheduleTime to releasedTime, times the GPUs (whole seconds)
    products: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        return self.held_seconds + self.released_seconds


def released_seconds(claim: models.GpuClaim, *, since: dt.datetime | None = None) -> float:
    """The GPU-seconds a Released claim's status records (``count * replicas`` GPUs from
    ``lastScheduleTime`` to ``releasedTime``); 0 for any other claim, or one missing a time."""
    if claim.status.phase != constants.PHASE_RELEASED:
        return 0.0
    start = timestamps.parse_time(claim.status.last_schedule_time)
    end = timestamps.parse_time(claim.status.released_time)
    if start is None or end is None:
        return 0.0
    gpus = claim.spec.devices.count * max(1, claim.spec.replicas)
    return gpus * seconds_between(start, end, since=since)


def allocated_seconds(claim: models.GpuClaim, now: dt.datetime, *, since: dt.datetime | None = None) -> float:
    """An Allocated claim's GPU-seconds by its status alone (the devices it lists, from
    ``lastScheduleTime``, whole seconds): what a reader who may not list the Leases can know."""
    start = timestamps.parse_time(claim.status.last_schedule_time)
    if claim.status.phase != constants.PHASE_ALLOCATED or start is None:
        return 0.0
    return sum(len(a.devices) for a in claim.status.allocations) * seconds_between(start, now, since=since)


def claim_usage(
    held: Iterable[Holding] | None,
    claims: Iterable[models.GpuClaim],
    now: dt.datetime,
    *,
    since: dt.datetime | None = None,
) -> list[ClaimUsage]:
    """Every claim's GPU-seconds after ``since`` (ever, without it), sorted by namespace and name:
    each claim with a Lease held now, and each Released claim; the Leases of a claim deleted
    meanwhile still count, under its name. ``held`` None (the Leases could not be read): the
    Allocated claims' statuses stand in for their Leases."""
    by_claim: dict[tuple[str, str], list[Holding]] = {}
    for h in held or ():
        by_claim.setdefault((h.namespace, h.claim), []).append(h)
    phases = {(c.metadata.namespace, c.metadata.name): c for c in claims}
    out: list[ClaimUsage] = []
    for key in sorted(by_claim.keys() | phases.keys()):
        claim = phases.get(key)
        mine = by_claim.get(key, [])
        if mine:
            gpus, live = len(mine), sum(seconds_between(h.acquired, now, since=since) for h in mine)
            released = 0.0
        elif claim is not None:
            listed = sum(len(a.devices) for a in claim.status.allocations)
            live = allocated_seconds(claim, now, since=since) if held is None else 0.0
            released = released_seconds(claim, since=since)
            gpus = listed if live else claim.spec.devices.count * max(1, claim.spec.replicas)
        else:
            continue
        if not mine and live <= 0 and released <= 0:
            continue
        out.append(
            ClaimUsage(
                namespace=key[0],
                claim=key[1],
                phase=claim.status.phase if claim is not None else "Deleted",
                gpus=gpus,
                held_seconds=live,
                released_seconds=released,
                products=tuple(sorted({h.product for h in mine if h.product})),
            )
        )
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IdleClaim:
    """An Allocated claim none of whose pods has run for a while."""

    namespace: str
    claim: str
    gpus: int
    nodes: tuple[str, ...]
    idle_since: dt.datetime  # its allocation, or when its last pod's last container finished


def _finished_at(pod: Mapping[str, Any]) -> dt.datetime | None:
    """When the last container of an ended pod finished (None when its status says nothing)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    ends = [
        timestamps.parse_time(((s.get("state") or {}).get("terminated") or {}).get("finishedAt"))
        for s in statuses
    ]
    known = [e for e in ends if e is not None]
    return max(known) if known else None


def idle_claims(
    claims: Iterable[models.GpuClaim],
    pods: Iterable[Mapping[str, Any]],
    now: dt.datetime,
    *,
    idle_after: dt.timedelta,
) -> list[IdleClaim]:
    """The Allocated claims among ``claims`` that hold GPUs with no pod of theirs (``pods`` with
    their ``gpu.scheduling/claim`` annotation) running or about to, for ``idle_after`` at least:
    idle since the later of their ``lastScheduleTime`` and their ended pods' last finish. A pod
    deleted meanwhile is not seen, so a claim whose pods are deleted when they end looks idle
    since its allocation."""
    busy: set[tuple[str, str]] = set()
    finished: dict[tuple[str, str], dt.datetime] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = (meta.get("annotations") or {}).get(constants.ANNOTATION_CLAIM)
        if not name:
            continue
        key = (str(meta.get("namespace", "")), str(name))
        if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            busy.add(key)
            continue
        end = _finished_at(pod)
        if end is not None and (key not in finished or end > finished[key]):
            finished[key] = end
    out: list[IdleClaim] = []
    for claim in claims:
        key = (claim.metadata.namespace, claim.metadata.name)
        start = timestamps.parse_time(claim.status.last_schedule_time)
        if claim.status.phase != constants.PHASE_ALLOCATED or start is None or key in busy:
            continue
        since = max(start, finished.get(key, start))
        if now - since >= idle_after:
            out.append(
                IdleClaim(
                    namespace=key[0],
                    claim=key[1],
                    gpus=sum(len(a.devices) for a in claim.status.allocations),
                    nodes=tuple(sorted({a.node_name for a in claim.status.allocations})),
                    idle_since=since,
                )
            )
    return sorted(out, key=lambda c: (c.namespace, c.claim))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class IdleGpu:
    """An allocated GPU with no compute process on it for a while, by its agent's ``idleSince``."""

    namespace: str
    claim: str
    node: str
    index: int  # the GPU's host index
    uuid: str  # the GPU's (a MIG instance or a slot is reported as its GPU)
    idle_since: dt.datetime  # the later of its idleSince and the claim's allocation


def _gpus_by_lock(statuses: Iterable[models.GpuNodeStatus]) -> dict[tuple[str, str], models.Device]:
    """(node, UUID of a GPU or of one of its MIG instances) -> the GPU."""
    out: dict[tuple[str, str], models.Device] = {}
    for status in statuses:
        node = status.spec.node_name or status.metadata.name
        for device in status.status.devices:
            out[(node, device.uuid)] = device
            for instance in device.mig.devices if device.mig is not None else ():
                out[(node, instance.uuid)] = device
    return out


def idle_gpus(
    claims: Iterable[models.GpuClaim],
    statuses: Iterable[models.GpuNodeStatus],
    now: dt.datetime,
    *,
    idle_after: dt.timedelta,
) -> list[IdleGpu]:
    """The GPUs of Allocated claims on which their node's agent has seen no compute process for
    ``idle_after`` at least, counted from the later of the GPU's ``idleSince`` and the claim's
    ``lastScheduleTime`` (a GPU idle before the claim got it is idle for the claim only since
    then). A MIG instance or a slot of a shared GPU counts as idle only when its whole GPU is; a
    GPU whose status says nothing (a process runs, the agent cannot tell, or it is not listed) is
    not idle. One entry per GPU and claim, sorted by namespace, claim, node and index."""
    gpus = _gpus_by_lock(statuses)
    found: dict[tuple[str, str, str, int], IdleGpu] = {}
    for claim in claims:
        allocated = timestamps.parse_time(claim.status.last_schedule_time)
        if claim.status.phase != constants.PHASE_ALLOCATED or allocated is None:
            continue
        for allocation in claim.status.allocations:
            for ref in allocation.devices:
                gpu = gpus.get((allocation.node_name, ref.uuid))
                since = timestamps.parse_time(gpu.idle_since) if gpu is not None else None
                if gpu is None or since is None:
                    continue
                since = max(since, allocated)
                if now - since >= idle_after:
                    key = (claim.metadata.namespace, claim.metadata.name, allocation.node_name, gpu.index)
                    found[key] = IdleGpu(
                        namespace=key[0],
                        claim=key[1],
                        node=key[2],
                        index=gpu.index,
                        uuid=gpu.uuid,
                        idle_since=since,
                    )
    return [found[key] for key in sorted(found)]
