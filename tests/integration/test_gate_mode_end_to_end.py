"""Gate mode through the real API server, the webhook and the controller together.

A pod is created before its claim exists: the webhook (``--pending gate``)
admits it with the scheduling gate, the ``gpu.scheduling/gated`` label and env
vars read from the devices annotation; once the controller allocates the
claim it gives the pod the annotation and the nodeSelector and removes the
gate and the label. What the kubelet would read is then the claim's devices.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.test_webhook_cluster import create_pod, pod, webhook  # noqa: F401 - fixture
from webhook import admission

DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


@pytest.fixture
def webhook_options() -> admission.Options:
    return admission.Options(pending="gate")


@pytest.mark.usefixtures("webhook")
async def test_pod_created_before_its_claim_is_gated_then_ungated_with_the_claims_devices(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    node, run = gpu_node
    stored = await create_pod(api, namespace, pod("trainer", "train"))
    assert constants.SCHEDULING_GATE in {g["name"] for g in stored["spec"]["schedulingGates"]}
    assert stored["metadata"]["labels"][constants.LABEL_GATED] == "true"
    for container in [*stored["spec"]["initContainers"], *stored["spec"]["containers"]]:
        refs = {
            e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]
        }
        for name in DEVICE_ENV:
            assert refs[name] == f"metadata.annotations['{constants.ANNOTATION_DEVICES}']"

    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        await resources.CustomResources(api).create_claim(namespace, support.claim_body("train", 4, run=run))
        path = f"/api/v1/namespaces/{namespace}/pods/trainer"

        async def ungated() -> dict[str, Any] | None:
            current: dict[str, Any] = await transport.request(api, "GET", path)
            gates = {g["name"] for g in current["spec"].get("schedulingGates") or []}
            return None if constants.SCHEDULING_GATE in gates else current

        released = await support.wait_for(ungated, within=30, what="the pod to be ungated")
        claim = await resources.CustomResources(api).get_claim(namespace, "train")

    (allocation,) = claim["status"]["allocations"]
    uuids = ",".join(d["uuid"] for d in allocation["devices"])
    assert allocation["nodeName"] == node
    assert released["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == uuids
    assert released["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: node}
    assert constants.LABEL_GATED not in (released["metadata"].get("labels") or {})
