"""The webhook benchmark's AdmissionReview has the shape the real API server sends.

bench/webhook_request.py builds the benchmark's request by hand; the figures mean something
only if that request is what a webhook gets in a cluster. Here a recording TLS
webhook is registered with the local kube-apiserver, the benchmark's pod is
created the way the Job controller would (its template, field manager
``kube-controller-manager``), and the review the API server sent is compared
with the benchmark's: compact JSON, the same request fields, and the same
fields in the pod, ``managedFields`` included (which the API server records
before it calls any webhook, and which is half the bytes).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gpualloc.kube import transport
from gpualloc.kube.client import Api
from gpualloc.runtime import serving
from tests.integration.test_webhook_cluster import MWC_PATH, webhook_configuration
from tests.integration.tls_support import write_serving_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import webhook_request as bench

ALLOWED = (
    b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","response":{"uid":"%s","allowed":true}}'
)


@pytest.fixture
async def recorded(api: Api, namespace: str) -> AsyncIterator[list[bytes]]:
    """Bodies of the reviews the API server sends for pods in ``namespace``; every pod is allowed."""
    bodies: list[bytes] = []

    async def record(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        bodies.append(body)
        uid = json.loads(body)["request"]["uid"]
        return web.Response(body=ALLOWED % uid.encode(), content_type="application/json")

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:
        ca_file, cert_file, key_file = write_serving_pair(Path(tmp))
        context.load_cert_chain(str(cert_file), str(key_file))
        ca_pem = ca_file.read_bytes()
    runner = await serving.start(
        record, "127.0.0.1", 0, ssl_context=context, shutdown_timeout=1, max_body=3 * 1024 * 1024
    )
    name = f"gpualloc-bench-{uuid.uuid4().hex[:10]}"
    config = webhook_configuration(name, namespace, runner.addresses[0][1], ca_pem)
    await transport.request(api, "POST", MWC_PATH, body=config)
    try:
        probe = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "probe", "annotations": {"gpu.scheduling/claim": "probe"}},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
        for _ in range(150):  # the API server picks the configuration up from a watch
            await transport.request(
                api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=probe, query=[("dryRun", "All")]
            )
            if bodies:
                break
            await asyncio.sleep(0.1)
        assert bodies, "the API server never called the recording webhook"
        bodies.clear()
        yield bodies
    finally:
        await transport.request(api, "DELETE", f"{MWC_PATH}/{name}")
        await runner.cleanup()


def paths(value: Any, prefix: str = "") -> set[str]:
    """Every field path in a JSON value, list items by position."""
    out = {prefix}
    if isinstance(value, dict):
        for key, item in value.items():
            out |= paths(item, f"{prefix}/{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out |= paths(item, f"{prefix}/{i}")
    return out


def _renamed(path: str, volume: str) -> str:
    return path.replace(volume, "kube-api-access-x7k2p")


async def test_the_benchmark_review_is_shaped_as_the_api_server_sends_it(
    api: Api, namespace: str, recorded: list[bytes]
) -> None:
    ours = json.loads(bench.review_body())
    pod = ours["request"]["object"]
    # What the Job controller sends: its template, without what the API server adds on create.
    sent = json.loads(json.dumps(pod))
    sent["metadata"] = {k: v for k, v in sent["metadata"].items() if k not in ("namespace", "managedFields")}
    sent["spec"] = bench.as_sent(sent["spec"])
    del sent["status"]
    await transport.request(
        api,
        "POST",
        f"/api/v1/namespaces/{namespace}/pods",
        body=sent,
        query=[("fieldManager", "kube-controller-manager"), ("dryRun", "All")],
    )
    (body,) = recorded
    theirs = json.loads(body)

    # Compact JSON, with the fields in the order the benchmark writes them.
    assert body.rstrip(b"\n") == json.dumps(theirs, separators=(",", ":"), ensure_ascii=False).encode()
    assert list(theirs) == list(ours) and list(theirs["request"]) == list(ours["request"])

    # The same pod fields, managedFields included; the ServiceAccount volume gets a random suffix.
    their_pod = theirs["request"]["object"]
    volume = next(v["name"] for v in their_pod["spec"]["volumes"] if v["name"].startswith("kube-api-access-"))
    their_paths = {_renamed(p, volume) for p in paths(their_pod)}
    assert sorted(their_paths ^ paths(pod)) == []
    # The sizes agree within a few percent (values differ: names, uids, the timestamp).
    assert abs(len(body) - len(bench.review_body())) < 0.05 * len(body)
