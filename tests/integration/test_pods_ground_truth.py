"""Pods are the ground truth of use, against the real API server (issue 37): a claim that vanishes
while its pod runs (its finalizer stripped, here by an admin, as on a cluster without the chart's
finalizer policy, or a claim lost in an etcd restore) leaves its GPU locked and counted in its
namespace's quota until the pod ends; no claim of another namespace gets that GPU meanwhile.

The chart's policy that refuses the strip to tenants is tested with a tenant's token in
tests/e2e/test_tenant_attacks.py; the interleavings in the deterministic simulation
(tests/simulation, "strip-finalizer", invariants 3 and 6).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from controller import statuses
from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.conftest import fresh_namespace
from tests.integration.controller_support import (
    claim_body,
    condition,
    controller_argv,
    device_leases,
    fresh_gpu_node,
    get_claim,
    running_controller,
    status_uuids,
    wait_for,
    wait_phase,
)
from tests.integration.test_quota import get_quota, quota

SWEEP = 2.0  # controller_argv's --sweep-interval


@pytest.fixture
def other_namespace(control_plane: Any) -> Iterator[str]:
    yield from fresh_namespace(control_plane, f"t-other-{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def one_gpu_node(api: Api) -> AsyncIterator[tuple[str, str]]:
    """A node with a single GPU (``gpu_node`` has 8): the other namespace's claim can only get the
    GPU the pod holds."""
    async with fresh_gpu_node(api, "truth-{run}", gpus=1) as node:
        yield node


def pods_path(namespace: str, name: str = "") -> str:
    return f"/api/v1/namespaces/{namespace}/pods" + (f"/{name}" if name else "")


async def set_phase(api: Api, namespace: str, name: str, phase: str) -> None:
    await transport.request(
        api,
        "PATCH",
        pods_path(namespace, name) + "/status",
        body={"status": {"phase": phase}},
        content_type=transport.MERGE_PATCH,
    )


async def leases_of(api: Api, namespace: str, uid: str) -> list[str]:
    return sorted(
        lease["metadata"]["name"]
        for lease in await device_leases(api, namespace)
        if (lease.get("spec") or {}).get("holderIdentity") == uid
    )


async def test_a_claim_stripped_of_its_finalizer_keeps_its_gpu_locked_and_counted_until_its_pod_ends(
    api: Api, kubeconfig: str, namespace: str, other_namespace: str, one_gpu_node: tuple[str, str]
) -> None:
    node, run = one_gpu_node
    crs = resources.CustomResources(api)
    async with (
        quota(api, namespace, {"gpus": 1}) as quota_name,
        running_controller(kubeconfig, controller_argv(namespace, run=run)),
    ):
        await crs.create_claim(namespace, claim_body("mine", 1, run=run))
        allocated = await wait_phase(api, namespace, "mine", constants.PHASE_ALLOCATED)
        uid, gpu = allocated["metadata"]["uid"], status_uuids(allocated)[0]
        # The pod the webhook admitted for it, as the webhook writes it, and running on its node.
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "trainer",
                "annotations": {constants.ANNOTATION_CLAIM: "mine", constants.ANNOTATION_DEVICES: gpu},
            },
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda"}]},
        }
        await transport.request(api, "POST", pods_path(namespace), body=pod)
        await set_phase(api, namespace, "trainer", "Running")

        await crs.delete_claim(namespace, "mine")
        in_use = await wait_for(
            lambda: _with_condition(api, namespace, "mine", statuses.CONDITION_IN_USE),
            what="the claim being deleted to say it is in use",
        )
        assert in_use["metadata"]["deletionTimestamp"]
        await crs.patch_claim(namespace, "mine", {"metadata": {"finalizers": []}})  # the strip
        assert await get_claim(api, namespace, "mine") is None, "the claim is gone at once"

        await crs.create_claim(other_namespace, claim_body("theirs", 1, run=run))
        await asyncio.sleep(3 * SWEEP)  # three sweeps: each one finds the claim gone
        assert await leases_of(api, namespace, uid) == [constants.lease_name(gpu)], "the Lease stays"
        theirs = await get_claim(api, other_namespace, "theirs")
        assert theirs is not None and theirs["status"]["phase"] == constants.PHASE_PENDING
        assert gpu not in status_uuids(theirs)
        ledger = (await get_quota(api, namespace, quota_name))["status"]
        assert ledger["used"] == 1 and uid in ledger["claims"], "the quota still counts the pod's GPU"

        await set_phase(api, namespace, "trainer", "Succeeded")
        theirs = await wait_phase(api, other_namespace, "theirs", constants.PHASE_ALLOCATED, within=30)
        assert status_uuids(theirs) == [gpu], "the GPU is free once the pod has ended"
        assert await leases_of(api, namespace, uid) == []
        freed = await wait_for(
            lambda: _ledger_without(api, namespace, quota_name, uid),
            what="the quota to let the gone claim go",
        )
        assert freed["used"] == 0


async def _with_condition(api: Api, namespace: str, name: str, type_: str) -> dict[str, Any] | None:
    claim = await get_claim(api, namespace, name)
    return claim if condition(claim, type_).get("status") == "True" else None


async def _ledger_without(api: Api, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
    status: dict[str, Any] = (await get_quota(api, namespace, name)).get("status") or {}
    return status if uid not in (status.get("claims") or {}) else None
