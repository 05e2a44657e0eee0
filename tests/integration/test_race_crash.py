"""Controllers race over 300 claims on 20 nodes against the real API server, under faults.

Sixteen nodes have 8 whole GPUs each; two have a GPU in MIG mode (the a100-mig profile) and
two share their 4 GPUs by time-slicing, 3 slots each. Most claims ask for whole GPUs, some
for a MIG instance, some for one or two shared slots, some for a milli-GPU share of a whole
GPU (``sharing.milli``, issue 39), so the four kinds race on one API server and one
controller state. A third of them ask for ``leastFragmentation``, the rest ``binpack``.

Three controllers run without leader election (they really compete: only the
Leases keep them honest) and a pair with it (one leads, one stands by). For
``CHAOS_S`` seconds, while claims are created, and Allocated ones deleted and
replaced (churn), the run's seed chooses when these faults strike:

a. a racer is SIGKILLed and restarted (twice);
b. kube-apiserver is restarted on the same port (clients reconnect);
c. each controller reaches the API server through its own toxiproxy listener,
   which in turn adds latency and jitter, black-holes data (``timeout``),
   resets connections (``reset_peer``) or closes and refuses them (the proxy
   disabled) for a while;
d. the elected leader is SIGSTOPped past its lease; once the standby has taken
   over, it is SIGCONTed: it may write before it notices, and must then stop
   (exit 1: a supervisor would restart it as a standby, and the test does).
   An elected controller that loses its lease by other faults is restarted too.

Safety is checked from a watch of claims and Leases (``chaos_support.Mirror``)
after every event, at one revision at a time:

* no two claims list the same GPU, MIG instance or slot, no GPU is listed whole
  while another claim lists an instance, a slot or a share of it, the shares of
  a GPU listed and those its Lease's ledger holds add up to at most 1000, and
  every device an Allocated claim lists has its Lease (Terminating or not) held
  by that claim's UID, whole or by a ledger entry (a claim being deleted
  releases its Leases first: ``chaos_support.Books`` says how it counts);

and once the faults are healed and the controllers have settled (liveness):

* every claim holds exactly the Leases of its status (Allocated) or none
  (Pending), and no Pending claim would fit in the GPUs left free;
* after every claim is deleted, the finalizers and the sweep leave no Lease.

On failure the seed, the fault timeline and where the logs are come with the
error. ``GPUALLOC_RACE_RUNS=N`` repeats the scenario N times (default 2,
different seeds); ``GPUALLOC_RACE_SEED`` shifts the seeds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from controller.nodes import in_mig_mode
from gpualloc.api import codecs, constants, models
from gpualloc.api import leases as lease_format
from gpualloc.devcluster import binaries
from gpualloc.kube import errors, leases, resources, transport
from gpualloc.kube.client import Api
from tests.integration.chaos_support import (
    Books,
    Mirror,
    Timeline,
    Toxiproxy,
    all_of,
    consistent_snapshot,
    proxied_kubeconfig,
    recorded,
    share_ledger,
    silicon_of,
    until_available,
)
from tests.integration.controller_support import (
    RUN_LABEL,
    claim_body,
    create_gpu_node,
    delete_gpu_node,
    publish_simulated_node,
    simulated_inventory,
)

RUNS = int(os.environ.get("GPUALLOC_RACE_RUNS", "2"))
BASE_SEED = int(os.environ.get("GPUALLOC_RACE_SEED", "0"))
NODES = 20
MIG_NODES, SHARED_NODES = 2, 2  # the last four nodes
SHARING = models.DeviceSharing(strategy="TimeSlicing", replicas=3)
CLAIMS = 300
SIZES = (1, 2, 4, 8)
MILLI_SHARES = (250, 300, 400, 500, 750)  # sharing.milli of the fractional claims
RACERS = 3  # slots 0..2, without leader election
ELECTORS = 2  # slots 3 and 4, with it
CHAOS_S = 30.0
APISERVER_STOP_S = 3.0  # SIGTERM, then SIGKILL: watches keep a terminating API server alive
# Liveness bounds, counted from the end of the faults (settling) and from the deletion of every claim
# (releasing): no progress for the first, or not done after the second. A claim's error backoff
# reaches 60 s after many failed attempts (workers.BACKOFF_CAP), so "stuck" means longer.
SETTLE_STALL, SETTLE_WITHIN = 90.0, 300.0
RELEASE_STALL, RELEASE_WITHIN = 90.0, 180.0
LEASE_DURATION = 5.0
RENEW_DEADLINE = 3.5
RETRY_PERIOD = 0.5
ELECTION_ID = "gpualloc-controller"
EXIT_LOST_LEADERSHIP = 1
STARTING_S = 30.0  # how long stop_all waits for a just-restarted controller to catch SIGTERM
GPUALLOC = Path(sys.executable).with_name("gpualloc")


@dataclasses.dataclass
class Slot:
    index: int
    elect: bool
    kubeconfig: Path
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    held_down: bool = False  # killed on purpose, to be restarted by the fault itself
    paused: bool = False

    @property
    def identity(self) -> str:
        return f"{'elect' if self.elect else 'racer'}-{self.index}-{self.starts}"


def _catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler installed (its ``SigCgt`` mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True  # gone already
    caught = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


class Controllers:
    """The controller processes (racers and the elected pair), their logs in ``logs``."""

    def __init__(
        self, kubeconfigs: list[Path], namespace: str, logs: Path, run: str, timeline: Timeline
    ) -> None:
        self.namespace = namespace
        self.logs = logs
        self.run = run
        self.timeline = timeline
        self.slots = [Slot(i, i >= RACERS, kubeconfig) for i, kubeconfig in enumerate(kubeconfigs)]
        self.lost_leadership = collections.Counter[str]()  # identity -> exits with code 1
        self.unexpected: list[str] = []

    def start(self, index: int) -> None:
        slot = self.slots[index]
        slot.starts += 1
        argv = [
            str(GPUALLOC),
            "controller",
            "--kubeconfig",
            str(slot.kubeconfig),
            "--namespace",
            self.namespace,
            "--health-port",
            "0",
            "--metrics-port",
            "0",
            "--sweep-interval",
            "3",
            # The nodes' GpuNodeStatuses are written once, with no agent to renew the heartbeat: a
            # run slower than the default 120 s (a loaded machine) must not see every node go stale.
            "--node-stale-after",
            "3600",
            # Preemption is tested on its own (test_preemption.py, the simulation): here, among 290
            # claims of drawn priorities on 160 GPUs, it turns settling into minutes of cascades.
            "--preemption-scope",
            "None",
            "--identity",
            slot.identity,
            "--claim-selector",
            f"{RUN_LABEL}={self.run}",
        ]
        if slot.elect:
            argv += [
                "--leader-elect=true",
                "--leader-election-id",
                ELECTION_ID,
                "--leader-election-lease-duration",
                str(LEASE_DURATION),
                "--leader-election-renew-deadline",
                str(RENEW_DEADLINE),
                "--leader-election-retry-period",
                str(RETRY_PERIOD),
            ]
        else:
            argv.append("--leader-elect=false")
        with open(self.logs / f"controller-{slot.identity}.log", "wb") as log:
            slot.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        slot.paused = False

    def signal(self, index: int, sig: signal.Signals) -> None:
        slot = self.slots[index]
        if slot.proc is not None and slot.proc.poll() is None:
            slot.proc.send_signal(sig)
        if sig == signal.SIGSTOP:
            slot.paused = True
        elif sig == signal.SIGCONT:
            slot.paused = False

    def slot_of(self, identity: str) -> Slot | None:
        return next((s for s in self.slots if s.identity == identity and s.proc is not None), None)

    def reap(self) -> None:
        """Restart controllers that exited on their own, as a Deployment would; note why."""
        for slot in self.slots:
            if slot.held_down or slot.proc is None or slot.proc.poll() is None:
                continue
            code = slot.proc.returncode
            if slot.elect and code == EXIT_LOST_LEADERSHIP:
                self.lost_leadership[slot.identity] += 1
                self.timeline.note(f"{slot.identity} lost its leadership and exited 1; restarting it")
            else:
                self.unexpected.append(f"{slot.identity} exited {code}")
                self.timeline.note(f"UNEXPECTED: {slot.identity} exited {code}; restarting it")
            self.start(slot.index)

    async def supervise(self) -> None:
        while True:
            self.reap()
            await asyncio.sleep(0.2)

    def stop_all(self) -> dict[str, int]:
        """SIGCONT the paused, SIGTERM every one once it catches SIGTERM; identity -> exit status.

        A controller restarted just before the end (one that lost its leadership, say) may still be
        starting: SIGTERM would end it before its handler is installed (exit -15), which says
        nothing about how it stops. So each is given up to ``STARTING_S`` to install it."""
        live = [slot.proc for slot in self.slots if slot.proc is not None and slot.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + STARTING_S
        for proc in live:
            while proc.poll() is None and not _catches_sigterm(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes: dict[str, int] = {}
        for slot in self.slots:
            if slot.proc is None:
                continue
            try:
                codes[slot.identity] = slot.proc.wait(20)
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                codes[slot.identity] = slot.proc.wait(10)
        return codes

    def believes_it_leads(self, identity: str) -> bool:
        """Whether ``identity`` logged that it leads (one that loses its leadership exits).

        The election Lease may name a candidate that does not know it: its acquire
        was written, but the answer was lost (a reset connection, a timeout), so it
        still campaigns, and leads only if its next attempt finds itself the holder.
        """
        text = (self.logs / f"controller-{identity}.log").read_bytes()
        return b'"msg": "became leader"' in text

    def tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.logs.glob("controller-*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)


@dataclasses.dataclass(frozen=True)
class Fault:
    at: float  # seconds after the chaos starts
    kind: str  # sigkill | apiserver | overlap | latency | timeout | reset_peer | cut
    slot: int = -1
    duration: float = 0.0
    attributes: tuple[tuple[str, int], ...] = ()
    stream: str = "downstream"

    def describe(self) -> str:
        where = f" slot {self.slot}" if self.slot >= 0 else ""
        attrs = f" {dict(self.attributes)}" if self.attributes else ""
        span = f" for {self.duration:.1f} s" if self.duration else ""
        return f"{self.kind}{where}{attrs}{span}"


def plan_faults(rng: random.Random) -> list[Fault]:
    """The run's faults, drawn from its seed; none lasts past ``CHAOS_S``."""
    plan = [
        Fault(
            at=rng.uniform(2, CHAOS_S - 5),
            kind="sigkill",
            slot=rng.randrange(RACERS),
            duration=rng.uniform(0.2, 2),
        )
        for _ in range(2)
    ]
    # Early: under load a restart takes 15-30 s to be ready, and the chaos lasts until it is.
    plan.append(Fault(at=rng.uniform(0.1, 0.4) * CHAOS_S, kind="apiserver"))
    plan.append(Fault(at=rng.uniform(6, CHAOS_S - 16), kind="overlap", duration=rng.uniform(0.5, 3)))
    for slot in range(RACERS + ELECTORS):
        at = rng.uniform(0, 5)
        while True:
            kind = rng.choice(("latency", "latency", "timeout", "reset_peer", "cut"))
            if kind == "latency":
                fault = Fault(
                    at=at,
                    kind=kind,
                    slot=slot,
                    duration=rng.uniform(3, 10),
                    attributes=(("latency", rng.randint(20, 300)), ("jitter", rng.randint(0, 150))),
                )
            elif kind == "timeout":
                fault = Fault(
                    at=at,
                    kind=kind,
                    slot=slot,
                    duration=rng.uniform(1, 5),
                    attributes=(("timeout", rng.choice((0, rng.randint(200, 3000)))),),
                    stream=rng.choice(("upstream", "downstream")),
                )
            elif kind == "reset_peer":
                fault = Fault(
                    at=at,
                    kind=kind,
                    slot=slot,
                    duration=rng.uniform(1, 3),
                    attributes=(("timeout", rng.randint(0, 500)),),
                )
            else:
                fault = Fault(at=at, kind=kind, slot=slot, duration=rng.uniform(1, 6))
            if fault.at + fault.duration > CHAOS_S - 1:
                break
            plan.append(fault)
            at = fault.at + fault.duration + rng.uniform(2, 8)
    return sorted(plan, key=lambda f: f.at)


@dataclasses.dataclass
class Chaos:
    """Carries out a plan of faults against the controllers, the proxies and the API server."""

    control_plane: Any
    api: Api
    namespace: str
    controllers: Controllers
    toxiproxy: Toxiproxy
    timeline: Timeline
    overlaps: list[dict[str, Any]] = dataclasses.field(default_factory=list, init=False)
    _toxics: int = dataclasses.field(default=0, init=False)
    # One SIGKILL at a time per slot: two would race to restart it.
    _killing: dict[int, asyncio.Lock] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(asyncio.Lock), init=False
    )

    async def run(self, plan: list[Fault], started: float) -> None:
        async def at(fault: Fault) -> None:
            await asyncio.sleep(max(0.0, started + fault.at - time.monotonic()))
            await self.strike(fault)

        await all_of(*(at(fault) for fault in plan))

    async def strike(self, fault: Fault) -> None:
        if fault.kind == "sigkill":
            await self.sigkill(fault)
        elif fault.kind == "apiserver":
            await self.restart_apiserver()
        elif fault.kind == "overlap":
            await self.overlap(fault)
        else:
            await self.network(fault)

    async def sigkill(self, fault: Fault) -> None:
        slot = self.controllers.slots[fault.slot]
        async with self._killing[fault.slot]:
            await self._sigkill(slot, fault)

    async def _sigkill(self, slot: Slot, fault: Fault) -> None:
        if slot.proc is None:
            return
        slot.held_down = True
        try:
            slot.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(slot.proc.wait, 10)
            self.timeline.note(f"SIGKILLed {slot.identity}; restarting it in {fault.duration:.1f} s")
            await asyncio.sleep(fault.duration)
            self.controllers.start(slot.index)
            self.timeline.note(f"started {slot.identity}")
        finally:
            slot.held_down = False

    async def restart_apiserver(self) -> None:
        self.timeline.note("restarting kube-apiserver")
        began = time.monotonic()
        await asyncio.to_thread(self.control_plane.restart_apiserver, stop_timeout=APISERVER_STOP_S)
        ready = time.monotonic() - began
        # /readyz comes before the custom resources are served again.
        await until_available(lambda: resources.CustomResources(self.api).list_claims(self.namespace))
        for path in (
            f"/apis/{constants.GROUP}/{constants.VERSION}/{constants.NODE_STATUS_PLURAL}",
            f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases",
        ):
            await until_available(
                functools.partial(transport.request, self.api, "GET", path, query=[("limit", "1")])
            )
        serving = time.monotonic() - began
        self.timeline.note(
            f"kube-apiserver ready again after {ready:.1f} s, serving claims after {serving:.1f} s"
        )

    async def election_holder(self) -> str:
        try:
            lease = await leases.get_lease(self.api, self.namespace, ELECTION_ID)
        except errors.KubeError:
            return ""
        return str((lease.get("spec") or {}).get("holderIdentity") or "")

    async def overlap(self, fault: Fault) -> None:
        """SIGSTOP the leader past its lease; SIGCONT it once the standby leads."""
        outcome: dict[str, Any] = {}
        self.overlaps.append(outcome)
        deadline = time.monotonic() + 30  # on a loaded machine the first election can take that long
        while True:
            holder = await self.election_holder()
            leader = self.controllers.slot_of(holder)
            if leader is not None and leader.proc is not None and leader.proc.poll() is None:
                break
            if time.monotonic() > deadline:
                outcome["skipped"] = f"no running leader to stop (election Lease holder {holder!r})"
                self.timeline.note(f"overlap: {outcome['skipped']}")
                return
            await asyncio.sleep(0.2)
        proc = leader.proc
        outcome["stopped"] = leader.identity
        self.controllers.signal(leader.index, signal.SIGSTOP)
        stopped_at = time.monotonic()
        # Read after the stop: the process cannot log anything more until SIGCONT.
        outcome["believed_leading"] = self.controllers.believes_it_leads(leader.identity)
        self.timeline.note(
            f"overlap: SIGSTOPped the leader {leader.identity}"
            + (
                ""
                if outcome["believed_leading"]
                else " (named by the Lease, but it has not logged that it leads)"
            )
        )
        try:
            successor = ""
            give_up = stopped_at + LEASE_DURATION + 20
            while time.monotonic() < give_up:
                holder = await self.election_holder()
                if holder and holder != outcome["stopped"]:
                    successor = holder
                    break
                await asyncio.sleep(0.2)
            if successor:
                outcome["successor"] = successor
                self.timeline.note(f"overlap: {successor} leads after {time.monotonic() - stopped_at:.1f} s")
                await asyncio.sleep(fault.duration)
            else:
                self.timeline.note("overlap: nobody took over while the leader was stopped")
        finally:
            self.controllers.signal(leader.index, signal.SIGCONT)
        self.timeline.note(
            f"overlap: SIGCONTed {outcome['stopped']} after {time.monotonic() - stopped_at:.1f} s"
        )
        resumed = time.monotonic()
        audit_offset = audit_size(self.control_plane.audit_log)
        while proc.poll() is None:
            if time.monotonic() - resumed > 30:
                outcome["exit"] = None
                self.timeline.note(f"overlap: {outcome['stopped']} still runs 30 s after SIGCONT")
                return
            await asyncio.sleep(0.1)
        outcome["exit"] = proc.returncode
        outcome["exit_s_after_cont"] = round(time.monotonic() - resumed, 1)
        outcome["writes_after_cont"] = await asyncio.to_thread(
            audited_writes, self.control_plane.audit_log, audit_offset, outcome["stopped"]
        )
        self.timeline.note(
            f"overlap: {outcome['stopped']} exited {proc.returncode} {outcome['exit_s_after_cont']} s after"
            f" SIGCONT; its writes meanwhile: {outcome['writes_after_cont'] or 'none'}"
        )

    async def network(self, fault: Fault) -> None:
        proxy = f"controller-{fault.slot}"
        who = self.controllers.slots[fault.slot].identity
        self._toxics += 1
        name = f"{fault.kind}-{self._toxics}"
        attributes = dict(fault.attributes)
        if fault.kind == "cut":
            await self.toxiproxy.set_enabled(proxy, False)
        elif fault.kind == "latency":
            await self.toxiproxy.add_toxic(proxy, name, "latency", attributes, stream="downstream")
            await self.toxiproxy.add_toxic(proxy, name + "-up", "latency", attributes, stream="upstream")
        else:
            await self.toxiproxy.add_toxic(proxy, name, fault.kind, attributes, stream=fault.stream)
        self.timeline.note(f"network: {fault.describe()} ({who}, {fault.stream})")
        await asyncio.sleep(fault.duration)
        if fault.kind == "cut":
            await self.toxiproxy.set_enabled(proxy, True)
        else:
            for toxic in (name, name + "-up") if fault.kind == "latency" else (name,):
                try:
                    await self.toxiproxy.remove_toxic(proxy, toxic)
                except TimeoutError:
                    # toxiproxy can hang removing a toxic while a connection it delays is not read
                    # (Shopify/toxiproxy#558, open): the fault lasts longer, until the reset at the end.
                    self.timeline.note(f"network: toxiproxy did not remove {toxic} within 10 s; it stays")
                    return
        self.timeline.note(f"network: {fault.kind} on slot {fault.slot} over")


def audit_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def audited_writes(path: Path, offset: int, identity: str) -> dict[str, int]:
    """Writes the controller ``identity`` made (by the audit log, from byte ``offset``):
    ``"<verb> <resource> <code>"`` -> count."""
    agent = f"gpualloc-controller/{identity}"
    writes: collections.Counter[str] = collections.Counter()
    try:
        with path.open("rb") as log:
            log.seek(offset)
            lines = log.read().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("userAgent") != agent or event.get("stage") != "ResponseComplete":
            continue
        verb = event.get("verb")
        if verb not in ("create", "update", "patch", "delete"):
            continue
        ref = event.get("objectRef") or {}
        resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        writes[f"{verb} {resource} {(event.get('responseStatus') or {}).get('code')}"] += 1
    return dict(writes)


def room(inventory: models.NodeInventory, held: set[str], shared: dict[str, int]) -> dict[str, int]:
    """What a node has free, by the claim kind that could use it, with ``held`` the device Lease
    names that exist and ``shared`` what their share ledgers hold (Lease name -> milli-GPU): whole
    GPUs, MIG instances, shared GPUs with a free slot, and the most milli-GPU one GPU has left."""

    def free(lock_id: str) -> bool:
        return constants.lease_name(lock_id) not in held

    out = {"Exclusive": 0, "MIG": 0, "Shared": 0, "milli": 0}
    for device in inventory.devices:
        name = constants.lease_name(device.uuid)
        whole_gpu = device.health == constants.HEALTHY and not device.shared and not in_mig_mode(device)
        if whole_gpu and (free(device.uuid) or name in shared):
            out["milli"] = max(out["milli"], lease_format.WHOLE_MILLI - shared.get(name, 0))
        if device.health != constants.HEALTHY or not free(device.uuid):
            continue
        if device.mig is not None and device.mig.enabled:
            out["MIG"] += sum(1 for m in device.mig.devices if free(m.uuid))
        elif device.shared:
            out["Shared"] += any(free(slot) for slot in device.slot_ids)
        elif all(free(lock_id) for lock_id in device.lock_ids):
            out["Exclusive"] += 1
    return out


def settled_problems(
    claims: list[dict[str, Any]], leases: list[dict[str, Any]], inventories: dict[str, models.NodeInventory]
) -> list[str]:
    """Why the system has not settled yet (empty once it has)."""
    problems: list[str] = []
    held: dict[str, set[str]] = collections.defaultdict(set)
    shared: dict[str, int] = {}  # a share ledger's name -> the milli-GPU its entries hold
    for lease in leases:
        ledger = share_ledger(lease)
        for holder in ledger if ledger is not None else [str(lease["spec"].get("holderIdentity"))]:
            held[holder].add(lease["metadata"]["name"])
        if ledger is not None:
            shared[lease["metadata"]["name"]] = sum(ledger.values())
    names = {lease["metadata"]["name"] for lease in leases}
    free = {node: room(inventory, names, shared) for node, inventory in inventories.items()}
    uids = set()
    for claim in claims:
        uid = claim["metadata"]["uid"]
        uids.add(uid)
        name = claim["metadata"]["name"]
        status = claim.get("status") or {}
        mine = held.get(uid, set())
        want = {constants.lease_name(u) for u in recorded(claim)}
        if claim["metadata"].get("deletionTimestamp"):
            problems.append(f"{name} is still being deleted")
        if mine != want:
            problems.append(f"{name} holds {len(mine)} leases, status lists {len(want)}")
        if not status.get("phase"):
            problems.append(f"{name} has no phase yet")
        elif status["phase"] == constants.PHASE_PREEMPTED and want:
            problems.append(f"{name} is Preempted and still lists {len(want)} GPUs")
        elif status["phase"] == constants.PHASE_PENDING:
            count = claim["spec"]["devices"]["count"]
            kind = claim["spec"]["devices"].get("exclusivity", "Exclusive")
            milli = (claim["spec"]["devices"].get("sharing") or {}).get("milli")
            if milli:
                kind, count = "milli", milli
            roomy = [n for n, f in free.items() if f[kind] >= count]
            if roomy:
                problems.append(
                    f"{name} ({count} {kind}) is Pending while {roomy[0]} has {free[roomy[0]][kind]} free"
                )
    for holder in held.keys() - uids:
        problems.append(f"leases held by vanished claim {holder}")
    return problems


async def churn(
    api: Api,
    namespace: str,
    tag: str,
    mirror: Mirror,
    timeline: Timeline,
    rng: random.Random,
    counts: Any,
) -> None:
    """Until ``CHAOS_S``: now and then delete an Allocated claim and create a new one, so that
    GPUs are released and taken again while the faults strike."""
    crs = resources.CustomResources(api)
    gone: set[str] = set()
    end = time.monotonic() + CHAOS_S - 3
    await asyncio.sleep(3)
    while time.monotonic() < end:
        await asyncio.sleep(rng.uniform(0.3, 1.0))
        allocated = mirror.books.allocated()
        pick = rng.random()
        size = rng.choice(SIZES)
        if allocated:
            key = allocated[int(pick * len(allocated))]
            name = key.split("/", 1)[1]
            # NotFound: an earlier try landed and its answer was lost (the API server restarting),
            # or the mirror had not seen an earlier delete yet. Either way the claim is gone.
            with contextlib.suppress(errors.NotFound):
                await until_available(functools.partial(crs.delete_claim, namespace, name))
            gone.add(name)
            counts["deleted"] = len(gone)
        name = f"n{counts['created']:03d}"
        body = claim_body(name, size, run=tag)
        with contextlib.suppress(errors.AlreadyExists):  # a retried create that had landed
            await until_available(functools.partial(crs.create_claim, namespace, body))
        counts["created"] += 1
    timeline.note(f"churn over: {counts['deleted']} claims deleted, {counts['created']} created")


async def wait_until_done(
    what: str, probe: Callable[[], Awaitable[list[str]]], mirror: Mirror, *, stall: float, within: float
) -> int:
    """Poll ``probe`` (the problems left) every second until it finds none; the number of polls.

    Fails on a safety violation, when the problems have not become fewer for ``stall`` seconds
    (stuck), or after ``within`` seconds in all. A slow machine only slows it down. Every 10
    polls the timeline notes what is left.
    """
    began = improved = time.monotonic()
    fewest = -1
    polls = 0
    while True:
        polls += 1
        mirror.check_now()
        assert not mirror.violations, "safety violated:\n" + "\n".join(mirror.violations[:20])
        problems = await probe()
        if not problems:
            return polls
        now = time.monotonic()
        if fewest < 0 or len(problems) < fewest:
            fewest, improved = len(problems), now
        assert now - improved < stall and now - began < within, (
            f"{what}: not done after {now - began:.0f} s, no progress for {now - improved:.0f} s"
            f" ({len(problems)} left): {problems[:10]}"
        )
        if polls % 10 == 0:
            mirror.timeline.note(
                f"{what}: {len(problems)} left after {now - began:.0f} s, e.g. {problems[0]}"
            )
        await asyncio.sleep(1.0)


@pytest.mark.parametrize("run", range(RUNS))
async def test_racing_controllers_under_faults_never_double_book(
    control_plane: Any, api: Api, kubeconfig: str, namespace: str, tmp_path: Path, run: int
) -> None:
    seed = BASE_SEED + run
    timeline = Timeline()
    plan = plan_faults(random.Random(seed))
    timeline.note(
        f"seed {seed}; {len(plan)} faults planned: " + "; ".join(f"{f.at:.1f} s {f.describe()}" for f in plan)
    )
    try:
        await race(control_plane, api, Path(kubeconfig), namespace, tmp_path, seed, plan, timeline)
    except BaseException as exc:
        (tmp_path / "timeline.txt").write_text(timeline.render() + "\n")
        exc.add_note(
            f"race run {run}, seed {seed} (GPUALLOC_RACE_SEED={seed} GPUALLOC_RACE_RUNS=1 repeats it); "
            f"logs in {tmp_path} (API server's: {control_plane.logs_dir}, audit: {control_plane.audit_log})\n"
            f"timeline:\n{timeline.render()}"
        )
        raise


async def race(
    control_plane: Any,
    api: Api,
    kubeconfig: Path,
    namespace: str,
    logs: Path,
    seed: int,
    plan: list[Fault],
    timeline: Timeline,
) -> None:
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:8]
    nodes = [f"race-{tag}-{i:02d}" for i in range(NODES)]
    crs = resources.CustomResources(api)
    whole = nodes[: NODES - MIG_NODES - SHARED_NODES]
    mig, shared = nodes[len(whole) : len(whole) + MIG_NODES], nodes[len(whole) + MIG_NODES :]
    published = {n: simulated_inventory(n, "a100-mig") for n in mig}
    published.update({n: simulated_inventory(n, "a100-pcie-4-nvlink", SHARING) for n in shared})
    silicon = silicon_of(published.values())
    inventories: dict[str, models.NodeInventory] = {}
    mirror = Mirror(api, namespace, label=RUN_LABEL, value=tag, timeline=timeline, silicon=silicon)
    report: dict[str, Any] = {"seed": seed}
    binary = (await asyncio.to_thread(binaries.ensure, ["toxiproxy-server"], progress=lambda _: None))[
        "toxiproxy-server"
    ]
    tasks: list[asyncio.Task[Any]] = []
    controllers: Controllers | None = None
    codes: dict[str, int] = {}
    async with Toxiproxy(binary, logs / "toxiproxy.log") as toxiproxy:
        try:
            upstream = f"127.0.0.1:{control_plane.ports['apiserver']}"
            kubeconfigs = []
            for slot in range(RACERS + ELECTORS):
                listen = await toxiproxy.create_proxy(f"controller-{slot}", upstream)
                kubeconfigs.append(
                    proxied_kubeconfig(kubeconfig, f"https://{listen}", logs / f"kubeconfig-{slot}")
                )
            controllers = Controllers(kubeconfigs, namespace, logs, tag, timeline)
            chaos = Chaos(control_plane, api, namespace, controllers, toxiproxy, timeline)
            await all_of(
                *(
                    create_gpu_node(api, n, labels={RUN_LABEL: tag}, kind="nvswitch" if i % 2 else "pcie")
                    for i, n in enumerate(whole)
                ),
                *(publish_simulated_node(api, n, tag, "a100-mig") for n in mig),
                *(publish_simulated_node(api, n, tag, "a100-pcie-4-nvlink", SHARING) for n in shared),
            )
            for n in nodes:
                raw = await until_available(functools.partial(crs.get_node_status, n))
                inventories[n] = codecs.parse_node_status(raw).status
            tasks.append(asyncio.create_task(mirror.run(), name="mirror"))
            await asyncio.wait_for(mirror.synced.wait(), 30)
            for slot in range(RACERS + ELECTORS):
                controllers.start(slot)
            tasks.append(asyncio.create_task(controllers.supervise(), name="supervise"))

            sizes = [rng.choice(SIZES) for _ in range(CLAIMS)]
            priorities = [rng.choice((0, 0, 0, 10)) for _ in range(CLAIMS)]
            # An RNG of its own, so that a seed's sizes and priorities stay what they were.
            kinds = random.Random(f"{seed}-kinds")
            asks = [
                kinds.choices(("Exclusive", "MIG", "Shared", "Milli"), (58, 12, 12, 18))[0]
                for _ in range(CLAIMS)
            ]
            # A third ask for leastFragmentation (the chart's packing.defaultStrategy can make it
            # every claim's), likewise from an RNG of its own.
            ranking = random.Random(f"{seed}-strategies")
            strategies = [
                "leastFragmentation" if ranking.random() < 1 / 3 else "binpack" for _ in range(CLAIMS)
            ]
            limit = asyncio.Semaphore(16)

            async def create(i: int) -> None:
                body = claim_body(
                    f"c{i:03d}", sizes[i], run=tag, priority=priorities[i], strategy=strategies[i]
                )
                if asks[i] == "Milli":  # a milli-GPU share of one whole GPU
                    sharing = {"milli": MILLI_SHARES[i % len(MILLI_SHARES)]}
                    body["spec"]["devices"] = {"count": 1, "exclusivity": "Shared", "sharing": sharing}
                elif asks[i] != "Exclusive":  # one MIG instance, or one or two slots of shared GPUs
                    count = 1 + i % 2 if asks[i] == "Shared" else 1
                    body["spec"]["devices"] = {"count": count, "exclusivity": asks[i]}
                async with limit:
                    with contextlib.suppress(errors.AlreadyExists):  # a retried create that had landed
                        await until_available(lambda: crs.create_claim(namespace, body))

            counts: collections.Counter[str] = collections.Counter()
            started = time.monotonic()
            timeline.note("chaos starts: creating the claims")
            await all_of(
                *(create(i) for i in range(CLAIMS)),
                chaos.run(plan, started),
                churn(api, namespace, tag, mirror, timeline, random.Random(f"{seed}-churn"), counts),
            )
            await toxiproxy.reset()
            timeline.note(f"faults over after {time.monotonic() - started:.1f} s; network healed")
            report.update(overlaps=chaos.overlaps, churned=counts["deleted"])

            async def unsettled() -> list[str]:
                # The mirror is cheap to ask; once it looks settled, a consistent snapshot confirms it.
                books = mirror.books
                problems = settled_problems(
                    list(books.claims.values()), list(books.leases.values()), inventories
                )
                if problems:
                    return problems
                claims, held = await consistent_snapshot(api, namespace, label=RUN_LABEL, value=tag)
                unsafe = Books.of(claims, held, label=RUN_LABEL, value=tag, silicon=silicon).problems()
                assert not unsafe, "safety violated (consistent snapshot):\n" + "\n".join(unsafe[:20])
                return settled_problems(claims, held, inventories)

            polls = await wait_until_done(
                "settling", unsettled, mirror, stall=SETTLE_STALL, within=SETTLE_WITHIN
            )
            claims, held = await consistent_snapshot(api, namespace, label=RUN_LABEL, value=tag)
            allocated = [c for c in claims if c["status"]["phase"] == constants.PHASE_ALLOCATED]
            report.update(
                polls=polls,
                allocated=len(allocated),
                allocated_by_kind=dict(
                    collections.Counter(
                        "Milli"
                        if (c["spec"]["devices"].get("sharing") or {}).get("milli")
                        else c["spec"]["devices"].get("exclusivity", "Exclusive")
                        for c in allocated
                    )
                ),
                pending=len(claims) - len(allocated),
                gpus_held=len(held),
                settled_s=round(timeline.now(), 1),
            )
            timeline.note(f"settled: {len(allocated)} claims Allocated, {len(held)} GPUs held")
            assert len(claims) == CLAIMS + counts["created"] - counts["deleted"] and allocated, report
            holders = set()
            for lease in held:
                ledger = share_ledger(lease)
                holders |= set(ledger) if ledger is not None else {lease["spec"]["holderIdentity"]}
            assert {c["metadata"]["uid"] for c in allocated} >= holders

            await until_available(
                lambda: transport.request(
                    api,
                    "DELETE",
                    f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{namespace}/{constants.CLAIM_PLURAL}",
                    query=[("labelSelector", f"{RUN_LABEL}={tag}")],
                )
            )

            async def unreleased() -> list[str]:
                books = mirror.books
                if books.claims or books.leases:
                    return [f"{len(books.claims)} claims and {len(books.leases)} leases left"]
                claims, held = await consistent_snapshot(api, namespace, label=RUN_LABEL, value=tag)
                return [f"{len(claims)} claims and {len(held)} leases left"] if claims or held else []

            await wait_until_done("releasing", unreleased, mirror, stall=RELEASE_STALL, within=RELEASE_WITHIN)
            report["released_s"] = round(timeline.now() - report["settled_s"], 1)
            mirror.check_now()
            report["mirror"] = dict(mirror.stats)
            assert not mirror.violations, "safety violated:\n" + "\n".join(mirror.violations[:20])
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if controllers is not None:
                codes = await asyncio.to_thread(controllers.stop_all)
            for node in nodes:
                with contextlib.suppress(errors.KubeError):
                    await until_available(functools.partial(delete_gpu_node, api, node), within=30)
    assert controllers is not None
    timeline.note(f"controllers stopped: {codes}")
    tail = controllers.tail()
    assert not controllers.unexpected, (controllers.unexpected, tail)
    # An elected controller may have lost its lease just before the end (exit 1, as when it is noticed).
    assert all(
        code == 0 or (code == EXIT_LOST_LEADERSHIP and who.startswith("elect-"))
        for who, code in codes.items()
    ), (
        codes,
        tail,
    )
    for overlap in report["overlaps"]:
        if "successor" in overlap and overlap["believed_leading"]:
            # The stopped leader found its lease taken: it must have stopped, not kept leading.
            # (A candidate whose acquire's answer was lost never led: it stays a standby.)
            assert overlap.get("exit") == EXIT_LOST_LEADERSHIP, (overlap, tail)
    report["lost_leadership"] = dict(controllers.lost_leadership)
    report["elapsed_s"] = round(timeline.now(), 1)
    print(f"\nrace (seed {seed}): {report}\n{timeline.render()}")
