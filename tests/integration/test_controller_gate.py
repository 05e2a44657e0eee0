"""The scheduling gate: the controller lifts it once a claim pod's claim is allocated and checked."""

from __future__ import annotations

import uuid
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests import reviews
from tests.integration import controller_support as support


def gated_pod(name: str, claim: str, replica: int | None = None) -> dict[str, Any]:
    annotations = {constants.ANNOTATION_CLAIM: claim}
    if replica is not None:
        annotations[constants.ANNOTATION_REPLICA] = str(replica)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        # As the webhook leaves it in gate mode: the gate, and the label the controller watches.
        "metadata": {"name": name, "annotations": annotations, "labels": {constants.LABEL_GATED: "true"}},
        "spec": {
            "schedulingGates": [{"name": "example.com/other-gate"}, {"name": constants.SCHEDULING_GATE}],
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
        },
    }


async def test_a_gated_pod_created_before_allocation_gets_devices_node_and_loses_only_our_gate(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    nodes = [f"gpu-{run}-a", f"gpu-{run}-b"]
    for node in nodes:
        await support.create_gpu_node(api, node, labels={support.RUN_LABEL: run})
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    try:
        async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
            # Pods first: they wait behind the gate for a claim that does not exist yet.
            for replica in (0, 1):
                await transport.request(
                    api, "POST", pods_path, body=gated_pod(f"worker-{replica}", "gang", replica)
                )
            await resources.CustomResources(api).create_claim(
                namespace, support.claim_body("gang", 8, replicas=2, run=run)
            )

            async def released() -> list[dict[str, Any]] | None:
                pods = [await transport.request(api, "GET", f"{pods_path}/worker-{r}") for r in (0, 1)]
                ungated = all(
                    constants.SCHEDULING_GATE
                    not in {g["name"] for g in p["spec"].get("schedulingGates") or []}
                    for p in pods
                )
                return pods if ungated else None

            pods = await support.wait_for(released, within=30, what="both pods un-gated")
            claim = await resources.CustomResources(api).get_claim(namespace, "gang")
            by_replica = {a["replica"]: a for a in claim["status"]["allocations"]}
            assert sorted(support.status_uuids(claim)) == sorted(
                d["uuid"] for a in by_replica.values() for d in a["devices"]
            )
            for replica, pod in enumerate(pods):
                allocation = by_replica[replica]
                assert pod["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == ",".join(
                    d["uuid"] for d in allocation["devices"]
                )
                assert pod["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: allocation["nodeName"]}
                assert pod["spec"]["schedulingGates"] == [{"name": "example.com/other-gate"}]
                assert constants.LABEL_GATED not in (pod["metadata"].get("labels") or {})
    finally:
        for node in nodes:
            await support.delete_gpu_node(api, node)


async def test_pods_the_controller_cannot_release_stay_gated_with_a_still_gated_warning_saying_why(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    pinned = gated_pod("pinned-elsewhere", "one")
    pinned["spec"]["affinity"] = reviews.name_affinity("In", "some-other-node")
    typo = gated_pod("replica-typo", "one")
    typo["metadata"]["annotations"][constants.ANNOTATION_REPLICA] = "first"
    expected = {
        "pinned-elsewhere": "by its required node affinity (metadata.name In [some-other-node])",
        "replica-typo": "annotation gpu.scheduling/replica must be a non-negative integer",
        "for-failed": "claim doomed is Failed",
    }
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        for body in (pinned, typo, gated_pod("for-failed", "doomed")):
            await transport.request(api, "POST", pods_path, body=body)
        crs = resources.CustomResources(api)
        await crs.create_claim(namespace, support.claim_body("one", 1, run=run))
        # 9 GPUs never fit on an 8-GPU node: Failed after one retry.
        await crs.create_claim(namespace, support.claim_body("doomed", 9, run=run, max_retries=1))

        async def warnings() -> dict[str, str] | None:
            listing = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events")
            found = {
                e["involvedObject"]["name"]: e["message"]
                for e in listing["items"]
                if e["reason"] == "StillGated" and e["type"] == "Warning"
            }
            return found if set(found) == set(expected) else None

        found = await support.wait_for(
            warnings, within=120, what="a StillGated warning on each of the three pods"
        )
        for name, words in expected.items():
            assert words in found[name], (name, found[name])
            stored = await transport.request(api, "GET", f"{pods_path}/{name}")
            gates = {g["name"] for g in stored["spec"]["schedulingGates"]}
            assert constants.SCHEDULING_GATE in gates, f"{name} was un-gated"
            assert constants.ANNOTATION_DEVICES not in (stored["metadata"].get("annotations") or {})


def admitted_pod(name: str, claim: str, node: str, uuids: str) -> dict[str, Any]:
    """A pod as the webhook admits it for a claim it sees Allocated: the devices in its env and
    annotation, the node pin, and held at the gate for the controller to check."""
    body = gated_pod(name, claim)
    body["metadata"]["annotations"][constants.ANNOTATION_DEVICES] = uuids
    body["spec"]["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]
    body["spec"]["nodeSelector"] = {constants.HOSTNAME_LABEL: node}
    body["spec"]["containers"][0]["env"] = [
        {"name": name, "value": uuids} for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
    ]
    return body


async def test_a_pod_admitted_from_an_out_of_date_view_of_a_recreated_claim_stays_gated(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    """The webhook's watch may still show a deleted claim Allocated when a claim of the same name
    has been created again and holds other GPUs: a pod admitted from that view carries the old
    GPUs in its env. The controller lifts the gate only for the devices the claim holds now."""
    node, run = gpu_node
    pods_path = f"/api/v1/namespaces/{namespace}/pods"
    crs = resources.CustomResources(api)

    async def allocated(name: str) -> str:
        async def uuids() -> str | None:
            claim = await crs.get_claim(namespace, name)
            if (claim.get("status") or {}).get("phase") != constants.PHASE_ALLOCATED:
                return None
            return ",".join(d["uuid"] for d in claim["status"]["allocations"][0]["devices"])

        return await support.wait_for(uuids, within=30, what=f"claim {name} Allocated")

    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        await crs.create_claim(namespace, support.claim_body("train", 2, run=run))
        old = await allocated("train")
        await crs.delete_claim(namespace, "train")

        async def gone() -> bool | None:
            claims = (await crs.list_claims(namespace))["items"]
            return True if all(c["metadata"]["name"] != "train" for c in claims) else None

        await support.wait_for(gone, within=30, what="claim train gone")
        # Another claim takes the old GPUs (binpack: the first free ones), so the new "train"
        # gets others.
        await crs.create_claim(namespace, support.claim_body("filler", 2, run=run))
        assert await allocated("filler") == old
        await crs.create_claim(namespace, support.claim_body("train", 2, run=run))
        new = await allocated("train")
        assert new != old
        await transport.request(api, "POST", pods_path, body=admitted_pod("stale", "train", node, old))
        await transport.request(api, "POST", pods_path, body=admitted_pod("fresh", "train", node, new))

        async def fresh_ungated() -> bool | None:
            pod = await transport.request(api, "GET", f"{pods_path}/fresh")
            return True if not pod["spec"].get("schedulingGates") else None

        await support.wait_for(fresh_ungated, within=30, what="pod fresh un-gated")

        async def warning() -> str | None:
            listing = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events")
            for event in listing["items"]:
                if event["reason"] == "StillGated" and event["involvedObject"]["name"] == "stale":
                    return str(event["message"])
            return None

        message = await support.wait_for(warning, within=30, what="a StillGated warning on pod stale")
        assert "out-of-date view of claim train" in message and old in message and new in message
        stale = await transport.request(api, "GET", f"{pods_path}/stale")
        assert stale["spec"]["schedulingGates"] == [{"name": constants.SCHEDULING_GATE}]
        assert stale["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == old
