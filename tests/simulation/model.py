"""An in-memory API server with exactly the semantics the controller relies on.

One ``ApiServer`` per simulated cluster holds GpuClaims, GpuNodeStatuses,
Nodes, device Leases and Pods. Its methods are synchronous and atomic: the
scheduler decides *when* a call is applied (``scheduler.SimCluster`` wraps
them as the controller's ``Cluster``); the server decides *what* it does:

* one global ``resourceVersion`` counter, bumped by every write that changes
  an object (a write that changes nothing bumps nothing, as the real server);
  ``metadata.generation`` bumps on spec changes only;
* GpuClaims: JSON merge patches (RFC 7386) on the status subresource or on
  metadata, each with a resourceVersion precondition (``errors.Conflict``);
  deleting a claim with finalizers only sets ``deletionTimestamp``; it is
  removed when a patch empties them; no finalizer may be added then;
* Leases: ``create`` is the lock (``errors.AlreadyExists`` while the name
  exists, Terminating included), ``delete`` takes a uid precondition (and a
  resourceVersion one when given, as a share ledger's last entry's release does)
  (``errors.Conflict`` on another uid, ``errors.NotFound`` when none) and only
  marks a Lease with finalizers Terminating; ``replace_lease`` (PUT, a
  resourceVersion precondition) and ``patch_lease_finalizers`` (the JSON
  Patch the controller used before, a uid ``test``) empty them. Emptying the
  finalizers of a Terminating Lease removes it **in a second step**, as the
  real server does (``genericregistry.Store.Update`` then
  ``deleteWithoutFinalizers``): the method returns ``Then(step)``, which the
  scheduler applies later, other calls in between. That removal is
  conditional on the uid of a PUT's body, and on nothing for a PATCH;
* Pods: JSON Patch, a failed ``test`` answered 422 (``errors.Invalid``);
* GpuQuotas: JSON merge patches on the status subresource with a
  resourceVersion precondition, as claims.

Every write fans an event (a deep copy) out to every subscribed watch whose
filter the object passes, one FIFO queue per watch and kind: the scheduler
delivers them late but in order per kind. A label-selector watch sees an
object that stops matching as DELETED, one that starts matching as ADDED.

``SimFeed`` is a controller cache with the interface of ``watching.Reflector``
that the controller uses (``cache``, ``synced``, ``on_event``, ``get``), fed by
``apply`` (one watch event) and ``relist`` (a fresh list, differences as events).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jsonpatch
import jsonpointer
import msgspec

from controller import state
from gpualloc.api import constants, leases, timestamps
from gpualloc.kube import errors, watching

Obj = dict[str, Any]

KINDS = ("claims", "node_statuses", "nodes", "leases", "pods", "quotas")
# The controller's watches: one per kind, and a second one on the pods (every live pod, as the
# controller's field selector ``state.LIVE_PODS`` gives them). The scheduler delivers the second
# one's events only along with another delivery to the same process (``Simulation._do_deliver``),
# so the choices drawn from a seed are the ones they were before it existed.
WATCHED = (*KINDS, "live_pods")
STORED_AS = {"live_pods": "pods"}  # a watch -> the kind of object it lists
NAMESPACE = "gpualloc-system"  # where the device Leases live
PRODUCT = "NVIDIA H100 80GB HBM3"
TERMINAL_PHASES = ("Succeeded", "Failed")
API_VERSIONS = {
    "claims": (constants.API_VERSION, constants.CLAIM_KIND),
    "node_statuses": (constants.API_VERSION, constants.NODE_STATUS_KIND),
    "nodes": ("v1", "Node"),
    "leases": ("coordination.k8s.io/v1", "Lease"),
    "pods": ("v1", "Pod"),
    "quotas": (constants.API_VERSION, constants.QUOTA_KIND),
}


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


def clone(value: Any) -> Any:
    """A deep copy of JSON-shaped data (dicts, lists, scalars), as it goes over the wire.

    A msgpack round trip: about twice as fast as a recursive copy in Python."""
    return _decode(_encode(value))


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: ``patch`` applied to ``target``; ``None`` deletes a key. Never mutates either."""
    if not isinstance(patch, dict):
        return clone(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def meta(obj: Mapping[str, Any]) -> Obj:
    m = obj.get("metadata")
    return m if isinstance(m, dict) else {}


def gpu_uuid(node: str, index: int) -> str:
    digest = hashlib.sha256(f"{node}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def mig_uuid(node: str, index: int, instance: int) -> str:
    digest = hashlib.sha256(f"{node}/{index}/mig/{instance}".encode()).hexdigest()
    return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


# Each GPU in MIG mode is split the same way: a 1g.5gb at slice 0 and a 3g.20gb at slice 4.
MIG_SPLIT = (("1g.5gb", 0, 1, 4864), ("3g.20gb", 4, 4, 19968))


def _stamp(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def inventory(
    node: str,
    gpus: int,
    *,
    now: datetime.datetime,
    ready: bool = True,
    unhealthy: Sequence[int] = (),
    mig: Sequence[int] = (),
    shared: Mapping[int, int] | None = None,
) -> Obj:
    """The ``status`` of a GpuNodeStatus as the agent writes it, kept small: every controller parses
    it on start and on each change, and the locking races do not depend on the topology (one
    NVLink island, no per-pair links). The GPUs ``mig`` are in MIG mode, split as ``MIG_SPLIT``;
    the GPUs ``shared`` (index -> slots) are offered to Shared claims by time-slicing."""
    bad = set(unhealthy)
    devices: list[Obj] = [
        {
            "index": i,
            "minor": i,
            "uuid": gpu_uuid(node, i),
            "product": PRODUCT,
            "memoryMiB": 81559,
            "health": constants.UNHEALTHY if i in bad else constants.HEALTHY,
        }
        for i in range(gpus)
    ]
    for i, slots in (shared or {}).items():
        devices[i]["sharing"] = {"strategy": "TimeSlicing", "replicas": slots}
    for i in mig:
        devices[i]["mig"] = {
            "enabled": True,
            "devices": [
                {
                    "index": j,
                    "uuid": mig_uuid(node, i, j),
                    "profile": profile,
                    "memoryMiB": mib,
                    "placementStart": start,
                    "memorySlices": size,
                    "computeSlices": int(profile[0]),
                }
                for j, (profile, start, size, mib) in enumerate(MIG_SPLIT)
            ],
        }
    stamp = _stamp(now)
    return {
        "source": "simulated",
        "product": PRODUCT,
        "devices": devices,
        "islands": [list(range(gpus))],
        "total": gpus,
        "healthy": gpus - len(bad),
        "lastHeartbeatTime": stamp,
        "conditions": [
            {
                "type": constants.CONDITION_READY,
                "status": "True" if ready else "False",
                "reason": "Publishing" if ready else "NotReady",
                "lastTransitionTime": stamp,
            }
        ],
    }


@dataclasses.dataclass(frozen=True, slots=True)
class Then:
    """A call half done: the server applies ``step`` in a later scheduler step; its result or
    exception is the call's answer."""

    step: Callable[[], Any]


def _not_found(kind: str, name: str) -> errors.NotFound:
    return errors.NotFound(404, "NotFound", f'{kind} "{name}" not found')


def _conflict(kind: str, name: str, why: str) -> errors.Conflict:
    return errors.Conflict(409, "Conflict", f'Operation cannot be fulfilled on {kind} "{name}": {why}')


@dataclasses.dataclass(slots=True)
class Watch:
    """One controller process's watches: a FIFO of (type, object) per kind, since its last list."""

    name: str
    queues: dict[str, collections.deque[tuple[str, Obj]]] = dataclasses.field(
        default_factory=lambda: {kind: collections.deque() for kind in WATCHED}
    )


class ApiServer:
    """The simulated API server: atomic, synchronous operations on plain dicts.

    Stored objects are never mutated in place (a write stores a new dict), and
    what leaves the server is a copy, so nothing a client does to an answer or
    an event can change the store.
    """

    def __init__(self, *, namespace: str = NAMESPACE, clock: Callable[[], datetime.datetime]) -> None:
        self.namespace = namespace
        self.clock = clock
        self.rv = 0
        self.objects: dict[str, dict[str, Obj]] = {kind: {} for kind in KINDS}
        self.watches: dict[str, Watch] = {}
        self._uids = 0
        # (lease name, holder) of Leases an admin deleted outright (no finalizer held them), until
        # that holder creates the name again: the controller is not to blame that they are gone
        # (invariants 2 and 3 skip them).
        self.admin_vanished: set[tuple[str, str]] = set()
        # The claim uid each pod is bound to: the one the webhook admitted it for, or for a gated
        # pod the claim of its name when it was un-gated ("" when there was none).
        self.pod_claim_uid: dict[str, str] = {}
        # Uids of claims whose finalizers a tenant stripped while they were being deleted (the
        # "strip-finalizer" action): they vanish at once, and their pods are the ground truth of use.
        self.stripped: set[str] = set()
        # Invariant 7: each claim written Preempted for a preemptor that a stored quota ledger of
        # its namespace did not hold then.
        self.inadmissible_preemptions: list[str] = []
        # The most GPUs each quota's stored ledger has ever held each claim uid for: (quota key,
        # uid) -> GPUs (invariant 7 for a preemptor that vanished after it was admitted).
        self.ever_admitted: dict[tuple[str, str], int] = {}
        self.events_emitted = 0
        # Every version of each claim key ever stored, oldest first: what a webhook whose watch is
        # behind may still see (the scheduler's "stale-pod" action admits pods from them).
        self.claim_history: dict[str, list[Obj]] = {}
        self.mig_gpus: dict[str, tuple[int, ...]] = {}  # node -> its GPUs in MIG mode (fixed)
        self.shared_gpus: dict[str, dict[int, int]] = {}  # node -> its shared GPUs' slots (fixed)

    # ------------------------------------------------------------------ store and watches

    def _uid(self, prefix: str) -> str:
        self._uids += 1
        return f"{prefix}-{self._uids}"

    @staticmethod
    def key_of(obj: Mapping[str, Any]) -> str:
        return watching.object_key(obj)

    def visible(self, kind: str, obj: Mapping[str, Any]) -> bool:
        """Does ``obj`` pass the controller's watch filter for ``kind``?"""
        m = meta(obj)
        labels = m.get("labels") or {}
        if kind == "leases":
            return (
                m.get("namespace") == self.namespace
                and labels.get(constants.LABEL_MANAGED_BY) == constants.MANAGED_BY
            )
        if kind == "pods":
            return labels.get(constants.LABEL_GATED) == "true"
        if kind == "live_pods":
            return (obj.get("status") or {}).get("phase") not in TERMINAL_PHASES
        return True

    def subscribe(self, name: str) -> Watch:
        """A fresh set of watches for controller process ``name`` (replacing any older one)."""
        watch = Watch(name)
        self.watches[name] = watch
        return watch

    def unsubscribe(self, name: str) -> None:
        self.watches.pop(name, None)

    def list(self, kind: str) -> dict[str, Obj]:
        """What a LIST with the controller's filter returns now, by ``object_key`` (copies)."""
        stored = self.objects[STORED_AS.get(kind, kind)]
        return {key: clone(obj) for key, obj in stored.items() if self.visible(kind, obj)}

    def relist(self, name: str, kind: str) -> dict[str, Obj]:
        """A LIST for controller ``name``'s watch of ``kind``: its queue restarts from now."""
        self.watches[name].queues[kind].clear()
        return self.list(kind)

    def _write(self, kind: str, key: str, new: Obj | None) -> Obj | None:
        """Store ``new`` at ``key`` (None removes it); bump the resourceVersion and fan events out.

        Returns the stored object (or the removed one with its final resourceVersion). A
        write that changes nothing is no write: no new resourceVersion, no event.
        """
        store = self.objects[kind]
        old = store.get(key)
        if new is not None and old is not None and new == old:
            return old
        self.rv += 1
        if new is None:
            if old is None:
                return None
            del store[key]
            final = dict(old)
            final["metadata"] = {**meta(old), "resourceVersion": str(self.rv)}
            self._fan_out(kind, old, None, final)
            return final
        new = dict(new)
        new["metadata"] = {**meta(new), "resourceVersion": str(self.rv)}
        store[key] = new
        if kind == "claims":
            self.claim_history.setdefault(key, []).append(new)
        self._fan_out(kind, old, new, new)
        return new

    def _fan_out(self, kind: str, old: Obj | None, new: Obj | None, shown: Obj) -> None:
        for watched in [kind, *(w for w, stored in STORED_AS.items() if stored == kind)]:
            was = old is not None and self.visible(watched, old)
            now = new is not None and self.visible(watched, new)
            if now:
                type_ = watching.MODIFIED if was else watching.ADDED
            elif was:
                type_ = watching.DELETED
            else:
                continue
            for watch in self.watches.values():
                watch.queues[watched].append((type_, clone(shown)))

    def pending_events(self) -> int:
        return sum(len(q) for w in self.watches.values() for q in w.queues.values())

    def _created(self, kind: str, body: Mapping[str, Any], prefix: str) -> Obj:
        api_version, kind_name = API_VERSIONS[kind]
        obj = clone(dict(body))
        obj["apiVersion"] = api_version
        obj["kind"] = kind_name
        m = obj.setdefault("metadata", {})
        m["uid"] = self._uid(prefix)
        m["creationTimestamp"] = _stamp(self.clock())
        if kind in ("claims", "node_statuses"):
            m["generation"] = 1
        m.pop("deletionTimestamp", None)
        return obj

    # ------------------------------------------------------------------ GpuClaims

    def claim(self, namespace: str, name: str) -> Obj | None:
        return self.objects["claims"].get(f"{namespace}/{name}")

    def create_claim(self, namespace: str, name: str, spec: Mapping[str, Any]) -> Obj:
        key = f"{namespace}/{name}"
        if key in self.objects["claims"]:
            raise errors.AlreadyExists(409, "AlreadyExists", f'gpuclaims "{name}" already exists')
        body = {"metadata": {"name": name, "namespace": namespace}, "spec": clone(dict(spec))}
        obj = self._created("claims", body, "claim")
        return clone(self._write("claims", key, obj))

    def _at_version(self, kind: str, plural: str, key: str, resource_version: str) -> Obj:
        """The stored object at ``key``, if it has ``resource_version`` (any, when "")."""
        old = self.objects[kind].get(key)
        name = key.rsplit("/", 1)[-1]
        if old is None:
            raise _not_found(plural, name)
        if resource_version and meta(old).get("resourceVersion") != resource_version:
            raise _conflict(
                f"{plural}.gpu.scheduling",
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        return old

    def create_quota(self, namespace: str, name: str, spec: Mapping[str, Any]) -> Obj:
        body = {"metadata": {"name": name, "namespace": namespace}, "spec": clone(dict(spec))}
        obj = self._created("quotas", body, "quota")
        return clone(self._write("quotas", f"{namespace}/{name}", obj))

    def patch_quota_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        key = f"{namespace}/{name}"
        old = self._at_version("quotas", "gpuquotas", key, resource_version)
        new = dict(old)
        new["status"] = merge_patch(old.get("status"), patch.get("status"))
        for uid, entry in ((new["status"] or {}).get("claims") or {}).items():
            gpus = int((entry or {}).get("gpus", 0))
            self.ever_admitted[(key, uid)] = max(gpus, self.ever_admitted.get((key, uid), 0))
        return clone(self._write("quotas", key, new))

    def delete_claim(self, namespace: str, name: str) -> None:
        """A user's delete: Terminating while finalizers remain, else removed."""
        key = f"{namespace}/{name}"
        old = self.objects["claims"].get(key)
        if old is None:
            raise _not_found("gpuclaims", name)
        if meta(old).get("finalizers"):
            if not meta(old).get("deletionTimestamp"):
                new = dict(old)
                new["metadata"] = {**meta(old), "deletionTimestamp": _stamp(self.clock())}
                self._write("claims", key, new)
            return
        self._write("claims", key, None)

    def strip_finalizers(self, namespace: str, name: str) -> bool:
        """A tenant empties the finalizers of its claim being deleted (a merge patch that no admission
        policy refuses here): the claim vanishes at once. True when it did."""
        key = f"{namespace}/{name}"
        old = self.objects["claims"].get(key)
        if old is None or not meta(old).get("deletionTimestamp"):
            return False
        self.stripped.add(str(meta(old).get("uid")))
        self._write("claims", key, None)
        return True

    def get_claim(self, namespace: str, name: str) -> Obj:
        obj = self.claim(namespace, name)
        if obj is None:
            raise _not_found("gpuclaims", name)
        return clone(obj)

    def _patch_claim(
        self, namespace: str, name: str, resource_version: str, change: Callable[[Obj], Obj]
    ) -> Obj:
        key = f"{namespace}/{name}"
        old = self._at_version("claims", "gpuclaims", key, resource_version)
        new = change(old)
        m = meta(new)
        if m.get("deletionTimestamp") and not m.get("finalizers"):
            return clone(self._write("claims", key, None))
        return clone(self._write("claims", key, new))

    def patch_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        """The status subresource: only ``status`` changes; anything else in the patch is ignored."""

        def change(old: Obj) -> Obj:
            new = dict(old)
            if "status" in patch:
                status = merge_patch(old.get("status"), patch["status"])
                if status is None or status == {}:
                    new.pop("status", None)
                else:
                    new["status"] = status
            return new

        written = self._patch_claim(namespace, name, resource_version, change)
        if (written.get("status") or {}).get("phase") == constants.PHASE_PREEMPTED and (
            (patch.get("status") or {}).get("phase") == constants.PHASE_PREEMPTED
        ):
            why = self._inadmissible(written)
            if why:
                self.inadmissible_preemptions.append(f"{namespace}/{name} was preempted for {why}")
        return written

    def _inadmissible(self, victim: Mapping[str, Any]) -> str:
        """Why the preemptor of ``victim`` (just written Preempted) is not admitted yet: a quota of
        its namespace whose stored ledger does not hold it for its whole ask; "" when every one does
        (or it is gone). A ledger grows only by writes conditional on its version and within its
        limits, with the victims still counted: so the preemptor's room is the API server's word.

        ``preemptedBy`` names a key, not a uid: a preemptor that vanished after it was admitted (its
        finalizer stripped; its entry then leaves the ledger) may have left its key to a new claim.
        One of the key's earlier claims, gone now, that every ledger once held for its whole ask,
        passes too, and so does such a preemptor that moved on (being deleted, or no longer
        Pending: allocated by another controller, and released since): it may move between the
        controller's last look and a victim's write, which is conditional on the victim's version
        alone (seeds 9358316 and 11326617 found it). A preemptor never admitted does not pass."""
        by = str((victim.get("status") or {}).get("preemptedBy") or "")
        namespace, _, name = by.partition("/")
        preemptor = self.claim(namespace, name)
        if preemptor is None:
            return ""
        phase = (preemptor.get("status") or {}).get("phase")
        moved_on = bool(meta(preemptor).get("deletionTimestamp")) or phase not in (
            None,
            constants.PHASE_PENDING,
        )
        if moved_on and not self._not_admitted(preemptor, namespace, now=False):
            return ""  # admitted, then deleted, or allocated and released, while victims were marked
        why = self._not_admitted(preemptor, namespace, now=True)
        if why:
            live = str(meta(preemptor).get("uid"))
            earlier = {str(meta(v).get("uid")): v for v in self.claim_history.get(by, [])}
            if any(u != live and not self._not_admitted(v, namespace, now=False) for u, v in earlier.items()):
                return ""
        return f"{by}, {why}" if why else ""

    def _not_admitted(self, claim: Mapping[str, Any], namespace: str, *, now: bool) -> str:
        """Which quota of ``namespace`` does not hold ``claim`` for its whole ask ("" when all do):
        in its stored ledger ``now``, else at any time so far (``ever_admitted``)."""
        spec = claim.get("spec") or {}
        ask = int((spec.get("devices") or {}).get("count", 1)) * max(1, int(spec.get("replicas", 1)))
        uid = str(meta(claim).get("uid"))
        for key, quota in self.objects["quotas"].items():
            if meta(quota).get("namespace") != namespace:
                continue
            entry = ((quota.get("status") or {}).get("claims") or {}).get(uid) or {}
            held = int(entry.get("gpus", 0)) if now else self.ever_admitted.get((key, uid), 0)
            if held < ask:
                return f"which quota {meta(quota).get('name')} holds for {held} of its {ask} GPUs"
        return ""

    def patch_claim_metadata(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        """The main resource, metadata only: finalizers, labels, annotations."""

        def change(old: Obj) -> Obj:
            wanted = {k: v for k, v in (patch.get("metadata") or {}).items() if k in _WRITABLE_META}
            m = merge_patch(meta(old), wanted)
            if meta(old).get("deletionTimestamp"):
                added = set(m.get("finalizers") or []) - set(meta(old).get("finalizers") or [])
                if added:
                    raise errors.Invalid(
                        422,
                        "Invalid",
                        f"metadata.finalizers: Forbidden: no new finalizers can be added if the object "
                        f"is being deleted, found new finalizers {sorted(added)}",
                    )
            if m.get("finalizers") == []:
                m.pop("finalizers")
            new = dict(old)
            new["metadata"] = m
            return new

        return self._patch_claim(namespace, name, resource_version, change)

    # ------------------------------------------------------------------ Leases

    def lease(self, name: str) -> Obj | None:
        return self.objects["leases"].get(f"{self.namespace}/{name}")

    def create_lease(self, body: Mapping[str, Any]) -> Obj:
        m = meta(body)
        name = str(m.get("name", ""))
        namespace = m.get("namespace") or self.namespace
        if namespace != self.namespace:
            raise errors.BadRequest(400, "BadRequest", f"lease namespace {namespace} is not {self.namespace}")
        key = f"{namespace}/{name}"
        if key in self.objects["leases"]:
            raise errors.AlreadyExists(
                409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists'
            )
        obj = self._created("leases", body, "lease")
        obj["metadata"]["namespace"] = namespace
        self.admin_vanished.discard((name, str((body.get("spec") or {}).get("holderIdentity") or "")))
        return clone(self._write("leases", key, obj))

    def get_lease(self, name: str) -> Obj:
        obj = self.lease(name)
        if obj is None:
            raise _not_found("leases.coordination.k8s.io", name)
        return clone(obj)

    def _lease_with_uid(self, name: str, uid: str | None) -> Obj:
        obj = self.lease(name)
        if obj is None:
            raise _not_found("leases.coordination.k8s.io", name)
        if uid is not None and meta(obj).get("uid") != uid:
            raise _conflict(
                "leases.coordination.k8s.io",
                name,
                f"Precondition failed: UID in precondition: {uid}, "
                f"UID in object meta: {meta(obj).get('uid')}",
            )
        return obj

    def delete_lease(self, name: str, *, uid: str | None, resource_version: str | None = None) -> Obj | None:
        """Delete (uid and resourceVersion preconditions when given); a Lease with finalizers is
        only marked Terminating.

        Returns the Lease as removed, or None while finalizers keep it."""
        obj = self._lease_with_uid(name, uid)
        if resource_version is not None and meta(obj).get("resourceVersion") != resource_version:
            raise _conflict(
                "leases.coordination.k8s.io",
                name,
                f"Precondition failed: ResourceVersion in precondition: {resource_version}, "
                f"ResourceVersion in object meta: {meta(obj).get('resourceVersion')}",
            )
        key = f"{self.namespace}/{name}"
        if meta(obj).get("finalizers"):
            if not meta(obj).get("deletionTimestamp"):
                new = dict(obj)
                new["metadata"] = {**meta(obj), "deletionTimestamp": _stamp(self.clock())}
                self._write("leases", key, new)
            return None
        return self._write("leases", key, None)

    def replace_lease(self, body: Mapping[str, Any]) -> Obj | Then:
        """PUT: the whole Lease, conditional on its ``metadata.resourceVersion``.

        Emptying the finalizers of a Terminating Lease removes it, in a second step
        conditional on the body's uid (its NotFound ignored, as the real server does)."""
        m = meta(body)
        name = str(m.get("name", ""))
        obj = self.lease(name)
        if obj is None:
            raise _not_found("leases.coordination.k8s.io", name)
        if m.get("resourceVersion") != meta(obj).get("resourceVersion"):
            raise _conflict(
                "leases.coordination.k8s.io",
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if meta(obj).get("deletionTimestamp") and not m.get("finalizers"):
            return Then(lambda: self._remove_emptied_lease(name, clone(body), uid=m.get("uid")))
        new = clone(dict(body))
        new["metadata"] = {**meta(new), "deletionTimestamp": meta(obj).get("deletionTimestamp")}
        if not new["metadata"]["deletionTimestamp"]:
            del new["metadata"]["deletionTimestamp"]
        written = self._write("leases", f"{self.namespace}/{name}", new)
        assert written is not None
        return clone(written)

    def patch_lease_finalizers(self, name: str, *, uid: str) -> Then | None:
        """The JSON Patch ``[test /metadata/uid, replace /metadata/finalizers []]``: what the
        controller did before. The removal of a Terminating Lease that follows is conditional on
        nothing: it removes whatever Lease has the name by then."""
        obj = self._lease_with_uid(name, uid)
        if meta(obj).get("deletionTimestamp"):
            return Then(lambda: self._remove_emptied_lease(name, None, uid=None))
        if meta(obj).get("finalizers"):
            new = dict(obj)
            new["metadata"] = {k: v for k, v in meta(obj).items() if k != "finalizers"}
            self._write("leases", f"{self.namespace}/{name}", new)
        return None

    def _remove_emptied_lease(self, name: str, answer: Obj | None, *, uid: str | None) -> Obj | None:
        """``deleteWithoutFinalizers``: remove the Lease, if it has ``uid`` when given."""
        try:
            self._lease_with_uid(name, uid)
        except errors.NotFound:
            return answer
        self._write("leases", f"{self.namespace}/{name}", None)
        return answer

    def admin_delete_lease(self, name: str) -> bool:
        """``kubectl delete lease``: no precondition. True when the Lease vanished at once."""
        obj = self.lease(name)
        if obj is None:
            return False
        holder = str((obj.get("spec") or {}).get("holderIdentity") or "")
        removed = self.delete_lease(name, uid=None) is not None
        if removed:
            self.admin_vanished.add((name, holder))
        return removed

    # ------------------------------------------------------------------ Pods

    def create_pod(self, body: Mapping[str, Any], *, claim_uid: str) -> Obj:
        m = meta(body)
        key = f"{m['namespace']}/{m['name']}"
        if key in self.objects["pods"]:
            raise errors.AlreadyExists(409, "AlreadyExists", f'pods "{m["name"]}" already exists')
        obj = self._created("pods", body, "pod")
        obj.setdefault("status", {"phase": "Pending"})
        self.pod_claim_uid[key] = claim_uid
        return clone(self._write("pods", key, obj))

    def set_pod_phase(self, key: str, phase: str) -> None:
        old = self.objects["pods"][key]
        new = dict(old)
        new["status"] = {**(old.get("status") or {}), "phase": phase}
        self._write("pods", key, new)

    def delete_pod(self, key: str) -> None:
        self._write("pods", key, None)

    def evict_pod(self, namespace: str, name: str, *, uid: str = "") -> None:
        """The Eviction API, with no PodDisruptionBudget in the simulation: the pod is deleted (if it
        is still the one with ``uid``, when given)."""
        key = f"{namespace}/{name}"
        obj = self.objects["pods"].get(key)
        if obj is None:
            raise _not_found("pods", name)
        if uid and str(meta(obj).get("uid")) != uid:
            raise errors.Conflict(409, "Conflict", f"Precondition failed: UID in precondition: {uid}")
        self.delete_pod(key)

    def bind_pod(self, key: str, node: str) -> None:
        """kube-scheduler binds the pod, and its kubelet starts it."""
        old = self.objects["pods"][key]
        new = dict(old)
        new["spec"] = {**(old.get("spec") or {}), "nodeName": node}
        new["status"] = {"phase": "Running"}
        self._write("pods", key, new)

    def refuse_pod(self, key: str, message: str) -> None:
        """kube-scheduler cannot place the pod: PodScheduled False, reason Unschedulable."""
        old = self.objects["pods"][key]
        new = dict(old)
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastTransitionTime": timestamps.format_time(self.clock()),
        }
        new["status"] = {**(old.get("status") or {}), "conditions": [condition]}
        self._write("pods", key, new)

    def list_pods(self, namespace: str) -> list[Obj]:
        return [
            clone(obj) for obj in self.objects["pods"].values() if meta(obj).get("namespace") == namespace
        ]

    def list_claim_leases(self, uid: str) -> list[Obj]:
        """The Leases labelled with the claim uid, and the share ledgers with the label of an entry
        of it (as the controller's two label selectors on the real API server)."""
        return [
            clone(obj)
            for obj in self.objects["leases"].values()
            if (meta(obj).get("labels") or {}).get(constants.LABEL_CLAIM_UID) == uid
            or leases.SHARE_LABEL_PREFIX + uid in (meta(obj).get("labels") or {})
        ]

    def patch_pod(self, namespace: str, name: str, operations: Sequence[Mapping[str, Any]]) -> Obj:
        key = f"{namespace}/{name}"
        old = self.objects["pods"].get(key)
        if old is None:
            raise _not_found("pods", name)
        try:
            new = jsonpatch.apply_patch(clone(old), [dict(op) for op in operations])
        except jsonpatch.JsonPatchTestFailed as exc:
            raise errors.Invalid(422, "Invalid", f"the server rejected our request: {exc}") from exc
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
            raise errors.Invalid(422, "Invalid", f"the patch does not apply: {exc}") from exc
        new["metadata"] = {**meta(new), "uid": meta(old).get("uid"), "name": name, "namespace": namespace}
        if is_gated(old) and not is_gated(new):
            # A gated pod names its claim, not a uid: it is bound to the claim whose devices it was
            # given (the version its un-gater read): the claim of that name now if that lists them,
            # else the latest earlier one of the name that did (else the claim of that name now).
            annotations = meta(new).get("annotations") or {}
            claim_key = f"{namespace}/{annotations.get(constants.ANNOTATION_CLAIM)}"
            given = {u for u in str(annotations.get(constants.ANNOTATION_DEVICES) or "").split(",") if u}
            current = self.objects["claims"].get(claim_key)
            versions = [
                *([current] if current is not None else []),
                *reversed(self.claim_history.get(claim_key, [])),
            ]
            self.pod_claim_uid[key] = next(
                (str(meta(v).get("uid")) for v in versions if given <= _listed_uuids(v)),
                str(meta(current).get("uid")) if current is not None else "",
            )
        return clone(self._write("pods", key, new))

    # ------------------------------------------------------------------ nodes

    def add_gpu_node(
        self,
        name: str,
        gpus: int,
        mig: Sequence[int] = (),
        shared: Mapping[int, int] | None = None,
        allocatable: Mapping[str, str] | None = None,
    ) -> None:
        body: Obj = {"metadata": {"name": name, "labels": {constants.HOSTNAME_LABEL: name}}}
        if allocatable:
            body["status"] = {"allocatable": dict(allocatable)}
        node = self._created("nodes", body, "node")
        self._write("nodes", name, node)
        status = self._created(
            "node_statuses", {"metadata": {"name": name}, "spec": {"nodeName": name}}, "gns"
        )
        self.mig_gpus[name] = tuple(mig)
        self.shared_gpus[name] = dict(shared or {})
        status["status"] = inventory(
            name, gpus, now=self.clock(), mig=self.mig_gpus[name], shared=self.shared_gpus[name]
        )
        self._write("node_statuses", name, status)

    def set_node_status(self, name: str, *, ready: bool, unhealthy: Sequence[int]) -> None:
        """The agent's next write: Ready or not, these device indices Unhealthy, a fresh heartbeat."""
        old = self.objects["node_statuses"][name]
        gpus = int(old["status"]["total"])
        new = dict(old)
        new["status"] = inventory(
            name,
            gpus,
            now=self.clock(),
            ready=ready,
            unhealthy=unhealthy,
            mig=self.mig_gpus.get(name, ()),
            shared=self.shared_gpus.get(name),
        )
        # As the agent does (``publishing.merge_conditions``): a condition whose status holds keeps
        # its lastTransitionTime, so a write that changes nothing else is a heartbeat alone.
        for cond, was in zip(new["status"]["conditions"], old["status"]["conditions"], strict=True):
            if cond["status"] == was["status"]:
                cond["lastTransitionTime"] = was["lastTransitionTime"]
        self._write("node_statuses", name, new)

    # ------------------------------------------------------------------ events

    def emit_event(self, obj: Mapping[str, Any], reason: str, message: str, type_: str) -> None:
        self.events_emitted += 1


def _listed_uuids(claim: Mapping[str, Any]) -> set[str]:
    """The device UUIDs a claim's status lists (a slot's GPU as its UUID)."""
    return {
        str(d.get("uuid"))
        for a in (claim.get("status") or {}).get("allocations") or []
        for d in a.get("devices") or []
    }


def is_gated(pod: Mapping[str, Any]) -> bool:
    gates = (pod.get("spec") or {}).get("schedulingGates") or []
    return any(g.get("name") == constants.SCHEDULING_GATE for g in gates)


_WRITABLE_META = frozenset({"finalizers", "labels", "annotations"})


class SimFeed:
    """A controller cache with the interface of ``watching.Reflector`` the controller uses; it keeps
    what the controller's reflector of that kind keeps (``state.KEPT``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.cache: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.on_event: Callable[[str, Obj], None] | None = None
        self._kept = state.KEPT.get(kind)

    def get(self, key: str) -> Obj | None:
        return self.cache.get(key)

    def _keep(self, obj: Obj) -> Obj:
        return obj if self._kept is None else self._kept(obj)

    def apply(self, type_: str, obj: Obj) -> None:
        """One watch event, as ``Reflector.apply``: the cache first, then ``on_event``."""
        key = watching.object_key(obj)
        obj = self._keep(obj)
        if type_ == watching.DELETED:
            self.cache.pop(key, None)
        else:
            self.cache[key] = obj
        self._notify(type_, obj)

    def relist(self, objects: Mapping[str, Obj]) -> None:
        """A fresh list, as ``Reflector.relist``: replace the cache, emit the differences."""
        objects = {key: self._keep(obj) for key, obj in objects.items()}
        events = watching.diff(self.cache, objects)
        self.cache = objects
        for type_, obj in events:
            self._notify(type_, obj)
        self.synced.set()

    def _notify(self, type_: str, obj: Obj) -> None:
        # Unlike the Reflector, a handler's exception is not swallowed: it is a bug to report.
        if self.on_event is not None:
            self.on_event(type_, obj)

    def __repr__(self) -> str:
        return f"<SimFeed {self.kind} objects={len(self.cache)}>"
