"""A tenant's finalizer strip and tolerations, attacked with its own token (issue 37, items 1 and 4).

The release, the tenant (a ServiceAccount bound to ``edit``, with a TokenRequest token) and the
chart's policies come from the e2e fixtures (``tests/e2e/conftest.py``, ``tests/e2e/tenants.py``). The
controller runs in this process as the chart's controller ServiceAccount (a TokenRequest token of
it, so the chart's RBAC and the policies' exemptions are what it meets).

* **The finalizer strip.** A tenant deleted its Allocated claim while the claim's pod ran (the
  claim stays, Terminating with ``InUse``), then removed ``gpu.scheduling/release-devices`` from
  its finalizers with a plain patch: the claim vanished and its GPU went to another namespace. Now
  the claim-finalizer-removal ValidatingAdmissionPolicy refuses it in every form (JSON patch,
  merge patch, PUT), for a Preempted claim too, while the controller's ServiceAccount still
  removes it once the pods are gone. The status subresource cannot change the finalizers.
* **Tolerations are the operator's.** A tenant's claim that tolerates a taint meant to keep its
  team off a node is not allocated there until a GpuQuota of its namespace allows the toleration
  (``spec.allowedTolerations``, which only cluster admins write).
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import client as kube_client
from gpualloc.kube import errors, resources, transport
from gpualloc.kube.client import Api
from tests.e2e import tenants
from tests.integration import controller_support as support

WHY = "only the gpualloc controller may remove it; it does once the claim's pods are gone"


def strip_refusal(namespace: str, name: str) -> str:
    return f"GpuClaim {namespace}/{name}: the finalizer {constants.FINALIZER} cannot be removed: {WHY}"


async def controller_kubeconfig(s: tenants.Setup) -> str:
    """A kubeconfig with a token of the chart's controller ServiceAccount."""
    token = await tenants.service_account_token(s.admin, s.system, f"{s.fullname}-controller")
    return str(s.token_kubeconfig(token, "controller.kubeconfig"))


async def wait_until_strips_are_refused(s: tenants.Setup) -> None:
    """The API server loads the policy and its binding from watches: a dry-run strip until refused."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    await tenants.call(
        s.tenant, "POST", tenants.claims_path(s.tenant_ns), body=support.claim_body(name, 1, run="probe")
    )
    path = f"{tenants.claims_path(s.tenant_ns)}/{name}"

    async def in_force() -> bool:
        try:
            await tenants.call(
                s.tenant,
                "PATCH",
                path,
                body={"metadata": {"finalizers": None}},
                content_type=tenants.MERGE,
                query=[("dryRun", "All")],
            )
        except errors.KubeError as exc:
            return exc.status == 403 and WHY in exc.message
        return False

    try:
        await tenants.eventually("the claim-finalizer-removal ValidatingAdmissionPolicy", in_force)
    finally:
        await tenants.purge_claim(s.admin, s.tenant_ns, name)


async def try_every_strip(tenant: Api, namespace: str, name: str) -> None:
    """A JSON patch (remove, and replace the list), a merge patch (null and []), and a
    PUT without the finalizer: each refused with the policy's message."""
    path = f"{tenants.claims_path(namespace)}/{name}"
    stored = await tenants.call(tenant, "GET", path)
    index = stored["metadata"]["finalizers"].index(constants.FINALIZER)
    at = f"/metadata/finalizers/{index}"
    attempts: list[tuple[Any, str]] = [
        (
            [{"op": "test", "path": at, "value": constants.FINALIZER}, {"op": "remove", "path": at}],
            tenants.JSON_PATCH,
        ),
        ([{"op": "replace", "path": "/metadata/finalizers", "value": []}], tenants.JSON_PATCH),
        ({"metadata": {"finalizers": None}}, tenants.MERGE),
        ({"metadata": {"finalizers": []}}, tenants.MERGE),
    ]
    for body, kind in attempts:
        message = await tenants.refused(tenants.call(tenant, "PATCH", path, body=body, content_type=kind))
        assert strip_refusal(namespace, name) in message, (body, message)
    stored["metadata"]["finalizers"] = [
        f for f in stored["metadata"]["finalizers"] if f != constants.FINALIZER
    ]
    message = await tenants.refused(tenants.call(tenant, "PUT", path, body=stored))
    assert strip_refusal(namespace, name) in message


async def test_a_tenant_cannot_strip_the_finalizer_of_its_deleted_claim_while_its_pod_runs(
    setup: tenants.Setup,
) -> None:
    ns, run = setup.tenant_ns, uuid.uuid4().hex[:8]
    node = f"att-gpu-{run}"
    await wait_until_strips_are_refused(setup)
    await support.create_gpu_node(setup.admin, node, labels={support.RUN_LABEL: run})
    tenant_claims = resources.CustomResources(setup.tenant)
    path = f"{tenants.claims_path(ns)}/held"
    try:
        kubeconfig = await controller_kubeconfig(setup)
        argv = support.controller_argv(setup.system, "--in-use-poll", "1", run=run)
        async with support.running_controller(kubeconfig, argv):
            await tenant_claims.create_claim(ns, support.claim_body("held", 1, run=run))
            await support.wait_phase(setup.admin, ns, "held", "Allocated", within=60)
            annotations = {constants.ANNOTATION_CLAIM: "held"}
            await tenants.create(
                setup.tenant, ns, tenants.pod("worker", [tenants.container("main")], annotations=annotations)
            )
            await tenant_claims.delete_claim(ns, "held")

            kept = await support.wait_condition(setup.admin, ns, "held", "InUse", status="True", within=60)
            assert kept["metadata"]["deletionTimestamp"]

            await try_every_strip(setup.tenant, ns, "held")
            # The status subresource is no way around it: the tenant may not write it, and the
            # API server keeps a custom resource's metadata as it was on a status write.
            strip = {"metadata": {"finalizers": None}, "status": {"message": "stripped?"}}
            await tenants.refused(
                tenants.call(setup.tenant, "PATCH", f"{path}/status", body=strip, content_type=tenants.MERGE)
            )
            written = await tenants.call(
                setup.admin, "PATCH", f"{path}/status", body=strip, content_type=tenants.MERGE
            )
            assert constants.FINALIZER in written["metadata"]["finalizers"]

            still = await tenants.call(setup.tenant, "GET", path)
            assert constants.FINALIZER in still["metadata"]["finalizers"]
            assert still["status"]["phase"] == "Allocated"

            # The pod ends: the controller, as its ServiceAccount, removes the finalizer itself.
            await transport.request(
                setup.admin,
                "DELETE",
                f"/api/v1/namespaces/{ns}/pods/worker",
                body={"gracePeriodSeconds": 0},
            )

            async def gone() -> bool:
                return await support.get_claim(setup.admin, ns, "held") is None

            await support.wait_for(gone, within=60, what="the controller to release the claim and let it go")
    finally:
        with contextlib.suppress(errors.KubeError):
            await transport.request(
                setup.admin, "DELETE", f"/api/v1/namespaces/{ns}/pods/worker", body={"gracePeriodSeconds": 0}
            )
        await tenants.purge_claim(setup.admin, ns, "held")
        await support.delete_gpu_node(setup.admin, node)


async def test_a_preempted_claim_cannot_strip_its_finalizer_but_the_controllers_account_can(
    setup: tenants.Setup,
) -> None:
    """A Preempted claim whose pods are being evicted (held, say, by their own PodDisruptionBudget)
    keeps its finalizer, before and after the tenant deletes it; no controller runs here, so the
    phase stays as the admin wrote it, as the controller would."""
    ns = setup.tenant_ns
    await wait_until_strips_are_refused(setup)
    path = f"{tenants.claims_path(ns)}/victim"
    await tenants.call(
        setup.tenant, "POST", tenants.claims_path(ns), body=support.claim_body("victim", 1, run="none")
    )
    devices = [{"index": 0, "minor": 0, "uuid": "GPU-0a0a0a0a-1111-2222-3333-444444444444"}]
    status = {
        "phase": constants.PHASE_PREEMPTED,
        "allocations": [{"replica": 0, "nodeName": "gpu-node-9", "devices": devices}],
    }
    await tenants.call(
        setup.admin, "PATCH", f"{path}/status", body={"status": status}, content_type=tenants.MERGE
    )
    controller: Api | None = None
    try:
        await try_every_strip(setup.tenant, ns, "victim")
        await tenants.call(setup.tenant, "DELETE", path)
        await try_every_strip(setup.tenant, ns, "victim")
        still = await tenants.call(setup.tenant, "GET", path)
        assert still["metadata"]["deletionTimestamp"]
        assert still["status"]["phase"] == constants.PHASE_PREEMPTED

        # The controller's ServiceAccount may remove it (it does once the pods are gone and the
        # Leases released): without that exemption the policy would keep every claim for ever.
        kubeconfig = await controller_kubeconfig(setup)
        controller = await kube_client.connect(kubeconfig)
        await tenants.call(
            controller, "PATCH", path, body={"metadata": {"finalizers": None}}, content_type=tenants.MERGE
        )
        assert await support.get_claim(setup.admin, ns, "victim") is None
    finally:
        if controller is not None:
            await controller.close()
        await tenants.purge_claim(setup.admin, ns, "victim")


TEAM_TAINT = {"key": "team", "value": "reserved", "effect": "NoSchedule"}
TOLERATION = {"key": "team", "operator": "Equal", "value": "reserved", "effect": "NoSchedule"}


def allowing_quota(*allowed: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = {"gpus": 8, "allowedTolerations": list(allowed)}
    return {
        "apiVersion": constants.API_VERSION,
        "kind": "GpuQuota",
        "metadata": {"name": "pool"},
        "spec": spec,
    }


async def test_a_tenants_toleration_opens_a_tainted_node_only_once_its_quota_allows_it(
    setup: tenants.Setup,
) -> None:
    ns, run = setup.tenant_ns, uuid.uuid4().hex[:8]
    node = f"att-reserved-{run}"
    await support.create_gpu_node(setup.admin, node, labels={support.RUN_LABEL: run})
    await transport.request(
        setup.admin,
        "PATCH",
        f"/api/v1/nodes/{node}",
        body={"spec": {"taints": [TEAM_TAINT]}},
        content_type=transport.MERGE_PATCH,
    )
    body = support.claim_body("sneaky", 1, run=run)
    body["spec"]["tolerations"] = [TOLERATION]
    quotas = tenants.quotas_path(ns)
    try:
        # The tenant cannot grant itself the toleration: GpuQuotas are the cluster admin's.
        await tenants.refused(tenants.call(setup.tenant, "POST", quotas, body=allowing_quota(TOLERATION)))
        kubeconfig = await controller_kubeconfig(setup)
        async with support.running_controller(kubeconfig, support.controller_argv(setup.system, run=run)):
            await tenants.call(setup.tenant, "POST", tenants.claims_path(ns), body=body)
            reason = (
                f"toleration team=reserved:NoSchedule is not allowed in namespace {ns}"
                " (GpuQuota allowedTolerations)"
            )

            async def refused_named() -> dict[str, Any] | None:
                got = await support.get_claim(setup.admin, ns, "sneaky")
                return got if reason in ((got or {}).get("status") or {}).get("message", "") else None

            held_back = await support.wait_for(
                refused_named, within=60, what="the claim to name its toleration"
            )
            assert held_back["status"]["phase"] == "Pending"
            assert "tainted team=reserved:NoSchedule" in held_back["status"]["message"]

            # The operator allows the team's toleration in the namespace: the claim gets the node.
            await tenants.call(
                setup.admin, "POST", quotas, body=allowing_quota({"key": "team", "operator": "Exists"})
            )
            allocated = await support.wait_phase(setup.admin, ns, "sneaky", "Allocated", within=60)
            assert allocated["status"]["nodes"] == node
    finally:
        await tenants.purge_claim(setup.admin, ns, "sneaky")
        with contextlib.suppress(errors.KubeError):
            await tenants.call(setup.admin, "DELETE", f"{quotas}/pool")
        await support.delete_gpu_node(setup.admin, node)


def naming_resource_claim(name: str, entry: str, resource_claim: str, claim: str = "") -> dict[str, Any]:
    """A pod whose ``spec.resourceClaims`` entry ``entry`` names ``resource_claim``, given to its
    container; a pod of ``claim`` when one is given."""
    extra: dict[str, Any] = {"resourceClaims": [{"name": entry, "resourceClaimName": resource_claim}]}
    if claim:
        extra["annotations"] = {constants.ANNOTATION_CLAIM: claim}
    main = tenants.container("main", resources={"claims": [{"name": entry}]})
    return tenants.pod(name, [main], **extra)


async def test_a_tenants_pod_gets_a_claims_resourceclaim_only_through_gpualloc(setup: tenants.Setup) -> None:
    """With DRA on, a pod naming ``<claim>-gpus-<r>`` itself would get the claim's GPUs from the
    kubelet while the controller, counting the claim's pods by annotation, sees none: the claim
    could be released under it. The pod-resourceclaims policy refuses every such pod but what the
    webhook makes (the entry gpualloc-gpus, in a pod of that claim)."""
    pods = f"/api/v1/namespaces/{setup.tenant_ns}/pods"

    async def attempt(body: dict[str, Any]) -> str:
        """The refusal of the tenant's dry-run create of ``body`` ("" when accepted)."""
        return await tenants.refusal(
            tenants.call(setup.tenant, "POST", pods, body=body, query=[("dryRun", "All")])
        )

    bare = naming_resource_claim("bare", "mine", "train-gpus-0")
    message = await tenants.eventually(
        "the pod-resourceclaims ValidatingAdmissionPolicy", lambda: attempt(bare)
    )
    assert (
        "pod bare: ResourceClaims named <claim>-gpus-<replica> are the GPUs of a GpuClaim (train-gpus-0)"
        in (message)
    )
    # In a pod of the claim, under an entry of the tenant's choosing (the webhook checks only its own).
    assert "(train-gpus-0)" in await attempt(
        naming_resource_claim("aside", "mine", "train-gpus-0", claim="train")
    )
    # Under gpualloc's entry, in a pod of another claim.
    assert "(train-gpus-0)" in await attempt(
        naming_resource_claim("theft", constants.DRA_POD_CLAIM, "train-gpus-0", claim="other")
    )
    # What the webhook makes, and the tenant's own ResourceClaim, pass.
    assert (
        await attempt(naming_resource_claim("own", constants.DRA_POD_CLAIM, "train-gpus-0", claim="train"))
        == ""
    )
    assert await attempt(naming_resource_claim("free", "mine", "my-gpus")) == ""
