"""Milli-GPU shares against the real API server, the controller and the webhook (issue 39).

A node published as the simulated agent publishes the a100-pcie-4-nvlink profile, without
``--sharing``: its four GPUs are whole GPUs, and shares of them (``sharing.milli``) are held as
entries of each GPU's own Lease, ``gpu-<uuid>`` (``controller.locking``, rules 6 to 8).
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import pytest

from gpualloc.api import constants, leases
from gpualloc.kube import errors, resources, transport
from gpualloc.kube import leases as kube_leases
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.test_quota import get_quota, over_quota, quota
from tests.integration.test_shared_claims import message_of
from tests.integration.test_webhook_cluster import (  # noqa: F401 - webhook and its options: fixtures
    create_pod,
    env,
    pod,
    webhook,
    webhook_options,
)

PROFILE = "a100-pcie-4-nvlink"


def share_claim(name: str, run: str, milli: int, strategy: str = "MPS") -> dict[str, Any]:
    body = support.claim_body(name, 1, run=run)
    body["spec"]["devices"].update(exclusivity="Shared", sharing={"strategy": strategy, "milli": milli})
    return body


def share_of(claim: dict[str, Any]) -> tuple[str, int]:
    (device,) = claim["status"]["allocations"][0]["devices"]
    return device["uuid"], device["milli"]


async def ledger(api: Api, namespace: str, gpu: str) -> dict[str, int] | None:
    """The shares the Lease of ``gpu`` holds, by claim uid; None when it has no Lease."""
    try:
        raw = await transport.request(
            api,
            "GET",
            f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{constants.lease_name(gpu)}",
        )
    except errors.NotFound:
        return None
    info = leases.parse(raw)
    assert info.ledger, f"the Lease of {gpu} holds a whole claim, {info.holder}"
    return {s.holder: s.milli for s in info.shares}


async def delete_claim(api: Api, namespace: str, name: str) -> None:
    await transport.request(api, "DELETE", f"/apis/gpu.scheduling/v1/namespaces/{namespace}/gpuclaims/{name}")

    async def gone() -> bool:
        return await support.get_claim(api, namespace, name) is None

    await support.wait_for(gone, within=30, what=f"claim {name} to give its share back and go")


@pytest.mark.usefixtures("webhook")
async def test_shares_pack_a_gpu_in_its_lease_ledger_pods_get_mps_limits_and_release_frees_the_gpu(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    node = f"frac-{run}"
    inv = await support.publish_simulated_node(api, node, run, PROFILE)
    memory = {d.uuid: d.memory_mib for d in inv.devices}
    crs = resources.CustomResources(api)
    try:
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
            got: dict[str, dict[str, Any]] = {}
            for name, milli in (("a", 600), ("b", 400), ("c", 300)):  # one at a time: each sees the last
                await crs.create_claim(namespace, share_claim(name, run, milli))
                got[name] = await support.wait_phase(api, namespace, name, "Allocated", within=30)
            (gpu, _), (other, _) = share_of(got["a"]), share_of(got["c"])
            # Best fit: b's 400 fills a's GPU exactly; c's 300 then needs another GPU.
            assert share_of(got["b"]) == (gpu, 400) and other != gpu
            uid = {name: claim["metadata"]["uid"] for name, claim in got.items()}
            assert await ledger(api, namespace, gpu) == {uid["a"]: 600, uid["b"]: 400}
            assert await ledger(api, namespace, other) == {uid["c"]: 300}

            # A whole claim takes only the GPUs no share is on; a share that fits no GPU says why.
            await crs.create_claim(namespace, support.claim_body("whole", 2, run=run))
            whole = await support.wait_phase(api, namespace, "whole", "Allocated", within=30)
            assert not {gpu, other} & set(support.status_uuids(whole))
            await crs.create_claim(namespace, share_claim("big", run, 800))
            waiting = await message_of(api, namespace, "big", "no GPU with 800 milli-GPU free")
            assert waiting["status"]["phase"] == "Pending"

            # The webhook gives a's pod its GPU by UUID and the share's MPS limits, in every container.
            await create_pod(api, namespace, pod("infer", "a"))
            stored = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/infer")
            for container in stored["spec"]["initContainers"] + stored["spec"]["containers"]:
                values = env(container)
                assert values["CUDA_VISIBLE_DEVICES"] == gpu, container["name"]
                assert values["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60", container["name"]
                assert values["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={memory[gpu] * 600 // 1000}M"
            assert stored["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: node}

            # Releasing b takes its entry out; releasing a, the last, deletes the Lease: the GPU is
            # whole again, and the waiting share gets it.
            await delete_claim(api, namespace, "b")
            assert await ledger(api, namespace, gpu) == {uid["a"]: 600}
            await transport.request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/infer")
            await delete_claim(api, namespace, "a")
            big = await support.wait_phase(api, namespace, "big", "Allocated", within=30)
            assert share_of(big) == (gpu, 800)
            assert await ledger(api, namespace, gpu) == {big["metadata"]["uid"]: 800}
    finally:
        await support.delete_gpu_node(api, node)


async def test_a_quota_counts_a_share_as_its_fraction_of_a_gpu(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    node = f"frac-{run}"
    await support.publish_simulated_node(api, node, run, PROFILE)
    crs = resources.CustomResources(api)
    try:
        async with (
            quota(api, namespace, {"gpus": 1}) as name,
            support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)),
        ):
            for claim, milli in (("a", 600), ("b", 400)):  # 1 GPU in all: within the quota
                await crs.create_claim(namespace, share_claim(claim, run, milli, strategy="TimeSlicing"))
                await support.wait_phase(api, namespace, claim, "Allocated", within=30)
            stored = await get_quota(api, namespace, name)
            assert (stored["status"]["used"], stored["status"]["usedMilli"]) == (1, 1000)
            await crs.create_claim(namespace, share_claim("c", run, 100, strategy="TimeSlicing"))
            waiting = await support.wait_for(
                lambda: over_quota(api, namespace, "c"), within=30, what="claim c to wait for its quota"
            )
            assert "would use 1.1 of 1 GPUs" in waiting["status"]["message"], waiting["status"]["message"]
            await delete_claim(api, namespace, "b")
            await support.wait_phase(api, namespace, "c", "Allocated", within=30)
            stored = await get_quota(api, namespace, name)
            assert stored["status"]["usedMilli"] == 700
    finally:
        await support.delete_gpu_node(api, node)


async def test_a_share_left_in_a_ledger_by_a_dead_attempt_of_the_same_claim_is_released_not_adopted(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    node = f"frac-{run}"
    inv = await support.publish_simulated_node(api, node, run, PROFILE)
    crs = resources.CustomResources(api)
    try:
        created = await crs.create_claim(namespace, share_claim("c", run, 300, strategy="TimeSlicing"))
        meta = created["metadata"]
        # What an attempt killed between its ledger write and its status write leaves: an entry of
        # this claim, at the version it planned from, in the ledger of every GPU of the node.
        entry = leases.share_entry(
            milli=300,
            claim_namespace=namespace,
            claim_name="c",
            claim_resource_version=meta["resourceVersion"],
        )
        for device in inv.devices:
            body = leases.share_lease(
                namespace,
                uuid=device.uuid,
                node=node,
                entries={meta["uid"]: entry},
                now=datetime.datetime.now(datetime.UTC),
            )
            await kube_leases.create(api, namespace, body)
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
            allocated = await support.wait_phase(api, namespace, "c", "Allocated", within=60)
        gpu, milli = share_of(allocated)
        assert milli == 300
        shares = await ledger(api, namespace, gpu)
        assert shares == {meta["uid"]: 300}
        raw = await kube_leases.get_lease(api, namespace, constants.lease_name(gpu))
        stamped = leases.ledger(raw)[meta["uid"]]["claimResourceVersion"]
        assert stamped != meta["resourceVersion"]  # the live attempt's entry, not the dead one's
        for device in inv.devices:
            if device.uuid != gpu:
                assert await ledger(api, namespace, device.uuid) is None  # released and deleted
    finally:
        await support.delete_gpu_node(api, node)
