"""One namespace floods the controller with claims that fit nowhere: does another namespace's claim wait?

Issue 37: with 3,000 Pending claims of 64 GPUs and priority 1 in one namespace, another
namespace's 1-GPU claim (priority 0) was not Allocated within 90 s. This bench starts the
local control plane (``local_plane``), publishes N simulated GPU nodes that heartbeat as the
agents do (``controller_throughput``'s, default 1,000 x 8 GPUs), starts ``gpualloc
controller`` and ``gpualloc webhook`` as processes, creates ``--flood`` claims (default
3,000) of ``--flood-count`` GPUs (64) and priority 1 in namespace ``flood``, and waits until
the controller has tried each once (its status carries the ``Allocated`` condition). Then,
``--rounds`` times (default 5), it creates a 1-GPU claim in namespace ``victim`` and measures
the time from the create to the watch event showing it Allocated, then deletes it. Every
other round runs with churn in the flood namespace: ``--churn-rate`` flood claims a second
deleted and created anew, so the flood keeps its size.

Reported (``bench/results/claim_flood_<date>.json`` and a table on stdout): each round's time
to Allocated; the controller's and the webhook's peak resident memory (VmHWM) next to the
chart's limits (``helm/gpualloc/values.yaml``); their CPU seconds while the flood was created
and tried, and during the rounds; the controller's API requests during the rounds.

    .venv/bin/python bench/claim_flood.py                                  # 1,000 nodes, 3,000 claims
    .venv/bin/python bench/claim_flood.py --nodes 100 --flood 3000 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import random
import sys
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import controller_throughput as throughput
import local_plane
import procfs
import webhook_vegeta

from gpualloc.api import constants
from gpualloc.api import leases as lease_format
from gpualloc.kube import client, errors, resources, transport, watching

REPO_ROOT = Path(__file__).resolve().parents[1]
VALUES = REPO_ROOT / "helm" / "gpualloc" / "values.yaml"
FLOOD_NS, VICTIM_NS, LEASE_NS = "flood", "victim", "gpualloc-system"


def flood_claim(name: str, count: int, priority: int) -> dict[str, Any]:
    body = throughput.claim(name, count)
    body["spec"]["priority"] = priority
    return body


def chart_limit_mib(component: str) -> float:
    """The chart's memory limit of ``component`` (``controller``, ``webhook``) in MiB."""
    text = str(yaml.safe_load(VALUES.read_text())[component]["resources"]["limits"]["memory"])
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text) / 2**20


def tried(obj: dict[str, Any]) -> bool:
    """The controller has looked at the claim and said why it waits (or allocated it)."""
    status = obj.get("status") or {}
    return bool(status.get("conditions")) or status.get("phase") == constants.PHASE_ALLOCATED


async def churn(api: Any, names: list[str], rate: float, count: int, rng: random.Random) -> None:
    """Delete a random flood claim and create a new one, ``rate`` times a second, until cancelled."""
    crs = resources.CustomResources(api)
    made = 0
    while True:
        started = time.monotonic()
        gone = names.pop(rng.randrange(len(names)))
        with contextlib.suppress(errors.KubeError):
            await crs.delete_claim(FLOOD_NS, gone)
        name = f"churn-{made:06d}"
        made += 1
        with contextlib.suppress(errors.KubeError):
            await crs.create_claim(FLOOD_NS, flood_claim(name, count, 1))
            names.append(name)
        await asyncio.sleep(max(0.0, 1.0 / rate - (time.monotonic() - started)))


async def run(args: argparse.Namespace, plane: Any, workdir: Path) -> dict[str, Any]:
    api = await client.connect(str(plane.kubeconfig), connections=args.concurrency + 8)
    rng = random.Random(args.seed)
    heartbeat_ns = lease_format.heartbeat_namespace(LEASE_NS)
    processes: dict[str, Any] = {}
    tasks: list[asyncio.Task[None]] = []
    try:
        for ns in (FLOOD_NS, VICTIM_NS, LEASE_NS, heartbeat_ns):
            await throughput.retrying(
                lambda ns=ns: transport.request(
                    api, "POST", "/api/v1/namespaces", body={"metadata": {"name": ns}}
                )
            )
        if args.finalizer_policy:
            await throughput.install_policy(api, throughput.render_finalizer_policy(), VICTIM_NS)
        node_names = [f"bench-node-{i:04d}" for i in range(args.nodes)]
        await throughput.bounded(
            16, [(lambda n=n: throughput.create_node(api, n, args.gpus)) for n in node_names]
        )
        print(f"{args.nodes} nodes of {args.gpus} GPUs published", flush=True)
        tasks.append(
            asyncio.create_task(throughput.heartbeats(api, node_names, args.heartbeat, heartbeat_ns))
        )

        seen_tried: set[str] = set()
        allocated_at: dict[str, float] = {}
        arrived: dict[str, asyncio.Event] = {}  # set when the claim is first seen Allocated

        def on_claim(type_: str, obj: dict[str, Any]) -> None:
            meta = obj["metadata"]
            key = f"{meta['namespace']}/{meta['name']}"
            if type_ == watching.DELETED:
                seen_tried.discard(key)
                return
            if tried(obj):
                seen_tried.add(key)
            if (obj.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED:
                allocated_at.setdefault(key, time.time())
                arrived.setdefault(key, asyncio.Event()).set()

        reflector = watching.Reflector(api, watching.CLAIMS, on_event=on_claim)
        tasks.append(asyncio.create_task(reflector.run()))
        await reflector.synced.wait()

        controller = throughput.start_controller(
            plane.kubeconfig, LEASE_NS, args.workers, workdir / "controller.log"
        )
        processes["controller"] = controller
        processes["webhook"] = throughput.start_webhook(plane.kubeconfig, workdir)
        crs = resources.CustomResources(api)
        warmup_sent = time.time()
        await throughput.retrying(lambda: crs.create_claim(VICTIM_NS, throughput.claim("warmup", 1)))
        deadline = time.monotonic() + 60
        while f"{VICTIM_NS}/warmup" not in allocated_at:
            if controller.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"controller not allocating; see {workdir / 'controller.log'}")
            await asyncio.sleep(0.05)
        idle_ttl = allocated_at[f"{VICTIM_NS}/warmup"] - warmup_sent
        await crs.delete_claim(VICTIM_NS, "warmup")
        pids = {name: p.pid for name, p in processes.items()}

        def cpu() -> dict[str, float]:
            return {name: procfs.cpu_seconds(pid) for name, pid in pids.items()}

        # The flood.
        cpu_before = cpu()
        started = time.time()
        names = [f"flood-{i:05d}" for i in range(args.flood)]
        await throughput.bounded(
            args.concurrency,
            [(lambda n=n: crs.create_claim(FLOOD_NS, flood_claim(n, args.flood_count, 1))) for n in names],
        )
        created = time.time()
        print(f"{args.flood} flood claims created in {created - started:.1f} s", flush=True)
        deadline = time.monotonic() + args.tried_timeout
        while sum(1 for n in names if f"{FLOOD_NS}/{n}" in seen_tried) < len(names):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        tried_all = time.time()
        n_tried = sum(1 for n in names if f"{FLOOD_NS}/{n}" in seen_tried)
        flood_cpu = {name: round(used - cpu_before[name], 2) for name, used in cpu().items()}
        print(
            f"{n_tried}/{len(names)} flood claims tried, {tried_all - started:.1f} s from the first create",
            flush=True,
        )

        # The rounds.
        rounds: list[dict[str, Any]] = []
        audit_offset = plane.audit_log.stat().st_size
        cpu_before = cpu()
        rounds_started = time.time()
        for r in range(args.rounds):
            churning = r % 2 == 1
            churner = (
                asyncio.create_task(churn(api, names, args.churn_rate, args.flood_count, rng))
                if churning
                else None
            )
            if churner is not None:
                await asyncio.sleep(args.churn_lead)  # the churn is under way when the victim comes
            name = f"victim-{r:02d}"
            sent = time.time()
            await crs.create_claim(VICTIM_NS, throughput.claim(name, 1))
            key = f"{VICTIM_NS}/{name}"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(asyncio.get_running_loop().time() + args.victim_timeout):
                    await arrived.setdefault(key, asyncio.Event()).wait()
            waited = allocated_at[key] - sent if key in allocated_at else None
            if churner is not None:
                churner.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await churner
            rounds.append(
                {"round": r, "churn": churning, "time_to_allocated_s": round(waited, 3) if waited else None}
            )
            print(
                f"round {r}: churn {'yes' if churning else 'no '}  "
                + (
                    f"Allocated in {waited:.3f} s"
                    if waited is not None
                    else f"not Allocated in {args.victim_timeout} s"
                ),
                flush=True,
            )
            await crs.delete_claim(VICTIM_NS, name)
            await asyncio.sleep(args.pause)
        rounds_ended = time.time()
        rounds_cpu = {name: round(used - cpu_before[name], 2) for name, used in cpu().items()}
        await asyncio.sleep(1.0)  # the audit log catches up
        audit = throughput.audit_counts(plane.audit_log, audit_offset, until=rounds_ended)
        peak = {name: procfs.memory_kib(pid).get("VmHWM", 0) / 1024 for name, pid in pids.items()}
        now_rss = {name: procfs.memory_kib(pid).get("VmRSS", 0) / 1024 for name, pid in pids.items()}
        times = [r["time_to_allocated_s"] for r in rounds if r["time_to_allocated_s"] is not None]
        span = rounds_ended - rounds_started
        return {
            **procfs.run_stamp(),
            "config": {
                "nodes": args.nodes,
                "gpus_per_node": args.gpus,
                "flood_claims": args.flood,
                "flood_count": args.flood_count,
                "flood_priority": 1,
                "victim_count": 1,
                "victim_priority": 0,
                "rounds": args.rounds,
                "churn_rate_per_second": args.churn_rate,
                "heartbeat_seconds": args.heartbeat,
                "controller_workers": args.workers,
                "finalizer_policy": args.finalizer_policy,
                "seed": args.seed,
            },
            "idle_time_to_allocated_s": round(idle_ttl, 3),  # the first claim, before the flood
            "flood_create_seconds": round(created - started, 2),
            "flood_tried": n_tried,
            "flood_tried_seconds": round(tried_all - started, 2),
            "rounds": rounds,
            "time_to_allocated_s": throughput.summary(times),
            "all_within_1s": len(times) == len(rounds) and all(t < 1.0 for t in times),
            "cpu_seconds_flood_phase": flood_cpu,
            "cpu_seconds_rounds": rounds_cpu,
            "cores_busy_rounds": {name: round(used / span, 2) for name, used in rounds_cpu.items()}
            if span > 0
            else {},
            "controller_requests_rounds": audit,
            "peak_rss_mib": {name: round(v, 1) for name, v in peak.items()},
            "rss_at_end_mib": {name: round(v, 1) for name, v in now_rss.items()},
            "chart_limit_mib": {name: chart_limit_mib(name) for name in pids},
        }
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        webhook_vegeta.stop_all(list(processes.values()))
        await api.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--flood", type=int, default=3000, help="claims in the flood namespace")
    parser.add_argument("--flood-count", type=int, default=64, help="GPUs each flood claim asks for")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--churn-rate", type=float, default=20.0, help="flood claims replaced a second")
    parser.add_argument("--churn-lead", type=float, default=3.0, help="seconds of churn before the victim")
    parser.add_argument("--victim-timeout", type=float, default=90.0)
    parser.add_argument(
        "--tried-timeout", type=float, default=600.0, help="longest wait for the flood's first tries"
    )
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between rounds")
    parser.add_argument("--concurrency", type=int, default=32, help="creates in flight")
    parser.add_argument("--heartbeat", type=float, default=30.0, help="seconds between a node's heartbeats")
    parser.add_argument("--workers", type=int, default=4, help="controller --workers")
    parser.add_argument(
        "--finalizer-policy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="install the chart's claim-finalizer MutatingAdmissionPolicy (default: yes)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=None, help="default: bench/results/claim_flood_<date>.json"
    )
    parser.add_argument(
        "--state-dir", type=Path, default=None, help="control plane state (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    out = (
        args.out or REPO_ROOT / "bench" / "results" / f"claim_flood_{datetime.date.today().isoformat()}.json"
    )

    with local_plane.temporary("gpualloc-flood-", state_dir=args.state_dir) as (control_plane, workdir):
        result = asyncio.run(run(args, control_plane, workdir))
    local_plane.write(out, result)
    print()
    print("| round | churn | time to Allocated |")
    print("|---|---|---|")
    for r in result["rounds"]:
        took = r["time_to_allocated_s"]
        shown = f"{took:.3f} s" if took is not None else "not Allocated"
        print(f"| {r['round']} | {'yes' if r['churn'] else 'no'} | {shown} |")
    print()
    for name in ("controller", "webhook"):
        peak, limit = result["peak_rss_mib"][name], result["chart_limit_mib"][name]
        flood_cpu, rounds_cpu = result["cpu_seconds_flood_phase"][name], result["cpu_seconds_rounds"][name]
        print(
            f"{name}: peak RSS {peak} MiB (chart limit {limit:g} MiB); CPU {flood_cpu} s while the flood "
            f"was created and tried, {rounds_cpu} s in the rounds "
            f"({result['cores_busy_rounds'].get(name)} cores)"
        )
    print(f"controller requests during the rounds: {result['controller_requests_rounds']}")
    print(f"every round within 1 s: {result['all_within_1s']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
