"""Taints on the real API server: a node tainted against a claim is skipped and explained, the
GKE/AKS GPU-pool taint is tolerated by default, and a claim's toleration opens a tainted node
(issue 21) once a GpuQuota of its namespace allows it, or under ``--claim-tolerations Any`` (issue 37)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support

GPU_POOL = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TEAM = {"key": "team", "value": "ml", "effect": "NoExecute"}
QUOTAS = f"/apis/{constants.GROUP}/{constants.VERSION}"


@pytest.fixture
async def nodes(api: Api) -> AsyncIterator[tuple[str, str, str]]:
    """Two 8-GPU nodes of a fresh run: a GPU pool tainted as on GKE/AKS, and one reserved for a team."""
    run = uuid.uuid4().hex[:8]
    pool, team = f"pool-{run}", f"team-{run}"
    for name, taint in ((pool, GPU_POOL), (team, TEAM)):
        await support.create_gpu_node(api, name, labels={support.RUN_LABEL: run})
        await transport.request(
            api,
            "PATCH",
            f"/api/v1/nodes/{name}",
            body={"spec": {"taints": [taint]}},
            content_type=transport.MERGE_PATCH,
        )
    yield pool, team, run
    for name in (pool, team):
        await support.delete_gpu_node(api, name)


async def test_a_tainted_node_is_skipped_without_a_toleration_and_used_with_one(
    api: Api, kubeconfig: str, namespace: str, nodes: tuple[str, str, str]
) -> None:
    pool, team, run = nodes
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        await crs.create_claim(namespace, support.claim_body("first", 8, run=run))
        first = await support.wait_phase(api, namespace, "first", "Allocated")
        assert first["status"]["nodes"] == pool  # the GPU-pool taint is tolerated by default

        await crs.create_claim(namespace, support.claim_body("second", 8, run=run))

        async def explained() -> dict[str, Any] | None:
            got = await support.get_claim(api, namespace, "second")
            return got if "tainted" in ((got or {}).get("status") or {}).get("message", "") else None

        second = await support.wait_for(explained, what="the second claim to name the taint")
        assert second["status"]["phase"] == "Pending"
        assert "1 is tainted team=ml:NoExecute" in second["status"]["message"], second["status"]["message"]

        # Pending claims may be edited, but a toleration counts only once the operator allows it
        # in the namespace's GpuQuota (issue 37): until then the reason says which one is refused.
        toleration = {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoExecute"}
        await crs.patch_claim(namespace, "second", {"spec": {"tolerations": [toleration]}})
        refused = (
            f"toleration team=ml:NoExecute is not allowed in namespace {namespace}"
            " (GpuQuota allowedTolerations)"
        )

        async def refused_named() -> dict[str, Any] | None:
            got = await support.get_claim(api, namespace, "second")
            return got if refused in ((got or {}).get("status") or {}).get("message", "") else None

        second = await support.wait_for(refused_named, what="the second claim to name the refused toleration")
        assert second["status"]["phase"] == "Pending"
        assert "1 is tainted team=ml:NoExecute" in second["status"]["message"], second["status"]["message"]

        # The operator allows the team's toleration: the claim gets the team's node.
        quota = {
            "apiVersion": constants.API_VERSION,
            "kind": "GpuQuota",
            "metadata": {"name": "team"},
            "spec": {"gpus": 64, "allowedTolerations": [{"key": "team", "operator": "Exists"}]},
        }
        await transport.request(api, "POST", f"{QUOTAS}/namespaces/{namespace}/gpuquotas", body=quota)
        second = await support.wait_phase(api, namespace, "second", "Allocated")
        assert second["status"]["nodes"] == team


async def test_every_claim_toleration_counts_with_claim_tolerations_any(
    api: Api, kubeconfig: str, namespace: str, nodes: tuple[str, str, str]
) -> None:
    """``--claim-tolerations Any`` (single-tenant clusters): the claim's own toleration opens the
    team's node without any GpuQuota, as before issue 37."""
    _, team, run = nodes
    crs = resources.CustomResources(api)
    body = support.claim_body("tolerating", 8, run=run)
    body["spec"]["nodeName"] = team
    body["spec"]["tolerations"] = [{"key": "team", "operator": "Equal", "value": "ml", "effect": "NoExecute"}]
    async with support.running_controller(
        kubeconfig, support.controller_argv(namespace, "--claim-tolerations", "Any", run=run)
    ):
        await crs.create_claim(namespace, body)
        got = await support.wait_phase(api, namespace, "tolerating", "Allocated")
        assert got["status"]["nodes"] == team
