"""``onNodeLoss: Reallocate`` on the real API server (issue 21): a claim whose node is deleted
moves to another node once its grace period has passed and no pod uses it; with the default
(``Keep``) it stays where it was, DevicesLost."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support

GRACE = 3


@pytest.fixture
async def node_pair(api: Api, kubeconfig: str, namespace: str) -> AsyncIterator[tuple[str, str, str]]:
    """A fresh run with its controller running: (run tag, first node, second node). The first is an
    8-GPU node already; the second is the test's to create. Both are deleted after the test."""
    run = uuid.uuid4().hex[:8]
    first, second = f"lost-{run}-a", f"lost-{run}-b"
    await support.create_gpu_node(api, first, labels={support.RUN_LABEL: run})
    try:
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
            yield run, first, second
    finally:
        await support.delete_gpu_node(api, first)
        await support.delete_gpu_node(api, second)


def claim_pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {constants.ANNOTATION_CLAIM: claim}},
        "spec": {"containers": [{"name": "train", "image": "cuda"}]},
    }


async def test_a_reallocate_claim_moves_off_a_deleted_node_after_its_grace_once_its_pod_is_gone(
    api: Api, namespace: str, node_pair: tuple[str, str, str]
) -> None:
    run, first, second = node_pair
    crs = resources.CustomResources(api)
    moving = support.claim_body("moving", 8, run=run)
    moving["spec"].update(onNodeLoss="Reallocate", nodeLossGracePeriodSeconds=GRACE)
    await crs.create_claim(namespace, moving)
    before = await support.wait_phase(api, namespace, "moving", "Allocated")
    assert {a["nodeName"] for a in before["status"]["allocations"]} == {first}
    pod = claim_pod("worker", "moving")
    await transport.request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=pod)

    await support.create_gpu_node(api, second, labels={support.RUN_LABEL: run})
    await support.delete_gpu_node(api, first)

    noticed = await support.wait_condition(api, namespace, "moving", "NodeLost", status="True", within=20)
    assert f"{first} is deleted or not ready" in support.condition(noticed, "NodeLost")["message"]
    # Past the grace period, the pod still uses the claim: it stays where it was.
    await asyncio.sleep(GRACE + 3)
    kept = await support.get_claim(api, namespace, "moving")
    assert kept is not None and kept["status"]["phase"] == "Allocated"
    assert set(support.status_uuids(kept)) == set(support.status_uuids(before))

    await transport.request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/worker")

    async def moved() -> dict[str, Any] | None:
        got = await support.get_claim(api, namespace, "moving")
        allocs = (got or {}).get("status", {}).get("allocations") or []
        return got if allocs and {a["nodeName"] for a in allocs} == {second} else None

    after = await support.wait_for(moved, within=30, what="the claim to be allocated on the other node")
    assert after["status"]["phase"] == "Allocated"
    assert support.condition(after, "NodeLost")["reason"] == "Reallocated"
    assert support.condition(after, "Releasing")["status"] == "False"
    old = set(support.status_uuids(before))

    async def let_go() -> bool:
        names = {lease["metadata"]["name"] for lease in await support.device_leases(api, namespace)}
        return not any(f"gpu-{u.lower()}" in names for u in old)

    await support.wait_for(let_go, within=10, what="the lost node's Leases to be released")


async def test_a_keep_claim_stays_on_a_deleted_node_with_devices_lost(
    api: Api, namespace: str, node_pair: tuple[str, str, str]
) -> None:
    run, first, second = node_pair
    crs = resources.CustomResources(api)
    await crs.create_claim(namespace, support.claim_body("keep", 8, run=run))
    before = await support.wait_phase(api, namespace, "keep", "Allocated")
    await support.create_gpu_node(api, second, labels={support.RUN_LABEL: run})
    await support.delete_gpu_node(api, first)

    got = await support.wait_condition(api, namespace, "keep", "DevicesLost", status="True", within=20)
    await asyncio.sleep(3)
    got = await support.get_claim(api, namespace, "keep")
    assert got is not None and got["status"]["phase"] == "Allocated"
    assert set(support.status_uuids(got)) == set(support.status_uuids(before))
    assert not support.condition(got, "NodeLost")
