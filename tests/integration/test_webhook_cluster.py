"""The webhook registered with the real kube-apiserver: what gets stored, what gets refused.

The webhook runs in this process on 127.0.0.1 with a certificate (SAN IP
127.0.0.1) from ``certs.building``; a MutatingWebhookConfiguration points at it
by URL with that CA as caBundle. The configuration is named per test, scoped by
namespaceSelector to the test's namespace only, and deleted afterwards (it is
cluster-scoped). Pods are only created, never scheduled: they stay Pending.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import ssl
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gpualloc.api import constants
from gpualloc.kube import errors, resources, transport, watching
from gpualloc.kube.client import Api
from tests import admitting, reviews
from tests.integration.tls_support import write_serving_pair
from webhook import admission, cache, server
from webhook import metrics as metrics_

MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
UUIDS = ["GPU-11111111-2222-3333-4444-555555555555", "GPU-66666666-7777-8888-9999-000000000000"]
IMAGE = "registry.k8s.io/pause:3.10"


@dataclasses.dataclass
class RunningWebhook:
    webhook: server.Webhook
    runner: web.BaseRunner
    reflector: watching.Reflector
    metrics: metrics_.Metrics
    port: int
    stopped: bool = False

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await server.stop(self.webhook, self.runner)


def webhook_configuration(name: str, namespace: str, port: int, ca_pem: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "claim-pods.gpu.scheduling",
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "failurePolicy": "Fail",
                "reinvocationPolicy": "IfNeeded",
                "timeoutSeconds": 5,
                "clientConfig": {
                    "url": f"https://127.0.0.1:{port}/mutate",
                    "caBundle": base64.b64encode(ca_pem).decode(),
                },
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                        "scope": "Namespaced",
                    }
                ],
                "namespaceSelector": {
                    "matchExpressions": [
                        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": [namespace]},
                        {
                            "key": "kubernetes.io/metadata.name",
                            "operator": "NotIn",
                            "values": ["kube-system"],
                        },
                    ]
                },
                "matchConditions": [
                    {
                        "name": "has-claim-annotation",
                        "expression": "has(object.metadata.annotations) && "
                        "'gpu.scheduling/claim' in object.metadata.annotations",
                    }
                ],
            }
        ],
    }


def pod(name: str, claim: str | None, *, init: bool = True, **annotations: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    ann = dict(annotations)
    if claim is not None:
        ann[constants.ANNOTATION_CLAIM] = claim
    if ann:
        meta["annotations"] = ann
    spec: dict[str, Any] = {
        "containers": [
            {"name": "main", "image": IMAGE},
            {"name": "side", "image": IMAGE, "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]},
        ]
    }
    if init:
        spec["initContainers"] = [{"name": "prep", "image": IMAGE}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


async def create_pod(api: Api, namespace: str, body: dict[str, Any], *, dry_run: bool = False) -> Any:
    query = [("dryRun", "All")] if dry_run else []
    return await transport.request(
        api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=body, query=query
    )


async def create_claim(
    api: Api, namespace: str, name: str, *, phase: str, node: str = "gpu-node-7", message: str = ""
) -> None:
    crs = resources.CustomResources(api)
    body = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name},
        "spec": {"devices": {"count": 2}},
    }
    await crs.create_claim(namespace, body)
    status: dict[str, Any] = {"phase": phase, "message": message}
    if phase == constants.PHASE_ALLOCATED:
        status["allocations"] = [
            {
                "replica": 0,
                "nodeName": node,
                "devices": [{"index": 2 + i, "minor": 2 + i, "uuid": u} for i, u in enumerate(UUIDS)],
            }
        ]
    await crs.patch_claim_status(namespace, name, {"status": status})


async def denial(api: Api, namespace: str, body: dict[str, Any]) -> errors.KubeError:
    with pytest.raises(errors.KubeError) as caught:
        await create_pod(api, namespace, body)
    return caught.value


@pytest.fixture
def webhook_options() -> admission.Options:
    """The webhook's options; a test module overrides this fixture for gate mode."""
    return admission.Options()


@pytest.fixture
async def webhook(
    api: Api, namespace: str, webhook_options: admission.Options
) -> AsyncIterator[RunningWebhook]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # The context loads from files; write the pair to a private temp dir.
    with tempfile.TemporaryDirectory() as tmp:
        ca_file, cert_file, key_file = write_serving_pair(Path(tmp))
        ca_pem = ca_file.read_bytes()
        context.load_cert_chain(str(cert_file), str(key_file))

    metrics = metrics_.Metrics()
    reflector = watching.Reflector(api, watching.CLAIMS, transform=cache.kept_of_claim)  # as main does
    claims = cache.ClaimCache(reflector, cache.fetch_from(resources.CustomResources(api)), metrics=metrics)
    webhook = server.Webhook(claims, webhook_options, metrics)
    runner = await server.start(webhook, "127.0.0.1", 0, ssl_context=context, shutdown_timeout=2)
    task = asyncio.create_task(reflector.run())
    running = RunningWebhook(webhook, runner, reflector, metrics, runner.addresses[0][1])
    name = f"gpualloc-test-{uuid.uuid4().hex[:10]}"
    await transport.request(
        api, "POST", MWC_PATH, body=webhook_configuration(name, namespace, running.port, ca_pem)
    )
    try:
        await asyncio.wait_for(reflector.synced.wait(), 30)
        await _wait_until_registered(api, namespace)
        yield running
    finally:
        try:
            await transport.request(api, "DELETE", f"{MWC_PATH}/{name}")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await running.stop()


async def _wait_until_registered(api: Api, namespace: str) -> None:
    """The API server picks a new configuration up from a watch: wait until it calls us (dry run)."""
    probe = pod("probe", "probe-claim-that-does-not-exist", init=False)
    for _ in range(150):
        try:
            stored = await create_pod(api, namespace, probe, dry_run=True)
            gates = {g["name"] for g in stored["spec"].get("schedulingGates") or []}
            if constants.SCHEDULING_GATE in gates:  # gate mode admits it, gated
                return
        except errors.Forbidden as exc:
            if "does not exist" in exc.message:
                return
            raise
        await asyncio.sleep(0.1)
    raise AssertionError("the API server never called the webhook")


async def wait_cached(running: RunningWebhook, key: str, phase: str) -> None:
    for _ in range(100):
        raw = running.reflector.get(key)
        if raw is not None and (raw.get("status") or {}).get("phase") == phase:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never reached the cache as {phase}")


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


# ------------------------------------------------------------------ tests


async def test_allocated_claim_pod_is_stored_pinned_with_env_everywhere_and_the_annotation(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    await create_claim(api, namespace, "train", phase=constants.PHASE_ALLOCATED)
    await wait_cached(webhook, f"{namespace}/train", constants.PHASE_ALLOCATED)
    misses = webhook.metrics.registry.get_sample_value("gpualloc_webhook_claim_cache_misses_total")

    await create_pod(api, namespace, pod("worker", "train"))
    stored = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/worker")

    joined = ",".join(UUIDS)
    assert stored["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "gpu-node-7"}
    assert stored["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == joined
    everything = stored["spec"]["initContainers"] + stored["spec"]["containers"]
    assert [c["name"] for c in everything] == ["prep", "main", "side"]
    for container in everything:
        assert env(container)["CUDA_VISIBLE_DEVICES"] == joined, container["name"]
        assert env(container)["NVIDIA_VISIBLE_DEVICES"] == joined, container["name"]
    assert [e["name"] for e in everything[2]["env"]].count("CUDA_VISIBLE_DEVICES") == 1
    assert stored["status"]["phase"] == "Pending"
    after = webhook.metrics.registry.get_sample_value("gpualloc_webhook_claim_cache_misses_total")
    assert after == misses, "a cached claim costs no GET"


async def test_containers_after_the_first_get_the_entries_by_copy_and_the_api_server_applies_it(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    await create_claim(api, namespace, "train", phase=constants.PHASE_ALLOCATED)
    await wait_cached(webhook, f"{namespace}/train", constants.PHASE_ALLOCATED)
    body = pod("copies", "train")
    for i, container in enumerate([*body["spec"]["initContainers"], *body["spec"]["containers"]]):
        container["env"] = [{"name": f"OWN_{i}", "value": str(i)}]
    body["spec"]["containers"][1]["env"] = [{"name": "OWN_2", "value": "2"}]  # "side" sets none of ours here
    # The patch the webhook sends for it copies the first container's entries into the others.
    claim = webhook.reflector.get(f"{namespace}/train")
    assert claim is not None
    answer = admitting.admit(
        reviews.pod_review(body, namespace=namespace),
        cache.ClaimCache(cache.StaticStore([claim]), _absent).get,
    )
    ops = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert [op["op"] for op in ops].count("copy") == 4, ops

    await create_pod(api, namespace, body)
    stored = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/copies")

    joined = ",".join(UUIDS)
    for i, container in enumerate([*stored["spec"]["initContainers"], *stored["spec"]["containers"]]):
        assert [e["name"] for e in container["env"]] == [
            f"OWN_{i}",
            "CUDA_VISIBLE_DEVICES",
            "NVIDIA_VISIBLE_DEVICES",
        ]
        assert env(container)["CUDA_VISIBLE_DEVICES"] == joined, container["name"]
        assert env(container)["NVIDIA_VISIBLE_DEVICES"] == joined, container["name"]


async def _absent(namespace: str, name: str) -> dict[str, Any] | None:
    return None


async def test_pod_without_the_annotation_is_untouched_and_fails_open_while_claim_pods_fail_closed(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    plain = pod("plain", None)
    stored = await create_pod(api, namespace, plain)
    assert "nodeSelector" not in stored["spec"]
    assert "annotations" not in stored["metadata"]
    assert all("CUDA_VISIBLE_DEVICES" not in env(c) for c in stored["spec"]["containers"][:1])
    assert env(stored["spec"]["containers"][1]) == {"CUDA_VISIBLE_DEVICES": "0"}, (
        "the user's own value is kept"
    )
    assert not any("CUDA" in str(c.get("env")) for c in stored["spec"]["initContainers"])

    await create_claim(api, namespace, "train", phase=constants.PHASE_ALLOCATED)
    await webhook.stop()  # the webhook is down from here on

    await create_pod(api, namespace, pod("plain-2", None))  # still admitted: it never reaches the webhook
    refused = await denial(api, namespace, pod("claimer", "train"))
    assert "failed calling webhook" in refused.message
    with pytest.raises(errors.NotFound):
        await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/claimer")


async def test_claim_in_another_namespace_is_denied(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    refused = await denial(api, namespace, pod("sneaky", "default/train"))
    assert refused.status == 403
    assert "claims are looked up in the pod's own namespace" in refused.message


async def test_pending_claim_is_denied_with_its_status_message(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    await create_claim(api, namespace, "wait", phase=constants.PHASE_PENDING, message="0/4 nodes fit")
    refused = await denial(api, namespace, pod("early", "wait", init=False))
    assert refused.status == 403
    assert f"GpuClaim {namespace}/wait is Pending" in refused.message
    assert '"0/4 nodes fit"' in refused.message


async def test_pod_pinned_to_another_node_is_denied(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    await create_claim(api, namespace, "train", phase=constants.PHASE_ALLOCATED)
    body = pod("pinned", "train", init=False)
    body["spec"]["nodeSelector"] = {constants.HOSTNAME_LABEL: "elsewhere"}
    refused = await denial(api, namespace, body)
    assert "elsewhere" in refused.message and "gpu-node-7" in refused.message


async def test_pod_kept_off_the_claims_node_by_required_node_affinity_is_denied(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    await create_claim(api, namespace, "train", phase=constants.PHASE_ALLOCATED)
    body = pod("daemon-like", "train", init=False)
    body["spec"]["affinity"] = reviews.name_affinity("In", "elsewhere")
    refused = await denial(api, namespace, body)
    assert "required node affinity (metadata.name In [elsewhere])" in refused.message
    assert "gpu-node-7" in refused.message


TAKEN = f"gpu-3/{UUIDS[1]} is held by claim ml/other; delete and re-create this claim to get other GPUs"


async def set_devices_lost(api: Api, namespace: str, name: str, *, reason: str, message: str) -> None:
    """What the controller writes: the DevicesLost condition, through the status subresource."""
    conditions = [
        {"type": constants.CONDITION_ALLOCATED, "status": "True", "reason": "Allocated"},
        {"type": constants.CONDITION_DEVICES_LOST, "status": "True", "reason": reason, "message": message},
    ]
    crs = resources.CustomResources(api)
    await crs.patch_claim_status(namespace, name, {"status": {"conditions": conditions}})


async def refusal(api: Api, namespace: str, body: dict[str, Any]) -> tuple[int, str]:
    """Create a pod that is refused: the HTTP status and the API server's whole message (a
    KubeError's message is cut short)."""
    response = await transport.send(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    try:
        text = await response.read()
    finally:
        response.release()
    assert response.status >= 400, text[:300]
    message: str = json.loads(text)["message"]
    return response.status, message


async def wait_cached_reason(running: RunningWebhook, key: str, reason: str) -> None:
    for _ in range(100):
        raw = running.reflector.get(key) or {}
        reasons = {c.get("reason") for c in (raw.get("status") or {}).get("conditions") or []}
        if reason in reasons:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{key} never reached the cache with a condition of reason {reason}")


@pytest.mark.parametrize(
    "webhook_options", [admission.Options(), admission.Options(pending="gate")], ids=["deny", "gate"]
)
async def test_claim_that_lost_devices_to_another_claim_refuses_its_pods_saying_so(
    api: Api, namespace: str, webhook: RunningWebhook
) -> None:
    await create_claim(api, namespace, "trainer", phase=constants.PHASE_ALLOCATED)
    await set_devices_lost(api, namespace, "trainer", reason=constants.REASON_DEVICES_TAKEN, message=TAKEN)
    await wait_cached_reason(webhook, f"{namespace}/trainer", constants.REASON_DEVICES_TAKEN)

    status, message = await refusal(api, namespace, pod("late", "trainer"))
    assert status == 403
    expected = (
        f"claim {namespace}/trainer lost devices to another claim: {TAKEN}; delete and re-create the claim"
    )
    assert message == f'admission webhook "claim-pods.gpu.scheduling" denied the request: {expected}'
    with pytest.raises(errors.NotFound):
        await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/late")

    # Another reason for DevicesLost (an unhealthy GPU) admits the pod with its devices, as before.
    await set_devices_lost(api, namespace, "trainer", reason="DeviceUnhealthy", message="gpu-3: XID 79")
    await wait_cached_reason(webhook, f"{namespace}/trainer", "DeviceUnhealthy")
    stored = await create_pod(api, namespace, pod("later", "trainer"))
    assert stored["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == ",".join(UUIDS)
    assert stored["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "gpu-node-7"}
