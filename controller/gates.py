"""The gate, pure: pods held by the ``gpu.scheduling/claim-allocated`` scheduling gate, and which
pods use a claim.

* ``pod_allocation`` / ``placement_conflict`` / ``ungate_patch``: what a gated pod gets once its
  claim is Allocated;
* ``pods_using``: the pods that keep a claim in use (its devices cannot be released);
* ``given_devices`` / ``kept_of_live_pod`` / ``held_by_pods``: the GPUs live pods were given,
  which stay in use whatever happens to their claim (pods are the ground truth of use).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

import jsonpatch

from controller import unplaceable
from gpualloc.api import constants, models, pods, quantities, requests

Obj = dict[str, Any]


def is_gated(pod: Mapping[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == constants.SCHEDULING_GATE for g in gates)


def pod_claim(pod: Mapping[str, Any]) -> str | None:
    """The ``namespace/name`` key of the claim a pod references, or None."""
    metadata = pod.get("metadata") or {}
    name = (metadata.get("annotations") or {}).get(constants.ANNOTATION_CLAIM)
    if not name:
        return None
    return f"{metadata.get('namespace', '')}/{name}"


# What the controller's cache keeps of a gated pod: enough for ``pod_allocation``, ``placement_conflict``
# and ``ungate_patch`` (a JSON Patch from a diff of what is kept touches only those fields).
_KEPT_ANNOTATIONS = frozenset(
    {constants.ANNOTATION_CLAIM, constants.ANNOTATION_DEVICES, *pods.REPLICA_ANNOTATIONS}
)
_KEPT_LABELS = frozenset({constants.LABEL_GATED, *pods.REPLICA_LABELS})
_NAME_MAX = 253
_HUGEPAGES_KEPT = 4  # hugepages-* sizes kept of a pod's requests: made-up names cannot grow the cache
REQUESTS = "requests"  # the cached form's own field: what the pod requests (``kept_requests``)
PER_NODE = "perNode"  # the cached form's own field: true for a DaemonSet's pod or a static pod's mirror


def kept_requests(pod: Obj) -> dict[str, int]:
    """What the pod requests of the resources gpualloc counts, as kube-scheduler sums them
    (``requests.pod_requests``, with ``pods: 1``): cpu, memory, ephemeral-storage and at most
    ``_HUGEPAGES_KEPT`` hugepages sizes. The controller keeps only this of a pod's containers."""
    asked = requests.pod_requests(pod)
    kept = {name: value for name, value in asked.items() if name in requests.STANDARD}
    huge = sorted(name for name in asked if name.startswith(quantities.HUGEPAGES_PREFIX))
    kept.update({name: asked[name] for name in huge[:_HUGEPAGES_KEPT]})
    return kept


def requests_of(kept: Mapping[str, Any]) -> Mapping[str, int]:
    """What a cached pod (``kept_of_pod``, ``kept_of_live_pod``) requests."""
    value = kept.get(REQUESTS)
    return value if isinstance(value, Mapping) else {}


def kept_of_pod(pod: Obj) -> Obj:
    """The part of a gated pod the controller caches. Tenants create pods: a pod with a large
    annotation or spec costs the controller only these few fields, and a claim name longer
    than any object name is dropped."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = {
        k: v
        for k, v in (metadata.get("annotations") or {}).items()
        if k in _KEPT_ANNOTATIONS and isinstance(v, str) and len(v) <= _NAME_MAX
    }
    labels = {k: v for k, v in (metadata.get("labels") or {}).items() if k in _KEPT_LABELS}
    kept_meta: Obj = {
        key: metadata[key] for key in ("name", "namespace", "uid", "resourceVersion") if key in metadata
    }
    kept_meta["annotations"] = annotations
    kept_meta["labels"] = labels
    kept_spec = {key: spec[key] for key in ("schedulingGates", "nodeSelector", "affinity") if key in spec}
    return {
        "apiVersion": pod.get("apiVersion", "v1"),
        "kind": pod.get("kind", "Pod"),
        "metadata": kept_meta,
        "spec": kept_spec,
        REQUESTS: kept_requests(pod),
    }


def pods_using(claim_name: str, candidates: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods among ``candidates`` (one namespace's, read from the API server) that use the claim
    ``claim_name``: annotated with it and not Succeeded or Failed. While there are any, the claim
    is in use and keeps its devices.

    A pod still waiting at our scheduling gate counts too: another controller whose cache is
    behind may be un-gating it onto the claim's devices at this very moment (the deterministic
    simulation found that race, seed 9280). Such a pod of a claim being deleted is never
    un-gated again; deleting it lets the claim go.
    """
    using = []
    for pod in candidates:
        annotations = (pod.get("metadata") or {}).get("annotations") or {}
        if annotations.get(constants.ANNOTATION_CLAIM) != claim_name:
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        using.append(pod)
    return using


def pods_done(claim_name: str, candidates: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The pods among ``candidates`` annotated with the claim that are Succeeded or Failed."""
    return [
        pod
        for pod in candidates
        if ((pod.get("metadata") or {}).get("annotations") or {}).get(constants.ANNOTATION_CLAIM)
        == claim_name
        and (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
    ]


def replica_index(pod: Mapping[str, Any]) -> int | None:
    """The replica an admitted pod of a claim is (0 when it names none: a one-replica claim's),
    or None when its index is malformed (the webhook admits no such pod)."""
    metadata = pod.get("metadata") or {}
    try:
        found = pods.replica_of(
            {"annotations": metadata.get("annotations") or {}, "labels": metadata.get("labels") or {}}
        )
    except pods.ReplicaError:
        return None
    return 0 if found is None else found.index


def pod_allocation(pod: Mapping[str, Any], claim: models.GpuClaim) -> tuple[models.Allocation | None, str]:
    """The allocation a gated pod gets, or None and the reason it cannot get one."""
    metadata = pod.get("metadata") or {}
    try:  # the webhook's rule: a malformed index is an error, never replica 0
        found = pods.replica_of(
            {"annotations": metadata.get("annotations") or {}, "labels": metadata.get("labels") or {}}
        )
    except pods.ReplicaError as exc:
        return None, str(exc)
    replica = None if found is None else found.index
    if replica is None:
        if claim.spec.replicas != 1:
            return None, (
                f"claim {claim.metadata.name} has {claim.spec.replicas} replicas and the pod names none "
                f"(annotation {constants.ANNOTATION_REPLICA} or a pod-index / completion-index label)"
            )
        replica = 0
    for alloc in claim.status.allocations:
        if alloc.replica == replica:
            return alloc, ""
    return None, f"claim {claim.metadata.name} has no replica {replica}"


def placement_conflict(
    pod: Mapping[str, Any], claim: models.GpuClaim, allocation: models.Allocation
) -> str | None:
    """Why a gated pod cannot have ``allocation``, or None: a hostname nodeSelector or a required
    node affinity that rules its node out (the webhook denies such pods when it sees the claim
    Allocated), or devices that the webhook recorded and the claim does not hold.

    The webhook admits a pod of an Allocated claim from its watch, which may be behind: the claim
    may have been deleted and created again under its name, and hold other devices now. Such a
    pod carries the old devices in its spec, so it must never start."""
    spec = pod.get("spec") or {}
    node = allocation.node_name
    recorded = ((pod.get("metadata") or {}).get("annotations") or {}).get(constants.ANNOTATION_DEVICES)
    holds = ",".join(d.uuid for d in allocation.devices)
    if recorded is not None and recorded != holds:
        return (
            f"the webhook gave the pod devices {recorded} from an out-of-date view of claim "
            f"{claim.metadata.name}, which holds {holds} now; delete the pod and create it again"
        )
    pinned = (spec.get("nodeSelector") or {}).get(constants.HOSTNAME_LABEL)
    if pinned and pinned != node:
        return f"pod is pinned to {pinned} but claim {claim.metadata.name} is on {node}"
    excluded = pods.affinity_excludes(spec.get("affinity"), node)
    if excluded is not None:
        return f"pod is kept off {node}, where claim {claim.metadata.name} is, by its {excluded}"
    return None


def ungate_patch(pod: Mapping[str, Any], allocation: models.Allocation) -> list[Obj]:
    """The JSON Patch that hands a gated pod its devices and lets it schedule.

    Adds the ``gpu.scheduling/devices`` annotation (UUIDs, comma-joined) and the
    ``kubernetes.io/hostname`` nodeSelector (allowed while the pod is gated),
    and removes only our scheduling gate and the ``gpu.scheduling/gated`` label the
    webhook put on the pod. The patch is a diff of a deep copy, led by a
    ``test`` of the gate list so a concurrent change to the gates makes it fail
    instead of removing the wrong entry, and by a ``test`` of the pod's
    resourceVersion as ``pod`` holds it: any write to the pod since (such as the
    sweep's ``fence_patch``) makes it fail too, and the caller looks again.
    """
    new = copy.deepcopy(dict(pod))
    metadata = new.setdefault("metadata", {})
    annotations = metadata.get("annotations")
    if annotations is None:
        annotations = metadata["annotations"] = {}
    annotations[constants.ANNOTATION_DEVICES] = ",".join(d.uuid for d in allocation.devices)
    limit = pods.share_memory_limit(allocation.devices)
    if limit:
        annotations[constants.ANNOTATION_MPS_MEMORY_LIMIT] = limit
    spec = new.setdefault("spec", {})
    selector = spec.get("nodeSelector")
    if selector is None:
        selector = spec["nodeSelector"] = {}
    selector.setdefault(constants.HOSTNAME_LABEL, allocation.node_name)
    labels = metadata.get("labels")
    if isinstance(labels, dict):  # ``new`` is a deep copy: edit it in place
        labels.pop(constants.LABEL_GATED, None)
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    remaining = [g for g in gates if g.get("name") != constants.SCHEDULING_GATE]
    if remaining:
        spec["schedulingGates"] = remaining
    else:
        spec.pop("schedulingGates", None)
    ops: list[Obj] = list(jsonpatch.make_patch(dict(pod), new))
    if gates:
        ops.insert(0, {"op": "test", "path": "/spec/schedulingGates", "value": gates})
    version = metadata.get("resourceVersion")
    if version:
        ops.insert(0, {"op": "test", "path": "/metadata/resourceVersion", "value": version})
    return ops


def fence_patch(pod: Mapping[str, Any], claim_uid: str) -> list[Obj]:
    """The JSON Patch that marks a gated pod of a vanished claim (``gpu.scheduling/claim-gone``:
    its uid) while the pod is still gated (a ``test`` of the gate list, which fails once the pod
    was un-gated). An un-gate decided on that claim, before it vanished, carries the pod's older
    resourceVersion (``ungate_patch``), so after this write it can never land: the claim's Leases
    may then go, although the pod is still there."""
    new = copy.deepcopy(dict(pod))
    annotations = new.setdefault("metadata", {}).get("annotations")
    if annotations is None:
        annotations = new["metadata"]["annotations"] = {}
    annotations[constants.ANNOTATION_CLAIM_GONE] = claim_uid
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return [
        {"op": "test", "path": "/spec/schedulingGates", "value": gates},
        *jsonpatch.make_patch(dict(pod), new),
    ]


# ------------------------------------------------------------------ pods as the ground truth of use

_DEVICES_MAX = 16384  # longer than any devices annotation the webhook or the controller writes


def given_devices(pod: Mapping[str, Any]) -> tuple[str, frozenset[str]] | None:
    """(claim name, device UUIDs) a pod was given: its devices annotation, read only on a pod that
    also names its claim, which is a pod the webhook admitted (it sets or removes the devices
    annotation of every such pod, and the pod-annotation policy keeps both fixed afterwards). A
    devices annotation on any other pod never went through gpualloc and means nothing: counting it
    would let a tenant mark any GPU in use. None when the pod was given no device."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    claim = annotations.get(constants.ANNOTATION_CLAIM)
    devices = annotations.get(constants.ANNOTATION_DEVICES)
    if not isinstance(claim, str) or not claim or not isinstance(devices, str):
        return None
    uuids = frozenset(u for u in devices.split(",") if u)
    return (claim, uuids) if uuids else None


def kept_of_live_pod(pod: Obj) -> Obj:
    """The part of a live (not Succeeded or Failed) pod the controller caches: its identity, node,
    whether our gate still holds it, the two gpualloc annotations (bounded), and what it requests
    (``kept_requests``: its node's running sum counts it). Every pod of the
    cluster is watched, so this is kept small: a tenant's large pod costs these few fields."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = {
        k: v
        for k, v in (metadata.get("annotations") or {}).items()
        if k in (constants.ANNOTATION_CLAIM, constants.ANNOTATION_DEVICES)
        and isinstance(v, str)
        and len(v) <= (_DEVICES_MAX if k == constants.ANNOTATION_DEVICES else _NAME_MAX)
    }
    kept_meta: Obj = {
        k: metadata[k] for k in ("name", "namespace", "uid", "resourceVersion") if k in metadata
    }
    if annotations:
        kept_meta["annotations"] = annotations
    kept_spec: Obj = {k: spec[k] for k in ("nodeName",) if k in spec}
    if is_gated(pod):
        kept_spec["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]
    kept: Obj = {
        "apiVersion": pod.get("apiVersion", "v1"),
        "kind": pod.get("kind", "Pod"),
        "metadata": kept_meta,
        "spec": kept_spec,
        REQUESTS: kept_requests(pod),
    }
    if one_per_node(metadata):
        kept[PER_NODE] = True
    if annotations.get(constants.ANNOTATION_CLAIM):
        kept.update(unplaceable.kept_fields(pod))  # the scheduler's verdict on a claim pod
    return kept


def one_per_node(metadata: Mapping[str, Any]) -> bool:
    """Whether a pod of this metadata is one of a kind on every node rather than a workload's: its
    controller is a DaemonSet, or a Node (a static pod's mirror)."""
    owners = [ref for ref in metadata.get("ownerReferences") or () if isinstance(ref, Mapping)]
    return any(ref.get("controller") is True and ref.get("kind") in ("DaemonSet", "Node") for ref in owners)


def workload_pod(kept: Mapping[str, Any]) -> bool:
    """Whether a cached live pod is a task of the cluster's workload that takes no GPU: no claim of
    gpualloc's, not one per node (``one_per_node``)."""
    return pod_claim(kept) is None and not kept.get(PER_NODE)


def held_by_pods(claim_name: str, candidates: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The device UUIDs the live, un-gated pods among ``candidates`` (one namespace's, read from the
    API server) that name claim ``claim_name`` were given. A devices annotation on a gated pod is a
    webhook's view, not a use (the sweep fences such pods instead: ``fence_patch``)."""
    return frozenset(
        uuid
        for pod in pods_using(claim_name, candidates)
        if not is_gated(pod) and (given := given_devices(pod)) is not None
        for uuid in given[1]
    )
