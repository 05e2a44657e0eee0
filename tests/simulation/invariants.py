"""What must hold in the simulated cluster: after every step (1-3, 5, 6), and once settled (4).

1. No device (a GPU, a MIG instance, a slot of a shared GPU) is listed by two
   live claims' statuses, nor one piece of silicon: a GPU listed whole by one
   live claim and a MIG instance or a slot of it by another. A slot listed is
   one its GPU has (0..slots-1), so no more live claims than slots hold a GPU.
2. Every device a live Allocated claim lists has a Lease (Terminating counts)
   held by it (``holderIdentity`` is the claim's uid): ``gpu-<uuid>``, or
   ``gpu-<uuid>-s<slot>`` for a slot.
3. No claim in use is released: while a pod that was given a claim's devices is
   not terminal (Succeeded or Failed), the claim it is bound to exists, and
   Leases held by it exist for every device the claim lists and the pod uses.
   A pod is bound to the claim it was admitted for; a gated pod (which uses no
   device yet), when it is un-gated, to the claim whose devices it was given (the
   version of that name its un-gater read). The devices a pod
   uses are the ones in its containers' env (what the webhook wrote there from
   its view of the claim, which may be out of date), else its devices annotation.
   A claim whose finalizers a tenant stripped while it was being deleted is gone
   at once (the "strip-finalizer" action): its pods are then the ground truth of
   use, and Leases held by it must exist for every device such a pod uses.
4. Once settled, no Lease is held by a claim that no longer exists, and no
   quota ledger counts a claim that no longer exists; except, for a claim whose
   finalizers were stripped, while a live pod that names it is there (its Leases)
   or was given a device by it (its ledger entries).
5. No quota is exceeded: the GPUs listed by the Allocated claims of a
   namespace that hold GPUs (live, or being deleted but still holding a Lease)
   are within every GpuQuota of the namespace (total and per product
   pattern), and so is each quota's stored ledger. The GPUs that live pods of a
   stripped claim use count too, until those pods end.
6. A GPU a live pod was given is never listed by a live claim other than the one
   the pod is bound to, in whole or in part (a MIG instance, a slot, or the GPU
   of either), whatever happened to the pod's own claim.
7. No claim is preempted for a claim that its quota could not admit: when a claim
   is written Preempted, every stored quota ledger of its preemptor's namespace
   holds the preemptor for its whole ask already (``model.ApiServer.
   inadmissible_preemptions``); with invariant 5, its room is there. A
   preemptor that moved on (deleted, vanished, or no longer Pending) after it was
   admitted passes.
8. A claim pod is never bound to a node other than the one its GPUs are on:
   the un-gated pod's nodeSelector names its claim's node, and a claim that
   moves off a node its pods cannot be scheduled on evicts them first.
9. Once settled, no Allocated claim keeps its GPUs for a pod kube-scheduler has
   refused on its node for longer than the claim's grace period, when no pod of the
   claim is bound and no refused one is bare (``check_placed``).
10. Shares of a GPU never exceed 1000, and a GPU with a share is never also held
   whole: the milli-GPU shares (``sharing.milli``) that live claims list of one GPU
   add up to at most 1000, no live claim lists that GPU whole (or a MIG instance or
   slot of it) meanwhile, and every stored share ledger (the GPU's Lease) sums to at
   most 1000 too (``share_problem``). Invariants 2, 3 and 4 read a ledger's entry of
   a claim as a Lease held by it; 5 counts a share as its fraction of a GPU; 6 lets
   the sharers of a GPU's pods be.

A live claim is one that exists and is not being deleted. A claim being deleted
may release its devices (that is what deleting it asks for) unless a pod still
uses it, which is invariant 3's business.

A Lease an admin deleted outright (no finalizer kept it) is exempt from 2 and 3
until its holder creates it again: the controller is not to blame that it is gone.
That another claim then takes the GPU is not exempt (1, or 2's "held by").
"""

from __future__ import annotations

import datetime
import fnmatch
import re
from collections.abc import Iterator
from typing import Any

from gpualloc.api import constants, leases, timestamps
from tests.simulation import model

_SLOT = re.compile(r"GPU-[0-9a-f-]+-s[0-9]+")  # a slot's lock id (``constants.slot_id``)


class Violation(Exception):
    """An invariant does not hold; ``number`` says which (0: the controller code raised)."""

    def __init__(self, number: int, message: str) -> None:
        self.number = number
        self.message = message
        super().__init__(f"invariant {number}: {message}")


def listed_devices(claim: dict[str, Any]) -> Iterator[tuple[str, str, int]]:
    """(lock id, node, index) of every device a claim's status lists whole: its UUID, or for a slot
    of a shared GPU ``constants.slot_id(uuid, slot)``; not its milli-GPU shares (``listed_shares``)."""
    for alloc in (claim.get("status") or {}).get("allocations") or []:
        for device in alloc.get("devices") or []:
            if device.get("milli"):
                continue
            uuid, slot = str(device.get("uuid")), device.get("slot")
            lock = uuid if slot is None else constants.slot_id(uuid, int(slot))
            yield lock, str(alloc.get("nodeName")), int(device.get("index", -1))


def listed_shares(claim: dict[str, Any]) -> dict[str, int]:
    """GPU UUID -> the milli-GPU share of it a claim's status lists."""
    return {
        str(device.get("uuid")): int(device["milli"])
        for alloc in (claim.get("status") or {}).get("allocations") or []
        for device in alloc.get("devices") or []
        if device.get("milli")
    }


def holders(lease: dict[str, Any]) -> dict[str, int]:
    """Claim uid -> what it holds of a Lease's GPU in milli-GPU: its holder the whole of it, or
    each entry of a share ledger its share."""
    labels = model.meta(lease).get("labels") or {}
    if labels.get(leases.LABEL_SHARES) != leases.SHARES_MARK:
        return {_holder(lease): leases.WHOLE_MILLI}
    return {uid: int(entry.get("milli", 0)) for uid, entry in leases.ledger(lease).items()}


def holding_text(lease: dict[str, Any]) -> str:
    """How a trace names what a Lease holds: ``holder=<uid>``, or ``shares={uid: milli}``."""
    labels = model.meta(lease).get("labels") or {}
    if labels.get(leases.LABEL_SHARES) == leases.SHARES_MARK:
        return f"shares={holders(lease)}"
    return f"holder={_holder(lease)}"


def share_problem(server: model.ApiServer, label: dict[str, str]) -> str | None:
    """Invariant 10 on the stored claims and Leases: what is wrong, or None."""
    shares: dict[str, dict[str, int]] = {}  # GPU UUID -> live claim key -> milli
    whole: dict[str, str] = {}  # a GPU, MIG instance or slot's GPU UUID -> a live claim listing it whole
    parent = _parents(server)
    for key, claim in sorted(server.objects["claims"].items()):
        if model.meta(claim).get("deletionTimestamp"):
            continue
        for uuid, milli in listed_shares(claim).items():
            shares.setdefault(uuid, {})[key] = milli
        for lock, _, _ in listed_devices(claim):
            whole.setdefault(parent.get(lock, lock), key)
    for uuid, by_claim in sorted(shares.items()):
        total = sum(by_claim.values())
        if total > leases.WHOLE_MILLI:
            return (
                f"GPU {label.get(uuid, uuid)} is shared past the whole of it: {total} milli-GPU, {by_claim}"
            )
        if uuid in whole:
            gpu = label.get(uuid, uuid)
            return f"GPU {gpu} is listed whole (or in part) by {whole[uuid]} and shared by {by_claim}"
    for key, lease in sorted(server.objects["leases"].items()):
        total = sum(holders(lease).values())
        if total > leases.WHOLE_MILLI:
            return f"Lease {key}'s share ledger sums to {total} milli-GPU: {holders(lease)}"
    return None


def _parents(server: model.ApiServer) -> dict[str, str]:
    """MIG instance UUID or slot lock id -> its GPU's UUID, from the published GpuNodeStatuses."""
    parent = {}
    for status in server.objects["node_statuses"].values():
        for device in (status.get("status") or {}).get("devices") or []:
            for instance in (device.get("mig") or {}).get("devices") or []:
                parent[str(instance["uuid"])] = str(device["uuid"])
            for k in range(int((device.get("sharing") or {}).get("replicas", 0))):
                parent[constants.slot_id(str(device["uuid"]), k)] = str(device["uuid"])
    return parent


def _holder(lease: dict[str, Any]) -> str:
    return str((lease.get("spec") or {}).get("holderIdentity") or "")


def _lease_problem(server: model.ApiServer, uuid: str, uid: str) -> str | None:
    name = constants.lease_name(uuid)
    lease = server.lease(name)
    if lease is None:
        if (name, uid) in server.admin_vanished:
            return None
        return "has no Lease"
    if uid not in holders(lease):
        return f"has its Lease held by {holding_text(lease)!r}"
    return None


def _quota_problem(server: model.ApiServer) -> str | None:
    holding = {uid for lease in server.objects["leases"].values() for uid in holders(lease)}
    for key, quota in sorted(server.objects["quotas"].items()):
        namespace = str(model.meta(quota).get("namespace"))
        spec = quota.get("spec") or {}
        limits = [("", int(spec["gpus"]))] + [
            (p["pattern"], int(p["gpus"])) for p in spec.get("products") or []
        ]
        ledger = ((quota.get("status") or {}).get("claims") or {}).values()
        for pattern, hard in limits:
            in_use = 0  # milli-GPU: a share counts as its fraction
            for claim in server.objects["claims"].values():
                m = model.meta(claim)
                holds = not m.get("deletionTimestamp") or str(m.get("uid")) in holding
                if m.get("namespace") != namespace or not holds:
                    continue
                if (claim.get("status") or {}).get("phase") != constants.PHASE_ALLOCATED:
                    continue
                in_use += leases.WHOLE_MILLI * sum(
                    1 for uuid, _, _ in listed_devices(claim) if _product_matches(uuid, pattern)
                )
                in_use += sum(
                    m for uuid, m in listed_shares(claim).items() if _product_matches(uuid, pattern)
                )
            for devices in _stripped_in_use(server, namespace).values():
                in_use += sum(milli for uuid, milli in devices.items() if _product_matches(uuid, pattern))
            stored = sum(  # milli-GPU: an entry's exact milli, else its whole GPUs
                int(e["milli"]) if e.get("milli") is not None else int(e.get("gpus", 0)) * leases.WHOLE_MILLI
                for e in ledger
                if not pattern
                or any(fnmatch.fnmatchcase(p, pattern) for p in str(e.get("product", "")).split(","))
            )
            what = f"{pattern} GPUs" if pattern else "GPUs"
            if in_use > hard * leases.WHOLE_MILLI:
                held = in_use / leases.WHOLE_MILLI
                return f"{namespace}'s Allocated claims hold {held:g} {what}, quota {key} allows {hard}"
            if stored > hard * leases.WHOLE_MILLI:
                counted = stored / leases.WHOLE_MILLI
                return f"quota {key}'s ledger counts {counted:g} {what}, above its {hard}"
    return None


def _live_given(pod: dict[str, Any]) -> bool:
    """A pod that is not terminal and not gated: it runs (or may) on the devices it was given."""
    return (pod.get("status") or {}).get("phase") not in model.TERMINAL_PHASES and not model.is_gated(pod)


def _names_of_live_pods(server: model.ApiServer) -> set[str]:
    """``namespace/claim`` of every claim name a live pod (gated or not) carries."""
    names = set()
    for pod in server.objects["pods"].values():
        if (pod.get("status") or {}).get("phase") in model.TERMINAL_PHASES:
            continue
        m = model.meta(pod)
        names.add(f"{m.get('namespace')}/{(m.get('annotations') or {}).get(constants.ANNOTATION_CLAIM)}")
    return names


def _last_version(server: model.ApiServer, key: str, uid: str) -> dict[str, Any]:
    """The last stored version of claim ``key`` with ``uid``."""
    return next(c for c in reversed(server.claim_history[key]) if model.meta(c).get("uid") == uid)


def _stripped_in_use(server: model.ApiServer, namespace: str) -> dict[str, dict[str, int]]:
    """Stripped claims of ``namespace`` with live pods: uid -> the GPUs those pods use, each with
    the milli-GPU the claim held of it (its share, as its last version lists it, else the whole)."""
    used: dict[str, dict[str, int]] = {}
    for key, pod in server.objects["pods"].items():
        uid = server.pod_claim_uid.get(key, "")
        m = model.meta(pod)
        if uid in server.stripped and m.get("namespace") == namespace and _live_given(pod):
            claim_name = (m.get("annotations") or {}).get(constants.ANNOTATION_CLAIM)
            shares = listed_shares(_last_version(server, f"{namespace}/{claim_name}", uid))
            used.setdefault(uid, {}).update(
                (u, shares.get(u, leases.WHOLE_MILLI)) for u in _devices_used(pod).split(",") if u
            )
    return used


def _product_matches(uuid: str, pattern: str) -> bool:
    """Every simulated GPU is a ``model.PRODUCT``."""
    return not pattern or fnmatch.fnmatchcase(model.PRODUCT, pattern)


def _devices_used(pod: dict[str, Any]) -> str:
    """The devices a pod's containers get: the value the webhook wrote into their env, else (a pod
    admitted for a Pending claim reads it through the downward API) the devices annotation."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for entry in container.get("env") or []:
            if entry.get("name") == "CUDA_VISIBLE_DEVICES" and "value" in entry:
                return str(entry["value"])
    annotations = model.meta(pod).get("annotations") or {}
    return str(annotations.get(constants.ANNOTATION_DEVICES) or "")


def check_step(server: model.ApiServer, label: dict[str, str]) -> None:
    """Invariants 1-3, 5-8 and 10; raises ``Violation``. ``label`` names devices (uuid -> ``node/index``)."""
    problem = share_problem(server, label)
    if problem is not None:
        raise Violation(10, problem)
    owners: dict[str, str] = {}
    live_uids: dict[str, str] = {}  # live claim key -> its uid
    parent = _parents(server)
    children: dict[str, set[str]] = {}  # a GPU's UUID -> its MIG instances' UUIDs and slots' lock ids
    for part, gpu in parent.items():
        children.setdefault(gpu, set()).add(part)
    silicon: dict[str, set[str]] = {}  # a GPU's UUID -> the live claims listing it or a part of it
    sharers: dict[str, set[str]] = {}  # a GPU's UUID -> the live claims listing a share of it
    for key, claim in sorted(server.objects["claims"].items()):
        if model.meta(claim).get("deletionTimestamp"):
            continue
        uid = str(model.meta(claim).get("uid"))
        live_uids[key] = uid
        for uuid in listed_shares(claim):
            sharers.setdefault(uuid, set()).add(key)
        for uuid, _, _ in listed_devices(claim):
            other = owners.get(uuid)
            if other is not None and other != key:
                raise Violation(
                    1, f"device {label.get(uuid, uuid)} is listed by both {other} and {key} ({uid})"
                )
            owners[uuid] = key
            silicon.setdefault(parent.get(uuid, uuid), set()).add(key)
        if (claim.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED:
            for uuid in [lock for lock, _, _ in listed_devices(claim)] + list(listed_shares(claim)):
                problem = _lease_problem(server, uuid, uid)
                if problem is not None:
                    raise Violation(
                        2,
                        f"Allocated claim {key} ({uid}) lists device {label.get(uuid, uuid)}, "
                        f"which {problem}",
                    )
    for gpu, keys in sorted(silicon.items()):
        if gpu in owners and len(keys) > 1:
            raise Violation(
                1,
                f"GPU {label.get(gpu, gpu)} is listed whole by {owners[gpu]} while "
                f"{', '.join(sorted(keys - {owners[gpu]}))} list MIG instances or slots of it",
            )
    for lock, key in sorted(owners.items()):
        if _SLOT.fullmatch(lock) and lock not in parent:
            # A shared GPU's slots are 0..replicas-1: so no more claims than slots hold it.
            raise Violation(1, f"{key} lists {lock}, a slot that no GPU has")
    for pod_key, pod in sorted(server.objects["pods"].items()):
        phase = (pod.get("status") or {}).get("phase")
        m = model.meta(pod)
        annotations = m.get("annotations") or {}
        claim_name = annotations.get(constants.ANNOTATION_CLAIM)
        if phase in model.TERMINAL_PHASES or model.is_gated(pod) or not claim_name:
            continue  # a pod of no claim takes only CPU
        node_name = str((pod.get("spec") or {}).get("nodeName") or "")
        given = str(annotations.get(constants.ANNOTATION_DEVICES) or "")
        elsewhere = sorted(
            label.get(u, u)
            for u in given.split(",")
            if u and node_name and label.get(u, node_name).split("/")[0] != node_name
        )
        if elsewhere:
            raise Violation(
                8, f"pod {pod_key} is bound to {node_name}, but the GPUs it was given are {elsewhere}"
            )
        admitted_for = server.pod_claim_uid.get(pod_key, "")
        claim = server.claim(str(m.get("namespace")), str(claim_name))
        claim_key = f"{m.get('namespace')}/{claim_name}"
        used = [u for u in _devices_used(pod).split(",") if u]
        bound = claim if claim is not None and model.meta(claim).get("uid") == admitted_for else None
        if bound is None and admitted_for in server.stripped:
            bound = _last_version(server, claim_key, admitted_for)
        # A shared GPU's pod names the GPU; its claim lists the slot it holds.
        slot_of = {parent[lock]: lock for lock, _, _ in listed_devices(bound or {}) if _SLOT.fullmatch(lock)}
        shared_by_it = listed_shares(bound or {})
        for uuid in used:
            others = sorted(k for k in sharers.get(uuid, ()) if live_uids[k] != admitted_for)
            if others and uuid not in shared_by_it:
                raise Violation(
                    6,
                    f"pod {pod_key} ({phase}) of claim {claim_key} ({admitted_for}) was given "
                    f"{label.get(uuid, uuid)} whole, and {', '.join(others)} list a share of it",
                )
            lock = slot_of.get(uuid, uuid)
            parts = {lock, parent[lock]} if lock in parent else {lock} | children.get(lock, set())
            for part in sorted(parts):
                other = owners.get(part)
                if other is not None and live_uids[other] != admitted_for:
                    raise Violation(
                        6,
                        f"pod {pod_key} ({phase}) of claim {claim_key} ({admitted_for}) was given "
                        f"{label.get(lock, lock)}, and {other} ({live_uids[other]}) lists "
                        f"{label.get(part, part)}",
                    )
        if claim is None or model.meta(claim).get("uid") != admitted_for:
            if admitted_for not in server.stripped:
                raise Violation(
                    3, f"claim {claim_key} ({admitted_for}) is gone while its pod {pod_key} is {phase}"
                )
            last = _last_version(server, claim_key, admitted_for)
            lock_of = {parent[lock]: lock for lock, _, _ in listed_devices(last) if lock in parent}
            for uuid in [lock_of.get(u, u) for u in used]:
                problem = _lease_problem(server, uuid, admitted_for)
                if problem is not None:
                    raise Violation(
                        3,
                        f"claim {claim_key} ({admitted_for}) was stripped of its finalizers, its pod "
                        f"{pod_key} ({phase}) uses device {label.get(uuid, uuid)}, which {problem}",
                    )
            continue
        listed = [lock for lock, _, _ in listed_devices(claim)] + list(listed_shares(claim))
        lock_of = {parent[lock]: lock for lock in listed if _SLOT.fullmatch(lock) and lock in parent}
        for uuid in listed + [lock_of.get(u, u) for u in used]:
            problem = _lease_problem(server, uuid, admitted_for)
            if problem is not None:
                raise Violation(
                    3,
                    f"claim {claim_key} ({admitted_for}) is in use by pod {pod_key} ({phase}), "
                    f"but device {label.get(uuid, uuid)} {problem}",
                )
    problem = _quota_problem(server)
    if problem is not None:
        raise Violation(5, problem)

    if server.inadmissible_preemptions:
        raise Violation(7, server.inadmissible_preemptions[0])


def check_settled(server: model.ApiServer) -> None:
    """Invariant 4 (Leases and ledgers); raises ``Violation``."""
    uids = {str(model.meta(c).get("uid")) for c in server.objects["claims"].values()}
    named = _names_of_live_pods(server)
    bound = {server.pod_claim_uid.get(k, "") for k, pod in server.objects["pods"].items() if _live_given(pod)}
    for key, lease in sorted(server.objects["leases"].items()):
        labels = model.meta(lease).get("labels") or {}
        entries = leases.ledger(lease)
        for holder in holders(lease):
            names = entries.get(holder) or {
                "namespace": labels.get(constants.LABEL_CLAIM_NAMESPACE),
                "name": labels.get(constants.LABEL_CLAIM_NAME),
            }
            claim_key = f"{names.get('namespace')}/{names.get('name')}"
            if holder in server.stripped and claim_key in named:
                continue  # its pods still use it (or may: one waits at the gate)
            if holder not in uids:
                state = " (Terminating)" if model.meta(lease).get("deletionTimestamp") else ""
                raise Violation(
                    4, f"settled, yet Lease {key}{state} is held by {holder!r}, a claim that is gone"
                )
        if not holders(lease):
            raise Violation(4, f"settled, yet Lease {key} is an empty share ledger")
    for key, quota in sorted(server.objects["quotas"].items()):
        held = {uid for lease in server.objects["leases"].values() for uid in holders(lease)}
        for uid in (quota.get("status") or {}).get("claims") or {}:
            if uid in server.stripped and (uid in held or uid in bound):
                continue  # the quota counts the GPUs its pods still use
            if uid not in uids:
                raise Violation(4, f"settled, yet quota {key}'s ledger counts {uid}, a claim that is gone")


def _refused_since(pod: dict[str, Any]) -> datetime.datetime | None:
    """When kube-scheduler found the pod Unschedulable (None: it has not)."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    found = next((c for c in conditions if c.get("reason") == "Unschedulable"), None)
    return timestamps.parse_time(str(found.get("lastTransitionTime") or "")) if found else None


def check_placed(server: model.ApiServer, *, now: datetime.datetime) -> None:
    """Invariant 9, once settled (issue 41's liveness): no Allocated claim keeps its GPUs on a node
    for a pod kube-scheduler has refused there for longer than the claim's grace period, while no
    pod of the claim is bound and none of the refused ones is bare (a bare pod keeps its claim)."""
    for key, claim in sorted(server.objects["claims"].items()):
        phase = (claim.get("status") or {}).get("phase")
        if phase != constants.PHASE_ALLOCATED or model.meta(claim).get("deletionTimestamp"):
            continue
        grace = int((claim.get("spec") or {}).get("unschedulableGracePeriodSeconds", 60))
        namespace, name = key.split("/", 1)
        pods = [
            p
            for p in server.objects["pods"].values()
            if model.meta(p).get("namespace") == namespace
            and (model.meta(p).get("annotations") or {}).get(constants.ANNOTATION_CLAIM) == name
            and (p.get("status") or {}).get("phase") not in model.TERMINAL_PHASES
        ]
        if any((p.get("spec") or {}).get("nodeName") for p in pods):
            continue  # a pod of it runs: it stays
        refused = [(p, since) for p in pods if (since := _refused_since(p)) is not None]
        if any(not model.meta(p).get("ownerReferences") for p, _ in refused):
            continue  # a bare pod cannot change its node: the claim stays, and says so
        for pod, since in refused:
            if (now - since).total_seconds() > grace:
                raise Violation(
                    9,
                    f"settled, yet {key} keeps its GPUs for pod {model.meta(pod).get('name')}, Unschedulable "
                    f"for {(now - since).total_seconds():.0f} s (grace {grace} s)",
                )
