"""Turn caches, a Decision and the held Leases into what the controller writes (pure).

Nothing here does I/O or reads a clock: the reconciler passes ``now`` in.

* ``build_node_views``: the allocator's ``NodeView`` per node from the cached
  Nodes and GpuNodeStatuses, and the caller's word on which device Leases
  another claim UID holds (``taken``).
* ``lock_plan``: the Leases to create for a Decision, sorted by UUID (the one
  global order every controller acquires in), and their labels.
* ``allocated_status`` / ``unallocated_status``: the status merge patches.
* ``allocation_problems`` / ``devices_lost_condition``: what became of the
  devices of an Allocated claim.
* ``record_failure``: the retry bookkeeping behind ``retryPolicy``.
* ``pod_allocation`` / ``placement_conflict`` / ``ungate_patch``: gate mode, for pods held by the
  ``gpu.scheduling/claim-allocated`` scheduling gate.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jsonpatch

from controller import allocator
from controller import queue as work_queue
from gpualloc.api import codecs, constants, models, pods, timestamps

Obj = dict[str, Any]

REASON_ALLOCATED = "Allocated"
REASON_INSUFFICIENT = "InsufficientDevices"
REASON_RETRIES_EXHAUSTED = "RetriesExhausted"
REASON_DEVICE_UNHEALTHY = "DeviceUnhealthy"
REASON_DEVICES_MISSING = "DevicesMissing"
REASON_DEVICES_HEALTHY = "DevicesHealthy"


_FROZEN: dict[str, Any] = {"frozen": True, "slots": True, "kw_only": True}


# ------------------------------------------------------------------- cache views


@dataclasses.dataclass(**_FROZEN)
class NodeFacts:
    """What the allocator needs from a core/v1 Node."""

    name: str
    labels: Mapping[str, str]
    unschedulable: bool


def node_facts(raw: Mapping[str, Any]) -> NodeFacts:
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    return NodeFacts(
        name=str(metadata.get("name", "")),
        labels={str(k): str(v) for k, v in (metadata.get("labels") or {}).items()},
        unschedulable=bool(spec.get("unschedulable", False)),
    )


@dataclasses.dataclass(**_FROZEN)
class LeaseInfo:
    """A device Lease as the controller reads it from its cache."""

    name: str
    uid: str
    holder: str
    claim_namespace: str
    claim_name: str


def lease_info(raw: Mapping[str, Any]) -> LeaseInfo:
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    namespace, name = constants.lease_claim(metadata)
    return LeaseInfo(
        name=str(metadata.get("name", "")),
        uid=str(metadata.get("uid", "")),
        holder=str(spec.get("holderIdentity") or ""),
        claim_namespace=namespace,
        claim_name=name,
    )


# A GpuNodeStatus whose heartbeat is older than this is not allocated from (--node-stale-after).
NODE_STALE_AFTER_S = 120.0


def node_ready(inventory: models.NodeInventory, *, now: datetime.datetime, stale_after: float) -> bool:
    """The GpuNodeStatus Ready condition is True and its heartbeat is at most ``stale_after`` s old."""
    ready = any(c.type == constants.CONDITION_READY and c.status == "True" for c in inventory.conditions)
    if not ready:
        return False
    beat = timestamps.parse_time(inventory.last_heartbeat_time)
    if beat is None:
        return False
    return (now - beat).total_seconds() <= stale_after


def build_node_views(
    *,
    statuses: Mapping[str, models.GpuNodeStatus],
    nodes: Mapping[str, NodeFacts],
    is_taken: Callable[[str], bool],
    now: datetime.datetime,
    stale_after: float,
) -> list[allocator.NodeView]:
    """One ``NodeView`` per GPU node (a node with a GpuNodeStatus), sorted by name.

    ``statuses`` is keyed by node name (``spec.nodeName``). ``is_taken`` says
    whether a device's Lease (by name) is held by another claim than the one
    being planned: Leases that claim holds already are free for it (a retry
    after a crash adopts them). Nodes without a GpuNodeStatus have no GPUs and
    are left out.
    """
    views: list[allocator.NodeView] = []
    for name in sorted(statuses):
        inventory = statuses[name].status
        facts = nodes.get(name)
        taken = frozenset(
            device.uuid for device in inventory.devices if is_taken(constants.lease_name(device.uuid))
        )
        views.append(
            allocator.NodeView(
                name=name,
                labels=facts.labels if facts else {},
                unschedulable=facts.unschedulable if facts else False,
                node_present=facts is not None,
                ready=node_ready(inventory, now=now, stale_after=stale_after),
                inventory=inventory,
                taken=taken,
            )
        )
    return views


def seed_for(uid: str) -> int:
    """A stable seed per claim for ``strategy: random`` (a retry makes the same choice)."""
    value = 0
    for char in uid:
        value = (value * 131 + ord(char)) % (1 << 61)
    return value


# ------------------------------------------------------------------- locking


@dataclasses.dataclass(**_FROZEN)
class LockItem:
    uuid: str
    lease: str
    node: str


def lock_plan(allocations: Iterable[models.Allocation]) -> tuple[LockItem, ...]:
    """The Leases to hold for these allocations, sorted by device UUID (the acquisition order)."""
    items = {
        device.uuid: LockItem(uuid=device.uuid, lease=constants.lease_name(device.uuid), node=alloc.node_name)
        for alloc in allocations
        for device in alloc.devices
    }
    return tuple(items[uuid] for uuid in sorted(items))


def lease_labels(item: LockItem, claim: models.GpuClaim) -> dict[str, str]:
    """For selecting and for ``kubectl get leases -L``. The node's name is its
    ``kubernetes.io/hostname`` label, so it fits; a claim's name may not (``label_value``)."""
    return {
        constants.LABEL_NODE: item.node,
        constants.LABEL_CLAIM_NAMESPACE: claim.metadata.namespace,
        constants.LABEL_CLAIM_NAME: constants.label_value(claim.metadata.name),
        constants.LABEL_CLAIM_UID: claim.metadata.uid,
        constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
    }


def lease_annotations(claim: models.GpuClaim) -> dict[str, str]:
    """The claim's namespace and whole name, which the sweep GETs (``lease_claim`` reads them)."""
    return {
        constants.LABEL_CLAIM_NAMESPACE: claim.metadata.namespace,
        constants.LABEL_CLAIM_NAME: claim.metadata.name,
    }


def recorded_leases(status: models.GpuClaimStatus) -> frozenset[str]:
    """The Lease names of the devices a claim's status lists."""
    return frozenset(constants.lease_name(d.uuid) for a in status.allocations for d in a.devices)


def allocation_complete(claim: models.GpuClaim) -> bool:
    """Allocated, with one allocation per replica (0..replicas-1) and at least one device each."""
    if claim.status.phase != constants.PHASE_ALLOCATED:
        return False
    replicas = sorted(a.replica for a in claim.status.allocations)
    return replicas == list(range(claim.spec.replicas)) and all(a.devices for a in claim.status.allocations)


# ------------------------------------------------------------------- status


def display_fields(allocations: Sequence[models.Allocation]) -> tuple[str, str]:
    """The printer-column strings: nodes ``"n1,n2"`` and devices ``"0,1"`` or ``"n1:0,1;n2:2,3"``."""
    ordered = sorted(allocations, key=lambda a: a.replica)
    nodes: list[str] = []
    for alloc in ordered:
        if alloc.node_name not in nodes:
            nodes.append(alloc.node_name)

    def indices(alloc: models.Allocation) -> str:
        return ",".join(str(d.index) for d in sorted(alloc.devices, key=lambda d: d.index))

    if len(ordered) == 1:
        devices = indices(ordered[0])
    else:
        devices = ";".join(f"{a.node_name}:{indices(a)}" for a in ordered)
    return ",".join(nodes), devices


def set_condition(
    conditions: Sequence[models.Condition], new: models.Condition
) -> tuple[models.Condition, ...]:
    """``conditions`` with ``new`` in place of the one of its type.

    The old ``lastTransitionTime`` is kept when the status did not change,
    as Kubernetes conditions do.
    """
    out: list[models.Condition] = []
    placed = False
    for cond in conditions:
        if cond.type != new.type:
            out.append(cond)
            continue
        placed = True
        if cond.status == new.status and cond.last_transition_time:
            new = dataclasses.replace(new, last_transition_time=cond.last_transition_time)
        out.append(new)
    if not placed:
        out.append(new)
    return tuple(out)


def _conditions_json(conditions: Iterable[models.Condition]) -> list[Obj]:
    return [codecs.encode(c) for c in conditions]


def _condition(
    claim: models.GpuClaim, type_: str, status: str, reason: str, message: str, *, now: datetime.datetime
) -> models.Condition:
    """A condition of ``claim`` at its current generation, changed ``now``."""
    return models.Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=timestamps.format_time(now),
        observed_generation=claim.metadata.generation or None,
    )


def allocated_status(
    claim: models.GpuClaim,
    allocations: Sequence[models.Allocation],
    *,
    now: datetime.datetime,
) -> Obj:
    """The merge patch that records a successful allocation."""
    stamp = timestamps.format_time(now)
    nodes, devices = display_fields(allocations)
    count = sum(len(a.devices) for a in allocations)
    message = f"allocated {count} GPU{'s' if count != 1 else ''} on {nodes}"
    conditions = set_condition(
        [c for c in claim.status.conditions if c.type != constants.CONDITION_DEVICES_LOST],
        _condition(claim, constants.CONDITION_ALLOCATED, "True", REASON_ALLOCATED, message, now=now),
    )
    return {
        "status": {
            "phase": constants.PHASE_ALLOCATED,
            "allocations": [codecs.encode(a) for a in sorted(allocations, key=lambda a: a.replica)],
            "conditions": _conditions_json(conditions),
            "message": message,
            "retryCount": claim.status.retry_count,
            "lastScheduleTime": stamp,
            "observedGeneration": claim.metadata.generation,
            "nodes": nodes,
            "devices": devices,
        }
    }


def unallocated_status(
    claim: models.GpuClaim,
    *,
    phase: str,
    reason: str,
    message: str,
    retry_count: int,
    now: datetime.datetime,
) -> Obj:
    """The merge patch for a claim that holds nothing: Pending (will retry) or Failed."""
    message = " ".join(message.split()) or "no allocation"
    conditions = set_condition(
        claim.status.conditions,
        _condition(claim, constants.CONDITION_ALLOCATED, "False", reason, message, now=now),
    )
    return {
        "status": {
            "phase": phase,
            "allocations": None,
            "conditions": _conditions_json(conditions),
            "message": message,
            "retryCount": retry_count,
            "observedGeneration": claim.metadata.generation,
            "nodes": "",
            "devices": "",
        }
    }


def status_differs(claim: models.GpuClaim, patch: Mapping[str, Any]) -> bool:
    """Would writing ``patch`` change the claim's status (timestamps aside)?"""
    current = codecs.encode(claim.status)
    for key, value in (patch.get("status") or {}).items():
        if key in ("lastScheduleTime",):
            continue
        have = current.get(key)
        if key == "conditions":
            strip = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in value or []]
            have = [{k: v for k, v in c.items() if k != "lastTransitionTime"} for c in have or []]
            if strip != have:
                return True
        elif key == "allocations":
            if (value or []) != (have or []):
                return True
        elif value != have:
            return True
    return False


# ------------------------------------------------------------------- device health


@dataclasses.dataclass(**_FROZEN)
class Problem:
    node: str
    uuid: str
    reason: str  # REASON_DEVICE_UNHEALTHY or REASON_DEVICES_MISSING
    detail: str  # one phrase, e.g. "gpu-3/GPU-5f1c… unhealthy (XID 79)"


def allocation_problems(
    allocations: Sequence[models.Allocation],
    *,
    statuses: Mapping[str, models.GpuNodeStatus],
    nodes: Mapping[str, NodeFacts],
) -> list[Problem]:
    """Devices of an allocation whose Node, GpuNodeStatus or device entry vanished, or that are Unhealthy.

    A stale heartbeat is not a problem here: an agent restart does not take GPUs away.
    """
    problems: list[Problem] = []
    for alloc in sorted(allocations, key=lambda a: a.replica):
        node = alloc.node_name
        status = statuses.get(node)
        by_uuid = {d.uuid: d for d in status.status.devices} if status else {}
        for ref in alloc.devices:
            reason = REASON_DEVICES_MISSING
            if node not in nodes:
                what = "node is gone"
            elif status is None:
                what = "no GpuNodeStatus"
            elif ref.uuid not in by_uuid:
                what = "device is gone"
            elif by_uuid[ref.uuid].health != constants.HEALTHY:
                why = by_uuid[ref.uuid].health_reason
                reason, what = REASON_DEVICE_UNHEALTHY, "unhealthy" + (f" ({why})" if why else "")
            else:
                continue
            detail = f"gpu-{ref.minor}/{ref.uuid} on {node}: {what}"
            problems.append(Problem(node=node, uuid=ref.uuid, reason=reason, detail=detail))
    return problems


# Far below the schema's 32768 for a condition message, and still readable in kubectl describe.
DEVICES_LOST_MESSAGE_LIMIT = 4096


def join_capped(details: Sequence[str], limit: int = DEVICES_LOST_MESSAGE_LIMIT) -> str:
    """``"; ".join(details)`` with as many whole details as fit in ``limit`` characters, then
    ``"... and N more"``: a gang losing hundreds of devices at once must not make the
    status write fail schema validation. Deterministic, so an unchanged list compares equal."""
    joined = "; ".join(details)
    if len(joined) <= limit:
        return joined
    kept: list[str] = []
    used = 0
    for detail in details:
        tail = len(f"; ... and {len(details) - len(kept)} more")
        if used + len(detail) + 2 + tail > limit:
            break
        kept.append(detail)
        used += len(detail) + 2
    return "; ".join([*kept, f"... and {len(details) - len(kept)} more"])


def devices_lost_condition(
    claim: models.GpuClaim,
    problems: Sequence[Problem],
    *,
    lost_leases: Sequence[str] = (),
    now: datetime.datetime,
) -> models.Condition | None:
    """The DevicesLost condition to write, or None when the recorded one is still right.

    True (reason DeviceUnhealthy, or DevicesMissing when any device or its
    Lease is gone) while there are problems; False (DevicesHealthy) once they
    are over; no condition at all for a claim that never had a problem.
    """
    current = next((c for c in claim.status.conditions if c.type == constants.CONDITION_DEVICES_LOST), None)
    details = [p.detail for p in problems] + [
        f"lease {name} is held by another claim" for name in lost_leases
    ]
    if details:
        missing = lost_leases or any(p.reason == REASON_DEVICES_MISSING for p in problems)
        reason = REASON_DEVICES_MISSING if missing else REASON_DEVICE_UNHEALTHY
        message = join_capped(details)
        if current and current.status == "True" and current.reason == reason and current.message == message:
            return None
        return _condition(claim, constants.CONDITION_DEVICES_LOST, "True", reason, message, now=now)
    if current is None or current.status == "False":
        return None
    return _condition(
        claim,
        constants.CONDITION_DEVICES_LOST,
        "False",
        REASON_DEVICES_HEALTHY,
        "every allocated device is present and healthy",
        now=now,
    )


def condition_patch(claim: models.GpuClaim, condition: models.Condition) -> Obj:
    return {"status": {"conditions": _conditions_json(set_condition(claim.status.conditions, condition))}}


# ------------------------------------------------------------------- retries


@dataclasses.dataclass(**_FROZEN)
class RetryState:
    """Failed allocation attempts of one claim, kept in memory (seeded from status.retryCount).

    ``failures`` counts attempts that failed at or after ``not_before`` (the
    end of the previous backoff). An attempt that an event triggered earlier
    (capacity changed) and that failed too is not counted, so a busy cluster
    does not burn a claim's ``maxRetries`` faster than its backoff allows.
    """

    failures: int = 0
    not_before: float = 0.0  # monotonic seconds
    generation: int = 0

    @property
    def retry_count(self) -> int:
        """The status field: retries made so far (attempts after the first)."""
        return max(0, self.failures - 1)


def initial_retry_state(claim: models.GpuClaim) -> RetryState:
    failed_before = any(
        c.type == constants.CONDITION_ALLOCATED and c.status == "False" for c in claim.status.conditions
    )
    failures = claim.status.retry_count + 1 if failed_before else 0
    return RetryState(failures=failures, not_before=0.0, generation=claim.metadata.generation)


def record_failure(
    state: RetryState, *, now: float, policy: models.RetryPolicy, jitter: float
) -> tuple[RetryState, bool]:
    """The state after a failed attempt at ``now``, and whether the attempt counted."""
    if now < state.not_before:
        return state, False
    failures = state.failures + 1
    delay = work_queue.backoff_delay(failures, base=float(policy.backoff_seconds), jitter=jitter)
    return dataclasses.replace(state, failures=failures, not_before=now + delay), True


def retries_exhausted(state: RetryState, policy: models.RetryPolicy) -> bool:
    """``maxRetries`` retries were made and failed (never, for ``maxRetries: 0``)."""
    return policy.max_retries > 0 and state.retry_count >= policy.max_retries


# ------------------------------------------------------------------- gate mode


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
    """Why a gated pod cannot run on its allocation's node (a hostname nodeSelector or a required
    node affinity that rules the node out), or None. The webhook denies the same pods at admission
    when the claim is Allocated already."""
    spec = pod.get("spec") or {}
    node = allocation.node_name
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
    webhook put on the pod. The patch is a diff of a deep copy,
    led by a ``test`` of the gate list so a concurrent change to the gates
    makes it fail instead of removing the wrong entry.
    """
    new = copy.deepcopy(dict(pod))
    metadata = new.setdefault("metadata", {})
    annotations = metadata.get("annotations")
    if annotations is None:
        annotations = metadata["annotations"] = {}
    annotations[constants.ANNOTATION_DEVICES] = ",".join(d.uuid for d in allocation.devices)
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
    return ops
