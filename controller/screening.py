"""Screening: whether a node can take one replica of a claim, and with which devices (pure).

``screen`` runs the node's own checks (Node object, cordon, taints, status, readiness,
nodeName, selector), then picks the node's usable devices for the claim's kind: whole GPUs
(free, healthy, matching, pinned by ``preferIds``), MIG instances, or slots of shared GPUs. A
node that cannot take the replica gives a ``Miss``: the phrase the reason's summary counts and
the node's own line. The rules are in the allocator's module docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from controller import nodes
from controller.asks import Ask, matches, matches_selector
from controller.nodes import MIG_MODE, SHARED, NodeView, in_mig_mode
from gpualloc.api import constants, leases, models, requests, taints

_NOUNS = {"cpu": "CPU", "pods": "pod slots"}


@dataclasses.dataclass(frozen=True, slots=True)
class Miss:
    """Why a node cannot take the replica: the summary phrase and the node's own line."""

    rank: int  # order among summary groups with equal counts
    one: str  # "is cordoned"
    many: str  # "are cordoned"
    detail: str
    pods_lack: bool = False  # the pods' CPU, memory or pod slots kept the node out (``_resources_miss``)


@dataclasses.dataclass(slots=True)
class Screened:
    """A node that passed the node checks and has at least ``count`` usable devices."""

    view: NodeView
    prep: nodes.Prepared
    position: int  # in sorted node names
    total: int
    free: int  # healthy and not taken
    usable: list[models.Device]  # free, matching, (preferIds), sorted by index


def screen(view: NodeView, ask: Ask, position: int, extra_taken: set[str], n_nodes: int) -> Screened | Miss:
    miss = _node_miss(view, ask)
    if miss is not None:
        return miss
    assert view.inventory is not None
    if ask.exclusivity == "MIG":
        return _screen_mig(view, ask, position, extra_taken, n_nodes)
    if ask.exclusivity == "Shared" and ask.sharing.milli is not None:
        return _screen_milli(view, ask, position, extra_taken, n_nodes)
    if ask.exclusivity == "Shared":
        return _screen_shared(view, ask, position, extra_taken, n_nodes)
    prep = nodes.prepare(view.name, view.inventory, n_nodes)
    taken = view.taken
    if extra_taken:
        free_devs = [d for d in prep.healthy if d.uuid not in taken and d.uuid not in extra_taken]
    else:
        free_devs = [d for d in prep.healthy if d.uuid not in taken]
    usable = [d for d in free_devs if matches(ask, d)] if ask.filters else free_devs
    total, free = len(prep.by_index), len(free_devs)

    if ask.prefer_ids:
        return _screen_prefer_ids(view, prep, ask, position, free, usable, extra_taken)

    if len(usable) < ask.count:
        counts = (
            (len(prep.healthy) - free, "taken"),
            (total - len(prep.healthy) - prep.in_mig - prep.shared, "unhealthy"),
            (prep.in_mig, MIG_MODE),
            (prep.shared, SHARED),
            (free - len(usable), "not" + ask.filters if ask.filters else "not matching"),
        )
        parts = [f"{n} {what}" for n, what in counts if n]
        extra = f" ({', '.join(parts)})" if parts else ""
        phrase = f"fewer than {ask.count} free healthy GPUs{ask.filters}"
        return Miss(
            6,
            f"has {phrase}",
            f"have {phrase}",
            f"{len(usable)} of {total} GPUs usable{extra}; need {ask.count}",
        )
    return Screened(view, prep, position, total, free, usable)


def _node_miss(view: NodeView, ask: Ask) -> Miss | None:
    """Why the node itself cannot take the claim, before its devices are looked at."""
    if not view.node_present:
        return Miss(0, "has no Node object", "have no Node object", "the Node object does not exist")
    if view.unschedulable:
        return Miss(1, "is cordoned", "are cordoned", "cordoned (spec.unschedulable)")
    taint = taints.untolerated(view.taints, ask.tolerations)
    if taint is not None:
        phrase = f"tainted {taint}"
        return Miss(1, f"is {phrase}", f"are {phrase}", f"{phrase}, which the claim does not tolerate")
    inv = view.inventory
    if inv is None:
        return Miss(
            2, "has no GpuNodeStatus", "have no GpuNodeStatus", "no GpuNodeStatus (agent not running?)"
        )
    if not view.ready:
        return Miss(
            3, "is not ready", "are not ready", "GpuNodeStatus not Ready or heartbeat stale (agent down?)"
        )
    if ask.node_name is not None and view.name != ask.node_name:
        phrase = f'the requested nodeName "{ask.node_name}"'
        return Miss(4, f"is not {phrase}", f"are not {phrase}", f"not {phrase}")
    if not matches_selector(ask.selector, view.labels):
        return Miss(
            5, "does not match the selector", "do not match the selector", "labels do not match selector"
        )
    if view.name in ask.avoid_nodes:
        return Miss(
            5,
            "could not run the claim's pods",
            "could not run the claim's pods",
            "kube-scheduler could not place the claim's pods here (status.unplaceableNodes)",
        )
    return _resources_miss(view, ask)


def _resources_miss(view: NodeView, ask: Ask) -> Miss | None:
    """Why the node cannot take the replica's pods (kube-scheduler's NodeResourcesFit on what the
    pods request and what is left of the node's allocatable); None where the node's allocatable is
    not known."""
    if not view.allocatable:
        return None
    short = requests.shortfall(ask.pod_requests, view.free)
    if not short:
        return None
    names = ", ".join(_NOUNS.get(s.resource, s.resource) for s in short)
    return Miss(
        5,
        f"has too little {names} for the pods",
        f"have too little {names} for the pods",
        requests.lacking(short, view.allocatable),
        pods_lack=True,
    )


def taking_pods(view: NodeView, ask: Ask) -> NodeView:
    """``view`` once one more replica's pods are bound to the node (a gang's next replica there)."""
    if not view.allocatable:
        return view
    free = dict(view.free)
    requests.add(free, {name: -value for name, value in ask.pod_requests.items()})
    return dataclasses.replace(view, free=free)


def _screen_mig(
    view: NodeView, ask: Ask, position: int, extra_taken: set[str], n_nodes: int
) -> Screened | Miss:
    """A MIG claim's screening: the node's free MIG instances that match, as pseudo-devices (the
    parent's index and minor, the instance's UUID, "MIG <profile>" as product), parent by parent
    in placement order, so that a claim of several packs onto one GPU."""
    assert view.inventory is not None
    taken = view.taken
    total = 0
    free: list[tuple[models.Device, models.MigDevice]] = []
    for parent in sorted(view.inventory.devices, key=lambda d: d.index):
        if not in_mig_mode(parent):
            continue
        assert parent.mig is not None
        total += len(parent.mig.devices)
        if parent.health != constants.HEALTHY:
            continue  # (held whole, every instance of it is in ``taken``: views.taken_on)
        for m in sorted(parent.mig.devices, key=lambda m: (m.placement_start, m.index)):
            if m.uuid not in taken and m.uuid not in extra_taken:
                free.append((parent, m))
    usable = [
        models.Device(
            index=parent.index,
            minor=parent.minor,
            uuid=m.uuid,
            product=f"MIG {m.profile}",
            memory_mib=m.memory_mib,
            compute_capability=parent.compute_capability,
        )
        for parent, m in free
        if (not ask.mig_profiles or m.profile in ask.mig_profiles)
        and matches(ask, dataclasses.replace(parent, memory_mib=m.memory_mib))
    ]
    if len(usable) < ask.count:
        if total == 0:
            return Miss(6, "has no GPU in MIG mode", "have no GPU in MIG mode", "no GPU in MIG mode")
        phrase = f"fewer than {ask.count} free MIG instances{ask.filters}"
        detail = f"{len(usable)} of {total} MIG instances usable ({total - len(free)} taken or unhealthy)"
        return Miss(6, f"has {phrase}", f"have {phrase}", f"{detail}; need {ask.count}")
    prep = nodes.prepare(view.name, view.inventory, n_nodes)
    return Screened(view, prep, position, total, len(free), usable)


def _identity(gpu: models.Device) -> dict[str, Any]:
    """What a slot or a share offered carries of its GPU: which one it is, and what ``matches``
    and the allocation read."""
    return {
        "index": gpu.index,
        "minor": gpu.minor,
        "uuid": gpu.uuid,
        "product": gpu.product,
        "memory_mib": gpu.memory_mib,
        "compute_capability": gpu.compute_capability,
    }


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlotDevice(models.Device):
    """A slot of a shared GPU, as screening offers it: the GPU, and which of its slots."""

    slot: int


def _screen_shared(
    view: NodeView, ask: Ask, position: int, extra_taken: set[str], n_nodes: int
) -> Screened | Miss:
    """A Shared claim's screening: one free slot (the lowest) of each healthy shared GPU whose
    strategy is the claim's and whose slots are at most its ``maxClaimsPerGPU``, fullest GPU first,
    so claims pack onto GPUs already shared. A gang's replicas never share a GPU (``extra_taken``
    holds the UUIDs of the GPUs its earlier replicas took). ``total`` and ``free`` count slots."""
    assert view.inventory is not None
    taken, most = view.taken, ask.sharing.max_claims_per_gpu
    total, free, offered = 0, 0, []
    for gpu in view.inventory.devices:
        if not gpu.shared or gpu.health != constants.HEALTHY:
            continue
        assert gpu.sharing is not None
        if gpu.sharing.strategy != ask.sharing.strategy or (most is not None and gpu.sharing.replicas > most):
            continue
        open_slots = [k for k, slot in enumerate(gpu.slot_ids) if slot not in taken]
        total += gpu.sharing.replicas
        free += len(open_slots)
        if open_slots and gpu.uuid not in extra_taken and matches(ask, gpu):
            offered.append((len(open_slots), gpu.index, gpu, open_slots[0]))
    usable: list[models.Device] = [
        SlotDevice(**_identity(gpu), slot=slot) for _, _, gpu, slot in sorted(offered, key=lambda o: o[:2])
    ]
    if len(usable) < ask.count:
        limit = f" of at most {most} claims" if most is not None else ""
        if total == 0:
            phrase = f"no GPU shared by {ask.sharing.strategy}{limit}"
            return Miss(6, f"has {phrase}", f"have {phrase}", phrase)
        phrase = f"fewer than {ask.count} {ask.sharing.strategy} GPUs with a free slot{ask.filters}"
        detail = f"{len(usable)} shared GPUs usable ({total - free} of {total} slots taken); need {ask.count}"
        return Miss(6, f"has {phrase}", f"have {phrase}", detail)
    prep = nodes.prepare(view.name, view.inventory, n_nodes)
    return Screened(view, prep, position, total, free, usable)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShareDevice(models.Device):
    """A milli-GPU share of a GPU, as screening offers it: the GPU, and the share."""

    milli: int


def _screen_milli(
    view: NodeView, ask: Ask, position: int, extra_taken: set[str], n_nodes: int
) -> Screened | Miss:
    """A fractional claim's screening: the healthy whole GPUs (not in MIG mode, not offered as
    slots) that are free or hold only shares, with ``sharing.milli`` left, best fit first (the least
    left once the share is placed, then by index), so shares pack onto GPUs already shared and whole
    GPUs stay whole. A gang's replicas never share a GPU (``extra_taken``). ``total`` and ``free``
    count GPUs: those shares may go on, and those with room for this one."""
    assert view.inventory is not None and ask.sharing.milli is not None
    milli, taken, used = ask.sharing.milli, view.taken, view.milli_used
    prep = nodes.prepare(view.name, view.inventory, n_nodes)
    open_gpus = [d for d in prep.healthy if d.uuid not in taken or d.uuid in used]
    left = {d.uuid: leases.WHOLE_MILLI - used.get(d.uuid, 0) for d in open_gpus}
    roomy = [d for d in open_gpus if left[d.uuid] >= milli and d.uuid not in extra_taken]
    fitting = [d for d in roomy if matches(ask, d)] if ask.filters else roomy
    usable: list[models.Device] = [
        ShareDevice(**_identity(d), milli=milli)
        for d in sorted(fitting, key=lambda d: (left[d.uuid] - milli, d.index))
    ]
    if not usable:
        phrase = f"no GPU with {milli} milli-GPU free{ask.filters}"
        most = max(left.values(), default=0)
        detail = (
            f"{len(open_gpus)} of {len(prep.by_index)} GPUs free or shared, the most free has"
            f" {most} milli-GPU ({len(roomy)} with room{', none matching' if roomy else ''}); need {milli}"
        )
        return Miss(6, f"has {phrase}", f"have {phrase}", detail)
    return Screened(view, prep, position, len(open_gpus), len(roomy), usable)


def _screen_prefer_ids(
    view: NodeView,
    prep: nodes.Prepared,
    ask: Ask,
    position: int,
    free: int,
    usable: list[models.Device],
    extra_taken: set[str],
) -> Screened | Miss:
    by_index = prep.by_index
    usable_idx = {d.index for d in usable}
    wanted = set(ask.prefer_ids)
    pinned = [d for d in usable if d.index in wanted]
    if len(pinned) >= ask.count:
        return Screened(view, prep, position, len(by_index), free, pinned)
    problems: dict[str, list[int]] = {
        "missing": [],
        MIG_MODE: [],
        SHARED: [],
        "unhealthy": [],
        "taken": [],
        "not matching": [],
    }
    for i in ask.prefer_ids:
        d = by_index.get(i)
        if d is None:
            problems["missing"].append(i)
        elif in_mig_mode(d):
            problems[MIG_MODE].append(i)
        elif d.shared:
            problems[SHARED].append(i)
        elif d.health != constants.HEALTHY:
            problems["unhealthy"].append(i)
        elif d.uuid in view.taken or d.uuid in extra_taken:
            problems["taken"].append(i)
        elif i not in usable_idx:
            problems["not matching"].append(i)
    what = "; ".join(f"{'/'.join(map(str, ids))} {kind}" for kind, ids in problems.items() if ids)
    ids = ",".join(map(str, ask.prefer_ids))
    phrase = f"cannot give preferIds {ids} ({what})"
    return Miss(7, phrase, phrase, f"preferIds {ids}: {what}; {len(pinned)} usable, need {ask.count}")
