"""Soak: every component as a process under seeded, bounded churn for a while; memory and safety.

Starts the local control plane (etcd, kube-apiserver, kube-scheduler, kwok; no
kube-controller-manager), four kwok GPU nodes with a simulated agent each (two
hardware profiles that stay up, two that flap), the controller (device Leases
in namespace ``soak``, only this run's claims) and the webhook (deny mode),
as ``gpualloc.demo`` does. Then, for ``--duration``, one action about every
``--interval`` seconds, chosen by the seed and bounded by ``--max-claims`` and
``--max-pods``:

* claims created (1 to 8 GPUs, assorted policy, topology mode, strategy and
  priority) and deleted, half of the time with their pods still there (the
  claim then stays Terminating, in use, until they go);
* claim pods (annotated ``gpu.scheduling/claim``) created and deleted; the
  webhook denies pods of claims that are not Allocated, which is counted;
* every ``--flap-interval`` a node flap: a flapping node's agent is stopped
  (SIGTERM) and started again 20 to 60 s later, longer than the controller's
  ``--node-stale-after 30``; a steady node gets its GpuNodeStatus Ready
  condition set False by hand (its agent's next heartbeat, within 10 s, puts
  it back). Steady agents are never restarted, so their memory is one process;
* every ``--xid-interval`` an XID through the simulated agent's injection file
  (``--xid-inject-file``): on a flapping node a real fault (XID 79, 48, 94, 74,
  a double-bit ECC error, now and then the GPU lost), which marks the device
  Unhealthy until the agent restarts (its file is emptied before the restart);
  on a steady node an application XID (13, 31, ...), which the agent ignores.

Meanwhile:

* RSS (``VmRSS`` in ``/proc/<pid>/status``) of every process, every
  ``--sample-interval`` seconds. Growth is from the median over 10-15% of the
  run (after the first 10% as warm-up) to the median over its last 5%, plus
  the least-squares slope after warm-up; a flapping agent's RSS starts over at
  each restart, so it gets no growth figure;
* safety from a list + watch of GpuClaims, device Leases and pods in ``soak``,
  checked after every event (``tests/integration/chaos_support.Mirror``): no
  GPU listed by two claims; every GPU an Allocated claim lists has a Lease
  (Terminating or not) held by that claim's UID; and no claim in use released:
  every GPU a claim pod's containers get, once its gate is lifted and until it
  is gone, is listed by its claim and held by that claim's Lease;
* liveness: every ``--sample-interval`` the GPUs the controller counts as taken
  (``gpualloc_devices{state="allocated"}`` on its /metrics) beside those the
  API server holds (the mirror's device Leases and the GPUs its claims list),
  and when each claim was first seen Allocated.

At the end every pod and claim is deleted; once the controller has released
everything (or ``--release-timeout`` passed), the device Leases left and the
claims left with the controller's finalizer are counted as leaked, and so are
GPUs the controller still counts as taken.

Writes ``soak.json`` (every sample, the churn counts, the figures) and
``soak.png`` (RSS over time per component) in ``--out``:

    .venv/bin/python bench/soak.py --duration 1h
    .venv/bin/python bench/soak.py --duration 3m --out /tmp/soak-3m
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp

from gpualloc.kube.client import Api

sys.path.insert(0, str(Path(__file__).resolve().parent))
import procfs

from agent import simulated
from gpualloc import demo
from gpualloc.api import constants, leases
from gpualloc.devcluster import binaries, cluster
from gpualloc.kube import client, errors, resources, transport, watching

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "bench" / "results"
NAMESPACE = "soak"  # claims, pods and device Leases: the mirror watches claims and Leases in one namespace
RUN_LABEL = "gpualloc.dev/soak"
NODE_STALE_AFTER_S = 30.0
HEARTBEAT_S = 10.0
WARMUP_FRACTION = 0.10
WARM_WINDOW = (0.10, 0.15)  # fractions of the run: "RSS at warm-up end"
END_WINDOW = (0.95, 1.00)  # "RSS at the end"
STARTUP_S = 15.0  # samples of a process this young stay out of the windows (it is still starting)
PLANE = ("kube-apiserver", "etcd", "kube-scheduler", "kwok")

SIZES = (1, 1, 1, 2, 2, 2, 3, 4, 4, 8)
POLICIES = ("packed", "packed", "spread", "contiguous")
TOPOLOGY_MODES = ("Preferred", "Preferred", "Ignore", "Required")
STRATEGIES = ("binpack", "spread", "leastLoaded", "bestFit", "random", "roundRobin")
REAL_XIDS = ("79", "48", "94", "74", "ecc")
APPLICATION_XIDS = ("13", "31", "43", "45", "68", "109")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    name: str
    profile: str
    flaps: bool  # True: the agent is stopped and restarted; False: the Ready condition is toggled


NODES = (
    Node(name="soak-node-0", profile="h100-sxm-8", flaps=False),
    Node(name="soak-node-1", profile="a100-pcie-4-nvlink", flaps=False),
    Node(name="soak-node-2", profile="consumer-8", flaps=True),
    Node(name="soak-node-3", profile="a100-sxm-8", flaps=True),
)


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_duration(text: str) -> float:
    """``1h``, ``3m``, ``90s``, ``1h30m``, or plain seconds."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise argparse.ArgumentTypeError(f"expected a duration like 1h, 3m, 90s or 1h30m, got {text!r}")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def chaos_support() -> ModuleType:
    """The race test's watch-fed safety mirror (tests/ is not installed: import it from the checkout)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module("tests.integration.chaos_support")


# ------------------------------------------------------------------ processes


class Components(demo.Processes):
    """The demo's process set, plus stopping one of them (an agent's flap)."""

    def stop_one(self, name: str, timeout: float = 10.0) -> None:
        for entry in list(self.procs):
            label, proc = entry
            if label != name:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            self.procs.remove(entry)

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs if proc.poll() is None}


class Agents:
    """One simulated agent per node, started with an XID injection file; restartable."""

    def __init__(self, comps: Components, kubeconfig: str, workdir: Path) -> None:
        self.comps = comps
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.incarnation: collections.Counter[str] = collections.Counter()
        self.running: dict[str, str] = {}  # node -> process name in comps (one log file per incarnation)

    def xid_file(self, node: Node) -> Path:
        return self.workdir / f"xid-{node.name}.txt"

    def start(self, node: Node) -> None:
        self.xid_file(node).write_text("")  # a restart clears the faults (marks are sticky until then)
        metrics_port, health_port = cluster.free_ports(2)
        self.incarnation[node.name] += 1
        name = f"agent-{node.name}.{self.incarnation[node.name]}"
        args = ["agent", "--source", "simulated", "--profile", node.profile, "--node-name", node.name]
        args += ["--kubeconfig", self.kubeconfig, "--lease-namespace", NAMESPACE]
        args += ["--heartbeat-interval", str(HEARTBEAT_S), "--xid-inject-file", str(self.xid_file(node))]
        args += ["--metrics-port", str(metrics_port), "--health-port", str(health_port)]
        self.comps.start(name, args)
        self.running[node.name] = name

    def stop(self, node: Node) -> None:
        name = self.running.pop(node.name, None)
        if name is not None:
            self.comps.stop_one(name)

    def pids(self) -> dict[str, int]:
        """component (``agent-<node>``) -> pid of its running incarnation."""
        alive = self.comps.pids()
        return {f"agent-{node}": alive[name] for node, name in self.running.items() if name in alive}


def start_controller_and_webhook(
    comps: Components, kubeconfig: str, run_id: str, workdir: Path
) -> tuple[int, int]:
    """The controller (this run's claims only, Leases in ``soak``) and the webhook; the webhook's port
    and the controller's metrics port."""
    ports = cluster.free_ports(5)
    controller = ["controller", "--kubeconfig", kubeconfig, "--namespace", NAMESPACE, "--leader-elect=false"]
    controller += ["--claim-selector", f"{RUN_LABEL}={run_id}", "--identity", "soak"]
    controller += ["--node-stale-after", str(NODE_STALE_AFTER_S)]
    controller += ["--metrics-port", str(ports[0]), "--health-port", str(ports[1])]
    comps.start("controller", controller)
    certs_dir = workdir / "webhook-certs"
    certs = ["certs", "--out-dir", str(certs_dir), "--ip-address", "127.0.0.1", "--dns-name", "localhost"]
    subprocess.run([sys.executable, "-m", "gpualloc.cli", *certs], check=True, stdout=subprocess.DEVNULL)
    webhook = ["webhook", "--kubeconfig", kubeconfig, "--host", "127.0.0.1", "--port", str(ports[2])]
    webhook += ["--tls-cert-file", str(certs_dir / "tls.crt"), "--tls-key-file", str(certs_dir / "tls.key")]
    webhook += ["--metrics-port", str(ports[3]), "--health-port", str(ports[4])]
    comps.start("webhook", webhook)
    return ports[2], ports[0]


# ------------------------------------------------------------------ RSS


class Sampler:
    """component -> [(seconds since churn began, pid, RSS KiB)]."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.series: dict[str, list[tuple[float, int, int]]] = collections.defaultdict(list)

    def take(self, pids: dict[str, int]) -> None:
        at = round(time.monotonic() - self.started, 2)
        for component, pid in sorted(pids.items()):
            kib = procfs.rss_kib(pid)
            if kib is not None:
                self.series[component].append((at, pid, kib))


def rss_figures(series: list[tuple[float, int, int]], duration: float) -> dict[str, Any]:
    """RSS at warm-up end and at the end (window medians), growth, slope after warm-up, restarts."""

    born: dict[int, float] = {}
    for at, pid, _ in series:
        born.setdefault(pid, at)
    first = min(born.values(), default=0.0)

    def window(lo: float, hi: float) -> list[int]:
        # A process started during the run (a flapping agent) is still importing for a few seconds.
        return [
            kib
            for at, pid, kib in series
            if lo * duration <= at <= hi * duration and (born[pid] == first or at - born[pid] >= STARTUP_S)
        ]

    warm, end = window(*WARM_WINDOW), window(*END_WINDOW)
    after = [(at, pid, kib) for at, pid, kib in series if WARMUP_FRACTION * duration <= at <= duration]
    pids = list(dict.fromkeys(pid for _, pid, _ in after))
    warm_mib = statistics.median(warm) / 1024 if warm else None
    end_mib = statistics.median(end) / 1024 if end else None
    figures: dict[str, Any] = {
        "warm_mib": round(warm_mib, 1) if warm_mib else None,
        "end_mib": round(end_mib, 1) if end_mib else None,
        "growth_pct": None,
        "max_after_warmup_mib": round(max(kib for _, _, kib in after) / 1024, 1) if after else None,
        "slope_mib_per_hour": None,
        "processes_after_warmup": len(pids),
    }
    if len(pids) == 1 and warm_mib and end_mib:
        figures["growth_pct"] = round((end_mib - warm_mib) / warm_mib * 100, 2)
        if len(after) >= 3:
            xs = [at for at, _, _ in after]
            ys = [kib / 1024 for _, _, kib in after]
            figures["slope_mib_per_hour"] = round(statistics.linear_regression(xs, ys).slope * 3600, 2)
    return figures


# ------------------------------------------------------------------ the controller's view


async def controller_taken(session: aiohttp.ClientSession, port: int) -> int | None:
    """GPUs the controller counts as taken (``gpualloc_devices{state="allocated"}``, summed)."""
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
            text = await response.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("gpualloc_devices{") and 'state="allocated"' in line
    )


def api_taken(books: Any) -> int:
    """GPUs taken according to the mirror (the API server): device Leases, and GPUs claims list."""
    recorded = chaos_support().recorded
    listed = {constants.lease_name(u) for claim in books.claims.values() for u in recorded(claim)}
    return len(set(books.leases) | listed)


def view_figures(view: list[tuple[float, int, int]], duration: float) -> dict[str, Any]:
    """How far the controller's count of taken GPUs drifted from the API server's."""
    during = [c - a for at, c, a in view if at <= duration]
    last = view[-1] if view else None
    return {
        "max_excess_during_churn": max(during) if during else None,
        "excess_at_churn_end": during[-1] if during else None,
        "controller_taken_after_release": last[1] if last else None,
        "api_taken_after_release": last[2] if last else None,
    }


def allocations_by_tenth(first_allocated: list[float], duration: float) -> list[int]:
    """Claims first seen Allocated in each tenth of the churn (from when each was first seen so)."""
    counts = [0] * 10
    for at in first_allocated:
        counts[min(9, int(at / duration * 10))] += 1
    return counts


# ------------------------------------------------------------------ churn


def claim_body(name: str, run_id: str, rng: random.Random) -> dict[str, Any]:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name, "labels": {RUN_LABEL: run_id}},
        "spec": {
            "devices": {"count": rng.choice(SIZES), "policy": rng.choice(POLICIES)},
            "topology": {"mode": rng.choice(TOPOLOGY_MODES)},
            "strategy": rng.choice(STRATEGIES),
            "priority": rng.choice((0, 0, 0, 10)),
        },
    }


def pod_body(name: str, claim: str, run_id: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {RUN_LABEL: run_id},
            "annotations": {constants.ANNOTATION_CLAIM: claim},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [{"name": "main", "image": "registry.invalid/cuda-job:1"}],
        },
    }


def error_kind(exc: errors.KubeError) -> str:
    return type(exc).__name__


class Churn:
    """The seeded actions, their bookkeeping and their counts."""

    def __init__(
        self,
        api: Api,
        rng: random.Random,
        run_id: str,
        mirror: Any,
        agents: Agents,
        args: argparse.Namespace,
    ) -> None:
        self.api = api
        self.crs = resources.CustomResources(api)
        self.rng = rng
        self.run_id = run_id
        self.mirror = mirror
        self.agents = agents
        self.args = args
        self.claims: dict[str, list[str]] = {}  # live claim -> its pods
        self.pods: dict[str, str] = {}  # live pod -> its claim
        self.counts: collections.Counter[str] = collections.Counter()
        self.denials: list[str] = []  # a few examples
        self.allocated: dict[str, float] = {}  # claims ever seen Allocated -> when first (s since start)
        self.started = time.monotonic()
        self.restarts: dict[str, asyncio.Task[None]] = {}  # node -> its pending restart
        self.seq = 0
        self.gpus = {n.name: len(simulated.load_profile(n.profile).devices) for n in NODES}

    def _name(self, prefix: str) -> str:
        self.seq += 1
        return f"{prefix}-{self.seq:06d}"

    def observe(self) -> None:
        for key, claim in self.mirror.books.claims.items():
            if (claim.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED:
                self.allocated.setdefault(key, round(time.monotonic() - self.started, 2))

    async def step(self) -> None:
        """One claim or pod action, weighted by how full the bounds are."""
        full = len(self.claims) >= self.args.max_claims
        weights = {
            self.create_claim: 0 if full else 3,
            self.delete_claim: (4 if full else 2) if self.claims else 0,
            self.create_pod: 3 if self.claims and len(self.pods) < self.args.max_pods else 0,
            self.delete_pod: (4 if len(self.pods) >= self.args.max_pods else 2) if self.pods else 0,
        }
        actions = [a for a, w in weights.items() if w]
        action = self.rng.choices(actions, weights=[weights[a] for a in actions])[0]
        await action()

    async def create_claim(self) -> None:
        name = self._name("claim")
        try:
            await self.crs.create_claim(NAMESPACE, claim_body(name, self.run_id, self.rng))
        except errors.KubeError as exc:
            self.counts[f"claim create failed ({error_kind(exc)})"] += 1
            return
        self.claims[name] = []
        self.counts["claims created"] += 1

    async def delete_claim(self) -> None:
        name = self.rng.choice(sorted(self.claims))
        pods = self.claims.pop(name)
        if pods and self.rng.random() < 0.5:
            for pod in pods:
                await self._delete_pod(pod)
            pods = []
        try:
            await self.crs.delete_claim(NAMESPACE, name)
        except errors.KubeError as exc:
            self.counts[f"claim delete failed ({error_kind(exc)})"] += 1
            return
        self.counts["claims deleted"] += 1
        if pods:
            self.counts["claims deleted while pods use them"] += 1

    async def create_pod(self) -> None:
        allocated = [c for c in sorted(self.claims) if f"{NAMESPACE}/{c}" in self.allocated]
        pool = allocated if allocated and self.rng.random() < 0.6 else sorted(self.claims)
        claim = self.rng.choice(pool)
        name = self._name("pod")
        path = watching.PODS.path(NAMESPACE)
        try:
            await transport.request(self.api, "POST", path, body=pod_body(name, claim, self.run_id))
        except errors.Forbidden as exc:
            if "denied the request" not in exc.message:
                self.counts["pod create failed (Forbidden)"] += 1
                return
            self.counts["pods denied by the webhook"] += 1
            if len(self.denials) < 5:
                self.denials.append(exc.message[:300])
            return
        except errors.KubeError as exc:
            self.counts[f"pod create failed ({error_kind(exc)})"] += 1
            return
        self.pods[name] = claim
        self.claims[claim].append(name)
        self.counts["pods admitted"] += 1

    async def delete_pod(self) -> None:
        name = self.rng.choice(sorted(self.pods))
        claim = self.pods[name]
        if claim in self.claims:
            self.claims[claim].remove(name)
        await self._delete_pod(name)

    async def _delete_pod(self, name: str) -> None:
        self.pods.pop(name, None)
        try:
            await transport.request(self.api, "DELETE", f"{watching.PODS.path(NAMESPACE)}/{name}")
        except errors.NotFound:
            pass
        except errors.KubeError as exc:
            self.counts[f"pod delete failed ({error_kind(exc)})"] += 1
            return
        self.counts["pods deleted"] += 1

    async def flap(self) -> None:
        """Restart a flapping node's agent (down 20-60 s), or set a steady node's Ready False."""
        candidates = [n for n in NODES if not (n.flaps and n.name in self.restarts)]
        node = self.rng.choice(candidates)
        if node.flaps:
            down = self.rng.uniform(20, 60)
            await asyncio.to_thread(self.agents.stop, node)
            self.restarts[node.name] = asyncio.create_task(self._restart_later(node, down))
            self.counts["flaps: agent stopped and restarted"] += 1
            return
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {
            "type": constants.CONDITION_READY,
            "status": "False",
            "reason": "SoakFlap",
            "message": "set by bench/soak.py",
            "lastTransitionTime": now,
        }
        try:
            await self.crs.patch_node_status_status(node.name, {"status": {"conditions": [condition]}})
        except errors.KubeError as exc:
            self.counts[f"flap failed ({error_kind(exc)})"] += 1
            return
        self.counts["flaps: Ready set False"] += 1

    async def _restart_later(self, node: Node, delay: float) -> None:
        await asyncio.sleep(delay)
        self.agents.start(node)
        self.restarts.pop(node.name, None)

    async def restart_all_now(self) -> None:
        """Start every stopped agent at once (the end of the run)."""
        for name, task in list(self.restarts.items()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.restarts.pop(name, None)
            self.agents.start(next(n for n in NODES if n.name == name))

    def xid(self) -> None:
        node = self.rng.choice([n for n in NODES if n.name in self.agents.running])
        index = self.rng.randrange(self.gpus[node.name])
        if node.flaps:
            what = "lost" if self.rng.random() < 0.1 else self.rng.choice(REAL_XIDS)
        else:
            what = self.rng.choice(APPLICATION_XIDS)
        with self.agents.xid_file(node).open("a") as handle:
            handle.write(f"{index} {what}\n")
        kind = "lost" if what == "lost" else "ecc" if what == "ecc" else f"XID {what}"
        self.counts[f"faults injected: {kind}"] += 1
        self.counts["faults injected"] += 1


# ------------------------------------------------------------------ the run


async def wait_published(api: Api, comps: Components) -> None:
    crs = resources.CustomResources(api)

    async def published() -> bool:
        items = (await crs.list_node_statuses())["items"]
        names = {i["metadata"]["name"] for i in items if (i.get("status") or {}).get("total")}
        return names >= {n.name for n in NODES}

    await demo.wait_for("the agents to publish their GpuNodeStatus", published, 90, comps)


async def release(api: Api, run_id: str, within: float) -> dict[str, Any]:
    """Delete every pod and claim of the run; wait for the controller; what it left behind."""
    crs = resources.CustomResources(api)
    selector = [("labelSelector", f"{RUN_LABEL}={run_id}")]
    claims_path = transport.collection_path(
        constants.GROUP, constants.VERSION, constants.CLAIM_PLURAL, NAMESPACE
    )
    leases_query = [("labelSelector", f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}")]
    started = time.monotonic()
    await transport.request(api, "DELETE", watching.PODS.path(NAMESPACE), query=selector)
    await transport.request(api, "DELETE", claims_path, query=selector)
    while True:
        pods = (await transport.request(api, "GET", watching.PODS.path(NAMESPACE), query=selector))["items"]
        claims = (await crs.list_claims(NAMESPACE, f"{RUN_LABEL}={run_id}"))["items"]
        held = (await transport.request(api, "GET", watching.LEASES.path(NAMESPACE), query=leases_query))[
            "items"
        ]
        if not (pods or claims or held) or time.monotonic() - started > within:
            break
        await asyncio.sleep(1.0)
    return {
        "seconds": round(time.monotonic() - started, 1),
        "pods_left": len(pods),
        "leaked_leases": [
            {
                "name": lease["metadata"]["name"],
                "holder": (lease.get("spec") or {}).get("holderIdentity"),
                "terminating": bool(lease["metadata"].get("deletionTimestamp")),
            }
            for lease in held
        ],
        "leaked_finalizers": [
            claim["metadata"]["name"]
            for claim in claims
            if constants.FINALIZER in (claim["metadata"].get("finalizers") or [])
        ],
        "claims_left": [claim["metadata"]["name"] for claim in claims],
    }


async def soak(
    args: argparse.Namespace, plane: cluster.ControlPlane, comps: Components, workdir: Path
) -> dict[str, Any]:
    support = chaos_support()
    rng = random.Random(args.seed)
    run_id = uuid.uuid4().hex[:8]
    kubeconfig = str(plane.kubeconfig)
    api = await client.connect(kubeconfig)
    timeline = support.Timeline()
    mirror = support.Mirror(api, NAMESPACE, label=RUN_LABEL, value=run_id, timeline=timeline, pods=True)
    agents = Agents(comps, kubeconfig, workdir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[Any]] = []
    churn = Churn(api, rng, run_id, mirror, agents, args)
    crashed: list[str] = []
    view: list[tuple[float, int, int]] = []
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))

    def pids() -> dict[str, int]:
        running = plane.running()
        found = {name: pid for name, pid in comps.pids().items() if not name.startswith("agent-")}
        return {**{n: running[n] for n in PLANE if n in running}, **found, **agents.pids()}

    async def look() -> None:
        """RSS of every process; GPUs taken in the controller's eyes and in the API server's."""
        sampler.take(pids())
        taken = await controller_taken(session, metrics_port)
        if taken is not None:
            at = round(time.monotonic() - sampler.started, 2)
            view.append((at, taken, api_taken(mirror.books)))

    async def sample() -> None:
        while True:
            await look()
            await asyncio.sleep(args.sample_interval)

    try:
        for node in NODES:
            agents.start(node)
        port, metrics_port = start_controller_and_webhook(comps, kubeconfig, run_id, workdir)
        await demo.register_webhook(api, port, (workdir / "webhook-certs" / "ca.crt").read_bytes())
        await wait_published(api, comps)
        await demo.wait_for_webhook(port, comps)
        tasks.append(asyncio.create_task(mirror.run(), name="mirror"))
        await asyncio.wait_for(mirror.synced.wait(), 60)
        say(f"churn for {args.duration:.0f} s (run {run_id}, seed {args.seed}); logs in {workdir}")

        sampler = Sampler()  # time 0: the churn's start
        tasks.append(asyncio.create_task(sample(), name="sampler"))
        started = churn.started = time.monotonic()
        end = started + args.duration
        next_flap = started + rng.uniform(0.5, 1.5) * args.flap_interval
        next_xid = started + rng.uniform(0.5, 1.5) * args.xid_interval
        next_note = started + 60
        while time.monotonic() < end and not stop.is_set():
            try:
                comps.check()
                plane.check_alive()
            except (RuntimeError, cluster.ControlPlaneError) as exc:
                crashed.append(str(exc)[-3000:])
                say(f"a process died; ending the churn early:\n{exc}")
                break
            now = time.monotonic()
            if now >= next_flap:
                await churn.flap()
                next_flap = now + rng.uniform(0.5, 1.5) * args.flap_interval
            elif now >= next_xid:
                churn.xid()
                next_xid = now + rng.uniform(0.5, 1.5) * args.xid_interval
            else:
                await churn.step()
            churn.observe()
            if now >= next_note:
                next_note = now + 60
                say(
                    f"{now - started:5.0f} s: {len(churn.claims)} claims, {len(churn.pods)} pods, "
                    f"{len(mirror.violations)} violations; {dict(churn.counts)}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.uniform(0.5, 1.5) * args.interval)
        churned = time.monotonic() - started
        say(f"churn over after {churned:.0f} s; restarting stopped agents, deleting every pod and claim")
        await churn.restart_all_now()
        released = await release(api, run_id, args.release_timeout)
        churn.observe()
        mirror.check_now()
        await asyncio.sleep(5.0)  # the controller's last watch events
        await look()
        return {
            "run_id": run_id,
            "churn_seconds": round(churned, 1),
            "completed": not crashed and not stop.is_set(),
            "crashed": crashed,
            "churn": dict(sorted(churn.counts.items())),
            "claims_seen_allocated": len(churn.allocated),
            "allocated_at": sorted(churn.allocated.values()),
            "webhook_denial_examples": churn.denials,
            "agent_incarnations": dict(agents.incarnation),
            "release": released,
            "violations": list(mirror.violations),
            "mirror": dict(mirror.stats),
            "controller_view": [list(v) for v in view],
            "samples": {
                component: [list(s) for s in series] for component, series in sorted(sampler.series.items())
            },
        }
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in churn.restarts.values():
            task.cancel()
        await session.close()
        await api.close()


# ------------------------------------------------------------------ report


def figures(result: dict[str, Any]) -> dict[str, Any]:
    duration = result["churn_seconds"]
    rss = {c: rss_figures([tuple(s) for s in series], duration) for c, series in result["samples"].items()}
    growths = [f["growth_pct"] for f in rss.values() if f["growth_pct"] is not None]
    return {
        "rss": rss,
        "max_growth_pct": max(growths) if growths else None,
        "violations": len(result["violations"]),
        "leaked_leases": len(result["release"]["leaked_leases"]),
        "leaked_finalizers": len(result["release"]["leaked_finalizers"]),
        "controller_view": view_figures([tuple(v) for v in result["controller_view"]], duration),
        "allocations_by_tenth": allocations_by_tenth(result["allocated_at"], duration),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    duration = result["churn_seconds"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 11), sharex=True, height_ratios=(3, 3, 2))
    for component, series in result["samples"].items():
        axis = axes[0] if component in PLANE else axes[1]
        # A restarted agent is one line per process, so a restart does not look like a drop.
        by_pid: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
        for at, pid, kib in series:
            by_pid[pid].append((at / 60, kib / 1024))
        colour = None
        for i, points in enumerate(by_pid.values()):
            xs, ys = zip(*points, strict=True)
            (line,) = axis.plot(xs, ys, color=colour, linewidth=1, label=component if i == 0 else None)
            colour = line.get_color()
    if result["controller_view"]:
        ats, controller, api = zip(*result["controller_view"], strict=True)
        minutes = [at / 60 for at in ats]
        axes[2].plot(minutes, controller, linewidth=1, label="the controller (gpualloc_devices allocated)")
        axes[2].plot(minutes, api, linewidth=1, label="the API server (device Leases, GPUs claims list)")
    titles = ("control plane: RSS", "gpualloc components: RSS", "GPUs taken, as each sees it")
    for axis, title in zip(axes, titles, strict=True):
        axis.axvline(WARMUP_FRACTION * duration / 60, color="grey", linestyle=":", label="warm-up end")
        axis.axvline(duration / 60, color="black", linestyle=":", label="churn end")
        axis.set_title(title)
        axis.legend(fontsize=7, loc="upper left", ncol=2)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("RSS (MiB)")
    axes[1].set_ylabel("RSS (MiB)")
    axes[2].set_ylabel("GPUs")
    axes[2].set_xlabel("minutes since the churn began")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict[str, Any]) -> str:
    f = result["figures"]
    lines = [f"soak of {result['churn_seconds']:.0f} s, seed {result['config']['seed']}"]
    lines.append(f"{'component':28} {'warm-up MiB':>11} {'end MiB':>8} {'growth %':>9} {'MiB/h':>7}  note")
    for component, r in f["rss"].items():
        growth = "-" if r["growth_pct"] is None else f"{r['growth_pct']:.1f}"
        slope = "-" if r["slope_mib_per_hour"] is None else f"{r['slope_mib_per_hour']:.1f}"
        note = (
            f"{r['processes_after_warmup']} processes (restarted)" if r["processes_after_warmup"] > 1 else ""
        )
        lines.append(
            f"{component:28} {r['warm_mib']!s:>11} {r['end_mib']!s:>8} {growth:>9} {slope:>7}  {note}"
        )
    lines.append(f"largest growth: {f['max_growth_pct']}% (goal < 10%)")
    lines.append(f"safety violations: {f['violations']} (goal 0)")
    lines.append(
        f"leaked Leases: {f['leaked_leases']}, leaked claim finalizers: {f['leaked_finalizers']} "
        f"(goal 0 each); released in {result['release']['seconds']} s"
    )
    view = f["controller_view"]
    lines.append(
        f"GPUs the controller counts as taken beyond what the API server holds: at most "
        f"{view['max_excess_during_churn']} during the churn, {view['excess_at_churn_end']} at its end; "
        f"after release the controller counts {view['controller_taken_after_release']} taken, "
        f"the API server {view['api_taken_after_release']} (goal 0)"
    )
    lines.append(f"claims first Allocated in each tenth of the run: {f['allocations_by_tenth']}")
    lines.append(f"churn: {json.dumps(result['churn'])}")
    lines.append(f"claims seen Allocated: {result['claims_seen_allocated']}")
    if result["crashed"]:
        lines.append(f"CRASHED: {result['crashed']}")
    return "\n".join(lines)


COMPACT = ("samples", "controller_view", "allocated_at")  # long series: one line each


def to_json(result: dict[str, Any]) -> str:
    """Indented, with the long series last and compact (one line per component)."""
    order = [k for k in result if k not in COMPACT] + [k for k in COMPACT if k in result]
    parts = []
    for key in order:
        value = result[key]
        if key not in COMPACT:
            text = json.dumps(value, indent=1).replace("\n", "\n ")
        elif isinstance(value, dict):
            series = ",\n".join(
                f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in value.items()
            )
            text = "{\n" + series + "\n }"
        else:
            text = json.dumps(value, separators=(",", ":"))
        parts.append(f" {json.dumps(key)}: {text}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("1h"), help="e.g. 1h, 3m")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory of soak.json and soak.png")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interval", type=float, default=1.0, help="mean seconds between claim/pod actions")
    parser.add_argument("--flap-interval", type=float, default=90.0, help="mean seconds between node flaps")
    parser.add_argument("--xid-interval", type=float, default=45.0, help="mean seconds between XIDs")
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument("--max-claims", type=int, default=12)
    parser.add_argument("--max-pods", type=int, default=12)
    parser.add_argument("--release-timeout", type=float, default=180.0)
    parser.add_argument("--keep", action="store_true", help="keep the state directory (logs) after the run")
    args = parser.parse_args(argv)

    paths = binaries.ensure(["kube-apiserver", "etcd", "kube-scheduler", "kwok"], progress=say)
    workdir = Path(tempfile.mkdtemp(prefix="gpualloc-soak-"))
    plane = cluster.ControlPlane(workdir / "plane", binaries=paths)
    comps = Components(workdir)
    ok = False
    try:
        say(f"starting the local control plane in {workdir / 'plane'}")
        plane.start()
        plane.apply_crds()
        plane.ensure_scheduler()
        plane.ensure_kwok()
        for node in NODES:
            plane.add_kwok_node(node.name, {"gpualloc.dev/profile": node.profile})
        for namespace in (NAMESPACE, leases.heartbeat_namespace(NAMESPACE)):  # device Leases; heartbeats
            plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        plane.ensure_service_account(NAMESPACE)
        result = asyncio.run(soak(args, plane, comps, workdir))
        ok = True
    finally:
        comps.stop()
        plane.stop()
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")
    result = {
        **procfs.run_stamp(),
        "config": {
            "duration_s": args.duration,
            "seed": args.seed,
            "interval_s": args.interval,
            "flap_interval_s": args.flap_interval,
            "xid_interval_s": args.xid_interval,
            "sample_interval_s": args.sample_interval,
            "max_claims": args.max_claims,
            "max_pods": args.max_pods,
            "node_stale_after_s": NODE_STALE_AFTER_S,
            "heartbeat_s": HEARTBEAT_S,
            "nodes": [dataclasses.asdict(n) for n in NODES],
            "warm_window": WARM_WINDOW,
            "end_window": END_WINDOW,
        },
        **result,
    }
    result["figures"] = figures(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(to_json(result))
    plot(result, args.out / "soak.png")
    print(report(result))
    print(f"wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")
    f = result["figures"]
    good = (
        result["completed"]
        and not f["violations"]
        and not f["leaked_leases"]
        and not f["leaked_finalizers"]
        and not f["controller_view"]["controller_taken_after_release"]
    )
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
