"""``helm install`` of the chart into the real local control plane, in both TLS modes.

kube-controller-manager, kube-scheduler and kwok run, so Deployments, DaemonSets
and hook Jobs get pods that are scheduled onto fake nodes; kwok reports them
Running (and Job pods Succeeded) without running a container, so nothing here
shows that the image runs. What it shows: every object the chart renders is
accepted by the real API server under strict field validation (cert-manager's
kinds by cert-manager's own CRDs), helm install / upgrade / uninstall succeed,
the certs hook Job runs before and after each install and upgrade, the agent
lands only on GPU nodes, the webhook replicas land on distinct nodes, and the
MutatingWebhookConfiguration fails closed for claim pods only.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc.devcluster import binaries
from tests.conftest import completed_requests, wait_until
from tests.e2e.test_helm_cert_manager import cert_manager_crds

CHART = Path(__file__).resolve().parents[2] / "helm" / "gpualloc"
GPU_LABEL = "nvidia.com/gpu.present"
CLAIM_ANNOTATION = "gpu.scheduling/claim"
WEBHOOK_NAME = "claim-pods.gpu.scheduling"
GPU_NODES = ("helm-gpu-1", "helm-gpu-2")
CPU_NODES = ("helm-cpu-1",)


# ----------------------------------------------------------------------------- helpers


class Helm:
    """The helm binary against the local control plane, with its own config and cache dirs."""

    def __init__(self, kubeconfig: Path, home: Path) -> None:
        self.path = str(binaries.ensure(["helm"], progress=lambda _: None)["helm"])
        self.kubeconfig = str(kubeconfig)
        self.env = {
            **os.environ,
            "HELM_CONFIG_HOME": str(home / "config"),
            "HELM_CACHE_HOME": str(home / "cache"),
            "HELM_DATA_HOME": str(home / "data"),
        }

    def __call__(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.path, "--kubeconfig", self.kubeconfig, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )

    def ok(self, *args: str, timeout: float = 300.0) -> str:
        result = self(*args, timeout=timeout)
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    def template(self, release: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
        out = self.ok(
            "template", release, str(CHART), "--namespace", namespace, "--kube-version", "1.36.0", *sets
        )
        return [doc for doc in yaml.safe_load_all(out) if doc]


def _sets(values: dict[str, str]) -> list[str]:
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


class Paths:
    """apiVersion + kind -> REST path, from the API server's discovery documents."""

    def __init__(self, control_plane: Any) -> None:
        self.cp = control_plane
        self.cache: dict[tuple[str, str], tuple[str, bool]] = {}

    def collection(self, obj: dict[str, Any]) -> str:
        api_version, kind = obj["apiVersion"], obj["kind"]
        key = (api_version, kind)
        if key not in self.cache:
            base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
            for resource in self.cp.request("GET", base)["resources"]:
                if resource["kind"] == kind and "/" not in resource["name"]:
                    self.cache[key] = (f"{base}/{{ns}}{resource['name']}", resource["namespaced"])
                    break
            else:
                raise AssertionError(f"the API server does not serve {kind} in {api_version}")
        template, namespaced = self.cache[key]
        namespace = obj["metadata"].get("namespace")
        return template.format(ns=f"namespaces/{namespace}/" if namespaced else "")

    def item(self, obj: dict[str, Any]) -> str:
        return f"{self.collection(obj)}/{obj['metadata']['name']}"


def _strictly_accepted(
    control_plane: Any, paths: Paths, objs: list[dict[str, Any]], namespace: str
) -> list[str]:
    """Create every object as a server-side dry run with strict field validation; returns kind/name.
    An object in a namespace the chart itself makes (the heartbeat namespace), which a dry run
    does not create, is tried in the release ``namespace``."""
    made = {obj["metadata"]["name"] for obj in objs if obj["kind"] == "Namespace"}
    accepted = []
    for obj in objs:
        if obj["metadata"].get("namespace") in made:
            obj = {**obj, "metadata": {**obj["metadata"], "namespace": namespace}}
        control_plane.request("POST", paths.collection(obj) + "?dryRun=All&fieldValidation=Strict", obj)
        accepted.append(f"{obj['kind']}/{obj['metadata']['name']}")
    return accepted


def _job_creates(audit_log: Path, namespace: str, name: str) -> int:
    """Successful creations (not dry runs) of the Job ``name`` in ``namespace``, from the audit log."""
    return sum(
        1
        for event in completed_requests(audit_log, resource="jobs", name=name, namespace=namespace)
        if event.get("verb") == "create"
        and (event.get("responseStatus") or {}).get("code") == 201
        and "dryRun" not in event.get("requestURI", "")
    )


def _status(control_plane: Any, path: str) -> dict[str, Any]:
    return control_plane.request("GET", path).get("status") or {}


def _gpu_node_count(control_plane: Any) -> int:
    return len(control_plane.request("GET", f"/api/v1/nodes?labelSelector={GPU_LABEL}%3Dtrue")["items"])


def _pods(control_plane: Any, namespace: str, component: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/component%3D{component}"
    return control_plane.request("GET", f"/api/v1/namespaces/{namespace}/pods?labelSelector={selector}")[
        "items"
    ]


def _pod(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "main", "image": "registry.invalid/none:1"}]},
    }


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster(control_plane: Any) -> Iterator[Any]:
    """The control plane with controllers, a scheduler, kwok, two GPU nodes and one CPU node.

    The nodes are deleted afterwards: later tests count the cluster's nodes.
    """
    from gpualloc.devcluster import cluster as cluster_mod

    control_plane.ensure_controller_manager()
    control_plane.ensure_scheduler()
    control_plane.ensure_kwok()
    try:
        for name in GPU_NODES:
            control_plane.add_kwok_node(name, {GPU_LABEL: "true"})
        for name in CPU_NODES:
            control_plane.add_kwok_node(name)
        # What the GPU Operator (or a manual NVIDIA container toolkit setup) provides.
        try:
            control_plane.request(
                "POST",
                "/apis/node.k8s.io/v1/runtimeclasses",
                {
                    "apiVersion": "node.k8s.io/v1",
                    "kind": "RuntimeClass",
                    "metadata": {"name": "nvidia"},
                    "handler": "nvidia",
                },
            )
        except cluster_mod.RequestError as exc:
            if exc.status != 409:
                raise
        yield control_plane
    finally:
        for name in (*GPU_NODES, *CPU_NODES):
            try:
                control_plane.request("DELETE", f"/api/v1/nodes/{name}")
            except cluster_mod.RequestError as exc:
                if exc.status != 404:
                    raise


@pytest.fixture
def helm(cluster: Any, tmp_path: Path) -> Helm:
    return Helm(cluster.kubeconfig, tmp_path / "helm")


@pytest.fixture
def release(helm: Helm, cluster: Any, namespace: str) -> Iterator[str]:
    """A release name; uninstalled after the test, and its cluster-wide webhook config removed."""
    from gpualloc.devcluster import cluster as cluster_mod

    name = f"h{uuid.uuid4().hex[:6]}"
    try:
        yield name
    finally:
        helm("uninstall", name, "--namespace", namespace, "--wait", "--timeout", "60s")
        # Never leave a fail-closed webhook behind for the tests that run after this one.
        try:
            cluster.request(
                "DELETE",
                f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}-gpualloc",
            )
        except cluster_mod.RequestError as exc:
            if exc.status != 404:
                raise


@pytest.fixture
def other_namespace(cluster: Any) -> Iterator[str]:
    """A namespace for workload pods (not excluded from the webhook)."""

    name = f"work-{uuid.uuid4().hex[:6]}"
    cluster.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    cluster.ensure_service_account(name)
    try:
        yield name
    finally:
        cluster.request("DELETE", f"/api/v1/namespaces/{name}")


# ----------------------------------------------------------------------------- tests


def test_helm_install_without_cert_manager_upgrade_and_uninstall(
    cluster: Any, helm: Helm, release: str, namespace: str, other_namespace: str
) -> None:
    values = {"certManager.enabled": "false"}
    fullname = f"{release}-gpualloc"
    paths = Paths(cluster)

    # 1. Every rendered object, hooks included, passes the API server's strict validation.
    rendered = helm.template(release, namespace, *_sets(values))
    accepted = _strictly_accepted(cluster, paths, rendered, namespace)
    assert f"Job/{fullname}-certs" in accepted
    assert f"MutatingWebhookConfiguration/{fullname}" in accepted

    # 2. helm install (no --wait: no image is pulled here). Hooks are always waited for.
    installed = helm.ok(
        "install", release, str(CHART), "--namespace", namespace, "--timeout", "180s", *_sets(values)
    )
    assert f"get secret {fullname}-webhook-tls" in installed  # NOTES.txt rendered, for this TLS mode
    status = json.loads(helm.ok("status", release, "--namespace", namespace, "-o", "json"))
    assert status["info"]["status"] == "deployed"
    manifest = [
        doc
        for doc in yaml.safe_load_all(helm.ok("get", "manifest", release, "--namespace", namespace))
        if doc
    ]
    assert {o["kind"] for o in manifest} >= {
        "DaemonSet",
        "Deployment",
        "MutatingWebhookConfiguration",
        "PodDisruptionBudget",
    }
    for obj in manifest:
        live = cluster.request("GET", paths.item(obj))
        assert live["metadata"]["labels"]["app.kubernetes.io/instance"] == release

    # 3. The certs Job ran as a pre-install and as a post-install hook, and was cleaned up.
    assert _job_creates(cluster.audit_log, namespace, f"{fullname}-certs") == 2
    jobs = cluster.request("GET", f"/apis/batch/v1/namespaces/{namespace}/jobs")["items"]
    assert not [j for j in jobs if j["metadata"]["name"] == f"{fullname}-certs"]  # hook-succeeded
    cluster_roles = cluster.request("GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles")["items"]
    assert f"{fullname}-certs" not in {r["metadata"]["name"] for r in cluster_roles}

    # 4. Workloads: 2 controller and 2 webhook replicas, the webhook's on distinct nodes, the agent
    #    on every GPU node and only there, disruption budgets that see their pods.
    apps = f"/apis/apps/v1/namespaces/{namespace}"
    for component in ("controller", "webhook"):
        deployment_path = f"{apps}/deployments/{fullname}-{component}"
        wait_until(
            f"{component} available",
            lambda p=deployment_path: _status(cluster, p).get("availableReplicas") == 2,
        )
        pdb_path = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets/{fullname}-{component}"
        wait_until(
            f"{component} PDB sees 2 healthy pods",
            lambda p=pdb_path: _status(cluster, p).get("currentHealthy") == 2,
        )
        assert _status(cluster, pdb_path)["disruptionsAllowed"] == 1
    webhook_nodes = [p["spec"]["nodeName"] for p in _pods(cluster, namespace, "webhook")]
    assert len(webhook_nodes) == 2 and len(set(webhook_nodes)) == 2, webhook_nodes
    gpu_nodes = _gpu_node_count(cluster)
    ds_path = f"{apps}/daemonsets/{fullname}-agent"
    wait_until("agent DaemonSet ready", lambda: _status(cluster, ds_path).get("numberReady") == gpu_nodes)
    ds = cluster.request("GET", ds_path)
    assert ds["status"]["desiredNumberScheduled"] == gpu_nodes
    for pod in _pods(cluster, namespace, "agent"):
        node = cluster.request("GET", f"/api/v1/nodes/{pod['spec']['nodeName']}")
        assert node["metadata"]["labels"].get(GPU_LABEL) == "true"
        assert pod["spec"]["runtimeClassName"] == "nvidia"

    # 5. Fail closed for claim pods only: no webhook answers here (kwok runs no container), so a pod
    #    with the claim annotation is refused; a pod without it, or in the release namespace, is not.
    pods = f"/api/v1/namespaces/{other_namespace}/pods"
    from gpualloc.devcluster import cluster as cluster_mod

    with pytest.raises(cluster_mod.RequestError) as refused:
        cluster.request("POST", pods, _pod("claimed", {CLAIM_ANNOTATION: "two-gpus"}), timeout=30)
    assert WEBHOOK_NAME in str(refused.value)
    cluster.request("POST", pods, _pod("plain"))
    cluster.request("POST", pods, _pod("other-annotation", {"example.com/claim": "x"}))
    cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods", _pod("claimed", {CLAIM_ANNOTATION: "x"}))

    # 6. helm upgrade runs the hook in both phases again and changes what it should.
    helm.ok(
        "upgrade", release, str(CHART), "--namespace", namespace, "--timeout", "180s",
        *_sets({**values, "webhook.pendingMode": "gate"}),
    )  # fmt: skip
    assert _job_creates(cluster.audit_log, namespace, f"{fullname}-certs") == 4
    role = cluster.request("GET", f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{fullname}-controller")
    (pods_rule,) = [r for r in role["rules"] if r["resources"] == ["pods"]]
    assert "patch" in pods_rule["verbs"]
    deployment = cluster.request(
        "GET", f"/apis/apps/v1/namespaces/{namespace}/deployments/{fullname}-webhook"
    )
    assert "--pending=gate" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]

    # 7. helm uninstall removes the cluster-scoped objects too.
    helm.ok("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "60s")
    with pytest.raises(cluster_mod.RequestError) as gone:
        cluster.request(
            "GET", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{fullname}"
        )
    assert gone.value.status == 404
    admission = "/apis/admissionregistration.k8s.io/v1"
    for kind, suffix in (
        ("mutatingadmissionpolicies", "no-gpu-without-claim"),
        ("validatingadmissionpolicies", "pod-devices"),
        ("validatingadmissionpolicies", "node-identity"),
    ):
        with pytest.raises(cluster_mod.RequestError) as gone:
            cluster.request("GET", f"{admission}/{kind}/{fullname}-{suffix}")
        assert gone.value.status == 404
    # The API server drops deleted policies from its admission cache a moment after the delete
    # (the pod-devices policy refuses a claim pod that no webhook gave its devices).
    claimed = _pod("claimed-after-uninstall", {CLAIM_ANNOTATION: "two-gpus"})

    def created() -> bool:
        try:
            cluster.request("POST", pods, claimed)
        except cluster_mod.RequestError as exc:
            assert exc.status == 403 and "pod-devices" in str(exc), exc
            return False
        return True

    wait_until("the claim pod created once the release is gone", created, within=30)


def test_helm_install_with_cert_manager_crds(cluster: Any, helm: Helm, release: str, namespace: str) -> None:
    """cert-manager's CRDs only (not its controller or cainjector): the chart's Issuers and
    Certificates are valid cert-manager objects and the release installs."""
    crd_names = cluster.apply_crds(cert_manager_crds())
    assert "certificates.cert-manager.io" in crd_names
    fullname = f"{release}-gpualloc"
    paths = Paths(cluster)

    rendered = helm.template(release, namespace)
    accepted = _strictly_accepted(cluster, paths, rendered, namespace)
    assert {f"Issuer/{fullname}-selfsigned", f"Issuer/{fullname}-ca", f"Certificate/{fullname}-ca"} <= set(
        accepted
    )
    assert f"Certificate/{fullname}-webhook-serving" in accepted
    assert not [a for a in accepted if a.startswith("Job/")]

    installed = helm.ok("install", release, str(CHART), "--namespace", namespace, "--timeout", "120s")
    assert f"get certificate {fullname}-webhook-serving" in installed  # NOTES.txt, cert-manager mode
    serving = cluster.request(
        "GET", f"/apis/cert-manager.io/v1/namespaces/{namespace}/certificates/{fullname}-webhook-serving"
    )
    rendered_serving = next(o for o in rendered if o["metadata"]["name"] == f"{fullname}-webhook-serving")
    assert serving["spec"] == rendered_serving["spec"]  # nothing pruned or defaulted away
    ca_issuer = cluster.request(
        "GET", f"/apis/cert-manager.io/v1/namespaces/{namespace}/issuers/{fullname}-ca"
    )
    assert ca_issuer["spec"]["ca"]["secretName"] == f"{fullname}-ca"
    mwc = cluster.request(
        "GET", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{fullname}"
    )
    assert (
        mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
        == f"{namespace}/{fullname}-webhook-serving"
    )
    # Without cert-manager's cainjector running, nothing fills the caBundle.
    assert not mwc["webhooks"][0]["clientConfig"].get("caBundle")
