"""How long a claim pod waits at the scheduling gate, against a real local kube-apiserver.

The webhook holds every claim pod behind ``gpu.scheduling/claim-allocated``;
the controller lifts the gate once it has read the claim from the API server
and found the pod's devices still its own (docs/api.md, "Every claim pod waits
at the gate"). That is one GET of the claim and one PATCH of the pod between
the pod's create and the scheduler seeing it: this bench measures what it costs.

Starts a control plane (``gpualloc.devcluster``), publishes ``--nodes``
simulated GPU nodes, starts ``gpualloc controller`` as a process, creates
``--claims`` claims of 1 GPU and waits until they are Allocated. Then it creates
``--pods`` pods, each as the webhook admits a pod of an Allocated claim (the
claim's devices in env and annotation, the node pin, the gate and the gated
label), spread over the claims, and a client-side watch records when each
pod's gate is gone:

* open loop, ``--rate`` pods/s: time from the client sending the create to the
  watch event without the gate, p50/p90/p99/max;
* saturation (``--saturation-pods`` created ``--concurrency`` at a time): gates
  lifted per second, and the CPU of each process per pod (controller,
  kube-apiserver, etcd) over the span, so one sees which process is the limit;
* the same number of pods created the same way without the gate (what the
  webhook wrote before every claim pod waited at it): pods created per second
  and the CPU of each process per pod. The difference is what the gate costs.

Writes bench/results/ungate_latency.json and prints a summary.

    .venv/bin/python bench/ungate_latency.py
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_plane
import procfs
from controller_throughput import (
    bounded,
    claim,
    create_node,
    retrying,
    start_controller,
    summary,
)

from gpualloc.api import constants
from gpualloc.devcluster import cluster
from gpualloc.kube import client, resources, transport, watching
from gpualloc.kube.client import Api

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "ungate_latency.json"
NAMESPACE, LEASES = "bench", "gpualloc-system"


def admitted_pod(name: str, claim_name: str, node: str, uuids: str) -> dict[str, Any]:
    """A pod as the webhook admits it for an Allocated claim (webhook.recipe.edits)."""
    env = [{"name": n, "value": uuids} for n in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {constants.LABEL_GATED: "true"},
            "annotations": {constants.ANNOTATION_CLAIM: claim_name, constants.ANNOTATION_DEVICES: uuids},
        },
        "spec": {
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "env": env}],
            "nodeSelector": {constants.HOSTNAME_LABEL: node},
            "schedulingGates": [{"name": constants.SCHEDULING_GATE}],
        },
    }


def ungated_pod(name: str, claim_name: str, node: str, uuids: str) -> dict[str, Any]:
    """The same pod without the gate and the gated label: the baseline."""
    body = admitted_pod(name, claim_name, node, uuids)
    del body["spec"]["schedulingGates"], body["metadata"]["labels"]
    return body


def gated(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == constants.SCHEDULING_GATE for g in pod["spec"].get("schedulingGates") or [])


async def run(args: argparse.Namespace, plane: cluster.ControlPlane, workdir: Path) -> dict[str, Any]:
    api: Api = await client.connect(str(plane.kubeconfig), connections=args.concurrency + 8)
    watchers: list[asyncio.Task[None]] = []
    controller = None
    try:
        for ns in (NAMESPACE, LEASES):
            await retrying(
                lambda ns=ns: transport.request(
                    api, "POST", "/api/v1/namespaces", body={"metadata": {"name": ns}}
                )
            )
        plane.ensure_service_account(NAMESPACE)
        nodes = [f"bench-node-{i:03d}" for i in range(args.nodes)]
        await bounded(8, [(lambda n=n: create_node(api, n, 8)) for n in nodes])

        claims: dict[str, dict[str, Any]] = {}
        ungated_at: dict[str, float] = {}

        def on_claim(type_: str, obj: dict[str, Any]) -> None:
            claims[obj["metadata"]["name"]] = obj

        def on_pod(type_: str, obj: dict[str, Any]) -> None:
            name = obj["metadata"]["name"]
            if type_ != watching.DELETED and not gated(obj) and name not in ungated_at:
                ungated_at[name] = time.time()

        for kind, handler in ((watching.CLAIMS, on_claim), (watching.PODS, on_pod)):
            reflector = watching.Reflector(api, kind, namespace=NAMESPACE, on_event=handler)
            watchers.append(asyncio.create_task(reflector.run()))
            await reflector.synced.wait()

        controller = start_controller(plane.kubeconfig, LEASES, args.workers, workdir / "controller.log")
        crs = resources.CustomResources(api)
        names = [f"claim-{i:03d}" for i in range(args.claims)]
        await bounded(
            8, [(lambda n=n: retrying(lambda: crs.create_claim(NAMESPACE, claim(n, 1)))) for n in names]
        )

        def allocation(name: str) -> tuple[str, str] | None:
            status = claims.get(name, {}).get("status") or {}
            if status.get("phase") != constants.PHASE_ALLOCATED:
                return None
            first = status["allocations"][0]
            return first["nodeName"], ",".join(d["uuid"] for d in first["devices"])

        deadline = time.monotonic() + 60
        while not all(allocation(n) for n in names):
            if controller.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"claims not allocated; see {workdir / 'controller.log'}")
            await asyncio.sleep(0.05)
        print(f"{len(names)} claims Allocated", flush=True)

        sent_at: dict[str, float] = {}

        async def create(pod: str, claim_name: str, make: Any = admitted_pod) -> None:
            node, uuids = allocation(claim_name) or ("", "")
            sent_at[pod] = time.time()
            await transport.request(
                api,
                "POST",
                f"/api/v1/namespaces/{NAMESPACE}/pods",
                body=make(pod, claim_name, node, uuids),
            )

        async def wait_for(pods: list[str]) -> None:
            deadline = time.monotonic() + 120
            while not all(p in ungated_at for p in pods):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{sum(p not in ungated_at for p in pods)} pods still gated after 120 s"
                    )
                await asyncio.sleep(0.01)

        # Open loop at --rate: the latency a pod sees at that load.
        open_pods = [f"open-{i:05d}" for i in range(args.pods)]
        start = time.time()

        async def paced(i: int, pod: str) -> None:
            await asyncio.sleep(max(0.0, start + i / args.rate - time.time()))
            await create(pod, names[i % len(names)])

        await asyncio.gather(*(paced(i, p) for i, p in enumerate(open_pods)))
        await wait_for(open_pods)
        latency = [ungated_at[p] - sent_at[p] for p in open_pods]
        print(f"open loop: {len(open_pods)} pods at {args.rate}/s", flush=True)

        # Saturation: as many in flight as --concurrency, CPU per pod of each process.
        pids = {"controller": controller.pid, **plane.running()}
        pids = {k: v for k, v in pids.items() if k in ("controller", "kube-apiserver", "etcd")}
        cpu_before = {k: procfs.cpu_seconds(v) for k, v in pids.items()}
        burst = [f"burst-{i:05d}" for i in range(args.saturation_pods)]
        start = time.time()
        await bounded(
            args.concurrency,
            [(lambda i=i, p=p: create(p, names[i % len(names)])) for i, p in enumerate(burst)],
        )
        await wait_for(burst)
        span = max(ungated_at[p] for p in burst) - start
        cpu = {k: procfs.cpu_seconds(v) - cpu_before[k] for k, v in pids.items()}

        # The baseline: the same pods, no gate (the controller has nothing to do with them).
        cpu_before = {k: procfs.cpu_seconds(v) for k, v in pids.items()}
        plain = [f"plain-{i:05d}" for i in range(args.saturation_pods)]
        start = time.time()
        await bounded(
            args.concurrency,
            [(lambda i=i, p=p: create(p, names[i % len(names)], ungated_pod)) for i, p in enumerate(plain)],
        )
        await wait_for(plain)
        plain_span = max(ungated_at[p] for p in plain) - start
        plain_cpu = {k: procfs.cpu_seconds(v) - cpu_before[k] for k, v in pids.items()}
        return {
            "config": {
                "nodes": args.nodes,
                "claims": args.claims,
                "pods_open_loop": args.pods,
                "rate": args.rate,
                "pods_saturation": args.saturation_pods,
                "concurrency": args.concurrency,
                "controller_workers": args.workers,
                "machine": f"{platform.machine()}, {platform.python_version()}",
            },
            "time_to_ungated_from_client_send_s": summary(latency),
            "saturation_ungates_per_second": round(len(burst) / span, 1),
            "saturation_span_seconds": round(span, 2),
            "cpu_ms_per_pod": {k: round(1000 * v / len(burst), 2) for k, v in cpu.items()},
            "without_gate_pods_per_second": round(len(plain) / plain_span, 1),
            "without_gate_cpu_ms_per_pod": {k: round(1000 * v / len(plain), 2) for k, v in plain_cpu.items()},
        }
    finally:
        for task in watchers:
            task.cancel()
        if controller is not None:
            controller.kill()
            controller.wait()
        await api.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--claims", type=int, default=16)
    parser.add_argument("--pods", type=int, default=400, help="pods created open loop at --rate")
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--saturation-pods", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4, help="controller --workers")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    with local_plane.temporary("gpualloc-bench-") as (control_plane, workdir):
        result = asyncio.run(run(args, control_plane, workdir))
    local_plane.write(args.out, result)
    t = result["time_to_ungated_from_client_send_s"]
    print(
        f"time from create to un-gated at {args.rate}/s: p50 {t['p50']} s, p90 {t['p90']} s, "
        f"p99 {t['p99']} s, max {t['max']} s\n"
        f"saturation: {result['saturation_ungates_per_second']} pods un-gated/s; CPU ms per pod: "
        + ", ".join(f"{k} {v}" for k, v in result["cpu_ms_per_pod"].items())
        + f"\nwithout the gate: {result['without_gate_pods_per_second']} pods created/s; CPU ms per pod: "
        + ", ".join(f"{k} {v}" for k, v in result["without_gate_cpu_ms_per_pod"].items())
        + f"\nwrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
