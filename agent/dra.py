"""What the agent, as gpualloc's DRA kubelet plugin, answers for a ResourceClaim (pure).

The controller writes one ``resource.k8s.io/v1`` ResourceClaim per Allocated replica; its
``status.allocation.devices.results`` name, for driver ``gpu.gpualloc.dev`` and pool = the node,
each device by ``constants.dra_device_name(lock_id)``: a GPU's UUID, a MIG instance's UUID or a
shared GPU's slot id (``<GPU-uuid>-s<k>``), in lower case. ``prepare`` turns a claim into the CDI
device IDs the kubelet hands the runtime: a GPU's own CDI device, a MIG instance's, and for a slot
its GPU's. A claim that names a device this node does not have, or none of ours on this node,
fails as a whole: a container is never started with part of its GPUs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent import inventory
from gpualloc import cdi
from gpualloc.api import constants, models

MODES = ("gpualloc", "nvidia")  # whose CDI spec names the devices: the agent's own, or nvidia-ctk's
_SLOT = re.compile(r"^(?P<gpu>.+)-s(?P<slot>[0-9]+)$")  # constants.slot_id, lower case


def gpus(facts: inventory.NodeFacts) -> list[cdi.Gpu]:
    """The node's GPUs as the CDI spec and the device index need them, each MIG instance with the
    minors of its two capability nodes where the source knows both; a lost GPU is left out (a
    claim naming it fails to prepare)."""
    found = []
    for d in facts.devices:
        if d.lost:
            continue
        instances = {i.uuid: i for i in d.mig_instances}
        migs = []
        for m in d.mig.devices if d.mig is not None and d.mig.enabled else ():
            where = instances.get(m.uuid)
            caps = None
            if (
                where is not None
                and where.gpu_instance_cap is not None
                and where.compute_instance_cap is not None
            ):
                caps = (where.gpu_instance_cap, where.compute_instance_cap)
            migs.append(cdi.Mig(uuid=m.uuid, caps=caps))
        found.append(cdi.Gpu(minor=d.minor, uuid=d.uuid, migs=tuple(migs)))
    return found


def health(devices: Sequence[models.Device]) -> dict[str, tuple[bool, str]]:
    """DRA device name -> (healthy, reason) for every device a claim can be given: each GPU, its MIG
    instances and its slots (``Device.lock_ids``), as its GPU is."""
    found: dict[str, tuple[bool, str]] = {}
    for device in devices:
        state = (device.health == constants.HEALTHY, device.health_reason)
        for lock_id in device.lock_ids:
            found[constants.dra_device_name(lock_id)] = state
    return found


def device_index(gpus: Sequence[cdi.Gpu], mode: str = "gpualloc") -> dict[str, str]:
    """DRA device name (lower case) -> CDI device ID, for every GPU and MIG instance of the node."""
    kind = cdi.NVIDIA_KIND if mode == "nvidia" else cdi.KIND
    index: dict[str, str] = {}
    for gpu in gpus:
        index[constants.dra_device_name(gpu.uuid)] = cdi.qualified_name(gpu.uuid, kind)
        for mig in gpu.migs:
            index[constants.dra_device_name(mig.uuid)] = cdi.qualified_name(mig.uuid, kind)
    return index


def cdi_id(index: Mapping[str, str], device: str) -> str | None:
    """The CDI device ID of DRA device ``device``: a GPU's or MIG instance's own, a slot's GPU's."""
    found = index.get(device)
    if found is not None:
        return found
    slot = _SLOT.match(device)
    return index.get(slot.group("gpu")) if slot else None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PreparedDevice:
    request: str
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """One claim's answer: its devices, or why it could not be prepared."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


def prepare(claim: Mapping[str, Any], uid: str, node: str, index: Mapping[str, str]) -> Prepared:
    """The answer for ResourceClaim ``claim`` (as the API server returned it), which the kubelet
    asked for by ``uid``, on node ``node`` whose devices ``index`` maps (``device_index``)."""
    meta = claim.get("metadata") or {}
    ref = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
    if meta.get("uid") != uid:
        return Prepared(error=f"ResourceClaim {ref} has uid {meta.get('uid')!r}, not {uid!r}")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        return Prepared(error=f"ResourceClaim {ref} is not allocated")
    results = ((allocation.get("devices") or {}).get("results")) or []
    ours = [r for r in results if r.get("driver") == constants.DRA_DRIVER and r.get("pool") == node]
    if not ours:
        return Prepared(error=f"ResourceClaim {ref} names no device of {constants.DRA_DRIVER} on node {node}")
    devices: list[PreparedDevice] = []
    unknown: list[str] = []
    for result in ours:
        device = str(result.get("device") or "")
        found = cdi_id(index, device)
        if found is None:
            unknown.append(device)
            continue
        devices.append(
            PreparedDevice(
                request=str(result.get("request") or ""), pool=node, device=device, cdi_ids=(found,)
            )
        )
    if unknown:
        return Prepared(
            error=f"ResourceClaim {ref} names devices node {node} does not have: {', '.join(unknown)}"
        )
    return Prepared(devices=tuple(devices))
