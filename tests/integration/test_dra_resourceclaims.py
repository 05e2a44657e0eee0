"""gpualloc as the DRA driver of its own allocations (issue 42 part 2), on the real kube-apiserver.

What the API server allows a ResourceClaim (``controller.resourceclaims`` builds on it), the
controller's ``--dra`` mirror (a ResourceClaim per allocated replica, following a move, gone with
the claim) and, with kube-scheduler, kube-controller-manager and kwok running, a pod that the
webhook's ``--dra`` gave the ResourceClaim: bound to the claim's node and reserved in the claim,
and let go by kube-controller-manager once deleted, the allocation kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from typing import Any

import pytest

from controller import resourceclaims as rcs
from gpualloc.api import constants
from gpualloc.kube import errors, resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.controller_support import KwokGpuNodes
from tests.integration.test_webhook_cluster import webhook  # noqa: F401 - fixture
from webhook import admission

RC_PATH = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims"
DEVICE_CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"


@pytest.fixture
def webhook_options() -> admission.Options:
    return admission.Options(dra=True)


async def held_pod(api: Api, namespace: str, name: str) -> dict[str, str]:
    """A ``reservedFor`` entry naming a real pod that never runs (held at a scheduling gate).
    kube-controller-manager, once an earlier test has started it, drops an entry whose pod does
    not exist, so a made-up pod would not hold a ResourceClaim."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "schedulingGates": [{"name": "example.com/held"}],
            "containers": [{"name": "main", "image": support.PAUSE_IMAGE}],
        },
    }
    created = await support.create_pod(api, namespace, body)
    return {"resource": "pods", "name": name, "uid": str(created["metadata"]["uid"])}


def rc_path(namespace: str, name: str = "") -> str:
    return RC_PATH.format(namespace=namespace) + (f"/{name}" if name else "")


async def get_rc(api: Api, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = await transport.request(api, "GET", rc_path(namespace, name))
    except errors.NotFound:
        return None
    return found


async def patch_rc_status(
    api: Api, namespace: str, name: str, patch: Any, *, json_patch: bool = False
) -> Any:
    return await transport.request(
        api,
        "PATCH",
        rc_path(namespace, name) + "/status",
        body=patch,
        content_type=transport.JSON_PATCH if json_patch else transport.MERGE_PATCH,
    )


def node_of(rc: dict[str, Any] | None) -> str:
    allocated = rcs.allocated_of(rc or {})
    return allocated.node if allocated is not None else ""


async def ensure_device_class(api: Api) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": constants.DRA_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{constants.DRA_DRIVER}"'}}]},
    }
    with contextlib.suppress(errors.AlreadyExists):
        await transport.request(api, "POST", DEVICE_CLASSES, body=body)


# ------------------------------------------------------------------ what the API server allows


async def test_the_api_server_serves_resource_v1_and_keeps_an_allocation_unchanged_until_it_is_removed(
    api: Api, namespace: str
) -> None:
    """status at creation is dropped; an allocation cannot be changed, only removed, and only while
    reservedFor is empty; spec cannot change (the reasons for ``resourceclaims.plan``)."""
    listing = await transport.request(api, "GET", "/apis/resource.k8s.io/v1")
    assert {"resourceclaims", "resourceclaims/status"} <= {r["name"] for r in listing["resources"]}
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "probe-gpus-0"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpus", "exactly": {"deviceClassName": constants.DRA_DRIVER, "count": 1}}
                ]
            }
        },
        "status": {
            "allocation": rcs.allocation_json(rcs.Allocated("node-a", (rcs.Result("node-a", "gpu-a"),)))
        },
    }
    created = await transport.request(api, "POST", rc_path(namespace), body=body)
    assert "allocation" not in (created.get("status") or {})
    on_a = rcs.allocation_json(rcs.Allocated("node-a", (rcs.Result("node-a", "gpu-a"),)))
    on_b = rcs.allocation_json(rcs.Allocated("node-b", (rcs.Result("node-b", "gpu-b"),)))
    await patch_rc_status(api, namespace, "probe-gpus-0", {"status": {"allocation": on_a}})
    # "field is immutable", past the part of the message the error keeps
    with pytest.raises(errors.Invalid, match=r"status\.allocation: Invalid value"):
        await patch_rc_status(api, namespace, "probe-gpus-0", {"status": {"allocation": on_b}})
    pod = await held_pod(api, namespace, "p")
    await patch_rc_status(api, namespace, "probe-gpus-0", {"status": {"reservedFor": [pod]}})
    with pytest.raises(errors.Invalid, match="reservedFor"):
        await patch_rc_status(api, namespace, "probe-gpus-0", {"status": {"allocation": None}})
    await patch_rc_status(api, namespace, "probe-gpus-0", {"status": {"reservedFor": None}})
    await patch_rc_status(api, namespace, "probe-gpus-0", {"status": {"allocation": None}})
    moved = await patch_rc_status(api, namespace, "probe-gpus-0", {"status": {"allocation": on_b}})
    assert node_of(moved) == "node-b"
    spec = copy.deepcopy(body["spec"])
    spec["devices"]["requests"][0]["exactly"]["count"] = 2
    with pytest.raises(errors.Invalid, match="spec: Invalid value"):
        await transport.request(
            api,
            "PATCH",
            rc_path(namespace, "probe-gpus-0"),
            body={"spec": spec},
            content_type=transport.MERGE_PATCH,
        )


# ------------------------------------------------------------------ the mirror


async def test_an_allocated_gang_gets_a_resourceclaim_per_replica_that_follows_a_move_and_goes_with_the_claim(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    run = uuid.uuid4().hex[:8]
    first, second, other = f"dra-{run}-a", f"dra-{run}-b", f"dra-{run}-c"
    for node in (first, other):
        await support.create_gpu_node(api, node, labels={support.RUN_LABEL: run}, gpus=4)
    crs = resources.CustomResources(api)
    argv = support.controller_argv(namespace, "--dra", run=run)
    try:
        async with support.running_controller(kubeconfig, argv):
            body = support.claim_body("gang", 4, run=run, replicas=2)
            body["spec"].update(onNodeLoss="Reallocate", nodeLossGracePeriodSeconds=1)
            await crs.create_claim(namespace, body)
            claim = await support.wait_phase(api, namespace, "gang", "Allocated")
            nodes = support.allocated_nodes(claim)

            async def mirrored() -> dict[str, dict[str, Any]] | None:
                got = {r: await get_rc(api, namespace, f"gang-gpus-{r}") for r in (0, 1)}
                ok = all(node_of(rc) == nodes[r] for r, rc in got.items())
                return {f"gang-gpus-{r}": rc for r, rc in got.items() if rc is not None} if ok else None

            found = await support.wait_for(mirrored, within=45, what="a ResourceClaim per replica")
            for allocation in claim["status"]["allocations"]:
                rc = found[f"gang-gpus-{allocation['replica']}"]
                assert rc["metadata"]["ownerReferences"] == [
                    {
                        "apiVersion": constants.API_VERSION,
                        "kind": "GpuClaim",
                        "name": "gang",
                        "uid": claim["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": False,
                    }
                ]
                assert rc["metadata"]["labels"][constants.LABEL_CLAIM_NAME] == "gang"
                assert rc["spec"]["devices"]["requests"][0]["exactly"]["count"] == 4
                results = rc["status"]["allocation"]["devices"]["results"]
                assert [(r["driver"], r["pool"], r["device"]) for r in results] == [
                    (constants.DRA_DRIVER, allocation["nodeName"], d["uuid"].lower())
                    for d in allocation["devices"]
                ]

            # The replica on `first` moves once that node is gone. A pod reserved in its
            # ResourceClaim holds the old allocation there until it is let go (as
            # kube-controller-manager does once the pod is gone).
            moving = next(r for r, node in nodes.items() if node == first)
            name = f"gang-gpus-{moving}"
            before = found[name]
            pod = await held_pod(api, namespace, "gone-soon")
            await patch_rc_status(api, namespace, name, {"status": {"reservedFor": [pod]}})
            await support.create_gpu_node(api, second, labels={support.RUN_LABEL: run}, gpus=4)
            await support.delete_gpu_node(api, first)

            async def moved() -> dict[str, Any] | None:
                got = await support.get_claim(api, namespace, "gang")
                return got if got and support.allocated_nodes(got).get(moving) == second else None

            await support.wait_for(moved, within=60, what=f"replica {moving} allocated on {second}")
            await asyncio.sleep(1.0)
            held = await get_rc(api, namespace, name)
            assert node_of(held) == first, "a reserved ResourceClaim keeps its allocation"
            await transport.request(api, "DELETE", f"/api/v1/namespaces/{namespace}/pods/gone-soon")
            await patch_rc_status(api, namespace, name, {"status": {"reservedFor": None}})

            async def followed() -> dict[str, Any] | None:
                rc = await get_rc(api, namespace, name)
                return rc if node_of(rc) == second else None

            after = await support.wait_for(followed, within=45, what=f"{name} allocated on {second}")
            assert after["metadata"]["uid"] == before["metadata"]["uid"], (
                "the same ResourceClaim, re-allocated"
            )

            await crs.delete_claim(namespace, "gang")

            async def gone() -> bool:
                return all([await get_rc(api, namespace, f"gang-gpus-{r}") is None for r in (0, 1)])

            await support.wait_for(gone, within=45, what="the claim's ResourceClaims deleted with it")
    finally:
        for node in (first, second, other):
            await support.delete_gpu_node(api, node)


# ------------------------------------------------------------------ with kube-scheduler


async def test_kube_scheduler_binds_a_pod_naming_the_resourceclaim_to_the_claims_node_and_reserves_it(
    api: Api,
    kubeconfig: str,
    namespace: str,
    kwok_gpu_nodes: KwokGpuNodes,
    webhook: Any,  # noqa: F811 - the fixture, with --dra (webhook_options)
) -> None:
    await ensure_device_class(api)
    run = kwok_gpu_nodes.run
    nodes = [await kwok_gpu_nodes.add(suffix) for suffix in ("a", "b")]
    argv = support.controller_argv(namespace, "--dra", "--claim-tolerations", "Any", run=run)
    async with support.running_controller(kubeconfig, argv):
        body = support.claim_body("train", 2, run=run)
        body["spec"]["tolerations"] = [support.run_toleration(run)]
        await resources.CustomResources(api).create_claim(namespace, body)
        claim = await support.wait_phase(api, namespace, "train", "Allocated")
        node = support.allocated_nodes(claim)[0]
        assert node in nodes
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "worker", "annotations": {constants.ANNOTATION_CLAIM: "train"}},
            "spec": {
                "tolerations": [support.run_toleration(run)],
                "containers": [{"name": "main", "image": support.PAUSE_IMAGE}],
            },
        }
        created = await support.create_pod(api, namespace, pod)
        assert created["spec"]["resourceClaims"] == [
            {"name": constants.DRA_POD_CLAIM, "resourceClaimName": "train-gpus-0"}
        ]
        assert created["spec"]["containers"][0]["resources"]["claims"] == [{"name": constants.DRA_POD_CLAIM}]
        path = f"/api/v1/namespaces/{namespace}/pods/worker"

        async def bound() -> dict[str, Any] | None:
            got: dict[str, Any] = await transport.request(api, "GET", path)
            return got if got["spec"].get("nodeName") else None

        try:
            placed = await support.wait_for(bound, within=45, what="the pod bound by kube-scheduler")
        except AssertionError:
            got = await transport.request(api, "GET", path)
            rc = await get_rc(api, namespace, "train-gpus-0")
            raise AssertionError(
                f"pod {got['spec'].get('schedulingGates')} {got.get('status')}; rc {rc}"
            ) from None
        assert placed["spec"]["nodeName"] == node

        rc = await get_rc(api, namespace, "train-gpus-0")
        assert rc is not None
        assert rc["status"]["reservedFor"] == [
            {"resource": "pods", "name": "worker", "uid": placed["metadata"]["uid"]}
        ]
        assert node_of(rc) == node
        assert "resource.kubernetes.io/delete-protection" not in (rc["metadata"].get("finalizers") or [])

        # kube-controller-manager lets the pod go once it is deleted; the allocation stays (no
        # delete-protection finalizer), so the claim's next pod is placed the same way.
        await transport.request(api, "DELETE", path, body={"gracePeriodSeconds": 0})

        async def released() -> dict[str, Any] | None:
            got = await get_rc(api, namespace, "train-gpus-0")
            return got if got and not (got.get("status") or {}).get("reservedFor") else None

        after = await support.wait_for(released, within=30, what="the pod let go from reservedFor")
        assert node_of(after) == node


@pytest.mark.parametrize("webhook_options", [admission.Options(dra=True, pending="gate")], ids=["gate"])
async def test_a_pod_made_before_its_claim_names_the_resourceclaim_at_creation_and_is_bound_once_allocated(
    api: Api,
    kubeconfig: str,
    namespace: str,
    kwok_gpu_nodes: KwokGpuNodes,
    webhook: Any,  # noqa: F811 - the fixture, in gate mode with --dra
) -> None:
    await ensure_device_class(api)
    run = kwok_gpu_nodes.run
    node = await kwok_gpu_nodes.add("a")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "early",
            "annotations": {constants.ANNOTATION_CLAIM: "later", "gpu.scheduling/replica": "1"},
        },
        "spec": {
            "tolerations": [support.run_toleration(run)],
            "containers": [{"name": "main", "image": support.PAUSE_IMAGE}],
        },
    }
    created = await support.create_pod(api, namespace, pod)
    assert created["spec"]["resourceClaims"] == [
        {"name": constants.DRA_POD_CLAIM, "resourceClaimName": "later-gpus-1"}
    ]
    assert created["spec"]["schedulingGates"], "gated until the claim is allocated"
    argv = support.controller_argv(namespace, "--dra", "--claim-tolerations", "Any", run=run)
    async with support.running_controller(kubeconfig, argv):
        body = support.claim_body("later", 1, run=run, replicas=2)
        body["spec"]["tolerations"] = [support.run_toleration(run)]
        await resources.CustomResources(api).create_claim(namespace, body)
        path = f"/api/v1/namespaces/{namespace}/pods/early"

        async def bound() -> dict[str, Any] | None:
            got: dict[str, Any] = await transport.request(api, "GET", path)
            return got if got["spec"].get("nodeName") else None

        placed = await support.wait_for(
            bound, within=60, what="the gated pod bound once its claim is allocated"
        )
        assert placed["spec"]["nodeName"] == node
        rc = await get_rc(api, namespace, "later-gpus-1")
        assert rc is not None and node_of(rc) == node
        assert [r["uid"] for r in rc["status"]["reservedFor"]] == [placed["metadata"]["uid"]]
