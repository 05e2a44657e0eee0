"""gpualloc's controller and webhook beside the local control plane, as the dev cluster runs them.

``start(plane, dra=...)`` makes the namespaces of the device and heartbeat Leases, a serving
certificate with ``gpualloc certs`` (for 127.0.0.1), starts ``gpualloc controller`` and
``gpualloc webhook`` as processes of the control plane (recorded in its state file, stopped with
it, and by ``gpualloc dev down`` after a SIGKILL), waits for the webhook's ``/readyz``, and
registers the MutatingWebhookConfiguration the chart installs, pointed at ``127.0.0.1``: the API
server runs on this machine and calls it there. With ``dra`` both run with ``--dra`` and the
DeviceClass ``gpu.gpualloc.dev`` (the chart's) is made: each Allocated replica gets its
ResourceClaim and each claim pod names it, so a real node's kubelet asks the agent (its DRA
plugin) which devices the container gets.

``webhook_configuration`` is the configuration's body, the demo's too.
"""

from __future__ import annotations

import base64
import contextlib
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gpualloc.api import constants, leases
from gpualloc.devcluster import cluster

NAMESPACE = constants.DEFAULT_NAMESPACE  # the controller's device Leases; the agents' lease namespace
WEBHOOK_CONFIG = "gpualloc-dev"
CONTROLLER = "controller"
WEBHOOK = "webhook"


def webhook_configuration(
    name: str, url: str, ca_bundle: bytes, *, exempt: str = NAMESPACE
) -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration, calling ``url``: pods that name a claim, in any
    namespace but kube-system and ``exempt`` (gpualloc's own)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": "pods.gpu.scheduling",
                "admissionReviewVersions": ["v1"],
                "clientConfig": {"url": url, "caBundle": base64.b64encode(ca_bundle).decode()},
                "rules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ],
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "timeoutSeconds": 5,
                "reinvocationPolicy": "IfNeeded",
                "namespaceSelector": {
                    "matchExpressions": [
                        {
                            "key": "kubernetes.io/metadata.name",
                            "operator": "NotIn",
                            "values": ["kube-system", exempt],
                        }
                    ]
                },
                "matchConditions": [
                    {
                        "name": "has-claim-annotation",
                        "expression": "has(object.metadata.annotations) && "
                        f"'{constants.ANNOTATION_CLAIM}' in object.metadata.annotations",
                    }
                ],
            }
        ],
    }


def device_class() -> dict[str, Any]:
    """The DeviceClass the chart installs (dra.createDeviceClass): every device of gpualloc's driver."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": constants.DRA_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{constants.DRA_DRIVER}"'}}]},
    }


def ensure_namespaces(plane: cluster.ControlPlane) -> None:
    """The namespace of the device Leases and that of the agents' heartbeat Leases."""
    for name in (NAMESPACE, leases.heartbeat_namespace(NAMESPACE)):
        try:
            plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        except cluster.RequestError as exc:
            if exc.status != 409:
                raise


def _create(plane: cluster.ControlPlane, path: str, body: dict[str, Any]) -> None:
    """POST ``body``; if it exists, PUT it over the old one (a state directory used before)."""
    try:
        plane.request("POST", path, body)
    except cluster.RequestError as exc:
        if exc.status != 409:
            raise
        old = plane.request("GET", f"{path}/{body['metadata']['name']}")
        body = {
            **body,
            "metadata": {**body["metadata"], "resourceVersion": old["metadata"]["resourceVersion"]},
        }
        plane.request("PUT", f"{path}/{body['metadata']['name']}", body)


def _ready(url: str) -> bool:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only whether it answers; the API server checks the CA
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def start(plane: cluster.ControlPlane, *, dra: bool, timeout: float = 60.0) -> int:
    """Start the controller and the webhook (``--dra`` with ``dra``) and register the webhook; the
    webhook's port. Raises ControlPlaneError if either exits or the webhook is not ready in time."""
    ensure_namespaces(plane)
    certs_dir = plane.state_dir / "webhook-certs"
    cli = [sys.executable, "-m", "gpualloc.cli"]
    certs = ["certs", "--out-dir", str(certs_dir), "--ip-address", "127.0.0.1", "--dns-name", "localhost"]
    made = subprocess.run([*cli, *certs], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        raise cluster.ControlPlaneError(f"gpualloc certs failed: {made.stderr.strip()[-2000:]}")
    port, *spare = cluster.free_ports(5)
    kubeconfig = str(plane.kubeconfig)
    flags = ["--dra"] if dra else []
    controller = [*cli, "controller", "--kubeconfig", kubeconfig, "--namespace", NAMESPACE]
    controller += ["--leader-elect=false", "--sweep-interval", "5", "--log-format", "text", *flags]
    controller += ["--metrics-port", str(spare[0]), "--health-port", str(spare[1])]
    webhook = [*cli, "webhook", "--kubeconfig", kubeconfig, "--host", "127.0.0.1", "--port", str(port)]
    webhook += ["--tls-cert-file", str(certs_dir / "tls.crt"), "--tls-key-file", str(certs_dir / "tls.key")]
    webhook += ["--log-format", "text", *flags]
    if dra:
        _create(plane, "/apis/resource.k8s.io/v1/deviceclasses", device_class())
    plane.start_process(CONTROLLER, controller)
    plane.start_process(WEBHOOK, webhook)
    deadline = time.monotonic() + timeout
    while not _ready(f"https://127.0.0.1:{port}/readyz"):
        plane.check_alive()
        if time.monotonic() > deadline:
            raise cluster.ControlPlaneError(f"the webhook was not ready in {timeout:.0f} s")
        time.sleep(0.2)
    url = f"https://127.0.0.1:{port}/mutate"
    path = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    _create(plane, path, webhook_configuration(WEBHOOK_CONFIG, url, (certs_dir / "ca.crt").read_bytes()))
    return port


def stop(plane: cluster.ControlPlane) -> None:
    """Unregister the webhook (a pod made after it stopped would be refused), then stop both."""
    with contextlib.suppress(cluster.ControlPlaneError, OSError):
        plane.request(
            "DELETE", f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{WEBHOOK_CONFIG}"
        )
    plane.stop_process(WEBHOOK)
    plane.stop_process(CONTROLLER)


def logs(plane: cluster.ControlPlane) -> dict[str, Path]:
    """name -> log file of the controller and the webhook."""
    return {name: plane.logs_dir / f"{name}.log" for name in (CONTROLLER, WEBHOOK)}
