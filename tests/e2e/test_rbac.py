"""The chart's RBAC, proven against the real API server with each component's own token.

The ServiceAccounts, Roles, ClusterRoles and bindings come from ``helm template``
(certs hook RBAC included) and are created in a fresh namespace. A TokenRequest
gives each ServiceAccount a token; a kubeconfig made from that token is what the
calls below use. Each component's permitted calls succeed, and a call outside its
role is refused with 403 by the RBAC authorizer.
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
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

from gpualloc.devcluster import binaries
from gpualloc.kube import client as kube_client

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


def _token_kubeconfig(admin_kubeconfig: Path, server: str, token: str, path: Path) -> Path:
    """A kubeconfig with the admin's cluster (server, CA) and a bearer-token user."""
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    cluster = dict(admin["clusters"][0]["cluster"])
    cluster["server"] = server
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "local", "cluster": cluster}],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
                "current-context": "sa",
            }
        )
    )
    path.chmod(0o600)
    return path


@pytest.fixture
async def installed(
    control_plane: Any, namespace: str, api: k8s.ApiClient, tmp_path: Path
) -> AsyncIterator[Installed]:
    from gpualloc.devcluster import cluster

    release = f"rb{uuid.uuid4().hex[:6]}"
    inst = Installed(release=release, namespace=namespace, fullname=f"{release}-gpualloc")
    objs = _render(
        release, namespace, "--set", "certManager.enabled=false", "--set", "webhook.pendingMode=gate"
    )
    created: list[str] = []
    try:
        for obj in objs:
            if obj["kind"] not in RBAC_KINDS:
                continue
            obj["metadata"].pop("annotations", None)  # the certs RBAC are hooks; here plain objects
            path = COLLECTIONS[obj["kind"]].format(ns=namespace)
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
            inst.kubeconfigs[component] = _token_kubeconfig(
                control_plane.kubeconfig,
                control_plane.server,
                review.status.token,
                tmp_path / f"{component}.kubeconfig",
            )
        yield inst
    finally:
        for path in created:
            try:
                control_plane.request("DELETE", path)
            except cluster.RequestError as exc:
                if exc.status != 404:
                    raise


@pytest.fixture
async def as_component(installed: Installed) -> AsyncIterator[Callable[[str], Awaitable[k8s.ApiClient]]]:
    """``await as_component("agent")``: an ApiClient that authenticates with the agent's token."""
    opened: list[k8s.ApiClient] = []

    async def connect(component: str) -> k8s.ApiClient:
        api = await kube_client.connect(str(installed.kubeconfigs[component]))
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


def _lease(name: str) -> k8s.V1Lease:
    return k8s.V1Lease(
        metadata=k8s.V1ObjectMeta(name=name), spec=k8s.V1LeaseSpec(holder_identity="rbac-test")
    )


# ----------------------------------------------------------------------------- controller


async def test_controller_token_lists_claims_everywhere_locks_leases_and_writes_claim_status(
    installed: Installed, api: k8s.ApiClient, as_component: Callable[[str], Awaitable[k8s.ApiClient]]
) -> None:
    ns = installed.namespace
    admin = k8s.CustomObjectsApi(api)
    await allowed(
        lambda: admin.create_namespaced_custom_object(GROUP, VERSION, ns, "gpuclaims", _claim("c1"))
    )
    controller = await as_component("controller")
    custom = k8s.CustomObjectsApi(controller)

    claims = await allowed(lambda: custom.list_cluster_custom_object(GROUP, VERSION, "gpuclaims"))
    assert "c1" in {c["metadata"]["name"] for c in claims["items"]}
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
    admin = k8s.CustomObjectsApi(api)
    await allowed(
        lambda: admin.create_namespaced_custom_object(GROUP, VERSION, ns, "gpuclaims", _claim("w1"))
    )
    webhook = await as_component("webhook")
    custom = k8s.CustomObjectsApi(webhook)
    claims = await allowed(lambda: custom.list_cluster_custom_object(GROUP, VERSION, "gpuclaims"))
    assert "w1" in {c["metadata"]["name"] for c in claims["items"]}
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
    finally:
        await k8s.CustomObjectsApi(api).delete_cluster_custom_object(GROUP, VERSION, "gpunodestatuses", node)


async def test_agent_token_is_refused_secrets_claims_and_lease_writes(
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
