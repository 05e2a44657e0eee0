"""Controller (and webhook) memory under objects it does not own: N of them, each large.

What the controller caches of objects others write must not grow with what they put in
them. This starts a control plane, the controller as a process, and creates ``--count``
objects of one kind (``--objects``):

* ``pods`` (default 5,000): pods carrying the ``gpu.scheduling/gated=true`` label, our
  scheduling gate, a claim annotation and a ``--ballast-kb`` annotation (default 150 KB), as
  a tenant would without the chart's policies (the worst case: the chart's gated-label
  policy refuses such pods). Before issue 19 they went whole into the controller's cache.
* ``claims``: GpuClaims of one GPU, each with a ``--ballast-kb`` annotation, as a tenant with
  ``edit`` can create them. The webhook caches every claim too, so it runs here as well and
  its RSS is sampled beside the controller's.
* ``nodes``: core/v1 Nodes shaped as a kubelet reports them (50 images in the status, the
  usual labels, conditions, addresses and capacity; about 12 KB of JSON each), the Nodes of a
  large cluster. ``--ballast-kb`` is not used.

It samples VmRSS from /proc before, while and after, once the caches hold every object
(the Reflectors are not visible from outside, so it waits for RSS to settle after the last
create).

    .venv/bin/python bench/controller_memory.py --objects pods --count 5000 --ballast-kb 150
    .venv/bin/python bench/controller_memory.py --objects claims --count 2000 --ballast-kb 200 \
        --out bench/results/controller_memory_claims.json
    .venv/bin/python bench/controller_memory.py --objects nodes --count 5000 \
        --out bench/results/controller_memory_nodes.json
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

import controller_throughput as shared
import local_plane

from gpualloc.api import constants
from gpualloc.devcluster import cluster
from gpualloc.kube import client, transport

DEFAULT_OUT = shared.REPO_ROOT / "bench" / "results" / "controller_memory.json"
LIMIT_MIB = 384  # the chart's controller memory limit
WEBHOOK_LIMIT_MIB = 256  # the chart's webhook memory limit


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def hostile_pod(i: int, ballast: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"hostile-{i:05d}",
            "labels": {constants.LABEL_GATED: "true"},
            "annotations": {constants.ANNOTATION_CLAIM: f"claim-{i}", "ballast": ballast},
        },
        "spec": {
            "schedulingGates": [{"name": constants.SCHEDULING_GATE}],
            "containers": [{"name": "c", "image": "busybox"}],
        },
    }


def hostile_claim(i: int, ballast: str) -> dict[str, Any]:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": f"hostile-{i:05d}", "annotations": {"ballast": ballast}},
        "spec": {"devices": {"count": 1}},
    }


def kubelet_node(i: int) -> dict[str, Any]:
    """A Node as a kubelet of a GPU node reports it: labels, annotations, capacity, conditions and
    the 50 images ``--node-status-max-images`` lets it list."""
    name = f"gpu-node-{i:05d}"
    resources = {
        "cpu": "192",
        "memory": "2113407352Ki",
        "pods": "110",
        "ephemeral-storage": "3748905532Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
        "nvidia.com/gpu": "8",
    }
    condition = {
        "lastHeartbeatTime": "2026-11-26T10:00:00Z",
        "lastTransitionTime": "2026-11-20T08:00:00Z",
    }
    conditions = [
        {**condition, "type": t, "status": "False", "reason": f"KubeletHas{r}", "message": m}
        for t, r, m in (
            ("MemoryPressure", "SufficientMemory", "kubelet has sufficient memory available"),
            ("DiskPressure", "NoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "SufficientPID", "kubelet has sufficient PID available"),
        )
    ]
    conditions.append(
        {
            **condition,
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
        }
    )
    images = [
        {
            "names": [
                f"registry.example.com/ml/image-{j:02d}@sha256:{(i * 50 + j):064x}",
                f"registry.example.com/ml/image-{j:02d}:v1.{j}.0",
            ],
            "sizeBytes": 1_000_000_000 + j,
        }
        for j in range(50)
    ]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "beta.kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "node.kubernetes.io/instance-type": "p5.48xlarge",
                "topology.kubernetes.io/region": "us-east-1",
                "topology.kubernetes.io/zone": "us-east-1a",
                "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                "nvidia.com/gpu.count": "8",
            },
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                "csi.volume.kubernetes.io/nodeid": f'{{"ebs.csi.aws.com":"i-{i:017x}"}}',
            },
        },
        "spec": {
            "podCIDR": f"10.{i // 256 % 256}.{i % 256}.0/24",
            "providerID": f"aws:///us-east-1a/i-{i:017x}",
        },
        "status": {
            "capacity": resources,
            "allocatable": resources,
            "conditions": conditions,
            "addresses": [
                {"type": "InternalIP", "address": f"10.0.{i // 256 % 256}.{i % 256}"},
                {"type": "Hostname", "address": name},
                {"type": "InternalDNS", "address": f"{name}.ec2.internal"},
            ],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": f"{i:032x}",
                "systemUUID": f"ec2{i:05x}-0000-0000-0000-000000000000",
                "bootID": f"{i:08x}-0000-0000-0000-000000000000",
                "kernelVersion": "6.8.0-1019-aws",
                "osImage": "Ubuntu 24.04.1 LTS",
                "containerRuntimeVersion": "containerd://1.7.24",
                "kubeletVersion": "v1.36.3",
                "kubeProxyVersion": "v1.36.3",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
            "images": images,
        },
    }


async def run(args: argparse.Namespace, plane: cluster.ControlPlane, workdir: Path) -> dict[str, Any]:
    api = await client.connect(str(plane.kubeconfig))
    namespace = "tenant"
    samples: list[tuple[float, float, float]] = []
    processes = []
    try:
        for ns in (namespace, "gpualloc-system"):
            plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        plane.ensure_service_account(namespace)
        controller = shared.start_controller(
            plane.kubeconfig, "gpualloc-system", 4, workdir / "controller.log"
        )
        processes.append(controller)
        webhook = None
        if args.objects == "claims":
            webhook = shared.start_webhook(plane.kubeconfig, workdir)
            processes.append(webhook)
        started = time.monotonic()

        def sample() -> tuple[float, float]:
            now = (rss_mib(controller.pid), rss_mib(webhook.pid) if webhook else 0.0)
            samples.append((round(time.monotonic() - started, 1), round(now[0], 1), round(now[1], 1)))
            return now

        await asyncio.sleep(args.settle)
        before = sample()
        ballast = "x" * (args.ballast_kb * 1024)
        path, make = {
            "pods": (f"/api/v1/namespaces/{namespace}/pods", lambda i: hostile_pod(i, ballast)),
            "claims": (
                transport.collection_path(
                    constants.GROUP, constants.VERSION, constants.CLAIM_PLURAL, namespace
                ),
                lambda i: hostile_claim(i, ballast),
            ),
            "nodes": ("/api/v1/nodes", kubelet_node),
        }[args.objects]
        created = 0

        async def create(i: int) -> None:
            nonlocal created
            await shared.retrying(lambda: transport.request(api, "POST", path, body=make(i)))
            created += 1
            if created % 500 == 0:
                rss = sample()
                print(
                    f"  {created} {args.objects} created, RSS controller {rss[0]:.1f} MiB"
                    + (f", webhook {rss[1]:.1f} MiB" if webhook else ""),
                    flush=True,
                )

        create_started = time.monotonic()
        await shared.bounded(args.concurrency, [lambda i=i: create(i) for i in range(args.count)])
        create_seconds = time.monotonic() - create_started
        # Let the watches deliver everything and the heaps settle: RSS stable for settle seconds.
        peak = list(sample())
        stable_since = time.monotonic()
        last = peak[:]
        while time.monotonic() - stable_since < args.settle:
            await asyncio.sleep(1.0)
            now = sample()
            peak = [max(p, n) for p, n in zip(peak, now, strict=True)]
            if any(abs(n - was) > 1.0 for n, was in zip(now, last, strict=True)):
                stable_since = time.monotonic()
            last = list(now)
        after = sample()
        alive = {
            "controller": controller.poll() is None,
            **({"webhook": webhook.poll() is None} if webhook else {}),
        }
        figures = {
            "controller_rss_mib": {
                "before": round(before[0], 1),
                "after": round(after[0], 1),
                "peak": round(peak[0], 1),
            },
        }
        if webhook:
            figures["webhook_rss_mib"] = {
                "before": round(before[1], 1),
                "after": round(after[1], 1),
                "peak": round(peak[1], 1),
            }
        return {
            "objects": args.objects,
            "count": args.count,
            "ballast_kb": args.ballast_kb if args.objects != "nodes" else 0,
            **figures,
            "limit_mib": {"controller": LIMIT_MIB, **({"webhook": WEBHOOK_LIMIT_MIB} if webhook else {})},
            "under_limit": peak[0] < LIMIT_MIB and (not webhook or peak[1] < WEBHOOK_LIMIT_MIB),
            "alive": alive,
            "create_seconds": round(create_seconds, 1),
            "samples": samples,
            "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        }
    finally:
        shared.webhook_vegeta.stop_all(processes)
        await api.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--objects", choices=("pods", "claims", "nodes"), default="pods")
    parser.add_argument("--count", type=int, default=5000)
    parser.add_argument("--ballast-kb", type=int, default=150)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of stable RSS to wait for")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with local_plane.temporary("gpualloc-bench-mem-", crds=args.objects != "pods") as (
        control_plane,
        workdir,
    ):
        result = asyncio.run(run(args, control_plane, workdir))
    local_plane.write(args.out, result)
    rss = result["controller_rss_mib"]
    webhook = result.get("webhook_rss_mib")
    print(
        f"{args.count} {args.objects}"
        + (f" with {args.ballast_kb} KB annotations" if args.objects != "nodes" else "")
        + f", created in {result['create_seconds']} s; "
        f"controller RSS {rss['before']} MiB before, peak {rss['peak']} MiB, {rss['after']} MiB after"
        f" (limit {LIMIT_MIB} MiB)"
        + (
            f"; webhook RSS {webhook['before']} MiB before, peak {webhook['peak']} MiB"
            f" (limit {WEBHOOK_LIMIT_MIB} MiB)"
            if webhook
            else ""
        )
        + f"; wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
