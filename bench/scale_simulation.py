"""The controller's own state and allocator at 10,000 GPU nodes, against the in-memory API model.

No API server and no network: the simulation's ``ApiServer`` (``tests/simulation/model.py``)
holds the objects and fans out watch events; the controller's ``State`` keeps its caches
and its node index from those events, exactly as it does from a real watch. One claim at a
time is created, its event delivered, and then placed as a reconcile places it
(``state.node_index()`` and ``allocator.allocate``). Its Leases and its Allocated status
are written back to the model, and their events are delivered before the next claim.

Reported (stdout and ``bench/results/scale_simulation.json``):
- decisions per second;
- the CPU per decision (index refresh plus allocate, p50/p99), and per claim with the event
  handling included;
- the process's peak RSS.

``--trace-memory`` measures instead what the controller itself keeps: the Python memory still
held by its ``State`` and caches once the model (what the API server would hold) is dropped,
counted by ``tracemalloc``. That slows every step, so the run reports no timings then.

    .venv/bin/python bench/scale_simulation.py --nodes 10000 --claims 50000
    .venv/bin/python bench/scale_simulation.py --nodes 10000 --claims 50000 --trace-memory \
        --out bench/results/scale_simulation_memory.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import platform
import random
import resource
import statistics
import sys
import time
import tracemalloc

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from controller import allocator, statuses, views  # noqa: E402
from controller.state import State  # noqa: E402
from gpualloc.api import leases  # noqa: E402
from tests.simulation import model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
NOW = datetime.datetime(2026, 11, 26, tzinfo=datetime.UTC)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--claims", type=int, default=50_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "scale_simulation.json")
    parser.add_argument(
        "--trace-memory",
        action="store_true",
        help="report the memory the controller's state keeps (tracemalloc), not timings",
    )
    args = parser.parse_args(argv)
    if args.trace_memory:
        tracemalloc.start()

    server = model.ApiServer(clock=lambda: NOW)
    watch = server.subscribe("bench")
    feeds = {kind: model.SimFeed(kind) for kind in model.KINDS}
    state = State(
        feeds, lease_namespace=model.NAMESPACE, node_stale_after=1e9, wake=lambda key: None, now=lambda: NOW
    )

    def deliver() -> None:
        for kind, queue in watch.queues.items():
            while queue:
                feeds[kind].apply(*queue.popleft())

    started = time.perf_counter()
    for i in range(args.nodes):
        server.add_gpu_node(f"node-{i:05d}", args.gpus)
    deliver()
    print(f"{args.nodes} nodes published in {time.perf_counter() - started:.1f} s", flush=True)

    rng = random.Random(args.seed)
    sizes = rng.choices([1, 2, 4, 8], weights=[8, 4, 2, 1], k=args.claims)
    decision_ms: list[float] = []
    claim_ms: list[float] = []
    allocated = gpus = 0
    started = time.perf_counter()
    for i, count in enumerate(sizes):
        c0 = time.thread_time()
        raw = server.create_claim("bench", f"c{i:05d}", {"devices": {"count": count}})
        deliver()
        claim = state.claim(f"bench/c{i:05d}")
        assert claim is not None
        d0 = time.thread_time()
        decision = allocator.allocate(claim, state.node_index(), seed=views.seed_for(claim.metadata.uid))
        decision_ms.append((time.thread_time() - d0) * 1000)
        if decision.ok:
            for alloc in decision.allocations:
                for device in alloc.devices:
                    server.create_lease(
                        leases.device_lease(
                            model.NAMESPACE,
                            lock_id=device.lock_id,
                            node=alloc.node_name,
                            claim_namespace="bench",
                            claim_name=claim.metadata.name,
                            claim_uid=claim.metadata.uid,
                            claim_resource_version=claim.metadata.resource_version,
                            now=NOW,
                        )
                    )
            patch = statuses.allocated_status(claim, decision.allocations, now=NOW)
            server.patch_claim_status(
                "bench", claim.metadata.name, patch, resource_version=raw["metadata"]["resourceVersion"]
            )
            deliver()
            allocated += 1
            gpus += count
        claim_ms.append((time.thread_time() - c0) * 1000)
        if (i + 1) % 5000 == 0:
            print(f"{i + 1} claims, {allocated} allocated ({gpus} GPUs)", flush=True)
    wall = time.perf_counter() - started
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if args.trace_memory:
        whole = tracemalloc.get_traced_memory()[0]
        del server, watch, raw, sizes, decision_ms, claim_ms  # all but the controller's state
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0]
        memory = {
            "benchmark": "scale_simulation --trace-memory",
            "nodes": args.nodes,
            "gpus_per_node": args.gpus,
            "claims": args.claims,
            "allocated": allocated,
            "leases": gpus,
            "objects_in_the_controller_caches": {kind: len(feed.cache) for kind, feed in feeds.items()},
            "python_memory_mib_model_and_controller": round(whole / 2**20, 1),
            "python_memory_mib_controller_state": round(kept / 2**20, 1),
            "python": platform.python_version(),
        }
        print(json.dumps(memory, indent=2))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(memory, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    result = {
        "benchmark": "scale_simulation",
        "nodes": args.nodes,
        "gpus_per_node": args.gpus,
        "claims": args.claims,
        "allocated": allocated,
        "gpus_allocated": gpus,
        "gpus_supplied": args.nodes * args.gpus,
        "wall_seconds": round(wall, 1),
        "decisions_per_second": round(args.claims / (sum(decision_ms) / 1000), 1),
        "claims_per_second_with_events": round(args.claims / (sum(claim_ms) / 1000), 1),
        "decision_cpu_ms": {
            "p50": round(statistics.median(decision_ms), 3),
            "p99": round(percentile(decision_ms, 0.99), 3),
            "max": round(max(decision_ms), 3),
        },
        "claim_cpu_ms_with_events": {
            "p50": round(statistics.median(claim_ms), 3),
            "p99": round(percentile(claim_ms, 0.99), 3),
        },
        "peak_rss_mib": round(peak_mib, 1),
        "python": platform.python_version(),
        "load_average_at_end": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
