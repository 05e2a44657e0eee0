"""The seeded scheduler: N controllers and simulated users, interleaved at every await.

Every actor is an asyncio task on one loop. Each call a controller makes to
its ``Cluster`` (``SimCluster``) parks on a Future; the scheduler lets the loop
run until every task is blocked, checks the invariants, and then picks, with
its seeded ``random.Random``, one step:

* apply a pending call (atomically, in the ``model.ApiServer``), and answer it
  now or later (an answer delivered later lets others see the write first);
* answer a call applied earlier; or fail a call with 503, applied or not;
* deliver the next watch event of one kind to one controller (late, but in
  order per kind), or make a controller re-list one kind;
* start a reconcile of a claim key on a controller (never two of the same key
  at once in one controller; any number across controllers), or a sweep;
* a user action: create or delete a claim, create a pod for an Allocated claim
  (with the claim's devices, as if admitted and un-gated at once: more than the
  real webhook allows, which holds every claim pod at the gate) or a gated pod
  for a Pending one, complete or delete a pod, delete a Lease as an admin
  would, or flap a node (Ready toggles, a device turns Unhealthy or recovers);
* a stale webhook admits a pod: from any earlier version of a claim of that
  name that showed it Allocated (the claim may since have been released,
  deleted, or created again), the pod is stored gated with that version's
  devices, and the controller alone may lift the gate;
* rarely: crash a controller (its in-flight requests applied or not, their
  answers lost; its tasks cancelled) and start a fresh one with fresh lists;
  or move the virtual clock on.

After the main phase the users stop and the cluster settles: every event is
delivered, every controller reconciles every key and sweeps, until nothing
changes (bounded); then invariant 4 is checked.

Time is virtual: the controller is given ``now=VirtualClock.now``, and its
modules' ``time.monotonic()`` (and the old layout's module-level ``_now()``)
read the clock while a schedule runs, so a schedule depends on its seed only,
and the scheduler can let backoffs, expectations and grace periods run out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import importlib
import inspect
import logging
import random
import time
import traceback
import types
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import msgspec

from controller import metrics as controller_metrics
from controller import reconciling
from gpualloc.api import codecs, constants, requests
from gpualloc.kube import errors, watching
from tests.simulation import invariants, model

Obj = dict[str, Any]


def _settings_class() -> Callable[..., Any]:
    """``controller.settings.Settings``, or ``controller.reconciling.Settings`` in the layouts
    before issue 38 moved it."""
    try:
        settings: Callable[..., Any] = importlib.import_module("controller.settings").Settings
        return settings
    except ImportError:
        return reconciling.Settings  # type: ignore[attr-defined,no-any-return]


# What the scheduler may do besides applying/answering calls, delivering events and reconciling;
# ``without`` turns some off (to hunt one kind of bug).
ACTIONS = frozenset(
    {
        "create-claim",
        "delete-claim",
        "create-pod",
        "gated-pod",
        "finish-pod",
        "delete-pod",
        "admin-delete-lease",
        "flap-node",
        "crash",
        "fail-call",
        "relist",
        "quota",
        "release",
        "reallocate",
        "preempt",
        "mig",
        "shared",
        "milli",
        "stale-pod",
        "strip-finalizer",
        "preempt-cluster",
        "unplaceable",
        "heal",
        "schedule-pod",
        "cpu-pod",
        "tick",
        "fragmentation",
    }
)
SETTINGS = _settings_class()(namespace=model.NAMESPACE, node_stale_after=1e9)
SWEEP = "sweep"
NODE_ALLOCATABLE = {"cpu": "4", "pods": "110"}  # the nodes' allocatable when pods ask for CPU
QUIESCE_BOUND = 10_000  # loop iterations to wait for every task to block
SETTLE_ROUNDS = 8
DRAIN_BOUND = 20_000
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class _SharedMetrics(controller_metrics.Metrics):
    """One registry for every simulated controller in this process (building one per controller
    would cost more than a schedule); the scrape-time sources are not wired up (never scraped)."""

    def set_device_source(self, source: Callable[[], controller_metrics.DeviceCounts]) -> None:
        pass

    def set_pending_source(self, source: Callable[[], int]) -> None:
        pass


_METRICS: _SharedMetrics | None = None


def _metrics() -> controller_metrics.Metrics:
    global _METRICS
    if _METRICS is None:
        _METRICS = _SharedMetrics()
    return _METRICS


class VirtualClock:
    """Wall time and monotonic time that move only when the scheduler says so."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> datetime.datetime:
        return EPOCH + datetime.timedelta(seconds=self.offset)

    def monotonic(self) -> float:
        return 1_000_000.0 + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@functools.cache
def _controller_modules() -> list[types.ModuleType]:
    """The controller modules that read the clock (those of the layout at hand)."""
    found = []
    for name in ("reconciling", "allocating", "gating", "running"):
        with contextlib.suppress(ImportError):
            found.append(importlib.import_module(f"controller.{name}"))
    return found


@functools.cache
def _controller_class() -> tuple[Callable[..., Any], bool]:
    """``controller.running.Controller``, or where that does not exist (the controller before the
    fix of issue 18, commit cf09560) ``controller.reconciling.Controller``: the same seam. And
    whether it takes ``now``."""
    try:
        make: Callable[..., Any] = importlib.import_module("controller.running").Controller
    except ImportError:
        make = reconciling.Controller  # type: ignore[attr-defined]
    return make, "now" in inspect.signature(make).parameters


@contextlib.contextmanager
def virtual_time(clock: VirtualClock) -> Iterator[None]:
    """The controller's modules read ``clock`` for ``time.monotonic()`` (and a module-level
    ``_now()``) meanwhile; a controller that takes ``now`` is given ``clock.now`` as well."""
    shim = types.SimpleNamespace(monotonic=clock.monotonic, perf_counter=time.perf_counter, time=time.time)
    saved = []
    for module in _controller_modules():
        for name, value in (("time", shim), ("_now", clock.now)):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


PARSES_KEPT = 2048  # parsed objects kept from one schedule to the next (then all forgotten at once)
_PARSED: dict[tuple[str, bytes], Any] = {}
_ENCODE = msgspec.msgpack.Encoder().encode


@contextlib.contextmanager
def shared_parses() -> Iterator[None]:
    """``codecs`` parses each distinct GpuClaim and GpuNodeStatus once meanwhile.

    Every controller parses each version of each object it sees (and again after a crash), and
    schedules start alike (the same nodes, uids and resourceVersions). The same raw object always
    makes the same frozen model, which the controllers never change, so they may share it, in
    this schedule and the next. Raw objects here are the simulated server's msgpack round trips
    (dicts, lists, scalars): equal msgpack bytes, equal objects. A raw object that does not
    parse is not remembered (it raises every time)."""

    def once(name: str, parse: Callable[[Mapping[str, Any]], Any]) -> Callable[[Mapping[str, Any]], Any]:
        def parse_once(raw: Mapping[str, Any]) -> Any:
            key = (name, _ENCODE(raw))
            found = _PARSED.get(key)
            if found is None:
                if len(_PARSED) >= PARSES_KEPT:
                    _PARSED.clear()
                found = _PARSED[key] = parse(raw)
            return found

        return parse_once

    saved = {name: getattr(codecs, name) for name in ("parse_claim", "parse_node_status")}
    for name, parse in saved.items():
        setattr(codecs, name, once(name, parse))
    try:
        yield
    finally:
        for name, parse in saved.items():
            setattr(codecs, name, parse)


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    """The shape of one schedule, drawn from its seed."""

    nodes: tuple[str, ...]
    gpus: int
    claims: tuple[str, ...]  # the keys users create claims under (re-created with new uids)
    controllers: int
    steps: int

    @classmethod
    def draw(cls, rng: random.Random, steps: int | None = None) -> Scenario:
        gpus = rng.choice((2, 2, 3, 4))
        names = rng.choice((2, 3, 3, 4))
        # Mostly one namespace; sometimes a second one (the Leases live in neither).
        keys = tuple(f"{'ns-b' if rng.random() < 0.25 else 'ns-a'}/c{i}" for i in range(names))
        return cls(
            nodes=("n0", "n1"),
            gpus=gpus,
            claims=keys,
            controllers=rng.choice((2, 2, 3)),
            steps=steps if steps is not None else rng.randint(20, 50),
        )


def _releasing(claim: Obj) -> bool:
    conditions = (claim.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") == constants.CONDITION_RELEASING and c.get("status") == "True" for c in conditions
    )


def _admits_with_devices(claim: Obj) -> bool:
    """Whether a webhook that sees this version of a claim admits its pods with devices: Allocated,
    not being deleted or released, replica 0 holding devices."""
    status = claim.get("status") or {}
    allocations = status.get("allocations") or []
    return (
        status.get("phase") == constants.PHASE_ALLOCATED
        and not model.meta(claim).get("deletionTimestamp")
        and not _releasing(claim)
        and bool(allocations)
        and bool(allocations[0].get("devices"))
    )


def _waits_for_the_scheduler(pod: Obj, *, refused: bool = False) -> bool:
    """An un-gated claim pod that kube-scheduler has not bound yet: not refused yet either (or,
    with ``refused``, refused already: tried again when users act)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    return (
        not model.is_gated(pod)
        and not spec.get("nodeName")
        and bool((spec.get("nodeSelector") or {}).get(constants.HOSTNAME_LABEL))
        and status.get("phase") not in model.TERMINAL_PHASES
        and bool(status.get("conditions")) == refused
    )


def _device_env(devices: Sequence[str]) -> Obj:
    """The env entry by which the webhook gives a container the devices of an Allocated claim: a
    value in the pod's spec, which nobody can change once the pod exists (a gated pod of a Pending
    claim reads the devices annotation instead, which the controller writes as it lifts the gate)."""
    return {"name": "CUDA_VISIBLE_DEVICES", "value": ",".join(devices)}


def _draw_quota(rng: random.Random, scenario: Scenario) -> Obj | None:
    """Half the schedules: a GpuQuota in ns-a below the cluster's GPUs, sometimes with a product limit."""
    if rng.random() < 0.5:
        return None
    total = len(scenario.nodes) * scenario.gpus
    spec: Obj = {"gpus": rng.randint(1, total - 1)}
    if rng.random() < 0.3:
        spec["products"] = [{"pattern": "*H100*", "gpus": rng.randint(1, spec["gpus"])}]
    return spec


@dataclasses.dataclass(eq=False)
class Process:
    """One incarnation of a controller process in a slot (``c0``, ``c1``...)."""

    name: str
    controller: Any  # controller.running.Controller (reconciling.Controller before the fix)
    cluster: SimCluster
    feeds: dict[str, model.SimFeed]
    tasks: dict[str, asyncio.Task[None]] = dataclasses.field(default_factory=dict)
    alive: bool = True


@dataclasses.dataclass(eq=False)
class Call:
    """A request a controller sent: applied when the scheduler says, answered maybe later."""

    seq: int
    process: Process
    describe: Callable[[], str]
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    applied: bool = False
    half: bool = False  # the server did the first step of two (``model.Then``); ``fn`` is the second
    outcome: Any = None
    failed: bool = False  # outcome is an exception

    @property
    def op(self) -> str:
        return self.describe()


@dataclasses.dataclass(slots=True)
class Result:
    seed: int
    steps: int
    violation: invariants.Violation | None
    trace: list[str]
    settled: bool
    stats: dict[str, int]


class SimCluster:
    """The controller's ``Cluster``: each call waits for the scheduler, then is applied atomically.

    Each call carries a description for the trace, formatted only when a trace is kept."""

    def __init__(self, sim: Simulation, name: str) -> None:
        self.sim = sim
        self.server = sim.server
        self.name = name
        self.dead = False
        self.process: Process | None = None

    async def _call(
        self, describe: Callable[[], str], fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        if self.dead or self.process is None:  # a crashed process sends nothing more
            raise asyncio.CancelledError
        return await self.sim.submit(self.process, describe, functools.partial(fn, *args, **kwargs))

    def _lease(self, name: str) -> str:
        return self.sim.lease_label(name)

    async def create_lease(self, body: Obj) -> Obj:
        name = str(model.meta(body).get("name", ""))

        def describe() -> str:
            return f"create_lease {self._lease(name)} {invariants.holding_text(dict(body))}"

        result: Obj = await self._call(describe, self.server.create_lease, body)
        return result

    async def get_lease(self, name: str) -> Obj:
        def describe() -> str:
            return f"get_lease {self._lease(name)}"

        result: Obj = await self._call(describe, self.server.get_lease, name)
        return result

    async def delete_lease(self, name: str, *, uid: str, resource_version: str | None = None) -> None:
        def describe() -> str:
            at = "" if resource_version is None else f" rv={resource_version}"
            return f"delete_lease {self._lease(name)} uid={uid}{at}"

        await self._call(describe, self.server.delete_lease, name, uid=uid, resource_version=resource_version)

    async def replace_lease(self, body: Obj) -> Obj:
        m = model.meta(body)

        def describe() -> str:
            finalizers = m.get("finalizers") or []
            return (
                f"replace_lease {self._lease(str(m.get('name')))} rv={m.get('resourceVersion')} {finalizers=}"
                f" {invariants.holding_text(body)}"
            )

        result: Obj = await self._call(describe, self.server.replace_lease, body)
        if len(invariants.holders(result)) > 1:
            self.sim.count("shared_ledgers")  # a PUT that left two or more shares on one GPU
        return result

    async def drop_lease_finalizer(self, name: str, *, uid: str) -> None:
        """Not the controller's any more: the JSON Patch the controller before commit 5c95727
        sent, so that it still runs here and its race shows (README.md)."""

        def describe() -> str:
            return f"patch_lease_finalizers {self._lease(name)} uid={uid}"

        await self._call(describe, self.server.patch_lease_finalizers, name, uid=uid)

    async def get_claim(self, namespace: str, name: str) -> Obj:
        def describe() -> str:
            return f"get_claim {namespace}/{name}"

        result: Obj = await self._call(describe, self.server.get_claim, namespace, name)
        return result

    async def patch_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        def describe() -> str:
            status = self.sim.describe_status(patch)
            return f"patch_claim_status {namespace}/{name} rv={resource_version} {status}"

        result: Obj = await self._call(
            describe,
            self.server.patch_claim_status,
            namespace,
            name,
            patch,
            resource_version=resource_version,
        )
        return result

    async def patch_claim_metadata(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        def describe() -> str:
            return f"patch_claim_metadata {namespace}/{name} rv={resource_version} {patch.get('metadata')}"

        result: Obj = await self._call(
            describe,
            self.server.patch_claim_metadata,
            namespace,
            name,
            patch,
            resource_version=resource_version,
        )
        return result

    async def patch_quota_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        def describe() -> str:
            claims = (patch.get("status") or {}).get("claims") or {}
            entries = {uid: (e or {}).get("gpus") for uid, e in claims.items()}
            return f"patch_quota_status {namespace}/{name} rv={resource_version} claims={entries}"

        result: Obj = await self._call(
            describe,
            self.server.patch_quota_status,
            namespace,
            name,
            patch,
            resource_version=resource_version,
        )
        return result

    async def list_pods(self, namespace: str) -> list[Obj]:
        def describe() -> str:
            return f"list_pods {namespace}"

        result: list[Obj] = await self._call(describe, self.server.list_pods, namespace)
        return result

    async def list_claim_leases(self, uid: str) -> list[Obj]:
        def describe() -> str:
            return f"list_claim_leases {uid}"

        result: list[Obj] = await self._call(describe, self.server.list_claim_leases, uid)
        return result

    async def evict_pod(self, namespace: str, name: str, *, uid: str = "") -> None:
        def describe() -> str:
            return f"evict_pod {namespace}/{name}" + (f" uid={uid}" if uid else "")

        await self._call(describe, functools.partial(self.server.evict_pod, uid=uid), namespace, name)
        if uid:
            self.sim.count("moved_pods")

    async def get_workload(self, namespace: str, api_version: str, resource: str, name: str) -> Obj:
        raise errors.NotFound(message="the simulation has no workloads (no claim draws OnOwnerCompleted)")

    async def patch_pod(self, namespace: str, name: str, operations: Sequence[Mapping[str, Any]]) -> Obj:
        def describe() -> str:
            paths = ",".join(f"{o.get('op')}:{o.get('path')}" for o in operations)
            return f"patch_pod {namespace}/{name} [{paths}]"

        result: Obj = await self._call(describe, self.server.patch_pod, namespace, name, operations)
        return result

    async def emit_event(self, obj: Mapping[str, Any], reason: str, message: str, type_: str) -> None:
        # Best effort and invisible to the controller: no yield point, never raises.
        self.server.emit_event(obj, reason, message, type_)
        if reason == "Reallocated" and message.startswith("moved replica"):
            self.sim.count("healed_claims")


def _short(outcome: Any) -> str:
    if isinstance(outcome, BaseException):
        return type(outcome).__name__
    if isinstance(outcome, dict):
        m = model.meta(outcome)
        parts = [f"rv={m.get('resourceVersion')}"]
        if outcome.get("kind") == "Lease":
            parts.insert(0, f"uid={m.get('uid')} {invariants.holding_text(outcome)}")
        if m.get("deletionTimestamp"):
            parts.append("Terminating")
        return "ok " + " ".join(parts)
    if isinstance(outcome, list):
        return f"ok {len(outcome)} items"
    return "ok"


class Simulation:
    """One schedule: a seed, a scenario, the actors and the trace."""

    def __init__(
        self,
        seed: int,
        *,
        steps: int | None = None,
        keep_trace: bool = True,
        without: frozenset[str] = frozenset(),
    ) -> None:
        unknown = without - ACTIONS
        if unknown:
            raise ValueError(f"unknown actions {sorted(unknown)}; known: {sorted(ACTIONS)}")
        self.without = without
        self.seed = seed
        self.rng = random.Random(seed)
        self.scenario = Scenario.draw(self.rng, steps)
        # The quota of ns-a, from an RNG of its own so that the rest of a schedule is the same with
        # or without it (seeds pinned before quotas existed run with ``without={"quota"}``).
        self.quota = None if "quota" in without else _draw_quota(random.Random(seed ^ 0x5EED), self.scenario)
        # Which claims give their GPUs back when their pods complete (release: OnPodsCompleted), from
        # an RNG of its own for the same reason; ``without={"release"}`` leaves them all OnDelete.
        self._release_rng = None if "release" in without else random.Random(seed ^ 0x2E1EA5E)
        # Which claims move off a lost node (onNodeLoss: Reallocate, a grace of 0-5 s), likewise.
        self._node_loss_rng = None if "reallocate" in without else random.Random(seed ^ 0x10577)
        # Which claims move off a GPU that turned Unhealthy (onDeviceFailure: Reallocate, a grace of
        # 0-3 s), likewise (issue 40).
        self._heal_rng = None if "heal" in without else random.Random(seed ^ 0x4EA1)
        # Claim priorities (0-3 for half of them, so that some preempt others), likewise.
        self._priority_rng = None if "preempt" in without else random.Random(seed ^ 0x9E3779B9)
        # MIG (GPU 0 of n1 in MIG mode in half the schedules; a third of the claims then ask for
        # MIG instances), likewise.
        self._mig_rng = None if "mig" in without else random.Random(seed ^ 0x3160)
        self._mig_gpus: tuple[int, ...] = (
            (0,) if self._mig_rng is not None and self._mig_rng.random() < 0.5 else ()
        )
        # Pods a webhook admits from an out-of-date view of their claim, likewise (the option's
        # presence changes the main RNG's pick: seeds pinned before it run with "stale-pod" off).
        self._stale_rng = None if "stale-pod" in without else random.Random(seed ^ 0x57A1E)
        # Sharing (the last GPU of n0 offered to Shared claims with 2 or 3 slots in half the
        # schedules; a third of the claims then ask for a slot), likewise.
        self._shared_rng = None if "shared" in without else random.Random(seed ^ 0x5A4E)
        self._shared_slots = (
            self._shared_rng.choice((2, 3))
            if self._shared_rng is not None and self._shared_rng.random() < 0.5
            else 0
        )
        # Fractional shares (issue 39: in half the schedules, half the claims that ask for
        # neither MIG nor a slot ask for a milli-GPU share of one GPU instead), likewise.
        self._milli_rng = None if "milli" in without else random.Random(seed ^ 0x3111)
        self._milli = self._milli_rng is not None and self._milli_rng.random() < 0.5
        # A tenant who strips the finalizers of its claim being deleted, in half the schedules (an
        # RNG of its own; the option's presence changes the main RNG's pick, so seeds pinned before
        # it run with "strip-finalizer" off).
        strip_rng = None if "strip-finalizer" in without else random.Random(seed ^ 0x57819)
        self._strip = strip_rng is not None and strip_rng.random() < 0.5
        # Preemption across namespaces (--preemption-scope Cluster) in half the schedules with
        # priorities, likewise.
        scope_rng = None if {"preempt", "preempt-cluster"} & without else random.Random(seed ^ 0xC1A55)
        self.settings = (
            dataclasses.replace(SETTINGS, preemption_scope="Cluster")
            if scope_rng is not None and scope_rng.random() < 0.5
            else SETTINGS
        )
        # Nodes with CPU (4 cores, 110 pod slots) and pods that ask for it: claims state podResources
        # or not, a simulated kube-scheduler binds an un-gated claim pod to the node its nodeSelector
        # names or finds it Unschedulable there, other pods take CPU, and half the claim pods have a
        # Job as owner; in half the schedules, from an RNG of its own (issue 41).
        fit_rng = None if "unplaceable" in without else random.Random(seed ^ 0xF17)
        self._fit_rng = fit_rng if fit_rng is not None and fit_rng.random() < 0.5 else None
        # A third of the claims ask for leastFragmentation instead of binpack or spread, from an RNG
        # of its own (issue 39: the strategy the chart can make the default).
        self._fragmentation_rng = None if "fragmentation" in without else random.Random(seed ^ 0xF6D)
        self.clock = VirtualClock()
        self.server = model.ApiServer(clock=self.clock.now)
        self.calls: list[Call] = []
        self.processes: dict[str, Process] = {}  # slot -> current incarnation
        self.slots: list[str] = []
        self.incarnations: dict[str, int] = {}
        self.trace: list[str] = []
        self.keep_trace = keep_trace
        self.step = 0
        self._seq = 0
        self._pods = 0
        self._labels: dict[str, str] = {}  # uuid and lease name -> "n0/1"
        self._bug: invariants.Violation | None = None
        self._checked_rv = -1
        self.stats: dict[str, int] = {}
        self.settled = False

    # ------------------------------------------------------------------ trace

    def log(self, actor: str, text: str) -> None:
        if self.keep_trace:
            self.trace.append(f"{self.step:4d} {actor:<6} {text}")

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def lease_label(self, name: str) -> str:
        return self._labels.get(name, name)

    def describe_status(self, patch: Mapping[str, Any]) -> str:
        status = patch.get("status") or {}
        parts = []
        if "phase" in status:
            parts.append(f"phase={status['phase']}")
        if "allocations" in status:
            devices = [
                self._labels.get(str(d.get("uuid")), str(d.get("uuid")))
                for a in status.get("allocations") or []
                for d in a.get("devices") or []
            ]
            parts.append(f"devices={devices}")
        conditions = [
            f"{c.get('type')}={c.get('status')}"
            for c in status.get("conditions") or []
            if c.get("type") != constants.CONDITION_ALLOCATED
        ]
        if conditions:
            parts.append(f"conditions={conditions}")
        return " ".join(parts) or "{...}"

    # ------------------------------------------------------------------ calls

    async def submit(self, process: Process, op: Callable[[], str], fn: Callable[[], Any]) -> Any:
        self._seq += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.calls.append(Call(self._seq, process, op, fn, future))
        return await future

    def _apply(self, call: Call) -> None:
        """One server step of ``call``: all of it, or the first of two (``model.Then``)."""
        try:
            outcome = call.fn()
        except errors.KubeError as exc:
            call.outcome, call.failed, call.applied = exc, True, True
            return
        if isinstance(outcome, model.Then):
            call.fn, call.half = outcome.step, True
            return
        call.outcome, call.failed, call.applied = outcome, False, True

    def _apply_fully(self, call: Call) -> None:
        """Every server step of ``call`` now (a request the server goes on with, whatever the client)."""
        while not call.applied:
            self._apply(call)

    def _answer(self, call: Call) -> None:
        self.calls.remove(call)
        if call.future.done():
            return
        if call.failed:
            call.future.set_exception(call.outcome)
        else:
            call.future.set_result(call.outcome)

    # ------------------------------------------------------------------ processes

    def _start(self, slot: str) -> Process:
        n = self.incarnations.get(slot, 0) + 1
        self.incarnations[slot] = n
        name = slot if n == 1 else f"{slot}.{n}"
        feeds = {kind: model.SimFeed(kind) for kind in model.WATCHED}
        cluster = SimCluster(self, name)
        make, takes_now = _controller_class()
        extra: dict[str, Any] = {"now": self.clock.now} if takes_now else {}
        controller = make(
            cluster,
            self.settings,
            _metrics(),
            rng=random.Random(self.rng.getrandbits(32)),
            feeds=feeds,
            **extra,
        )
        process = Process(name, controller, cluster, feeds)
        cluster.process = process
        self.processes[slot] = process
        self.server.subscribe(name)
        for kind in model.WATCHED:
            feeds[kind].relist(self.server.relist(name, kind))
        return process

    def _stop(self, process: Process) -> None:
        process.alive = False
        process.cluster.dead = True
        process.controller.queue.shutdown()
        for task in [*process.tasks.values(), *getattr(process.controller, "_background", ())]:
            task.cancel()
        self.server.unsubscribe(process.name)

    async def _run(self, process: Process, what: str, coro: Awaitable[None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except errors.KubeError as exc:
            if self.keep_trace:
                self.log(process.name, f"{what} ended: {type(exc).__name__}: {exc.message[:80]}")
        except Exception as exc:
            text = "".join(traceback.format_exception(exc)).rstrip()
            self.log(process.name, f"{what} raised {type(exc).__name__}: {exc}")
            if self._bug is None:
                self._bug = invariants.Violation(0, f"{process.name} {what} raised:\n{text}")
        else:
            if self.keep_trace:
                self.log(process.name, f"{what} done")
        finally:
            if process.tasks.get(what.removeprefix("reconcile ")) is asyncio.current_task():
                del process.tasks[what.removeprefix("reconcile ")]

    def _spawn(self, process: Process, key: str) -> None:
        if key == SWEEP:
            what, coro = SWEEP, process.controller.sweep()
        else:
            what, coro = f"reconcile {key}", process.controller.reconcile(key)
        if self.keep_trace:
            self.log(process.name, f"starts {what}")
        task = asyncio.get_running_loop().create_task(self._run(process, what, coro))
        process.tasks[key] = task

    # ------------------------------------------------------------------ running

    async def quiesce(self) -> None:
        """Let the loop run until every task waits for the scheduler (no turn of the loop when none
        has anything to do: a step that woke no task, as most deliveries and user actions)."""
        loop = asyncio.get_running_loop()
        ready = loop._ready  # type: ignore[attr-defined]
        for _ in range(QUIESCE_BOUND):
            if not ready:
                return
            await asyncio.sleep(0)
        raise RuntimeError("the actors never all blocked")

    def check(self) -> None:
        if self._bug is not None:
            raise self._bug
        if self.server.rv == self._checked_rv:
            return  # every change to what the invariants read bumps the resourceVersion
        invariants.check_step(self.server, self._labels)
        self._checked_rv = self.server.rv

    async def run(self) -> Result:
        with virtual_time(self.clock), shared_parses():
            try:
                await self._main()
            except invariants.Violation as violation:
                self.log("sched", f"VIOLATION {violation}")
                return Result(self.seed, self.step, violation, self.trace, self.settled, self.stats)
            except Exception as exc:  # an event handler of the controller (or the simulation) failed
                text = "".join(traceback.format_exception(exc)).rstrip()
                violation = invariants.Violation(0, f"step {self.step} raised:\n{text}")
                self.log("sched", f"VIOLATION {violation}")
                return Result(self.seed, self.step, violation, self.trace, self.settled, self.stats)
            finally:
                await self._teardown()
        return Result(self.seed, self.step, None, self.trace, self.settled, self.stats)

    async def _main(self) -> None:
        sc = self.scenario
        self.log(
            "sched",
            f"seed {self.seed}: nodes {list(sc.nodes)} x {sc.gpus} GPUs, claims {list(sc.claims)}, "
            f"{sc.controllers} controllers, {sc.steps} steps",
        )
        for node in sc.nodes:
            mig = self._mig_gpus if node == "n1" else ()
            shared = {sc.gpus - 1: self._shared_slots} if node == "n0" and self._shared_slots else {}
            allocatable = NODE_ALLOCATABLE if self._fit_rng is not None else None
            self.server.add_gpu_node(node, sc.gpus, mig, shared, allocatable)
            for i in range(sc.gpus):
                uuid = model.gpu_uuid(node, i)
                self._labels[uuid] = self._labels[constants.lease_name(uuid)] = f"{node}/{i}"
                for j, (profile, *_) in enumerate(model.MIG_SPLIT if i in mig else ()):
                    uuid = model.mig_uuid(node, i, j)
                    self._labels[uuid] = self._labels[constants.lease_name(uuid)] = f"{node}/{i}/{profile}"
                for k in range(shared.get(i, 0)):
                    slot = constants.slot_id(model.gpu_uuid(node, i), k)
                    self._labels[slot] = self._labels[constants.lease_name(slot)] = f"{node}/{i}/s{k}"
        if self._mig_gpus:
            self.log("sched", f"n1's GPU {self._mig_gpus[0]} is in MIG mode: {model.MIG_SPLIT}")
        if self._shared_slots:
            self.log("sched", f"n0's GPU {sc.gpus - 1} is shared by time-slicing, {self._shared_slots} slots")
        if self.quota is not None:
            self.server.create_quota("ns-a", "quota", self.quota)
            self.log("sched", f"ns-a has GpuQuota {self.quota}")
        self.slots = [f"c{i}" for i in range(sc.controllers)]
        for slot in self.slots:
            self._start(slot)
        await self.quiesce()
        self.check()
        for self.step in range(1, sc.steps + 1):
            await self._one_step(users=True)
            await self.quiesce()
            self.check()
        await self._settle()

    async def _teardown(self) -> None:
        for process in self.processes.values():
            self._stop(process)
        for call in self.calls:
            if not call.future.done():
                call.future.cancel()
        self.calls.clear()
        tasks = [t for p in self.processes.values() for t in p.tasks.values()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.quiesce()

    # ------------------------------------------------------------------ choosing a step

    def _choices(self, *, users: bool, starts: bool) -> list[tuple[float, Callable[[], Awaitable[None]]]]:
        """The kinds of step possible now, each with its weight and a way to pick one of its kind."""
        rng = self.rng
        options: list[tuple[float, Callable[[], Awaitable[None]]]] = []
        if self.calls:
            applied = [c for c in self.calls if c.applied]
            unapplied = [c for c in self.calls if not c.applied]
            if unapplied:
                options.append((4.0 * len(unapplied), lambda: self._do_apply(rng.choice(unapplied))))
                if users and "fail-call" not in self.without:
                    options.append((0.05 * len(unapplied), lambda: self._do_fail(rng.choice(unapplied))))
            if applied:
                options.append((3.0 * len(applied), lambda: self._do_answer(rng.choice(applied))))
        processes = [self.processes[slot] for slot in self.slots]
        queues = [
            (process, kind)
            for process in processes
            for kind, queue in self.server.watches[process.name].queues.items()
            if queue and kind in model.KINDS
        ]
        if queues:
            options.append((2.0 * len(queues), lambda: self._do_deliver(*rng.choice(queues))))
        if starts:
            for process in processes:
                tasks = process.tasks
                if any(k not in tasks for k in process.feeds["claims"].cache):
                    options.append((3.0, functools.partial(self._do_reconcile_one, process)))
                if SWEEP not in tasks:
                    options.append((0.4, functools.partial(self._do_reconcile, process, SWEEP)))
        waiting = self._waiting_pods()
        if waiting:  # kube-scheduler runs whether users act or not
            options.append((2.0, lambda: self._do_schedule(rng.choice(waiting))))
        if users:
            without = self.without
            if "relist" not in without:
                options.append(
                    (
                        0.1 * len(processes),
                        lambda: self._do_relist(rng.choice(processes), rng.choice(model.KINDS)),
                    )
                )
            if "crash" not in without:
                options.append((0.06 * len(processes), lambda: self._do_crash(rng.choice(self.slots))))
            options.append((3.0, self._do_user))
            if "tick" not in without:
                options.append((0.1, self._do_tick))
        return options

    def _waiting_pods(self) -> list[str]:
        """The un-gated claim pods kube-scheduler has neither bound nor refused yet."""
        if self._fit_rng is None or "schedule-pod" in self.without:
            return []
        return [
            key for key, pod in sorted(self.server.objects["pods"].items()) if _waits_for_the_scheduler(pod)
        ]

    async def _do_schedule(self, key: str) -> None:
        self._schedule_pod(key)

    async def _one_step(self, *, users: bool, starts: bool = True) -> bool:
        options = self._choices(users=users, starts=starts)
        if not options:
            return False
        total = sum(w for w, _ in options)
        pick = self.rng.random() * total
        action = options[-1][1]
        for weight, candidate in options:
            pick -= weight
            if pick < 0:
                action = candidate
                break
        await action()
        return True

    async def _do_reconcile_one(self, process: Process) -> None:
        keys = [k for k in sorted(process.feeds["claims"].cache) if k not in process.tasks]
        await self._do_reconcile(process, self.rng.choice(keys))

    async def _do_apply(self, call: Call) -> None:
        self._apply(call)
        if not call.applied:
            if self.keep_trace:
                self.log(call.process.name, f"{call.op} -> first step applied, the second later")
            self.count("calls")
            return
        later = self.rng.random() < 0.25
        if self.keep_trace:
            self.log(
                call.process.name,
                f"{call.op} -> {_short(call.outcome)}" + (" (answer delayed)" if later else ""),
            )
        self.count("calls")
        if not later:
            self._answer(call)

    async def _do_answer(self, call: Call) -> None:
        if self.keep_trace:
            self.log(call.process.name, f"gets the answer to: {call.op} -> {_short(call.outcome)}")
        self._answer(call)

    async def _do_fail(self, call: Call) -> None:
        applied = call.half or self.rng.random() < 0.5
        if applied:
            self._apply_fully(call)
        if self.keep_trace:
            outcome = "applied: " + _short(call.outcome) if applied else "not applied"
            self.log(call.process.name, f"{call.op} -> 503 Unavailable ({outcome})")
        call.outcome = errors.Unavailable(503, "ServiceUnavailable", "simulated")
        call.failed = True
        self._answer(call)
        self.count("failed_calls")

    async def _do_deliver(self, process: Process, kind: str) -> None:
        """The next watch event of ``kind`` to ``process``; half the time every one queued (a burst:
        the handlers only update indexes and the work queue, so nothing could run in between)."""
        queue = self.server.watches[process.name].queues[kind]
        for _ in range(1 if self.rng.random() < 0.5 else len(queue)):
            type_, obj = queue.popleft()
            if self.keep_trace:
                self.log(process.name, self._describe_event(kind, type_, obj))
            process.feeds[kind].apply(type_, obj)
            self.count("events")
        self._deliver_live_pods(process)

    def _deliver_live_pods(self, process: Process) -> None:
        """Every queued event of the live-pods watch (``model.WATCHED``), with another delivery."""
        queue = self.server.watches[process.name].queues["live_pods"]
        while queue:
            type_, obj = queue.popleft()
            if self.keep_trace:
                self.log(process.name, self._describe_event("live_pods", type_, obj))
            process.feeds["live_pods"].apply(type_, obj)
            self.count("events")

    def _describe_event(self, kind: str, type_: str, obj: Obj) -> str:
        m = model.meta(obj)
        extra = ""
        if kind == "claims":
            status = obj.get("status") or {}
            devices = [self._labels.get(u, u) for u, _, _ in invariants.listed_devices(obj)] + [
                f"{self._labels.get(u, u)}:{milli}m" for u, milli in invariants.listed_shares(obj).items()
            ]
            terminating = " Terminating" if m.get("deletionTimestamp") else ""
            extra = f" {status.get('phase', '-')} {devices}{terminating}"
        elif kind == "leases":
            extra = " " + invariants.holding_text(obj)
        name = self.lease_label(str(m.get("name"))) if kind == "leases" else watching.object_key(obj)
        return f"sees {kind} {type_} {name} rv={m.get('resourceVersion')}{extra}"

    async def _do_relist(self, process: Process, kind: str) -> None:
        self.log(process.name, f"re-lists {kind}")
        process.feeds[kind].relist(self.server.relist(process.name, kind))

    async def _do_reconcile(self, process: Process, key: str) -> None:
        self._spawn(process, key)
        self.count("sweeps" if key == SWEEP else "reconciles")

    async def _do_tick(self) -> None:
        seconds = self.rng.choice((1.0, 5.0, 11.0, 61.0))
        self.clock.advance(seconds)
        self.log("clock", f"+{seconds:g}s")

    async def _do_crash(self, slot: str) -> None:
        process = self.processes[slot]
        for call in [c for c in self.calls if c.process is process]:
            if not call.applied and (call.half or self.rng.random() < 0.5):
                self._apply_fully(call)
                if self.keep_trace:
                    self.log(
                        process.name, f"{call.op} -> {_short(call.outcome)}, the answer lost in the crash"
                    )
            self.calls.remove(call)
        self.log(process.name, "CRASHES")
        self._stop(process)
        await self.quiesce()
        fresh = self._start(slot)
        self.log(fresh.name, "starts with fresh lists")
        self.count("crashes")

    # ------------------------------------------------------------------ users

    async def _do_user(self) -> None:
        server = self.server
        options: list[tuple[str, float, Callable[[], None]]] = []
        claims = server.objects["claims"]
        for key in self.scenario.claims:
            claim = claims.get(key)
            if claim is None:
                options.append(("create-claim", 3.0, functools.partial(self._create_claim, key)))
                continue
            if model.meta(claim).get("deletionTimestamp"):
                if self._strip:
                    options.append(("strip-finalizer", 0.6, functools.partial(self._strip_finalizer, key)))
                continue
            options.append(("delete-claim", 1.2, functools.partial(self._delete_claim, key)))
            phase = (claim.get("status") or {}).get("phase")
            if _releasing(claim):
                continue  # the webhook admits no pod of a claim being released
            more = 2.0 if self._fit_rng is not None else 1.0  # pods for kube-scheduler to place
            if phase == constants.PHASE_ALLOCATED:
                create = functools.partial(self._create_pod, claim, gated=False)
                options.append(("create-pod", 2.0 * more, create))
            elif phase not in (constants.PHASE_FAILED, constants.PHASE_RELEASED, constants.PHASE_PREEMPTED):
                # the webhook refuses those
                options.append(
                    ("gated-pod", 0.5 * more, functools.partial(self._create_pod, claim, gated=True))
                )
        if self._stale_rng is not None:
            for key in self.scenario.claims:
                if any(_admits_with_devices(v) for v in server.claim_history.get(key, ())):
                    options.append(("stale-pod", 1.0, functools.partial(self._create_stale_pod, key)))
        for key, pod in sorted(server.objects["pods"].items()):
            if (pod.get("status") or {}).get("phase") not in model.TERMINAL_PHASES:
                options.append(("finish-pod", 1.0, functools.partial(self._finish_pod, key)))
            options.append(("delete-pod", 0.5, functools.partial(self._delete_pod, key)))
        if self._fit_rng is not None:
            for key, pod in sorted(server.objects["pods"].items()):
                if _waits_for_the_scheduler(pod, refused=True):  # kube-scheduler tries it again
                    options.append(("schedule-pod", 0.5, functools.partial(self._schedule_pod, key)))
            options.append(("cpu-pod", 0.4, self._create_cpu_pod))
        for key in sorted(server.objects["leases"]):
            options.append(("admin-delete-lease", 0.3, functools.partial(self._admin_delete_lease, key)))
        for node in self.scenario.nodes:
            options.append(("flap-node", 0.4, functools.partial(self._flap, node)))
            if self._heal_rng is not None and self._reallocating_gpus(node):
                options.append(("heal", 2.0, functools.partial(self._fail_gpu, node)))
        options = [o for o in options if o[0] not in self.without]
        if not options:
            return
        total = sum(w for _, w, _ in options)
        pick = self.rng.random() * total
        action = options[-1][2]
        for _, weight, candidate in options:
            pick -= weight
            if pick < 0:
                action = candidate
                break
        action()
        self.count("user_actions")

    def _create_claim(self, key: str) -> None:
        namespace, name = key.split("/")
        spec = {
            "devices": {"count": self.rng.randint(1, self.scenario.gpus)},
            "strategy": self.rng.choice(("binpack", "spread")),
            "retryPolicy": {"backoffSeconds": 1, "maxRetries": 0},
        }
        if self._fragmentation_rng is not None and self._fragmentation_rng.random() < 1 / 3:
            spec["strategy"] = "leastFragmentation"
            self.count("fragmentation_claims")
        if self._release_rng is not None and self._release_rng.random() < 0.4:
            spec["release"] = constants.RELEASE_ON_PODS_COMPLETED
        if self._node_loss_rng is not None and self._node_loss_rng.random() < 0.4:
            spec["onNodeLoss"] = constants.NODE_LOSS_REALLOCATE
            spec["nodeLossGracePeriodSeconds"] = self._node_loss_rng.randint(0, 5)
        if self._heal_rng is not None and self._heal_rng.random() < 0.4:
            spec["onDeviceFailure"] = constants.DEVICE_FAILURE_REALLOCATE
            spec["deviceFailureGracePeriodSeconds"] = self._heal_rng.randint(0, 3)
        if self._priority_rng is not None and self._priority_rng.random() < 0.5:
            spec["priority"] = self._priority_rng.randint(0, 3)
        if self._mig_gpus and self._mig_rng is not None and self._mig_rng.random() < 0.35:
            spec["devices"] = {"count": self._mig_rng.randint(1, 2), "exclusivity": "MIG"}
            profile = self._mig_rng.choice(("", "1g.5gb", "3g.20gb"))
            if profile:
                spec["devices"]["migProfile"] = profile
        elif self._shared_slots and self._shared_rng is not None and self._shared_rng.random() < 0.35:
            # At most 1 per GPU fits nowhere; at most the GPU's slots, or any, fits the shared GPU.
            most = self._shared_rng.choice((None, None, self._shared_slots, 1))
            sharing = {} if most is None else {"maxClaimsPerGPU": most}
            spec["devices"] = {"count": 1, "exclusivity": "Shared", "sharing": sharing}
        elif self._milli and self._milli_rng is not None and self._milli_rng.random() < 0.5:
            milli = self._milli_rng.choice((250, 300, 400, 500, 600, 750, 999))
            spec["devices"] = {"count": 1, "exclusivity": "Shared", "sharing": {"milli": milli}}
        if self._fit_rng is not None:
            spec["unschedulableGracePeriodSeconds"] = self._fit_rng.randint(0, 3)
            if self._fit_rng.random() < 0.5:
                spec["podResources"] = {"cpu": str(self._fit_rng.randint(1, 3))}
        obj = self.server.create_claim(namespace, name, spec)
        count = spec["devices"]["count"]  # type: ignore[index]
        release = f", release {spec['release']}" if "release" in spec else ""
        if spec["devices"].get("exclusivity") == "MIG":  # type: ignore[attr-defined]
            release += f", MIG {spec['devices'].get('migProfile') or 'any profile'}"  # type: ignore[attr-defined]
        if spec["devices"].get("exclusivity") == "Shared":  # type: ignore[attr-defined]
            sharing: dict[str, int] = spec["devices"]["sharing"]  # type: ignore[index,assignment]
            if "milli" in sharing:
                release += f", a share of {sharing['milli']} milli-GPU"
            else:
                release += f", Shared (at most {sharing.get('maxClaimsPerGPU', 'any')} per GPU)"
        if "onNodeLoss" in spec:
            release += f", onNodeLoss Reallocate after {spec['nodeLossGracePeriodSeconds']} s"
        if "onDeviceFailure" in spec:
            release += f", onDeviceFailure Reallocate after {spec['deviceFailureGracePeriodSeconds']} s"
        if "priority" in spec:
            release += f", priority {spec['priority']}"
        if "podResources" in spec:
            release += f", pods ask {spec['podResources']['cpu']} CPU"  # type: ignore[index]
        self.log("user", f"creates claim {key} ({model.meta(obj)['uid']}) for {count} GPUs{release}")

    def _delete_claim(self, key: str) -> None:
        namespace, name = key.split("/")
        self.server.delete_claim(namespace, name)
        still = self.server.claim(namespace, name)
        self.log("user", f"deletes claim {key}" + (" (Terminating)" if still is not None else " (gone)"))

    def _strip_finalizer(self, key: str) -> None:
        namespace, name = key.split("/")
        claim = self.server.claim(namespace, name)
        uid = model.meta(claim).get("uid") if claim is not None else None
        if self.server.strip_finalizers(namespace, name):
            self.count("strips")
            self.log("user", f"strips the finalizers of claim {key} ({uid}) being deleted: it is gone")

    def _create_pod(self, claim: Obj, *, gated: bool) -> None:
        m = model.meta(claim)
        self._pods += 1
        name = f"p{self._pods}"
        annotations = {constants.ANNOTATION_CLAIM: m["name"]}
        labels: dict[str, str] = {}
        spec: Obj = {"containers": [{"name": "main", "image": "cuda"}]}
        devices: list[str] = []
        if gated:
            labels[constants.LABEL_GATED] = "true"
            spec["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]
            phase = "Pending"
        else:
            alloc = claim["status"]["allocations"][0]
            devices = [d["uuid"] for d in alloc["devices"]]
            annotations[constants.ANNOTATION_DEVICES] = ",".join(devices)
            spec["containers"][0]["env"] = [_device_env(devices)]
            spec["nodeSelector"] = {constants.HOSTNAME_LABEL: alloc["nodeName"]}
            phase = "Running"
        metadata: Obj = {
            "name": name,
            "namespace": m["namespace"],
            "labels": labels,
            "annotations": annotations,
        }
        if self._fit_rng is not None:
            cpu = str(
                ((claim.get("spec") or {}).get("podResources") or {}).get("cpu")
                or self._fit_rng.randint(1, 2)
            )
            spec["containers"][0]["resources"] = {"requests": {"cpu": cpu}}
            if self._fit_rng.random() < 0.5:
                metadata["ownerReferences"] = [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": "job",
                        "uid": "job-uid",
                        "controller": True,
                    }
                ]
            if not gated:
                phase = "Pending"  # released from the gate onto its claim's node: kube-scheduler's turn
        body = {"metadata": metadata, "spec": spec, "status": {"phase": phase}}
        self.server.create_pod(body, claim_uid=m["uid"])
        shown = [self._labels.get(u, u) for u in devices]
        what = "a gated pod" if gated else f"pod using {shown}"
        self.log("user", f"creates {what} {m['namespace']}/{name} for claim {m['name']} ({m['uid']})")

    def _create_stale_pod(self, key: str) -> None:
        """A webhook whose watch still shows an earlier version of claim ``key`` Allocated admits a
        pod with that version's devices, held at the gate as the webhook holds every claim pod."""
        assert self._stale_rng is not None
        views = [v for v in self.server.claim_history[key] if _admits_with_devices(v)]
        current = self.server.objects["claims"].get(key)
        uid = model.meta(current).get("uid") if current is not None else None
        older = [v for v in views if model.meta(v).get("uid") != uid]
        # Mostly a claim of the name since deleted: the view the bug it guards against needs.
        view = self._stale_rng.choice(older if older and self._stale_rng.random() < 0.7 else views)
        m = model.meta(view)
        alloc = view["status"]["allocations"][0]
        devices = [d["uuid"] for d in alloc["devices"]]
        self._pods += 1
        name = f"p{self._pods}"
        body = {
            "metadata": {
                "name": name,
                "namespace": m["namespace"],
                "labels": {constants.LABEL_GATED: "true"},
                "annotations": {
                    constants.ANNOTATION_CLAIM: m["name"],
                    constants.ANNOTATION_DEVICES: ",".join(devices),
                },
            },
            "spec": {
                "containers": [{"name": "main", "image": "cuda", "env": [_device_env(devices)]}],
                "nodeSelector": {constants.HOSTNAME_LABEL: alloc["nodeName"]},
                "schedulingGates": [{"name": constants.SCHEDULING_GATE}],
            },
            "status": {"phase": "Pending"},
        }
        self.server.create_pod(body, claim_uid=m["uid"])
        self.count("stale_pods")
        shown = [self._labels.get(u, u) for u in devices]
        self.log(
            "user",
            f"a webhook admits gated pod {m['namespace']}/{name} with {shown} from claim {m['name']} "
            f"({m['uid']}) at rv {m['resourceVersion']}",
        )

    def _schedule_pod(self, key: str) -> None:
        """kube-scheduler on an un-gated pod: bound to the node its nodeSelector names when that
        node's CPU takes it, else Unschedulable (once)."""
        pod = self.server.objects["pods"][key]
        node = str(((pod.get("spec") or {}).get("nodeSelector") or {}).get(constants.HOSTNAME_LABEL, ""))
        asked = requests.pod_requests(pod).get("cpu", 0)
        free = 4000 - sum(
            requests.pod_requests(other).get("cpu", 0)
            for other in self.server.objects["pods"].values()
            if (other.get("spec") or {}).get("nodeName") == node
            and (other.get("status") or {}).get("phase") not in model.TERMINAL_PHASES
        )
        if node in self.scenario.nodes and asked <= free:
            self.server.bind_pod(key, node)
            self.count("bound_pods")
            self.log("kube", f"binds pod {key} to {node}")
            return
        if (pod.get("status") or {}).get("conditions"):
            return  # refused already: still refused
        message = f"0/{len(self.scenario.nodes)} nodes are available: 1 Insufficient cpu"
        self.server.refuse_pod(key, message)
        self.count("unschedulable_pods")
        self.log(
            "kube", f"pod {key} is Unschedulable on {node or '(no node)'}: {asked}m CPU asked, {free}m free"
        )

    def _create_cpu_pod(self) -> None:
        """A pod of no claim that takes CPU on a node (a DaemonSet's, another team's)."""
        assert self._fit_rng is not None
        self._pods += 1
        name, node = f"p{self._pods}", self._fit_rng.choice(self.scenario.nodes)
        cpu = str(self._fit_rng.randint(1, 3))
        container = {"name": "main", "image": "cpu", "resources": {"requests": {"cpu": cpu}}}
        body = {
            "metadata": {"name": name, "namespace": "ns-c", "labels": {}, "annotations": {}},
            "spec": {"containers": [container], "nodeName": node},
            "status": {"phase": "Running"},
        }
        self.server.create_pod(body, claim_uid="")
        self.log("user", f"runs pod ns-c/{name} asking {cpu} CPU on {node}")

    def _finish_pod(self, key: str) -> None:
        self.server.set_pod_phase(key, "Succeeded")
        self.log("user", f"pod {key} Succeeded")

    def _delete_pod(self, key: str) -> None:
        self.server.delete_pod(key)
        self.log("user", f"deletes pod {key}")

    def _admin_delete_lease(self, key: str) -> None:
        name = key.split("/", 1)[1]
        lease = self.server.objects["leases"][key]
        holding = invariants.holding_text(lease)
        gone = self.server.admin_delete_lease(name)
        self.log(
            "admin",
            f"deletes Lease {self.lease_label(name)} ({holding})" + (" (gone)" if gone else " (Terminating)"),
        )

    def _flap(self, node: str) -> None:
        status = self.server.objects["node_statuses"][node]["status"]
        ready = any(
            c["type"] == constants.CONDITION_READY and c["status"] == "True" for c in status["conditions"]
        )
        unhealthy = [d["index"] for d in status["devices"] if d["health"] != constants.HEALTHY]
        if self.rng.random() < 0.5:
            ready = not ready
            self.log("node", f"{node} Ready={ready}")
        else:
            index = self.rng.randrange(self.scenario.gpus)
            if index in unhealthy:
                unhealthy.remove(index)
                self.log("node", f"{node}/{index} Healthy")
            else:
                unhealthy.append(index)
                self.log("node", f"{node}/{index} Unhealthy")
        self.server.set_node_status(node, ready=ready, unhealthy=sorted(unhealthy))

    def _fail_gpu(self, node: str) -> None:
        """A GPU of an onDeviceFailure: Reallocate claim turns Unhealthy (its agent saw XID 79)."""
        assert self._heal_rng is not None
        status = self.server.objects["node_statuses"][node]["status"]
        ready = any(
            c["type"] == constants.CONDITION_READY and c["status"] == "True" for c in status["conditions"]
        )
        unhealthy = {d["index"] for d in status["devices"] if d["health"] != constants.HEALTHY}
        index = self._heal_rng.choice(self._reallocating_gpus(node))
        self.log("node", f"{node}/{index} Unhealthy (XID 79 under a Reallocate claim)")
        self.count("failed_gpus")
        self.server.set_node_status(node, ready=ready, unhealthy=sorted(unhealthy | {index}))

    def _reallocating_gpus(self, node: str) -> list[int]:
        """The indices of ``node``'s GPUs that onDeviceFailure: Reallocate claims list (issue 40:
        failing one of them is what the healing path is for)."""
        return sorted(
            {
                index
                for claim in self.server.objects["claims"].values()
                if (claim.get("spec") or {}).get("onDeviceFailure") == constants.DEVICE_FAILURE_REALLOCATE
                for _, on, index in invariants.listed_devices(claim)
                if on == node and index >= 0
            }
        )

    # ------------------------------------------------------------------ settling

    async def _drain(self) -> None:
        """Apply and answer every call and deliver every event, in a seeded order, until none is left."""
        for _ in range(DRAIN_BOUND):
            self.step += 1
            if not await self._one_step(users=False, starts=False):
                self.step -= 1
                if not any(w.queues["live_pods"] for w in self.server.watches.values()):
                    return
                for process in list(self.processes.values()):
                    self._deliver_live_pods(process)
            await self.quiesce()
            self.check()
        raise invariants.Violation(0, f"the cluster never quietened ({DRAIN_BOUND} steps of draining)")

    async def _settle(self) -> None:
        """Users stop; every controller reconciles every key and sweeps until nothing changes."""
        self.log("sched", "users stop; settling")
        self.clock.advance(61.0)  # expectations, grace periods and backoffs run out
        await self._drain()
        for round_ in range(SETTLE_ROUNDS):
            if round_ == 1 and self._fit_rng is not None:
                self.clock.advance(4.0)  # past the grace of the pods kube-scheduler refused in round 0
            before = self.server.rv
            together = round_ == 0  # the first round concurrently, then one process at a time
            groups = [list(self.processes.values())] if together else [[p] for p in self.processes.values()]
            for group in groups:
                for process in group:
                    for key in sorted(process.feeds["claims"].cache):
                        if key not in process.tasks:
                            self._spawn(process, key)
                    if SWEEP not in process.tasks:
                        self._spawn(process, SWEEP)
                await self.quiesce()
                await self._drain()
            if self.server.rv == before:
                self.settled = True
                break
        self.log("sched", "settled" if self.settled else f"still changing after {SETTLE_ROUNDS} rounds")
        self.count("settled" if self.settled else "unsettled")
        invariants.check_settled(self.server)
        if self._fit_rng is not None:
            invariants.check_placed(self.server, now=self.clock.now())


async def run_schedule(
    seed: int, *, steps: int | None = None, keep_trace: bool = True, without: frozenset[str] = frozenset()
) -> Result:
    return await Simulation(seed, steps=steps, keep_trace=keep_trace, without=without).run()


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """The controller's logs off meanwhile (the trace says what happened), restored afterwards."""
    loggers = [logging.getLogger(name) for name in ("controller", "gpualloc")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class Runner:
    """Runs schedules one after another on one event loop (a loop per schedule costs more)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(
        self,
        seed: int,
        *,
        steps: int | None = None,
        keep_trace: bool = True,
        without: frozenset[str] = frozenset(),
    ) -> Result:
        with quiet_logs():
            return self.loop.run_until_complete(
                run_schedule(seed, steps=steps, keep_trace=keep_trace, without=without)
            )

    def close(self) -> None:
        self.loop.close()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- exploring many seeds

_RUNNER: Runner | None = None


@dataclasses.dataclass(slots=True)
class Batch:
    """What exploring a range of seeds found: how many ran, the first violating seed, counters."""

    schedules: int
    violation: tuple[int, str] | None
    stats: dict[str, int]


def explore(first: int, count: int, steps: int | None = None, without: frozenset[str] = frozenset()) -> Batch:
    """Run seeds ``first .. first+count-1`` without traces; stop at the first violation."""
    global _RUNNER
    if _RUNNER is None:
        _RUNNER = Runner()
    stats: dict[str, int] = {}
    for seed in range(first, first + count):
        result = _RUNNER.run(seed, steps=steps, keep_trace=False, without=without)
        for what, n in result.stats.items():
            stats[what] = stats.get(what, 0) + n
        stats["steps"] = stats.get("steps", 0) + result.steps
        if result.violation is not None:
            return Batch(seed - first + 1, (seed, str(result.violation)), stats)
    return Batch(count, None, stats)


def explore_range(args: tuple[int, int, int | None, frozenset[str]]) -> Batch:
    """``explore(*args)``, for ``Pool.imap_unordered`` (a worker finds it by this module's name)."""
    return explore(*args)
