"""The CPU a gpualloc process spends per API request and per watch event, on the real API server.

    .venv/bin/python bench/client_cost.py [--requests 3000] [--concurrency 4]

The controller's work per allocation is a handful of writes (the Lease of each
GPU, the claim's status) and the watch events they and the cluster cause (the
claim's, each Lease's, node heartbeats). Whatever the allocator does, those cost
the process CPU in the HTTP client, TLS, JSON and the caches. This measures
them alone, with the controller's own client and event loop
(``gpualloc.kube.client.Api`` on uvloop, ``gpualloc.runtime.eventloop``):

* **write**: ``--requests`` Lease creates, ``--concurrency`` at a time, each
  answer read and parsed, as ``controller.locking`` creates a GPU's Lease:
  this process's CPU (``time.process_time``, every thread) per request;
* **watch event**: a second process creates as many Leases while this one
  only watches them with a ``Reflector`` (the controller's cache): this
  process's CPU per event received and stored.

Multiplying by the writes and events an allocation causes
(``controller_throughput.py`` reports both) gives the CPU an allocation costs
before any allocation logic runs: the floor of the controller's CPU per
allocation in this architecture. Writes bench/results/client_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpualloc.api import leases as lease_format  # noqa: E402
from gpualloc.devcluster import binaries, cluster  # noqa: E402
from gpualloc.kube import client, leases, transport, watching  # noqa: E402
from gpualloc.runtime import eventloop  # noqa: E402

RESULT = ROOT / "bench" / "results" / "client_cost.json"


async def create_leases(api: client.Api, namespace: str, prefix: str, n: int, concurrency: int) -> None:
    """``n`` Leases named ``prefix-<i>``, ``concurrency`` requests at a time."""
    now = datetime.datetime.now(datetime.UTC)
    names = iter(range(n))

    async def sender() -> None:
        for i in names:
            body = lease_format.body(
                namespace, f"{prefix}-{i}", holder="bench", labels={"bench": prefix}, now=now
            )
            await leases.create(api, namespace, body)

    await asyncio.gather(*(sender() for _ in range(concurrency)))


async def measure(kubeconfig: str, namespace: str, n: int, concurrency: int) -> dict[str, Any]:
    api = await client.connect(kubeconfig, connections=concurrency + 2)
    try:
        await transport.request(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
        await create_leases(api, namespace, "warm", 100, concurrency)  # connections, imports, caches
        cpu, wall = time.process_time(), time.monotonic()
        await create_leases(api, namespace, "write", n, concurrency)
        write_cpu, write_wall = time.process_time() - cpu, time.monotonic() - wall

        all_seen = asyncio.Event()

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            if len(reflector.cache) >= n:
                all_seen.set()

        reflector = watching.Reflector(
            api, watching.LEASES, namespace=namespace, label_selector="bench=watched", on_event=on_event
        )
        task = asyncio.create_task(reflector.run())
        await reflector.synced.wait()
        cpu, wall = time.process_time(), time.monotonic()
        creator = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--create", str(n), "--kubeconfig", kubeconfig, "--namespace", namespace
        )
        await all_seen.wait()
        watch_cpu, watch_wall = time.process_time() - cpu, time.monotonic() - wall
        await creator.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await api.close()
    return {
        "write": {
            "requests": n,
            "concurrency": concurrency,
            "wall_s": round(write_wall, 2),
            "cpu_s": round(write_cpu, 3),
            "cpu_ms_per_request": round(1e3 * write_cpu / n, 3),
        },
        "watch_event": {
            "events": n,
            "wall_s": round(watch_wall, 2),
            "cpu_s": round(watch_cpu, 3),
            "cpu_ms_per_event": round(1e3 * watch_cpu / n, 3),
        },
    }


async def create_only(kubeconfig: str, namespace: str, n: int) -> None:
    api = await client.connect(kubeconfig, connections=6)
    try:
        await create_leases(api, namespace, "watched", n, 4)
    finally:
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="Lease creates per phase")
    parser.add_argument(
        "--concurrency", type=int, default=4, help="requests in flight (the controller's workers)"
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--create", type=int, help=argparse.SUPPRESS)  # the second process
    parser.add_argument("--kubeconfig", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", default="client-cost", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.create is not None:
        eventloop.run(create_only(args.kubeconfig, args.namespace, args.create))
        return 0
    bins = binaries.ensure(["etcd", "kube-apiserver"], progress=lambda m: print(m, file=sys.stderr))
    with tempfile.TemporaryDirectory(prefix="client-cost-") as tmp:
        plane = cluster.ControlPlane(Path(tmp), binaries=bins)
        plane.start()
        try:
            kubeconfig = str(plane.kubeconfig)
            figures = eventloop.run(measure(kubeconfig, args.namespace, args.requests, args.concurrency))
        finally:
            plane.stop()
    report = {
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["bench/client_cost.py", *sys.argv[1:]]),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "loadavg": os.getloadavg()},
        **figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    write, event = figures["write"], figures["watch_event"]
    print(
        f"write (Lease create, {write['concurrency']} in flight): {write['cpu_ms_per_request']:.3f} ms "
        f"CPU per request ({write['requests']} in {write['wall_s']} s)"
    )
    print(f"watch event (Lease ADDED, into a Reflector): {event['cpu_ms_per_event']:.3f} ms CPU per event")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
