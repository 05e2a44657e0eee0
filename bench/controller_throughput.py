"""End-to-end controller throughput against a real local kube-apiserver.

Starts a control plane (``gpualloc.devcluster``), publishes N simulated GPU
nodes (a Node plus a GpuNodeStatus each, default 100 x 8 GPUs), measures the
Lease-create ceiling of this client library against this API server, then
starts ``gpualloc controller`` as a process and creates M claims (default 400,
sizes 1/2/4/8) at ``--rate`` per second, open loop. A client-side watch
records when each claim is first seen Allocated.

Reported (``bench/results/controller_throughput.json`` and stdout):

* allocations per second: allocated claims / (last allocation - first create);
* time to Allocated, p50/p90/p99/max: from ``creationTimestamp`` (one-second
  resolution, as the API stores it) and from the moment the client sent the
  create (sub-millisecond) to the watch event showing ``phase: Allocated``;
* API requests per allocation: the controller's requests in the audit log
  (matched by its user agent), all and writes only, per allocated claim;
* the ceiling: Lease creates per second with ``--ceiling-concurrency`` in
  flight, through the same ``gpualloc.kube.leases`` calls the controller uses.

    .venv/bin/python bench/controller_throughput.py --nodes 100 --claims 400 --rate 50
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient

from gpualloc.api import constants
from gpualloc.devcluster import binaries, cluster
from gpualloc.kube import client, errors, leases, resources, transport, watching

REPO_ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = REPO_ROOT / "helm" / "gpualloc" / "crds"
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "controller_throughput.json"
CONTROLLER_AGENT = "gpualloc-controller"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


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


async def create_node(api: ApiClient, name: str, gpus: int) -> None:
    crs = resources.CustomResources(api)
    body = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
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


async def bounded(concurrency: int, jobs: list[Any]) -> list[Any]:
    limit = asyncio.Semaphore(concurrency)

    async def one(job: Any) -> Any:
        async with limit:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


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


async def lease_ceiling(api: ApiClient, namespace: str, count: int, concurrency: int) -> dict[str, Any]:
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


def audit_counts(audit_log: Path, offset: int) -> dict[str, Any]:
    """The controller's requests in the audit log after ``offset`` bytes, by verb and resource."""
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


def start_controller(
    kubeconfig: Path, namespace: str, workers: int, log_path: Path
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
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
        )


async def run(args: argparse.Namespace, plane: cluster.ControlPlane, workdir: Path) -> dict[str, Any]:
    api = await client.connect(str(plane.kubeconfig))
    rng = random.Random(args.seed)
    claims_ns, lease_ns, scratch_ns = "bench", "gpualloc-system", "bench-ceiling"
    controller: subprocess.Popen[bytes] | None = None
    watcher: asyncio.Task[None] | None = None
    try:
        for ns in (claims_ns, lease_ns, scratch_ns):
            await retrying(
                lambda ns=ns: transport.request(
                    api, "POST", "/api/v1/namespaces", body={"metadata": {"name": ns}}
                )
            )
        node_names = [f"bench-node-{i:03d}" for i in range(args.nodes)]
        await bounded(16, [(lambda n=n: create_node(api, n, args.gpus)) for n in node_names])
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

        log_path = workdir / "controller.log"
        controller = start_controller(plane.kubeconfig, lease_ns, args.workers, log_path)
        # Readiness without a probe port: the first claim (not counted) comes back Allocated.
        await retrying(lambda: resources.CustomResources(api).create_claim(claims_ns, claim("warmup", 1)))
        deadline = time.monotonic() + 60
        while "warmup" not in allocated_at:
            if controller.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"controller not allocating; see {log_path}")
            await asyncio.sleep(0.05)

        audit_offset = plane.audit_log.stat().st_size
        sizes = rng.choices([1, 2, 4, 8], weights=args.weights, k=args.claims)
        sent_at: dict[str, float] = {}
        crs = resources.CustomResources(api)
        start = time.time()

        async def create(i: int) -> None:
            await asyncio.sleep(max(0.0, start + i / args.rate - time.time()))
            name = f"claim-{i:04d}"
            sent_at[name] = time.time()
            await crs.create_claim(claims_ns, claim(name, sizes[i]))

        await asyncio.gather(*(create(i) for i in range(args.claims)))
        created_all = time.time()
        # Wait for the last allocations: until every claim is Allocated or nothing moved for a while.
        last_count, last_change = -1, time.time()
        while True:
            count = sum(1 for name in sent_at if name in allocated_at)
            if count != last_count:
                last_count, last_change = count, time.time()
            if count == len(sent_at) or time.time() - last_change > args.quiet:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # let the audit log catch up
        audit = audit_counts(plane.audit_log, audit_offset)

        done = [n for n in sent_at if n in allocated_at]
        from_send = [allocated_at[n] - sent_at[n] for n in done]
        from_ts: list[float] = []
        for n in done:
            stamp = created_ts.get(n, "")
            if stamp:
                created = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
                from_ts.append(allocated_at[n] - created)
        last = max((allocated_at[n] for n in done), default=start)
        span = last - start
        demand = sum(sizes)
        result = {
            "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
            "config": {
                "nodes": args.nodes,
                "gpus_per_node": args.gpus,
                "claims": args.claims,
                "rate_per_second": args.rate,
                "size_weights_1_2_4_8": args.weights,
                "gpus_demanded": demand,
                "gpus_supplied": args.nodes * args.gpus,
                "controller_workers": args.workers,
                "seed": args.seed,
            },
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
            "lease_create_ceiling": ceiling,
        }
        return result
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        if controller is not None and controller.poll() is None:
            controller.terminate()
            try:
                controller.wait(20)
            except subprocess.TimeoutExpired:
                controller.kill()
                controller.wait()
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
    parser.add_argument("--rate", type=float, default=50.0, help="claims created per second")
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
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="control plane state (default: a temp dir)"
    )
    args = parser.parse_args(argv)

    paths = binaries.ensure(["kube-apiserver", "etcd"])
    with tempfile.TemporaryDirectory(prefix="gpualloc-bench-") as tmp:
        workdir = Path(tmp)
        plane = cluster.ControlPlane(args.state_dir or workdir / "plane", binaries=paths)
        plane.start()
        try:
            plane.apply_crds(CRD_DIR)
            result = asyncio.run(run(args, plane, workdir))
        finally:
            plane.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
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
        f"at concurrency {args.ceiling_concurrency}\n"
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
