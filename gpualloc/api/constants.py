"""Names fixed by the gpu.scheduling/v1 API contract (see docs/api.md)."""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping
from typing import Any

GROUP = "gpu.scheduling"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"

CLAIM_KIND = "GpuClaim"
CLAIM_PLURAL = "gpuclaims"
NODE_STATUS_KIND = "GpuNodeStatus"
NODE_STATUS_PLURAL = "gpunodestatuses"
QUOTA_KIND = "GpuQuota"
QUOTA_PLURAL = "gpuquotas"

# Annotations and labels.
ANNOTATION_CLAIM = f"{GROUP}/claim"
ANNOTATION_REPLICA = f"{GROUP}/replica"
ANNOTATION_DEVICES = f"{GROUP}/devices"
# On a gated pod of an MPS milli-GPU share: its CUDA_MPS_PINNED_DEVICE_MEM_LIMIT ("0=<MiB>M"), set
# by the controller with the devices annotation and read by the container through the downward API.
ANNOTATION_MPS_MEMORY_LIMIT = f"{GROUP}/mps-memory-limit"
# On a gated pod: the uid of the claim of its name that vanished while it waited (the sweep's fence).
ANNOTATION_CLAIM_GONE = f"{GROUP}/claim-gone"
LABEL_NODE = f"{GROUP}/node"
LABEL_CLAIM_NAMESPACE = f"{GROUP}/claim-namespace"
LABEL_CLAIM_NAME = f"{GROUP}/claim-name"
LABEL_CLAIM_UID = f"{GROUP}/claim-uid"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpualloc"
DEFAULT_NAMESPACE = "gpualloc-system"  # the chart's documented release namespace, the controller's default

FINALIZER = f"{GROUP}/release-devices"
SCHEDULING_GATE = f"{GROUP}/claim-allocated"
# On pods the webhook gated, so the controller can watch just those and not every pod.
LABEL_GATED = f"{GROUP}/gated"

# Well-known pod labels used to find a gang replica index.
LABEL_STATEFULSET_POD_INDEX = "apps.kubernetes.io/pod-index"
LABEL_JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
ANNOTATION_JOB_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"

HOSTNAME_LABEL = "kubernetes.io/hostname"
# The node label strategy costOptimized reads by default (low, then medium, then high).
LABEL_COST_TIER = f"{GROUP}/cost-tier"
LABEL_SHARING = f"{GROUP}/sharing"  # on a Node: how its agent offers its GPUs (TimeSlicing-4, MPS-2, None)
# On a GPU Node, with the controller's --label-free-gpus: "true" while at least one whole GPU of
# it is free for a claim; "shares" while none is but a GPU holding fractional shares has room for
# more; "false" otherwise (controller.labelling). The chart's packing.steerPodsWithoutClaim has
# kube-scheduler prefer, for pods without GPUs, nodes without "true", and most those with neither.
LABEL_FREE_GPUS = f"{GROUP}/free-gpus"
FREE_GPUS_WHOLE = "true"
FREE_GPUS_SHARES = "shares"
FREE_GPUS_NONE = "false"
# On a GPU Node, with the same flag: "true" once the pods bound to it request at least 75% of its
# allocatable CPU and memory (averaged), until they request less than 70% (controller.nodes.busy);
# "false" otherwise. The same policy has kube-scheduler prefer, for pods without GPUs, among the
# nodes without a whole GPU free, the busy ones: they pack there instead of spreading over the
# emptiest (docs/operations.md, "Steering pods without GPUs").
LABEL_BUSY = f"{GROUP}/busy"

# Enumerations.
PHASE_PENDING = "Pending"
PHASE_ALLOCATED = "Allocated"
PHASE_FAILED = "Failed"
PHASE_RELEASED = "Released"  # spec.release OnPodsCompleted: the work is done, the devices are back
# The controller's fence before it releases an OnPodsCompleted claim: no pod of it is admitted.
CONDITION_RELEASING = "Releasing"
PHASE_PREEMPTED = "Preempted"  # a claim of higher priority took its GPUs (status.preemptedBy)
PHASES = (PHASE_PENDING, PHASE_ALLOCATED, PHASE_FAILED, PHASE_RELEASED, PHASE_PREEMPTED)
PREEMPT_LOWER_PRIORITY = "PreemptLowerPriority"
PREEMPT_NEVER = "Never"
PREEMPTION_POLICIES = (PREEMPT_LOWER_PRIORITY, PREEMPT_NEVER)

RELEASE_ON_DELETE = "OnDelete"
RELEASE_ON_PODS_COMPLETED = "OnPodsCompleted"
RELEASE_ON_OWNER_COMPLETED = "OnOwnerCompleted"
RELEASES = (RELEASE_ON_DELETE, RELEASE_ON_PODS_COMPLETED, RELEASE_ON_OWNER_COMPLETED)
# spec.onNodeLoss: what an Allocated claim does when a node it uses is gone or not ready.
NODE_LOSS_KEEP = "Keep"  # the default: DevicesLost, until a person acts
NODE_LOSS_REALLOCATE = "Reallocate"  # after the grace period, once its pods are gone: allocated afresh
NODE_LOSSES = (NODE_LOSS_KEEP, NODE_LOSS_REALLOCATE)
NODE_LOSS_GRACE_S = 300
# spec.onDeviceFailure: what an Allocated claim does when a GPU it holds turns Unhealthy.
DEVICE_FAILURE_KEEP = "Keep"  # the default: DevicesUnhealthy, until a person acts
DEVICE_FAILURE_REALLOCATE = "Reallocate"  # after the grace period: the failed replica moves, alone
DEVICE_FAILURES = (DEVICE_FAILURE_KEEP, DEVICE_FAILURE_REALLOCATE)
DEVICE_FAILURE_GRACE_S = 30
# Released when the work is done (the others wait for the claim's deletion).
RELEASES_WHEN_DONE = (RELEASE_ON_PODS_COMPLETED, RELEASE_ON_OWNER_COMPLETED)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

EXCLUSIVITIES = ("Exclusive", "Shared", "MIG")
SHARING_STRATEGIES = ("TimeSlicing", "MPS")
MAX_SHARING_SLOTS = 64  # claims on one shared GPU at most (the agent's --sharing, maxClaimsPerGPU)
POLICIES = ("packed", "spread", "contiguous", "preferIds")
TOPOLOGY_MODES = ("Required", "Preferred", "Ignore")
STRATEGIES = (
    "binpack",
    "spread",
    "leastLoaded",
    "bestFit",
    "random",
    "roundRobin",
    "costOptimized",
    "leastFragmentation",
)
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
LINK_TYPES_PCIE = ("PIX", "PXB", "PHB", "NODE", "SYS")
SOURCES = ("nvml", "simulated")

CONDITION_ALLOCATED = "Allocated"
CONDITION_READY = "Ready"
CONDITION_NVML_READY = "NvmlReady"
CONDITION_DEVICES_LOST = "DevicesLost"
CONDITION_DEVICES_UNHEALTHY = "DevicesUnhealthy"
REASON_DEVICES_TAKEN = "DevicesTaken"

_LEASE_UNSAFE = re.compile(r"[^a-z0-9-]")


# Pure and asked for every device on every reconcile, sweep and metrics scrape: cached.
@functools.lru_cache(maxsize=1 << 16)
def lease_name(uuid: str) -> str:
    """The name of the Lease that locks the device with this UUID.

    Identity is the UUID, never the index: ``gpu-<uuid lower case>``. MIG UUIDs
    of the old ``MIG-GPU-…/gi/ci`` form carry slashes, which are folded to ``-``.
    """
    return "gpu-" + _LEASE_UNSAFE.sub("-", uuid.lower())


def device_display(number: int, uuid: str) -> str:
    """How messages and logs name a device: ``gpu-<number>/<uuid>``, e.g. ``gpu-3/GPU-5f1c…``
    (the number for people, the UUID for identity)."""
    return f"gpu-{number}/{uuid}"


def slot_id(uuid: str, slot: int) -> str:
    """The lock id of slot ``slot`` of a shared GPU: ``<uuid>-s<slot>``, so its Lease is
    ``gpu-<uuid>-s<slot>`` (``lease_name``)."""
    return f"{uuid}-s{slot}"


LABEL_VALUE_MAX = 63


def shorten_label_value(name: str) -> str:
    """An object's ``name`` as a label value: itself when it fits in 63 characters, else a prefix and a hash.

    Object names may be 253 characters (a GpuClaim's is a DNS subdomain) but
    label values only 63: a longer one is cut to 52 characters and given ``-``
    and 10 hex digits of its SHA-256, so it stays distinct and selectable. The
    whole name goes in an annotation of the same key (``leases.device_lease``).
    A name's characters are all valid in a label value already; free text is
    not, and is the agent's ``publishing.sanitize_label_value``.
    """
    if len(name) <= LABEL_VALUE_MAX:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[: LABEL_VALUE_MAX - 11]}-{digest}"


def lease_claim(metadata: Mapping[str, Any]) -> tuple[str, str]:
    """``(namespace, name)`` of the claim a device Lease's metadata names, ``""`` where it names none.

    From the annotations, which hold the whole name; else from the labels (Leases
    made before the annotations existed, whose names fit in a label).
    """
    annotations = metadata.get("annotations") or {}
    labels = metadata.get("labels") or {}

    def read(key: str) -> str:
        return str(annotations.get(key) or labels.get(key) or "")

    return read(LABEL_CLAIM_NAMESPACE), read(LABEL_CLAIM_NAME)


# ----------------------------------------------------------------- DRA (issue 42)
# gpualloc is the DRA driver of its own allocations: for each Allocated replica the controller
# writes a resource.k8s.io/v1 ResourceClaim whose status.allocation names the devices it chose
# (its Leases stay the lock), the webhook puts it in the pod's spec.resourceClaims, and the
# agent, as the kubelet plugin, answers NodePrepareResources with the devices' CDI names.
DRA_DRIVER = "gpu.gpualloc.dev"  # the driver's name, and the DeviceClass the chart installs
DRA_REQUEST = "gpus"  # the one request of every ResourceClaim gpualloc writes
DRA_POD_CLAIM = "gpualloc-gpus"  # the pod's spec.resourceClaims entry (and containers' claims)


def resource_claim_name(claim: str, replica: int) -> str:
    """The ResourceClaim of a GpuClaim's replica, in the claim's namespace: ``<claim>-gpus-<r>``,
    the claim's name cut and hashed when that would pass 253 characters."""
    suffix = f"-gpus-{replica}"
    if len(claim) + len(suffix) <= 253:
        return f"{claim}{suffix}"
    digest = hashlib.sha256(claim.encode()).hexdigest()[:10]
    return f"{claim[: 253 - len(suffix) - 11]}-{digest}{suffix}"


def dra_device_name(lock_id: str) -> str:
    """A device's name in a ResourceClaim's allocation results (a DNS label): its lock id
    (GPU or MIG UUID, or a shared GPU's slot id) in lower case."""
    return lock_id.lower()
