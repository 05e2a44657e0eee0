"""The allocator's view of each GPU node, built from the cached Nodes and GpuNodeStatuses (pure).

``build_node_views`` makes one ``allocator.NodeView`` per node with a
GpuNodeStatus; the caller says which devices are taken. ``node_ready`` is the
freshness rule, ``seed_for`` the per-claim seed of the random strategies.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from controller import allocator, gates
from gpualloc.api import constants, leases, models, requests, taints, timestamps


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeFacts:
    """What the allocator needs from a core/v1 Node."""

    name: str
    labels: Mapping[str, str]
    unschedulable: bool
    taints: tuple[models.Taint, ...] = ()
    # status.allocatable of the resources gpualloc counts (``requests.counted``), in each
    # resource's unit (millicores, bytes, a count); empty when the Node reports none. Not
    # screened on yet (issue 41).
    allocatable: Mapping[str, int] = dataclasses.field(default_factory=dict)


def kept_of_node(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a core/v1 Node the controller caches: what ``node_facts`` reads. A kubelet's
    Node carries much more (its status lists every image on the node, its conditions, addresses
    and capacity), which at thousands of nodes is most of the controller's memory; of the status
    only the ``allocatable`` of the resources gpualloc counts is kept."""
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    kept = {
        "apiVersion": raw.get("apiVersion", "v1"),
        "kind": raw.get("kind", "Node"),
        "metadata": {k: metadata[k] for k in ("name", "uid", "resourceVersion", "labels") if k in metadata},
        "spec": {k: spec[k] for k in ("unschedulable", "taints") if k in spec},
    }
    allocatable = _counted_allocatable(raw)
    if allocatable:
        kept["status"] = {"allocatable": allocatable}
    return kept


def _counted_allocatable(raw: Mapping[str, Any]) -> dict[str, Any]:
    allocatable = (raw.get("status") or {}).get("allocatable")
    if not isinstance(allocatable, Mapping):
        return {}
    return {str(k): v for k, v in allocatable.items() if requests.counted(str(k))}


def node_facts(raw: Mapping[str, Any]) -> NodeFacts:
    metadata = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    return NodeFacts(
        name=str(metadata.get("name", "")),
        labels={str(k): str(v) for k, v in (metadata.get("labels") or {}).items()},
        unschedulable=bool(spec.get("unschedulable", False)),
        taints=taints.node_taints(raw),
        allocatable=requests.parse_resource_list(_counted_allocatable(raw)),
    )


# A GpuNodeStatus whose heartbeat is older than this is not allocated from (--node-stale-after).
NODE_STALE_AFTER_S = 120.0


def node_ready(inventory: models.NodeInventory, *, heartbeat_age: float | None, stale_after: float) -> bool:
    """The GpuNodeStatus Ready condition is True and its heartbeat is at most ``stale_after`` s old.

    ``heartbeat_age`` is measured by the caller: the controller counts from when
    it last saw the heartbeat change, on its own monotonic clock, so an agent
    clock that is hours ahead or behind changes nothing (``state``). None: no
    heartbeat at all.
    """
    ready = any(c.type == constants.CONDITION_READY and c.status == "True" for c in inventory.conditions)
    return ready and heartbeat_age is not None and heartbeat_age <= stale_after


def heartbeat_age_by_clock(heartbeat: str | None, now: datetime.datetime) -> float | None:
    """Seconds since ``heartbeat``, a time the agent wrote (``gpualloc.views.latest_heartbeats``):
    what a one-off reader such as ``gpualloc explain`` can tell (it trusts the agent's clock);
    None without a heartbeat."""
    beat = timestamps.parse_time(heartbeat)
    return None if beat is None else (now - beat).total_seconds()


def build_node_views(
    *,
    statuses: Mapping[str, models.GpuNodeStatus],
    nodes: Mapping[str, NodeFacts],
    is_taken: Callable[[str], bool],  # by device UUID
    heartbeat_ages: Mapping[str, float | None],  # by node name, see node_ready
    stale_after: float,
    requested: Mapping[str, Mapping[str, int]] | None = None,  # by node name: ``requested_by_node``
    milli_used: Callable[[str], int | None] | None = None,  # by taken GPU UUID (``node_view``)
) -> list[allocator.NodeView]:
    """One ``NodeView`` per GPU node (a node with a GpuNodeStatus), sorted by name.

    ``statuses`` is keyed by node name (``spec.nodeName``). ``is_taken`` says
    whether a device (by UUID) is taken. Nodes without a GpuNodeStatus have no
    GPUs and are left out. Without ``requested`` the pods' fit is not checked.
    """
    return [
        node_view(
            name,
            statuses[name],
            nodes.get(name),
            is_taken=is_taken,
            milli_used=milli_used,
            heartbeat_age=heartbeat_ages.get(name),
            stale_after=stale_after,
            requested=None if requested is None else requested.get(name, {}),
        )
        for name in sorted(statuses)
    ]


def node_view(
    name: str,
    status: models.GpuNodeStatus,
    facts: NodeFacts | None,
    *,
    is_taken: Callable[[str], bool],
    heartbeat_age: float | None,
    stale_after: float,
    requested: Mapping[str, int] | None = None,
    milli_used: Callable[[str], int | None] | None = None,
) -> allocator.NodeView:
    """The ``NodeView`` of one GPU node (see ``build_node_views``); ``requested``: what the
    non-terminal pods bound to it request (``requests.add`` of each), None when not known;
    ``milli_used``: what the milli-GPU shares take of a taken GPU, None when it is held whole
    (``milli_used`` None: every taken GPU is held whole)."""
    inventory = status.status
    allocatable = facts.allocatable if facts is not None and requested is not None else {}
    taken = taken_on(inventory, is_taken)
    used = {} if milli_used is None else shares_on(inventory, taken, milli_used)
    return allocator.NodeView(
        name=name,
        labels=facts.labels if facts else {},
        unschedulable=facts.unschedulable if facts else False,
        taints=facts.taints if facts else (),
        node_present=facts is not None,
        ready=node_ready(inventory, heartbeat_age=heartbeat_age, stale_after=stale_after),
        inventory=inventory,
        taken=taken,
        allocatable=allocatable,
        free=requests.node_free(allocatable, requested or {}),
        milli_used=used,
    )


def shares_on(
    inventory: models.NodeInventory, taken: frozenset[str], milli_used: Callable[[str], int | None]
) -> dict[str, int]:
    """The taken GPUs of a node that hold milli-GPU shares and nothing whole, and what the shares
    use of each. A GPU whose MIG instances or sharing slots are taken is the same silicon, held
    whole."""
    used: dict[str, int] = {}
    for device in inventory.devices:
        if device.uuid not in taken or any(i in taken for i in device.lock_ids[1:]):
            continue
        milli = milli_used(device.uuid)
        if milli is not None:
            used[device.uuid] = milli
    return used


def taken_on(inventory: models.NodeInventory, is_taken: Callable[[str], bool]) -> frozenset[str]:
    """The taken lock ids of a node's GPUs, MIG instances and sharing slots (``Device.lock_ids``).
    A GPU, its MIG instances and its slots are the same silicon: a GPU is taken when one of its
    instances or slots is, and every instance and slot when the GPU is."""
    taken: set[str] = set()
    for device in inventory.devices:
        if is_taken(device.uuid):
            taken.update(device.lock_ids)
            continue
        instances = {uuid for uuid in device.lock_ids[1:] if is_taken(uuid)}
        if instances:
            taken |= instances | {device.uuid}
    return frozenset(taken)


def held_by_claims(claims: Iterable[models.GpuClaim]) -> tuple[frozenset[str], Callable[[str], int | None]]:
    """What these claims' statuses hold, for a one-off reader (``explain``, ``simulate``): the lock
    ids they list (the GPUs of their shares included), and what the shares use of each GPU (None:
    a claim lists it whole): the ``is_taken`` and ``milli_used`` of ``node_view``."""
    taken: set[str] = set()
    whole: set[str] = set()
    shares: dict[str, int] = {}
    for claim in claims:
        for alloc in claim.status.allocations:
            for device in alloc.devices:
                taken.add(device.lock_id)
                if device.milli:
                    shares[device.uuid] = shares.get(device.uuid, 0) + device.milli
                else:
                    whole.add(device.lock_id)

    def milli_used(uuid: str) -> int | None:
        return None if uuid in whole else min(shares.get(uuid, 0), leases.WHOLE_MILLI)

    return frozenset(taken), milli_used


def seed_for(uid: str) -> int:
    """A stable seed per claim for ``strategy: random`` (a retry makes the same choice)."""
    value = 0
    for char in uid:
        value = (value * 131 + ord(char)) % (1 << 61)
    return value


def requested_by_node(pods: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """What the pods bound to each node request, summed (``gates.kept_requests``), of those among
    ``pods`` that are not Succeeded or Failed: the ``requested`` of ``node_view``."""
    out: dict[str, dict[str, int]] = {}
    for pod in pods:
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        phase = (pod.get("status") or {}).get("phase")
        if node and phase not in ("Succeeded", "Failed"):
            requests.add(out.setdefault(node, {}), gates.kept_requests(dict(pod)))
    return out
