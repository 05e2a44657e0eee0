"""Shared claims against the real API server, the controller and the webhook (issue 22).

A node published as the simulated agent publishes the a100-pcie-4-nvlink profile with
``--sharing MPS:4``: each of its four GPUs has four slots, each slot a Lease of its own.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from gpualloc.api import constants, leases, models
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.test_webhook_cluster import (  # noqa: F401 - webhook and its options: fixtures
    create_pod,
    env,
    pod,
    webhook,
    webhook_options,
)

MPS_4 = models.DeviceSharing(strategy="MPS", replicas=4)


def shared_claim(name: str, run: str, **sharing: Any) -> dict[str, Any]:
    body = support.claim_body(name, 1, run=run)
    body["spec"]["devices"].update(exclusivity="Shared", sharing=sharing)
    return body


async def message_of(api: Api, namespace: str, name: str, text: str) -> dict[str, Any]:
    async def says() -> dict[str, Any] | None:
        found = await support.get_claim(api, namespace, name)
        return found if text in (found or {}).get("status", {}).get("message", "") else None

    found: dict[str, Any] = await support.wait_for(says, within=30, what=f"claim {name} to say {text!r}")
    return found


@pytest.mark.usefixtures("webhook")
async def test_four_mps_claims_share_one_gpu_by_slot_leases_a_fifth_goes_elsewhere_and_pods_get_limits(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    node = f"shared-{run}"
    inv = await support.publish_simulated_node(api, node, run, "a100-pcie-4-nvlink", sharing=MPS_4)
    first, second = inv.devices[0], inv.devices[1]
    crs = resources.CustomResources(api)
    limits = {"strategy": "MPS", "maxClaimsPerGPU": 4, "computePercent": 25, "memoryMiB": 10240}
    try:
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
            got: dict[str, dict[str, Any]] = {}
            for i in range(5):  # one at a time, so that each sees the slots the others took
                await crs.create_claim(namespace, shared_claim(f"s{i}", run, **limits))
                got[f"s{i}"] = await support.wait_phase(api, namespace, f"s{i}", "Allocated", within=30)
            placed = {
                name: [(d["uuid"], d["slot"]) for d in claim["status"]["allocations"][0]["devices"]]
                for name, claim in got.items()
            }
            # The fullest shared GPU first: GPU 0's four slots, then the fifth claim on GPU 1.
            assert placed == {
                "s0": [(first.uuid, 0)],
                "s1": [(first.uuid, 1)],
                "s2": [(first.uuid, 2)],
                "s3": [(first.uuid, 3)],
                "s4": [(second.uuid, 0)],
            }
            held = {
                leases.parse(raw).name: leases.parse(raw).holder
                for raw in await support.device_leases(api, namespace)
            }
            for name, [(gpu, slot)] in placed.items():
                lease = constants.lease_name(constants.slot_id(gpu, slot))
                assert held[lease] == got[name]["metadata"]["uid"], lease
            assert constants.lease_name(first.uuid) not in held  # no claim holds the GPU whole

            # A whole-GPU claim never gets a shared GPU; a claim that wants fewer sharers finds none.
            await crs.create_claim(namespace, support.claim_body("whole", 1, run=run))
            whole = await message_of(api, namespace, "whole", "1 free healthy GPU")
            assert whole["status"]["phase"] == "Pending"
            await crs.create_claim(namespace, shared_claim("pair", run, strategy="MPS", maxClaimsPerGPU=2))
            await message_of(api, namespace, "pair", "no GPU shared by MPS of at most 2 claims")

            # The webhook gives s1's pod the GPU and the claim's MPS limits, in every container.
            await create_pod(api, namespace, pod("infer", "s1"))
            stored = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/infer")
            for container in stored["spec"]["initContainers"] + stored["spec"]["containers"]:
                values = env(container)
                assert values["CUDA_VISIBLE_DEVICES"] == first.uuid, container["name"]
                assert values["NVIDIA_VISIBLE_DEVICES"] == first.uuid, container["name"]
                assert values["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25", container["name"]
                assert values["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M", container["name"]
            assert stored["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: node}

            # A slot given back is taken again: deleting s2 lets a new claim onto GPU 0, slot 2.
            await transport.request(
                api, "DELETE", f"/apis/gpu.scheduling/v1/namespaces/{namespace}/gpuclaims/s2"
            )

            async def gone() -> bool:
                return await support.get_claim(api, namespace, "s2") is None

            await support.wait_for(gone, within=30, what="claim s2 to give its slot back and go")
            await crs.create_claim(namespace, shared_claim("s5", run, **limits))
            again = await support.wait_phase(api, namespace, "s5", "Allocated", within=30)
            (device,) = again["status"]["allocations"][0]["devices"]
            assert (device["uuid"], device["slot"]) == (first.uuid, 2)
    finally:
        await support.delete_gpu_node(api, node)
