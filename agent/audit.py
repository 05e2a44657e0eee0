"""The usage audit: which processes on this node's GPUs have no business there (pure).

NVML lists the processes with a CUDA context on each GPU, and the agent reads
each one's pod UID from its cgroup (``inventory.pod_uid_of_cgroup``). A
process is *unexpected* when:

* no claim holds its GPU (no Lease of the GPU, of one of its MIG instances or
  of one of its sharing slots, no share in its Lease's ledger), whatever it is; or
* a claim holds the GPU and the process runs in a pod on this node that is not
  a pod of a holding claim (its ``gpu.scheduling/claim`` annotation names
  another claim, or none), or in a pod the agent does not know.

A process whose pod cannot be told (the agent cannot read its cgroup: it needs
the host's PID namespace; or it runs outside any pod, as the MPS server does)
is unexpected only on a GPU no claim holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent import inventory
from agent.metrics import LeaseHolder
from gpualloc.api import constants, models

MAX_REPORTED = 32  # in the GpuNodeStatus; the metric counts them all


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PodRef:
    """A pod on this node, as the audit needs it."""

    namespace: str
    name: str
    claim: str  # its gpu.scheduling/claim annotation ("" without one)


def pod_ref(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a pod on this node the agent caches (a Reflector transform): name, namespace,
    UID and its claim annotation, however large the pod."""
    metadata = pod.get("metadata") or {}
    claim = (metadata.get("annotations") or {}).get(constants.ANNOTATION_CLAIM, "")
    kept = {key: metadata[key] for key in ("name", "namespace", "uid", "resourceVersion") if key in metadata}
    kept["annotations"] = {constants.ANNOTATION_CLAIM: claim} if isinstance(claim, str) and claim else {}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": kept}


def pods_by_uid(cached: Iterable[Mapping[str, Any]]) -> dict[str, PodRef]:
    """The Reflector's cached pods (``pod_ref``) by UID."""
    out = {}
    for pod in cached:
        metadata = pod.get("metadata") or {}
        out[str(metadata.get("uid", ""))] = PodRef(
            namespace=str(metadata.get("namespace", "")),
            name=str(metadata.get("name", "")),
            claim=str((metadata.get("annotations") or {}).get(constants.ANNOTATION_CLAIM, "")),
        )
    return out


def unexpected(
    devices: Sequence[models.Device],
    samples: Sequence[inventory.DeviceSample],
    holders: Mapping[str, LeaseHolder],
    pods: Mapping[str, PodRef] | None,
    shares: Mapping[str, Sequence[LeaseHolder]] | None = None,
) -> list[models.UnexpectedProcess]:
    """Every unexpected process, by GPU index and pid. ``holders`` maps lock ids (``Device.lock_ids``)
    to the claim holding them, ``shares`` GPU UUIDs to the claims holding milli-GPU shares of them
    (each of them holds the GPU); ``pods`` maps pod UIDs to this node's pods (None: pods are not
    tracked, so only processes on GPUs no claim holds are reported)."""
    by_uuid = {d.uuid: d for d in devices}
    found: list[models.UnexpectedProcess] = []
    for sample in sorted(samples, key=lambda s: s.index):
        device = by_uuid.get(sample.uuid)
        if device is None:
            continue
        sharers = (shares or {}).get(device.uuid, ())
        claims = sorted(
            {(h.claim_namespace, h.claim_name) for lock in device.lock_ids if (h := holders.get(lock))}
            | {(h.claim_namespace, h.claim_name) for h in sharers}
        )
        for process in sorted(sample.processes, key=lambda p: p.pid):
            pod = pods.get(process.pod_uid) if pods is not None and process.pod_uid else None
            reason = _why(device.index, process, claims, pod, pods_tracked=pods is not None)
            if reason:
                found.append(
                    models.UnexpectedProcess(
                        index=device.index,
                        uuid=device.uuid,
                        pid=process.pid,
                        pod_uid=process.pod_uid,
                        pod=f"{pod.namespace}/{pod.name}" if pod is not None else "",
                        reason=reason,
                    )
                )
    return found


def describe(stray: models.UnexpectedProcess) -> str:
    """One line for a log or an Event: the process, its pod where known, the GPU, why."""
    pod = f" in pod {stray.pod}" if stray.pod else (f" in pod uid {stray.pod_uid}" if stray.pod_uid else "")
    return f"process {stray.pid}{pod} on GPU {stray.index} ({stray.uuid}): {stray.reason}"


def _why(
    index: int,
    process: inventory.GpuProcess,
    claims: Sequence[tuple[str, str]],
    pod: PodRef | None,
    *,
    pods_tracked: bool,
) -> str:
    """Why the process is unexpected; "" when it is not (or cannot be told)."""
    if not claims:
        return f"no claim holds GPU {index}"
    if not process.pod_uid or not pods_tracked:
        return ""
    held = ", ".join(f"{namespace}/{name}" for namespace, name in claims)
    if pod is None:
        return f"its pod (uid {process.pod_uid}) is not a pod on this node; GPU {index} is held by {held}"
    if (pod.namespace, pod.claim) in claims:
        return ""
    theirs = f"claim {pod.namespace}/{pod.claim}" if pod.claim else "no claim"
    return f"its pod {pod.namespace}/{pod.name} has {theirs}; GPU {index} is held by {held}"
