"""What a pod of a claim gets: one pure function of the pod and the claim, ``edits``.

``admission`` decides whether a pod is let in and which replica it is;
``edits`` says what it then gets, as JSON Patch operations made by
``mutations`` (the DRA example driver keeps its container edits in one
function the same way):

* an Allocated claim's replica (``allocation``): the claim's tolerations, a
  ``nodeSelector kubernetes.io/hostname`` pinning the pod to the replica's
  node, ``CUDA_VISIBLE_DEVICES`` and ``NVIDIA_VISIBLE_DEVICES`` in every
  container and init container (``device_env``), a Shared MPS claim's client
  limits (``sharing_env``), the devices' UUIDs comma-joined in the
  ``gpu.scheduling/devices`` annotation, the scheduling gate
  ``gpu.scheduling/claim-allocated`` and the gated label. The controller lifts
  the gate once the API server still holds that claim with those devices
  (``controller.gating``);
* no allocation yet (gate mode): the claim's tolerations (the defaults when
  the claim does not exist yet), the gate and the label, no
  ``gpu.scheduling/devices`` annotation (a user-set one is removed: only the
  controller says which devices a pod gets), and the device env vars read
  from that annotation through the downward API, which the controller fills
  in when it lifts the gate. Gate mode always yields UUIDs, whatever the
  device-id mode, since the annotation holds UUIDs.

With DRA (``resource_claim``, the webhook's ``--dra``), both kinds of pod also name the
replica's ResourceClaim (``constants.resource_claim_name``, which the controller writes) in
``spec.resourceClaims`` as ``gpualloc-gpus``, and every container and init container that gets
the env lists it in ``resources.claims`` (``dra_edits``): kube-scheduler then places the pod where
the claim's allocation says and the kubelet has the driver (the agent) prepare exactly its devices.
``spec.resourceClaims`` cannot change once the pod exists, so a gated pod gets it at creation too:
its replica is known then. The env stays, for the runtimes that read it.

Device ids: UUIDs by default. ``device_ids="index"`` is for clusters whose
container runtime exposes every GPU of the node to every container: it writes
host indices to ``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (so
CUDA numbers GPUs as nvidia-smi does) and ``NVIDIA_VISIBLE_DEVICES=all``: were
the runtime to expose only the allocated GPUs, they would be renumbered from 0
inside the container and host indices would name the wrong devices, so index
mode must not ask it to. MIG instances are always given by UUID.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from gpualloc.api import constants, models, pods, taints
from webhook import mutations, objects

DeviceIdMode = Literal["uuid", "index"]

_GATED_ENV = [mutations.annotation_env(name) for name in mutations.DEVICE_ENV_NAMES]


def edits(
    pod: objects.Pod[Any],
    claim: models.GpuClaim | None,
    allocation: models.Allocation | None = None,
    device_ids: DeviceIdMode = "uuid",
    resource_claim: str = "",
) -> tuple[list[mutations.Op], list[str]]:
    """The patch that gives ``pod`` what ``claim`` provides, and the user-set env entries it replaces
    (``container/NAME``; none in gate mode).

    With ``allocation`` (the pod's replica's, holding devices): the allocated pod; without, the
    pod of a claim not allocated yet, or not created yet (``claim`` None), in gate mode. With
    ``resource_claim`` (DRA on): the pod also uses that ResourceClaim (``dra_edits``)."""
    spec = claim.spec if claim is not None else None
    tolerations = taints.claim_tolerations(spec) if spec is not None else taints.DEFAULT_TOLERATIONS
    extra_env = sharing_env(spec, allocation) if spec is not None else []
    replaced: list[str] = []
    if allocation is None:
        ops = edit_gated(pod, tolerations, extra_env)
    else:
        ops, replaced = edit_allocated(pod, allocation, device_ids, tolerations, extra_env)
    if resource_claim:
        dra_edits(pod, resource_claim, ops)
    return ops, replaced


def dra_edits(pod: objects.Pod[Any], resource_claim: str, ops: list[mutations.Op]) -> None:
    """Name the ResourceClaim ``resource_claim`` as ``gpualloc-gpus`` in ``spec.resourceClaims``, and
    that in every container's and init container's ``resources.claims``."""
    mutations.add_resource_claim(pod, resource_claim, ops)
    mutations.use_resource_claim_everywhere(pod, ops)


def device_env(
    devices: Sequence[models.DeviceRef], device_ids: DeviceIdMode = "uuid"
) -> list[dict[str, Any]]:
    """The env entries that give a container ``devices``, as UUIDs or as host indices (MIG
    instances always by UUID: an index names a whole GPU)."""
    if device_ids == "index" and not any(d.uuid.startswith("MIG-") for d in devices):
        return [
            mutations.value_env(mutations.ENV_CUDA_VISIBLE_DEVICES, ",".join(str(d.index) for d in devices)),
            mutations.value_env(mutations.ENV_NVIDIA_VISIBLE_DEVICES, "all"),
            mutations.value_env(mutations.ENV_CUDA_DEVICE_ORDER, "PCI_BUS_ID"),
        ]
    uuids = ",".join([d.uuid for d in devices])
    return [mutations.value_env(name, uuids) for name in mutations.DEVICE_ENV_NAMES]


def sharing_env(
    spec: models.GpuClaimSpec, allocation: models.Allocation | None = None
) -> list[dict[str, Any]]:
    """The MPS client limits of a Shared MPS claim (``sharing.computePercent``, ``memoryMiB``), for
    each of its ``count`` GPUs as the container numbers them (0, 1, ...); none for other claims.

    A milli-GPU share's follow from its share: the thread percentage is its milli in percent, and
    the memory limit its part of the GPU's memory, which the allocation says (``DeviceRef.memoryMiB``)
    or, for a pod waiting at the gate, the annotation the controller sets when it lifts the gate
    (``gpu.scheduling/mps-memory-limit``, through the downward API)."""
    sharing = spec.devices.sharing
    if spec.devices.exclusivity != "Shared" or sharing is None or sharing.strategy != "MPS":
        return []
    if sharing.milli is not None:
        percent = str(pods.share_thread_percentage(sharing.milli))
        if allocation is None:
            limit = mutations.annotation_env(
                mutations.ENV_MPS_MEMORY_LIMIT, constants.ANNOTATION_MPS_MEMORY_LIMIT
            )
        else:
            limit = mutations.value_env(
                mutations.ENV_MPS_MEMORY_LIMIT, pods.share_memory_limit(allocation.devices)
            )
        return [mutations.value_env(mutations.ENV_MPS_THREAD_PERCENTAGE, percent), limit]
    entries = []
    if sharing.compute_percent is not None:
        entries.append(mutations.value_env(mutations.ENV_MPS_THREAD_PERCENTAGE, str(sharing.compute_percent)))
    if sharing.memory_mib is not None:
        limits = ",".join(f"{i}={sharing.memory_mib}M" for i in range(spec.devices.count))
        entries.append(mutations.value_env(mutations.ENV_MPS_MEMORY_LIMIT, limits))
    return entries


def edit_allocated(
    pod: objects.Pod[Any],
    allocation: models.Allocation,
    device_ids: DeviceIdMode = "uuid",
    tolerations: Sequence[models.Toleration] = (),
    extra_env: Sequence[dict[str, Any]] = (),
) -> tuple[list[mutations.Op], list[str]]:
    """The patch for an allocated claim, and the user-set env entries it replaces (``container/NAME``).
    ``extra_env``: more entries for every container (``sharing_env``). The pod waits at the gate
    until the controller has checked the claim against the API server (``controller.gating``)."""
    ops: list[mutations.Op] = []
    mutations.add_tolerations(pod, tolerations, ops)
    mutations.pin_to_node(pod, allocation.node_name, ops)
    entries = [*device_env(allocation.devices, device_ids), *extra_env]
    replaced = mutations.set_env_everywhere(pod, entries, ops)
    uuids = ",".join([d.uuid for d in allocation.devices])
    mutations.set_annotation(pod, constants.ANNOTATION_DEVICES, uuids, ops)
    mutations.add_scheduling_gate(pod, ops)
    mutations.set_label(pod, constants.LABEL_GATED, "true", ops)
    return ops, replaced


def edit_gated(
    pod: objects.Pod[Any],
    tolerations: Sequence[models.Toleration] = (),
    extra_env: Sequence[dict[str, Any]] = (),
) -> list[mutations.Op]:
    """The patch for a claim not allocated yet, in gate mode. ``extra_env``: as ``edit_allocated``'s
    (a claim that does not exist yet has none: its pod gets no MPS limits)."""
    ops: list[mutations.Op] = []
    mutations.add_tolerations(pod, tolerations, ops)
    # Only the controller may say which devices the pod gets (and an MPS share's memory limit):
    # drop a user-set value.
    mutations.remove_annotation(pod, constants.ANNOTATION_DEVICES, ops)
    mutations.remove_annotation(pod, constants.ANNOTATION_MPS_MEMORY_LIMIT, ops)
    mutations.add_scheduling_gate(pod, ops)
    mutations.set_label(pod, constants.LABEL_GATED, "true", ops)
    mutations.set_env_everywhere(pod, [*_GATED_ENV, *extra_env], ops)
    return ops
