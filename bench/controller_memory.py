"""Controller memory under hostile pods: N gated-looking pods, each with a large annotation.

A tenant can create pods; before issue 19 any pod labelled ``gpu.scheduling/gated=true``
went whole into the controller's cache. This starts a control plane, the
controller as a process, and creates ``--pods`` pods (default 5,000) carrying
that label, our scheduling gate, a claim annotation and a ``--ballast-kb``
annotation (default 150 KB), as a tenant would without the chart's policies
(the worst case: the chart's gated-label policy refuses such pods). It samples
the controller's RSS (VmRSS from /proc) before, while and after, once its cache
holds every pod (the controller's own pods Reflector is not visible from
outside, so it waits for RSS to settle after the last create).

    .venv/bin/python bench/controller_memory.py --pods 5000 --ballast-kb 150
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


async def run(args: argparse.Namespace, plane: cluster.ControlPlane, workdir: Path) -> dict[str, Any]:
    api = await client.connect(str(plane.kubeconfig))
    namespace = "tenant"
    samples: list[tuple[float, float]] = []
    try:
        for ns in (namespace, "gpualloc-system"):
            plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
        plane.ensure_service_account(namespace)
        proc = shared.start_controller(plane.kubeconfig, "gpualloc-system", 4, workdir / "controller.log")
        started = time.monotonic()

        def sample() -> float:
            value = rss_mib(proc.pid)
            samples.append((round(time.monotonic() - started, 1), round(value, 1)))
            return value

        await asyncio.sleep(args.settle)
        before = sample()
        ballast = "x" * (args.ballast_kb * 1024)
        path = f"/api/v1/namespaces/{namespace}/pods"
        created = 0

        async def create(i: int) -> None:
            nonlocal created
            await shared.retrying(lambda: transport.request(api, "POST", path, body=hostile_pod(i, ballast)))
            created += 1
            if created % 500 == 0:
                print(f"  {created} pods created, controller RSS {sample():.1f} MiB", flush=True)

        create_started = time.monotonic()
        await shared.bounded(args.concurrency, [lambda i=i: create(i) for i in range(args.pods)])
        create_seconds = time.monotonic() - create_started
        # Let the watch deliver everything and the heap settle: RSS stable for settle seconds.
        peak = sample()
        stable_since = time.monotonic()
        last = peak
        while time.monotonic() - stable_since < args.settle:
            await asyncio.sleep(1.0)
            now = sample()
            peak = max(peak, now)
            if abs(now - last) > 1.0:
                stable_since = time.monotonic()
            last = now
        after = sample()
        alive = proc.poll() is None
        proc.terminate()
        proc.wait(20)
        return {
            "pods": args.pods,
            "ballast_kb": args.ballast_kb,
            "controller_rss_mib": {
                "before": round(before, 1),
                "after": round(after, 1),
                "peak": round(peak, 1),
            },
            "limit_mib": LIMIT_MIB,
            "under_limit": peak < LIMIT_MIB,
            "controller_alive": alive,
            "create_seconds": round(create_seconds, 1),
            "samples": samples,
            "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        }
    finally:
        await api.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--ballast-kb", type=int, default=150)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds of stable RSS to wait for")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    with local_plane.temporary("gpualloc-bench-mem-", crds=False) as (control_plane, workdir):
        result = asyncio.run(run(args, control_plane, workdir))
    local_plane.write(args.out, result)
    rss = result["controller_rss_mib"]
    print(
        f"{args.pods} hostile pods with {args.ballast_kb} KB annotations, "
        f"created in {result['create_seconds']} s; "
        f"controller RSS {rss['before']} MiB before, peak {rss['peak']} MiB, {rss['after']} MiB after "
        f"(limit {LIMIT_MIB} MiB); wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
