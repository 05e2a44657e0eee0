"""What an Allocated claim writes into its pods, worked out once per claim change, not once per pod. Pure.

A claim's part of an admission does not depend on the pod: for each replica,
its node, its devices, the env entries of each device-id mode (encoded, and
cut into the pieces that make a container's operations with one
``str.join``), and the operations that pin a pod to the node and record the
devices. ``plan_of`` works these out the first time a parsed claim is used
and keeps them while that object is in use; the claim cache parses a claim
once per change (``cache.ClaimCache``), so a claim's plan is made once per
change too, and the decision only reads the pod.

The plan also records whether the claim lost devices to another claim (its
``DevicesLost`` condition True with reason ``DevicesTaken``): the conditions
are read once per claim change here, not once per pod.

In the server that took about 4 µs off each admission (BENCHMARKS.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import msgspec

from gpualloc.api import constants, models
from webhook import mutations

DeviceIdMode = Literal["uuid", "index"]


class Target(msgspec.Struct, frozen=True, gc=False):
    """One replica's allocation and the operations that write it into a pod."""

    node: str
    uuids: str  # comma-joined: the devices annotation, and CUDA_VISIBLE_DEVICES in uuid mode
    env: Mapping[DeviceIdMode, mutations.Env]  # the env entries, by device-id mode
    selector_ops: mutations.MemberOps  # pinning the pod to ``node``
    annotation_ops: mutations.MemberOps  # recording ``uuids``


def target(*, node: str, devices: tuple[models.DeviceRef, ...]) -> Target:
    """What the pods of a replica allocated ``devices`` on ``node`` get."""
    uuids = ",".join([d.uuid for d in devices])
    index_env = [
        mutations.value_env(mutations.ENV_CUDA_VISIBLE_DEVICES, ",".join(str(d.index) for d in devices)),
        mutations.value_env(mutations.ENV_NVIDIA_VISIBLE_DEVICES, "all"),
        mutations.value_env(mutations.ENV_CUDA_DEVICE_ORDER, "PCI_BUS_ID"),
    ]
    return Target(
        node=node,
        uuids=uuids,
        env={
            "uuid": mutations.env([mutations.value_env(name, uuids) for name in mutations.DEVICE_ENV_NAMES]),
            "index": mutations.env(index_env),
        },
        selector_ops=mutations.member_ops("/spec/nodeSelector", constants.HOSTNAME_LABEL, node),
        annotation_ops=mutations.member_ops("/metadata/annotations", constants.ANNOTATION_DEVICES, uuids),
    )


class Plan(msgspec.Struct, frozen=True, gc=False):
    """A claim's part of every admission of its pods."""

    claim: models.GpuClaim
    targets: Mapping[int, Target]  # replica -> its allocation, for replicas that hold devices
    # The DevicesTaken condition's message (whitespace folded, capped) when the claim lost
    # devices to another claim, else None: its pods are denied.
    taken: str | None = None


TAKEN_MESSAGE_LIMIT = 512


def taken_message(claim: models.GpuClaim) -> str | None:
    """The message of the claim's DevicesLost condition if True with reason DevicesTaken, else None.

    Other reasons (DeviceUnhealthy, DevicesMissing) give None: those pods are admitted as before.
    """
    for condition in claim.status.conditions:
        if condition.type == constants.CONDITION_DEVICES_LOST:
            if condition.status != "True" or condition.reason != constants.REASON_DEVICES_TAKEN:
                return None
            message = " ".join(condition.message.split())
            if len(message) > TAKEN_MESSAGE_LIMIT:
                message = message[: TAKEN_MESSAGE_LIMIT - 1] + "…"
            return message
    return None


def build(claim: models.GpuClaim) -> Plan:
    """The plan of a claim: a Target for each replica whose (first) allocation holds devices.

    The decision reads the targets of an Allocated claim only, and ``taken`` of any claim.
    """
    targets: dict[int, Target] = {}
    seen: set[int] = set()
    for allocation in claim.status.allocations:
        if allocation.replica in seen:
            continue  # the first allocation of a replica is the one that counts
        seen.add(allocation.replica)
        if allocation.devices:
            targets[allocation.replica] = target(node=allocation.node_name, devices=allocation.devices)
    return Plan(claim=claim, targets=targets, taken=taken_message(claim))


_MEMO_LIMIT = 4096
_memo: dict[int, Plan] = {}


def plan_of(claim: models.GpuClaim) -> Plan:
    """The plan of ``claim``, built on its first use and kept while this object is the one in use.

    Keyed by identity (models hold dicts, so they are not hashable); the plan
    holds the claim, so its id cannot be reused while the entry exists.
    """
    plan = _memo.get(id(claim))
    if plan is not None and plan.claim is claim:
        return plan
    plan = build(claim)
    if len(_memo) >= _MEMO_LIMIT:
        _memo.clear()
    _memo[id(claim)] = plan
    return plan
