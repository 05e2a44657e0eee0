"""Latency and throughput of the admission webhook over TLS, against a do-nothing aiohttp TLS handler.

    make compiled && .venv/bin/python bench/webhook_latency.py [--rate 500] [--duration 10] [--concurrency 32]

What runs: three processes on 127.0.0.1. The orchestrator (this script) makes
a CA and a serving certificate, then for each target starts a server process
and a separate load-generator process:

* ``webhook``: the real app (``webhook.server.make_app``) with TLS 1.2+, the
  real decision, and claims served from an in-memory lookup
  (``cache.StaticStore``): no API server is involved, the claim is always a
  cache hit, as in the steady state. It runs as the image ships it: the
  admission path compiled with mypyc (``setup.py``; built into ``.compiled/``
  by ``make compiled``, and the server refuses to start if it is not);
* ``interpreted``: the same app run from the sources, as in development;
* ``minimal``: an aiohttp TLS handler that reads the body and answers a fixed
  "allowed" AdmissionReview: the ceiling of the stack (Python, asyncio,
  aiohttp, TLS) on this machine;
* ``parse``: the same plus decoding the review (``admission.read_review``, the
  webhook's own typed decoder) and nothing else;
* ``answer``: the minimal handler sending the webhook's real answer (the
  3.5 KB AdmissionReview with its base64 JSON Patch, computed once at start)
  instead of the bare "allowed": the ceiling of any webhook that has to send
  this patch;
* ``floor``: both, decoding the review and sending the real answer, with no
  decision in between: the ceiling of this webhook whatever its decision
  costs. ``parse``, ``answer`` and ``floor`` show what reading the request and
  writing the answer cost on this machine before any decision is made;
* ``bound``: decodes the review and builds the same answer from the decoded
  pod and claim (the patch, its base64, the warning) as leanly as it can be
  written, with none of the webhook's checks, metrics or bookkeeping, and only
  for pods shaped like this one (``bound_answer``; the server refuses to start
  unless its answer equals the webhook's, byte for byte): about what a Python
  decision that sends this answer spends at least, on this stack.

The request is a realistic AdmissionReview: a Job's pod with 3 containers and
1 init container (images, resources, probes, mounts, env), whose claim is
Allocated with 4 GPUs; the webhook answers it with a JSON Patch. It is shaped
as the API server sends it (checked against one captured from the local
kube-apiserver on 2026-11-25): compact JSON, the ServiceAccount volume and the
default tolerations its admission plugins add, and the ``managedFields`` entry
it records before calling webhooks, about half of the 11 KB.

The saturation ratios are paired: every round runs ``minimal`` and ``webhook``
one after the other, and the figure reported is the median of the rounds'
ratios, so a machine whose speed drifts between rounds (a shared host does)
moves both sides of each ratio alike.

Figures per target:
* open loop: requests sent on a fixed schedule (``--rate`` per second for
  ``--duration`` seconds, over keep-alive connections, as the API server
  does); latency is counted from each request's scheduled time, so a server
  that falls behind shows it (no coordinated omission);
* closed loop: ``--concurrency`` workers sending back to back for
  ``--duration`` seconds: the saturation throughput. It runs twice:
  - with the load generator kept awake (a task that always yields, so its
    event loop polls epoll without blocking): the saturation figure, judged
    against the target;
  - with the load generator free to sleep in epoll between answers, as
    before 2026-11-25, reported beside it.

  Why the first counts: over loopback the kernel delivers a response into
  the client's socket on the *server's* CPU, and when the client is asleep
  it wakes it there too (``sock_def_readable`` -> ``try_to_wake_up``, an
  inter-processor interrupt, dear in a VM). perf showed about 10 µs of each
  request's server CPU spent so for any server slower than the client, and
  none for the minimal handler, which keeps the client busy. A handler that
  only spins 30 µs cost 98 µs per request against minimal's 53 with the
  client sleeping, and 80 against 48 with it awake (+32: what it does).
  Across a network to the API server, as in a cluster, the webhook does not
  pay for its client's wake-ups; so the client is kept awake for every
  target, minimal included.
Server CPU (from /proc, user and system) is given per phase, and the load
average of the machine before and after, since the cores may be shared.

Writes bench/results/webhook_latency.json and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import functools
import json
import os
import platform
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "webhook_latency.json"
NAMESPACE = "ml-team"
CLAIM = "trainer"
UUIDS = [f"GPU-{i:08x}-1c2d-4e5f-8a9b-0c1d2e3f4a5b" for i in (0x5F1C0001, 0x5F1C0002, 0x5F1C0003, 0x5F1C0004)]

# minimal: read the body, answer a fixed "allowed" (the stack's ceiling); webhook: the real app as
# the image ships it (its admission path compiled with mypyc, from .compiled/: `make compiled`);
# interpreted: the same app run from the sources, as in development;
# bound: the same answer built with no checks; floor: parse + answer;
# parse: minimal plus decoding the review with the webhook's decoder;
# answer: minimal, answering with the webhook's real (patched) answer, made once.
# minimal and webhook come first: in every round, in either order, they run one after the other.
TARGETS = ("minimal", "webhook", "interpreted", "bound", "floor", "parse", "answer")
COMPILED_DIR = ROOT / ".compiled"  # made by `make compiled` (setup.py with GPUALLOC_MYPYC=1)
TARGET_P99_MS = 10.0
TARGET_RATIO = 0.6


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


# ------------------------------------------------------------------ servers


MINIMAL_ANSWER = json.dumps(
    {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": "x", "allowed": True},
    }
).encode()


def bound_answer(body: bytes, claims: Any) -> bytes:
    """The webhook's answer to the benchmark's review, built from the decoded pod with no checks at all.

    As lean as it can be written: no validation, no device-plugin, replica, pin
    or affinity check, no metrics, and only for pods shaped like the
    benchmark's (every container has an env list; a user may have set
    ``CUDA_VISIBLE_DEVICES``, never ``NVIDIA_VISIBLE_DEVICES``): only the work
    of building this answer.
    """
    from webhook import admission, objects

    request = admission.read_review(body).request
    assert request is not None and isinstance(request.object, objects.Pod)
    pod = request.object
    assert pod.metadata is not None and pod.metadata.annotations is not None and pod.spec is not None
    name = pod.metadata.annotations["gpu.scheduling/claim"]
    allocation = claims.get(request.namespace, name).status.allocations[0]
    value = objects.encode(",".join([d.uuid for d in allocation.devices])).decode()
    cuda = '{"name":"CUDA_VISIBLE_DEVICES","value":' + value + "}"
    nvidia = '{"name":"NVIDIA_VISIBLE_DEVICES","value":' + value + "}"
    node = objects.encode(allocation.node_name).decode()
    ops = ['{"op":"add","path":"/spec/nodeSelector","value":{"kubernetes.io/hostname":' + node + "}}"]
    replaced = []
    sources: tuple[str, ...] = ()  # the entries appended to the first plain container: later ones copy them
    for key, items in (("initContainers", pod.spec.init_containers), ("containers", pod.spec.containers)):
        for i, container in enumerate(items or ()):
            path = f"/spec/{key}/{i}/env"
            for j, entry in enumerate(container.env or ()):
                if entry.name == "CUDA_VISIBLE_DEVICES":
                    ops.append(f'{{"op":"replace","path":"{path}/{j}","value":{cuda}}}')
                    ops.append(f'{{"op":"add","path":"{path}/-","value":{nvidia}}}')
                    replaced.append(f"{container.name}/CUDA_VISIBLE_DEVICES")
                    break
            else:
                if sources:
                    ops.extend(f'{{"op":"copy","from":"{source}","path":"{path}/-"}}' for source in sources)
                    continue
                ops.append(f'{{"op":"add","path":"{path}/-","value":{cuda}}}')
                ops.append(f'{{"op":"add","path":"{path}/-","value":{nvidia}}}')
                n = len(container.env or ())
                sources = (f"{path}/{n}", f"{path}/{n + 1}")
    ops.append('{"op":"add","path":"/metadata/annotations/gpu.scheduling~1devices","value":' + value + "}")
    warnings = (
        [f"gpualloc replaced {', '.join(replaced)} with the devices of GpuClaim {request.namespace}/{name}"]
        if replaced
        else None
    )
    patch = f"[{','.join(ops)}]".encode()
    response = objects.Response(
        uid=request.uid, allowed=True, patch_type="JSONPatch", patch=patch, warnings=warnings
    )
    return objects.encode(objects.Answer(response=response))


def serve(target: str, cert: str, key: str) -> None:
    """Run one server on 127.0.0.1 (a free port, printed as ``PORT <n>``) until SIGTERM."""
    from aiohttp import web

    from gpualloc.runtime import serving
    from webhook import admission, cache, server

    async def main() -> None:
        context = server.make_ssl_context(cert, key)
        if target in ("webhook", "interpreted"):
            compiled = admission.__file__ is not None and admission.__file__.endswith(".so")
            if compiled != (target == "webhook"):
                raise SystemExit(f"{target}: webhook.admission is {admission.__file__}")
            claims = cache.ClaimCache(cache.StaticStore([raw_claim()]), _no_fetch)
            app = server.make_app(claims=claims, options=admission.Options())
        elif target == "bound":
            bound_claims = cache.ClaimCache(cache.StaticStore([raw_claim()]), _no_fetch)
            real = admission.dump_json(admission.decide(review_body(), bound_claims.get).answer)
            if bound_answer(review_body(), bound_claims) != real:
                raise SystemExit("bound_answer differs from the webhook's answer")

            async def bound(request: web.Request) -> web.Response:
                text = bound_answer(await request.read(), bound_claims)
                return web.Response(body=text, content_type="application/json", charset="utf-8")

            app = web.Application(client_max_size=server.MAX_BODY)
            app.router.add_post("/mutate", bound)
        else:
            parse = target in ("parse", "floor")
            answer = MINIMAL_ANSWER
            if target in ("answer", "floor"):
                claims = cache.ClaimCache(cache.StaticStore([raw_claim()]), _no_fetch)
                answer = admission.dump_json(admission.decide(review_body(), claims.get).answer)

            async def allowed(request: web.Request) -> web.Response:
                body = await request.read()
                if parse:
                    admission.read_review(body)
                return web.Response(body=answer, content_type="application/json")

            app = web.Application(client_max_size=server.MAX_BODY)
            app.router.add_post("/mutate", allowed)
        runner = await serving.start_app(app, "127.0.0.1", 0, ssl_context=context, shutdown_timeout=1)
        print(f"PORT {runner.addresses[0][1]}", flush=True)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    profile = os.environ.get("WEBHOOK_BENCH_PROFILE")
    if not profile:
        asyncio.run(main())
        return
    import cProfile

    cProfile.runctx(
        "asyncio.run(main())", globals(), {"main": main, "asyncio": asyncio}, profile + "." + target
    )


async def _no_fetch(namespace: str, name: str) -> dict[str, Any] | None:
    return None


# ------------------------------------------------------------------ load


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)

    def pct(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000, 3)

    return {
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "max_ms": round(ordered[-1] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


class Connection:
    """One keep-alive HTTP/1.1 connection over TLS, written by hand to keep the client cheap.

    A Python HTTP client costs about as much CPU per request as the server it
    measures; on two shared cores an aiohttp client saturates before a
    minimal server does, and the comparison would measure the client.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        return cls(reader, writer)

    async def post(self, request: bytes) -> tuple[int, bytes]:
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        at = lower.find(b"content-length:")
        length = int(lower[at + 15 : lower.index(b"\r\n", at)]) if at >= 0 else 0
        return status, await self.reader.readexactly(length)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


def http_request(port: int, body: bytes) -> bytes:
    head = (
        f"POST /mutate?timeout=5s HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nAccept: application/json, */*\r\n"
        f"User-Agent: kube-apiserver-admission\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def load(
    port: int, ca: str, server_pid: int, rate: float, duration: float, concurrency: int
) -> dict[str, Any]:
    body = review_body()
    request = http_request(port, body)
    context = ssl.create_default_context(cafile=ca)
    loop = asyncio.get_running_loop()
    idle: list[Connection] = []
    opened: list[Connection] = []

    async def checkout() -> Connection:
        if idle:
            return idle.pop()
        conn = await Connection.open(port, context)
        opened.append(conn)
        return conn

    async def one(errors: list[str]) -> None:
        conn = await checkout()
        try:
            status, answer = await conn.post(request)
        except Exception as exc:
            errors.append(repr(exc))
            return
        idle.append(conn)
        if status != 200:
            errors.append(f"HTTP {status}: {answer[:100]!r}")

    try:
        first = await checkout()
        status, answer = await first.post(request)
        idle.append(first)
        check = json.loads(answer)["response"] if status == 200 else {}

        # Warm up: connections, caches.
        warm_errors: list[str] = []
        for _ in range(10):
            await asyncio.gather(*(one(warm_errors) for _ in range(concurrency)))

        # Open loop at a fixed rate: latency from each request's scheduled time.
        n = int(rate * duration)
        latencies: list[float] = []
        errors: list[str] = []

        async def scheduled(at: float) -> None:
            await one(errors)
            latencies.append(time.perf_counter() - at)

        tasks = []
        cpu0, start = cpu_seconds(server_pid), time.perf_counter() + 0.05
        for i in range(n):
            at = start + i / rate
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(scheduled(at)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        open_loop = {
            "target_rps": rate,
            "requests": n,
            "achieved_rps": round(n / elapsed, 1),
            "errors": len(errors),
            "connections": len(opened),
            "server_cpu_pct": round(100 * (cpu_seconds(server_pid) - cpu0) / elapsed, 1),
            "server_cpu_us_per_request": round(1e6 * (cpu_seconds(server_pid) - cpu0) / n, 1),
            **summary(latencies),
        }

        # Closed loop: saturation; each worker keeps one connection busy. Twice: with the client
        # kept awake (the figure that counts, see the module docstring), and with it free to sleep.
        async def closed(awake: bool) -> dict[str, Any]:
            latencies: list[float] = []
            errors: list[str] = []
            deadline = time.perf_counter() + duration

            async def worker() -> None:
                while time.perf_counter() < deadline:
                    t = time.perf_counter()
                    await one(errors)
                    latencies.append(time.perf_counter() - t)

            async def keep_awake() -> None:
                # Always something ready to run: the event loop polls epoll without blocking.
                while time.perf_counter() < deadline:  # noqa: ASYNC110 - busy on purpose, never waits
                    await asyncio.sleep(0)

            (user0, system0), t0 = cpu_times(server_pid), time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)), *([keep_awake()] if awake else []))
            elapsed = time.perf_counter() - t0
            user1, system1 = cpu_times(server_pid)
            cpu, n = user1 - user0 + system1 - system0, max(1, len(latencies))
            return {
                "client": "awake" if awake else "sleeping",
                "concurrency": concurrency,
                "requests": len(latencies),
                "throughput_rps": round(len(latencies) / elapsed, 1),
                "errors": len(errors),
                "server_cpu_pct": round(100 * cpu / elapsed, 1),
                "server_cpu_us_per_request": round(1e6 * cpu / n, 1),
                "server_user_us_per_request": round(1e6 * (user1 - user0) / n, 1),
                "server_system_us_per_request": round(1e6 * (system1 - system0) / n, 1),
                **summary(latencies),
            }

        closed_loop = await closed(awake=True)
        closed_loop_sleeping = await closed(awake=False)
    finally:
        for conn in opened:
            await conn.close()
    return {
        "first_response": {"allowed": check.get("allowed"), "patched": "patch" in check},
        "open_loop": open_loop,
        "closed_loop": closed_loop,
        "closed_loop_sleeping_client": closed_loop_sleeping,
    }


# ------------------------------------------------------------------ orchestration


def make_certs(directory: Path) -> tuple[str, str, str]:
    """A CA and a serving certificate for 127.0.0.1, from the real ``gpualloc certs``."""
    command = [sys.executable, "-m", "gpualloc.cli", "certs", "--out-dir", str(directory)]
    subprocess.run([*command, "--ip-address", "127.0.0.1"], check=True, stdout=subprocess.DEVNULL)
    return str(directory / "ca.crt"), str(directory / "tls.crt"), str(directory / "tls.key")


# The server and the load generator each get a CPU of their own when there are two: without
# pinning, the scheduler moves them between the cores and the same target measured twice in a
# row differed by up to 50%; pinned, by about 10%. Where CPUs are hyperthreads, the load
# generator takes one on another core: siblings share a core's caches and execution units.
SERVER_CPU = 0


@functools.cache
def _siblings(cpu: int) -> frozenset[int]:
    """The CPUs sharing ``cpu``'s core (itself included), from sysfs; {cpu} when unknown."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        text = path.read_text().strip()
    except OSError:
        return frozenset({cpu})
    out: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return frozenset(out)


@functools.cache
def load_cpu() -> int:
    """The first usable CPU not on the server CPU's core (1 when all share it)."""
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    others = [cpu for cpu in usable if cpu not in _siblings(SERVER_CPU)]
    return others[0] if others else 1


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def pin_to(cpu: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` pinning the child to ``cpu``; None when the machine has fewer than two CPUs."""
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def run_target(target: str, certs: tuple[str, str, str], args: argparse.Namespace) -> dict[str, Any]:
    ca, cert, key = certs
    me = [sys.executable, str(Path(__file__).resolve())]
    loadavg = round(os.getloadavg()[0], 2)
    env = dict(os.environ)
    if target == "webhook":  # the compiled modules first on the path: what the image runs
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(COMPILED_DIR), env.get("PYTHONPATH")]))
    server = subprocess.Popen(
        [*me, "--serve", target, "--cert", cert, "--key", key],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=pin_to(SERVER_CPU),
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"{target} server did not start: {line!r}")
        port = int(line.split()[1])
        load_args = [
            *me,
            "--load",
            f"--port={port}",
            f"--ca={ca}",
            f"--server-pid={server.pid}",
            f"--rate={args.rate}",
            f"--duration={args.duration}",
            f"--concurrency={args.concurrency}",
        ]
        out = subprocess.run(
            load_args,
            check=True,
            capture_output=True,
            text=True,
            timeout=args.duration * 4 + 120,
            preexec_fn=pin_to(load_cpu()),
        )
        result: dict[str, Any] = json.loads(out.stdout)
        result["loadavg_1m_before"] = loadavg
        return result
    finally:
        server.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(10)
        if server.poll() is None:
            server.kill()
            server.wait()


def breakdown() -> dict[str, float]:
    """CPU time of each step of an admission, in process (best of several runs, in microseconds)."""
    import timeit

    from webhook import admission, cache

    body = review_body()
    review = admission.read_review(body)
    claims = cache.ClaimCache(cache.StaticStore([raw_claim()]), _no_fetch)
    options = admission.Options()
    prepared = admission.prepare(review)
    response = admission.decide_prepared(prepared, claims.get, options).answer
    steps = {
        "read_review": lambda: admission.read_review(body),
        "prepare": lambda: admission.prepare(review),
        "decide": lambda: admission.decide_prepared(prepared, claims.get, options),
        "dump_response": lambda: admission.dump_json(response),
    }
    out = {}
    for name, step in steps.items():
        out[name] = round(min(timeit.repeat(step, number=500, repeat=5)) / 500 * 1e6, 1)
    return out


def median_round(rounds: list[dict[str, Any]], loop: str, key: str) -> dict[str, Any]:
    """The round whose ``loop`` figure ``key`` is the median: its figures are reported together."""
    ordered = sorted(rounds, key=lambda r: r[loop][key])
    return dict(ordered[len(ordered) // 2][loop])


def orchestrate(args: argparse.Namespace) -> int:
    import aiohttp

    if not (COMPILED_DIR / ".built").exists():
        print(f"error: no compiled webhook in {COMPILED_DIR}: run `make compiled` first", file=sys.stderr)
        return 2
    before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {target: [] for target in TARGETS}
    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp))
        for i in range(args.rounds):
            # Alternate the order, so a load that changes during the run falls on both alike.
            for target in TARGETS if i % 2 == 0 else tuple(reversed(TARGETS)):
                print(f"round {i + 1}/{args.rounds}: {target} ...", file=sys.stderr, flush=True)
                rounds[target].append(run_target(target, certs, args))
    after = os.getloadavg()
    results = {
        target: {
            "first_response": runs[0]["first_response"],
            "open_loop": median_round(runs, "open_loop", "p99_ms"),
            "closed_loop": median_round(runs, "closed_loop", "throughput_rps"),
            "closed_loop_sleeping_client": median_round(
                runs, "closed_loop_sleeping_client", "throughput_rps"
            ),
            "rounds": [
                {
                    "loadavg_1m_before": r["loadavg_1m_before"],
                    "open_loop": r["open_loop"],
                    "closed_loop": r["closed_loop"],
                    "closed_loop_sleeping_client": r["closed_loop_sleeping_client"],
                }
                for r in runs
            ],
        }
        for target, runs in rounds.items()
    }
    webhook, minimal = results["webhook"], results["minimal"]

    def by_round(target: str, loop: str = "closed_loop") -> list[float]:
        """Each round's saturation of ``target`` over the minimal handler's in the same round."""
        ratios = []
        for ours, baseline in zip(results[target]["rounds"], minimal["rounds"], strict=True):
            rps = ours[loop]["throughput_rps"]
            ratios.append(round(rps / baseline[loop]["throughput_rps"], 3))
        return ratios

    def vs_minimal(target: str, loop: str = "closed_loop") -> float:
        return round(statistics.median(by_round(target, loop)), 3)

    ratio = vs_minimal("webhook")
    cpu_ratio = (
        minimal["closed_loop"]["server_cpu_us_per_request"]
        / webhook["closed_loop"]["server_cpu_us_per_request"]
    )
    p99 = webhook["open_loop"]["p99_ms"]

    report = {
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["bench/webhook_latency.py", *sys.argv[1:]]),
        "note": "claims served from an in-memory lookup (webhook.cache.StaticStore): no API server; "
        "server and load generator are separate processes on 127.0.0.1 over TLS with keep-alive; "
        "figures are from the median of the rounds (open loop: by p99; closed loop: by throughput); "
        "saturation ratios are the median of each round's ratio to the minimal handler in that round; "
        "closed_loop keeps the load generator awake (the saturation figure), "
        "closed_loop_sleeping_client lets it sleep in epoll, and then loopback charges each "
        "wake-up of it to the server's CPU",
        "host": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "server_cpu": SERVER_CPU,
            "load_cpu": load_cpu(),
            "server_cpu_siblings": sorted(_siblings(SERVER_CPU)),
            "loadavg_before": [round(x, 2) for x in before],
            "loadavg_after": [round(x, 2) for x in after],
            "python": platform.python_version(),
            "aiohttp": aiohttp.__version__,
            "openssl": ssl.OPENSSL_VERSION,
        },
        "request": {
            "bytes": len(review_body()),
            "containers": 3,
            "init_containers": 1,
            "devices": len(UUIDS),
            "answered_with_patch": webhook["first_response"]["patched"],
        },
        "settings": {
            "rate": args.rate,
            "duration_s": args.duration,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
        },
        "webhook": webhook,
        "interpreted": results["interpreted"],
        "minimal": minimal,
        "parse": results["parse"],
        "answer": results["answer"],
        "floor": results["floor"],
        "bound": results["bound"],
        "breakdown_cpu_us": breakdown(),
        "saturation_ratio": ratio,
        "saturation_ratio_by_round": by_round("webhook"),
        "saturation_ratio_interpreted": vs_minimal("interpreted"),
        "saturation_ratio_interpreted_by_round": by_round("interpreted"),
        "saturation_ratio_bound": vs_minimal("bound"),
        "saturation_ratio_bound_by_round": by_round("bound"),
        "saturation_ratio_parse_only": vs_minimal("parse"),
        "saturation_ratio_answer_only": vs_minimal("answer"),
        "saturation_ratio_floor": vs_minimal("floor"),
        "saturation_ratio_sleeping_client": vs_minimal("webhook", "closed_loop_sleeping_client"),
        "saturation_ratio_sleeping_client_by_round": by_round("webhook", "closed_loop_sleeping_client"),
        "saturation_ratio_bound_sleeping_client": vs_minimal("bound", "closed_loop_sleeping_client"),
        "server_cpu_per_request_ratio": round(cpu_ratio, 3),
        "targets": {
            "p99_ms_at_rate": {"limit": TARGET_P99_MS, "measured": p99, "met": p99 < TARGET_P99_MS},
            "saturation_ratio": {"limit": TARGET_RATIO, "measured": ratio, "met": ratio >= TARGET_RATIO},
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report, args)
    return 0


def print_summary(report: dict[str, Any], args: argparse.Namespace) -> None:
    host = report["host"]
    print(
        f"webhook latency ({report['request']['bytes']} B AdmissionReview, 3+1 containers; "
        f"{args.rounds} rounds of {args.duration:g} s per phase, median round shown; "
        f"{host['cpus']} CPUs, load average {host['loadavg_before'][0]} -> {host['loadavg_after'][0]})"
    )
    rate = f"open loop @ {int(args.rate)}/s"
    closed = f"closed loop, {args.concurrency} connections, client awake"
    sleeping = "client sleeping"
    print(f"{'':10} {rate:>35}   {closed:>54}   {sleeping:>24}")
    print(
        f"{'':10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>8}   "
        f"{'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'srv cpu':>8} {'us/req':>8} {'us sys':>8}   "
        f"{'req/s':>7} {'us/req':>7} {'us sys':>7}"
    )
    for name in TARGETS:
        o, c = report[name]["open_loop"], report[name]["closed_loop"]
        z = report[name]["closed_loop_sleeping_client"]
        print(
            f"{name:10} {o['p50_ms']:8.2f} {o['p99_ms']:8.2f} {o['max_ms']:8.2f} {o['errors']:8d}   "
            f"{c['throughput_rps']:8.0f} {c['p50_ms']:8.2f} {c['p99_ms']:8.2f} {c['server_cpu_pct']:7.0f}% "
            f"{c['server_cpu_us_per_request']:8.0f} {c['server_system_us_per_request']:8.1f}   "
            f"{z['throughput_rps']:7.0f} {z['server_cpu_us_per_request']:7.0f} "
            f"{z['server_system_us_per_request']:7.1f}"
        )
    steps = ", ".join(f"{k} {v:g}" for k, v in report["breakdown_cpu_us"].items())
    print(f"in-process CPU per admission (us): {steps}")
    targets = report["targets"]
    p99, ratio = targets["p99_ms_at_rate"], targets["saturation_ratio"]
    verdict = "met" if p99["met"] else "NOT met"
    print(f"p99 at {int(args.rate)}/s: {p99['measured']:.2f} ms (target < {p99['limit']:g} ms): {verdict}")
    verdict = "met" if ratio["met"] else "NOT met"
    rounds = ", ".join(f"{r:.0%}" for r in report["saturation_ratio_by_round"])
    print(
        f"saturation vs minimal: {ratio['measured']:.0%}, median of paired rounds ({rounds}) "
        f"(target >= {ratio['limit']:.0%}): {verdict}"
    )
    interpreted = ", ".join(f"{r:.0%}" for r in report["saturation_ratio_interpreted_by_round"])
    print(
        f"the same webhook interpreted, as in development (not compiled with mypyc): "
        f"{report['saturation_ratio_interpreted']:.0%} ({interpreted})"
    )
    bound = ", ".join(f"{r:.0%}" for r in report["saturation_ratio_bound_by_round"])
    print(f"the same answer built with no checks (bound): {report['saturation_ratio_bound']:.0%} ({bound})")
    asleep = ", ".join(f"{r:.0%}" for r in report["saturation_ratio_sleeping_client_by_round"])
    print(
        f"with the load generator free to sleep: {report['saturation_ratio_sleeping_client']:.0%} "
        f"({asleep}), "
        f"bound {report['saturation_ratio_bound_sleeping_client']:.0%}: loopback charges each wake-up of "
        "the client to the server, so a server slower than its client pays for them (module docstring)"
    )
    print(
        f"saturation vs minimal of decoding alone: {report['saturation_ratio_parse_only']:.0%}, "
        f"of sending the patched answer alone: {report['saturation_ratio_answer_only']:.0%}, "
        f"of both with no decision (the floor): {report['saturation_ratio_floor']:.0%}; "
        f"server CPU per request, minimal / webhook: {report['server_cpu_per_request_ratio']:.0%}"
    )
    print(f"wrote {args.out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each target, alternating")
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--serve", choices=TARGETS, help=argparse.SUPPRESS)
    parser.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    parser.add_argument("--ca", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.cert, args.key)
        return 0
    if args.load:
        result = asyncio.run(
            load(args.port, args.ca, args.server_pid, args.rate, args.duration, args.concurrency)
        )
        print(json.dumps(result))
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
