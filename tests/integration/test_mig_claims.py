"""MIG claims against the real API server (issue 22): a node published as the simulated agent
publishes the a100-mig profile (GPU 0 split into 3g.20gb + 2g.10gb + 2 x 1g.5gb, GPU 1 whole)."""

from __future__ import annotations

import uuid
from typing import Any

from gpualloc.api import constants, leases, models
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.test_controller_gate import gated_pod


async def publish_mig_node(api: Api, name: str, run: str) -> models.NodeInventory:
    """The Node and the GpuNodeStatus the agent publishes for the a100-mig profile; its inventory."""
    return await support.publish_simulated_node(api, name, run, "a100-mig")


def mig_claim(name: str, count: int, run: str, profile: str = "") -> dict[str, Any]:
    body = support.claim_body(name, count, run=run)
    body["spec"]["devices"]["exclusivity"] = "MIG"
    if profile:
        body["spec"]["devices"]["migProfile"] = profile
    return body


async def test_a_mig_claim_gets_an_instance_uuid_its_lease_and_its_pod_while_whole_claims_avoid_mig_gpus(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    node = f"mig-{run}"
    inv = await publish_mig_node(api, node, run)
    split, whole = inv.devices
    assert split.mig is not None and split.mig.enabled and whole.mig is None
    small = [m for m in split.mig.devices if m.profile == "1g.5gb"]
    crs = resources.CustomResources(api)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    try:
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
            await transport.request(api, "POST", pods, body=gated_pod("infer", "small"))
            await crs.create_claim(namespace, mig_claim("small", 1, run, "1g.5gb"))
            claim = await support.wait_phase(api, namespace, "small", "Allocated", within=30)
            (allocation,) = claim["status"]["allocations"]
            (device,) = allocation["devices"]
            # The first 1g.5gb in placement order, on GPU 0; its Lease is named from the MIG UUID.
            assert device == {"index": 0, "minor": split.minor, "uuid": small[0].uuid}
            held = {
                leases.parse(raw).name: leases.parse(raw).holder
                for raw in await support.device_leases(api, namespace)
            }
            assert held[constants.lease_name(small[0].uuid)] == claim["metadata"]["uid"]

            async def ungated() -> dict[str, Any] | None:
                pod: dict[str, Any] = await transport.request(api, "GET", f"{pods}/infer")
                gates = {g["name"] for g in pod["spec"].get("schedulingGates") or []}
                return pod if constants.SCHEDULING_GATE not in gates else None

            pod = await support.wait_for(ungated, within=30, what="the MIG claim's pod un-gated")
            assert pod["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == small[0].uuid
            assert pod["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: node}

            # Whole-GPU claims: GPU 1 only, never GPU 0 (in MIG mode).
            await crs.create_claim(namespace, support.claim_body("whole", 1, run=run))
            got = await support.wait_phase(api, namespace, "whole", "Allocated", within=30)
            assert got["status"]["allocations"][0]["devices"][0]["uuid"] == whole.uuid
            await crs.create_claim(namespace, support.claim_body("another", 1, run=run))

            async def refused() -> dict[str, Any] | None:
                found = await support.get_claim(api, namespace, "another")
                message = (found or {}).get("status", {}).get("message", "")
                return (
                    found
                    if message == "0/1 nodes fit: none has 1 free healthy GPU (at most 0 on one node)"
                    else None
                )

            pending = await support.wait_for(
                refused, within=30, what="the second whole claim kept off GPU 0 (MIG mode)"
            )
            assert pending["status"]["phase"] == "Pending"

            # The other 1g.5gb, then no more: the 3g.20gb and 2g.10gb are other profiles.
            await crs.create_claim(namespace, mig_claim("second", 1, run, "1g.5gb"))
            second = await support.wait_phase(api, namespace, "second", "Allocated", within=30)
            assert second["status"]["allocations"][0]["devices"][0]["uuid"] == small[1].uuid
            await crs.create_claim(namespace, mig_claim("third", 1, run, "1g.5gb"))

            async def none_left() -> dict[str, Any] | None:
                found = await support.get_claim(api, namespace, "third")
                message = (found or {}).get("status", {}).get("message", "")
                return found if "fewer than 1 free MIG instances" in message else None

            await support.wait_for(none_left, within=30, what="a third 1g.5gb claim to find none free")
            # Any profile: the 3g.20gb, first in placement order.
            await crs.create_claim(namespace, mig_claim("any", 1, run))
            any_ = await support.wait_phase(api, namespace, "any", "Allocated", within=30)
            big = next(m for m in split.mig.devices if m.profile == "3g.20gb")
            assert any_["status"]["allocations"][0]["devices"][0]["uuid"] == big.uuid
    finally:
        await support.delete_gpu_node(api, node)


async def test_the_crd_keeps_mig_profiles_to_mig_claims_and_sharing_to_shared_claims(
    api: Api, namespace: str
) -> None:
    crs = resources.CustomResources(api)
    wrong = support.claim_body("wrong", 1, run="x")
    wrong["spec"]["devices"]["migProfile"] = "1g.5gb"

    def asking(name: str, **devices: Any) -> dict[str, Any]:
        return {**mig_claim(name, 1, "x"), "spec": {"devices": {"count": 1, **devices}}}

    for body, message in (
        (wrong, "migProfile is only used with exclusivity MIG"),
        (asking("sharing", sharing={}), "sharing is only used with exclusivity Shared"),
        (
            asking("limits", exclusivity="Shared", sharing={"computePercent": 50}),
            "computePercent and memoryMiB are MPS limits; use them with strategy MPS",
        ),
        (
            asking("pinned", exclusivity="Shared", policy="preferIds", preferIds=[0]),
            "policy preferIds names whole GPUs; use it with exclusivity Exclusive",
        ),
        (
            asking("crowd", exclusivity="Shared", sharing={"maxClaimsPerGPU": 65}),
            "spec.devices.sharing.maxClaimsPerGPU",
        ),
        (mig_claim("bad", 1, "x", "one-slice"), "spec.devices.migProfile"),
    ):
        try:
            await crs.create_claim(namespace, body)
        except Exception as exc:  # the API server's 422
            assert message in str(exc), str(exc)
        else:
            raise AssertionError(f"{body['metadata']['name']} was accepted")
    accepted = await crs.create_claim(namespace, mig_claim("two-profiles", 1, "x", "1g.5gb, 2g.10gb"))
    assert accepted["spec"]["devices"]["migProfile"] == "1g.5gb, 2g.10gb"
