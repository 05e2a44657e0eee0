"""Faults and a watch-fed safety check for the race test (tests/integration/test_race_crash.py).

* ``Timeline``: what happened when, printed with the seed when a run fails.
* ``Toxiproxy``: a ``toxiproxy-server`` process on loopback and its HTTP API.
  Each controller reaches the API server through its own proxy (``proxied_kubeconfig``);
  toxiproxy is a TCP proxy, so TLS and the client certificate pass through untouched.
* ``Mirror``: GpuClaims and device Leases kept from list + watch, with the safety
  invariants checked after every event it applies.

Why the mirror orders events by resourceVersion: claims and Leases come on two
watch streams, and one may run ahead of the other (a controller creates a Lease
and then writes the claim's status; the status event can arrive first). Both
kinds live in the same etcd, whose revision numbers every write, so the mirror
keeps each stream's events in a queue and applies them in resourceVersion order,
only up to the newest revision *both* streams have reported (an event or a
bookmark). Its state is then the API server's state at one revision, and a check
never sees a half-applied change. A quiet stream holds the other back; the mirror
then writes a tick object of that kind (a Lease and a GpuClaim that no controller
selects) so that its stream moves on.

A re-list (a watch broken by an API server restart, or a 410) replaces a kind's
history between its last event and the list's revision by the differences, which
happened at unknown revisions in between. Events of the other kind in that window
are applied without a check, and the whole state is checked once the list's
revision is reached: no false alarm, and nothing outside the window unchecked.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import heapq
import json
import os
import re
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import yaml

from gpualloc.api import constants, models
from gpualloc.api import leases as lease_format
from gpualloc.devcluster import cluster
from gpualloc.kube import errors, resources, transport, watching
from gpualloc.kube.client import Api

T = TypeVar("T")
Obj = dict[str, Any]

CLAIMS = "claims"
LEASES = "leases"
PODS = "pods"
TICK = "race-tick"  # the Lease and the GpuClaim the mirror writes to move a quiet watch on
NUDGE_EVERY_S = 0.5  # at most one tick write per kind this often, and only while events wait


class Timeline:
    """Timestamped notes, seconds since the run started."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.entries: list[tuple[float, str]] = []

    def now(self) -> float:
        return time.monotonic() - self.started

    def note(self, what: str) -> None:
        self.entries.append((self.now(), what))

    def render(self) -> str:
        return "\n".join(f"{at:8.2f} s  {what}" for at, what in self.entries)


async def until_available(
    call: Callable[[], Awaitable[T]], *, within: float = 90.0, interval: float = 0.2
) -> T:
    """Retry ``call`` every ``interval`` seconds while the API server is away (restarting: no
    answer, 5xx, 429, or the 404 of a custom resource whose routes the restarted server has not set
    up yet)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except (errors.Unavailable, errors.NotFound) as exc:
            if (
                isinstance(exc, errors.NotFound)
                and "could not find the requested resource" not in exc.message
            ):
                raise
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(interval)


async def all_of(*awaitables: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather``, but the first failure cancels (and awaits) the others: none is left running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ------------------------------------------------------------------ toxiproxy


class ToxiproxyError(RuntimeError):
    pass


class Toxiproxy:
    """``toxiproxy-server`` on 127.0.0.1, driven through its HTTP API (v2)."""

    def __init__(self, binary: Path, log_path: Path) -> None:
        self.binary = binary
        self.log_path = log_path
        self.url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Toxiproxy:
        port = cluster.free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._proc = self._spawn(port)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        try:
            await self._wait_started()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _wait_started(self) -> None:
        deadline = time.monotonic() + 20
        while True:
            try:
                await self._call("GET", "/version")
                return
            except (aiohttp.ClientError, ToxiproxyError):
                if self._proc is None or self._proc.poll() is not None or time.monotonic() > deadline:
                    log = self.log_path.read_text(errors="replace")[-2000:]
                    raise ToxiproxyError(f"toxiproxy-server did not start; {self.log_path}:\n{log}") from None
                await asyncio.sleep(0.05)

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                [str(self.binary), "-host", "127.0.0.1", "-port", str(port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "LOG_LEVEL": "info"},
            )

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait, 10)
            self._proc = None

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        if self._session is None:
            raise ToxiproxyError("toxiproxy is not running")
        async with self._session.request(method, self.url + path, json=body) as response:
            text = await response.text()
            if response.status >= 400:
                raise ToxiproxyError(f"{method} {path}: HTTP {response.status}: {text[:300]}")
            if "json" not in response.headers.get("Content-Type", ""):
                return text  # GET /version answers plain text
            return json.loads(text) if text.strip() else None

    async def create_proxy(self, name: str, upstream: str) -> str:
        """A proxy listening on a free loopback port; its ``host:port``."""
        created = await self._call(
            "POST", "/proxies", {"name": name, "listen": "127.0.0.1:0", "upstream": upstream, "enabled": True}
        )
        return str(created["listen"])

    async def set_enabled(self, proxy: str, enabled: bool) -> None:
        """Disabling closes every connection and stops listening; enabling listens on the same port."""
        await self._call("POST", f"/proxies/{proxy}", {"enabled": enabled})

    async def add_toxic(
        self, proxy: str, name: str, type_: str, attributes: Mapping[str, Any], *, stream: str = "downstream"
    ) -> None:
        body = {
            "name": name,
            "type": type_,
            "stream": stream,
            "toxicity": 1.0,
            "attributes": dict(attributes),
        }
        await self._call("POST", f"/proxies/{proxy}/toxics", body)

    async def remove_toxic(self, proxy: str, name: str) -> None:
        with contextlib.suppress(ToxiproxyError):  # gone already (a reset)
            await self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")

    async def reset(self) -> None:
        """Every proxy enabled, every toxic removed."""
        await self._call("POST", "/reset")


def proxied_kubeconfig(source: Path, server: str, target: Path) -> Path:
    """A copy of the kubeconfig ``source`` whose clusters' server is ``server``."""
    config = yaml.safe_load(source.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = server
    target.write_text(yaml.safe_dump(config, sort_keys=False))
    target.chmod(0o600)
    return target


# --------------------------------------------------------------------- mirror


def recorded(claim: Mapping[str, Any]) -> list[str]:
    """The lock ids a claim's status lists: GPU or MIG instance UUIDs, and slots of shared GPUs
    (``constants.slot_id``)."""
    allocations = (claim.get("status") or {}).get("allocations") or []
    return [
        d["uuid"] if d.get("slot") is None else constants.slot_id(d["uuid"], int(d["slot"]))
        for a in allocations
        for d in a.get("devices") or []
    ]


def listed_shares(claim: Mapping[str, Any]) -> dict[str, int]:
    """Lease name -> the milli-GPU share of its GPU a claim's status lists (``sharing.milli``)."""
    allocations = (claim.get("status") or {}).get("allocations") or []
    return {
        constants.lease_name(d["uuid"]): int(d["milli"])
        for a in allocations
        for d in a.get("devices") or []
        if d.get("milli")
    }


def share_ledger(lease: Mapping[str, Any]) -> dict[str, int] | None:
    """A share ledger's entries (claim uid -> milli-GPU); None for a Lease that is not one."""
    labels = (lease.get("metadata") or {}).get("labels") or {}
    if labels.get(lease_format.LABEL_SHARES) != lease_format.SHARES_MARK:
        return None
    return {uid: int(entry.get("milli", 0)) for uid, entry in lease_format.ledger(lease).items()}


def silicon_of(inventories: Iterable[models.NodeInventory]) -> dict[str, str]:
    """Lease name of each MIG instance and sharing slot -> the Lease name of its GPU (the same
    silicon), from the published inventories."""
    return {
        constants.lease_name(part): constants.lease_name(device.uuid)
        for inv in inventories
        for device in inv.devices
        for part in device.lock_ids[1:]
    }


def devices_used(pod: Mapping[str, Any]) -> list[str]:
    """The GPU UUIDs a claim pod's containers get: the ``CUDA_VISIBLE_DEVICES`` value the webhook
    wrote, else (a pod admitted before its claim was Allocated reads it through the downward API)
    the devices annotation; none while the pod waits at the gate or once it is Succeeded or Failed."""
    metadata = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    annotations = metadata.get("annotations") or {}
    if constants.ANNOTATION_CLAIM not in annotations:
        return []
    if any(g.get("name") == constants.SCHEDULING_GATE for g in spec.get("schedulingGates") or []):
        return []
    if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return []
    value = annotations.get(constants.ANNOTATION_DEVICES) or ""
    for container in spec.get("containers") or []:
        for entry in container.get("env") or []:
            if entry.get("name") == "CUDA_VISIBLE_DEVICES" and "value" in entry:
                value = entry["value"]
    return [u for u in str(value).split(",") if u]


def _pod_claim(pod: Mapping[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    name = (metadata.get("annotations") or {}).get(constants.ANNOTATION_CLAIM)
    return f"{metadata.get('namespace', '')}/{name}"


def _lease_names(claim: Mapping[str, Any] | None) -> set[str]:
    return {constants.lease_name(u) for u in recorded(claim)} if claim else set()


_PART = re.compile(r"gpu-(mig-.*|.*-s[0-9]+)")  # the Lease name of a MIG instance or a slot


def _rv(obj: Mapping[str, Any]) -> int:
    return int(watching.resource_version_of(obj))


@dataclasses.dataclass(order=True)
class _Item:
    """Events to apply at revision ``rv``: one watch event, or a re-list's differences (``relist``)."""

    rv: int
    seq: int
    kind: str = dataclasses.field(compare=False)
    events: list[tuple[str, Obj]] = dataclasses.field(compare=False)
    relist: bool = dataclasses.field(compare=False)


@dataclasses.dataclass
class _Window:
    """Revisions (after, upto] where one kind's history is known only by a re-list at ``upto``."""

    after: int
    upto: int
    kind: str
    applied: bool = False


class Books:
    """Claims and device Leases at one revision, and the safety invariants over them.

    * no GPU is listed by two claims (a claim being deleted counts only while it
      still holds that GPU's Lease: its finalizer releases the Leases before the
      claim goes, and the Lease, not the dying status, is then what locks the GPU),
      except as milli-GPU shares (``sharing.milli``): those of one GPU add up to at
      most 1000 and are never listed beside a claim listing it whole, and every
      share ledger (the GPU's Lease) sums to at most 1000 too;
    * every GPU an Allocated claim lists has a Lease (Terminating or not) held
      by that claim's UID, unless the claim is being deleted; so has every GPU a
      Preempted claim still lists (it lists them until its pods are evicted, and
      its Leases are released only after it stops listing them);
    * a claim that is neither Allocated nor Preempted lists no GPU, and no claim
      lists one twice;
    * with ``silicon`` (``silicon_of``): no GPU is listed whole by one claim while
      another lists a MIG instance or a slot of it, and no claim lists a slot or an
      instance of a GPU that has none by that name;
    * no claim in use is released (pods, when the mirror follows them): every device a
      claim pod's containers get (``devices_used``: past the gate, not Succeeded or
      Failed) is listed by the claim of its annotation, which exists (being deleted
      counts) and holds that device's Lease.

    ``apply_*`` return what they touched, so that a check after an event looks
    only at the claims and Leases the event can affect.
    """

    def __init__(self, *, label: str, value: str, silicon: Mapping[str, str] | None = None) -> None:
        self.label = label
        self.value = value
        self.silicon = dict(silicon or {})  # a part's Lease name -> its GPU's
        self._parts: dict[str, set[str]] = collections.defaultdict(set)  # a GPU's Lease name -> parts'
        for part, gpu in self.silicon.items():
            self._parts[gpu].add(part)
        self.claims: dict[str, Obj] = {}  # namespace/name -> claim
        self.leases: dict[str, Obj] = {}  # name -> device Lease
        self.other_leases: dict[str, Obj] = {}  # the election Lease, the tick
        self._listers: dict[str, set[str]] = collections.defaultdict(set)  # lease name -> claim keys
        self.pods: dict[str, Obj] = {}  # namespace/name -> a claim pod using devices
        self._pods_of: dict[str, set[str]] = collections.defaultdict(set)  # claim key -> pod keys

    @classmethod
    def of(
        cls,
        claims: Iterable[Obj],
        leases: Iterable[Obj],
        *,
        label: str,
        value: str,
        silicon: Mapping[str, str] | None = None,
    ) -> Books:
        books = cls(label=label, value=value, silicon=silicon)
        for claim in claims:
            books.apply_claim(watching.ADDED, claim)
        for lease in leases:
            books.apply_lease(watching.ADDED, lease)
        return books

    def apply_claim(self, type_: str, obj: Obj) -> tuple[set[str], set[str]]:
        """Apply a claim event; the claim keys and Lease names it touched."""
        if ((obj.get("metadata") or {}).get("labels") or {}).get(self.label) != self.value:
            return set(), set()
        key = watching.object_key(obj)
        old = _lease_names(self.claims.get(key))
        if type_ == watching.DELETED:
            self.claims.pop(key, None)
            new: set[str] = set()
        else:
            self.claims[key] = obj
            new = _lease_names(obj)
        for name in old - new:
            self._listers[name].discard(key)
            if not self._listers[name]:
                del self._listers[name]
        for name in new - old:
            self._listers[name].add(key)
        return {key}, old | new

    def apply_lease(self, type_: str, obj: Obj) -> tuple[set[str], set[str]]:
        """Apply a Lease event; the claim keys (those listing its GPU) and Lease names it touched."""
        metadata = obj.get("metadata") or {}
        name = str(metadata.get("name", ""))
        device = (metadata.get("labels") or {}).get(constants.LABEL_MANAGED_BY) == constants.MANAGED_BY
        target = self.leases if device else self.other_leases
        if type_ == watching.DELETED:
            target.pop(name, None)
        else:
            target[name] = obj
        if not device:
            return set(), set()
        return set(self._listers.get(name, ())), {name}

    def apply_pod(self, type_: str, obj: Obj) -> tuple[set[str], set[str]]:
        """Apply a pod event; the claim it names (the touched key) and no Lease."""
        if ((obj.get("metadata") or {}).get("labels") or {}).get(self.label) != self.value:
            return set(), set()
        key, claim = watching.object_key(obj), _pod_claim(obj)
        touched = {claim}
        old = self.pods.pop(key, None)
        if old is not None:
            old_claim = _pod_claim(old)
            touched.add(old_claim)
            self._pods_of[old_claim].discard(key)
            if not self._pods_of[old_claim]:
                del self._pods_of[old_claim]
        if type_ != watching.DELETED and devices_used(obj):
            self.pods[key] = obj
            self._pods_of[claim].add(key)
        return touched, set()

    def pod_problems(self, claim_key: str) -> list[str]:
        """The claim pods of ``claim_key`` using devices that it does not hold (see the class doc)."""
        problems = []
        for pod_key in sorted(self._pods_of.get(claim_key, ())):
            used = devices_used(self.pods[pod_key])
            claim = self.claims.get(claim_key)
            if claim is None:
                problems.append(f"pod {pod_key} uses {used}, but its claim {claim_key} is gone")
                continue
            uid = claim["metadata"]["uid"]
            locks = {
                d["uuid"]: d["uuid"]
                if d.get("slot") is None
                else constants.slot_id(d["uuid"], int(d["slot"]))
                for a in (claim.get("status") or {}).get("allocations") or []
                for d in a.get("devices") or []
            }
            for gpu in used:
                if gpu not in locks:
                    problems.append(
                        f"pod {pod_key} uses {gpu}, which its claim {claim_key} (uid {uid}) does not list"
                    )
                elif not self.holds(constants.lease_name(locks[gpu]), uid):
                    held = self.holder(constants.lease_name(locks[gpu]))
                    problems.append(
                        f"pod {pod_key} uses {gpu} of claim {claim_key} (uid {uid}), whose Lease {held=}"
                    )
        return problems

    def holder(self, lease_name: str) -> str | None:
        """Who holds the Lease: its holder, or for a share ledger ``shares={uid: milli}``."""
        lease = self.leases.get(lease_name)
        if lease is None:
            return None
        shares = share_ledger(lease)
        if shares is not None:
            return f"shares={shares}"
        return str((lease.get("spec") or {}).get("holderIdentity"))

    def holds(self, lease_name: str, uid: str) -> bool:
        """Whether claim ``uid`` holds the Lease, whole or by an entry of its share ledger."""
        lease = self.leases.get(lease_name)
        if lease is None:
            return False
        shares = share_ledger(lease)
        return uid in shares if shares is not None else (lease.get("spec") or {}).get("holderIdentity") == uid

    def _counts(self, key: str, lease_name: str) -> bool:
        """Whether claim ``key`` locks the GPU of ``lease_name`` by listing it (see the class doc)."""
        metadata = self.claims[key]["metadata"]
        return not metadata.get("deletionTimestamp") or self.holds(lease_name, metadata["uid"])

    def claim_problems(self, key: str) -> list[str]:
        claim = self.claims.get(key)
        if claim is None:
            return []
        metadata = claim["metadata"]
        uid = metadata["uid"]
        phase = (claim.get("status") or {}).get("phase")
        uuids = recorded(claim)
        problems = []
        if len(set(uuids)) != len(uuids):
            problems.append(f"{key} lists a GPU twice: {uuids}")
        if phase not in (constants.PHASE_ALLOCATED, constants.PHASE_PREEMPTED):
            if uuids:
                problems.append(f"{key} is {phase} but lists devices {uuids}")
            return problems
        if metadata.get("deletionTimestamp"):
            return problems
        for gpu in uuids:
            name = constants.lease_name(gpu)
            if name not in self.leases:
                problems.append(f"{key} (uid {uid}) is {phase} and lists {gpu}, which has no Lease")
            elif not self.holds(name, uid):
                held = self.holder(name)
                problems.append(f"{key} (uid {uid}) is {phase} and lists {gpu}, whose Lease {held=}")
        return problems

    def lease_problems(self, name: str) -> list[str]:
        listers = sorted(k for k in self._listers.get(name, ()) if self._counts(k, name))
        shares = {k: m for k in listers if (m := listed_shares(self.claims[k]).get(name))}
        owners = [k for k in listers if k not in shares]  # those listing it whole
        problems = []
        if len(owners) >= 2 or (owners and shares):
            problems.append(
                f"{name} is listed by {len(listers)} claims: {owners} whole, {shares} in shares"
                f" (Lease held by {self.holder(name)!r})"
            )
        if sum(shares.values()) > lease_format.WHOLE_MILLI:
            problems.append(
                f"{name} is shared past the whole GPU: {shares} (Lease held by {self.holder(name)!r})"
            )
        stored = share_ledger(self.leases.get(name) or {}) or {}
        if sum(stored.values()) > lease_format.WHOLE_MILLI:
            problems.append(f"{name}'s share ledger sums past the whole GPU: {stored}")
        if owners and self.silicon and name not in self.silicon and _PART.fullmatch(name):
            problems.append(f"{owners} list {name}, which no GPU has")
        gpu = self.silicon.get(name, name)
        whole = {k for k in self._listers.get(gpu, ()) if self._counts(k, gpu)}
        parts = {
            k
            for part in self._parts.get(gpu, ())
            for k in self._listers.get(part, ())
            if self._counts(k, part)
        }
        if whole and parts - whole:
            problems.append(
                f"{gpu} is listed whole by {sorted(whole)} and in parts by {sorted(parts - whole)}"
            )
        return problems

    def problems(self, claims: Iterable[str] | None = None, leases: Iterable[str] | None = None) -> list[str]:
        """What breaks the invariants among ``claims`` and ``leases`` (default: everything)."""
        claim_keys = sorted((self.claims.keys() | self._pods_of.keys()) if claims is None else claims)
        lease_names = sorted(self._listers if leases is None else leases)
        return [p for key in claim_keys for p in (*self.claim_problems(key), *self.pod_problems(key))] + [
            p for name in lease_names for p in self.lease_problems(name)
        ]

    def allocated(self) -> list[str]:
        """Keys of Allocated claims not being deleted, sorted."""
        return sorted(
            key
            for key, claim in self.claims.items()
            if (claim.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED
            and not claim["metadata"].get("deletionTimestamp")
        )


class Mirror:
    """``Books`` kept from list + watch of GpuClaims and Leases in ``namespace`` (and, with
    ``pods``, its pods), checked after every event it applies (only what the event touched),
    and in full after a re-list.

    Violations go to ``violations`` (and the timeline), each once; the test fails on them.
    """

    def __init__(
        self,
        api: Api,
        namespace: str,
        *,
        label: str,
        value: str,
        timeline: Timeline,
        silicon: Mapping[str, str] | None = None,
        pods: bool = False,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.timeline = timeline
        self.kinds = (CLAIMS, LEASES, PODS) if pods else (CLAIMS, LEASES)
        self.books = Books(label=label, value=value, silicon=silicon)
        self.revision = 0
        self.violations: list[str] = []
        self.synced = asyncio.Event()
        self.stats: collections.Counter[str] = collections.Counter()
        self._seen: set[str] = set()
        self._received: dict[str, dict[str, Obj]] = {kind: {} for kind in self.kinds}
        self._upto: dict[str, int] = dict.fromkeys(self.kinds, 0)  # each stream's newest revision
        self._queue: list[_Item] = []
        self._seq = 0
        self._windows: list[_Window] = []
        self._nudged: dict[str, float] = dict.fromkeys(self.kinds, 0.0)
        self._ticks = 0

    # ------------------------------------------------------------ running

    async def run(self) -> None:
        """Create the tick objects, then follow every kind until cancelled."""
        await self._create_ticks()
        resources_ = {CLAIMS: watching.CLAIMS, LEASES: watching.LEASES, PODS: watching.PODS}
        async with asyncio.TaskGroup() as group:
            for kind in self.kinds:
                group.create_task(self._follow(kind, resources_[kind]))
            group.create_task(self._pump())

    async def _create_ticks(self) -> None:
        tick_claim = {
            "apiVersion": constants.API_VERSION,
            "kind": constants.CLAIM_KIND,
            "metadata": {"name": TICK},
            "spec": {"devices": {"count": 1}},
        }
        tick_lease = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": TICK},
            "spec": {"holderIdentity": TICK},
        }
        with contextlib.suppress(errors.AlreadyExists):
            await until_available(
                lambda: resources.CustomResources(self.api).create_claim(self.namespace, tick_claim)
            )
        with contextlib.suppress(errors.AlreadyExists):
            await until_available(
                lambda: transport.request(self.api, "POST", self._lease_path(), body=tick_lease)
            )
        if PODS in self.kinds:
            tick_pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": TICK},
                "spec": {
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "tick", "image": "registry.invalid/tick:1"}],
                },
            }
            with contextlib.suppress(errors.AlreadyExists):
                await until_available(
                    lambda: transport.request(
                        self.api, "POST", watching.PODS.path(self.namespace), body=tick_pod
                    )
                )

    def _lease_path(self, name: str | None = None) -> str:
        return watching.LEASES.path(self.namespace) + (f"/{name}" if name else "")

    async def _follow(self, kind: str, resource: watching.ResourceKind) -> None:
        reflector = watching.Reflector(self.api, resource, namespace=self.namespace, watch_timeout_seconds=60)
        failures = 0
        while True:
            try:
                objects, rv = await reflector.list_objects()
                self._relisted(kind, objects, int(rv))
                while True:
                    started, count = time.monotonic(), 0
                    async with contextlib.aclosing(reflector.stream(str(self._upto[kind]))) as stream:
                        async for event in stream:
                            count += 1
                            self._watched(kind, event)
                    failures = 0
                    if not count and time.monotonic() - started < 1.0:
                        await asyncio.sleep(0.2)  # ended at once: the API server is going away
            except errors.Gone:
                self.stats[f"{kind} expired"] += 1
            except (errors.KubeError, ValueError, KeyError, TypeError) as exc:
                failures += 1
                self.stats[f"{kind} watch failures"] += 1
                if failures == 1:
                    self.timeline.note(f"mirror: {kind} watch failed ({str(exc)[:120]}); re-listing")
                await asyncio.sleep(min(1.0, 0.1 * failures))

    async def _pump(self) -> None:
        """Apply what both streams have passed; move a quiet stream on with a tick write."""
        while True:
            await asyncio.sleep(0.1)
            self._drain()
            if not self._queue:
                continue
            head = self._queue[0].rv
            now = time.monotonic()
            for kind in self.kinds:
                if self._upto[kind] < head and now - self._nudged[kind] > NUDGE_EVERY_S:
                    self._nudged[kind] = now
                    await self._nudge(kind)

    async def _nudge(self, kind: str) -> None:
        self._ticks += 1
        patch = {"metadata": {"annotations": {"gpualloc.test/tick": str(self._ticks)}}}
        self.stats["ticks"] += 1
        with contextlib.suppress(errors.KubeError, TimeoutError):
            async with asyncio.timeout(3):
                if kind == CLAIMS:
                    await resources.CustomResources(self.api).patch_claim(self.namespace, TICK, patch)
                else:
                    path = self._lease_path(TICK) if kind == LEASES else watching.PODS.path(self.namespace)
                    await transport.request(
                        self.api,
                        "PATCH",
                        path if kind == LEASES else f"{path}/{TICK}",
                        body=patch,
                        content_type=transport.MERGE_PATCH,
                    )

    # ------------------------------------------------------------ ordering

    def _push(self, rv: int, kind: str, events: list[tuple[str, Obj]], *, relist: bool) -> None:
        self._seq += 1
        heapq.heappush(self._queue, _Item(rv, self._seq, kind, events, relist))

    def _watched(self, kind: str, event: Mapping[str, Any]) -> None:
        type_ = event.get("type")
        obj = event.get("object")
        if type_ == watching.ERROR:
            raise errors.from_status(obj if isinstance(obj, dict) else {})
        if not isinstance(obj, dict):
            raise ValueError(f"watch event without an object: {str(event)[:200]}")
        rv = _rv(obj)
        if type_ != watching.BOOKMARK:
            key = watching.object_key(obj)
            if type_ == watching.DELETED:
                self._received[kind].pop(key, None)
            else:
                self._received[kind][key] = obj
            self._push(rv, kind, [(str(type_), obj)], relist=False)
        self._upto[kind] = max(self._upto[kind], rv)
        self._drain()

    def _relisted(self, kind: str, objects: dict[str, Obj], rv: int) -> None:
        events = watching.diff(self._received[kind], objects)
        self._received[kind] = objects
        self._windows.append(_Window(self._upto[kind], rv, kind))
        self._push(rv, kind, events, relist=True)
        self._upto[kind] = max(self._upto[kind], rv)
        self.stats[f"{kind} lists"] += 1
        if self.stats[f"{kind} lists"] > 1:
            self.timeline.note(f"mirror: re-listed {kind} at revision {rv} ({len(events)} differences)")
        self._drain()

    def _drain(self) -> None:
        passed = min(self._upto.values())
        while self._queue and self._queue[0].rv <= passed:
            self._apply(heapq.heappop(self._queue))
        if passed and not self.synced.is_set() and all(self.stats[f"{k} lists"] for k in self.kinds):
            self.synced.set()

    def _blurred(self, item: _Item) -> bool:
        """Whether the state after ``item`` may mix revisions (inside a re-list's window)."""
        for window in self._windows:
            if window.applied or item.rv <= window.after:
                continue
            if item.rv < window.upto or (
                item.rv == window.upto and not (item.relist and item.kind == window.kind)
            ):
                return True
        return False

    # -------------------------------------------------------------- state

    def _apply(self, item: _Item) -> None:
        self.revision = max(self.revision, item.rv)
        claims: set[str] = set()
        leases: set[str] = set()
        for type_, obj in item.events:
            self.stats["events"] += 1
            apply = {
                CLAIMS: self.books.apply_claim,
                LEASES: self.books.apply_lease,
                PODS: self.books.apply_pod,
            }[item.kind]
            touched_claims, touched_leases = apply(type_, obj)
            claims |= touched_claims
            leases |= touched_leases
        blurred = self._blurred(item)
        if item.relist:
            for window in self._windows:
                if window.kind == item.kind and window.upto == item.rv:
                    window.applied = True
        if blurred:
            self.stats["events in re-list windows"] += len(item.events)
            return
        self.stats["checks"] += 1
        if item.relist:
            self._record(self.books.problems(), "re-list")
        else:
            type_, obj = item.events[0]
            self._record(self.books.problems(claims, leases), f"{type_} {watching.object_key(obj)}")

    def check_now(self) -> list[str]:
        """A full check of the mirror's current state (besides the per-event ones)."""
        problems = self.books.problems()
        self._record(problems, "poll")
        return problems

    def _record(self, problems: list[str], after: str) -> None:
        for problem in problems:
            if problem in self._seen:
                continue
            self._seen.add(problem)
            line = f"revision {self.revision} (after {after}): {problem}"
            self.violations.append(line)
            self.timeline.note(f"SAFETY VIOLATION at {line}")

    def lag(self) -> int:
        """Events received but not applied yet (waiting for the other stream)."""
        return len(self._queue)


async def consistent_snapshot(
    api: Api, namespace: str, *, label: str, value: str
) -> tuple[list[Obj], list[Obj]]:
    """The run's claims and the device Leases at one revision: the claims' list revision, with
    the Leases read at exactly that revision (two plain lists may straddle a release)."""
    crs = resources.CustomResources(api)
    listing = await until_available(lambda: crs.list_claims(namespace, f"{label}={value}"))
    query = [
        ("labelSelector", f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}"),
        ("resourceVersion", str(listing["metadata"]["resourceVersion"])),
        ("resourceVersionMatch", "Exact"),
    ]
    leases = await until_available(
        lambda: transport.request(api, "GET", watching.LEASES.path(namespace), query=query)
    )
    return list(listing.get("items") or []), list(leases.get("items") or [])
