"""Frozen models of the gpu.scheduling/v1 objects.

Every field's JSON name is the camelCase of its Python name unless the field
says otherwise with ``json_name``. ``codecs`` turns raw API dicts into these
models and back; ``tests/unit/test_models_match_crd.py`` checks the field names
against the CRD schema so the two cannot drift.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gpualloc.api import constants


def json_name(name: str) -> dict[str, Any]:
    """Field metadata naming the JSON key where camelCase would be wrong."""
    return {"json": name}


def resource_list() -> dict[str, Any]:
    """Field metadata of a map of resource name to Kubernetes quantity (``cpu: 500m``), read as
    integers in the unit kube-scheduler counts each resource in (``quantities.parse_units``:
    millicores, bytes, a count) and written back as quantities (``codecs``)."""
    return {"codec": "resource_list"}


# ---------------------------------------------------------------- GpuClaim spec


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SharingRequest:
    """How a ``Shared`` claim shares its GPUs: the GPUs' strategy, and at most how many claims
    (this one included) may hold each of them (None: as many as the GPU has slots)."""

    strategy: str = "TimeSlicing"  # TimeSlicing | MPS
    max_claims_per_gpu: int | None = dataclasses.field(default=None, metadata=json_name("maxClaimsPerGPU"))
    compute_percent: int | None = None  # MPS: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    # MPS: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for each of its GPUs
    memory_mib: int | None = dataclasses.field(default=None, metadata=json_name("memoryMiB"))
    # A fractional share: this many milli-GPU (1..999) of one GPU, held in the GPU's own Lease's
    # ledger (``leases``); None: a slot of a GPU the agent offers for sharing.
    milli: int | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeviceRequest:
    count: int
    exclusivity: str = "Exclusive"
    policy: str = "packed"
    prefer_ids: tuple[int, ...] = ()
    product: str | None = None
    products: tuple[str, ...] = ()  # alternatives, globs: a GPU matching any will do (not with product)
    min_memory_mib: int | None = dataclasses.field(default=None, metadata=json_name("minMemoryMiB"))
    min_compute_capability: str | None = None
    mig_profile: str = ""  # exclusivity MIG: the acceptable profiles, comma-separated ("" any)
    sharing: SharingRequest | None = None  # exclusivity Shared: how (None: time-slicing, any sharers)

    @property
    def mig_profiles(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.mig_profile.split(",") if p.strip())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SelectorRequirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LabelSelector:
    match_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    match_expressions: tuple[SelectorRequirement, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    mode: str = "Preferred"
    min_bandwidth_gbps: int = dataclasses.field(default=0, metadata=json_name("minBandwidthGBps"))
    same_node_label: str = ""  # a gang's replicas on nodes sharing this label's value (a clique, a rack)
    same_node_label_mode: str = "Required"  # Required | Preferred


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    max_retries: int = 0
    backoff_seconds: int = 5


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Toleration:
    """As core/v1 Toleration: the claim's pods get it, and the allocator honours it."""

    key: str = ""
    operator: str = "Equal"  # Equal | Exists
    value: str = ""
    effect: str = ""  # "" (any) | NoSchedule | PreferNoSchedule | NoExecute
    toleration_seconds: int | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Taint:
    """A core/v1 Node taint."""

    key: str
    effect: str
    value: str = ""

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuClaimSpec:
    devices: DeviceRequest
    selector: LabelSelector | None = None
    node_name: str | None = None
    topology: Topology = dataclasses.field(default_factory=Topology)
    strategy: str = "binpack"
    priority: int = 0
    replicas: int = 1
    retry_policy: RetryPolicy = dataclasses.field(default_factory=RetryPolicy)
    tolerations: tuple[Toleration, ...] = ()
    release: str = constants.RELEASE_ON_DELETE
    on_node_loss: str = constants.NODE_LOSS_KEEP
    preemption_policy: str = constants.PREEMPT_LOWER_PRIORITY
    gang_ref: str = ""  # accepted for ziwon/gpu-scheduler's claims, and ignored
    node_loss_grace_period_seconds: int = constants.NODE_LOSS_GRACE_S
    # What each replica's pods request (summed over the replica's pods), by resource: cpu in
    # millicores, memory, ephemeral-storage and hugepages-<size> in bytes, pods as a count.
    pod_resources: Mapping[str, int] = dataclasses.field(default_factory=dict, metadata=resource_list())
    # How long a claim pod may stay Unschedulable on the claim's node before the claim moves.
    unschedulable_grace_period_seconds: int = 60
    on_device_failure: str = constants.DEVICE_FAILURE_KEEP
    # How long a GPU must stay Unhealthy before an onDeviceFailure: Reallocate replica moves.
    device_failure_grace_period_seconds: int = constants.DEVICE_FAILURE_GRACE_S


# -------------------------------------------------------------- GpuClaim status


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeviceRef:
    index: int
    minor: int
    uuid: str
    slot: int | None = None  # a slot of a shared GPU (exclusivity Shared)
    milli: int | None = None  # a fractional share of the GPU (``sharing.milli``), in milli-GPU
    # A share's part of the GPU's memory (its milli of it), the MPS memory limit of its pods.
    memory_mib: int | None = dataclasses.field(default=None, metadata=json_name("memoryMiB"))

    @property
    def lock_id(self) -> str:
        """What its Lease is named from: the UUID (a share's too: the GPU's Lease holds its ledger),
        or the UUID and slot of a shared GPU."""
        return self.uuid if self.slot is None else constants.slot_id(self.uuid, self.slot)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Allocation:
    replica: int
    node_name: str
    devices: tuple[DeviceRef, ...]
    min_bandwidth_gbps: int = dataclasses.field(default=0, metadata=json_name("minBandwidthGBps"))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuClaimStatus:
    phase: str = constants.PHASE_PENDING
    allocations: tuple[Allocation, ...] = ()
    conditions: tuple[Condition, ...] = ()
    message: str = ""
    retry_count: int = 0
    last_schedule_time: str | None = None
    released_time: str | None = None
    preempted_by: str = ""
    # Nodes kube-scheduler could not place the claim's pods on (the claim moved off them); the
    # allocator passes over them. The most recent few (``controller.unplaceable.NODES_KEPT``).
    unplaceable_nodes: tuple[str, ...] = ()
    observed_generation: int = 0
    # Display fields for printer columns: "node-a,node-b" and "0,1,2,3".
    nodes: str = ""
    devices: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ObjectMeta:
    name: str
    namespace: str = ""
    uid: str = ""
    generation: int = 0
    resource_version: str = ""
    creation_timestamp: str = ""
    deletion_timestamp: str | None = None
    finalizers: tuple[str, ...] = ()
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    annotations: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuClaim:
    metadata: ObjectMeta
    spec: GpuClaimSpec
    status: GpuClaimStatus = dataclasses.field(default_factory=GpuClaimStatus)

    @property
    def key(self) -> str:
        """``namespace/name``, the work-queue and cache key."""
        return f"{self.metadata.namespace}/{self.metadata.name}"

    @property
    def releasing(self) -> bool:
        """Fenced for release (``constants.CONDITION_RELEASING`` True): the webhook admits no pod of it."""
        return any(
            c.type == constants.CONDITION_RELEASING and c.status == "True" for c in self.status.conditions
        )


# ---------------------------------------------------------------- GpuNodeStatus


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MigDevice:
    """A MIG device of a GPU in MIG mode: one compute instance of one GPU instance.

    Its GPU instance takes ``memory_slices`` memory slices of the parent GPU
    from ``placement_start`` on (NVML's placement: A100 and H100 have 8) and
    ``compute_slices`` compute slices (the 3 of ``3g.20gb``; 7 in all).
    """

    index: int
    uuid: str
    profile: str
    memory_mib: int = dataclasses.field(default=0, metadata=json_name("memoryMiB"))
    placement_start: int = -1  # -1: not known
    memory_slices: int = 0
    compute_slices: int = 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MigInfo:
    enabled: bool = False
    devices: tuple[MigDevice, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSharing:
    """A GPU the node's agent offers to ``Shared`` claims: up to ``replicas`` of them at once, by
    ``strategy`` (the agent's ``--sharing``). Such a GPU is never handed out whole."""

    strategy: str  # TimeSlicing | MPS
    replicas: int
    in_use: int = 0  # slots whose Lease is held, as the agent saw last


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    index: int
    minor: int
    uuid: str
    product: str = ""
    memory_mib: int = dataclasses.field(default=0, metadata=json_name("memoryMiB"))
    compute_capability: str = ""
    pci_bus_id: str = ""
    numa_node: int = -1
    health: str = constants.HEALTHY
    health_reason: str = ""
    pcie_generation: int = 0
    pcie_width: int = 0
    mig: MigInfo | None = None
    sharing: DeviceSharing | None = None  # shared by up to ``replicas`` Shared claims (not in MIG mode)
    idle_since: str | None = None  # RFC 3339: no compute process on it since then; None while one runs

    @property
    def shared(self) -> bool:
        return self.sharing is not None and not (self.mig is not None and self.mig.enabled)

    @property
    def lock_ids(self) -> tuple[str, ...]:
        """What its Leases are named from: its UUID, then its MIG instances' UUIDs, then its sharing
        slots (``constants.slot_id``). One piece of silicon, whichever is handed out."""
        instances = tuple(m.uuid for m in (self.mig.devices if self.mig is not None else ()))
        slots = tuple(self.slot_ids) if self.shared else ()
        return (self.uuid, *instances, *slots)

    @property
    def slot_ids(self) -> tuple[str, ...]:
        replicas = self.sharing.replicas if self.sharing is not None else 0
        return tuple(constants.slot_id(self.uuid, k) for k in range(replicas))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    a: int
    b: int
    type: str
    nvlinks: int = 0
    bandwidth_gbps: int = dataclasses.field(default=0, metadata=json_name("bandwidthGBps"))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeInventory:
    """The status of a GpuNodeStatus: what the agent saw on its node."""

    source: str = "simulated"
    driver_version: str = ""
    cuda_version: str = ""
    devices: tuple[Device, ...] = ()
    links: tuple[Link, ...] = ()
    islands: tuple[tuple[int, ...], ...] = ()
    total: int = 0
    healthy: int = 0
    allocated: int = 0
    product: str = ""
    last_heartbeat_time: str | None = None
    conditions: tuple[Condition, ...] = ()
    unexpected_processes: tuple[UnexpectedProcess, ...] = ()  # the agent's usage audit


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UnexpectedProcess:
    """A process on a GPU that no claim holds, or whose pod is not a pod of the claim that holds it."""

    index: int  # the GPU's host index
    uuid: str  # the GPU's UUID
    pid: int  # as the node sees it
    pod_uid: str = dataclasses.field(default="", metadata=json_name("podUID"))  # "" when not known
    pod: str = ""  # namespace/name, when the agent knows the pod
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuNodeStatusSpec:
    node_name: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuNodeStatus:
    metadata: ObjectMeta
    spec: GpuNodeStatusSpec
    status: NodeInventory = dataclasses.field(default_factory=NodeInventory)


# ---------------------------------------------------------------- GpuQuota


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProductLimit:
    pattern: str  # fnmatch, case-sensitive: "*H100*"
    gpus: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuQuotaSpec:
    gpus: int
    products: tuple[ProductLimit, ...] = ()
    max_priority: int | None = None
    max_claims: int | None = None  # the most GpuClaims of the namespace the controller considers
    allowed_tolerations: tuple[Toleration, ...] = ()  # what the claims may tolerate; () = the defaults only


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class QuotaEntry:
    """One admitted claim in a quota's ledger."""

    name: str
    gpus: int  # whole GPUs, or milli-GPU shares rounded up
    product: str = ""  # the product names of its devices, comma-separated; "" before a plan
    milli: int | None = None  # milli-GPU shares: the exact count, in milli-GPU


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuQuotaStatus:
    used: int = 0
    used_milli: int = 0  # exactly, milli-GPU shares counted as their fraction
    used_by_product: Mapping[str, int] = dataclasses.field(default_factory=dict)
    claims: Mapping[str, QuotaEntry] = dataclasses.field(default_factory=dict)  # claim uid ->


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GpuQuota:
    metadata: ObjectMeta
    spec: GpuQuotaSpec
    status: GpuQuotaStatus = dataclasses.field(default_factory=GpuQuotaStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"
