"""A GPU that fails under an Allocated claim (pure): the condition, and which replica moves where.

An allocated device the agent marks Unhealthy (an XID such as 79, a double-bit ECC error, an
NVLink or fabric error) gives the claim the condition ``DevicesUnhealthy`` (True, naming each GPU
and its reason; False once it is over), whatever ``spec.onDeviceFailure`` says. The grace period
counts from that condition's transition, so a controller that restarts does not start it over.

With ``onDeviceFailure: Reallocate`` only the replicas holding a failed GPU move (``failed``),
each as a whole: its pods run on one node, and its set keeps the claim's bandwidth rules. The
others keep their GPUs and their Leases. ``replacement`` is the claim the allocator places for
the moving replicas: as many replicas as move, held to the ``topology.sameNodeLabel`` domain the
kept replicas share. ``replaced_status`` writes the new allocations in, the kept ones unchanged.
The transaction around it (fence, evictions, Leases) is ``healing``'s.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence

from controller import statuses
from gpualloc.api import codecs, constants, models, timestamps

Obj = dict[str, object]

REASON_DEVICE_FAILED = "DeviceFailed"  # the Releasing fence of a replica that moves
REASON_REALLOCATED = statuses.REASON_REALLOCATED


def unhealthy(problems: Sequence[statuses.Problem]) -> list[statuses.Problem]:
    """The problems that are an Unhealthy device (not a missing one)."""
    return [p for p in problems if p.reason == statuses.REASON_DEVICE_UNHEALTHY]


def failed(claim: models.GpuClaim, problems: Sequence[statuses.Problem]) -> list[int]:
    """The replicas that hold an Unhealthy device, in order."""
    bad = {p.uuid for p in unhealthy(problems)}
    return sorted({a.replica for a in claim.status.allocations if any(d.uuid in bad for d in a.devices)})


def _current(claim: models.GpuClaim) -> models.Condition | None:
    return next((c for c in claim.status.conditions if c.type == constants.CONDITION_DEVICES_UNHEALTHY), None)


def condition(
    claim: models.GpuClaim, problems: Sequence[statuses.Problem], *, now: datetime.datetime
) -> models.Condition | None:
    """The ``DevicesUnhealthy`` condition to write, or None when the recorded one is still right:
    True while an allocated device is Unhealthy (the message names each, and what happens next),
    False (``DevicesHealthy``) once none is; no condition for a claim that never had one."""
    current = _current(claim)
    bad = unhealthy(problems)
    if bad:
        details = statuses.join_capped([p.detail for p in bad])
        if claim.spec.on_device_failure == constants.DEVICE_FAILURE_REALLOCATE:
            grace = claim.spec.device_failure_grace_period_seconds
            replicas = ", ".join(str(r) for r in failed(claim, problems))
            then = f"replica {replicas} moves to other GPUs {grace} s after (onDeviceFailure: Reallocate)"
        else:
            then = "the claim keeps its GPUs until a person acts (onDeviceFailure: Keep)"
        message = f"{details}; {then}"
        if current and current.status == "True" and current.message == message:
            return None
        return statuses.make_condition(
            claim,
            constants.CONDITION_DEVICES_UNHEALTHY,
            "True",
            statuses.REASON_DEVICE_UNHEALTHY,
            message,
            now=now,
        )
    if current is None or current.status != "True":
        return None
    return statuses.make_condition(
        claim,
        constants.CONDITION_DEVICES_UNHEALTHY,
        "False",
        statuses.REASON_DEVICES_HEALTHY,
        "every allocated device is healthy",
        now=now,
    )


def unhealthy_since(claim: models.GpuClaim) -> bool:
    """Is ``DevicesUnhealthy`` recorded True (the grace period has a start)?"""
    current = _current(claim)
    return current is not None and current.status == "True"


def unhealthy_for(claim: models.GpuClaim, now: datetime.datetime) -> float:
    """Seconds since ``DevicesUnhealthy`` turned True (0 when it is not True)."""
    current = _current(claim)
    if current is None or current.status != "True":
        return 0.0
    since = timestamps.parse_time(current.last_transition_time or "")
    return 0.0 if since is None else max(0.0, (now - since).total_seconds())


def replacement(
    claim: models.GpuClaim, moving: Sequence[int], labels: Mapping[str, Mapping[str, str]]
) -> models.GpuClaim:
    """The claim the allocator places for the ``moving`` replicas (``labels``: node name -> its
    labels). With ``topology.sameNodeLabel`` and kept replicas that share one value of it, the
    moving replicas must land in that domain too (``Required``); ``Preferred`` leaves it to the
    caller to try without (``unbound``)."""
    spec = dataclasses.replace(claim.spec, replicas=len(moving))
    key = claim.spec.topology.same_node_label
    kept = [a for a in claim.status.allocations if a.replica not in moving]
    values = {labels.get(a.node_name, {}).get(key) for a in kept}
    if key and kept and len(values) == 1 and None not in values:
        value = str(next(iter(values)))
        selector = claim.spec.selector or models.LabelSelector()
        bound = dataclasses.replace(selector, match_labels={**selector.match_labels, key: value})
        # Placed inside the domain, one replica at a time needs no domain search of its own.
        topology = dataclasses.replace(claim.spec.topology, same_node_label="")
        spec = dataclasses.replace(spec, selector=bound, topology=topology)
    return dataclasses.replace(claim, spec=spec)


def unbound(claim: models.GpuClaim, moving: Sequence[int]) -> models.GpuClaim | None:
    """For ``sameNodeLabelMode: Preferred``: the moving replicas placed anywhere, when
    ``replacement`` held them to a domain; None when there is nothing else to try."""
    topology = claim.spec.topology
    if not topology.same_node_label or topology.same_node_label_mode != "Preferred":
        return None
    spec = dataclasses.replace(
        claim.spec, replicas=len(moving), topology=dataclasses.replace(topology, same_node_label="")
    )
    return dataclasses.replace(claim, spec=spec)


def renumbered(placed: Sequence[models.Allocation], moving: Sequence[int]) -> list[models.Allocation]:
    """The allocator's replicas 0..k-1 as the moving replicas' numbers."""
    return [dataclasses.replace(a, replica=moving[a.replica]) for a in placed]


def _shown(allocation: models.Allocation) -> list[str]:
    return [constants.device_display(d.minor, d.uuid) for d in allocation.devices]


def replaced_status(
    claim: models.GpuClaim,
    new: Sequence[models.Allocation],
    *,
    why: str,
    now: datetime.datetime,
) -> Obj:
    """The merge patch that gives the replicas of ``new`` their new devices; the other replicas'
    allocations are written back unchanged. ``DevicesUnhealthy`` turns False (``Reallocated``) and
    the fence is lifted in the same write."""
    moved = {a.replica for a in new}
    allocations = sorted(
        [a for a in claim.status.allocations if a.replica not in moved] + list(new), key=lambda a: a.replica
    )
    nodes, devices = statuses.display_fields(allocations)
    where = "; ".join(
        f"replica {a.replica} to {a.node_name} [{', '.join(_shown(a))}]"
        for a in sorted(new, key=lambda a: a.replica)
    )
    message = f"moved {where}: {why}"
    conditions = claim.status.conditions
    for type_, status, reason in (
        (constants.CONDITION_DEVICES_UNHEALTHY, "False", REASON_REALLOCATED),
        (constants.CONDITION_RELEASING, "False", REASON_REALLOCATED),
    ):
        conditions = statuses.set_condition(
            conditions, statuses.make_condition(claim, type_, status, reason, message, now=now)
        )
    return {
        "status": {
            "allocations": [codecs.encode(a) for a in allocations],
            "conditions": [codecs.encode(c) for c in conditions],
            "message": message,
            "nodes": nodes,
            "devices": devices,
        }
    }
