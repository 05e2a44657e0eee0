"""Claims written for ziwon/gpu-scheduler (seed 004) apply as they are and are allocated (issue 21).

The claims are those of that project's usage guide, unchanged but for a label that lets this
test's controller pick them, sent as ``kubectl apply`` sends them (``fieldValidation=Strict``:
an unknown field would be an error). ``docs/api.md`` lists what differs."""

from __future__ import annotations

import uuid
from typing import Any

from gpualloc.api import models
from gpualloc.kube import transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support

SEED_CLAIMS: list[dict[str, Any]] = [
    {"metadata": {"name": "single-gpu"}, "spec": {"devices": {"count": 1, "exclusivity": "Exclusive"}}},
    {
        "metadata": {"name": "multi-gpu"},
        "spec": {
            "devices": {"count": 4, "policy": "contiguous", "exclusivity": "Exclusive"},
            "topology": {"mode": "Preferred"},
        },
    },
    {
        "metadata": {"name": "pinned-gpus"},
        "spec": {
            "devices": {"count": 2, "policy": "preferIds", "preferIds": [0, 1], "exclusivity": "Exclusive"}
        },
    },
    {
        "metadata": {"name": "specific-node"},
        "spec": {
            "selector": {"matchLabels": {"gpu-type": "a100", "topology": "nvlink"}},
            "devices": {"count": 8, "policy": "contiguous"},
        },
    },
    {
        "metadata": {"name": "tight"},
        "spec": {
            "devices": {"count": 2},
            "topology": {"mode": "Required", "minBandwidthGBps": 600},
            "gangRef": "podgroup-a",
        },
    },
    # "Advanced Usage": a shared GPU, and (its API reference) a MIG instance.
    {"metadata": {"name": "shared-gpu"}, "spec": {"devices": {"count": 1, "exclusivity": "Shared"}}},
    {"metadata": {"name": "mig-slice"}, "spec": {"devices": {"count": 1, "exclusivity": "MIG"}}},
]


async def test_seed_004_claims_apply_strictly_and_are_allocated(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    nodes = {
        f"s4-{run}-a100": {"gpu-type": "a100", "topology": "nvlink"},
        f"s4-{run}-b": {},
        f"s4-{run}-c": {},
    }
    for name, labels in nodes.items():
        await support.create_gpu_node(api, name, labels={support.RUN_LABEL: run, **labels})
    # A node whose agent shares its GPUs by time-slicing, and one with a GPU in MIG mode.
    shared, mig = f"s4-{run}-shared", f"s4-{run}-mig"
    await support.publish_simulated_node(
        api, shared, run, "a100-pcie-4-nvlink", models.DeviceSharing(strategy="TimeSlicing", replicas=2)
    )
    await support.publish_simulated_node(api, mig, run, "a100-mig")
    nodes.update({shared: {}, mig: {}})
    try:
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
            path = f"/apis/gpu.scheduling/v1/namespaces/{namespace}/gpuclaims"
            # The 8-GPU claim first, allocated before the others: the queue orders claims created in
            # the same second by name, and binpack would start filling its only node.
            for claim in sorted(SEED_CLAIMS, key=lambda c: c["metadata"]["name"] != "specific-node"):
                body = {"apiVersion": "gpu.scheduling/v1", "kind": "GpuClaim", **claim}
                body["metadata"] = {**claim["metadata"], "labels": {support.RUN_LABEL: run}}
                await transport.request(api, "POST", path, body=body, query=[("fieldValidation", "Strict")])
                if claim["metadata"]["name"] == "specific-node":
                    await support.wait_phase(api, namespace, "specific-node", "Allocated")
            got = {
                c["metadata"]["name"]: await support.wait_phase(
                    api, namespace, c["metadata"]["name"], "Allocated"
                )
                for c in SEED_CLAIMS
            }
        placed = {name: c["status"]["allocations"][0] for name, c in got.items()}
        assert placed["specific-node"]["nodeName"] == f"s4-{run}-a100"
        assert sorted(d["index"] for d in placed["pinned-gpus"]["devices"]) == [0, 1]
        assert placed["tight"]["minBandwidthGBps"] >= 600
        assert len(placed["multi-gpu"]["devices"]) == 4
        assert placed["shared-gpu"]["nodeName"] == shared and placed["shared-gpu"]["devices"][0]["slot"] == 0
        assert placed["mig-slice"]["nodeName"] == mig
        assert placed["mig-slice"]["devices"][0]["uuid"].startswith("MIG-")
    finally:
        for name in nodes:
            await support.delete_gpu_node(api, name)
