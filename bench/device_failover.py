"""How long a failed GPU takes to heal its claim: XID 79 to the replica allocated elsewhere (issue 40).

Starts a local control plane (etcd, kube-apiserver) and runs ``--runs`` times the scenario of
tests/integration/failure_support.py: two simulated 8-GPU agents of one clique, a 4-replica gang
of 2 GPUs with ``onDeviceFailure: Reallocate`` (grace 0 s) and a pod per replica, then XID 79
under replica 2. Each run has a fresh namespace, nodes and controller. The time is from writing
the XID into the agent's injection file to reading the claim that lists the replica's new GPUs:
the agent's event, its GpuNodeStatus write, the controller's condition write, the eviction, the
Lease creates and the status write. Writes bench/results/device_failover-<date>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.integration's helpers
import local_plane

from gpualloc.devcluster import cluster
from gpualloc.kube import client, transport
from tests.integration import controller_support as support
from tests.integration import failure_support as failure

RESULTS = Path(__file__).resolve().parent / "results"


async def run(runs: int, plane: cluster.ControlPlane) -> list[float]:
    api = await client.connect(str(plane.kubeconfig))
    seconds: list[float] = []
    try:
        for i in range(runs):
            namespace = f"failover-{i}"
            await transport.request(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
            # No kube-controller-manager here to make the ServiceAccount a pod needs.
            account = {"metadata": {"name": "default"}}
            await transport.request(
                api, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body=account
            )
            with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
                kubeconfig = str(plane.kubeconfig)
                async with failure.clique_of_two(api, plane, kubeconfig, Path(tmp)) as clique:
                    argv = support.controller_argv(namespace, run=clique.run)
                    async with support.running_controller(kubeconfig, argv):
                        got = await failure.failover(api, namespace, clique)
            seconds.append(got.seconds)
            print(f"run {i + 1}/{runs}: {got.seconds:.3f} s", flush=True)
    finally:
        await api.close()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or RESULTS / f"device_failover-{dt.date.today().isoformat()}.json"
    with local_plane.temporary("failover-") as (plane, _):
        seconds = asyncio.run(run(args.runs, plane))
    ordered = sorted(seconds)
    result: dict[str, Any] = {
        "what": "XID 79 under replica 2 of a 4 x 2-GPU gang to the replica allocated elsewhere (grace 0 s)",
        "runs": len(seconds),
        "median_s": round(statistics.median(ordered), 3),
        "p90_s": round(ordered[max(0, int(0.9 * len(ordered)) - 1)], 3),
        "max_s": round(ordered[-1], 3),
        "seconds": [round(s, 3) for s in seconds],
    }
    local_plane.write(out, result)
    print(
        f"median {result['median_s']} s, p90 {result['p90_s']} s, max {result['max_s']} s; written to {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
