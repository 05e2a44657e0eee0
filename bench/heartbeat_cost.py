"""What one node heartbeat costs the API server: a GpuNodeStatus write against a Lease renewal.

    .venv/bin/python bench/heartbeat_cost.py [--nodes 200] [--heartbeats 3000] [--rounds 2]

Starts a local control plane with gpualloc's CRDs, publishes ``--nodes`` GPU nodes as
``controller_throughput.py`` does (8 GPUs, every pair NVLinked: a GpuNodeStatus of about
6 KB) and a heartbeat Lease for each, and watches both kinds the way the controller does
(one ``Reflector`` each). Then, ``--rounds`` times, it sends ``--heartbeats`` heartbeats
each way, 16 in flight, spread over the nodes:

* **status**: a merge patch of the GpuNodeStatus's ``status.lastHeartbeatTime`` (how every
  heartbeat was written before the agents had Leases, and still every tenth one);
* **lease**: a merge patch of the heartbeat Lease's ``spec.renewTime``
  (``gpualloc.kube.leases.renew``, what the agent sends).

Reported per heartbeat: the CPU of kube-apiserver and of etcd (``/proc``), and the rate
reached. Writes ``bench/results/heartbeat_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import controller_throughput  # noqa: E402
import local_plane  # noqa: E402
import procfs  # noqa: E402

from gpualloc.api import leases as lease_format  # noqa: E402
from gpualloc.kube import client, leases, resources, transport, watching  # noqa: E402

RESULT = ROOT / "bench" / "results" / "heartbeat_cost.json"
NAMESPACE = "heartbeats"


async def measure(plane: Any, nodes: int, heartbeats: int, rounds: int) -> dict[str, Any]:
    api = await client.connect(str(plane.kubeconfig), connections=24)
    feeds: list[asyncio.Task[None]] = []
    try:
        names = [f"hb-node-{i:04d}" for i in range(nodes)]
        await controller_throughput.bounded(
            16, [(lambda n=n: controller_throughput.create_node(api, n, 8)) for n in names]
        )
        await transport.request(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": NAMESPACE}})
        now = datetime.datetime.now(datetime.UTC)
        await controller_throughput.bounded(
            16,
            [
                (
                    lambda n=n: leases.create(
                        api, NAMESPACE, lease_format.heartbeat_lease(NAMESPACE, node=n, now=now)
                    )
                )
                for n in names
            ],
        )
        for reflector in (
            watching.Reflector(api, watching.NODE_STATUSES),
            watching.Reflector(api, watching.LEASES, namespace=NAMESPACE),
        ):
            feeds.append(asyncio.create_task(reflector.run()))
        crs = resources.CustomResources(api)
        running = plane.running()

        async def status_beat(i: int) -> None:
            stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            await crs.patch_node_status_status(names[i % nodes], {"status": {"lastHeartbeatTime": stamp}})

        async def lease_beat(i: int) -> None:
            await leases.renew(api, NAMESPACE, names[i % nodes], datetime.datetime.now(datetime.UTC))

        async def phase(beat: Callable[[int], Awaitable[None]]) -> dict[str, float]:
            before = {name: procfs.cpu_seconds(running[name]) for name in ("kube-apiserver", "etcd")}
            started = time.monotonic()
            await controller_throughput.bounded(16, [(lambda i=i: beat(i)) for i in range(heartbeats)])
            wall = time.monotonic() - started
            used = {name: procfs.cpu_seconds(running[name]) - cpu for name, cpu in before.items()}
            return {
                "kube_apiserver_cpu_ms_per_heartbeat": round(used["kube-apiserver"] / heartbeats * 1000, 2),
                "etcd_cpu_ms_per_heartbeat": round(used["etcd"] / heartbeats * 1000, 2),
                "heartbeats_per_second": round(heartbeats / wall, 1),
            }

        results: dict[str, list[dict[str, float]]] = {"status": [], "lease": []}
        for round_ in range(rounds):
            for kind, beat in (("status", status_beat), ("lease", lease_beat)):
                figures = await phase(beat)
                results[kind].append(figures)
                print(f"round {round_ + 1}, {kind}: {figures}", flush=True)
        return results
    finally:
        for task in feeds:
            task.cancel()
        await asyncio.gather(*feeds, return_exceptions=True)
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--heartbeats", type=int, default=3000, help="heartbeats of each kind per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    with local_plane.temporary("heartbeat-cost-") as (plane, _):
        results = asyncio.run(measure(plane, args.nodes, args.heartbeats, args.rounds))
    report = {
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["bench/heartbeat_cost.py", *sys.argv[1:]]),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg": os.getloadavg()},
        "nodes": args.nodes,
        "heartbeats_per_round": args.heartbeats,
        **results,
    }
    local_plane.write(args.out, report)
    for kind in ("status", "lease"):
        ms = [r["kube_apiserver_cpu_ms_per_heartbeat"] for r in results[kind]]
        print(f"{kind}: kube-apiserver {min(ms)} to {max(ms)} ms of CPU per heartbeat")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
