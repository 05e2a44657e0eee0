"""A gang across nodes on the real API server: with ``topology.sameNodeLabel`` Required, a
4-replica gang lands inside one NVLink clique, or stays Pending with a reason per clique
(issue 21)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpualloc.kube import resources
from gpualloc.kube.client import Api
from tests.integration import controller_support as support

CLIQUE = "nvidia.com/gpu.clique"


@pytest.fixture
async def pools(api: Api) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """Five 8-GPU nodes of a fresh run: clique a has three, clique b two. (run id, node -> clique)"""
    run = uuid.uuid4().hex[:8]
    layout = {f"a{i}-{run}": "a" for i in range(3)} | {f"b{i}-{run}": "b" for i in range(2)}
    for name, clique in layout.items():
        await support.create_gpu_node(api, name, labels={support.RUN_LABEL: run, CLIQUE: clique})
    yield run, layout
    for name in layout:
        await support.delete_gpu_node(api, name)


def gang(name: str, run: str, replicas: int, count: int) -> dict[str, Any]:
    body = support.claim_body(name, count, run=run, replicas=replicas)
    body["spec"]["topology"] = {"sameNodeLabel": CLIQUE, "sameNodeLabelMode": "Required"}
    return body


async def test_a_required_gang_lands_in_one_clique_or_waits_with_a_reason_per_clique(
    api: Api, kubeconfig: str, namespace: str, pools: tuple[str, dict[str, str]]
) -> None:
    run, layout = pools
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        # 4 x 4 GPUs: both cliques could hold it; b, the fuller after a first claim there, is chosen.
        await crs.create_claim(
            namespace, support.claim_body("filler", 8, run=run, match_labels={CLIQUE: "b"})
        )
        await support.wait_phase(api, namespace, "filler", "Allocated")
        await crs.create_claim(namespace, gang("small", run, 2, 4))
        small = await support.wait_phase(api, namespace, "small", "Allocated")
        assert {layout[a["nodeName"]] for a in small["status"]["allocations"]} == {"b"}

        await crs.create_claim(namespace, gang("big", run, 4, 4))
        big = await support.wait_phase(api, namespace, "big", "Allocated")
        nodes = [a["nodeName"] for a in big["status"]["allocations"]]
        assert len(nodes) == 4 and {layout[n] for n in nodes} == {"a"}

        # Three 8-GPU replicas: a has 2 nodes' worth left, b none: Pending, each clique's reason.
        await crs.create_claim(namespace, gang("huge", run, 3, 8))

        async def explained() -> dict[str, Any] | None:
            got = await support.get_claim(api, namespace, "huge")
            return got if ((got or {}).get("status") or {}).get("message") else None

        huge = await support.wait_for(explained, what="the third gang to be explained")
        message = huge["status"]["message"]
        assert huge["status"]["phase"] == "Pending"
        assert message.startswith(f"no {CLIQUE} domain takes all 3 replicas ("), message
        assert f"{CLIQUE}=a: only 1 of 3 replicas fit" in message and f"{CLIQUE}=b: " in message, message
