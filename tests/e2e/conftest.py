"""Fixtures of the e2e tests: the tenant release (see ``tests/e2e/tenants.py``), one per module.

- ``namespaces`` (module): the release's namespace, the tenant's, one the webhook is not called
  for and one exempt from the isolation policies.
- ``setup`` (module, async): ``helm install`` of the chart, the webhook in this process, the
  tenant with its own token, two plain Nodes; every policy in force before it yields. Afterwards
  the release is uninstalled and no cluster-wide policy, webhook configuration or Node is left.
  A module's ``HELM_VALUES`` (``key=value`` strings) are set on top of the fixture's own.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpualloc.kube import client as kube_client
from tests.conftest import delete_if_present
from tests.e2e import tenants


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("isolation")


@pytest.fixture(scope="module")
def namespaces(control_plane: Any) -> Iterator[dict[str, str]]:
    tag = uuid.uuid4().hex[:6]
    names = {
        "system": f"iso-sys-{tag}",
        "tenant": f"tenant-{tag}",
        "unhooked": f"tenant-nohook-{tag}",
        "exempt": f"gpu-op-{tag}",
    }
    for name in names.values():
        control_plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        control_plane.ensure_service_account(name)
    try:
        yield names
    finally:
        for name in names.values():
            delete_if_present(control_plane, f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
async def setup(
    control_plane: Any, namespaces: dict[str, str], tmp_module: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tenants.Setup]:
    # kube-controller-manager aggregates the edit ClusterRole (without it, edit grants nothing).
    control_plane.ensure_controller_manager()
    release = f"iso{uuid.uuid4().hex[:6]}"
    fullname = f"{release}-gpualloc"
    kubeconfig = Path(control_plane.kubeconfig)
    admin = await kube_client.connect(str(kubeconfig))
    webhook = await tenants.start_webhook(admin)
    opened = [admin]
    nodes = [f"iso-node-{uuid.uuid4().hex[:6]}" for _ in range(2)]
    try:
        tenants.helm(
            kubeconfig, tmp_module / "helm", "install", release, str(tenants.CHART),
            "--namespace", namespaces["system"], "--no-hooks", "--timeout", "120s",
            "--set", "certManager.enabled=false", "--set", "webhook.pendingMode=gate",
            "--set", f"isolation.exemptNamespaces={{kube-system,{namespaces['exempt']}}}",
            "--set", f"webhook.excludeNamespaces={{{namespaces['unhooked']}}}",
            *[arg for value in getattr(request.module, "HELM_VALUES", ()) for arg in ("--set", value)],
        )  # fmt: skip
        # The release's webhook configuration, pointed at the webhook in this process.
        client_config = {"url": webhook.url, "caBundle": base64.b64encode(webhook.ca_pem).decode()}
        await tenants.call(
            admin,
            "PATCH",
            f"{tenants.ADMISSION}/mutatingwebhookconfigurations/{fullname}",
            body=[{"op": "replace", "path": "/webhooks/0/clientConfig", "value": client_config}],
            content_type=tenants.JSON_PATCH,
        )

        # The tenant: edit in its namespaces, a token from the TokenRequest API.
        for ns in (namespaces["tenant"], namespaces["unhooked"], namespaces["exempt"]):
            if ns == namespaces["tenant"]:
                control_plane.ensure_service_account(ns, "tenant")
            control_plane.request(
                "POST",
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
                {
                    "metadata": {"name": "tenant-edit"},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": "ClusterRole",
                        "name": "edit",
                    },
                    "subjects": [
                        {"kind": "ServiceAccount", "name": "tenant", "namespace": namespaces["tenant"]}
                    ],
                },
            )
        # Kubernetes' edit role does not grant pods/ephemeralcontainers (kubectl debug); clusters
        # that let tenants debug grant it like this, and that is the case the policies must cover.
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespaces['tenant']}"
        rule = {
            "apiGroups": [""],
            "resources": ["pods/ephemeralcontainers"],
            "verbs": ["get", "patch", "update"],
        }
        control_plane.request("POST", f"{rbac}/roles", {"metadata": {"name": "debug"}, "rules": [rule]})
        control_plane.request(
            "POST",
            f"{rbac}/rolebindings",
            {
                "metadata": {"name": "tenant-debug"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "debug"},
                "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": namespaces["tenant"]}],
            },
        )
        token = await tenants.service_account_token(admin, namespaces["tenant"], "tenant")
        tenant = await kube_client.connect(
            str(tenants.token_kubeconfig(control_plane, token, tmp_module / "tenant.kubeconfig"))
        )
        opened.append(tenant)
        for name in nodes:
            control_plane.request("POST", "/api/v1/nodes", {"metadata": {"name": name}})
        result = tenants.Setup(
            release=release,
            system=namespaces["system"],
            tenant_ns=namespaces["tenant"],
            unhooked_ns=namespaces["unhooked"],
            exempt_ns=namespaces["exempt"],
            admin=admin,
            tenant=tenant,
            control_plane=control_plane,
            kubeconfigs=tmp_module,
            nodes=nodes,
        )
        await tenants.wait_until_in_force(result)
        yield result
    finally:
        try:
            tenants.helm(
                kubeconfig, tmp_module / "helm", "uninstall", release, "--namespace", namespaces["system"]
            )
        finally:
            # Never leave a cluster-wide policy or a fail-closed webhook behind for later tests.
            for kind in (
                "mutatingwebhookconfigurations",
                "mutatingadmissionpolicies",
                "mutatingadmissionpolicybindings",
                "validatingadmissionpolicies",
                "validatingadmissionpolicybindings",
            ):
                for suffix in (
                    "",
                    "-no-gpu-without-claim",
                    "-pod-devices",
                    "-node-identity",
                    "-pod-gated-label",
                    "-quota-priority",
                    "-claim-metadata",
                    "-claim-finalizer-removal",
                    "-node-free-gpus-label",
                    "-steer-pods-without-gpus",
                ):
                    delete_if_present(control_plane, f"{tenants.ADMISSION}/{kind}/{fullname}{suffix}")
            for name in nodes:
                delete_if_present(control_plane, f"{tenants.NODE_STATUSES}/{name}")
                delete_if_present(control_plane, f"/api/v1/nodes/{name}")  # later tests count the nodes
            await tenants.wait_until_gone(admin, namespaces["tenant"])
            await webhook.stop()
            for api in opened:
                await api.close()
