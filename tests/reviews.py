"""The ``admission.k8s.io/v1`` AdmissionReview envelope around an object, as the API server sends it,
and pod parts the webhook and the controller tests share."""

from __future__ import annotations

from typing import Any


def pod_review(
    pod: Any,
    *,
    namespace: str,
    uid: str = "uid-1",
    operation: str = "CREATE",
    kind: str = "Pod",
    dry_run: bool = False,
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": namespace,
            "operation": operation,
            "object": pod,
            "oldObject": None,
            "dryRun": dry_run,
        },
    }


def name_affinity(operator: str, *nodes: str) -> dict[str, Any]:
    """A required node affinity on ``matchFields metadata.name``: a DaemonSet pod's pin (``In``)."""
    requirement = {"key": "metadata.name", "operator": operator, "values": list(nodes)}
    terms = [{"matchFields": [requirement]}]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
