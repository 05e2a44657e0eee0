"""What a claim pod says about itself: which gang replica it is, and which nodes it may run on. Pure.

The webhook (choosing the devices to inject) and the controller (ungating pods
in gate mode) must read these the same way, so the rules live here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpualloc.api import constants, models

# Where a pod's replica index comes from, first present wins: (metadata part, key, words for messages).
REPLICA_SOURCES: tuple[tuple[str, str, str], ...] = (
    ("annotations", constants.ANNOTATION_REPLICA, f"annotation {constants.ANNOTATION_REPLICA}"),
    ("labels", constants.LABEL_STATEFULSET_POD_INDEX, f"label {constants.LABEL_STATEFULSET_POD_INDEX}"),
    (
        "annotations",
        constants.ANNOTATION_JOB_COMPLETION_INDEX,
        f"annotation {constants.ANNOTATION_JOB_COMPLETION_INDEX}",
    ),
    ("labels", constants.LABEL_JOB_COMPLETION_INDEX, f"label {constants.LABEL_JOB_COMPLETION_INDEX}"),
)

# The keys of those sources, by part: a pod carrying none of them names no replica.
REPLICA_ANNOTATIONS = frozenset(key for part, key, _ in REPLICA_SOURCES if part == "annotations")
REPLICA_LABELS = frozenset(key for part, key, _ in REPLICA_SOURCES if part == "labels")

_INDEX = re.compile(r"[0-9]{1,9}")


class ReplicaError(ValueError):
    """A replica index source is present but does not hold a non-negative integer."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    """A gang replica index and where it was read from (for messages)."""

    index: int
    source: str


def replica_of(metadata: Mapping[str, Any]) -> Replica | None:
    """The gang replica index in a pod's metadata, from the first source present; None if none.

    Raises ReplicaError when the first source present does not hold a
    non-negative integer (a later source is not consulted then: a typo in an
    explicit annotation must not silently fall back to something else).
    """
    for part, key, words in REPLICA_SOURCES:
        values = metadata.get(part)
        if not isinstance(values, Mapping) or key not in values:
            continue
        raw = values[key]
        if not isinstance(raw, str) or not _INDEX.fullmatch(raw):
            shown = raw if isinstance(raw, str) else repr(raw)
            raise ReplicaError(f"{words} must be a non-negative integer, got {shown[:40]!r}")
        return Replica(index=int(raw), source=words)
    return None


# ------------------------------------------------------------------ node affinity

# (where in a term, which key): the requirements on a node's name.
_NAME_KEYS = (("matchFields", "metadata.name"), ("matchExpressions", constants.HOSTNAME_LABEL))


def _refuses(requirement: Mapping[str, Any], node: str) -> bool:
    """Whether a requirement on the node's name (or hostname label, the same) rules ``node`` out."""
    operator = requirement.get("operator")
    values = requirement.get("values")
    if operator in ("In", "NotIn") and not isinstance(values, list):
        return False  # malformed: the API server's validation refuses the pod anyway
    names = [v for v in values if isinstance(v, str)] if isinstance(values, list) else []
    if operator == "In":
        return node not in names
    if operator == "NotIn":
        return node in names
    return operator == "DoesNotExist"  # every node has a name and a hostname label


def affinity_excludes(affinity: Any, node: str) -> str | None:
    """The required node affinity that keeps a pod off ``node``, in words; None when it may run there.

    Judges only requirements on a node's name: ``matchFields metadata.name`` (as a
    DaemonSet's pods carry) and ``matchExpressions kubernetes.io/hostname`` (which
    gpualloc takes to be the node's name, as the kubelet sets it). Any other
    requirement might match, so it never rules a node out here. The terms are
    ORed: the pod is kept off ``node`` only when every term rules it out. The
    object may be malformed (mutating webhooks run before validation): a part of
    the wrong type is ignored.
    """
    if affinity is None or not isinstance(affinity, Mapping):  # most pods have none: skip the ABC check
        return None
    node_affinity = affinity.get("nodeAffinity")
    required = (
        node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(node_affinity, Mapping)
        else None
    )
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    if not isinstance(terms, list) or not terms:
        return None
    refusals: list[str] = []
    for term in terms:
        refusal = _term_refusal(term, node) if isinstance(term, Mapping) else None
        if refusal is None:
            return None
        refusals.append(refusal)
    return "required node affinity (" + " or ".join(refusals)[:300] + ")"


def _term_refusal(term: Mapping[str, Any], node: str) -> str | None:
    for part, key in _NAME_KEYS:
        requirements = term.get(part)
        for requirement in requirements if isinstance(requirements, list) else ():
            if (
                isinstance(requirement, Mapping)
                and requirement.get("key") == key
                and _refuses(requirement, node)
            ):
                values = requirement.get("values")
                shown = (
                    f" [{','.join(str(v) for v in values)}]" if isinstance(values, list) and values else ""
                )
                return f"{key} {requirement.get('operator')}{shown}"
    return None


def share_memory_limit(devices: Sequence[models.DeviceRef]) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` of the pods of an MPS milli-GPU share: ``0=<MiB>M``, its
    part of the GPU's memory (the GPU is device 0 in the container); "" for other devices."""
    return ",".join(f"{i}={d.memory_mib}M" for i, d in enumerate(devices) if d.milli and d.memory_mib)


def share_thread_percentage(milli: int) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of an MPS milli-GPU share: its milli in percent, rounded
    up (a share of 5 milli-GPU still gets 1%)."""
    return min(100, max(1, -(-milli // 10)))
