"""The webhook benchmark's request: an AdmissionReview as the API server sends it, and its claim.

An 11.8 KB AdmissionReview for a Job's pod with 3 containers and 1 init
container (images, resources, probes, mounts, env; one container sets
``CUDA_VISIBLE_DEVICES`` itself), whose claim is Allocated with 4 GPUs. It is
shaped as the API server sends it (checked against one captured from the local
kube-apiserver, ``tests/integration/test_bench_review.py``): compact JSON, the
ServiceAccount volume and the default tolerations its admission plugins add,
and the ``managedFields`` entry it records before calling webhooks, about half
of the bytes. Used by ``bench/webhook_vegeta.py``.
"""

from __future__ import annotations

import contextlib
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

NAMESPACE = "ml-team"
CLAIM = "trainer"
UUIDS = [f"GPU-{i:08x}-1c2d-4e5f-8a9b-0c1d2e3f4a5b" for i in (0x5F1C0001, 0x5F1C0002, 0x5F1C0003, 0x5F1C0004)]


# ------------------------------------------------------------------ the request


def container(name: str, image: str, *, gpu_env: bool = False, init: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": ["python", "-m", "train"],
        "args": ["--epochs=10", "--batch-size=256", "--data=/data/imagenet"],
        "ports": [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}],
        "env": [
            {
                "name": "POD_NAME",
                "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}},
            },
            {"name": "MASTER_ADDR", "value": "trainer-0.trainer"},
            {"name": "MASTER_PORT", "value": "29500"},
            {"name": "NCCL_DEBUG", "value": "WARN"},
        ],
        "resources": {"limits": {"cpu": "16", "memory": "128Gi"}, "requests": {"cpu": "8", "memory": "64Gi"}},
        "volumeMounts": [
            {"name": "data", "mountPath": "/data", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {
                "name": "kube-api-access-x7k2p",
                "readOnly": True,
                "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            },
        ],
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": 9090, "scheme": "HTTP"},
            "periodSeconds": 10,
            "timeoutSeconds": 1,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
        "imagePullPolicy": "IfNotPresent",
    }
    if gpu_env:
        c["env"].append({"name": "CUDA_VISIBLE_DEVICES", "value": "0"})
    if init:
        del c["readinessProbe"]  # the API server refuses probes on init containers
    return c


# How managedFields name the items of a list (server-side apply's merge keys), and the fields
# recorded whole (atomic): as the API server wrote them for this pod (checked by capturing one).
_MERGE_KEYS = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "ports": ("containerPort", "protocol"),
    "volumeMounts": ("mountPath",),
    "volumes": ("name",),
    "ownerReferences": ("uid",),
}
_ATOMIC = {"args", "command", "tolerations", "fieldRef", "ownerReferences"}


def fields_v1(value: dict[str, Any], *, dot: bool = False) -> dict[str, Any]:
    """The ``fieldsV1`` set of a managedFields entry that owns every field of ``value``."""
    out: dict[str, Any] = {".": {}} if dot else {}
    for key, item in value.items():
        if key in _MERGE_KEYS and isinstance(item, list):
            keyed: dict[str, Any] = {} if key == "containers" else {".": {}}  # required: no "." of its own
            for element in item:
                merge = json.dumps({k: element[k] for k in _MERGE_KEYS[key]}, separators=(",", ":"))
                keyed["k:" + merge] = {} if key in _ATOMIC else fields_v1(element, dot=True)
            out["f:" + key] = keyed
        elif isinstance(item, dict) and item and key not in _ATOMIC:
            out["f:" + key] = fields_v1(item, dot=True)
        else:
            out["f:" + key] = {}
    return dict(sorted(out.items()))  # Go writes a map's keys sorted


SERVICE_ACCOUNT_VOLUME = "kube-api-access-x7k2p"
DEFAULT_TOLERATIONS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")


def as_sent(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` as the Job controller sends it: before the API server's admission plugins add the
    ServiceAccount token volume and the default tolerations (what managedFields records)."""
    token = SERVICE_ACCOUNT_VOLUME
    sent = dict(spec, volumes=[v for v in spec["volumes"] if v["name"] != token])
    sent["tolerations"] = [t for t in spec["tolerations"] if t["key"] not in DEFAULT_TOLERATIONS]
    for key in ("initContainers", "containers"):
        sent[key] = [
            dict(c, volumeMounts=[m for m in c["volumeMounts"] if m["name"] != token]) for c in spec[key]
        ]
    return sent


def review_body() -> bytes:
    pod: dict[str, Any] = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "generateName": "trainer-",
            "namespace": NAMESPACE,
            "labels": {
                "batch.kubernetes.io/controller-uid": "8b0f2a4e-7c1d-4f6a-9e3b-2d5c8a1f0b7e",
                "batch.kubernetes.io/job-name": "trainer",
                "controller-uid": "8b0f2a4e-7c1d-4f6a-9e3b-2d5c8a1f0b7e",
                "job-name": "trainer",
                "app.kubernetes.io/name": "trainer",
            },
            "annotations": {"gpu.scheduling/claim": CLAIM, "prometheus.io/scrape": "true"},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "trainer",
                    "uid": "8b0f2a4e-7c1d-4f6a-9e3b-2d5c8a1f0b7e",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "volumes": [
                {"name": "data", "persistentVolumeClaim": {"claimName": "imagenet", "readOnly": True}},
                {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
                {  # added by the ServiceAccount admission plugin, as it writes it
                    "name": "kube-api-access-x7k2p",
                    "projected": {
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {
                                "configMap": {
                                    "name": "kube-root-ca.crt",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                }
                            },
                            {
                                "downwardAPI": {
                                    "items": [
                                        {
                                            "path": "namespace",
                                            "fieldRef": {
                                                "apiVersion": "v1",
                                                "fieldPath": "metadata.namespace",
                                            },
                                        }
                                    ]
                                }
                            },
                        ],
                        "defaultMode": 420,
                    },
                },
            ],
            "initContainers": [container("fetch-weights", "registry.example.com/tools/fetch:1.4", init=True)],
            "containers": [
                container("trainer", "nvcr.io/nvidia/pytorch:24.05-py3", gpu_env=True),
                container("sidecar-metrics", "registry.example.com/tools/dcgm-exporter:3.3"),
                container("log-shipper", "registry.example.com/tools/fluent-bit:3.0"),
            ],
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "serviceAccountName": "default",
            "serviceAccount": "default",
            "securityContext": {},
            "schedulerName": "default-scheduler",
            "tolerations": [  # the template's, then the two the DefaultTolerationSeconds plugin adds
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
            ],
            "priority": 0,
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {},
    }
    # The API server records who set which fields before it calls any admission plugin or webhook.
    metadata = {k: v for k, v in pod["metadata"].items() if k != "namespace"}
    owned = {"metadata": fields_v1(metadata), "spec": fields_v1(as_sent(pod["spec"]))}
    pod["metadata"]["managedFields"] = [
        {
            "manager": "kube-controller-manager",
            "operation": "Update",
            "apiVersion": "v1",
            "time": "2026-11-25T10:04:45Z",
            "fieldsType": "FieldsV1",
            "fieldsV1": {"f:" + key: value for key, value in owned.items()},
        }
    ]
    review = {
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": NAMESPACE,
            "operation": "CREATE",
            "userInfo": {
                "username": "system:serviceaccount:kube-system:job-controller",
                "uid": "1e3f6a2b-9c8d-4e7f-a6b5-c4d3e2f1a0b9",
                "groups": [
                    "system:serviceaccounts",
                    "system:serviceaccounts:kube-system",
                    "system:authenticated",
                ],
            },
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"},
        },
    }
    return json.dumps(review, separators=(",", ":"), sort_keys=False).encode()  # compact, as Go writes it


def raw_claim() -> dict[str, Any]:
    return {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "metadata": {
            "name": CLAIM,
            "namespace": NAMESPACE,
            "uid": "c1",
            "resourceVersion": "42",
            "generation": 1,
        },
        "spec": {"devices": {"count": 4}, "replicas": 1},
        "status": {
            "phase": "Allocated",
            "allocations": [
                {
                    "replica": 0,
                    "nodeName": "gpu-node-3",
                    "devices": [{"index": 4 + i, "minor": 4 + i, "uuid": u} for i, u in enumerate(UUIDS)],
                    "minBandwidthGBps": 900,
                }
            ],
            "message": "allocated 4 GPUs on gpu-node-3",
        },
    }


# ------------------------------------------------------------------ machine


def make_certs(directory: Path) -> tuple[str, str, str]:
    """A CA and a serving certificate for 127.0.0.1, from the real ``gpualloc certs``."""
    command = [sys.executable, "-m", "gpualloc.cli", "certs", "--out-dir", str(directory)]
    subprocess.run([*command, "--ip-address", "127.0.0.1"], check=True, stdout=subprocess.DEVNULL)
    return str(directory / "ca.crt"), str(directory / "tls.crt"), str(directory / "tls.key")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()
