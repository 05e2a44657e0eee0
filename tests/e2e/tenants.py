"""The tenant release of the e2e tests: gpualloc installed by its chart, and a tenant attacking it
with its own token.

``helm install`` (``--no-hooks``) in a fresh namespace, the release's webhook pointed at a gpualloc
webhook serving in this process on 127.0.0.1 (gate mode; the local API server cannot reach a
Service's pods), and a tenant: a ServiceAccount bound to the ``edit`` ClusterRole in its namespaces,
calling the real kube-apiserver with a token from the TokenRequest API. The fixtures that build it
are in ``tests/e2e/conftest.py``; ``test_tenant_isolation``, ``test_tenant_attacks`` and
``test_tenant_preemption`` use them, and ``test_rbac`` makes its token kubeconfigs here too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc.api import constants
from gpualloc.devcluster import binaries
from gpualloc.kube import client as kube_client
from gpualloc.kube import errors, resources, transport, watching
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.tls_support import write_serving_pair
from webhook import admission, cache, server
from webhook import metrics as metrics_

CHART = Path(__file__).resolve().parents[2] / "helm" / "gpualloc"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
NODE_STATUSES = "/apis/gpu.scheduling/v1/gpunodestatuses"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
NV, CUDA = "NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"
VOID = {"name": NV, "value": "void"}
# An image whose Dockerfile says ENV NVIDIA_VISIBLE_DEVICES=all (nothing pulls it here: what
# counts is that the stored spec overrides whatever the image says).
CUDA_IMAGE = "nvcr.io/nvidia/cuda:12.4.1-base-ubuntu22.04"
NOT_A_GPU_POD = "a pod without a gpu.scheduling/claim annotation gets no GPU"


@dataclass
class Setup:
    """The installed release, the tenant's client and the namespaces it may edit."""

    release: str
    system: str  # the release namespace
    tenant_ns: str  # an ordinary tenant namespace
    unhooked_ns: str  # a namespace the webhook is not called for (webhook.excludeNamespaces)
    exempt_ns: str  # a namespace listed in isolation.exemptNamespaces
    admin: Api
    tenant: Api
    control_plane: Any
    kubeconfigs: Path  # a directory for token kubeconfigs and logs
    nodes: list[str] = field(default_factory=list)

    def token_kubeconfig(self, token: str, name: str) -> Path:
        return token_kubeconfig(self.control_plane, token, self.kubeconfigs / name)

    @property
    def fullname(self) -> str:
        return f"{self.release}-gpualloc"


def helm(kubeconfig: Path, home: Path, *args: str) -> str:
    binary = str(binaries.ensure(["helm"], progress=lambda _: None)["helm"])
    env = {**os.environ, **{f"HELM_{d.upper()}_HOME": str(home / d) for d in ("config", "cache", "data")}}
    result = subprocess.run(
        [binary, "--kubeconfig", str(kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


async def call(
    api: Api,
    method: str,
    path: str,
    *,
    body: Any = None,
    content_type: str = "application/json",
    query: list[tuple[str, str]] | None = None,
) -> Any:
    """One API call; the JSON answer. A refusal raises ``errors.KubeError`` with the API server's
    whole message (``gpualloc.kube.errors`` cuts messages short, and the policies' are long)."""
    response = await api.send(
        method,
        path,
        query=query or [],
        body=body,
        content_type=content_type,
        client_timeout=transport.REQUEST_TIMEOUT,
    )
    try:
        raw = await response.read()
    finally:
        response.release()
    answer = json.loads(raw) if raw else None
    if not 200 <= response.status < 300:
        status = answer if isinstance(answer, dict) else {}
        raise errors.KubeError(
            response.status, str(status.get("reason", "")), str(status.get("message", raw))
        )
    return answer


def token_kubeconfig(control_plane: Any, token: str, path: Path) -> Path:
    """A kubeconfig with the admin's cluster (server, CA) and a bearer-token user."""
    admin = yaml.safe_load(Path(control_plane.kubeconfig).read_text())
    server_entry = dict(admin["clusters"][0]["cluster"])
    server_entry["server"] = control_plane.server
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "local", "cluster": server_entry}],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
                "current-context": "sa",
            }
        )
    )
    path.chmod(0o600)
    return path


async def service_account_token(
    admin: Api, namespace: str, account: str, pod: dict[str, Any] | None = None
) -> str:
    """A TokenRequest token for the ServiceAccount; bound to ``pod`` (and so to its node) if given."""
    spec: dict[str, Any] = {"audiences": [], "expirationSeconds": 3600}
    if pod is not None:
        spec["boundObjectRef"] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
        }
    review = await call(
        admin,
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    token: str = review["status"]["token"]
    return token


async def start_run(setup: Setup, node_prefix: str, namespace_prefix: str) -> tuple[str, str, str]:
    """A fresh run tag, a GPU node ``<node_prefix>-<run>`` labelled with it (a controller started
    with ``run=run`` sees that node only) and a namespace ``<namespace_prefix>-<run>`` besides the
    tenant's; (run, node, namespace). The test deletes them."""
    run = uuid.uuid4().hex[:8]
    node, namespace = f"{node_prefix}-{run}", f"{namespace_prefix}-{run}"
    setup.control_plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    await support.create_gpu_node(setup.admin, node, labels={support.RUN_LABEL: run})
    return run, node, namespace


async def eventually(what: str, check: Callable[[], Awaitable[Any]], within: float = 30.0) -> Any:
    deadline = time.monotonic() + within
    while True:
        try:
            result = await check()
        except errors.KubeError:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}")
        await asyncio.sleep(0.2)


def pod(name: str, containers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A pod whose containers are ``containers``; ``init=[...]`` adds init containers,
    ``annotations``/``labels`` go to metadata, anything else to spec."""
    metadata: dict[str, Any] = {"name": name}
    for key in ("annotations", "labels"):
        if key in extra:
            metadata[key] = extra.pop(key)
    spec: dict[str, Any] = {"containers": containers, **extra}
    if "init" in spec:
        spec["initContainers"] = spec.pop("init")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def container(name: str, *env: dict[str, Any], image: str = CUDA_IMAGE, **more: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "image": image, **more}
    if env:
        out["env"] = list(env)
    return out


def value(name: str, text: str) -> dict[str, Any]:
    return {"name": name, "value": text}


def from_field(name: str, path: str = "metadata.name") -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def device_entries(container_: dict[str, Any], name: str = NV) -> list[dict[str, Any]]:
    return [e for e in container_.get("env") or [] if e["name"] == name]


async def create(api: Api, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    stored: dict[str, Any] = await call(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    return stored


async def refused(call: Awaitable[Any]) -> str:
    """``call`` must fail with 403 Forbidden; returns the API server's message."""
    with pytest.raises(errors.KubeError) as caught:
        await call
    assert caught.value.status == 403, caught.value
    return caught.value.message


def quotas_path(namespace: str) -> str:
    return f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{namespace}/gpuquotas"


def claims_path(namespace: str) -> str:
    return f"/apis/{constants.GROUP}/{constants.VERSION}/namespaces/{namespace}/gpuclaims"


async def purge_claim(admin: Api, namespace: str, name: str) -> None:
    """Delete a claim for good where no controller runs to release it: its finalizers go first."""
    path = f"{claims_path(namespace)}/{name}"
    for method, body in (("PATCH", {"metadata": {"finalizers": None}}), ("DELETE", None)):
        try:  # a Terminating claim is gone once its finalizers are
            await call(admin, method, path, body=body, content_type=MERGE if body else "application/json")
        except errors.KubeError as exc:
            if exc.status != 404:
                raise


def claim_body(name: str, priority: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"devices": {"count": 1}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


async def refusal(attempt: Awaitable[Any]) -> str:
    """The 403 message of ``attempt``; "" if it was accepted (for polling with ``eventually``)."""
    try:
        await attempt
    except errors.KubeError as exc:
        if exc.status == 403:
            return exc.message
        raise
    return ""


# ----------------------------------------------------------------------------- programs


class Program:
    """``gpualloc <args>`` as a child process, its output in a log file; stopped with SIGTERM."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GPUALLOC_", "KUBECONFIG", "POD_", "NODE_"))
        }
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gpualloc.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def alive(self) -> None:
        assert self.process.poll() is None, f"{self.name} exited {self.process.returncode}:\n{self.tail()}"

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


# ----------------------------------------------------------------------------- the webhook


@dataclass
class LocalWebhook:
    """The gpualloc webhook, serving TLS on 127.0.0.1 in this process (gate mode)."""

    url: str
    ca_pem: bytes
    stop: Callable[[], Awaitable[None]]


async def start_webhook(admin: Api) -> LocalWebhook:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:
        ca_file, cert_file, key_file = write_serving_pair(Path(tmp))
        ca_pem = ca_file.read_bytes()
        context.load_cert_chain(str(cert_file), str(key_file))
    metrics = metrics_.Metrics()
    reflector = watching.Reflector(admin, watching.CLAIMS)
    claims = cache.ClaimCache(reflector, cache.fetch_from(resources.CustomResources(admin)), metrics=metrics)
    webhook = server.Webhook(claims, admission.Options(pending="gate"), metrics)
    runner = await server.start(webhook, "127.0.0.1", 0, ssl_context=context, shutdown_timeout=2)
    task = asyncio.create_task(reflector.run())
    await asyncio.wait_for(reflector.synced.wait(), 30)

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop(webhook, runner)

    return LocalWebhook(f"https://127.0.0.1:{runner.addresses[0][1]}/mutate", ca_pem, stop)


# ----------------------------------------------------------------------------- in force and gone


async def wait_until_gone(admin: Api, namespace: str) -> None:
    """The API server drops deleted policies from its admission path a moment after the delete:
    wait for that, so that no later test's pod meets them (dry runs as the admin)."""
    pods = f"/api/v1/namespaces/{namespace}/pods"
    body = pod(
        "probe",
        [container("main", value(NV, "all"), from_field(CUDA))],
        labels={constants.LABEL_GATED: "true"},
    )

    async def gone() -> bool:
        stored = await call(admin, "POST", pods, body=body, query=[("dryRun", "All")])
        return bool(device_entries(stored["spec"]["containers"][0]) == [value(NV, "all")])

    await eventually("the policies to leave the API server's admission path", gone)


async def wait_until_in_force(s: Setup) -> None:
    """The API server loads policies, bindings and the webhook configuration from watches: wait
    (with dry runs) until each answers, and until the tenant's edit role has been aggregated."""
    pods = f"/api/v1/namespaces/{s.tenant_ns}/pods"
    dry = [("dryRun", "All")]

    async def voided() -> bool:
        body = pod("probe", [container("main", value(NV, "all"))])
        stored = await call(s.tenant, "POST", pods, body=body, query=dry)
        return bool(device_entries(stored["spec"]["containers"][0]) == [VOID])

    async def validated() -> bool:
        body = pod("probe", [container("main", from_field(CUDA))])
        try:
            await call(s.admin, "POST", pods, body=body, query=dry)
        except errors.KubeError as exc:
            return exc.status == 403 and NOT_A_GPU_POD in exc.message
        return False

    async def label_checked() -> bool:
        body = pod("probe", [container("main")], labels={constants.LABEL_GATED: "true"})
        try:
            await call(s.admin, "POST", pods, body=body, query=dry)
        except errors.KubeError as exc:
            return exc.status == 403 and "gpu.scheduling/gated" in exc.message
        return False

    async def webhook_called() -> bool:
        body = pod("probe", [container("main")], annotations={constants.ANNOTATION_CLAIM: "no-such-claim"})
        stored = await call(s.admin, "POST", pods, body=body, query=dry)
        return constants.SCHEDULING_GATE in {g["name"] for g in stored["spec"].get("schedulingGates") or []}

    async def agent_checked() -> bool:
        token = await service_account_token(s.admin, s.system, f"{s.fullname}-agent")
        agent = await kube_client.connect(str(s.token_kubeconfig(token, "agent-unbound.kubeconfig")))
        try:
            body = status_body(s.nodes[0])
            await call(agent, "POST", NODE_STATUSES, body=body, query=dry)
        except errors.KubeError as exc:
            return exc.status == 403 and "carries no node name" in exc.message
        finally:
            await agent.close()
        return False

    async def claims_aggregated() -> bool:
        await call(s.tenant, "GET", quotas_path(s.tenant_ns))
        body = claim_body("probe")
        await call(s.tenant, "POST", claims_path(s.tenant_ns), body=body, query=dry)
        return True

    async def claims_finalized() -> bool:
        stored = await call(s.admin, "POST", claims_path(s.tenant_ns), body=claim_body("probe"), query=dry)
        return constants.FINALIZER in stored["metadata"].get("finalizers", [])

    await eventually("edit to be aggregated with the chart's GpuClaim and GpuQuota rights", claims_aggregated)
    await eventually("the MutatingAdmissionPolicy to set void", voided)
    await eventually("the pod-devices ValidatingAdmissionPolicy", validated)
    await eventually("the gated-label ValidatingAdmissionPolicy", label_checked)
    await eventually("the API server to call the webhook", webhook_called)
    await eventually("the node-identity ValidatingAdmissionPolicy", agent_checked)
    await eventually("the claim-finalizer MutatingAdmissionPolicy", claims_finalized)


def status_body(node: str, name: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.NODE_STATUS_KIND,
        "metadata": {"name": name or node},
        "spec": {"nodeName": node},
    }
