"""The controller's settings, as ``gpualloc controller``'s flags set them (``controller.main``)."""

from __future__ import annotations

import dataclasses

from controller import views
from gpualloc.api import constants

EVENT_INTERVAL = 60.0  # AllocationFailed at most this often per claim, unless the reason changes
IN_USE_POLL = 5.0  # a claim being deleted that pods still use is looked at again this often
LABEL_INTERVAL = 2.0  # seconds between the passes of the free-GPUs label (controller.labelling)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    namespace: str  # where the device Leases live
    workers: int = 4
    node_stale_after: float = views.NODE_STALE_AFTER_S
    heartbeat_namespace: str = ""  # where the agents renew their heartbeat Leases; "" = not watched
    cost_label: str = constants.LABEL_COST_TIER
    sweep_interval: float = 30.0
    event_interval: float = EVENT_INTERVAL
    in_use_poll: float = IN_USE_POLL
    claim_selector: str = ""  # label selector: handle only these claims (shards, tests); "" = all
    preemption_scope: str = "Namespace"  # whose claims a claim may preempt: Namespace, Cluster or None
    claim_tolerations: str = "Allowed"  # Allowed: those its namespace's GpuQuotas allow; Any: all of them
    dra: bool = False  # write a resource.k8s.io/v1 ResourceClaim per allocated replica (controller.dra)
    label_free_gpus: bool = False  # keep gpu.scheduling/free-gpus on every GPU node (controller.labelling)
    label_interval: float = LABEL_INTERVAL
