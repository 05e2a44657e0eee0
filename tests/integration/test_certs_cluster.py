"""``gpualloc certs`` against the real API server: the Secret, the caBundle, idempotence.

The command runs as a separate process, the way a Helm hook Job runs it. The
MutatingWebhookConfiguration it patches has a unique name, a namespaceSelector
that matches no namespace (it must not affect other tests), and is deleted
afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from cryptography import x509

from gpualloc.kube import transport
from gpualloc.kube.client import Api

MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def inert_configuration(name: str) -> dict[str, Any]:
    def hook(n: str) -> dict[str, Any]:
        return {
            "name": f"{n}.gpu.scheduling",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Ignore",
            "clientConfig": {"url": "https://127.0.0.1:9/mutate"},
            "rules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
            ],
            "namespaceSelector": {"matchLabels": {"gpualloc.test/never": name}},
        }

    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [hook("one"), hook("two")],
    }


@pytest.fixture
async def configuration(api: Api) -> AsyncIterator[str]:
    name = f"gpualloc-certs-test-{uuid.uuid4().hex[:10]}"
    await transport.request(api, "POST", MWC_PATH, body=inert_configuration(name))
    try:
        yield name
    finally:
        await transport.request(api, "DELETE", f"{MWC_PATH}/{name}")


async def gpualloc_certs(kubeconfig: str, *argv: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpualloc.cli",
        "certs",
        "--kubeconfig",
        kubeconfig,
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_certs_creates_the_secret_and_patches_every_ca_bundle_idempotently(
    api: Api, kubeconfig: str, namespace: str, configuration: str
) -> None:
    args = (
        "--service",
        "hook",
        "--namespace",
        namespace,
        "--secret",
        "hook-tls",
        "--webhook-config",
        configuration,
    )
    code, out, err = await gpualloc_certs(kubeconfig, *args)
    assert code == 0, err
    assert f"Secret {namespace}/hook-tls: created" in out
    assert "caBundle written to 2 of 2 webhooks" in out

    secret = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/hook-tls")
    assert secret["type"] == "kubernetes.io/tls"
    assert set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt", "ca.key"}
    ca_pem = base64.b64decode(secret["data"]["ca.crt"])
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    dns = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    )
    assert f"hook.{namespace}.svc" in dns and f"hook.{namespace}.svc.cluster.local" in dns
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca_pem))

    config = await transport.request(api, "GET", f"{MWC_PATH}/{configuration}")
    assert [base64.b64decode(w["clientConfig"]["caBundle"]) for w in config["webhooks"]] == [ca_pem, ca_pem]

    # Again: nothing is due, nothing is written.
    code, out, err = await gpualloc_certs(kubeconfig, *args)
    assert code == 0, err
    assert "CA: kept" in out and "serving certificate: kept" in out
    assert f"Secret {namespace}/hook-tls: unchanged" in out and "caBundle unchanged" in out
    secret_again = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/hook-tls")
    config_again = await transport.request(api, "GET", f"{MWC_PATH}/{configuration}")
    assert secret_again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]
    assert config_again["metadata"]["resourceVersion"] == config["metadata"]["resourceVersion"]

    # A changed name re-issues the serving certificate under the same CA: the caBundle stays.
    code, out, err = await gpualloc_certs(kubeconfig, *args, "--dns-name", "extra.example")
    assert code == 0, err
    assert (
        "SANs differ" in out
        and f"Secret {namespace}/hook-tls: updated" in out
        and "caBundle unchanged" in out
    )
    renewed = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/secrets/hook-tls")
    assert renewed["data"]["ca.crt"] == secret["data"]["ca.crt"]
    assert renewed["data"]["tls.crt"] != secret["data"]["tls.crt"]


async def test_a_missing_webhook_configuration_is_reported_and_skipped(
    api: Api, kubeconfig: str, namespace: str
) -> None:
    code, out, err = await gpualloc_certs(
        kubeconfig,
        "--dns-name",
        "x",
        "--namespace",
        namespace,
        "--secret",
        "s",
        "--webhook-config",
        "absent-config",
    )
    assert code == 0, err
    assert "MutatingWebhookConfiguration absent-config: not found" in out


async def test_a_secret_of_another_type_is_a_clear_error(api: Api, kubeconfig: str, namespace: str) -> None:
    opaque = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "taken"},
        "type": "Opaque",
        "data": {},
    }
    await transport.request(api, "POST", f"/api/v1/namespaces/{namespace}/secrets", body=opaque)
    code, _, err = await gpualloc_certs(
        kubeconfig, "--dns-name", "x", "--namespace", namespace, "--secret", "taken"
    )
    assert code == 1
    assert "type 'Opaque'" in err and "kubernetes.io/tls" in err
