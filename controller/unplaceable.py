"""Claims whose pods kube-scheduler cannot place on the claim's node (pure).

gpualloc picks a claim's GPUs before kube-scheduler picks where its pods run. When the two
disagree (the node's CPU went to other pods, an affinity rules it out), a pod pinned to the
claim's node stays ``Pending`` with ``PodScheduled=False, reason Unschedulable`` and the GPUs
are held for nothing. ``judge`` reads the claim's live pods as the controller caches them
(``kept``: the scheduler's verdict, whether a workload controller owns the pod, its node) and
says what to do:

* no pod of the claim is Unschedulable, or one of them is bound (runs): nothing;
* the oldest verdict is younger than ``spec.unschedulableGracePeriodSeconds``: wait;
* a pod no workload controller owns (a bare pod) cannot change its node: the claim stays, and
  says so (``Unplaceable``, reason ``BarePod``) until the pod is deleted;
* else the claim moves: back to ``Pending`` without devices, the nodes recorded in
  ``status.unplaceableNodes`` (the allocator passes over them), and the pods evicted so that
  their owners re-create them onto the new node.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping
from typing import Any

from gpualloc.api import timestamps

UNSCHEDULABLE = "unschedulable"  # the cached form's field: {"since": RFC 3339, "message": the scheduler's}
OWNED = "owned"  # the cached form's field: a workload controller owns the pod
WORKLOAD_KINDS = frozenset({"Job", "JobSet", "ReplicaSet", "StatefulSet"})
MESSAGE_MAX = 512  # of the scheduler's message, kept per pod
NODES_KEPT = 16  # status.unplaceableNodes: the most recent


def kept_fields(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What the live-pods cache keeps of a claim pod for ``judge``: the scheduler's Unschedulable
    verdict (when and why) and whether a workload controller owns it."""
    out: dict[str, Any] = {}
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    out[OWNED] = any(
        isinstance(o, Mapping) and o.get("controller") is True and o.get("kind") in WORKLOAD_KINDS
        for o in owners
    )
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if (
            isinstance(cond, Mapping)
            and cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            since = str(cond.get("lastTransitionTime") or "")
            out[UNSCHEDULABLE] = {"since": since, "message": str(cond.get("message") or "")[:MESSAGE_MAX]}
    return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    wait: float = 0.0  # seconds left of the grace period (> 0: nothing to do yet)
    pods: tuple[str, ...] = ()  # the Unschedulable pods' names
    bare: tuple[str, ...] = ()  # those of them no workload controller owns
    message: str = ""  # the scheduler's, of the oldest

    @property
    def moves(self) -> bool:
        return self.wait <= 0 and bool(self.pods) and not self.bare


def judge(pods: Iterable[Mapping[str, Any]], *, grace: float, now: datetime.datetime) -> Verdict | None:
    """What the claim's Unschedulable pods call for (module docstring); None when nothing."""
    stuck: list[tuple[datetime.datetime, str, bool, str]] = []
    for pod in pods:
        if (pod.get("spec") or {}).get("nodeName"):
            return None  # a pod of the claim is bound: it runs on these GPUs, the claim stays
        verdict = pod.get(UNSCHEDULABLE)
        if not isinstance(verdict, Mapping):
            continue
        since = timestamps.parse_time(str(verdict.get("since") or "")) or now
        name = str((pod.get("metadata") or {}).get("name", ""))
        stuck.append((since, name, bool(pod.get(OWNED)), str(verdict.get("message") or "")))
    if not stuck:
        return None
    stuck.sort()
    oldest, _, _, message = stuck[0]
    wait = grace - (now - oldest).total_seconds()
    if wait > 0:
        return Verdict(wait=wait)
    return Verdict(
        pods=tuple(name for _, name, _, _ in stuck),
        bare=tuple(name for _, name, owned, _ in stuck if not owned),
        message=message,
    )


def recorded_nodes(already: Iterable[str], more: Iterable[str]) -> list[str]:
    """``status.unplaceableNodes`` with ``more`` added: the most recent ``NODES_KEPT``, no repeats."""
    nodes = [n for n in already if n not in set(more)] + sorted(set(more))
    return nodes[-NODES_KEPT:]
