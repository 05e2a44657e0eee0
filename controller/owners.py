"""The workload that owns a claim, for ``release: OnOwnerCompleted`` (pure).

A claim follows the Job (``batch/v1``) or JobSet (``jobset.x-k8s.io``) named
in its ``metadata.ownerReferences``: the controller reference when there is
one, else the first reference of those kinds. The workload has finished when
its ``Complete`` (Job) or ``Completed`` (JobSet) or ``Failed`` condition is
True; a workload that is gone has finished too (the garbage collector is
about to delete the claim that it owned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# (API group, kind) -> (resource, the condition types that mean it has finished)
KINDS: Mapping[tuple[str, str], tuple[str, tuple[str, ...]]] = {
    ("batch", "Job"): ("jobs", ("Complete", "Failed")),
    ("jobset.x-k8s.io", "JobSet"): ("jobsets", ("Completed", "Failed")),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Owner:
    api_version: str  # "batch/v1"
    kind: str
    name: str
    uid: str

    @property
    def resource(self) -> str:
        return KINDS[(_group(self.api_version), self.kind)][0]

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def owner_of(raw_claim: Mapping[str, Any]) -> Owner | None:
    """The Job or JobSet the claim follows, or None when no such owner is named."""
    refs = [
        r
        for r in (raw_claim.get("metadata") or {}).get("ownerReferences") or []
        if (_group(str(r.get("apiVersion", ""))), r.get("kind")) in KINDS
    ]
    if not refs:
        return None
    ref = next((r for r in refs if r.get("controller")), refs[0])
    return Owner(str(ref["apiVersion"]), str(ref["kind"]), str(ref.get("name", "")), str(ref.get("uid", "")))


def finished(owner: Owner, raw: Mapping[str, Any] | None) -> str | None:
    """How the workload ``raw`` (None: it is gone) finished ("Complete", "Failed", "gone"), or None
    while it runs. An object with another uid is a namesake: the owner is gone."""
    if raw is None or str((raw.get("metadata") or {}).get("uid", "")) != owner.uid:
        return "gone"
    done = KINDS[(_group(owner.api_version), owner.kind)][1]
    for cond in (raw.get("status") or {}).get("conditions") or []:
        if cond.get("type") in done and cond.get("status") == "True":
            return str(cond["type"])
    return None
