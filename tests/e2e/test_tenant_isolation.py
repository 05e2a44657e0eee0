"""Isolation and node identity, as the chart installs them, attacked with a tenant's own token.

One ``helm install`` for the module (``--no-hooks``: the certs hook Job makes the webhook's
certificate, which this module replaces, see below). The tenant is a ServiceAccount bound to
the ``edit`` ClusterRole in its namespaces, with a token from the TokenRequest API; every
attack below is its own call to the real kube-apiserver, which evaluates the chart's CEL
policies (the MutatingAdmissionPolicy and the ValidatingAdmissionPolicies) itself.

Claim pods go through the real webhook: it runs in this process on 127.0.0.1, in gate mode,
and the release's MutatingWebhookConfiguration is pointed at it (the local API server cannot
reach a Service's pods). So what the validating policies see is what the webhook wrote,
after every mutation, as in a cluster.

Node identity: two plain Nodes, a pod of the agent's ServiceAccount on each (never run), and
a TokenRequest token bound to each pod, which carries the pod's node
(``authentication.kubernetes.io/node-name``). The agent program itself runs with one of them.

Quotas: the tenant's ``edit`` gets GpuClaim rights through the chart's aggregated ClusterRoles
(kube-controller-manager aggregates them), may read GpuQuotas and write none, and the
quota-priority ValidatingAdmissionPolicy caps ``spec.priority`` at each GpuQuota's maxPriority.

The release, the tenant and the webhook are the e2e fixtures' (``tests/e2e/conftest.py``), built
with the helpers of ``tests/e2e/tenants.py``, which ``test_tenant_attacks`` and
``test_tenant_preemption`` share.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import re
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc.api import constants, leases
from gpualloc.devcluster import binaries
from gpualloc.kube import client as kube_client
from gpualloc.kube import errors, resources, transport
from gpualloc.kube.client import Api
from tests.e2e.tenants import (
    ADMISSION,
    CHART,
    CUDA,
    JSON_PATCH,
    MERGE,
    NODE_STATUSES,
    NOT_A_GPU_POD,
    NV,
    STRATEGIC,
    VOID,
    Program,
    Setup,
    call,
    claim_body,
    claims_path,
    container,
    create,
    device_entries,
    eventually,
    from_field,
    pod,
    purge_claim,
    quotas_path,
    refusal,
    refused,
    service_account_token,
    status_body,
    value,
)
from tests.integration import controller_support as support

UUIDS = "GPU-11111111-2222-3333-4444-555555555555,GPU-66666666-7777-8888-9999-000000000000"


# ----------------------------------------------------------------------------- helpers


async def add_ephemeral(api: Api, namespace: str, name: str, debug: dict[str, Any]) -> dict[str, Any]:
    """Add an ephemeral container the way ``kubectl debug`` does: the pods/ephemeralcontainers subresource."""
    stored: dict[str, Any] = await call(
        api,
        "PATCH",
        f"/api/v1/namespaces/{namespace}/pods/{name}/ephemeralcontainers",
        body={"spec": {"ephemeralContainers": [debug]}},
        content_type=STRATEGIC,
    )
    return stored


# ----------------------------------------------------------------------------- pods without a claim


async def test_pod_without_claim_setting_all_is_stored_with_void_in_every_container(setup: Setup) -> None:
    body = pod(
        "sets-all",
        [
            container("main", value(NV, "all"), value("OTHER", "kept")),
            container("side", from_field(NV), value(NV, "0,1")),  # valueFrom, and a later duplicate
            container("plain"),
        ],
        init=[container("prep", value(NV, "all"))],
    )
    stored = await create(setup.tenant, setup.tenant_ns, body)
    spec = stored["spec"]
    for c in [*spec["initContainers"], *spec["containers"]]:
        entries = device_entries(c)
        assert entries and all(e == VOID for e in entries), (c["name"], c.get("env"))
    assert {"name": "OTHER", "value": "kept"} in spec["containers"][0]["env"]
    read = await call(setup.tenant, "GET", f"/api/v1/namespaces/{setup.tenant_ns}/pods/sets-all")
    assert read["spec"] == spec


async def test_pod_with_no_env_at_all_gets_void_over_the_image_default(setup: Setup) -> None:
    body = pod("image-default", [container("main"), container("other")], init=[container("prep")])
    stored = await create(setup.tenant, setup.tenant_ns, body)
    for c in [*stored["spec"]["initContainers"], *stored["spec"]["containers"]]:
        assert c["env"] == [VOID], c["name"]


async def test_claim_annotation_where_the_webhook_is_not_called_does_not_escape_void(setup: Setup) -> None:
    # webhook.excludeNamespaces: nothing there writes a claim's devices, so the annotation counts for nothing.
    body = pod(
        "claims-unhooked",
        [container("main", value(NV, "all"))],
        annotations={constants.ANNOTATION_CLAIM: "any", constants.ANNOTATION_DEVICES: "GPU-x"},
    )
    stored = await create(setup.tenant, setup.unhooked_ns, body)
    assert device_entries(stored["spec"]["containers"][0]) == [VOID]


async def test_pod_setting_cuda_visible_devices_by_value_from_is_refused_with_the_reason(
    setup: Setup,
) -> None:
    body = pod("cuda-from", [container("main", from_field(CUDA))])
    message = await refused(create(setup.tenant, setup.tenant_ns, body))
    assert NOT_A_GPU_POD in message
    assert "main: CUDA_VISIBLE_DEVICES from valueFrom" in message
    assert "create a\nGpuClaim" in message or "create a GpuClaim" in message

    literal = pod("cuda-literal", [container("main", value(CUDA, "0,1"))], init=[container("prep")])
    message = await refused(create(setup.tenant, setup.tenant_ns, literal))
    assert 'main: CUDA_VISIBLE_DEVICES="0,1"' in message
    # Hiding every GPU from CUDA is what a CPU-only program does: allowed.
    hidden = await create(
        setup.tenant, setup.tenant_ns, pod("cuda-hidden", [container("main", value(CUDA, "-1"))])
    )
    assert value(CUDA, "-1") in hidden["spec"]["containers"][0]["env"]


async def test_mount_at_the_runtimes_device_list_path_is_refused(setup: Setup) -> None:
    body = pod(
        "device-list-mount",
        [
            container(
                "main", volumeMounts=[{"name": "v", "mountPath": "/var/run/nvidia-container-devices/all"}]
            )
        ],
        volumes=[{"name": "v", "emptyDir": {}}],
    )
    message = await refused(create(setup.tenant, setup.tenant_ns, body))
    assert "main: /var/run/nvidia-container-devices/all" in message


# ----------------------------------------------------------------------------- ephemeral containers


async def test_ephemeral_container_added_through_the_subresource_gets_void(setup: Setup) -> None:
    ns = setup.tenant_ns
    await create(setup.tenant, ns, pod("debugged", [container("main")]))
    stored = await add_ephemeral(setup.tenant, ns, "debugged", container("debug", value(NV, "all")))
    (debug,) = stored["spec"]["ephemeralContainers"]
    assert device_entries(debug) == [VOID]
    stored = await add_ephemeral(setup.tenant, ns, "debugged", container("debug-2"))
    assert {c["name"]: c["env"] for c in stored["spec"]["ephemeralContainers"]} == {
        "debug": [VOID],
        "debug-2": [VOID],
    }
    message = await refused(
        add_ephemeral(setup.tenant, ns, "debugged", container("debug-3", from_field(CUDA)))
    )
    assert (
        "ephemeral containers get no GPU" in message
        and "debug-3: CUDA_VISIBLE_DEVICES from valueFrom" in message
    )


# ----------------------------------------------------------------------------- claim pods


async def _allocated_claim(s: Setup, name: str) -> None:
    crs = resources.CustomResources(s.admin)
    body = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name},
        "spec": {"devices": {"count": 2}},
    }
    await crs.create_claim(s.tenant_ns, body)
    devices = [{"index": i, "minor": i, "uuid": u} for i, u in enumerate(UUIDS.split(","))]
    allocation = {"replica": 0, "nodeName": "gpu-node-7", "devices": devices}
    await crs.patch_claim_status(
        s.tenant_ns, name, {"status": {"phase": constants.PHASE_ALLOCATED, "allocations": [allocation]}}
    )


async def test_claim_pods_keep_what_the_webhook_writes_and_their_debug_containers_get_void(
    setup: Setup,
) -> None:
    ns = setup.tenant_ns
    await _allocated_claim(setup, "two-gpus")
    body = pod(
        "trainer",
        [container("main", value(NV, "all")), container("side", from_field(CUDA))],
        init=[container("prep")],
        annotations={constants.ANNOTATION_CLAIM: "two-gpus"},
    )

    async def allocated_seen() -> bool:
        pods = f"/api/v1/namespaces/{ns}/pods"
        probe = await call(setup.tenant, "POST", pods, body=body, query=[("dryRun", "All")])
        return constants.ANNOTATION_DEVICES in probe["metadata"].get("annotations", {})

    # In gate mode a pod is admitted gated while the webhook's cache still has the claim Pending.
    await eventually("the webhook to see the claim Allocated", allocated_seen)
    stored = await create(setup.tenant, ns, body)
    assert stored["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == UUIDS
    for c in [*stored["spec"]["initContainers"], *stored["spec"]["containers"]]:
        assert device_entries(c) == [value(NV, UUIDS)], c["name"]
        assert device_entries(c, CUDA) == [value(CUDA, UUIDS)], c["name"]
    # It waits at the gate until the controller has checked the claim; the tenant cannot lift it.
    assert {"name": constants.SCHEDULING_GATE} in stored["spec"]["schedulingGates"]
    for patch, kind in (
        ([{"op": "remove", "path": "/spec/schedulingGates"}], JSON_PATCH),
        ({"spec": {"schedulingGates": None}}, MERGE),
    ):
        message = await refused(
            call(
                setup.tenant, "PATCH", f"/api/v1/namespaces/{ns}/pods/trainer", body=patch, content_type=kind
            )
        )
        assert "lifted only by gpualloc's controller" in message

    # kubectl debug on a claim pod: the debug container gets no GPU, the others keep theirs.
    debugged = await add_ephemeral(setup.tenant, ns, "trainer", container("debug", value(NV, UUIDS)))
    (debug,) = debugged["spec"]["ephemeralContainers"]
    assert device_entries(debug) == [VOID]
    assert device_entries(debugged["spec"]["containers"][0]) == [value(NV, UUIDS)]

    # Gate mode, claim not Allocated: the env comes from the devices annotation (fieldRef).
    gated = await create(
        setup.tenant,
        ns,
        pod(
            "waiting",
            [container("main", value(NV, "all"))],
            annotations={constants.ANNOTATION_CLAIM: "later"},
        ),
    )
    assert constants.SCHEDULING_GATE in {g["name"] for g in gated["spec"]["schedulingGates"]}
    assert gated["metadata"]["labels"][constants.LABEL_GATED] == "true"
    field_path = f"metadata.annotations['{constants.ANNOTATION_DEVICES}']"
    (entry,) = device_entries(gated["spec"]["containers"][0])
    assert entry["valueFrom"]["fieldRef"]["fieldPath"] == field_path


async def test_gated_label_is_refused_on_pods_the_webhook_did_not_gate(setup: Setup) -> None:
    ns = setup.tenant_ns
    body = pod("fake-gated", [container("main")], labels={constants.LABEL_GATED: "true"})
    assert "its webhook sets it" in await refused(create(setup.tenant, ns, body))
    # A gate of one's own is not the webhook's doing either: no claim annotation.
    body["spec"]["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]
    assert "its webhook sets it" in await refused(create(setup.tenant, ns, body))

    await create(setup.tenant, ns, pod("labelled-later", [container("main")]))
    label = {"metadata": {"labels": {constants.LABEL_GATED: "true"}}}
    message = await refused(
        call(
            setup.tenant,
            "PATCH",
            f"/api/v1/namespaces/{ns}/pods/labelled-later",
            body=label,
            content_type=STRATEGIC,
        )
    )
    assert "can only be removed" in message


# ----------------------------------------------------------------------------- exempt pods


async def test_exempt_pods_are_left_alone(setup: Setup) -> None:
    plugin = pod("plugin-gpu", [container("main", resources={"limits": {"nvidia.com/gpu": "1"}})])
    stored = await create(setup.tenant, setup.tenant_ns, plugin)
    assert "env" not in stored["spec"]["containers"][0]
    mig = pod("plugin-mig", [container("main", resources={"limits": {"nvidia.com/mig-1g.10gb": "2"}})])
    assert "env" not in (await create(setup.tenant, setup.tenant_ns, mig))["spec"]["containers"][0]

    # A request of zero GPUs gets nothing from the device plugin, so it exempts nothing.
    zero = pod("plugin-zero", [container("main", resources={"limits": {"nvidia.com/gpu": "0"}})])
    assert (await create(setup.tenant, setup.tenant_ns, zero))["spec"]["containers"][0]["env"] == [VOID]

    listed = pod("operator-tool", [container("main", value(NV, "all"))])
    stored = await create(setup.tenant, setup.exempt_ns, listed)
    assert stored["spec"]["containers"][0]["env"] == [value(NV, "all")]


async def test_device_plugin_pod_may_not_override_the_plugins_choice(setup: Setup) -> None:
    body = pod(
        "plugin-override",
        [container("main", value(NV, "all"), resources={"limits": {"nvidia.com/gpu": "1"}})],
    )
    message = await refused(create(setup.tenant, setup.tenant_ns, body))
    assert "requests GPUs from a device plugin" in message and 'main: NVIDIA_VISIBLE_DEVICES="all"' in message


# ----------------------------------------------------------------------------- node identity


def heartbeat_lease(node: str, namespace: str) -> dict[str, Any]:
    return leases.heartbeat_lease(namespace, node=node, now=datetime.datetime.now(datetime.UTC))


async def test_agent_token_writes_only_its_own_nodes_status_and_heartbeat_lease(setup: Setup) -> None:
    agent_account = f"{setup.fullname}-agent"
    clients: list[Api] = []
    try:
        agents: dict[str, Api] = {}
        kubeconfigs: dict[str, Path] = {}
        for node in setup.nodes:
            body = pod(f"agent-{node}", [container("agent")], serviceAccountName=agent_account, nodeName=node)
            agent_pod = await create(setup.admin, setup.system, body)
            token = await service_account_token(setup.admin, setup.system, agent_account, agent_pod)
            kubeconfigs[node] = setup.token_kubeconfig(token, f"{node}.kubeconfig")
            agents[node] = await kube_client.connect(str(kubeconfigs[node]))
            clients.append(agents[node])
        mine, other = setup.nodes

        # Its own node: create, then the status subresource.
        await call(agents[mine], "POST", NODE_STATUSES, body=status_body(mine))
        patched = await call(
            agents[mine],
            "PATCH",
            f"{NODE_STATUSES}/{mine}/status",
            body={"status": {"source": "simulated", "total": 0, "healthy": 0}},
            content_type="application/merge-patch+json",
        )
        assert patched["status"]["source"] == "simulated"

        # Another node's: 403 with the policy's message, on create and on the status subresource.
        message = await refused(call(agents[mine], "POST", NODE_STATUSES, body=status_body(other)))
        assert f"only the GpuNodeStatus of the node its pod runs on ({mine}), not {other}" in message
        # An admin's write is not an agent's: not matched by the policy.
        await call(setup.admin, "POST", NODE_STATUSES, body=status_body(other))
        forged = {"status": {"source": "simulated", "total": 8, "healthy": 8}}
        for path in (f"{NODE_STATUSES}/{other}/status", f"{NODE_STATUSES}/{other}"):
            message = await refused(
                call(agents[mine], "PATCH", path, body=forged, content_type="application/merge-patch+json")
            )
            assert f"runs on ({mine}), not {other}" in message
        await call(
            agents[other],
            "PATCH",
            f"{NODE_STATUSES}/{other}/status",
            body={"status": {"source": "simulated", "total": 0, "healthy": 0}},
            content_type="application/merge-patch+json",
        )

        # A token of the agent's ServiceAccount not bound to a pod carries no node: refused.
        unbound = await service_account_token(setup.admin, setup.system, agent_account)
        loose = await kube_client.connect(str(setup.token_kubeconfig(unbound, "unbound.kubeconfig")))
        clients.append(loose)
        message = await refused(
            call(
                loose,
                "PATCH",
                f"{NODE_STATUSES}/{mine}/status",
                body=forged,
                content_type="application/merge-patch+json",
            )
        )
        assert "carries no node name" in message

        # Heartbeat Leases: its own node's, in the heartbeat namespace; not another node's; and no
        # Lease at all where the device Leases (the locks) are.
        beats = f"/apis/coordination.k8s.io/v1/namespaces/{setup.system}-heartbeats/leases"
        await call(agents[mine], "POST", beats, body=heartbeat_lease(mine, f"{setup.system}-heartbeats"))
        renewal = leases.renewal(datetime.datetime.now(datetime.UTC))
        await call(agents[mine], "PATCH", f"{beats}/{mine}", body=renewal, content_type=transport.MERGE_PATCH)
        message = await refused(
            call(agents[mine], "POST", beats, body=heartbeat_lease(other, f"{setup.system}-heartbeats"))
        )
        assert f"only the heartbeat Lease of the node its pod runs on ({mine}), not {other}" in message
        await call(agents[other], "POST", beats, body=heartbeat_lease(other, f"{setup.system}-heartbeats"))
        message = await refused(
            call(agents[mine], "PATCH", f"{beats}/{other}", body=renewal, content_type=transport.MERGE_PATCH)
        )
        assert f"({mine}), not {other}" in message
        locks = f"/apis/coordination.k8s.io/v1/namespaces/{setup.system}/leases"
        message = await refused(call(agents[mine], "POST", locks, body=heartbeat_lease(mine, setup.system)))
        assert "cannot create resource" in message, message  # RBAC: not in the device Lease namespace
        await call(setup.admin, "DELETE", f"{beats}/{mine}")

        # The CRD: a GpuNodeStatus is named after its node, whoever writes it.
        with pytest.raises(errors.KubeError) as invalid:
            await call(setup.admin, "POST", NODE_STATUSES, body=status_body(other, name="elsewhere"))
        assert invalid.value.status == 422
        assert "metadata.name must equal spec.nodeName" in invalid.value.message

        # The agent program, unchanged, with the token of its pod: publishes its node.
        await call(setup.admin, "DELETE", f"{NODE_STATUSES}/{mine}")
        agent = Program(
            "agent",
            [
                "agent", f"--kubeconfig={kubeconfigs[mine]}", f"--node-name={mine}", "--source=simulated",
                "--profile=h100-sxm-8", f"--lease-namespace={setup.system}", "--heartbeat-interval=5",
                "--health-port=0", "--metrics-port=0", "--log-format=text",
            ],
            setup.kubeconfigs,
        )  # fmt: skip
        try:

            async def published() -> bool:
                assert agent.process.poll() is None, agent.log.read_text()[-3000:]
                got = await call(setup.admin, "GET", f"{NODE_STATUSES}/{mine}")
                return bool((got.get("status") or {}).get("total") == 8)

            await eventually("the agent to publish its node's 8 GPUs", published, within=60)
            renewals: set[str] = set()

            async def renewed_twice() -> bool:  # created at its first heartbeat, then renewed: every 5 s
                with contextlib.suppress(errors.NotFound):
                    got = await call(setup.admin, "GET", f"{beats}/{mine}")
                    renewals.add(got["spec"]["renewTime"])
                return len(renewals) >= 2

            await eventually("the agent to create and renew its heartbeat Lease", renewed_twice, within=30)
        finally:
            assert agent.stop() == 0, agent.log.read_text()[-3000:]
        # A whole-word 403 only: log lines carry timestamps and uids in which 403 turns up by chance.
        log = agent.log.read_text()
        assert not re.search(r"\b403\b", log) and "Forbidden" not in log, log[-3000:]
    finally:
        for api in clients:
            await api.close()


# ----------------------------------------------------------------------------- quotas


def quota_body(name: str, gpus: int = 8, max_priority: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"gpus": gpus}
    if max_priority is not None:
        spec["maxPriority"] = max_priority
    return {"apiVersion": constants.API_VERSION, "kind": "GpuQuota", "metadata": {"name": name}, "spec": spec}


async def test_tenant_may_read_quotas_but_not_write_them_or_their_status(setup: Setup) -> None:
    quotas = quotas_path(setup.tenant_ns)
    await call(setup.admin, "POST", quotas, body=quota_body("read-only", gpus=4))
    try:
        listed = await call(setup.tenant, "GET", quotas)
        assert "read-only" in {q["metadata"]["name"] for q in listed["items"]}
        assert (await call(setup.tenant, "GET", f"{quotas}/read-only"))["spec"]["gpus"] == 4
        # `gpualloc get quota` with the tenant's token.
        kubeconfig = setup.kubeconfigs / "tenant.kubeconfig"
        process = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "gpualloc.cli", "get", "quota", "-n", setup.tenant_ns],
            *[f"--kubeconfig={kubeconfig}"],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        printed, _ = await asyncio.wait_for(process.communicate(), timeout=60)
        assert process.returncode == 0, printed.decode()
        header, row = printed.decode().splitlines()
        assert header.split() == ["NAME", "USED", "HARD", "MAX-PRIORITY"]
        assert row.split() == ["read-only", "0", "4", "-"]

        patch = {"spec": {"gpus": 1000}}
        status = {"status": {"used": 0, "claims": {}}}
        writes: dict[str, Callable[[], Awaitable[Any]]] = {
            'create resource "gpuquotas"': lambda: call(
                setup.tenant, "POST", quotas, body=quota_body("mine", gpus=1000)
            ),
            'patch resource "gpuquotas"': lambda: call(
                setup.tenant, "PATCH", f"{quotas}/read-only", body=patch, content_type=MERGE
            ),
            'patch resource "gpuquotas/status"': lambda: call(
                setup.tenant, "PATCH", f"{quotas}/read-only/status", body=status, content_type=MERGE
            ),
            'delete resource "gpuquotas"': lambda: call(setup.tenant, "DELETE", f"{quotas}/read-only"),
            'deletecollection resource "gpuquotas"': lambda: call(setup.tenant, "DELETE", quotas),
        }
        for what, attempt in writes.items():
            message = await refused(attempt())
            # RBAC's refusal ("... cannot create resource ..."), not a policy's.
            assert f"cannot {what}" in message, message
        stored = await call(setup.admin, "GET", f"{quotas}/read-only")
        assert stored["spec"] == {"gpus": 4}
        assert "status" not in stored
    finally:
        await call(setup.admin, "DELETE", f"{quotas}/read-only")


async def test_edit_lets_the_tenant_create_change_and_delete_claims_but_not_their_status(
    setup: Setup,
) -> None:
    claims = claims_path(setup.tenant_ns)
    created = await call(setup.tenant, "POST", claims, body=claim_body("by-tenant"))
    assert created["spec"]["priority"] == 0  # the CRD's default
    listed = await call(setup.tenant, "GET", claims)
    assert "by-tenant" in {c["metadata"]["name"] for c in listed["items"]}
    labelled = await call(
        setup.tenant,
        "PATCH",
        f"{claims}/by-tenant",
        body={"metadata": {"labels": {"team": "a"}}},
        content_type=MERGE,
    )
    assert labelled["metadata"]["labels"] == {"team": "a"}
    # The status is the controller's: a tenant cannot mark its own claim Allocated.
    forged = {"status": {"phase": constants.PHASE_ALLOCATED}}
    message = await refused(
        call(setup.tenant, "PATCH", f"{claims}/by-tenant/status", body=forged, content_type=MERGE)
    )
    assert 'cannot patch resource "gpuclaims/status"' in message
    # Only in its own namespaces.
    message = await refused(
        call(setup.tenant, "POST", claims_path(setup.system), body=claim_body("elsewhere"))
    )
    assert 'cannot create resource "gpuclaims"' in message
    await call(setup.tenant, "DELETE", f"{claims}/by-tenant")
    swept = claim_body("swept")
    swept["metadata"]["labels"] = {"sweep": "yes"}
    await call(setup.tenant, "POST", claims, body=swept)
    await call(setup.tenant, "DELETE", claims, query=[("labelSelector", "sweep=yes")])  # deletecollection
    # Deleted: each waits, Terminating, for the controller (not running here) to release it and
    # remove the finalizer the chart's claim-finalizer policy added.
    remaining = await call(setup.tenant, "GET", claims)
    terminating = {
        c["metadata"]["name"] for c in remaining["items"] if c["metadata"].get("deletionTimestamp")
    }
    assert {"by-tenant", "swept"} <= terminating
    for name in ("by-tenant", "swept"):
        await purge_claim(setup.admin, setup.tenant_ns, name)


async def test_claim_priority_above_a_namespace_quotas_maximum_is_refused_with_the_reason(
    setup: Setup,
) -> None:
    ns = setup.tenant_ns
    quotas, claims = quotas_path(ns), claims_path(ns)
    dry = [("dryRun", "All")]
    tenant = setup.tenant
    await call(setup.admin, "POST", quotas, body=quota_body("capped", max_priority=100))
    await call(setup.admin, "POST", quotas, body=quota_body("uncapped", gpus=16))  # no maxPriority
    made: list[str] = []
    try:

        async def capped() -> str:
            return await refusal(call(tenant, "POST", claims, body=claim_body("probe", 500), query=dry))

        # The API server sees a new param a moment after it is created: poll with dry runs.
        message = await eventually("the quota-priority policy to see the GpuQuota", capped)
        reason = f"spec.priority 500 is above 100, the maximum of namespace {ns} (quota {ns}/capped)"
        assert reason in message, message
        assert reason in await refused(call(tenant, "POST", claims, body=claim_body("greedy", 500)))

        # At the maximum, and without a priority (the default, 0): accepted.
        at_cap = await call(tenant, "POST", claims, body=claim_body("at-cap", 100))
        made.append("at-cap")
        assert at_cap["spec"]["priority"] == 100
        plain = await call(tenant, "POST", claims, body=claim_body("plain"))
        made.append("plain")
        assert plain["spec"]["priority"] == 0

        # Raising it afterwards is refused too; an update that keeps it is not checked.
        raise_ = {"spec": {"priority": 101}}
        message = await refused(call(tenant, "PATCH", f"{claims}/at-cap", body=raise_, content_type=MERGE))
        assert f"spec.priority 101 is above 100, the maximum of namespace {ns} (quota {ns}/capped)" in message
        relabelled = {"metadata": {"labels": {"team": "a"}}}
        await call(tenant, "PATCH", f"{claims}/at-cap", body=relabelled, content_type=MERGE)

        # Every quota of the namespace applies: a tighter one refuses what the first allowed.
        await call(setup.admin, "POST", quotas, body=quota_body("tighter", max_priority=50))

        async def tightened() -> str:
            return await refusal(call(tenant, "POST", claims, body=claim_body("probe", 100), query=dry))

        message = await eventually("the policy to see the second GpuQuota", tightened)
        assert f"spec.priority 100 is above 50, the maximum of namespace {ns} (quota {ns}/tighter)" in message
        assert f"quota {ns}/capped" not in message

        # Another namespace, without a GpuQuota: no cap (parameterNotFoundAction: Allow).
        elsewhere = claims_path(setup.unhooked_ns)
        await call(tenant, "POST", elsewhere, body=claim_body("high", 1_000_000), query=dry)

        # The quota gone, the cap is gone.
        await call(setup.admin, "DELETE", f"{quotas}/capped")
        await call(setup.admin, "DELETE", f"{quotas}/tighter")

        async def uncapped() -> bool:
            await call(tenant, "POST", claims, body=claim_body("probe", 500), query=dry)
            return True

        await eventually("the policy to forget the deleted GpuQuotas", uncapped)
    finally:
        for name in ("capped", "tighter", "uncapped"):
            try:
                await call(setup.admin, "DELETE", f"{quotas}/{name}")
            except errors.KubeError as exc:
                assert exc.status == 404, exc
        for name in made:
            await purge_claim(setup.admin, ns, name)


def claim_with(name: str, *, finalizers: int = 0, owners: int = 0) -> dict[str, Any]:
    """A claim carrying that many finalizers and owner references."""
    body = claim_body(name)
    body["metadata"]["finalizers"] = [f"example.com/hold-{i}" for i in range(finalizers)]
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": f"owner-{i}",
            "uid": f"00000000-0000-0000-0000-{i:012d}",
        }
        for i in range(owners)
    ]
    return body


async def test_claim_with_more_than_16_finalizers_or_owner_references_is_refused_with_the_reason(
    setup: Setup,
) -> None:
    # The controller and the webhook cache every claim, finalizers and owner references included.
    ns, tenant = setup.tenant_ns, setup.tenant
    claims, dry = claims_path(ns), [("dryRun", "All")]
    message = await refused(call(tenant, "POST", claims, body=claim_with("fat", finalizers=17), query=dry))
    assert "at most 16 finalizers besides gpu.scheduling/release-devices, this one has 17" in message, message
    message = await refused(call(tenant, "POST", claims, body=claim_with("fat", owners=17), query=dry))
    assert "a GpuClaim may have at most 16 owner references, this one has 17" in message, message
    await call(tenant, "POST", claims, body=claim_with("owned", owners=16), query=dry)
    long_name = claim_with("long", owners=1)
    long_name["metadata"]["ownerReferences"][0]["name"] = "n" * 254
    message = await refused(call(tenant, "POST", claims, body=long_name, query=dry))
    assert "an owner reference of a GpuClaim may have at most 253 characters" in message, message
    # Owner references that name no object would let the garbage collector delete it: dry run above.
    await call(tenant, "POST", claims, body=claim_with("full", finalizers=16))
    try:
        path = f"{claims}/full"
        grow = {
            "metadata": {"finalizers": [*(f"example.com/hold-{i}" for i in range(17)), constants.FINALIZER]}
        }
        message = await refused(call(tenant, "PATCH", path, body=grow, content_type=MERGE))
        assert "at most 16 finalizers besides gpu.scheduling/release-devices, this one has 17" in message
        # gpualloc's own finalizer (the chart's policy adds it at create) does not count.
        assert constants.FINALIZER in (await call(tenant, "GET", path))["metadata"]["finalizers"]
        owners = {"metadata": {"ownerReferences": claim_with("x", owners=17)["metadata"]["ownerReferences"]}}
        message = await refused(call(tenant, "PATCH", path, body=owners, content_type=MERGE, query=dry))
        assert "at most 16 owner references, this one has 17" in message, message
        # (keeping gpualloc's own, which only the controller may remove)
        shrink = {
            "metadata": {"finalizers": [*(f"example.com/hold-{i}" for i in range(15)), constants.FINALIZER]}
        }
        kept = await call(tenant, "PATCH", path, body=shrink, content_type=MERGE)
        assert len(kept["metadata"]["finalizers"]) == 16
    finally:
        await purge_claim(setup.admin, ns, "full")


async def test_a_tenants_claims_past_its_quota_wait_with_the_quota_message(setup: Setup) -> None:
    """The tenant, with its own token, claims more GPUs than its namespace's GpuQuota allows: the
    controller allocates what fits and keeps the rest Pending with the quota's message."""
    ns, run = setup.tenant_ns, uuid.uuid4().hex[:8]
    node = f"iso-gpu-{run}"
    await support.create_gpu_node(setup.admin, node, labels={support.RUN_LABEL: run})
    quotas, tenant_claims = quotas_path(ns), resources.CustomResources(setup.tenant)
    await call(setup.admin, "POST", quotas, body=quota_body("gpus", gpus=4))
    argv = support.controller_argv(setup.system, run=run)
    try:
        async with support.running_controller(str(setup.control_plane.kubeconfig), argv):
            await tenant_claims.create_claim(ns, support.claim_body("first", 3, run=run))
            await support.wait_phase(setup.admin, ns, "first", "Allocated", within=60)
            await tenant_claims.create_claim(ns, support.claim_body("second", 2, run=run))

            second = await support.wait_condition(
                setup.admin, ns, "second", constants.CONDITION_ALLOCATED, reason="QuotaExceeded", within=60
            )
            assert second["status"]["phase"] == "Pending"
            assert second["status"]["message"] == f"namespace {ns} would use 5 of 4 GPUs (quota {ns}/gpus)"
            # The tenant reads the ledger but cannot touch it.
            ledger = await call(setup.tenant, "GET", f"{quotas}/gpus")
            assert ledger["status"]["used"] == 3
            with pytest.raises(errors.KubeError) as denied:
                await call(
                    setup.tenant,
                    "PATCH",
                    f"{quotas}/gpus/status",
                    body={"status": {"claims": None}},
                    content_type=MERGE,
                )
            assert denied.value.status == 403
    finally:
        for name in ("first", "second"):
            await purge_claim(setup.admin, ns, name)
        await call(setup.admin, "DELETE", f"{quotas}/gpus")
        await support.delete_gpu_node(setup.admin, node)


async def eventually_value(
    what: str, probe: Callable[[], Awaitable[dict[str, Any] | None]]
) -> dict[str, Any]:
    return await support.wait_for(probe, within=60, what=what)


# ----------------------------------------------------------------------------- every variant compiles

POLICY_KINDS = {
    "MutatingAdmissionPolicy": f"{ADMISSION}/mutatingadmissionpolicies",
    "MutatingAdmissionPolicyBinding": f"{ADMISSION}/mutatingadmissionpolicybindings",
    "ValidatingAdmissionPolicy": f"{ADMISSION}/validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": f"{ADMISSION}/validatingadmissionpolicybindings",
}


@pytest.mark.parametrize(
    "values",
    [
        ["webhook.deviceIds=index", "agent.nodeLabels.enabled=true"],
        [
            "webhook.enabled=false",
            "isolation.exemptResourceClaims=false",
            "isolation.exemptResources={a.com/b}",
        ],
    ],
    ids=["index-mode-node-labels", "no-webhook-no-exemptions"],
)
async def test_policy_variants_compile_in_the_api_server(setup: Setup, values: list[str]) -> None:
    """The API server compiles (type-checks) CEL when a policy is created: a dry run with strict
    field validation of each variant the values can render, next to the one installed above."""
    helm = str(binaries.ensure(["helm"], progress=lambda _: None)["helm"])
    args = [helm, "template", "variant", str(CHART), "--namespace", setup.system, "--kube-version", "1.36.0"]
    args += ["--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"]
    args += [arg for v in values for arg in ("--set", v)]
    process = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    rendered, _ = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0
    policies = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] in POLICY_KINDS]
    assert {o["kind"] for o in policies} == set(POLICY_KINDS)
    for obj in policies:
        query = [("dryRun", "All"), ("fieldValidation", "Strict")]
        await call(setup.admin, "POST", POLICY_KINDS[obj["kind"]], body=obj, query=query)


async def test_claims_are_stored_with_the_release_finalizer_by_the_chart_policy(setup: Setup) -> None:
    """The claim-finalizer MutatingAdmissionPolicy: what the create returns is what admission
    stored, before any controller could have patched it."""
    claims = claims_path(setup.tenant_ns)
    plain = await call(setup.tenant, "POST", claims, body=claim_body("finalized"))
    assert plain["metadata"]["finalizers"] == [constants.FINALIZER]
    own = claim_body("own-finalizer")
    own["metadata"]["finalizers"] = ["example.com/keep"]
    kept = await call(setup.tenant, "POST", claims, body=own)
    assert kept["metadata"]["finalizers"] == ["example.com/keep", constants.FINALIZER]
    already = claim_body("already")
    already["metadata"]["finalizers"] = [constants.FINALIZER]
    once = await call(setup.tenant, "POST", claims, body=already)
    assert once["metadata"]["finalizers"] == [constants.FINALIZER]
    for name in ("finalized", "own-finalizer", "already"):
        await purge_claim(setup.admin, setup.tenant_ns, name)
