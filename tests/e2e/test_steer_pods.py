"""packing.steerPodsWithoutClaim as the chart installs it, against the real kube-apiserver: the
MutatingAdmissionPolicy that gives a tenant's pods without GPUs the preferred node affinity for
nodes without free GPUs and for busy nodes, and the ValidatingAdmissionPolicy that lets the
controller's ServiceAccount change nothing of a Node but its two steering labels,
gpu.scheduling/free-gpus and gpu.scheduling/busy.

The release is the e2e fixtures' (tests/e2e/conftest.py), with ``HELM_VALUES`` on top. Pods are
created as dry runs by the tenant (``edit`` in its namespace, its own token): the API server runs
the admission policies on them all the same and stores nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpualloc.api import constants
from gpualloc.kube import client as kube_client
from gpualloc.kube import errors
from gpualloc.kube.client import Api
from tests.e2e.tenants import MERGE, Setup, call, container, eventually, pod, service_account_token
from tests.integration.test_free_gpus_label import STEER_TERMS

HELM_VALUES = ("packing.steerPodsWithoutClaim=true",)
KEY = constants.LABEL_FREE_GPUS
BUSY = constants.LABEL_BUSY
TERMS = STEER_TERMS  # the chart's three terms: no whole GPU free, no room for a share, busy without one
OWN_TERM = {
    "weight": 10,
    "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
}
DRY = [("dryRun", "All")]


async def admitted(s: Setup, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
    """The pod as the API server would store it, created by the tenant (a dry run)."""
    path = f"/api/v1/namespaces/{namespace or s.tenant_ns}/pods"
    stored: dict[str, Any] = await call(s.tenant, "POST", path, body=body, query=DRY)
    return stored


def preferred(stored: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = stored["spec"].get("affinity") or {}
    return list(
        (affinity.get("nodeAffinity") or {}).get("preferredDuringSchedulingIgnoredDuringExecution") or []
    )


@pytest.fixture(scope="module")
async def steering(setup: Setup) -> Setup:
    async def in_force() -> bool:
        return preferred(await admitted(setup, pod("probe", [container("main")]))) == TERMS

    await eventually("the steer MutatingAdmissionPolicy", in_force)
    return setup


async def test_a_tenants_pod_without_gpus_gets_the_preferred_terms_created_with_its_affinity(
    steering: Setup,
) -> None:
    stored = await admitted(steering, pod("plain", [container("main")]))
    assert stored["spec"]["affinity"] == {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": TERMS}
    }


async def test_the_pods_own_affinity_and_preferred_terms_are_kept_and_the_terms_appended(
    steering: Setup,
) -> None:
    required = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "Exists"}]}]}
    anti = {"requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "zone", "labelSelector": {}}]}
    own = pod(
        "own",
        [container("main")],
        affinity={
            "podAntiAffinity": anti,
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": required,
                "preferredDuringSchedulingIgnoredDuringExecution": [OWN_TERM],
            },
        },
    )
    stored = await admitted(steering, own)
    assert preferred(stored) == [OWN_TERM, *TERMS]
    assert (
        stored["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        == required
    )
    assert stored["spec"]["affinity"]["podAntiAffinity"] == anti

    only_pod_affinity = await admitted(
        steering, pod("anti", [container("main")], affinity={"podAntiAffinity": anti})
    )
    assert only_pod_affinity["spec"]["affinity"]["podAntiAffinity"] == anti
    assert preferred(only_pod_affinity) == TERMS

    no_preferred = await admitted(
        steering,
        pod(
            "req",
            [container("main")],
            affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}},
        ),
    )
    assert preferred(no_preferred) == TERMS
    assert (
        no_preferred["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        == required
    )


async def test_a_pod_that_already_prefers_by_the_label_gets_no_second_term(steering: Setup) -> None:
    mine = {
        "weight": 1,
        "preference": {"matchExpressions": [{"key": KEY, "operator": "In", "values": ["true"]}]},
    }
    body = pod(
        "mine",
        [container("main")],
        affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [mine]}},
    )
    assert preferred(await admitted(steering, body)) == [mine]


async def test_claim_pods_gpu_plugin_pods_bound_pods_and_exempt_namespaces_are_left_alone(
    steering: Setup,
) -> None:
    claim_pod = pod("claim", [container("main")], annotations={constants.ANNOTATION_CLAIM: "some-claim"})
    assert preferred(await admitted(steering, claim_pod)) == []
    gpu = container("main", resources={"limits": {"nvidia.com/gpu": "1"}})
    assert preferred(await admitted(steering, pod("plugin", [gpu]))) == []
    bound = pod("bound", [container("main")], nodeName=steering.nodes[0])
    stored = await admitted(steering, bound)
    assert preferred(stored) == [] and stored["spec"]["nodeName"] == steering.nodes[0]
    assert preferred(await admitted(steering, pod("exempt", [container("main")]), steering.exempt_ns)) == []


async def _controller(s: Setup) -> Api:
    token = await service_account_token(s.admin, s.system, f"{s.fullname}-controller")
    return await kube_client.connect(str(s.token_kubeconfig(token, "controller.kubeconfig")))


async def _patch_node(api: Api, node: str, body: dict[str, Any]) -> dict[str, Any]:
    stored: dict[str, Any] = await call(api, "PATCH", f"/api/v1/nodes/{node}", body=body, content_type=MERGE)
    return stored


async def test_the_controller_may_set_the_steering_labels_of_a_node_and_change_nothing_else(
    steering: Setup,
) -> None:
    controller = await _controller(steering)
    node = steering.nodes[0]
    await _patch_node(steering.admin, node, {"metadata": {"labels": {"owner": "admin"}}})

    async def in_force() -> bool:
        try:
            await _patch_node(controller, node, {"metadata": {"labels": {"owner": "controller"}}})
        except errors.KubeError as exc:
            return exc.status == 403
        return False

    try:
        await eventually("the node-free-gpus-label ValidatingAdmissionPolicy", in_force)
        stored = await _patch_node(controller, node, {"metadata": {"labels": {KEY: "true"}}})
        assert stored["metadata"]["labels"][KEY] == "true"
        stored = await _patch_node(controller, node, {"metadata": {"labels": {KEY: "shares"}}})
        assert stored["metadata"]["labels"][KEY] == "shares"
        stored = await _patch_node(controller, node, {"metadata": {"labels": {KEY: "false"}}})
        assert stored["metadata"]["labels"][KEY] == "false"
        stored = await _patch_node(controller, node, {"metadata": {"labels": {KEY: "true", BUSY: "true"}}})
        assert stored["metadata"]["labels"][BUSY] == "true" and stored["metadata"]["labels"][KEY] == "true"
        stored = await _patch_node(controller, node, {"metadata": {"labels": {BUSY: "false"}}})
        assert stored["metadata"]["labels"][BUSY] == "false"

        refusals: list[str] = []
        for body in (
            {"metadata": {"labels": {"team": "mine"}}},
            {"metadata": {"labels": {KEY: "true", "team": "mine"}}},
            {"metadata": {"labels": {"owner": None}}},
            {"metadata": {"annotations": {"note": "x"}}},
            {"spec": {"unschedulable": True}},
            {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}},
        ):
            with pytest.raises(errors.KubeError) as caught:
                await _patch_node(controller, node, body)
            assert caught.value.status == 403, (body, caught.value)
            refusals.append(caught.value.message)
        assert all(f"may change only the labels {KEY} and {BUSY}" in m for m in refusals), refusals

        with pytest.raises(errors.KubeError) as caught:
            await _patch_node(controller, node, {"metadata": {"labels": {KEY: "maybe"}}})
        assert caught.value.status == 422 and '"true", "shares" or "false"' in caught.value.message
        with pytest.raises(errors.KubeError) as caught:
            await _patch_node(controller, node, {"metadata": {"labels": {BUSY: "mostly"}}})
        assert caught.value.status == 422 and f'{BUSY} is "true" or "false"' in caught.value.message

        # The admin (not matched) may still do as it likes.
        await _patch_node(steering.admin, node, {"metadata": {"labels": {"team": "admin"}}})
    finally:
        await controller.close()
