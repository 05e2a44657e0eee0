"""Taints and tolerations, as the kube-scheduler matches them (pure).

A claim's pods must be able to run where its GPUs are, so the allocator skips
nodes with a ``NoSchedule`` or ``NoExecute`` taint that the claim's
``tolerations`` (which the webhook gives its pods) do not tolerate.
``DEFAULT_TOLERATIONS`` are added to every claim and claim pod: GPU pools on
GKE and AKS are tainted ``nvidia.com/gpu`` (``present`` / ``NoSchedule``) so
that only pods asking for GPUs land there, and a gpualloc claim pod is one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpualloc.api import models

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")  # PreferNoSchedule only steers the scheduler

DEFAULT_TOLERATIONS = (models.Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"),)


def tolerates(toleration: models.Toleration, taint: models.Taint) -> bool:
    """``v1.Toleration.ToleratesTaint``: the effect matches (or is empty), and the key and value do."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if not toleration.key:
        return toleration.operator == "Exists"  # an empty key with Exists tolerates everything
    if toleration.key != taint.key:
        return False
    return toleration.operator == "Exists" or toleration.value == taint.value


def untolerated(
    taints: Iterable[models.Taint], tolerations: Sequence[models.Toleration]
) -> models.Taint | None:
    """The first blocking taint none of ``tolerations`` tolerates; None when the pods may run there."""
    for taint in taints:
        if taint.effect in BLOCKING_EFFECTS and not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def node_taints(raw_node: Mapping[str, Any]) -> tuple[models.Taint, ...]:
    """The blocking taints of a core/v1 Node."""
    found = []
    for taint in (raw_node.get("spec") or {}).get("taints") or []:
        effect = str(taint.get("effect", ""))
        if effect in BLOCKING_EFFECTS and taint.get("key"):
            found.append(
                models.Taint(key=str(taint["key"]), value=str(taint.get("value") or ""), effect=effect)
            )
    return tuple(found)


def claim_tolerations(spec: models.GpuClaimSpec) -> tuple[models.Toleration, ...]:
    """What a claim's pods tolerate: its own tolerations and the defaults."""
    return (*spec.tolerations, *(t for t in DEFAULT_TOLERATIONS if t not in spec.tolerations))
