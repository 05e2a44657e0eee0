"""The steering labels (``--label-free-gpus``, controller.labelling) on the real kube-apiserver,
and what kube-scheduler does with the preference that the chart's packing.steerPodsWithoutClaim
gives pods without GPUs (the policy itself: tests/e2e/test_steer_pods.py)."""

from __future__ import annotations

import contextlib
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.controller_support import KwokGpuNodes

KEY = constants.LABEL_FREE_GPUS
BUSY = constants.LABEL_BUSY
# What the chart's MutatingAdmissionPolicy appends to a pod without GPUs (helm/gpualloc/templates/
# steer-policies.yaml): no whole GPU free, no room for a share either, and no whole GPU free on a
# busy node.
STEER_TERMS = [
    {
        "weight": 100,
        "preference": {"matchExpressions": [{"key": KEY, "operator": "NotIn", "values": ["true"]}]},
    },
    {
        "weight": 100,
        "preference": {"matchExpressions": [{"key": KEY, "operator": "NotIn", "values": ["true", "shares"]}]},
    },
    {
        "weight": 80,
        "preference": {
            "matchExpressions": [
                {"key": KEY, "operator": "NotIn", "values": ["true"]},
                {"key": BUSY, "operator": "NotIn", "values": ["false"]},
            ]
        },
    },
]


def controller_argv(namespace: str, run: str) -> list[str]:
    # --claim-tolerations Any: a claim's own toleration of the kwok nodes' run taint counts.
    return support.controller_argv(
        namespace, "--label-free-gpus", "--label-interval", "0.2", "--claim-tolerations", "Any", run=run
    )


async def wait_label(api: Api, node: str, value: str, key: str = KEY) -> None:
    async def probe() -> bool:
        got: dict[str, Any] = await transport.request(api, "GET", f"/api/v1/nodes/{node}")
        return bool((got["metadata"].get("labels") or {}).get(key) == value)

    await support.wait_for(probe, within=30, what=f"{node} labelled {key}={value}")


async def create_claim(api: Api, namespace: str, body: dict[str, Any]) -> None:
    await transport.request(
        api, "POST", f"/apis/{constants.API_VERSION}/namespaces/{namespace}/gpuclaims", body=body
    )


async def delete_claim(api: Api, namespace: str, name: str) -> None:
    await transport.request(
        api, "DELETE", f"/apis/{constants.API_VERSION}/namespaces/{namespace}/gpuclaims/{name}"
    )


async def test_a_gpu_node_is_labelled_true_then_false_once_claims_take_all_its_gpus_and_true_again(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    node, run = gpu_node
    async with support.running_controller(kubeconfig, controller_argv(namespace, run)):
        await wait_label(api, node, "true")
        await create_claim(api, namespace, support.claim_body("six", 6, run=run))
        await support.wait_phase(api, namespace, "six", constants.PHASE_ALLOCATED)
        await create_claim(api, namespace, support.claim_body("two", 2, run=run))
        await support.wait_phase(api, namespace, "two", constants.PHASE_ALLOCATED)
        await wait_label(api, node, "false")
        await delete_claim(api, namespace, "two")
        await wait_label(api, node, "true")
        got: dict[str, Any] = await transport.request(api, "GET", f"/api/v1/nodes/{node}")
        assert got["metadata"]["labels"][support.RUN_LABEL] == run, "the node's other labels are kept"


def share_body(name: str, run: str, milli: int) -> dict[str, Any]:
    body = support.claim_body(name, 1, run=run)
    body["spec"]["devices"].update(exclusivity="Shared", sharing={"milli": milli})
    return body


async def test_a_node_whose_only_room_is_on_a_shared_gpu_is_labelled_shares_then_false_when_it_is_full(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    node, run = gpu_node
    async with support.running_controller(kubeconfig, controller_argv(namespace, run)):
        await create_claim(api, namespace, support.claim_body("seven", 7, run=run))
        await support.wait_phase(api, namespace, "seven", constants.PHASE_ALLOCATED)
        await wait_label(api, node, "true")
        await create_claim(api, namespace, share_body("half", run, 500))  # on the last GPU
        await support.wait_phase(api, namespace, "half", constants.PHASE_ALLOCATED)
        await wait_label(api, node, "shares")
        await create_claim(api, namespace, share_body("other-half", run, 500))
        await support.wait_phase(api, namespace, "other-half", constants.PHASE_ALLOCATED)
        await wait_label(api, node, "false")
        await delete_claim(api, namespace, "half")
        await wait_label(api, node, "shares")


def cpu_pod(name: str, run: str, *, steered: bool) -> dict[str, Any]:
    """A pod without GPUs for this test's nodes only, with the chart's preferred term or without."""
    spec: dict[str, Any] = {
        "nodeSelector": {support.RUN_LABEL: run},
        "tolerations": [support.run_toleration(run)],
        "containers": [
            {"name": "main", "image": support.PAUSE_IMAGE, "resources": {"requests": {"cpu": "1"}}}
        ],
    }
    if steered:
        spec["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": STEER_TERMS}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


async def scheduled_node(api: Api, namespace: str, name: str) -> str:
    async def probe() -> str:
        got: dict[str, Any] = await transport.request(
            api, "GET", f"/api/v1/namespaces/{namespace}/pods/{name}"
        )
        return str(got["spec"].get("nodeName") or "")

    return await support.wait_for(probe, within=30, what=f"pod {name} scheduled")


async def test_kube_scheduler_puts_a_steered_cpu_pod_on_the_node_without_free_gpus_not_the_emptier_one(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """Two alike nodes; a claim takes all 8 GPUs of one (``full``), and a pod asking 8 CPUs makes
    it the busier. kube-scheduler's LeastAllocated puts a plain CPU pod on the emptier node, whose
    GPUs are free; the same pod with the chart's preferred term goes to ``full``."""
    run = kwok_gpu_nodes.run
    a = await kwok_gpu_nodes.add("a", cpu="32")
    b = await kwok_gpu_nodes.add("b", cpu="32")
    async with support.running_controller(kubeconfig, controller_argv(namespace, run)):
        body = support.claim_body("all", 8, run=run)
        body["spec"]["tolerations"] = [support.run_toleration(run)]
        await create_claim(api, namespace, body)
        claim = await support.wait_phase(api, namespace, "all", constants.PHASE_ALLOCATED)
        full = support.allocated_nodes(claim)[0]
        empty = b if full == a else a
        await wait_label(api, full, "false")
        await wait_label(api, empty, "true")
        await support.create_pod(api, namespace, support.plain_pod("hog", full, run=run, cpu="8"))
        assert await scheduled_node(api, namespace, "hog") == full

        await support.create_pod(api, namespace, cpu_pod("plain", run, steered=False))
        assert await scheduled_node(api, namespace, "plain") == empty, "LeastAllocated: the emptier node"
        await support.create_pod(api, namespace, cpu_pod("steered", run, steered=True))
        assert await scheduled_node(api, namespace, "steered") == full, "preferred: no free GPU there"
        with contextlib.suppress(Exception):
            await delete_claim(api, namespace, "all")


async def test_kube_scheduler_packs_a_steered_cpu_pod_onto_the_busy_node_not_the_emptier_one(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """Two alike nodes of one GPU each, both taken by claims; a pod asking 24 of 32 CPUs and 49 of
    64 GiB makes one of them busy (76% on average), and the controller labels it so; the other
    holds a pod asking 18 CPUs and 38 GiB (58%). kube-scheduler's LeastAllocated puts a plain CPU
    pod on the emptier node; the same pod with the chart's terms goes to the busy one."""
    run = kwok_gpu_nodes.run
    a = await kwok_gpu_nodes.add("a", cpu="32", memory="64Gi", gpus=1)
    b = await kwok_gpu_nodes.add("b", cpu="32", memory="64Gi", gpus=1)
    async with support.running_controller(kubeconfig, controller_argv(namespace, run)):
        for name in ("one", "other"):
            body = support.claim_body(name, 1, run=run)
            body["spec"]["tolerations"] = [support.run_toleration(run)]
            await create_claim(api, namespace, body)
            await support.wait_phase(api, namespace, name, constants.PHASE_ALLOCATED)
        for node in (a, b):
            await wait_label(api, node, "false")  # no GPU room on either: the GPU-room terms tie
            await wait_label(api, node, "false", key=BUSY)
        for name, node, cpu, memory in (("hog", a, "24", "49Gi"), ("some", b, "18", "38Gi")):
            await support.create_pod(
                api, namespace, support.plain_pod(name, node, run=run, cpu=cpu, memory=memory)
            )
        assert await scheduled_node(api, namespace, "hog") == a
        assert await scheduled_node(api, namespace, "some") == b
        await wait_label(api, a, "true", key=BUSY)

        await support.create_pod(api, namespace, cpu_pod("plain", run, steered=False))
        assert await scheduled_node(api, namespace, "plain") == b, "LeastAllocated: the emptier node"
        await support.create_pod(api, namespace, cpu_pod("steered", run, steered=True))
        assert await scheduled_node(api, namespace, "steered") == a, "preferred: the busy node"
        for name in ("one", "other"):
            with contextlib.suppress(Exception):
                await delete_claim(api, namespace, name)
