"""Helpers for the controller's integration tests: fake GPU nodes, claims, a controller task, waiting.

GPU nodes are a plain core/v1 Node (no kubelet) plus a GpuNodeStatus whose
status is written through the status subresource with a fresh heartbeat and a
Ready condition, as the agent would. UUIDs follow the CRD's pattern.

Where kube-scheduler must place the pods (issue 41), ``KwokGpuNodes`` makes kwok-managed
Nodes with chosen allocatable instead; ``plain_pod`` and ``claim_job`` fill them, and
``watching_pods`` records every state a watch reports of a namespace's pods (``PodHistory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, NamedTuple, TypeVar

from controller import main as controller_main
from gpualloc.api import codecs, constants, models
from gpualloc.kube import errors, leases, resources, transport, watching
from gpualloc.kube.client import Api

T = TypeVar("T")

RUN_LABEL = "gpualloc.test/run"
PRODUCT = "NVIDIA H100 80GB HBM3"
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"

Obj = dict[str, Any]


def gpu_uuid(node: str, index: int) -> str:
    digest = hashlib.sha256(f"{node}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def _stamp(when: datetime.datetime | None = None) -> str:
    return (when or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def inventory(
    node: str, *, kind: str = "nvswitch", gpus: int = 8, unhealthy: Iterable[int] = ()
) -> dict[str, Any]:
    """The ``status`` of a GpuNodeStatus: an 8-GPU NVSwitch (all pairs NV18, 900 GB/s) or PCIe box.

    The PCIe box has two NUMA nodes of four GPUs; pairs behind one switch are
    PIX (0-1, 2-3, ...), same NUMA node NODE, across SYS.
    """
    bad = set(unhealthy)
    devices = [
        {
            "index": i,
            "minor": i,
            "uuid": gpu_uuid(node, i),
            "product": PRODUCT,
            "memoryMiB": 81559,
            "computeCapability": "9.0",
            "pciBusId": f"0000:{0x18 + 0x10 * i:02x}:00.0",
            "numaNode": i * 2 // gpus,
            "health": constants.UNHEALTHY if i in bad else constants.HEALTHY,
            "healthReason": "XID 79" if i in bad else "",
        }
        for i in range(gpus)
    ]
    links: list[dict[str, Any]] = []
    for a in range(gpus):
        for b in range(a + 1, gpus):
            if kind == "nvswitch":
                links.append({"a": a, "b": b, "type": "NV18", "nvlinks": 18, "bandwidthGBps": 900})
            elif a // 2 == b // 2:
                links.append({"a": a, "b": b, "type": "PIX", "bandwidthGBps": 64})
            elif devices[a]["numaNode"] == devices[b]["numaNode"]:
                links.append({"a": a, "b": b, "type": "NODE", "bandwidthGBps": 50})
            else:
                links.append({"a": a, "b": b, "type": "SYS", "bandwidthGBps": 40})
    now = _stamp()
    return {
        "source": "simulated",
        "driverVersion": "580.159.04",
        "cudaVersion": "13.0",
        "product": PRODUCT,
        "devices": devices,
        "links": links,
        "islands": [list(range(gpus))] if kind == "nvswitch" else [],
        "total": gpus,
        "healthy": gpus - len(bad),
        "allocated": 0,
        "lastHeartbeatTime": now,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Publishing",
                "message": "",
                "lastTransitionTime": now,
            }
        ],
    }


async def create_gpu_node(
    api: Api,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    kind: str = "nvswitch",
    gpus: int = 8,
    unhealthy: Iterable[int] = (),
) -> None:
    """A Node and its GpuNodeStatus (status written through the status subresource)."""
    node_labels = {constants.HOSTNAME_LABEL: name, **(labels or {})}
    await retry_unavailable(lambda: _create_gpu_node(api, name, node_labels, labels, kind, gpus, unhealthy))


async def retry_unavailable(call: Callable[[], Awaitable[T]], attempts: int = 20) -> T:
    """Retry 429/5xx: right after a CRD is Established its storage may still say "(re)initializing"."""
    for attempt in range(attempts):
        try:
            return await call()
        except errors.Unavailable:
            if attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def _create_gpu_node(
    api: Api,
    name: str,
    node_labels: dict[str, str],
    labels: dict[str, str] | None,
    kind: str,
    gpus: int,
    unhealthy: Iterable[int],
) -> None:
    with contextlib.suppress(errors.AlreadyExists):
        await create_ready_node(api, name, node_labels)
    crs = resources.CustomResources(api)
    with contextlib.suppress(errors.AlreadyExists):
        await crs.create_node_status(
            {
                "apiVersion": constants.API_VERSION,
                "kind": constants.NODE_STATUS_KIND,
                "metadata": {"name": name, "labels": dict(labels or {})},
                "spec": {"nodeName": name},
            }
        )
    await crs.patch_node_status_status(
        name, {"status": inventory(name, kind=kind, gpus=gpus, unhealthy=unhealthy)}
    )


async def create_ready_node(api: Api, name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A core/v1 Node as it is once its kubelet reported Ready.

    The API server's TaintNodesByCondition taints a new Node not-ready:NoSchedule until its kubelet
    reports Ready and the node lifecycle controller lifts the taint; there is no kubelet here, so
    the taint is lifted as that controller would (the allocator skips nodes tainted against a claim,
    as kube-scheduler does).
    """
    body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}
    await transport.request(api, "POST", "/api/v1/nodes", body=body)
    node: dict[str, Any] = await transport.request(
        api,
        "PATCH",
        f"/api/v1/nodes/{name}",
        body={"spec": {"taints": None}},
        content_type=transport.MERGE_PATCH,
    )
    return node


def simulated_inventory(
    name: str, profile: str, sharing: models.DeviceSharing | None = None
) -> models.NodeInventory:
    """What the simulated agent of node ``name`` publishes for ``profile`` (its UUIDs depend on the
    node's name only)."""
    from agent import inventory, simulated

    scanned = simulated.SimulatedSource(simulated.load_profile(profile), name).scan()
    return inventory.derive(scanned, sharing=sharing)


async def publish_simulated_node(
    api: Api, name: str, run: str, profile: str, sharing: models.DeviceSharing | None = None
) -> models.NodeInventory:
    """A ready Node and the GpuNodeStatus the simulated agent publishes for ``profile`` (with
    ``--sharing``, when given); its inventory (``simulated_inventory``)."""
    await create_ready_node(api, name, {constants.HOSTNAME_LABEL: name, RUN_LABEL: run})
    inv = simulated_inventory(name, profile, sharing)
    crs = resources.CustomResources(api)
    status = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.NODE_STATUS_KIND,
        "metadata": {"name": name},
        "spec": {"nodeName": name},
    }
    await retry_unavailable(lambda: crs.create_node_status(status))
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        **codecs.encode(inv),
        "lastHeartbeatTime": now,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Publishing", "lastTransitionTime": now}
        ],
    }
    await crs.patch_node_status_status(name, {"status": body})
    return inv


async def delete_gpu_node(api: Api, name: str) -> None:
    with contextlib.suppress(errors.NotFound):
        await resources.CustomResources(api).delete_node_status(name)
    with contextlib.suppress(errors.NotFound):
        await transport.request(api, "DELETE", f"/api/v1/nodes/{name}")


@contextlib.asynccontextmanager
async def fresh_gpu_node(api: Api, name: str, *, gpus: int = 8) -> AsyncIterator[tuple[str, str]]:
    """A GPU node labelled with a fresh run tag, deleted on exit; (node name, run tag). ``name`` is
    a template: ``{run}`` stands for the tag."""
    run = uuid.uuid4().hex[:8]
    node = name.format(run=run)
    await create_gpu_node(api, node, labels={RUN_LABEL: run}, gpus=gpus)
    try:
        yield node, run
    finally:
        await delete_gpu_node(api, node)


def claim_body(
    name: str,
    count: int,
    *,
    run: str,
    replicas: int = 1,
    priority: int = 0,
    strategy: str = "binpack",
    backoff_seconds: int = 1,
    max_retries: int = 0,
    match_labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A GpuClaim labelled with this test's ``run`` and restricted to the nodes labelled with it.

    Controllers started with ``controller_argv(..., run=run)`` see only these
    claims, so claims other tests leave behind cannot take this test's GPUs.
    """
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name, "labels": {RUN_LABEL: run}},
        "spec": {
            "devices": {"count": count},
            "selector": {"matchLabels": {RUN_LABEL: run, **(match_labels or {})}},
            "replicas": replicas,
            "priority": priority,
            "strategy": strategy,
            "retryPolicy": {"backoffSeconds": backoff_seconds, "maxRetries": max_retries},
        },
    }


async def wait_for(
    probe: Callable[[], Awaitable[T | None]],
    *,
    within: float = 30.0,
    interval: float = 0.2,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns something truthy; that value. AssertionError on timeout."""
    deadline = time.monotonic() + within
    last: T | None = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


async def get_claim(api: Api, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return await resources.CustomResources(api).get_claim(namespace, name)
    except errors.NotFound:
        return None


async def wait_phase(api: Api, namespace: str, name: str, phase: str, within: float = 30) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        got = await get_claim(api, namespace, name)
        return got if got and (got.get("status") or {}).get("phase") == phase else None

    return await wait_for(probe, within=within, what=f"{namespace}/{name} {phase}")


async def wait_condition(
    api: Api, namespace: str, name: str, type_: str, *, within: float = 30, what: str = "", **fields: str
) -> dict[str, Any]:
    """Wait until the claim's condition of type ``type_`` has ``fields`` (``status="True"``,
    ``reason="QuotaExceeded"``...); the claim."""
    assert fields, "a condition to wait for"

    async def probe() -> dict[str, Any] | None:
        got = await get_claim(api, namespace, name)
        found = condition(got, type_)
        return got if all(found.get(key) == value for key, value in fields.items()) else None

    return await wait_for(probe, within=within, what=what or f"{namespace}/{name} {type_} {fields}")


async def device_leases(api: Api, namespace: str, label_selector: str = "") -> list[dict[str, Any]]:
    selector = f"{constants.LABEL_MANAGED_BY}={constants.MANAGED_BY}"
    if label_selector:
        selector += "," + label_selector
    listing = await leases.list_leases(api, namespace, selector)
    return list(listing.get("items") or [])


def condition(claim: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    """The claim's condition of that type ({} when it has none)."""
    for cond in ((claim or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return {}


def status_uuids(claim: dict[str, Any]) -> list[str]:
    return [d["uuid"] for a in (claim.get("status") or {}).get("allocations") or [] for d in a["devices"]]


def controller_argv(namespace: str, *extra: str, run: str = "") -> list[str]:
    selector = ["--claim-selector", f"{RUN_LABEL}={run}"] if run else []
    return [
        *selector,
        "--namespace",
        namespace,
        "--leader-elect=false",
        "--health-port",
        "0",
        "--metrics-port",
        "0",
        "--workers",
        "4",
        "--sweep-interval",
        "2",
        *extra,
    ]


@contextlib.asynccontextmanager
async def running_controller(kubeconfig: str, argv: list[str]) -> AsyncIterator[asyncio.Task[int]]:
    """``controller.main.run`` as an asyncio task in this process; stopped and awaited on exit."""
    stop = asyncio.Event()
    task = asyncio.create_task(controller_main.run(["--kubeconfig", kubeconfig, *argv], stop=stop))
    try:
        yield task
    finally:
        stop.set()
        await _finish(task)


async def _finish(task: asyncio.Task[int]) -> None:
    if task.done():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            task.result()
        return
    try:
        await asyncio.wait_for(asyncio.shield(task), 15)
    except (TimeoutError, asyncio.CancelledError):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    except Exception:
        pass


# ------------------------------------------------- kwok GPU nodes that kube-scheduler places pods on


def run_taint(run: str) -> dict[str, str]:
    """The taint on a test's kwok GPU nodes: only pods that tolerate it (``run_toleration``) land
    there, so pods other tests left Pending cannot take their CPU, memory or pod slots."""
    return {"key": RUN_LABEL, "value": run, "effect": "NoSchedule"}


def run_toleration(run: str) -> dict[str, str]:
    return {"key": RUN_LABEL, "operator": "Equal", "value": run, "effect": "NoSchedule"}


class KwokGpuNodes:
    """GPU nodes of one test that kube-scheduler can place pods on: a kwok-managed Node (Ready, its
    condition taints lifted, ``run_taint`` on it) with the allocatable chosen, and a GpuNodeStatus
    written as the agent would (``create_gpu_node``). ``names`` lists those made, for the teardown."""

    def __init__(self, control_plane: Any, api: Api, run: str) -> None:
        self.control_plane = control_plane
        self.api = api
        self.run = run
        self.names: list[str] = []

    async def add(
        self, suffix: str, *, cpu: str = "64", memory: str = "512Gi", pods: str = "110", gpus: int = 8
    ) -> str:
        """Node ``fit-<run>-<suffix>`` with ``cpu``, ``memory`` and ``pods`` allocatable and ``gpus``
        GPUs; its name."""
        from gpualloc.devcluster import cluster

        name = f"fit-{self.run}-{suffix}"
        allocatable = {"cpu": cpu, "memory": memory, "pods": pods}
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {constants.HOSTNAME_LABEL: name, RUN_LABEL: self.run, "type": "kwok"},
                "annotations": {cluster.KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            # Tainted from its creation on: a stray pod never gets a moment to land on it.
            "spec": {"taints": [run_taint(self.run)]},
            "status": {"allocatable": allocatable, "capacity": allocatable},
        }
        self.names.append(name)
        await transport.request(self.api, "POST", "/api/v1/nodes", body=body)
        node = await asyncio.to_thread(
            self.control_plane.wait_node_ready, name, timeout=30, hint="is kwok running?"
        )
        assert node["status"]["allocatable"] == allocatable, node["status"]
        await create_gpu_node(self.api, name, labels={RUN_LABEL: self.run}, gpus=gpus)
        return name

    async def delete_all(self) -> None:
        for name in self.names:
            await delete_gpu_node(self.api, name)


def requests_of(cpu: str | None = None, memory: str | None = None) -> dict[str, str]:
    return {k: v for k, v in (("cpu", cpu), ("memory", memory)) if v is not None}


def plain_pod(name: str, node: str, *, run: str, cpu: str | None = None, memory: str | None = None) -> Obj:
    """A pod without a claim, for ``node`` only (nodeSelector, placed by kube-scheduler), asking
    ``cpu`` and ``memory``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {RUN_LABEL: run}},
        "spec": {
            "nodeSelector": {constants.HOSTNAME_LABEL: node},
            "tolerations": [run_toleration(run)],
            "containers": [
                {"name": "main", "image": PAUSE_IMAGE, "resources": {"requests": requests_of(cpu, memory)}}
            ],
        },
    }


def claim_job(
    name: str,
    claim: str,
    *,
    run: str,
    replicas: int = 1,
    cpu: str | None = None,
    memory: str | None = None,
) -> Obj:
    """An Indexed Job of ``replicas`` pods (one per replica of ``claim``, the completion index
    naming the replica), each asking ``cpu`` and ``memory``."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": replicas,
            "parallelism": replicas,
            "backoffLimit": 6,
            "template": {
                "metadata": {"annotations": {constants.ANNOTATION_CLAIM: claim}, "labels": {RUN_LABEL: run}},
                "spec": {
                    "restartPolicy": "Never",
                    "tolerations": [run_toleration(run)],
                    "containers": [
                        {
                            "name": "main",
                            "image": PAUSE_IMAGE,
                            "resources": {"requests": requests_of(cpu, memory)},
                        }
                    ],
                },
            },
        },
    }


async def create_pod(api: Api, namespace: str, body: Obj) -> Obj:
    created: Obj = await transport.request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
    return created


async def create_job(api: Api, namespace: str, body: Obj) -> Obj:
    created: Obj = await transport.request(
        api, "POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", body=body
    )
    return created


class PodSighting(NamedTuple):
    name: str
    phase: str  # "Deleted" for the watch's DELETED event
    node: str  # spec.nodeName: where kube-scheduler bound it ("" before)
    selected: str  # the node its nodeSelector names ("" without one)
    gated: bool  # held at gpualloc's scheduling gate
    annotations: dict[str, str]
    owners: tuple[str, ...]  # "Kind/name" of each ownerReference
    scheduled: dict[str, Any]  # the PodScheduled condition ({} without one)


class PodHistory:
    """Every state of a namespace's pods that a watch reported, in order. kwok moves a Job's pod
    from Running to Succeeded at once, so a poll would miss the Running a watch sees."""

    def __init__(self) -> None:
        self.sightings: list[PodSighting] = []

    def record(self, type_: str, pod: Obj) -> None:
        metadata, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        conditions: list[Obj] = status.get("conditions") or []
        scheduled = next((c for c in conditions if c.get("type") == "PodScheduled"), {})
        self.sightings.append(
            PodSighting(
                name=metadata["name"],
                phase="Deleted" if type_ == "DELETED" else str(status.get("phase") or ""),
                node=str(spec.get("nodeName") or ""),
                selected=str((spec.get("nodeSelector") or {}).get(constants.HOSTNAME_LABEL) or ""),
                gated=any(
                    g.get("name") == constants.SCHEDULING_GATE for g in spec.get("schedulingGates") or []
                ),
                annotations=dict(metadata.get("annotations") or {}),
                owners=tuple(
                    f"{o.get('kind')}/{o.get('name')}" for o in metadata.get("ownerReferences") or []
                ),
                scheduled=dict(scheduled),
            )
        )

    def running(self) -> list[PodSighting]:
        """The first sighting of each pod seen Running, in order."""
        first: dict[str, PodSighting] = {}
        for seen in self.sightings:
            if seen.phase == "Running":
                first.setdefault(seen.name, seen)
        return list(first.values())

    def unschedulable(self) -> list[PodSighting]:
        return [
            s
            for s in self.sightings
            if s.scheduled.get("status") == "False" and s.scheduled.get("reason") == "Unschedulable"
        ]


@contextlib.asynccontextmanager
async def watching_events(
    api: Api, kind: watching.ResourceKind, namespace: str, on_event: Callable[[str, Obj], None]
) -> AsyncIterator[None]:
    """A watch of ``kind`` in ``namespace`` that hands each event to ``on_event`` inside the block
    (from the first list on)."""
    reflector = watching.Reflector(api, kind, namespace=namespace, on_event=on_event)
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 30)
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def watching_pods(api: Api, namespace: str) -> AsyncIterator[PodHistory]:
    """A ``PodHistory`` of ``namespace`` filled by a watch that runs inside the block."""
    history = PodHistory()
    async with watching_events(api, watching.PODS, namespace, history.record):
        yield history


async def wait_running(history: PodHistory, count: int, *, within: float = 30.0) -> list[PodSighting]:
    """Wait until ``count`` pods were seen Running; their first Running sightings."""

    async def probe() -> list[PodSighting] | None:
        running = history.running()
        return running if len(running) >= count else None

    return await wait_for(probe, within=within, interval=0.1, what=f"{count} pod(s) Running")


def allocated_nodes(claim: Obj) -> dict[int, str]:
    """The claim's node of each replica."""
    return {a["replica"]: a["nodeName"] for a in (claim.get("status") or {}).get("allocations") or []}
