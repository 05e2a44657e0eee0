"""The chart's RBAC, proven against the real API server with each component's own token.

The ServiceAccounts, Roles, ClusterRoles and bindings come from ``helm template``
(certs hook RBAC included) and are created in a fresh namespace. A TokenRequest
gives each ServiceAccount a token; a kubeconfig made from that token is what the
calls below use. Each component's permitted calls succeed, and a call outside its
role is refused with 403 by the RBAC authorizer.

The chart's pod-annotation ValidatingAdmissionPolicy is tested here too: it is the
other half of who may write what, a tenant allowed to edit pods may not touch
gpualloc's annotations on them, and the controller's token may.
"""

from __future__ import annotations

import asyncio
import base64
import re
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.client.exceptions import ApiException

from gpualloc.devcluster import binaries, cluster
from tests.conftest import delete_if_present, generated_client
from tests.e2e import tenants
from tests.integration.tls_support import http_status

CHART = Path(__file__).resolve().parents[2] / "helm" / "gpualloc"
GROUP, VERSION = "gpu.scheduling", "v1"
MERGE = "application/merge-patch+json"
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
COLLECTIONS = {
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
}


@dataclass
class Installed:
    """The chart's RBAC objects, created for one release in one namespace."""

    release: str
    namespace: str
    fullname: str
    kubeconfigs: dict[str, Path] = field(default_factory=dict)  # component -> token kubeconfig

    def name(self, component: str) -> str:
        return f"{self.fullname}-{component}"


def _render(release: str, namespace: str, *extra: str) -> list[dict[str, Any]]:
    helm = binaries.ensure(["helm"], progress=lambda _: None)["helm"]
    result = subprocess.run(
        [
            str(helm),
            "template",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--kube-version",
            "1.36.0",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture
async def api(kubeconfig: str) -> AsyncIterator[k8s.ApiClient]:
    """The admin's generated client: the RBAC is checked as kubectl would meet it."""
    async with await generated_client(kubeconfig) as api_client:
        yield api_client


@pytest.fixture
async def installed(
    control_plane: Any, namespace: str, api: k8s.ApiClient, tmp_path: Path
) -> AsyncIterator[Installed]:
    release = f"rb{uuid.uuid4().hex[:6]}"
    inst = Installed(release=release, namespace=namespace, fullname=f"{release}-gpualloc")
    objs = _render(
        release, namespace, "--set", "certManager.enabled=false", "--set", "webhook.pendingMode=gate"
    )
    created: list[str] = []
    try:
        for obj in objs:
            if obj["kind"] == "Namespace":  # the heartbeat namespace, where the agents' Role is
                control_plane.request("POST", "/api/v1/namespaces", obj)
                created.append(f"/api/v1/namespaces/{obj['metadata']['name']}")
        for obj in objs:
            if obj["kind"] not in RBAC_KINDS:
                continue
            obj["metadata"].pop("annotations", None)  # the certs RBAC are hooks; here plain objects
            path = COLLECTIONS[obj["kind"]].format(ns=obj["metadata"].get("namespace", namespace))
            control_plane.request("POST", path, obj)
            if obj["kind"].startswith("Cluster"):
                created.append(f"{path}/{obj['metadata']['name']}")
        core = k8s.CoreV1Api(api)
        for component in ("agent", "controller", "webhook", "certs"):
            # audiences [] = the API server's own audience
            request = k8s.AuthenticationV1TokenRequest(
                spec=k8s.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
            )
            review = await core.create_namespaced_service_account_token(
                inst.name(component), namespace, request
            )
            inst.kubeconfigs[component] = tenants.token_kubeconfig(
                control_plane, review.status.token, tmp_path / f"{component}.kubeconfig"
            )
        yield inst
    finally:
        for path in created:
            delete_if_present(control_plane, path)


@pytest.fixture
async def as_component(installed: Installed) -> AsyncIterator[Callable[[str], Awaitable[k8s.ApiClient]]]:
    """``await as_component("agent")``: an ApiClient that authenticates with the agent's token."""
    opened: list[k8s.ApiClient] = []

    async def connect(component: str) -> k8s.ApiClient:
        api = await generated_client(str(installed.kubeconfigs[component]))
        opened.append(api)
        return api

    try:
        yield connect
    finally:
        for api in opened:
            await api.close()


async def allowed(call: Callable[[], Awaitable[Any]], within: float = 10.0) -> Any:
    """Run ``call``; retry a 403 briefly (new RoleBindings reach the authorizer's cache in ms).

    A 429 is retried too: right after a CRD is Established its storage may still be
    initialising ("storage is (re)initializing").
    """
    deadline = time.monotonic() + within
    while True:
        try:
            return await call()
        except ApiException as exc:
            if exc.status not in (403, 429) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def refused(call: Callable[[], Awaitable[Any]]) -> str:
    """``call`` must fail with 403 Forbidden; returns the API server's message."""
    with pytest.raises(ApiException) as info:
        await call()
    assert info.value.status == 403, info.value.body
    return str(info.value.body)


def _claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"count": 1}},
    }


async def _lists_a_claim_the_admin_made(
    api: k8s.ApiClient, custom: k8s.CustomObjectsApi, namespace: str, name: str
) -> Any:
    """The admin (``api``) creates claim ``name``; a cluster-wide list with ``custom`` must show it.
    The listing."""
    admin = k8s.CustomObjectsApi(api)
    await allowed(
        lambda: admin.create_namespaced_custom_object(GROUP, VERSION, namespace, "gpuclaims", _claim(name))
    )
    claims = await allowed(lambda: custom.list_cluster_custom_object(GROUP, VERSION, "gpuclaims"))
    assert name in {c["metadata"]["name"] for c in claims["items"]}
    return claims


def _lease(name: str) -> k8s.V1Lease:
    return k8s.V1Lease(
        metadata=k8s.V1ObjectMeta(name=name), spec=k8s.V1LeaseSpec(holder_identity="rbac-test")
    )


# ----------------------------------------------------------------------------- controller


async def test_controller_token_lists_claims_everywhere_locks_leases_and_writes_claim_status(
    installed: Installed, api: k8s.ApiClient, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    controller = await as_component("controller")
    custom = k8s.CustomObjectsApi(controller)
    await _lists_a_claim_the_admin_made(api, custom, ns, "c1")
    await allowed(lambda: custom.list_cluster_custom_object(GROUP, VERSION, "gpunodestatuses"))
    await allowed(lambda: k8s.CoreV1Api(controller).list_node())
    await allowed(lambda: k8s.CoreV1Api(controller).list_pod_for_all_namespaces(limit=1))

    lease = await allowed(
        lambda: k8s.CoordinationV1Api(controller).create_namespaced_lease(ns, _lease("gpu-test"))
    )
    assert lease.spec.holder_identity == "rbac-test"
    await k8s.CoordinationV1Api(controller).delete_namespaced_lease("gpu-test", ns)

    patched = await allowed(
        lambda: custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            ns,
            "gpuclaims",
            "c1",
            {"status": {"phase": "Pending", "message": "rbac test"}},
            _content_type=MERGE,
        )
    )
    assert patched["status"]["message"] == "rbac test"
    finalized = await allowed(
        lambda: custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            ns,
            "gpuclaims",
            "c1",
            {"metadata": {"finalizers": ["gpu.scheduling/release-devices"]}},
            _content_type=MERGE,
        )
    )
    assert finalized["metadata"]["finalizers"] == ["gpu.scheduling/release-devices"]
    await custom.patch_namespaced_custom_object(
        GROUP, VERSION, ns, "gpuclaims", "c1", {"metadata": {"finalizers": None}}, _content_type=MERGE
    )
    event = k8s.CoreV1Event(
        metadata=k8s.V1ObjectMeta(generate_name="c1."),
        involved_object=k8s.V1ObjectReference(
            api_version=f"{GROUP}/{VERSION}", kind="GpuClaim", name="c1", namespace=ns
        ),
        reason="RbacTest",
        message="events are allowed",
        type="Normal",
    )
    await allowed(lambda: k8s.CoreV1Api(controller).create_namespaced_event(ns, event))


async def test_controller_token_reads_quotas_and_writes_only_their_status(
    installed: Installed, api: k8s.ApiClient, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    quota = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuQuota",
        "metadata": {"name": "q1"},
        "spec": {"gpus": 8},
    }
    await allowed(
        lambda: k8s.CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, ns, "gpuquotas", quota
        )
    )
    custom = k8s.CustomObjectsApi(await as_component("controller"))
    quotas = await allowed(lambda: custom.list_cluster_custom_object(GROUP, VERSION, "gpuquotas"))
    assert "q1" in {q["metadata"]["name"] for q in quotas["items"]}
    ledger = {"status": {"used": 2, "claims": {"uid-1": {"name": "c1", "gpus": 2}}}}
    written = await allowed(
        lambda: custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, "gpuquotas", "q1", ledger, _content_type=MERGE
        )
    )
    assert written["status"]["used"] == 2
    # The limits are the cluster admin's.
    raised = {"spec": {"gpus": 64}}
    await refused(
        lambda: custom.patch_namespaced_custom_object(
            GROUP, VERSION, ns, "gpuquotas", "q1", raised, _content_type=MERGE
        )
    )
    await refused(lambda: custom.delete_namespaced_custom_object(GROUP, VERSION, ns, "gpuquotas", "q1"))


async def test_controller_token_is_refused_secrets_and_leases_outside_its_namespace(
    installed: Installed, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    controller = await as_component("controller")
    core = k8s.CoreV1Api(controller)
    await allowed(lambda: k8s.CoordinationV1Api(controller).list_namespaced_lease(ns))  # bindings are live
    await refused(lambda: core.list_namespaced_secret(ns))
    await refused(lambda: core.read_namespaced_secret("anything", ns))
    await refused(lambda: core.list_secret_for_all_namespaces())
    # A device lock outside the controller's namespace would lock nothing: it may not write one.
    await refused(
        lambda: k8s.CoordinationV1Api(controller).create_namespaced_lease("default", _lease("gpu-x"))
    )
    await refused(lambda: k8s.CoordinationV1Api(controller).list_lease_for_all_namespaces())
    await refused(lambda: core.delete_namespaced_pod("anything", ns))
    await refused(
        lambda: k8s.CustomObjectsApi(controller).create_cluster_custom_object(
            GROUP,
            VERSION,
            "gpunodestatuses",
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "GpuNodeStatus",
                "metadata": {"name": "x"},
                "spec": {"nodeName": "x"},
            },
        )
    )


# ----------------------------------------------------------------------------- webhook


async def test_webhook_token_lists_and_watches_claims(
    installed: Installed, api: k8s.ApiClient, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    custom = k8s.CustomObjectsApi(await as_component("webhook"))
    claims = await _lists_a_claim_the_admin_made(api, custom, ns, "w1")
    got = await allowed(lambda: custom.get_namespaced_custom_object(GROUP, VERSION, ns, "gpuclaims", "w1"))
    assert got["metadata"]["name"] == "w1"
    response = await custom.list_cluster_custom_object(
        GROUP,
        VERSION,
        "gpuclaims",
        watch=True,
        timeout_seconds=1,
        resource_version=claims["metadata"]["resourceVersion"],
        _preload_content=False,
    )
    try:
        assert response.status == 200
    finally:
        response.release()


async def test_webhook_token_is_refused_creating_a_lease_and_writing_claims(
    installed: Installed, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    webhook = await as_component("webhook")
    custom = k8s.CustomObjectsApi(webhook)
    await allowed(lambda: custom.list_cluster_custom_object(GROUP, VERSION, "gpuclaims"))
    await refused(lambda: k8s.CoordinationV1Api(webhook).create_namespaced_lease(ns, _lease("gpu-w")))
    await refused(lambda: k8s.CoordinationV1Api(webhook).list_namespaced_lease(ns))
    await refused(
        lambda: custom.create_namespaced_custom_object(GROUP, VERSION, ns, "gpuclaims", _claim("w2"))
    )
    await refused(
        lambda: custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, "gpuclaims", "w1", {"status": {"phase": "Allocated"}}, _content_type=MERGE
        )
    )
    await refused(lambda: k8s.CoreV1Api(webhook).read_namespaced_secret("anything", ns))
    await refused(lambda: k8s.CoreV1Api(webhook).list_pod_for_all_namespaces(limit=1))


# ----------------------------------------------------------------------------- agent


async def test_agent_token_creates_a_node_status_and_patches_its_status(
    installed: Installed, api: k8s.ApiClient, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    node = f"rbac-node-{uuid.uuid4().hex[:6]}"
    agent = await as_component("agent")
    custom = k8s.CustomObjectsApi(agent)
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GpuNodeStatus",
        "metadata": {"name": node},
        "spec": {"nodeName": node},
    }
    try:
        created = await allowed(
            lambda: custom.create_cluster_custom_object(GROUP, VERSION, "gpunodestatuses", body)
        )
        assert created["metadata"]["name"] == node
        patched = await custom.patch_cluster_custom_object_status(
            GROUP,
            VERSION,
            "gpunodestatuses",
            node,
            {"status": {"source": "simulated", "total": 0, "healthy": 0}},
            _content_type=MERGE,
        )
        assert patched["status"]["source"] == "simulated"
        listed = await custom.list_cluster_custom_object(GROUP, VERSION, "gpunodestatuses")
        assert node in {n["metadata"]["name"] for n in listed["items"]}
        await allowed(lambda: k8s.CoordinationV1Api(agent).list_namespaced_lease(installed.namespace))
        # get nodes (the owner reference); a missing node is a 404, not a 403
        with pytest.raises(ApiException) as info:
            await k8s.CoreV1Api(agent).read_node(node)
        assert info.value.status == 404
        # the usage audit: its node's pods, and a Warning Event on the Node
        core = k8s.CoreV1Api(agent)
        await allowed(lambda: core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}"))
        event = k8s.CoreV1Event(
            metadata=k8s.V1ObjectMeta(name=f"{node}.audit"),
            involved_object=k8s.V1ObjectReference(api_version="v1", kind="Node", name=node),
            reason="UnexpectedGpuProcess",
            message="process 1 on GPU 0: no claim holds GPU 0",
            type="Warning",
        )
        await allowed(lambda: core.create_namespaced_event("default", event))
    finally:
        await k8s.CustomObjectsApi(api).delete_cluster_custom_object(GROUP, VERSION, "gpunodestatuses", node)


async def test_agent_token_renews_heartbeat_leases_and_is_refused_secrets_claims_and_device_lease_writes(
    installed: Installed, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    agent = await as_component("agent")
    core = k8s.CoreV1Api(agent)
    await allowed(lambda: k8s.CoordinationV1Api(agent).list_namespaced_lease(ns))
    message = await refused(lambda: core.read_namespaced_secret("anything", ns))
    assert f"system:serviceaccount:{ns}:{installed.name('agent')}" in message
    await refused(lambda: core.list_secret_for_all_namespaces())
    await refused(lambda: k8s.CoordinationV1Api(agent).create_namespaced_lease(ns, _lease("gpu-a")))
    await refused(lambda: k8s.CustomObjectsApi(agent).list_cluster_custom_object(GROUP, VERSION, "gpuclaims"))
    await refused(lambda: core.list_node())  # get only: the node labels option is off
    await refused(lambda: core.patch_node("anything", {"metadata": {"labels": {"x": "y"}}}))
    # Its heartbeat: a Lease in the heartbeat namespace, created and renewed; nothing more there.
    beats, coordination = f"{ns}-heartbeats", k8s.CoordinationV1Api(agent)
    await allowed(lambda: coordination.create_namespaced_lease(beats, _lease("node-a")))
    await allowed(
        lambda: coordination.patch_namespaced_lease("node-a", beats, {"spec": {"holderIdentity": "x"}})
    )
    await refused(lambda: coordination.delete_namespaced_lease("node-a", beats))
    await refused(lambda: coordination.list_namespaced_lease(beats))
    controller = k8s.CoordinationV1Api(await as_component("controller"))
    await allowed(lambda: controller.list_namespaced_lease(beats))  # the controller reads them, only
    await refused(lambda: controller.create_namespaced_lease(beats, _lease("node-b")))


# ----------------------------------------------------------------------------- certs


async def test_certs_token_writes_only_its_secret_and_its_webhook_configuration(
    installed: Installed, api: k8s.ApiClient, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    secret_name = installed.name("webhook-tls")
    config_name = installed.fullname
    admission = k8s.AdmissionregistrationV1Api(api)
    # An empty configuration of the chart's name (no webhooks: it changes no admission).
    await admission.create_mutating_webhook_configuration(
        k8s.V1MutatingWebhookConfiguration(metadata=k8s.V1ObjectMeta(name=config_name), webhooks=[])
    )
    try:
        certs = await as_component("certs")
        core = k8s.CoreV1Api(certs)
        secret = k8s.V1Secret(
            metadata=k8s.V1ObjectMeta(name=secret_name),
            type="kubernetes.io/tls",
            data={"tls.crt": base64.b64encode(b"x").decode(), "tls.key": base64.b64encode(b"y").decode()},
        )
        await allowed(lambda: core.create_namespaced_secret(ns, secret))
        got = await core.read_namespaced_secret(secret_name, ns)
        assert got.type == "kubernetes.io/tls"
        await core.patch_namespaced_secret(secret_name, ns, {"metadata": {"labels": {"rotated": "yes"}}})
        mine = k8s.AdmissionregistrationV1Api(certs)
        await allowed(lambda: mine.read_mutating_webhook_configuration(config_name))
        await mine.patch_mutating_webhook_configuration(
            config_name, {"metadata": {"labels": {"ca": "injected"}}}
        )

        # resourceNames: any other Secret or configuration is out of reach.
        await refused(lambda: core.read_namespaced_secret("other", ns))
        await refused(lambda: core.list_namespaced_secret(ns))
        await refused(lambda: core.delete_namespaced_secret(secret_name, ns))
        await refused(lambda: mine.read_mutating_webhook_configuration("someone-else"))
        await refused(lambda: mine.list_mutating_webhook_configuration())
        await refused(lambda: core.read_namespaced_secret("anything", "default"))
    finally:
        await admission.delete_mutating_webhook_configuration(config_name)


# ----------------------------------------------------------------------------- the programs


async def _eventually(
    what: str, check: Callable[[], Awaitable[Any]], programs: list[tenants.Program], within: float = 60.0
) -> Any:
    deadline = time.monotonic() + within
    while True:
        for program in programs:
            program.alive()
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {p.name}\n{p.tail()}" for p in programs)
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}\n{logs}")
        await asyncio.sleep(0.5)


async def test_components_run_and_sync_with_only_their_own_tokens(
    control_plane: Any, installed: Installed, api: k8s.ApiClient, tmp_path: Path
) -> None:
    """certs makes the Secret and caBundle; agent publishes; the controller allocates; the webhook
    serves with that certificate. Each authenticates with its chart ServiceAccount's token only."""
    ns = installed.namespace
    kc = {component: str(path) for component, path in installed.kubeconfigs.items()}
    admin = k8s.CustomObjectsApi(api)
    admission = k8s.AdmissionregistrationV1Api(api)
    service, secret_name, config_name = (
        installed.name("webhook"),
        installed.name("webhook-tls"),
        installed.fullname,
    )
    node = f"rbac-gpu-{uuid.uuid4().hex[:6]}"
    control_plane.add_kwok_node(node, {"nvidia.com/gpu.present": "true"})

    # The chart's webhook configuration, as the certs hook finds it after an install.
    (mwc,) = [o for o in _render(installed.release, ns, "--set", "certManager.enabled=false")
              if o["kind"] == "MutatingWebhookConfiguration"]  # fmt: skip
    control_plane.request("POST", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", mwc)
    programs: list[tenants.Program] = []
    try:
        # certs: the same arguments the hook Job gets.
        certs = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpualloc.cli", "certs", f"--service={service}", f"--namespace={ns}",
            f"--secret={secret_name}", f"--webhook-config={config_name}", f"--kubeconfig={kc['certs']}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        output, _ = await asyncio.wait_for(certs.communicate(), timeout=60)
        assert certs.returncode == 0, output.decode()
        secret = await k8s.CoreV1Api(api).read_namespaced_secret(secret_name, ns)
        files = {k: base64.b64decode(v) for k, v in secret.data.items()}
        live = await admission.read_mutating_webhook_configuration(config_name)
        assert base64.b64decode(live.webhooks[0].client_config.ca_bundle) == files["ca.crt"]
        for name in ("tls.crt", "tls.key"):
            (tmp_path / name).write_bytes(files[name])

        agent_port, controller_port, webhook_port = cluster.free_ports(3)
        programs.append(tenants.Program("agent", [
            "agent", f"--kubeconfig={kc['agent']}", f"--node-name={node}", "--source=simulated",
            "--profile=h100-sxm-8", f"--lease-namespace={ns}", "--heartbeat-interval=5",
            f"--health-port={agent_port}", "--metrics-port=0", "--log-format=text",
        ], tmp_path))  # fmt: skip
        programs.append(tenants.Program("controller", [
            "controller", f"--kubeconfig={kc['controller']}", f"--namespace={ns}", "--leader-elect=true",
            f"--health-port={controller_port}", "--metrics-port=0", "--log-format=text",
        ], tmp_path))  # fmt: skip
        programs.append(tenants.Program("webhook", [
            "webhook", f"--kubeconfig={kc['webhook']}", f"--tls-cert-file={tmp_path / 'tls.crt'}",
            f"--tls-key-file={tmp_path / 'tls.key'}", f"--port={webhook_port}", "--pending=deny",
            "--metrics-port=0", "--health-port=0", "--log-format=text",
        ], tmp_path))  # fmt: skip

        async def status_published() -> bool:
            try:
                gns = await admin.get_cluster_custom_object(GROUP, VERSION, "gpunodestatuses", node)
            except ApiException:
                return False
            return (gns.get("status") or {}).get("total") == 8

        await _eventually("the agent's GpuNodeStatus with 8 GPUs", status_published, programs)

        async def http_ready(port: int) -> bool:
            return http_status(port, "/readyz") == 200

        await _eventually("agent /readyz", lambda: http_ready(agent_port), programs)
        await _eventually("controller /readyz", lambda: http_ready(controller_port), programs)
        tls = ssl.create_default_context(cadata=files["ca.crt"].decode())
        server_name = f"{service}.{ns}.svc"

        async def webhook_ready() -> bool:
            return http_status(webhook_port, "/readyz", tls=tls, server_name=server_name) == 200

        # TLS verified against the caBundle, for the Service's DNS name: the chain certs made works.
        await _eventually("webhook /readyz over TLS", webhook_ready, programs)

        claim = _claim("first")
        claim["spec"]["devices"]["count"] = 2
        created = await allowed(
            lambda: admin.create_namespaced_custom_object(GROUP, VERSION, ns, "gpuclaims", claim)
        )

        async def allocated() -> dict[str, Any] | None:
            got = await admin.get_namespaced_custom_object(GROUP, VERSION, ns, "gpuclaims", "first")
            return got if (got.get("status") or {}).get("phase") == "Allocated" else None

        done = await _eventually("the claim Allocated", allocated, programs)
        (allocation,) = done["status"]["allocations"]
        assert allocation["nodeName"] == node
        assert len(allocation["devices"]) == 2
        leases = await k8s.CoordinationV1Api(api).list_namespaced_lease(
            ns, label_selector=f"gpu.scheduling/claim-uid={created['metadata']['uid']}"
        )
        assert len(leases.items) == 2
        assert {lease.spec.holder_identity for lease in leases.items} == {created["metadata"]["uid"]}
        for program in programs:
            program.alive()
        # Nothing in any log says the API server refused a call. A whole-word 403 only: log lines
        # carry timestamps, ports and uids in which the digits 403 turn up by chance.
        for program in programs:
            text = program.log.read_text()
            assert not re.search(r"\b403\b", text) and "Forbidden" not in text, program.tail()
    finally:
        codes = {program.name: program.stop() for program in programs}
        control_plane.request(
            "DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{config_name}"
        )
        try:
            await admin.delete_cluster_custom_object(GROUP, VERSION, "gpunodestatuses", node)
        except ApiException as exc:
            if exc.status != 404:
                raise
        control_plane.request("DELETE", f"/api/v1/nodes/{node}")  # later tests count the nodes
    assert all(code == 0 for code in codes.values()), codes


# ----------------------------------------------------------------------------- pod annotations

ADMISSION = "/apis/admissionregistration.k8s.io/v1"
POLICY_COLLECTIONS = {
    "ValidatingAdmissionPolicy": f"{ADMISSION}/validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": f"{ADMISSION}/validatingadmissionpolicybindings",
}


@pytest.fixture
async def annotation_policy(control_plane: Any, installed: Installed) -> AsyncIterator[None]:
    """The chart's pod-annotation ValidatingAdmissionPolicy and its binding, as rendered.

    The binding is narrowed to the test's namespace, so that while the policy is
    installed (and for the moment its removal takes to reach the API server's
    policy cache) it cannot refuse another test's pods.
    """
    docs = [
        d
        for d in _render(installed.release, installed.namespace, "--set", "webhook.pendingMode=gate")
        if d["kind"] in POLICY_COLLECTIONS and d["metadata"]["name"].endswith("-pod-annotations")
    ]
    assert sorted(d["kind"] for d in docs) == sorted(POLICY_COLLECTIONS)
    created: list[str] = []
    try:
        for doc in docs:
            if doc["kind"] == "ValidatingAdmissionPolicyBinding":
                doc["spec"]["matchResources"] = {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": installed.namespace}}
                }
            path = POLICY_COLLECTIONS[doc["kind"]]
            control_plane.request("POST", path, doc)
            created.append(f"{path}/{doc['metadata']['name']}")
        yield
    finally:
        for path in reversed(created):
            delete_if_present(control_plane, path)


async def _tenant(control_plane: Any, installed: Installed, api: k8s.ApiClient, tmp_path: Path) -> Path:
    """A kubeconfig for a user of the namespace who may read, create and edit pods there, no more."""
    ns, core = installed.namespace, k8s.CoreV1Api(api)
    rbac = k8s.RbacAuthorizationV1Api(api)
    await core.create_namespaced_service_account(
        ns, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="tenant"))
    )
    await rbac.create_namespaced_role(
        ns,
        k8s.V1Role(
            metadata=k8s.V1ObjectMeta(name="tenant"),
            rules=[
                k8s.V1PolicyRule(
                    api_groups=[""], resources=["pods"], verbs=["get", "list", "create", "update", "patch"]
                )
            ],
        ),
    )
    await rbac.create_namespaced_role_binding(
        ns,
        k8s.V1RoleBinding(
            metadata=k8s.V1ObjectMeta(name="tenant"),
            role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name="tenant"),
            subjects=[k8s.RbacV1Subject(kind="ServiceAccount", name="tenant", namespace=ns)],
        ),
    )
    review = await core.create_namespaced_service_account_token(
        "tenant", ns, k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(audiences=[]))
    )
    return tenants.token_kubeconfig(control_plane, review.status.token, tmp_path / "tenant.kubeconfig")


def _pod(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "registry.example/cuda:12"}]},
    }


async def test_only_the_controller_may_change_a_pods_gpualloc_annotations(
    control_plane: Any,
    installed: Installed,
    annotation_policy: None,
    api: k8s.ApiClient,
    as_component: Callable[[str], Awaitable[k8s.ApiClient]],
    tmp_path: Path,
) -> None:
    ns = installed.namespace
    tenant_api = await generated_client(str(await _tenant(control_plane, installed, api, tmp_path)))
    try:
        tenant = k8s.CoreV1Api(tenant_api)
        gated = {"gpu.scheduling/claim": "trainer"}
        held = {"gpu.scheduling/claim": "trainer", "gpu.scheduling/devices": "GPU-aaaa,GPU-bbbb"}
        # CREATE is the webhook's business: the policy lets the tenant create pods as they like.
        await allowed(lambda: tenant.create_namespaced_pod(ns, _pod("probe", held)))
        await tenant.create_namespaced_pod(ns, _pod("gated", gated))
        await tenant.create_namespaced_pod(ns, _pod("held", held))
        await tenant.create_namespaced_pod(ns, _pod("plain", {"team": "ml"}))

        def annotate(name: str, changes: dict[str, str | None]) -> Callable[[], Awaitable[Any]]:
            body = {"metadata": {"annotations": changes}}
            return lambda: tenant.patch_namespaced_pod(name, ns, body, _content_type=MERGE)

        # A new policy reaches the API server's policy cache within about a second: wait for it on
        # a pod of its own, then check each case once.
        deadline = time.monotonic() + 30
        while True:
            try:
                await annotate("probe", {"gpu.scheduling/devices": f"GPU-{time.monotonic_ns()}"})()
            except ApiException as exc:
                assert exc.status == 403, exc.body
                break
            assert time.monotonic() < deadline, "the ValidatingAdmissionPolicy never took effect"
            await asyncio.sleep(0.2)

        message = await refused(annotate("held", {"gpu.scheduling/devices": "GPU-cccc"}))
        assert "gpu.scheduling/devices" in message and "pod held" in message, message
        assert "gpu.scheduling/claim" not in message, message  # names only what changed
        await refused(annotate("held", {"gpu.scheduling/devices": None}))
        await refused(annotate("gated", {"gpu.scheduling/devices": "GPU-cccc"}))
        await refused(annotate("gated", {"gpu.scheduling/claim": "someone-elses"}))
        await refused(annotate("gated", {"gpu.scheduling/replica": "1"}))
        await refused(annotate("plain", {"gpu.scheduling/claim": "trainer"}))

        # Everything else stays editable, on claim pods too.
        edited = await annotate("held", {"team": "ml", "gpu.scheduling/devices": "GPU-aaaa,GPU-bbbb"})()
        assert edited.metadata.annotations["team"] == "ml"
        await tenant.patch_namespaced_pod(
            "gated", ns, {"metadata": {"labels": {"tier": "batch"}}}, _content_type=MERGE
        )
        await annotate("plain", {"owner": "alice"})()

        # The controller hands a gated pod its devices (and could correct a record) with its own token.
        controller = k8s.CoreV1Api(await as_component("controller"))
        body = {"metadata": {"annotations": {"gpu.scheduling/devices": "GPU-dddd"}}}
        ungated = await allowed(
            lambda: controller.patch_namespaced_pod("gated", ns, body, _content_type=MERGE)
        )
        assert ungated.metadata.annotations["gpu.scheduling/devices"] == "GPU-dddd"
        stored = await tenant.read_namespaced_pod("held", ns)
        assert stored.metadata.annotations["gpu.scheduling/devices"] == "GPU-aaaa,GPU-bbbb"
    finally:
        await tenant_api.close()
