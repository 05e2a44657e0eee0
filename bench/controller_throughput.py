"""End-to-end controller throughput against a real local kube-apiserver.

Starts a control plane (``gpualloc.devcluster``) with the chart's
claim-finalizer MutatingAdmissionPolicy, publishes N simulated GPU nodes (a
Node plus a GpuNodeStatus each, default 100 x 8 GPUs) that heartbeat every
``--heartbeat`` seconds as the agents do (their heartbeat Lease renewed, and every
tenth time the GpuNodeStatus's own heartbeat instead), measures the Lease-create ceiling of
this client library against this API server, then starts ``gpualloc
controller`` as a process and creates M claims (default 400, sizes 1/2/4/8).
By default they are created as fast as the API server takes them
(``--concurrency`` in flight): the controller works through a backlog, so the
figures are its capacity. ``--rate`` creates them at that rate instead, open
loop, for latency at a given load. A client-side watch records when each claim
is first seen Allocated.

Reported (``bench/results/controller_throughput.json`` and stdout):

* allocations per second: allocated claims / (last allocation - first create);
* time to Allocated, p50/p90/p99/max: from ``creationTimestamp`` (one-second
  resolution, as the API stores it) and from the moment the client sent the
  create (sub-millisecond) to the watch event showing ``phase: Allocated``;
* API requests per allocation: the controller's requests in the audit log
  (matched by its user agent) received by the last allocation, all and writes
  only, per allocated claim;
* the ceiling: Lease creates per second with ``--ceiling-concurrency`` in
  flight, through the same ``gpualloc.kube.leases`` calls the controller uses,
  and the controller's writes per second as a fraction of it;
* CPU seconds per allocation of each process (the controller, kube-apiserver,
  etcd, and this script, which creates the claims and the heartbeats) over the
  measured span (first create to last allocation: not the quiet wait after it,
  when the claims that fit nowhere are retried), and the controller's peak
  resident memory: which process is the limit.

Every Node reports an allocatable (``NODE_ALLOCATABLE``) large enough that its pods never keep a
claim out. ``--pods-per-node N`` binds N plain pods (not claim pods; ``LOAD_REQUESTS`` each, phase
Running, never run anywhere: there is no kubelet) to every node before the controller starts: the
controller counts their requests against the Node's allocatable (issue 41), and the figures say
what that costs. ``--controller-tree DIR`` runs the controller from another checkout (a ``git
worktree`` of an older commit) against this script: the result names the commit and the module
files the controller process imports.

    .venv/bin/python bench/controller_throughput.py --nodes 100 --claims 400
    .venv/bin/python bench/controller_throughput.py --nodes 1000 --claims 5000
    .venv/bin/python bench/controller_throughput.py --nodes 100 --claims 400 --rate 50
    .venv/bin/python bench/controller_throughput.py --nodes 1000 --claims 5000 --pods-per-node 2
    .venv/bin/python bench/controller_throughput.py --nodes 1000 --claims 5000 \
        --controller-tree /tmp/bench-old     # after: git worktree add /tmp/bench-old 332c6e7
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import hashlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gpualloc.kube.client import Api

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_plane
import procfs
import webhook_request
import webhook_vegeta

from agent import publishing
from gpualloc.api import constants
from gpualloc.api import leases as lease_format
from gpualloc.devcluster import binaries, cluster
from gpualloc.kube import client, errors, leases, resources, transport, watching

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART = REPO_ROOT / "helm" / "gpualloc"
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "controller_throughput.json"
CONTROLLER_AGENT = "gpualloc-controller"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
# What every bench Node offers its pods: room for far more load pods than --pods-per-node asks.
NODE_ALLOCATABLE = {"cpu": "128", "memory": "1Ti", "pods": "250"}
# What each load pod (--pods-per-node) requests: a CPU pod sharing the GPU node.
LOAD_REQUESTS = {"cpu": "500m", "memory": "1Gi"}


# ------------------------------------------------------------------ simulated nodes


def gpu_uuid(node: str, index: int) -> str:
    digest = hashlib.sha256(f"{node}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def inventory(node: str, gpus: int) -> dict[str, Any]:
    """An NVSwitch box: every pair NV18 at 900 GB/s, one island, two NUMA nodes."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "source": "simulated",
        "product": "NVIDIA H100 80GB HBM3",
        "devices": [
            {
                "index": i,
                "minor": i,
                "uuid": gpu_uuid(node, i),
                "product": "NVIDIA H100 80GB HBM3",
                "memoryMiB": 81559,
                "computeCapability": "9.0",
                "numaNode": i * 2 // gpus,
                "health": "Healthy",
            }
            for i in range(gpus)
        ],
        "links": [
            {"a": a, "b": b, "type": "NV18", "nvlinks": 18, "bandwidthGBps": 900}
            for a in range(gpus)
            for b in range(a + 1, gpus)
        ],
        "islands": [list(range(gpus))],
        "total": gpus,
        "healthy": gpus,
        "lastHeartbeatTime": now,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Publishing", "lastTransitionTime": now}
        ],
    }


async def retrying(call: Any, attempts: int = 40) -> Any:
    """Retry 429/5xx (a CRD's storage may still be initialising right after it is Established)."""
    for attempt in range(attempts):
        try:
            return await call()
        except errors.Unavailable:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    return None


async def create_node(api: Api, name: str, gpus: int) -> None:
    crs = resources.CustomResources(api)
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        # A Node's status is kept on create (the kubelet registers its Node so).
        "status": {"allocatable": NODE_ALLOCATABLE, "capacity": NODE_ALLOCATABLE},
    }
    await retrying(lambda: transport.request(api, "POST", "/api/v1/nodes", body=body))
    # No kubelet: lift the not-ready taint the API server puts on new Nodes, as the node lifecycle
    # controller would once the kubelet reports Ready (tests/integration/controller_support.py).
    untaint = {"spec": {"taints": None}}
    await retrying(
        lambda: transport.request(
            api, "PATCH", f"/api/v1/nodes/{name}", body=untaint, content_type=transport.MERGE_PATCH
        )
    )
    await retrying(
        lambda: crs.create_node_status(
            {
                "apiVersion": constants.API_VERSION,
                "kind": constants.NODE_STATUS_KIND,
                "metadata": {"name": name},
                "spec": {"nodeName": name},
            }
        )
    )
    await retrying(lambda: crs.patch_node_status_status(name, {"status": inventory(name, gpus)}))


async def create_load_pod(api: Api, namespace: str, name: str, node: str) -> None:
    """A plain pod bound to ``node`` (``spec.nodeName``: no scheduler involved), marked Running.
    Nothing runs it: the API server only stores it, and the controller's live-pods watch sees it."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"bench": "load"}},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "work",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"requests": LOAD_REQUESTS},
                }
            ],
        },
    }
    pods = f"/api/v1/namespaces/{namespace}/pods"
    await retrying(lambda: transport.request(api, "POST", pods, body=body))
    running = {"status": {"phase": "Running"}}
    await retrying(
        lambda: transport.request(
            api, "PATCH", f"{pods}/{name}/status", body=running, content_type=transport.MERGE_PATCH
        )
    )


async def load_nodes(
    api: Api, plane: cluster.ControlPlane, namespace: str, nodes: list[str], per_node: int, concurrency: int
) -> dict[str, Any]:
    """``per_node`` load pods on each node, ``concurrency`` creates in flight; how long it took."""
    plane.ensure_service_account(namespace)  # the API server refuses pods in a namespace without it
    jobs = [
        (lambda node=node, j=j: create_load_pod(api, namespace, f"load-{node}-{j}", node))
        for j in range(per_node)
        for node in nodes
    ]
    started = time.perf_counter()
    await bounded(concurrency, jobs)
    elapsed = time.perf_counter() - started
    listed = await transport.request(
        api, "GET", f"/api/v1/namespaces/{namespace}/pods", query=[("fieldSelector", "status.phase=Running")]
    )
    return {
        "pods_per_node": per_node,
        "pods": len(jobs),
        "pods_running_listed": len(listed.get("items") or []),
        "requests_each": LOAD_REQUESTS,
        "node_allocatable": NODE_ALLOCATABLE,
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "pods_per_second": round(len(jobs) / elapsed, 1) if elapsed > 0 else None,
    }


async def bounded(concurrency: int, jobs: list[Any]) -> list[Any]:
    limit = asyncio.Semaphore(concurrency)

    async def one(job: Any) -> Any:
        async with limit:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


async def no_node(name: str) -> None:
    """The bench's heartbeat Leases need no owner: they go with the control plane."""
    return None


async def heartbeats(api: Api, names: list[str], interval: float, namespace: str) -> None:
    """Each node's agent heartbeat every ``interval`` seconds, spread evenly, until cancelled: as
    ``agent.publishing`` does, the node's heartbeat Lease in ``namespace`` is renewed, and every
    ``STATUS_REFRESH_INTERVALS``-th time the GpuNodeStatus's own heartbeat is written instead."""
    crs = resources.CustomResources(api)
    gap = interval / max(1, len(names))
    for rounds in itertools.count():
        for i, name in enumerate(names):
            started = time.monotonic()
            now = datetime.datetime.now(datetime.UTC)
            with contextlib.suppress(errors.KubeError):
                if (rounds + i) % publishing.STATUS_REFRESH_INTERVALS == 0:
                    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
                    await crs.patch_node_status_status(name, {"status": {"lastHeartbeatTime": stamp}})
                else:
                    await publishing.heartbeat_renewer(api, namespace, name, no_node)(now)
            await asyncio.sleep(max(0.0, gap - (time.monotonic() - started)))


def render_finalizer_policy() -> list[dict[str, Any]]:
    """The chart's claim-finalizer MutatingAdmissionPolicy, as ``helm install`` renders it on 1.36."""
    helm = str(binaries.ensure(["helm"], progress=lambda _: None)["helm"])
    template = "templates/claim-finalizer-policy.yaml"
    served = "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"
    rendered = subprocess.run(
        [helm, "template", "bench", str(CHART), "--show-only", template, "--api-versions", served],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return [obj for obj in yaml.safe_load_all(rendered) if obj]


async def install_policy(api: Api, objects: list[dict[str, Any]], claims_ns: str) -> None:
    """Create the policy and its binding, and wait until a claim created gets the finalizer."""
    plurals = {
        "MutatingAdmissionPolicy": "mutatingadmissionpolicies",
        "MutatingAdmissionPolicyBinding": "mutatingadmissionpolicybindings",
    }
    for obj in objects:
        path = transport.collection_path("admissionregistration.k8s.io", "v1", plurals[obj["kind"]])
        await retrying(lambda obj=obj, path=path: transport.request(api, "POST", path, body=obj))
    # The API server sees a new policy a moment later: wait until a dry-run create carries it.
    path = transport.collection_path(constants.GROUP, constants.VERSION, "gpuclaims", claims_ns)
    deadline = time.monotonic() + 60
    while True:
        stored = await retrying(
            lambda: transport.request(api, "POST", path, body=claim("probe", 1), query=[("dryRun", "All")])
        )
        if constants.FINALIZER in (stored["metadata"].get("finalizers") or []):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the claim-finalizer policy did not take effect in 60 s")
        await asyncio.sleep(0.2)


# ------------------------------------------------------------------ measurements


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[rank], 4)


def summary(values: list[float]) -> dict[str, float | None]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": round(max(values), 4) if values else None,
        "mean": round(statistics.fmean(values), 4) if values else None,
    }


async def lease_ceiling(api: Api, namespace: str, count: int, concurrency: int) -> dict[str, Any]:
    """Lease creates per second with ``concurrency`` in flight (then the Leases are deleted again)."""
    names = [f"ceiling-{i:05d}" for i in range(count)]
    started = time.perf_counter()
    await bounded(
        concurrency,
        [
            (lambda n=n: leases.create_lease(api, namespace, n, holder="bench", labels={"bench": "ceiling"}))
            for n in names
        ],
    )
    elapsed = time.perf_counter() - started
    await transport.request(
        api,
        "DELETE",
        transport.collection_path("coordination.k8s.io", "v1", "leases", namespace),
        query=[("labelSelector", "bench=ceiling")],
    )
    return {
        "leases": count,
        "concurrency": concurrency,
        "seconds": round(elapsed, 3),
        "creates_per_second": round(count / elapsed, 1),
    }


def audit_counts(audit_log: Path, offset: int, until: float) -> dict[str, Any]:
    """The controller's requests in the audit log after ``offset`` bytes and received by ``until``
    (a Unix time), by verb and resource."""
    verbs: collections.Counter[str] = collections.Counter()
    by_resource: collections.Counter[str] = collections.Counter()
    total = 0
    with audit_log.open("rb") as handle:
        handle.seek(offset)
        for line in handle:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("stage") != "ResponseComplete":
                continue
            if not str(event.get("userAgent", "")).startswith(CONTROLLER_AGENT):
                continue
            received = str(event.get("requestReceivedTimestamp", "")).replace("Z", "+00:00")
            if received and datetime.datetime.fromisoformat(received).timestamp() > until:
                continue
            verb = str(event.get("verb", ""))
            ref = event.get("objectRef") or {}
            resource = str(ref.get("resource", "")) + (
                "/" + ref["subresource"] if ref.get("subresource") else ""
            )
            total += 1
            verbs[verb] += 1
            by_resource[f"{verb} {resource}"] += 1
    writes = sum(n for verb, n in verbs.items() if verb in WRITE_VERBS)
    return {
        "total": total,
        "writes": writes,
        "by_verb": dict(verbs),
        "by_request": dict(by_resource.most_common()),
    }


# ------------------------------------------------------------------ the run


def controller_env(tree: Path) -> dict[str, str]:
    """The controller process's environment: the packages of ``tree`` first on its path."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def controller_code(tree: Path) -> dict[str, Any]:
    """Which code the controller process runs: ``tree``'s commit (and whether it has changes), and
    the files its packages are imported from, asked of the same interpreter, directory and path."""
    probe = "import controller, gpualloc, json; print(json.dumps([controller.__file__, gpualloc.__file__]))"
    files = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe],
            cwd=tree,
            env=controller_env(tree),
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )

    def git(*argv: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *argv], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "tree": str(tree),
        "commit": git("rev-parse", "HEAD"),
        "changed_files": len(git("status", "--porcelain", "--untracked-files=no").splitlines()),
        "controller_module": files[0],
        "gpualloc_module": files[1],
    }


def start_controller(
    kubeconfig: Path, namespace: str, workers: int, log_path: Path, tree: Path, extra: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpualloc.cli",
                "controller",
                "--leader-elect=false",
                "--kubeconfig",
                str(kubeconfig),
                "--namespace",
                namespace,
                "--health-port",
                "0",
                "--metrics-port",
                "0",
                "--workers",
                str(workers),
                "--identity",
                "bench",
                "--log-level",
                "WARNING",
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tree,
            env=controller_env(tree),
        )


def start_webhook(kubeconfig: Path, workdir: Path) -> subprocess.Popen[bytes]:
    """``gpualloc webhook`` against the plane, ready (its claim cache synced); its log in ``workdir``."""
    ca, cert, key = webhook_request.make_certs(workdir / "certs")
    port = cluster.free_ports(1)[0]
    with (workdir / "webhook.log").open("wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "gpualloc.cli"),
                *webhook_vegeta.webhook_args(cert, key, port, kubeconfig),
                *("--health-port=0", "--metrics-port=0"),
            ],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    webhook_vegeta.wait_ready(port, ca, "/readyz", process)
    return process


async def run(args: argparse.Namespace, plane: cluster.ControlPlane, workdir: Path) -> dict[str, Any]:
    api = await client.connect(str(plane.kubeconfig), connections=args.concurrency + 8)
    rng = random.Random(args.seed)
    claims_ns, lease_ns, scratch_ns, load_ns = "bench", "gpualloc-system", "bench-ceiling", "bench-load"
    heartbeat_ns = lease_format.heartbeat_namespace(lease_ns)  # the controller's default
    controller: subprocess.Popen[bytes] | None = None
    webhook: subprocess.Popen[bytes] | None = None
    watcher: asyncio.Task[None] | None = None
    beating: asyncio.Task[None] | None = None
    try:
        for ns in (claims_ns, lease_ns, heartbeat_ns, scratch_ns, load_ns):
            await retrying(
                lambda ns=ns: transport.request(
                    api, "POST", "/api/v1/namespaces", body={"metadata": {"name": ns}}
                )
            )
        if args.finalizer_policy:
            await install_policy(api, render_finalizer_policy(), claims_ns)
        node_names = [f"bench-node-{i:04d}" for i in range(args.nodes)]
        await bounded(16, [(lambda n=n: create_node(api, n, args.gpus)) for n in node_names])
        print(f"{args.nodes} nodes published", flush=True)
        load = None
        if args.pods_per_node > 0:
            load = await load_nodes(api, plane, load_ns, node_names, args.pods_per_node, args.concurrency)
            print(
                f"{load['pods']} load pods bound and Running in {load['seconds']} s "
                f"({load['pods_per_second']}/s)",
                flush=True,
            )
        if args.heartbeat > 0:
            beating = asyncio.create_task(heartbeats(api, node_names, args.heartbeat, heartbeat_ns))
        ceiling = await lease_ceiling(api, scratch_ns, args.ceiling_leases, args.ceiling_concurrency)
        print(f"lease-create ceiling: {ceiling['creates_per_second']} creates/s", flush=True)

        # The client-side watch: when each claim is first seen Allocated.
        allocated_at: dict[str, float] = {}
        created_ts: dict[str, str] = {}

        def on_claim(type_: str, obj: dict[str, Any]) -> None:
            name = obj["metadata"]["name"]
            created_ts.setdefault(name, obj["metadata"].get("creationTimestamp", ""))
            if (obj.get("status") or {}).get(
                "phase"
            ) == constants.PHASE_ALLOCATED and name not in allocated_at:
                allocated_at[name] = time.time()

        reflector = watching.Reflector(api, watching.CLAIMS, namespace=claims_ns, on_event=on_claim)
        watcher = asyncio.create_task(reflector.run())
        await reflector.synced.wait()

        code = controller_code(args.controller_tree)
        print(f"controller: {code['controller_module']} at {code['commit'][:12] or '?'}", flush=True)
        log_path = workdir / "controller.log"
        controller = start_controller(
            plane.kubeconfig,
            lease_ns,
            args.workers,
            log_path,
            args.controller_tree,
            ["--dra"] if args.dra else [],
        )
        # Readiness without a probe port: the first claim (not counted) comes back Allocated.
        await retrying(lambda: resources.CustomResources(api).create_claim(claims_ns, claim("warmup", 1)))
        deadline = time.monotonic() + 60
        while "warmup" not in allocated_at:
            if controller.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"controller not allocating; see {log_path}")
            await asyncio.sleep(0.05)

        if args.webhook:
            webhook = start_webhook(plane.kubeconfig, workdir)
        audit_offset = plane.audit_log.stat().st_size
        pids = {"controller": controller.pid, **plane.running()}
        pids = {name: pid for name, pid in pids.items() if name in ("controller", "kube-apiserver", "etcd")}
        cpu_before = {name: procfs.cpu_seconds(pid) for name, pid in pids.items()}
        cpu_before["bench"] = time.process_time()
        sizes = rng.choices([1, 2, 4, 8], weights=args.weights, k=args.claims)
        sent_at: dict[str, float] = {}
        crs = resources.CustomResources(api)
        start = time.time()

        async def create(i: int) -> None:
            if args.rate:
                await asyncio.sleep(max(0.0, start + i / args.rate - time.time()))
            name = f"claim-{i:05d}"
            sent_at[name] = time.time()
            await crs.create_claim(claims_ns, claim(name, sizes[i]))

        if args.rate:
            await asyncio.gather(*(create(i) for i in range(args.claims)))
        else:
            await bounded(args.concurrency, [(lambda i=i: create(i)) for i in range(args.claims)])
        created_all = time.time()
        print(f"{args.claims} claims created in {created_all - start:.1f} s", flush=True)
        # Wait for the last allocations: until every claim is Allocated or nothing moved for a while.
        # The CPU is read at each allocation seen, so what is reported is the CPU up to the last one
        # (the span), not the quiet wait after it, when claims that fit nowhere are retried.
        last_count, last_change = -1, time.time()
        cpu_used: dict[str, float] = {}
        while True:
            count = sum(1 for name in sent_at if name in allocated_at)
            if count != last_count:
                last_count, last_change = count, time.time()
                cpu_used = {name: procfs.cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
                cpu_used["bench"] = time.process_time() - cpu_before["bench"]
            if count == len(sent_at) or time.time() - last_change > args.quiet:
                break
            await asyncio.sleep(0.1)
        peak_rss = procfs.memory_kib(controller.pid).get("VmHWM", 0)
        webhook_peak_rss = procfs.memory_kib(webhook.pid).get("VmHWM", 0) if webhook else 0
        await asyncio.sleep(1.0)  # let the audit log catch up
        done = [n for n in sent_at if n in allocated_at]
        last = max((allocated_at[n] for n in done), default=start)
        audit = audit_counts(plane.audit_log, audit_offset, until=last)  # the span's requests

        from_send = [allocated_at[n] - sent_at[n] for n in done]
        from_ts: list[float] = []
        for n in done:
            stamp = created_ts.get(n, "")
            if stamp:
                created = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
                from_ts.append(allocated_at[n] - created)
        span = last - start
        demand = sum(sizes)
        writes_per_s = audit["writes"] / span if span > 0 else None
        processes = {
            name: {
                "cpu_seconds": round(used, 2),
                "cores_busy": round(used / span, 2) if span > 0 else None,
                "cpu_ms_per_allocation": round(1000 * used / len(done), 2) if done else None,
            }
            for name, used in cpu_used.items()
        }
        result = {
            **procfs.run_stamp(),
            "config": {
                "nodes": args.nodes,
                "gpus_per_node": args.gpus,
                "claims": args.claims,
                "rate_per_second": args.rate or "saturation",
                "create_concurrency": None if args.rate else args.concurrency,
                "heartbeat_seconds": args.heartbeat,
                "finalizer_policy": args.finalizer_policy,
                "size_weights_1_2_4_8": args.weights,
                "gpus_demanded": demand,
                "gpus_supplied": args.nodes * args.gpus,
                "controller_workers": args.workers,
                "pods_per_node": args.pods_per_node,
                "dra": args.dra,
                "node_allocatable": NODE_ALLOCATABLE,
                "seed": args.seed,
            },
            "controller_code": code,
            "load_pods": load,
            "allocated": len(done),
            "not_allocated": len(sent_at) - len(done),
            "creation_seconds": round(created_all - start, 3),
            "allocation_span_seconds": round(span, 3),
            "allocations_per_second": round(len(done) / span, 2) if span > 0 else None,
            "time_to_allocated_from_creation_timestamp_s": summary(from_ts),
            "time_to_allocated_from_client_send_s": summary(from_send),
            "controller_requests": audit,
            "requests_per_allocation": round(audit["total"] / len(done), 2) if done else None,
            "writes_per_allocation": round(audit["writes"] / len(done), 2) if done else None,
            "writes_per_second": round(writes_per_s, 1) if writes_per_s is not None else None,
            "writes_per_second_over_ceiling": (
                round(writes_per_s / ceiling["creates_per_second"], 2) if writes_per_s is not None else None
            ),
            "lease_create_ceiling": ceiling,
            "processes": processes,
            "controller_peak_rss_mib": round(peak_rss / 1024, 1),
            **({"webhook_peak_rss_mib": round(webhook_peak_rss / 1024, 1)} if webhook else {}),
        }
        return result
    finally:
        if beating is not None:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        webhook_vegeta.stop_all([p for p in (controller, webhook) if p is not None])
        await api.close()


def claim(name: str, count: int) -> dict[str, Any]:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name},
        "spec": {"devices": {"count": count}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--claims", type=int, default=400)
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="claims created per second, open loop (default: as fast as they are taken, a backlog)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="creates in flight when there is no --rate"
    )
    parser.add_argument(
        "--heartbeat", type=float, default=30.0, help="seconds between a node's heartbeats (0: none)"
    )
    parser.add_argument(
        "--finalizer-policy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="install the chart's claim-finalizer MutatingAdmissionPolicy (default: yes)",
    )
    parser.add_argument(
        "--weights",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[8.0, 4.0, 2.0, 1.0],
        help="relative frequency of claim sizes 1,2,4,8 (default 8,4,2,1: ~2.1 GPUs a claim)",
    )
    parser.add_argument("--workers", type=int, default=4, help="controller --workers")
    parser.add_argument("--ceiling-leases", type=int, default=1000)
    parser.add_argument("--ceiling-concurrency", type=int, default=16)
    parser.add_argument(
        "--quiet", type=float, default=15.0, help="stop waiting after this long without progress"
    )
    parser.add_argument(
        "--webhook",
        action="store_true",
        help="run the webhook too, watching the claims, and report its peak RSS",
    )
    parser.add_argument(
        "--pods-per-node",
        type=int,
        default=0,
        help="plain pods bound to every GPU node before the controller starts (default 0)",
    )
    parser.add_argument(
        "--controller-tree",
        type=Path,
        default=REPO_ROOT,
        help="the checkout the controller process runs from (default: this one)",
    )
    parser.add_argument(
        "--dra",
        action="store_true",
        help="controller --dra: a ResourceClaim per allocated replica too (create + status write)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="control plane state (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    args.controller_tree = args.controller_tree.resolve()

    with local_plane.temporary("gpualloc-bench-", state_dir=args.state_dir) as (control_plane, workdir):
        result = asyncio.run(run(args, control_plane, workdir))
    local_plane.write(args.out, result)
    ttl = result["time_to_allocated_from_client_send_s"]
    ttl_ts = result["time_to_allocated_from_creation_timestamp_s"]
    print(
        f"allocated {result['allocated']}/{args.claims} claims "
        f"({result['config']['gpus_demanded']} GPUs asked, {result['config']['gpus_supplied']} exist) "
        f"in {result['allocation_span_seconds']} s: {result['allocations_per_second']} allocations/s\n"
        f"time to Allocated from send: p50 {ttl['p50']} s, p99 {ttl['p99']} s, max {ttl['max']} s; "
        f"from creationTimestamp: p50 {ttl_ts['p50']} s, p99 {ttl_ts['p99']} s\n"
        f"controller API requests per allocation: {result['requests_per_allocation']} "
        f"(writes {result['writes_per_allocation']}); "
        f"by request: {result['controller_requests']['by_request']}\n"
        f"lease-create ceiling: {result['lease_create_ceiling']['creates_per_second']} creates/s "
        f"at concurrency {args.ceiling_concurrency}; controller writes/s "
        f"{result['writes_per_second']} = {result['writes_per_second_over_ceiling']} of it\n"
        f"CPU ms per allocation: "
        + ", ".join(f"{name} {p['cpu_ms_per_allocation']}" for name, p in result["processes"].items())
        + f"; controller peak RSS {result['controller_peak_rss_mib']} MiB"
        + (f", webhook {result['webhook_peak_rss_mib']} MiB" if "webhook_peak_rss_mib" in result else "")
        + "\n"
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
