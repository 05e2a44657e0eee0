"""GPU-hours accounting against the device Leases' lifetimes, across a controller restart (issue 40).

Starts a local control plane (etcd, kube-apiserver), ``--nodes`` GPU nodes of 8 GPUs, and the
controller in this process (``controller.main.run``, as the integration tests run it), serving
/metrics. ``--claims`` claims of 1, 2 or 4 GPUs are created at once; each is deleted at a random
moment in (0.1, 1.2) x ``--duration`` seconds (those drawn past the end are still held then). At
``--restart-at`` x duration the controller is stopped, ``--gap`` seconds pass without one, and a new
one starts. A ``LeaseClock`` (tests/integration/usage_support.py) watches the Leases on its own
connection: a Lease's lifetime is from its ``spec.acquireTime`` to when it was seen DELETED.

Compared with those lifetimes, per claim (drift = |counted - lifetime| / lifetime):

* ``first``: the first controller's ``gpualloc_gpu_seconds_total``, scraped just before it stops,
  for every claim (released or held);
* ``second``: the new controller's, scraped at the end: the claims released after it started
  (most held across the restart) and those still held;
* ``cli``: ``gpualloc get usage -o json`` at the end, for the claims still held;
* ``lost``: the claims released before the second controller started, which it never reports
  (the documented limit: Prometheus has the first's last value); of those, the ones released
  while no controller ran lose their seconds since the first's last scrape (``gap_lost``).

Writes bench/results/usage_drift-<date>.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.integration's helpers
import local_plane

from gpualloc.devcluster import cluster
from gpualloc.kube import client, resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration import usage_support as usage

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
NAMESPACE = "usage-drift"
SIZES = (1, 2, 4)

Key = usage.ClaimKey


def summary(drifts: dict[str, float]) -> dict[str, Any]:
    values = sorted(drifts.values())
    if not values:
        return {"claims": 0}
    return {
        "claims": len(values),
        "median_pct": round(100 * statistics.median(values), 4),
        "max_pct": round(100 * values[-1], 4),
        "worst": max(drifts, key=lambda k: drifts[k]),
    }


def compare(
    counted: dict[Key, float], clock: usage.LeaseClock, keys: list[Key], now: dt.datetime
) -> dict[str, float]:
    return {key[1]: usage.drift(counted[key], clock.seconds(key, now)) for key in keys if key in counted}


async def run(args: argparse.Namespace, plane: cluster.ControlPlane) -> dict[str, Any]:
    api: Api = await client.connect(str(plane.kubeconfig))
    kubeconfig = str(plane.kubeconfig)
    rng = random.Random(args.seed)
    run_id = f"drift{args.seed}"
    try:
        await transport.request(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": NAMESPACE}})
        for i in range(args.nodes):
            await support.create_gpu_node(api, f"gpu-{i}", labels={support.RUN_LABEL: run_id})
        clock = usage.LeaseClock(api, NAMESPACE)
        watch = asyncio.create_task(clock.run())
        await clock.reflector.synced.wait()
        crs = resources.CustomResources(api)
        names = [f"c{i:03d}" for i in range(args.claims)]
        release_at = {name: rng.uniform(0.1, 1.2) * args.duration for name in names}
        ports = usage.free_port(), usage.free_port()
        argv = support.controller_argv(NAMESPACE, "--metrics-port", str(ports[0]), run=run_id)
        started = time.monotonic()
        deleted: dict[str, float] = {}

        async def release_due() -> None:
            for name in names:
                if name not in deleted and time.monotonic() - started >= release_at[name]:
                    deleted[name] = time.monotonic() - started
                    await crs.delete_claim(NAMESPACE, name)

        async def until(moment: float) -> None:
            while time.monotonic() - started < moment:
                await release_due()
                await asyncio.sleep(0.05)

        async with support.running_controller(kubeconfig, argv):
            for i, name in enumerate(names):
                await crs.create_claim(NAMESPACE, support.claim_body(name, SIZES[i % len(SIZES)], run=run_id))
            for name in names:
                await support.wait_phase(api, NAMESPACE, name, "Allocated", within=60)
            await until(args.restart_at * args.duration)
            keys = [(NAMESPACE, n) for n in names]
            await asyncio.sleep(1.0)  # the last deletions reach both watches
            first = await usage.scrape(ports[0])
            first_drift = compare(first, clock, keys, dt.datetime.now(dt.UTC))
        stopped = time.monotonic() - started
        await until(stopped + args.gap)
        argv = support.controller_argv(NAMESPACE, "--metrics-port", str(ports[1]), run=run_id)
        async with support.running_controller(kubeconfig, argv):
            second_start = time.monotonic() - started
            await until(args.duration)
            await asyncio.sleep(1.0)
            second = await usage.scrape(ports[1])
            second_now = dt.datetime.now(dt.UTC)
            answer = await usage.usage_cli(kubeconfig, NAMESPACE, NAMESPACE)
        lost = [n for n, t in deleted.items() if t < second_start]
        after = [(NAMESPACE, n) for n in names if n not in lost]
        held = [(NAMESPACE, n) for n in names if n not in deleted]
        second_drift = compare(second, clock, after, second_now)
        cli_drift = compare(answer.seconds, clock, held, answer.now)
        in_gap = [(NAMESPACE, n) for n in lost if deleted[n] >= stopped]
        gap_lost = sum(clock.seconds(k, second_now) - first.get(k, 0.0) for k in in_gap)
        counted = [k for k in after if k in second]
        total_counted = sum(second[k] for k in counted)
        total_life = sum(clock.seconds(k, second_now) for k in counted)
        watch.cancel()
        return {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "args": {k: v for k, v in vars(args).items() if k != "out"},
            "gpus": args.nodes * 8,
            "restart": {"stopped_s": round(stopped, 2), "second_started_s": round(second_start, 2)},
            "first": summary(first_drift),
            "second": summary(second_drift),
            "second_released_after_restart": summary({n: d for n, d in second_drift.items() if n in deleted}),
            "second_total_drift_pct": round(100 * usage.drift(total_counted, total_life), 4),
            "second_gpu_seconds": round(total_counted, 2),
            "cli": summary(cli_drift),
            "lost_claims": len(lost),
            # Released with no controller running: the seconds since the first's last scrape are
            # on no record (what Prometheus would miss, had it scraped when this bench did).
            "released_in_gap": len(in_gap),
            "gap_lost_gpu_seconds": round(gap_lost, 3),
            "all_gpu_seconds": round(sum(clock.seconds((NAMESPACE, n), second_now) for n in names), 2),
            "missing_series": sorted(k[1] for k in after if k not in second),
        }
    finally:
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--claims", type=int, default=24)
    parser.add_argument(
        "--duration", type=float, default=60.0, help="seconds from the allocations to the end"
    )
    parser.add_argument(
        "--restart-at", type=float, default=0.5, help="when the controller restarts (fraction)"
    )
    parser.add_argument("--gap", type=float, default=2.0, help="seconds without a controller")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or RESULTS / f"usage_drift-{dt.date.today().isoformat()}.json"
    with local_plane.temporary("usage-drift-") as (plane, _):
        result = asyncio.run(run(args, plane))
    local_plane.write(out, result)
    for part in ("first", "second", "cli"):
        print(f"{part}: {result[part]}")
    total, seconds = result["second_total_drift_pct"], result["second_gpu_seconds"]
    print(f"second, all the claims it counts: {total} % of {seconds} GPU-s")
    print(f"lost (released before the second controller started): {result['lost_claims']}")
    print(
        f"released with no controller: {result['released_in_gap']} claims,"
        f" {result['gap_lost_gpu_seconds']} of {result['all_gpu_seconds']} GPU-s on no record"
    )
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
