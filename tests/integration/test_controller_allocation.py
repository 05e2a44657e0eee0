"""The controller against the real API server: allocation, locking, release, contention, gangs."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gpualloc.api import constants
from gpualloc.api import leases as device_lease
from gpualloc.kube import errors, resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support

NodeFactory = Callable[..., Awaitable[str]]


@pytest.fixture
def run_id() -> str:
    return uuid.uuid4().hex[:8]


@pytest.fixture
async def gpu_nodes(api: Api, run_id: str) -> AsyncIterator[NodeFactory]:
    """Make GPU nodes labelled with this test's run id; deleted after the test."""
    made: list[str] = []

    async def make(suffix: str, **kwargs: Any) -> str:
        name = f"gpu-{run_id}-{suffix}"
        labels = {support.RUN_LABEL: run_id, **kwargs.pop("labels", {})}
        await support.create_gpu_node(api, name, labels=labels, **kwargs)
        made.append(name)
        return name

    yield make
    for name in made:
        await support.delete_gpu_node(api, name)


async def test_claim_is_allocated_with_leases_held_by_its_uid_and_deleting_it_releases_them(
    api: Api, kubeconfig: str, namespace: str, gpu_nodes: NodeFactory, run_id: str
) -> None:
    node = await gpu_nodes("a")
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run_id)):
        created = await crs.create_claim(namespace, support.claim_body("train", 4, run=run_id))
        uid = created["metadata"]["uid"]
        got = await support.wait_phase(api, namespace, "train", "Allocated")
        status = got["status"]
        assert constants.FINALIZER in got["metadata"]["finalizers"]
        assert status["nodes"] == node and status["devices"] == "0,1,2,3"
        assert status["observedGeneration"] == got["metadata"]["generation"]
        assert {c["type"]: c["status"] for c in status["conditions"]}["Allocated"] == "True"
        uuids = support.status_uuids(got)
        assert sorted(uuids) == sorted(support.gpu_uuid(node, i) for i in range(4))
        leases = await support.device_leases(api, namespace)
        assert sorted(lease["metadata"]["name"] for lease in leases) == sorted(
            constants.lease_name(u) for u in uuids
        )
        for lease in leases:
            assert lease["spec"]["holderIdentity"] == uid
            assert lease["metadata"]["labels"] == {
                constants.LABEL_NODE: node,
                constants.LABEL_CLAIM_NAMESPACE: namespace,
                constants.LABEL_CLAIM_NAME: "train",
                constants.LABEL_CLAIM_UID: uid,
                constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
            }

        await crs.delete_claim(namespace, "train")

        async def released() -> bool:
            return await support.get_claim(
                api, namespace, "train"
            ) is None and not await support.device_leases(api, namespace)

        await support.wait_for(released, within=30, what="claim gone and its leases released")


async def test_a_claim_name_past_the_63_character_label_limit_is_allocated_and_kept_whole_in_annotations(
    api: Api, kubeconfig: str, namespace: str, gpu_nodes: NodeFactory, run_id: str
) -> None:
    # A claim's name may be 253 characters, a label value only 63. (A node's name is its
    # kubernetes.io/hostname label, so it is a valid label value already.)
    await gpu_nodes("a")
    name = "c" * 200
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run_id)):
        created = await crs.create_claim(namespace, support.claim_body(name, 2, run=run_id))
        got = await support.wait_phase(api, namespace, name, "Allocated")
        leases = await support.device_leases(api, namespace)
        assert sorted(lease["metadata"]["name"] for lease in leases) == sorted(
            constants.lease_name(u) for u in support.status_uuids(got)
        )
        for lease in leases:
            meta = lease["metadata"]
            assert meta["annotations"] == {
                constants.LABEL_CLAIM_NAMESPACE: namespace,
                constants.LABEL_CLAIM_NAME: name,
                device_lease.ANNOTATION_CLAIM_RESOURCE_VERSION: meta["annotations"].get(
                    device_lease.ANNOTATION_CLAIM_RESOURCE_VERSION, "missing"
                ),
            }
            assert meta["annotations"][device_lease.ANNOTATION_CLAIM_RESOURCE_VERSION].isdigit()
            label = meta["labels"][constants.LABEL_CLAIM_NAME]
            assert len(label) <= 63 and label.startswith("c" * 40) and label != name
            assert meta["labels"][constants.LABEL_CLAIM_UID] == created["metadata"]["uid"]

        await crs.delete_claim(namespace, name)

        async def released() -> bool:
            return await support.get_claim(api, namespace, name) is None and not await support.device_leases(
                api, namespace
            )

        await support.wait_for(released, within=30, what="claim gone and its leases released")


async def test_two_namespaces_wanting_the_whole_node_get_it_exactly_once(
    api: Api, kubeconfig: str, namespace: str, gpu_nodes: NodeFactory, run_id: str
) -> None:
    await gpu_nodes("only")
    crs = resources.CustomResources(api)
    other = f"{namespace}-b"
    await transport.request(api, "POST", "/api/v1/namespaces", body={"metadata": {"name": other}})
    try:
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run_id)):
            await crs.create_claim(namespace, support.claim_body("whole", 8, run=run_id))
            await crs.create_claim(other, support.claim_body("whole", 8, run=run_id))

            async def settled() -> list[dict[str, Any]] | None:
                found = [await support.get_claim(api, ns, "whole") for ns in (namespace, other)]
                claims = [c for c in found if c is not None]
                phases = sorted(c.get("status", {}).get("phase", "") for c in claims)
                messages = [c.get("status", {}).get("message", "") for c in claims]
                return claims if phases == ["Allocated", "Pending"] and all(messages) else None

            claims = await support.wait_for(settled, within=30, what="one Allocated and one Pending")
            winner = next(c for c in claims if c["status"]["phase"] == "Allocated")
            loser = next(c for c in claims if c["status"]["phase"] == "Pending")
            assert len(support.status_uuids(winner)) == 8 and support.status_uuids(loser) == []
            assert "fit" in loser["status"]["message"]
            cond = {c["type"]: c for c in loser["status"]["conditions"]}["Allocated"]
            assert cond["status"] == "False" and cond["reason"] == "InsufficientDevices"
            leases = await support.device_leases(api, namespace)
            assert len(leases) == 8
            assert {lease["spec"]["holderIdentity"] for lease in leases} == {winner["metadata"]["uid"]}
    finally:
        with contextlib.suppress(errors.KubeError):
            await transport.request(api, "DELETE", f"/apis/gpu.scheduling/v1/namespaces/{other}/gpuclaims")
        with contextlib.suppress(errors.KubeError):
            await transport.request(api, "DELETE", f"/api/v1/namespaces/{other}")


async def test_a_claim_that_cannot_fit_stays_pending_and_is_allocated_once_capacity_frees(
    api: Api, kubeconfig: str, namespace: str, gpu_nodes: NodeFactory, run_id: str
) -> None:
    await gpu_nodes("a", kind="pcie")
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run_id)):
        await crs.create_claim(namespace, support.claim_body("blocker", 6, run=run_id))
        await support.wait_phase(api, namespace, "blocker", "Allocated")
        await crs.create_claim(namespace, support.claim_body("waiter", 4, run=run_id, backoff_seconds=600))

        async def explained() -> dict[str, Any] | None:
            got = await support.get_claim(api, namespace, "waiter")
            message = ((got or {}).get("status") or {}).get("message", "")
            return got if message else None

        waiting = await support.wait_for(explained, what="waiter to explain why it is pending")
        assert waiting["status"]["phase"] == "Pending"
        assert "0/1 nodes fit" in waiting["status"]["message"], waiting["status"]["message"]
        assert (
            waiting["status"]["message"]
            == {c["type"]: c for c in waiting["status"]["conditions"]}["Allocated"]["message"]
        )

        # The waiter's backoff is 10 minutes: only the freed capacity can wake it in time.
        await crs.delete_claim(namespace, "blocker")
        allocated = await support.wait_phase(api, namespace, "waiter", "Allocated", within=45)
        assert len(support.status_uuids(allocated)) == 4


async def test_a_gang_that_does_not_fit_whole_takes_nothing_and_one_that_fits_is_allocated_whole(
    api: Api, kubeconfig: str, namespace: str, gpu_nodes: NodeFactory, run_id: str
) -> None:
    await gpu_nodes("a")
    await gpu_nodes("b")
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run_id)):
        await crs.create_claim(namespace, support.claim_body("big-gang", 4, replicas=5, run=run_id))

        async def explained() -> dict[str, Any] | None:
            got = await support.get_claim(api, namespace, "big-gang")
            return got if ((got or {}).get("status") or {}).get("message") else None

        big = await support.wait_for(explained, what="the 5x4 gang to explain itself")
        assert big["status"]["phase"] == "Pending"
        assert not big["status"].get("allocations")
        assert await support.device_leases(api, namespace) == []

        await crs.create_claim(namespace, support.claim_body("gang", 4, replicas=4, run=run_id))
        gang = await support.wait_phase(api, namespace, "gang", "Allocated")
        allocations = gang["status"]["allocations"]
        assert sorted(a["replica"] for a in allocations) == [0, 1, 2, 3]
        assert all(len(a["devices"]) == 4 for a in allocations)
        uuids = support.status_uuids(gang)
        assert len(set(uuids)) == 16
        assert ";" in gang["status"]["devices"]
        leases = await support.device_leases(api, namespace)
        assert len(leases) == 16 and {lease["spec"]["holderIdentity"] for lease in leases} == {
            gang["metadata"]["uid"]
        }
        still = await support.get_claim(api, namespace, "big-gang")
        assert (
            still is not None
            and still["status"]["phase"] == "Pending"
            and not still["status"].get("allocations")
        )
