"""What a claim pod says about itself: which gang replica it is. Pure.

The webhook (choosing the devices to inject) and the controller (ungating pods
in gate mode) must read the replica index the same way, so the rule lives here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from gpualloc.api import constants

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
