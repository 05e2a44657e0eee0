"""The ResourceClaims a GpuClaim's allocation projects to (issue 42), and what to do to get them. Pure.

With ``--dra``, every replica of an Allocated GpuClaim has a ``resource.k8s.io/v1``
ResourceClaim ``constants.resource_claim_name(claim, replica)`` in the claim's namespace, owned
by the GpuClaim (``controller: true``: the garbage collector deletes it with the claim), whose
``status.allocation`` names the replica's devices as driver ``gpu.gpualloc.dev``'s, in the pool
of the replica's node, with a node selector on that node. kube-scheduler takes such a claim as
allocated by someone else: it places the pod naming it on that node and adds the pod to
``status.reservedFor``; the kubelet then asks the driver (the agent) to prepare exactly those
devices. The GpuClaim's Leases stay the lock: a ResourceClaim is only a projection of the
GpuClaim's status, and ``plan`` makes the one follow the other.

What the API server allows (kube-apiserver v1.36.3, checked by
``tests/integration/test_dra_resourceclaims.py``): ``spec`` is immutable; ``status`` given at
creation is dropped (so a claim takes a create and a status write); ``status.allocation``, once
set, cannot be changed, only removed, and only while ``reservedFor`` is empty. So when a replica
moves, its ResourceClaim keeps its name and uid, and has its allocation removed then written
anew, once no pod is reserved for it any more (kube-controller-manager's resourceclaim
controller removes the pods that are gone from ``reservedFor``). That is two writes, against
three for a delete and a re-create, and the name never stops existing under a pod that names it.

gpualloc's ResourceClaims carry no ``resource.kubernetes.io/delete-protection`` finalizer: with
it, kube-controller-manager would clear the allocation each time the last pod of a replica ends,
and the mirror would have to write it again for the next pod; without it the allocation stays as
long as the GpuClaim holds the devices, which is what it projects.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gpualloc.api import constants, models

Obj = dict[str, Any]

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceClaim"
# The label selector of every ResourceClaim the controller writes (its watch reads only those).
MANAGED = f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY},{constants.LABEL_CLAIM_NAME}"


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """One device of an allocation, as ``status.allocation.devices.results`` lists it."""

    pool: str
    device: str


@dataclasses.dataclass(frozen=True, slots=True)
class Allocated:
    """What an allocation says, in a form to compare: its node and its devices, in order."""

    node: str
    results: tuple[Result, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Wanted:
    """The ResourceClaim one replica should have."""

    name: str
    count: int
    allocated: Allocated


# The steps of a plan, each one API call.
@dataclasses.dataclass(frozen=True, slots=True)
class Create:
    body: Obj


@dataclasses.dataclass(frozen=True, slots=True)
class WriteAllocation:
    name: str  # its status.allocation written; its resourceVersion is the one the create or clear answered
    allocated: Allocated


@dataclasses.dataclass(frozen=True, slots=True)
class ClearAllocation:
    name: str
    resource_version: str


@dataclasses.dataclass(frozen=True, slots=True)
class Delete:
    name: str
    uid: str


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    """Nothing can be done until the pods in ``reservedFor`` are gone (its watch event wakes the claim)."""

    name: str
    reserved: int


Step = Create | WriteAllocation | ClearAllocation | Delete | Wait


# ------------------------------------------------------------------ the desired objects


def wanted(claim: models.GpuClaim) -> dict[str, Wanted]:
    """The ResourceClaims ``claim`` should have, by name: one per replica holding devices, while the
    claim is Allocated; none otherwise."""
    if claim.status.phase != constants.PHASE_ALLOCATED:
        return {}
    out: dict[str, Wanted] = {}
    for allocation in claim.status.allocations:
        if not allocation.devices:
            continue
        name = constants.resource_claim_name(claim.metadata.name, allocation.replica)
        results = tuple(
            Result(pool=allocation.node_name, device=constants.dra_device_name(d.lock_id))
            for d in allocation.devices
        )
        out.setdefault(
            name,
            Wanted(
                name=name,
                count=len(allocation.devices),
                allocated=Allocated(node=allocation.node_name, results=results),
            ),
        )
    return out


def body(claim: models.GpuClaim, want: Wanted) -> Obj:
    """The ResourceClaim to create for ``want`` (its status is written after, ``allocation_json``)."""
    meta = claim.metadata
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": want.name,
            "namespace": meta.namespace,
            "labels": {
                constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
                constants.LABEL_CLAIM_NAME: constants.shorten_label_value(meta.name),
            },
            # The whole name, which the label holds only up to 63 characters.
            "annotations": {constants.LABEL_CLAIM_NAME: meta.name},
            "ownerReferences": [
                {
                    "apiVersion": constants.API_VERSION,
                    "kind": constants.CLAIM_KIND,
                    "name": meta.name,
                    "uid": meta.uid,
                    "controller": True,
                    "blockOwnerDeletion": False,
                }
            ],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": constants.DRA_REQUEST,
                        "exactly": {"deviceClassName": constants.DRA_DRIVER, "count": want.count},
                    }
                ]
            }
        },
    }


def allocation_json(allocated: Allocated, timestamp: str = "") -> Obj:
    """``status.allocation`` for ``allocated``: its devices as driver gpu.gpualloc.dev's, in the pool
    of their node, and a node selector on that node; ``allocationTimestamp`` when given (RFC 3339).

    The timestamp is needed: kube-scheduler v1.36 stamps an allocation that has none when it
    reserves the claim for a pod, and that write is refused (the allocation is immutable), so the
    pod is never bound. One already stamped it leaves as it is."""
    out: Obj = {
        "devices": {
            "results": [
                {
                    "request": constants.DRA_REQUEST,
                    "driver": constants.DRA_DRIVER,
                    "pool": r.pool,
                    "device": r.device,
                }
                for r in allocated.results
            ]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [allocated.node]}]}
            ]
        },
    }
    if timestamp:
        out["allocationTimestamp"] = timestamp
    return out


# ------------------------------------------------------------------ reading what exists


def claim_key(rc: Mapping[str, Any]) -> str:
    """``namespace/name`` of the GpuClaim a ResourceClaim of ours projects (its annotation, else its
    label); "" for one that names none."""
    meta = rc.get("metadata") or {}
    name = str((meta.get("annotations") or {}).get(constants.LABEL_CLAIM_NAME) or "")
    name = name or str((meta.get("labels") or {}).get(constants.LABEL_CLAIM_NAME) or "")
    return f"{meta.get('namespace', '')}/{name}" if name else ""


def owner_uid(rc: Mapping[str, Any]) -> str:
    for ref in (rc.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return str(ref.get("uid") or "")
    return ""


def allocated_of(rc: Mapping[str, Any]) -> Allocated | None:
    """What a ResourceClaim's ``status.allocation`` says, None when it has none. The node is the
    first value of its first node selector term's first field requirement (the form ours take)."""
    allocation = (rc.get("status") or {}).get("allocation")
    if not isinstance(allocation, Mapping):
        return None
    results = tuple(
        Result(pool=str(r.get("pool", "")), device=str(r.get("device", "")))
        for r in (allocation.get("devices") or {}).get("results") or []
        if isinstance(r, Mapping)
    )
    node = ""
    terms = (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []
    if terms and isinstance(terms[0], Mapping):
        fields = terms[0].get("matchFields") or []
        if fields and isinstance(fields[0], Mapping):
            values = fields[0].get("values") or []
            node = str(values[0]) if values else ""
    return Allocated(node=node, results=results)


def requested_count(rc: Mapping[str, Any]) -> int:
    requests = ((rc.get("spec") or {}).get("devices") or {}).get("requests") or []
    for request in requests:
        if isinstance(request, Mapping) and request.get("name") == constants.DRA_REQUEST:
            return int((request.get("exactly") or {}).get("count") or 0)
    return 0


def reserved(rc: Mapping[str, Any]) -> int:
    """How many consumers (pods) are in ``status.reservedFor``."""
    return len((rc.get("status") or {}).get("reservedFor") or [])


# ------------------------------------------------------------------ the plan


def plan(claim: models.GpuClaim | None, existing: Mapping[str, Obj]) -> list[Step]:
    """The steps that make ``existing`` (the claim's ResourceClaims, by name) what ``claim`` (None:
    gone) projects to, in order. The steps on one name go one after the other, each on the answer
    of the one before; a ``Wait`` stops the plan for that name until its ``reservedFor`` is empty.

    * missing: create it, then write its allocation;
    * of another GpuClaim of the same name (the claim was deleted and made again), or asking for
      another count (``spec`` is immutable): delete it (it is made again on the next pass);
    * another allocation, or none wanted while the claim exists (a replica that moves, a claim back
      to Pending): remove the allocation, then write the new one if there is one;
    * the claim gone, Released, Preempted or Failed: delete it.

    Every step but a create and a first write waits for ``reservedFor`` to be empty: a pod that
    may still run keeps the devices its ResourceClaim names until kube-controller-manager has
    seen it end.
    """
    want = wanted(claim) if claim is not None else {}
    final = claim is None or claim.status.phase in (
        constants.PHASE_RELEASED,
        constants.PHASE_PREEMPTED,
        constants.PHASE_FAILED,
    )
    steps: list[Step] = []
    for name in sorted(existing):
        rc = existing[name]
        meta = rc.get("metadata") or {}
        target = want.get(name)
        current = allocated_of(rc)
        stale = claim is None or owner_uid(rc) != claim.metadata.uid
        gone = stale or (target is None and final)
        if gone or (target is not None and requested_count(rc) != target.count):
            steps.append(_unless_reserved(rc, Delete(name=name, uid=str(meta.get("uid", "")))))
            continue
        if current == (target.allocated if target is not None else None):
            continue
        if current is not None:
            step = _unless_reserved(rc, ClearAllocation(name=name, resource_version=_rv(rc)))
            steps.append(step)
            if isinstance(step, Wait):
                continue
        if target is not None:
            steps.append(WriteAllocation(name=name, allocated=target.allocated))
    if claim is not None:
        for name in sorted(want.keys() - existing.keys()):
            steps.append(Create(body=body(claim, want[name])))
            steps.append(WriteAllocation(name=name, allocated=want[name].allocated))
    return steps


def _rv(rc: Mapping[str, Any]) -> str:
    return str((rc.get("metadata") or {}).get("resourceVersion", ""))


def _unless_reserved(rc: Mapping[str, Any], step: Delete | ClearAllocation) -> Step:
    count = reserved(rc)
    return Wait(name=step.name, reserved=count) if count else step
