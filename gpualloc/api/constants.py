"""Names fixed by the gpu.scheduling/v1 API contract (see docs/api.md)."""

from __future__ import annotations

import functools
import re

GROUP = "gpu.scheduling"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"

CLAIM_KIND = "GpuClaim"
CLAIM_PLURAL = "gpuclaims"
NODE_STATUS_KIND = "GpuNodeStatus"
NODE_STATUS_PLURAL = "gpunodestatuses"

# Annotations and labels.
ANNOTATION_CLAIM = f"{GROUP}/claim"
ANNOTATION_REPLICA = f"{GROUP}/replica"
ANNOTATION_DEVICES = f"{GROUP}/devices"
LABEL_NODE = f"{GROUP}/node"
LABEL_CLAIM_NAMESPACE = f"{GROUP}/claim-namespace"
LABEL_CLAIM_NAME = f"{GROUP}/claim-name"
LABEL_CLAIM_UID = f"{GROUP}/claim-uid"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpualloc"

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

# Enumerations.
PHASE_PENDING = "Pending"
PHASE_ALLOCATED = "Allocated"
PHASE_FAILED = "Failed"
PHASES = (PHASE_PENDING, PHASE_ALLOCATED, PHASE_FAILED)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"

EXCLUSIVITIES = ("Exclusive", "Shared", "MIG")
POLICIES = ("packed", "spread", "contiguous", "preferIds")
TOPOLOGY_MODES = ("Required", "Preferred", "Ignore")
STRATEGIES = ("binpack", "spread", "leastLoaded", "bestFit", "random", "roundRobin", "costOptimized")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
LINK_TYPES_PCIE = ("PIX", "PXB", "PHB", "NODE", "SYS")
SOURCES = ("nvml", "simulated")

CONDITION_ALLOCATED = "Allocated"
CONDITION_READY = "Ready"
CONDITION_NVML_READY = "NvmlReady"
CONDITION_DEVICES_LOST = "DevicesLost"

_LEASE_UNSAFE = re.compile(r"[^a-z0-9-]")


# Pure and asked for every device on every reconcile, sweep and metrics scrape: cached.
@functools.lru_cache(maxsize=1 << 16)
def lease_name(uuid: str) -> str:
    """The name of the Lease that locks the device with this UUID.

    Identity is the UUID, never the index: ``gpu-<uuid lower case>``. MIG UUIDs
    of the old ``MIG-GPU-…/gi/ci`` form carry slashes, which are folded to ``-``.
    """
    return "gpu-" + _LEASE_UNSAFE.sub("-", uuid.lower())
