"""``release: OnPodsCompleted`` and ``OnOwnerCompleted`` on the real API server, with
kube-controller-manager running Jobs: an Indexed Job's claim is Released once its pods complete,
another claim then gets the GPUs, and the claim goes away with the Job it names as owner; a claim
that follows its Job is kept while the Job runs and Released once it is Complete (issue 21).

There is no kubelet: the test marks the Job's pods Succeeded through the status subresource, as a
kubelet would.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support

SWEEP = 2.0  # the controller's --sweep-interval in these tests


@pytest.fixture
async def sweeping(kubeconfig: str, namespace: str, kcm_node: tuple[str, str]) -> AsyncIterator[str]:
    """The controller, sweeping every SWEEP seconds, for the claims of kcm_node's run; the run tag."""
    _, run = kcm_node
    argv = support.controller_argv(namespace, "--sweep-interval", str(SWEEP), run=run)
    async with support.running_controller(kubeconfig, argv):
        yield run


async def job_pods(api: Api, namespace: str, job: str) -> list[dict[str, Any]]:
    listing = await transport.request(
        api,
        "GET",
        f"/api/v1/namespaces/{namespace}/pods",
        query=[("labelSelector", f"batch.kubernetes.io/job-name={job}")],
    )
    return list(listing.get("items") or [])


async def succeed(api: Api, pod: dict[str, Any]) -> None:
    """What the kubelet would write when the pod's containers exited 0."""
    meta, container = pod["metadata"], pod["spec"]["containers"][0]
    now = "2026-11-25T00:00:00Z"
    status = {
        "phase": "Succeeded",
        "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted"}],
        "containerStatuses": [
            {
                "name": container["name"],
                "image": container["image"],
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": {
                    "terminated": {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}
                },
            }
        ],
    }
    await transport.request(
        api,
        "PATCH",
        f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
        body={"status": status},
        content_type=transport.MERGE_PATCH,
    )


async def test_an_indexed_jobs_claim_is_released_when_its_pods_complete_and_goes_with_the_job(
    api: Api, namespace: str, sweeping: str
) -> None:
    run = sweeping
    crs = resources.CustomResources(api)
    job = await support.create_job(api, namespace, support.claim_job("train", "train", run=run, replicas=2))
    body = support.claim_body("train", 4, run=run, replicas=2)
    body["spec"]["release"] = constants.RELEASE_ON_PODS_COMPLETED
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": job["metadata"]["uid"]}
    ]
    claim = await crs.create_claim(namespace, body)
    allocated = await support.wait_phase(api, namespace, "train", "Allocated")
    pods = await support.wait_for(
        lambda: _two(job_pods(api, namespace, "train")), what="the Job's two pods", within=60
    )

    # The Job's pods are created one after the other, so a sweep may record one pod before the
    # next sweep records both: wait for the condition to name both.
    async def recorded() -> dict[str, Any] | None:
        got = await support.get_claim(api, namespace, "train")
        in_use = support.condition(got, "InUse")
        return got if in_use.get("status") == "True" and "used by 2 pods" in in_use["message"] else None

    used = await support.wait_for(
        recorded, within=4 * SWEEP + 10, what="the claim to record both of its pods"
    )
    assert all(pod["metadata"]["name"] in support.condition(used, "InUse")["message"] for pod in pods)
    assert used["status"]["phase"] == "Allocated"

    # Another claim waits for the same GPUs.
    await crs.create_claim(namespace, support.claim_body("next", 8, run=run))
    for pod in pods:
        await succeed(api, pod)

    released = await support.wait_phase(api, namespace, "train", "Released", within=4 * SWEEP + 15)
    status = released["status"]
    assert status.get("allocations") is None and status["releasedTime"]
    assert support.condition(released, "InUse")["reason"] == "PodsCompleted"
    assert status["message"].startswith("released 8 GPUs: every pod that used the claim has completed")
    following = await support.wait_phase(api, namespace, "next", "Allocated", within=30)
    assert set(support.status_uuids(following)) == set(support.status_uuids(allocated))
    holders = {lease["spec"]["holderIdentity"] for lease in await support.device_leases(api, namespace)}
    assert claim["metadata"]["uid"] not in holders

    # The Job completes; deleting it takes the claim with it (ownerReferences, garbage collector).
    await transport.request(
        api,
        "DELETE",
        f"/apis/batch/v1/namespaces/{namespace}/jobs/train",
        body={"propagationPolicy": "Background"},
    )

    async def gone() -> bool:
        return await support.get_claim(api, namespace, "train") is None

    await support.wait_for(gone, within=60, what="the claim to go with its Job")


async def test_an_owner_completed_claim_follows_its_job(api: Api, namespace: str, sweeping: str) -> None:
    run = sweeping
    crs = resources.CustomResources(api)
    job = await support.create_job(api, namespace, support.claim_job("owner", "owned", run=run, replicas=2))
    body = support.claim_body("owned", 2, run=run)
    body["spec"]["release"] = constants.RELEASE_ON_OWNER_COMPLETED
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": "owner",
            "uid": job["metadata"]["uid"],
            "controller": True,
        }
    ]
    await crs.create_claim(namespace, body)
    await support.wait_phase(api, namespace, "owned", "Allocated")
    pods = await support.wait_for(
        lambda: _two(job_pods(api, namespace, "owner")), what="the Job's two pods", within=60
    )
    await asyncio.sleep(2 * SWEEP)  # two sweeps while the Job runs
    got = await support.get_claim(api, namespace, "owned")
    assert got is not None and got["status"]["phase"] == "Allocated"

    for pod in pods:
        await succeed(api, pod)
    released = await support.wait_phase(api, namespace, "owned", "Released", within=4 * SWEEP + 30)
    assert released["status"]["message"] == (
        "released 2 GPUs: its Job owner is Complete; create a new claim for more work"
    )

    async def let_go() -> bool:
        leases = await support.device_leases(api, namespace)
        return released["metadata"]["uid"] not in {lease["spec"]["holderIdentity"] for lease in leases}

    await support.wait_for(let_go, within=10, what="its Leases to be released (after the status write)")


async def test_a_claim_whose_pods_never_ran_is_kept(api: Api, namespace: str, sweeping: str) -> None:
    run = sweeping
    crs = resources.CustomResources(api)
    body = support.claim_body("idle", 2, run=run)
    body["spec"]["release"] = constants.RELEASE_ON_PODS_COMPLETED
    await crs.create_claim(namespace, body)
    await support.wait_phase(api, namespace, "idle", "Allocated")
    await asyncio.sleep(3 * SWEEP)  # three sweeps with no pod at all
    got = await support.get_claim(api, namespace, "idle")
    assert got is not None and got["status"]["phase"] == "Allocated"


async def _two(pending: Any) -> list[dict[str, Any]] | None:
    pods: list[dict[str, Any]] = await pending
    return pods if len(pods) == 2 else None
