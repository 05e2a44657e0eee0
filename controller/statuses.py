"""What the controller writes into a claim's status, and what it reads back from it (pure).

Nothing here does I/O or reads a clock: the reconciler passes ``now`` in.

* ``allocated_status`` / ``unallocated_status``: the status merge patches;
* ``allocation_problems`` / ``devices_lost_condition``: what became of the
  devices of an Allocated claim;
* ``in_use_condition``: the pods that use a claim (being deleted, or to be
  released when they complete);
* ``released_status``: a claim whose pods have all completed (``release:
  OnPodsCompleted``).
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from controller import unplaceable
from gpualloc.api import codecs, constants, models, timestamps

Obj = dict[str, Any]

REASON_ALLOCATED = "Allocated"
REASON_INSUFFICIENT = "InsufficientDevices"
REASON_RETRIES_EXHAUSTED = "RetriesExhausted"
REASON_DEVICE_UNHEALTHY = "DeviceUnhealthy"
REASON_DEVICES_MISSING = "DevicesMissing"
REASON_DEVICES_HEALTHY = "DevicesHealthy"
CONDITION_IN_USE = "InUse"
REASON_PODS_RUNNING = "PodsRunning"
REASON_PODS_COMPLETED = "PodsCompleted"
REASON_RELEASED = "Released"
CONDITION_NODE_LOST = "NodeLost"
REASON_NODE_LOST = "NodeLost"
REASON_NODES_BACK = "NodesBack"
REASON_REALLOCATED = "Reallocated"
CONDITION_UNPLACEABLE = "Unplaceable"
REASON_UNPLACEABLE = "Unplaceable"  # the claim moved: its pods could not be scheduled on its node
REASON_BARE_POD = "BarePod"  # it cannot move: a pod no workload controller owns cannot change its node
REASON_PLACEABLE = "Placeable"
REASON_PREEMPTED = "Preempted"
REASON_PREEMPTING = "Preempting"


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


def make_condition(
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
        make_condition(claim, constants.CONDITION_ALLOCATED, "True", REASON_ALLOCATED, message, now=now),
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
        make_condition(claim, constants.CONDITION_ALLOCATED, "False", reason, message, now=now),
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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    node: str
    uuid: str
    reason: str  # REASON_DEVICE_UNHEALTHY or REASON_DEVICES_MISSING
    detail: str  # one phrase, e.g. "gpu-3/GPU-5f1c… unhealthy (XID 79)"


def allocation_problems(
    allocations: Sequence[models.Allocation],
    *,
    statuses: Mapping[str, models.GpuNodeStatus],
    nodes: Mapping[str, Any],  # node name -> views.NodeFacts; only presence is read
) -> list[Problem]:
    """Devices of an allocation whose Node, GpuNodeStatus or device entry vanished, or that are Unhealthy.

    A stale heartbeat is not a problem here: an agent restart does not take GPUs away.
    """
    problems: list[Problem] = []
    for alloc in sorted(allocations, key=lambda a: a.replica):
        node = alloc.node_name
        status = statuses.get(node)
        # A MIG instance stands or falls with its parent GPU (its health is the GPU's).
        by_uuid = {uuid: d for d in (status.status.devices if status else ()) for uuid in d.lock_ids}
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
            detail = f"{constants.device_display(ref.minor, ref.uuid)} on {node}: {what}"
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
    taken: Mapping[str, str] | None = None,
    now: datetime.datetime,
) -> models.Condition | None:
    """The DevicesLost condition to write, or None when the recorded one is still right.

    True while there are problems: reason ``DevicesTaken`` when another claim
    holds one of its Leases (``taken``: lease name -> one phrase; the webhook
    then refuses the claim's new pods), else ``DevicesMissing`` when a device
    is gone. False (DevicesHealthy) once they are over; no condition at all for
    a claim that never had a problem. An Unhealthy device is ``failures``'
    ``DevicesUnhealthy``, not a lost one.
    """
    taken = taken or {}
    current = next((c for c in claim.status.conditions if c.type == constants.CONDITION_DEVICES_LOST), None)
    missing = [p.detail for p in problems if p.reason == REASON_DEVICES_MISSING]
    details = [taken[name] for name in sorted(taken)] + missing
    if details:
        if taken:
            reason = constants.REASON_DEVICES_TAKEN
            details[len(taken) - 1] += "; delete and re-create this claim to get other GPUs"
        else:
            reason = REASON_DEVICES_MISSING
        message = join_capped(details)
        if current and current.status == "True" and current.reason == reason and current.message == message:
            return None
        return make_condition(claim, constants.CONDITION_DEVICES_LOST, "True", reason, message, now=now)
    if current is None or current.status == "False":
        return None
    return make_condition(
        claim,
        constants.CONDITION_DEVICES_LOST,
        "False",
        REASON_DEVICES_HEALTHY,
        "every allocated device is present and held by the claim",
        now=now,
    )


def in_use_condition(
    claim: models.GpuClaim, pods: Sequence[str], *, now: datetime.datetime, deleting: bool = True
) -> models.Condition | None:
    """The ``InUse`` condition of a claim that ``pods`` (names) use, or None when the recorded one
    says that already. A claim being deleted keeps its devices until they are gone; a claim with
    ``release: OnPodsCompleted`` gives them back once they have all completed."""
    shown = join_capped(list(pods), limit=1024)
    count = f"{len(pods)} pod{'s' if len(pods) != 1 else ''}"
    if deleting:
        message = (
            f"being deleted, but {count} still use its devices ({shown}); "
            "the devices are released when they finish or are deleted"
        )
    elif claim.spec.release == constants.RELEASE_ON_OWNER_COMPLETED:
        message = (
            f"used by {count} ({shown}); released once its owner has finished and they have completed"
            " (release: OnOwnerCompleted)"
        )
    else:
        message = (
            f"used by {count} ({shown}); released when they have all completed (release: OnPodsCompleted)"
        )
    current = next((c for c in claim.status.conditions if c.type == CONDITION_IN_USE), None)
    if current and current.status == "True" and current.message == message:
        return None
    return make_condition(claim, CONDITION_IN_USE, "True", REASON_PODS_RUNNING, message, now=now)


def condition_patch(claim: models.GpuClaim, condition: models.Condition) -> Obj:
    return conditions_patch(set_condition(claim.status.conditions, condition))


def conditions_patch(conditions: Iterable[models.Condition]) -> Obj:
    return {"status": {"conditions": _conditions_json(conditions)}}


def released_status(claim: models.GpuClaim, *, why: str, now: datetime.datetime) -> Obj:
    """The merge patch of a claim whose work is done (``why``): phase Released, no devices."""
    count = sum(len(a.devices) for a in claim.status.allocations)
    message = f"released {count} GPU{'s' if count != 1 else ''}: {why}; create a new claim for more work"
    conditions = set_condition(
        set_condition(
            claim.status.conditions,
            make_condition(claim, constants.CONDITION_ALLOCATED, "False", REASON_RELEASED, message, now=now),
        ),
        make_condition(claim, CONDITION_IN_USE, "False", REASON_PODS_COMPLETED, message, now=now),
    )
    return {
        "status": {
            "phase": constants.PHASE_RELEASED,
            "allocations": None,
            "conditions": _conditions_json(conditions),
            "message": message,
            "releasedTime": timestamps.format_time(now),
            "observedGeneration": claim.metadata.generation,
            "nodes": "",
            "devices": "",
        }
    }


def node_lost_condition(
    claim: models.GpuClaim, lost: Sequence[str], *, now: datetime.datetime
) -> models.Condition | None:
    """``onNodeLoss: Reallocate``: the ``NodeLost`` condition for the claim's ``lost`` nodes (True,
    changed when the first was lost: the grace period counts from it; False once none is), or None
    when the recorded one says that already."""
    current = next((c for c in claim.status.conditions if c.type == CONDITION_NODE_LOST), None)
    if lost:
        grace = claim.spec.node_loss_grace_period_seconds
        message = (
            f"{', '.join(lost)} {'is' if len(lost) == 1 else 'are'} deleted or not ready; the claim is"
            f" allocated afresh {grace} s after, once no pod uses it (onNodeLoss: Reallocate)"
        )
        if current and current.status == "True" and current.message == message:
            return None
        return make_condition(claim, CONDITION_NODE_LOST, "True", REASON_NODE_LOST, message, now=now)
    if current is None or current.status != "True":
        return None
    return make_condition(
        claim, CONDITION_NODE_LOST, "False", REASON_NODES_BACK, "its nodes are back", now=now
    )


def lost_for(claim: models.GpuClaim, now: datetime.datetime) -> float:
    """Seconds since the ``NodeLost`` condition turned True (0 when it is not True)."""
    for cond in claim.status.conditions:
        if cond.type == CONDITION_NODE_LOST and cond.status == "True":
            since = timestamps.parse_time(cond.last_transition_time or "")
            return 0.0 if since is None else max(0.0, (now - since).total_seconds())
    return 0.0


def _afresh(
    claim: models.GpuClaim,
    *,
    reason: str,
    message: str,
    settled: Sequence[str],
    now: datetime.datetime,
    **more: Any,
) -> Obj:
    """The merge patch that sends an allocated claim back to Pending without devices, to be
    allocated afresh: the conditions ``settled`` (Allocated among them) False with ``reason``,
    ``DevicesLost`` and ``Unplaceable`` dropped; ``more`` status fields besides."""
    conditions = claim.status.conditions
    for type_ in settled:
        conditions = set_condition(
            conditions, make_condition(claim, type_, "False", reason, message, now=now)
        )
    dropped = (constants.CONDITION_DEVICES_LOST, CONDITION_UNPLACEABLE)
    return {
        "status": {
            "phase": constants.PHASE_PENDING,
            "allocations": None,
            "conditions": _conditions_json(c for c in conditions if c.type not in dropped),
            "message": message,
            **more,
            "observedGeneration": claim.metadata.generation,
            "nodes": "",
            "devices": "",
        }
    }


def reallocating_status(claim: models.GpuClaim, lost: Sequence[str], *, now: datetime.datetime) -> Obj:
    """The merge patch that sends a claim that lost ``lost`` back to Pending, without devices."""
    message = f"allocating afresh: {', '.join(lost)} {'was' if len(lost) == 1 else 'were'} lost"
    settled = (constants.CONDITION_ALLOCATED, CONDITION_NODE_LOST, constants.CONDITION_RELEASING)
    return _afresh(claim, reason=REASON_REALLOCATED, message=message, settled=settled, now=now)


def preempted_status(victim: models.GpuClaim, *, by: models.GpuClaim, now: datetime.datetime) -> Obj:
    """The merge patch that marks ``victim`` preempted by ``by``: phase Preempted; it keeps listing
    its devices (and holding their Leases) until its pods are gone."""
    message = (
        f"preempted by {by.key} (priority {by.spec.priority} > {victim.spec.priority}): its pods are"
        " evicted, then its GPUs are released; create a new claim for more work"
    )
    conditions = set_condition(
        victim.status.conditions,
        make_condition(victim, constants.CONDITION_ALLOCATED, "False", REASON_PREEMPTED, message, now=now),
    )
    return {
        "status": {
            "phase": constants.PHASE_PREEMPTED,
            "preemptedBy": by.key,
            "conditions": _conditions_json(conditions),
            "message": message,
        }
    }


def preemption_done_status(victim: models.GpuClaim) -> Obj:
    """The merge patch of a preempted claim whose pods are gone: no devices any more."""
    count = sum(len(a.devices) for a in victim.status.allocations)
    message = (
        f"preempted by {victim.status.preempted_by}: its pods are gone and its {count}"
        f" GPU{'s' if count != 1 else ''} released; create a new claim for more work"
    )
    return {"status": {"allocations": None, "message": message, "nodes": "", "devices": ""}}


def releasing_condition(
    claim: models.GpuClaim,
    *,
    on: bool,
    now: datetime.datetime,
    why: str = "its work is done",
    reason: str = REASON_PODS_COMPLETED,
) -> models.Condition:
    """The fence written before the last look at the pods when a claim gives its GPUs back while it
    lives (``release: OnPodsCompleted``/``OnOwnerCompleted``, ``onNodeLoss: Reallocate``): the
    webhook admits no pod of a claim that has it, so that look sees every pod that can use the claim.
    Off when pods turned up after all."""
    if on:
        message = f"{why}; its GPUs are being released"
        return make_condition(claim, constants.CONDITION_RELEASING, "True", reason, message, now=now)
    message = "pods use the claim again; it keeps its GPUs"
    return make_condition(
        claim, constants.CONDITION_RELEASING, "False", REASON_PODS_RUNNING, message, now=now
    )


def fence_reason(claim: models.GpuClaim) -> str:
    """The reason of the claim's ``Releasing`` fence ("" when it has none): each path that fences
    a claim lifts only its own."""
    fences = (
        c for c in claim.status.conditions if c.type == constants.CONDITION_RELEASING and c.status == "True"
    )
    return next((c.reason for c in fences), "")


def was_used(claim: models.GpuClaim) -> bool:
    """Has the controller recorded pods using the claim (an ``InUse`` condition)?"""
    return any(c.type == CONDITION_IN_USE for c in claim.status.conditions)


def unplaceable_condition(
    claim: models.GpuClaim, bare: Sequence[str], scheduler: str, *, now: datetime.datetime
) -> models.Condition | None:
    """The ``Unplaceable`` condition of a claim whose pods kube-scheduler cannot place on its node
    (``unplaceable``): True, reason ``BarePod``, while ``bare`` pods hold it there; False once none
    does; None when the recorded one says that already."""
    current = next((c for c in claim.status.conditions if c.type == CONDITION_UNPLACEABLE), None)
    if bare:
        nodes = ", ".join(sorted({a.node_name for a in claim.status.allocations}))
        message = (
            f"pod {', '.join(bare)} cannot be scheduled on {nodes} ({scheduler}); a bare pod cannot"
            " change its node, so the claim keeps its GPUs there: delete the pod (a Job's pods are"
            " re-created elsewhere)"
        )
        if current and current.status == "True" and current.message == message:
            return None
        return make_condition(claim, CONDITION_UNPLACEABLE, "True", REASON_BARE_POD, message, now=now)
    if current is None or current.status != "True":
        return None
    return make_condition(
        claim,
        CONDITION_UNPLACEABLE,
        "False",
        REASON_PLACEABLE,
        "no pod of the claim is unschedulable",
        now=now,
    )


def unplaceable_fence(
    claim: models.GpuClaim, pods: Sequence[str], scheduler: str, *, now: datetime.datetime
) -> models.Condition:
    """The ``Releasing`` fence a claim moving off its nodes writes first: the webhook admits no pod
    of it while its stuck pods go. Its message says why, and becomes the move's."""
    nodes = sorted({a.node_name for a in claim.status.allocations})
    why = (
        f"allocating afresh without {', '.join(nodes)}: pod {', '.join(pods)} could not be scheduled"
        f" there for {claim.spec.unschedulable_grace_period_seconds} s ({scheduler})"
    )
    return releasing_condition(claim, on=True, now=now, why=why, reason=REASON_UNPLACEABLE)


def unplaceable_status(claim: models.GpuClaim, *, now: datetime.datetime) -> Obj:
    """The merge patch that moves a claim fenced by ``unplaceable_fence`` once its pods are gone:
    Pending without devices, its nodes added to ``unplaceableNodes``."""
    nodes = sorted({a.node_name for a in claim.status.allocations})
    fence = next((c for c in claim.status.conditions if c.type == constants.CONDITION_RELEASING), None)
    message = fence.message.removesuffix("; its GPUs are being released") if fence else "allocating afresh"
    return _afresh(
        claim,
        reason=REASON_UNPLACEABLE,
        message=message,
        settled=(constants.CONDITION_ALLOCATED, constants.CONDITION_RELEASING),
        now=now,
        unplaceableNodes=unplaceable.recorded_nodes(claim.status.unplaceable_nodes, nodes),
    )
