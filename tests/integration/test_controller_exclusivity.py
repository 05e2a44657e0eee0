"""The three ways a GPU used to be double-booked, against the real API server.

* a claim deleted while its pod runs keeps its Leases, Terminating with the
  reason (condition InUse), until the pod is gone; only then does another
  claim get its GPUs;
* a Lease of an Allocated claim deleted by hand does not free its GPU: the
  finalizer keeps it, and even with the finalizer forced off, planning counts
  the devices the claim's status lists, and the owner re-creates its Lease;
* an Allocated claim whose Lease another claim holds gets ``DevicesLost`` with
  reason ``DevicesTaken`` (the webhook then refuses its new pods:
  ``test_webhook_cluster``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gpualloc.api import constants
from gpualloc.api import leases as lease_format
from gpualloc.kube import errors, leases, resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support

GPUS = 8  # create_gpu_node's default board


async def create_pod(api: Api, namespace: str, name: str, claim: str) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {constants.ANNOTATION_CLAIM: claim}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    await transport.request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=body)


async def held(api: Api, namespace: str) -> dict[str, str]:
    """Lease name -> holder of every device Lease in ``namespace``."""
    return {
        lease["metadata"]["name"]: lease["spec"].get("holderIdentity", "")
        for lease in await support.device_leases(api, namespace)
    }


Probe = Callable[[], Awaitable[Any]]


async def test_a_claim_deleted_while_its_pod_runs_keeps_its_leases_until_the_pod_is_gone(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    crs = resources.CustomResources(api)
    argv = support.controller_argv(namespace, "--in-use-poll", "1", run=run)
    async with support.running_controller(kubeconfig, argv):
        created = await crs.create_claim(namespace, support.claim_body("first", GPUS, run=run))
        first = await support.wait_phase(api, namespace, "first", "Allocated")
        uid = created["metadata"]["uid"]
        await create_pod(api, namespace, "worker", "first")  # Pending: not finished, so in use
        await crs.delete_claim(namespace, "first")

        kept = await support.wait_condition(api, namespace, "first", "InUse", status="True", within=60)
        assert kept["metadata"].get("deletionTimestamp")
        assert "worker" in support.condition(kept, "InUse")["message"]
        await crs.create_claim(namespace, support.claim_body("second", 1, run=run, priority=1000))
        second = await support.wait_for(
            lambda: _explained(api, namespace, "second"), within=60, what="the second claim to be explained"
        )
        assert second["status"]["phase"] == "Pending", second["status"]
        holders = await held(api, namespace)
        assert {name: h for name, h in holders.items() if h == uid} == {
            constants.lease_name(u): uid for u in support.status_uuids(first)
        }

        await transport.request(
            api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/worker", body={"gracePeriodSeconds": 0}
        )
        got = await support.wait_phase(api, namespace, "second", "Allocated", within=60)
        assert await support.get_claim(api, namespace, "first") is None
        assert set(support.status_uuids(got)) <= set(support.status_uuids(first))
        assert set((await held(api, namespace)).values()) == {got["metadata"]["uid"]}


async def _explained(api: Api, namespace: str, name: str) -> dict[str, Any] | None:
    got = await support.get_claim(api, namespace, name)
    return got if ((got or {}).get("status") or {}).get("message") else None


async def test_a_lease_deleted_by_hand_does_not_give_its_gpu_to_another_claim(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        created = await crs.create_claim(namespace, support.claim_body("owner", GPUS, run=run))
        owner = await support.wait_phase(api, namespace, "owner", "Allocated")
        uid = created["metadata"]["uid"]
        victim = constants.lease_name(support.status_uuids(owner)[0])

        # As kubectl delete would: the finalizer keeps the Lease, and the lock with it.
        await leases.delete_lease(api, namespace, victim)
        lease = await leases.get_lease(api, namespace, victim)
        assert lease["metadata"].get("deletionTimestamp") and lease["spec"]["holderIdentity"] == uid
        # Priority 1000 would preempt the owner, which is fair: this test is about the lost Lease.
        thief_body = support.claim_body("thief", 1, run=run, priority=1000)
        thief_body["spec"]["preemptionPolicy"] = "Never"
        await crs.create_claim(namespace, thief_body)
        thief = await support.wait_for(
            lambda: _explained(api, namespace, "thief"), what="the thief to be explained"
        )
        assert thief["status"]["phase"] == "Pending", thief["status"]

        # Forced: the finalizer removed by hand, the Lease gone. The owner's status still counts,
        # and the owner takes its Lease back.
        await _force_finalizer_off(api, namespace, victim)

        async def recreated() -> dict[str, Any] | None:
            try:
                again = await leases.get_lease(api, namespace, victim)
            except errors.NotFound:
                return None
            return again if again["metadata"]["uid"] != lease["metadata"]["uid"] else None

        again = await support.wait_for(recreated, what="the owner to re-create its Lease")
        assert again["spec"]["holderIdentity"] == uid
        assert again["metadata"]["finalizers"] == [lease_format.FINALIZER]
        thief = await support.get_claim(api, namespace, "thief")
        assert thief is not None and thief["status"]["phase"] == "Pending"
        assert set((await held(api, namespace)).values()) == {uid}


async def _force_finalizer_off(api: Api, namespace: str, name: str) -> None:
    """As an admin would, by hand: empty the Lease's finalizers (it is Terminating, so it goes)."""
    lease = await leases.get_lease(api, namespace, name)
    await leases.replace_lease(
        api, namespace, name, {**lease, "metadata": {**lease["metadata"], "finalizers": []}}
    )


async def test_a_claim_whose_lease_another_claim_holds_is_marked_devices_taken(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    crs = resources.CustomResources(api)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        await crs.create_claim(namespace, support.claim_body("owner", 2, run=run))
        owner = await support.wait_phase(api, namespace, "owner", "Allocated")
    # With no controller running, someone replaces one of its Leases by another claim's. (That
    # claim has no run label, so no controller of this test handles it; it exists, so the sweep
    # leaves its Lease alone.)
    body = support.claim_body("intruder", 1, run=run)
    del body["metadata"]["labels"]
    intruder = await crs.create_claim(namespace, body)
    uuid_ = support.status_uuids(owner)[0]
    victim = constants.lease_name(uuid_)
    await leases.delete_lease(api, namespace, victim)
    await _force_finalizer_off(api, namespace, victim)
    await leases.create_lease(
        api,
        namespace,
        victim,
        holder=intruder["metadata"]["uid"],
        labels={constants.LABEL_MANAGED_BY: constants.MANAGED_BY, support.RUN_LABEL: run},
        annotations={constants.LABEL_CLAIM_NAMESPACE: namespace, constants.LABEL_CLAIM_NAME: "intruder"},
    )
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        got = await support.wait_condition(
            api, namespace, "owner", constants.CONDITION_DEVICES_LOST, status="True"
        )
    lost = support.condition(got, constants.CONDITION_DEVICES_LOST)
    assert lost["reason"] == constants.REASON_DEVICES_TAKEN
    assert f"{uuid_} is held by claim {namespace}/intruder" in lost["message"]
    assert got["status"]["phase"] == "Allocated"
    assert (await held(api, namespace))[victim] == intruder["metadata"]["uid"]
