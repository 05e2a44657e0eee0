"""The Lease formats: the device locks, and the agents' node heartbeats.

One ``coordination.k8s.io/v1`` Lease per device, in the controller's
namespace, named ``gpu-<uuid lower case>`` (``constants.lease_name``), held by
the claim's UID. The controller writes them, the agent and the CLI read them,
and the kube adapter sends them: all through this module.

* labels: node, claim namespace, claim name (shortened to fit a label value),
  claim UID, managed-by, for selecting and ``kubectl get leases -L``;
* annotations: the claim's whole namespace and name (the sweep GETs the
  claim with them), and ``gpu.scheduling/claim-resource-version``, the claim's
  resourceVersion that the allocation attempt which created the Lease planned
  from. That attempt's status write is conditional on that resourceVersion, so
  once the claim has another one, the attempt can no longer record the Lease
  (see ``controller.locking``);
* the finalizer ``gpu.scheduling/device-lock``: a Lease deleted by hand (an
  admin, a script) only gets a deletionTimestamp and goes on existing, so the
  lock holds until the controller releases it and removes the finalizer.

A GPU shared in milli-GPU shares (``sharing.milli``) is locked by the same Lease
``gpu-<uuid>``, which then holds a *ledger* instead of one claim: the annotation
``gpu.scheduling/shares`` maps each holding claim's UID to its share (``milli``,
the claim's namespace and name, and the resourceVersion its attempt planned
from), the label ``gpu.scheduling/shares=milli`` marks it, and one label
``s.gpu.scheduling/<claim uid>`` per entry lets a claim's Leases be listed by
selector. holderIdentity is empty. A whole claim's create of the name meets
``AlreadyExists`` while any share is held, and a share never goes into a Lease
that holds a whole claim: the silicon rule is the lock's own (``controller.locking``).

The agents' heartbeats are Leases too (``heartbeat_lease``), as the kubelet's are:
one per GPU node, named after the node and renewed every heartbeat interval, in
a namespace of their own (``heartbeat_namespace``), because an agent may write
there and must not be able to touch a device lock. Renewing a small Lease costs
the API server a sixth of rewriting the node's GpuNodeStatus (BENCHMARKS.md), so
the GpuNodeStatus is written only when what it says changes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping
from typing import Any

from gpualloc.api import constants

Obj = dict[str, Any]

API_VERSION = "coordination.k8s.io/v1"
FINALIZER = f"{constants.GROUP}/device-lock"
ANNOTATION_CLAIM_RESOURCE_VERSION = f"{constants.GROUP}/claim-resource-version"
ANNOTATION_SHARES = f"{constants.GROUP}/shares"  # a share ledger: JSON, claim UID -> entry
LABEL_SHARES = f"{constants.GROUP}/shares"  # "milli" on a share ledger
SHARES_MARK = "milli"
SHARE_LABEL_PREFIX = f"s.{constants.GROUP}/"  # + a claim UID: one label per ledger entry
WHOLE_MILLI = 1000  # a GPU, in milli-GPU
MANAGED = f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}"  # label selector of every device Lease


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeaseInfo:
    """A device Lease as the controller reads it."""

    name: str
    uid: str
    holder: str
    claim_namespace: str
    claim_name: str
    claim_resource_version: str  # the claim's version its creating attempt planned from ("" if unknown)
    node: str
    deleting: bool  # has a deletionTimestamp (kept by the finalizer)
    # A share ledger's entry (``entries``): this claim's milli-GPU of the GPU; 0 for a whole Lease.
    milli: int = 0
    # A share ledger as a whole (``parse``): its entries, holder "" (empty for a whole Lease).
    shares: tuple[LeaseInfo, ...] = ()
    ledger: bool = False  # a share ledger, even an empty one

    @property
    def used_milli(self) -> int:
        """The milli-GPU the Lease takes of its GPU: all of it for a whole Lease, else its shares'."""
        return sum(s.milli for s in self.shares) if self.ledger else WHOLE_MILLI


def parse(raw: Mapping[str, Any]) -> LeaseInfo:
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    namespace, name = constants.lease_claim(metadata)
    annotations = metadata.get("annotations") or {}
    labels = metadata.get("labels") or {}
    info = LeaseInfo(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        holder=str(spec.get("holderIdentity") or ""),
        claim_namespace=namespace,
        claim_name=name,
        claim_resource_version=str(annotations.get(ANNOTATION_CLAIM_RESOURCE_VERSION, "")),
        node=str(labels.get(constants.LABEL_NODE, "")),
        deleting=bool(metadata.get("deletionTimestamp")),
    )
    if labels.get(LABEL_SHARES) != SHARES_MARK:
        return info
    entries = tuple(
        dataclasses.replace(
            info,
            holder=uid,
            claim_namespace=str(entry.get("namespace", "")),
            claim_name=str(entry.get("name", "")),
            claim_resource_version=str(entry.get("claimResourceVersion", "")),
            milli=int(entry.get("milli", 0)),
        )
        for uid, entry in sorted(ledger(raw).items())
    )
    return dataclasses.replace(info, holder="", shares=entries, ledger=True)


def ledger(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A share ledger's entries as stored, by claim UID (empty for any other Lease). An annotation
    that does not parse reads as one entry taking the whole GPU, so that it is never handed out."""
    metadata = raw.get("metadata") or {}
    text = (metadata.get("annotations") or {}).get(ANNOTATION_SHARES)
    if not text:
        return {}
    try:
        entries = json.loads(text)
        if isinstance(entries, dict) and all(
            isinstance(e, dict) and isinstance(e.get("milli"), int) for e in entries.values()
        ):
            return {str(k): dict(v) for k, v in entries.items()}
    except ValueError:
        pass
    return {"": {"milli": WHOLE_MILLI}}


def held_by(raw: Mapping[str, Any], uid: str) -> LeaseInfo | None:
    """What claim ``uid`` holds of this Lease: the whole Lease, its ledger entry, or None."""
    info = parse(raw)
    if not info.ledger:
        return info if info.holder == uid else None
    return next((s for s in info.shares if s.holder == uid), None)


def holdings(info: LeaseInfo) -> tuple[LeaseInfo, ...]:
    """What each claim holds of a parsed Lease: its ledger's entries, or the Lease itself."""
    return info.shares if info.ledger else (info,)


def _share_labels(base: Mapping[str, str], entries: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    labels = {k: v for k, v in base.items() if not k.startswith(SHARE_LABEL_PREFIX)}
    labels.update({SHARE_LABEL_PREFIX + uid: str(e["milli"]) for uid, e in entries.items() if uid})
    return labels


def with_ledger(raw: Mapping[str, Any], entries: Mapping[str, Mapping[str, Any]]) -> Obj:
    """``raw`` (a share ledger as read, resourceVersion kept: the PUT's precondition) with these
    entries instead of its own."""
    metadata = dict(raw.get("metadata") or {})
    annotations = dict(metadata.get("annotations") or {})
    annotations[ANNOTATION_SHARES] = json.dumps(dict(entries), sort_keys=True, separators=(",", ":"))
    metadata["annotations"] = annotations
    metadata["labels"] = _share_labels(metadata.get("labels") or {}, entries)
    return {**raw, "metadata": metadata}


def share_entry(*, milli: int, claim_namespace: str, claim_name: str, claim_resource_version: str) -> Obj:
    """One entry of a share ledger."""
    return {
        "milli": milli,
        "namespace": claim_namespace,
        "name": claim_name,
        "claimResourceVersion": claim_resource_version,
    }


def share_lease(
    namespace: str, *, uuid: str, node: str, entries: Mapping[str, Mapping[str, Any]], now: datetime.datetime
) -> Obj:
    """The share ledger of GPU ``uuid``, as its first share creates it."""
    lease = body(
        namespace,
        constants.lease_name(uuid),
        holder="",
        labels={
            constants.LABEL_NODE: node,
            constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
            LABEL_SHARES: SHARES_MARK,
        },
        finalizers=(FINALIZER,),
        now=now,
    )
    return with_ledger(lease, entries)


def micro_time(when: datetime.datetime) -> str:
    """A ``MicroTime`` as the API server writes it: RFC 3339, microseconds, UTC, ``Z``."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def body(
    namespace: str,
    name: str,
    *,
    holder: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
    finalizers: tuple[str, ...] = (),
    duration_seconds: int | None = None,
    now: datetime.datetime,
) -> Obj:
    """A Lease object to create."""
    spec: Obj = {"holderIdentity": holder, "acquireTime": micro_time(now), "renewTime": micro_time(now)}
    if duration_seconds is not None:
        spec["leaseDurationSeconds"] = duration_seconds
    metadata: Obj = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    if finalizers:
        metadata["finalizers"] = list(finalizers)
    return {"apiVersion": API_VERSION, "kind": "Lease", "metadata": metadata, "spec": spec}


def device_lease(
    namespace: str,
    *,
    lock_id: str,
    node: str,
    claim_namespace: str,
    claim_name: str,
    claim_uid: str,
    claim_resource_version: str,
    now: datetime.datetime,
) -> Obj:
    """The Lease that locks a device (its UUID, or a shared GPU's slot: ``models.DeviceRef.lock_id``)
    for a claim (created by one allocation attempt)."""
    return body(
        namespace,
        constants.lease_name(lock_id),
        holder=claim_uid,
        labels={
            constants.LABEL_NODE: node,
            constants.LABEL_CLAIM_NAMESPACE: claim_namespace,
            # The node's name is its kubernetes.io/hostname label, so it fits; a claim's name may not.
            constants.LABEL_CLAIM_NAME: constants.shorten_label_value(claim_name),
            constants.LABEL_CLAIM_UID: claim_uid,
            constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
        },
        annotations={
            constants.LABEL_CLAIM_NAMESPACE: claim_namespace,
            constants.LABEL_CLAIM_NAME: claim_name,
            ANNOTATION_CLAIM_RESOURCE_VERSION: claim_resource_version,
        },
        finalizers=(FINALIZER,),
        now=now,
    )


HEARTBEAT_NAMESPACE_SUFFIX = "-heartbeats"


def heartbeat_namespace(lease_namespace: str, given: str | None = None) -> str:
    """Where the heartbeat Leases live: ``given`` (a --heartbeat-namespace flag) when set, even
    empty; else ``<device Lease namespace>-heartbeats`` (the chart's ``gpualloc.heartbeatNamespace``
    is the same), and "" without a device Lease namespace. ValueError when the derived name is
    longer than a namespace name may be: then it has to be given."""
    if given is not None:
        return given
    if not lease_namespace:
        return ""
    name = lease_namespace + HEARTBEAT_NAMESPACE_SUFFIX
    if len(name) > 63:
        raise ValueError(f"{name} is longer than 63 characters: give the heartbeat namespace")
    return name


def heartbeat_lease(
    namespace: str, *, node: str, now: datetime.datetime, owner: Mapping[str, Any] | None = None
) -> Obj:
    """The heartbeat Lease of ``node``, as its agent first creates it: named after the node, held by
    it, and owned by the Node object ``owner`` when given (``ownerReferences`` entry), so that the
    garbage collector deletes it with the Node, as the kubelet's node Lease."""
    lease = body(
        namespace, node, holder=node, labels={constants.LABEL_MANAGED_BY: constants.MANAGED_BY}, now=now
    )
    if owner is not None:
        lease["metadata"]["ownerReferences"] = [dict(owner)]
    return lease


def renewal(now: datetime.datetime) -> Obj:
    """The merge patch that renews a heartbeat Lease."""
    return {"spec": {"renewTime": micro_time(now)}}


def renewed_at(raw: Mapping[str, Any]) -> str:
    """A heartbeat Lease's renewTime as written ("" when it has none)."""
    return str((raw.get("spec") or {}).get("renewTime") or "")
