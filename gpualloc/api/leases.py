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
from collections.abc import Mapping
from typing import Any

from gpualloc.api import constants

Obj = dict[str, Any]

API_VERSION = "coordination.k8s.io/v1"
FINALIZER = f"{constants.GROUP}/device-lock"
ANNOTATION_CLAIM_RESOURCE_VERSION = f"{constants.GROUP}/claim-resource-version"
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


def parse(raw: Mapping[str, Any]) -> LeaseInfo:
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    namespace, name = constants.lease_claim(metadata)
    annotations = metadata.get("annotations") or {}
    labels = metadata.get("labels") or {}
    return LeaseInfo(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        holder=str(spec.get("holderIdentity") or ""),
        claim_namespace=namespace,
        claim_name=name,
        claim_resource_version=str(annotations.get(ANNOTATION_CLAIM_RESOURCE_VERSION, "")),
        node=str(labels.get(constants.LABEL_NODE, "")),
        deleting=bool(metadata.get("deletionTimestamp")),
    )


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
