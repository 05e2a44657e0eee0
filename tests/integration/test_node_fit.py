"""The node gpualloc picks must take the claim's pods (issue 41): proved against the real kube-scheduler.

kube-apiserver, kube-scheduler, kube-controller-manager (Jobs) and kwok run; the GPU nodes are
kwok-managed Nodes with the CPU, memory and pod slots each test chooses, plus a GpuNodeStatus
(``controller_support.KwokGpuNodes``). The controller runs in this process, the webhook too
(``test_webhook_cluster.webhook``). A pod counts as placed only when kube-scheduler bound it and
kwok reported it Running, as a watch saw it (kwok ends a Job's pod at once: Running, then
Succeeded).

Binpack prefers the node with the most of its GPUs taken, then the fewest free: each test gives the
node that cannot take the pods that preference, so a claim lands elsewhere only because the pods'
requests were counted. The last two tests count nothing up front (no ``spec.podResources``, the
pods made after the allocation): the claim lands on that node, and only kube-scheduler's verdict
(Unschedulable for ``spec.unschedulableGracePeriodSeconds``) moves it, or, for a bare pod, is
explained.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import pytest

from gpualloc.api import constants
from gpualloc.kube import resources, transport, watching
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.controller_support import KwokGpuNodes
from tests.integration.test_webhook_cluster import webhook, webhook_options  # noqa: F401 - fixtures
from webhook import admission

GRACE_S = 3  # spec.unschedulableGracePeriodSeconds of the claims that move
UNPLACEABLE = "Unplaceable"
GATE_MODE = pytest.mark.parametrize("webhook_options", [admission.Options(pending="gate")], ids=["gate"])


def fit_claim(
    name: str,
    count: int,
    *,
    run: str,
    replicas: int = 1,
    pod_resources: dict[str, str] | None = None,
    node: str | None = None,
) -> dict[str, Any]:
    """A binpack claim on this test's nodes, tolerating their taint; ``node`` pins it."""
    body = support.claim_body(name, count, run=run, replicas=replicas)
    body["spec"]["tolerations"] = [support.run_toleration(run)]
    if pod_resources is not None:
        body["spec"]["podResources"] = pod_resources
    if node is not None:
        body["spec"]["nodeName"] = node
    return body


def controller_argv(namespace: str, run: str) -> list[str]:
    # The claims' own toleration of the run's taint counts without a GpuQuota allowing it.
    return support.controller_argv(namespace, "--claim-tolerations", "Any", run=run)


async def create_claim(api: Api, namespace: str, body: dict[str, Any]) -> None:
    await resources.CustomResources(api).create_claim(namespace, body)


async def wait_pod_running(api: Api, namespace: str, name: str) -> dict[str, Any]:
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"

    async def probe() -> dict[str, Any] | None:
        pod: dict[str, Any] = await transport.request(api, "GET", path)
        return pod if (pod.get("status") or {}).get("phase") == "Running" else None

    return await support.wait_for(probe, within=30, what=f"pod {name} Running")


async def take_gpus_and_cpu(api: Api, namespace: str, node: str, *, run: str, gpus: int, cpu: str) -> None:
    """Another claim holds ``gpus`` of ``node``'s GPUs (binpack's preference then) and a plain pod
    running there requests ``cpu``."""
    await create_claim(api, namespace, fit_claim("other", gpus, run=run, node=node))
    other = await support.wait_phase(api, namespace, "other", constants.PHASE_ALLOCATED)
    assert support.allocated_nodes(other) == {0: node}
    await support.create_pod(api, namespace, support.plain_pod("hog", node, run=run, cpu=cpu))
    hog = await wait_pod_running(api, namespace, "hog")
    assert hog["spec"]["nodeName"] == node


@contextlib.asynccontextmanager
async def controller_and_pods(
    api: Api, kubeconfig: str, namespace: str, run: str
) -> AsyncIterator[support.PodHistory]:
    """The controller running for this test's nodes, and a watch of the namespace's pods."""
    async with (
        support.running_controller(kubeconfig, controller_argv(namespace, run)),
        support.watching_pods(api, namespace) as pods,
    ):
        yield pods


@contextlib.asynccontextmanager
async def a_busy_b_roomy(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> AsyncIterator[tuple[str, str, support.PodHistory]]:
    """Node A (4 CPU), binpack's choice with 4 of its GPUs held, its CPU all taken by a running pod
    (``take_gpus_and_cpu``), and node B (64 CPU), under ``controller_and_pods``; (A, B, the pods)."""
    run = kwok_gpu_nodes.run
    a = await kwok_gpu_nodes.add("a", cpu="4")
    b = await kwok_gpu_nodes.add("b", cpu="64")
    async with controller_and_pods(api, kubeconfig, namespace, run) as pods:
        await take_gpus_and_cpu(api, namespace, a, run=run, gpus=4, cpu="4")
        yield a, b, pods


def assert_ran_with_claims_devices(ran: list[support.PodSighting], claim: dict[str, Any]) -> None:
    """Each pod ran on its replica's node, with that replica's devices (the webhook's annotation)."""
    by_replica = {a["replica"]: a for a in claim["status"]["allocations"]}
    assert len(ran) == len(by_replica)
    for pod in ran:
        replica = int(pod.annotations.get(constants.ANNOTATION_JOB_COMPLETION_INDEX, "0"))
        allocation = by_replica[replica]
        assert pod.node == allocation["nodeName"], (pod, allocation)
        uuids = ",".join(d["uuid"] for d in allocation["devices"])
        assert pod.annotations[constants.ANNOTATION_DEVICES] == uuids


# ------------------------------------------------------------------ kube-scheduler and kwok nodes


async def test_kube_scheduler_places_pods_on_kwok_gpu_nodes_only_within_their_cpu_memory_and_pod_slots(
    api: Api, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """What the other tests stand on: these nodes take pods, and kube-scheduler refuses one that
    their allocatable cannot take (its own verdict, PodScheduled=False Unschedulable), for CPU,
    memory and pod slots alike."""
    run = kwok_gpu_nodes.run
    node = await kwok_gpu_nodes.add("a", cpu="2", memory="4Gi", pods="2")

    async def refused(name: str) -> str:
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"

        async def probe() -> dict[str, Any] | None:
            pod: dict[str, Any] = await transport.request(api, "GET", path)
            scheduled = support.condition(pod, "PodScheduled")
            return scheduled if scheduled.get("reason") == "Unschedulable" else None

        scheduled = await support.wait_for(probe, within=30, what=f"kube-scheduler to refuse pod {name}")
        assert scheduled["status"] == "False"
        return str(scheduled["message"])

    small = support.plain_pod("small", node, run=run, cpu="1500m", memory="3Gi")
    await support.create_pod(api, namespace, small)
    assert (await wait_pod_running(api, namespace, "small"))["spec"]["nodeName"] == node
    await support.create_pod(api, namespace, support.plain_pod("cpu", node, run=run, cpu="1"))
    assert "Insufficient cpu" in await refused("cpu")
    await support.create_pod(api, namespace, support.plain_pod("memory", node, run=run, memory="2Gi"))
    assert "Insufficient memory" in await refused("memory")
    await support.create_pod(api, namespace, support.plain_pod("tiny", node, run=run))
    assert (await wait_pod_running(api, namespace, "tiny"))["spec"]["nodeName"] == node  # 2 of 2 slots
    await support.create_pod(api, namespace, support.plain_pod("slot", node, run=run))
    assert "Too many pods" in await refused("slot")


# ------------------------------------------------------------------------- the case


@pytest.mark.usefixtures("webhook")
async def test_a_claim_whose_pods_need_cpu_is_allocated_on_the_node_with_free_cpu_and_its_job_pod_runs_there(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """Issue 41's case with ``spec.podResources``: node A has the GPUs of another claim (binpack's
    choice) and its CPU all taken; the 1-GPU claim asking 1 CPU a pod goes to B at once, and its
    Job's pod runs on B with the claim's GPU."""
    run = kwok_gpu_nodes.run
    async with a_busy_b_roomy(api, kubeconfig, namespace, kwok_gpu_nodes) as (_, b, history):
        await create_claim(api, namespace, fit_claim("train", 1, run=run, pod_resources={"cpu": "1"}))
        claim = await support.wait_phase(api, namespace, "train", constants.PHASE_ALLOCATED)
        assert support.allocated_nodes(claim) == {0: b}
        await support.create_job(api, namespace, support.claim_job("train", "train", run=run, cpu="1"))
        ran = await support.wait_running(history, 2)  # the hog, then the Job's pod
    assert_ran_with_claims_devices([p for p in ran if p.name != "hog"], claim)


@GATE_MODE
@pytest.mark.usefixtures("webhook")
async def test_in_gate_mode_a_gated_job_pods_own_cpu_request_keeps_its_claim_off_the_node_without_cpu(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """Issue 41's case without ``spec.podResources``: the Job comes first, its pod waits at the
    gate, and what that pod requests (1 CPU) keeps the claim off A; the pod runs on B."""
    run = kwok_gpu_nodes.run
    async with a_busy_b_roomy(api, kubeconfig, namespace, kwok_gpu_nodes) as (_, b, history):
        await support.create_job(api, namespace, support.claim_job("train", "train", run=run, cpu="1"))

        async def gated() -> list[support.PodSighting] | None:
            return [s for s in history.sightings if s.name != "hog"] or None

        (first, *_) = await support.wait_for(gated, within=30, what="the Job's pod")
        assert first.gated, first
        await create_claim(api, namespace, fit_claim("train", 1, run=run))
        claim = await support.wait_phase(api, namespace, "train", constants.PHASE_ALLOCATED)
        assert support.allocated_nodes(claim) == {0: b}
        ran = await support.wait_running(history, 2)
    assert_ran_with_claims_devices([p for p in ran if p.name != "hog"], claim)


# ------------------------------------------------------------------------------------ a gang


@pytest.mark.usefixtures("webhook")
async def test_a_gang_whose_replicas_fit_only_on_two_nodes_by_cpu_gets_one_node_each_and_both_pods_run(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """Two replicas of 1 GPU and 3 CPU; A (4 CPU, half its GPUs held: binpack's choice for both)
    and B (4 CPU) take one replica each, and each replica's Job pod runs on its node."""
    run = kwok_gpu_nodes.run
    a = await kwok_gpu_nodes.add("a", cpu="4")
    b = await kwok_gpu_nodes.add("b", cpu="4")
    async with controller_and_pods(api, kubeconfig, namespace, run) as history:
        await create_claim(api, namespace, fit_claim("other", 4, run=run, node=a))
        await support.wait_phase(api, namespace, "other", constants.PHASE_ALLOCATED)
        body = fit_claim("gang", 1, run=run, replicas=2, pod_resources={"cpu": "3"})
        await create_claim(api, namespace, body)
        claim = await support.wait_phase(api, namespace, "gang", constants.PHASE_ALLOCATED)
        assert sorted(support.allocated_nodes(claim).values()) == sorted([a, b])
        job = support.claim_job("gang", "gang", run=run, replicas=2, cpu="3")
        await support.create_job(api, namespace, job)
        ran = await support.wait_running(history, 2)
    assert_ran_with_claims_devices(ran, claim)


# ------------------------------------------------------------------- pod slots and memory


@pytest.mark.usefixtures("webhook")
async def test_nodes_without_a_free_pod_slot_or_the_memory_are_passed_over_for_one_that_takes_the_pod(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """A (2 GPUs: binpack's first choice) has both its pod slots taken and memory to spare; B
    (4 GPUs, its second) has slots but 1Gi of 4Gi memory free; a claim whose pod asks 2Gi goes to
    C (8 GPUs), and its Job's pod runs there."""
    run = kwok_gpu_nodes.run
    a = await kwok_gpu_nodes.add("a", pods="2", gpus=2)
    b = await kwok_gpu_nodes.add("b", memory="4Gi", gpus=4)
    c = await kwok_gpu_nodes.add("c", gpus=8)
    async with controller_and_pods(api, kubeconfig, namespace, run) as history:
        for name, node, memory in (("slot-0", a, None), ("slot-1", a, None), ("mem", b, "3Gi")):
            await support.create_pod(api, namespace, support.plain_pod(name, node, run=run, memory=memory))
        await support.wait_running(history, 3)
        await create_claim(api, namespace, fit_claim("train", 1, run=run, pod_resources={"memory": "2Gi"}))
        claim = await support.wait_phase(api, namespace, "train", constants.PHASE_ALLOCATED)
        assert support.allocated_nodes(claim) == {0: c}
        job = support.claim_job("train", "train", run=run, memory="2Gi")
        await support.create_job(api, namespace, job)
        ran = await support.wait_running(history, 4)
    assert_ran_with_claims_devices([p for p in ran if p.name.startswith("train-")], claim)


# ------------------------------------------------------------------------------ nothing fits


async def test_a_claim_whose_pod_cpu_fits_no_node_stays_pending_and_its_message_names_cpu_node_by_node(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """Both nodes have free GPUs, neither the 4 CPU the claim's pod asks: Pending, no Lease taken,
    and the Allocated condition (InsufficientDevices) says what each node lacks."""
    run = kwok_gpu_nodes.run
    a = await kwok_gpu_nodes.add("a", cpu="2")
    b = await kwok_gpu_nodes.add("b", cpu="2")
    await support.create_pod(api, namespace, support.plain_pod("hog", a, run=run, cpu="1"))
    await wait_pod_running(api, namespace, "hog")
    async with support.running_controller(kubeconfig, controller_argv(namespace, run)):
        await create_claim(api, namespace, fit_claim("train", 1, run=run, pod_resources={"cpu": "4"}))
        claim = await support.wait_condition(
            api, namespace, "train", "Allocated", status="False", reason="InsufficientDevices"
        )
        leases = await support.device_leases(api, namespace)
    assert claim["status"]["phase"] == constants.PHASE_PENDING
    assert not claim["status"].get("allocations")
    assert leases == []
    message = support.condition(claim, "Allocated")["message"]
    assert f"{a}: 4 CPU asked, 1 of 2 free" in message, message
    assert f"{b}: 4 CPU asked, 2 of 2 free" in message, message


# ------------------------------------------- pods kube-scheduler refuses on their claim's node


class ClaimSighting(NamedTuple):
    phase: str
    nodes: dict[int, str]
    conditions: tuple[dict[str, Any], ...]


class ClaimHistory:
    """Every state of one claim that a watch reported, in order (a move passes through Pending)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sightings: list[ClaimSighting] = []

    def record(self, type_: str, claim: dict[str, Any]) -> None:
        if claim["metadata"]["name"] != self.name or type_ == watching.DELETED:
            return
        status = claim.get("status") or {}
        self.sightings.append(
            ClaimSighting(
                phase=str(status.get("phase") or ""),
                nodes=support.allocated_nodes(claim),
                conditions=tuple(status.get("conditions") or ()),
            )
        )

    def unplaceable(self) -> list[dict[str, Any]]:
        """The conditions seen of type or reason Unplaceable, status True for the type."""
        return [
            c
            for s in self.sightings
            for c in s.conditions
            if c.get("reason") == UNPLACEABLE or (c.get("type") == UNPLACEABLE and c.get("status") == "True")
        ]


@contextlib.asynccontextmanager
async def watching_claim(api: Api, namespace: str, name: str) -> AsyncIterator[ClaimHistory]:
    history = ClaimHistory(name)
    async with support.watching_events(api, watching.CLAIMS, namespace, history.record):
        yield history


async def create_moving_claim(api: Api, namespace: str, name: str, node: str, *, run: str) -> dict[str, Any]:
    """A 1-GPU claim that moves after ``GRACE_S``, allocated on ``node`` (binpack's choice: nothing
    says CPU yet); the claim as allocated."""
    body = fit_claim(name, 1, run=run)
    body["spec"]["unschedulableGracePeriodSeconds"] = GRACE_S
    await create_claim(api, namespace, body)
    claim = await support.wait_phase(api, namespace, name, constants.PHASE_ALLOCATED)
    assert support.allocated_nodes(claim) == {0: node}
    return claim


def bare_claim_pod(name: str, claim: str, *, run: str, cpu: str) -> dict[str, Any]:
    """A pod of ``claim`` that no workload controller owns; the webhook gives it the claim's node."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {constants.ANNOTATION_CLAIM: claim}},
        "spec": {
            "tolerations": [support.run_toleration(run)],
            "containers": [
                {"name": "main", "image": support.PAUSE_IMAGE, "resources": {"requests": {"cpu": cpu}}}
            ],
        },
    }


async def events_of(api: Api, namespace: str, kind: str, name: str, reason: str) -> list[dict[str, Any]]:
    listing = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events")
    return [
        e
        for e in listing.get("items") or []
        if e["involvedObject"].get("kind") == kind
        and e["involvedObject"].get("name") == name
        and e.get("reason") == reason
    ]


async def refused_on(pods: support.PodHistory, node: str) -> support.PodSighting:
    """Wait until kube-scheduler reports a pod meant for ``node`` Unschedulable; that sighting."""

    async def probe() -> support.PodSighting | None:
        return next((s for s in pods.unschedulable() if s.selected == node), None)

    return await support.wait_for(probe, within=30, what=f"a pod refused on {node}")


@pytest.mark.usefixtures("webhook")
async def test_a_claim_whose_job_pod_cannot_be_placed_on_its_node_moves_where_the_pod_fits_and_it_runs_there(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """Issue 41's case, as a new user meets it (no podResources, the Job after its claim): the
    claim lands on A, whose CPU is all taken; kube-scheduler refuses the Job's pod there; after the
    grace period the claim goes back to Pending (Unplaceable, with the scheduler's words), its pod is
    deleted, the claim is allocated on B, and the Job's new pod runs on B with the claim's GPU."""
    run = kwok_gpu_nodes.run
    async with (
        a_busy_b_roomy(api, kubeconfig, namespace, kwok_gpu_nodes) as (a, b, pods),
        watching_claim(api, namespace, "train") as claims,
    ):
        await create_moving_claim(api, namespace, "train", a, run=run)
        await support.create_job(api, namespace, support.claim_job("train", "train", run=run, cpu="1"))
        refused = await refused_on(pods, a)
        assert "Insufficient cpu" in refused.scheduled["message"]

        async def moved() -> dict[str, Any] | None:
            got = await support.get_claim(api, namespace, "train")
            return got if got and support.allocated_nodes(got) == {0: b} else None

        claim = await support.wait_for(moved, within=45, what="the claim allocated on B")
        ran = await support.wait_running(pods, 2, within=45)  # the hog, then the Job's new pod
        events = await events_of(api, namespace, constants.CLAIM_KIND, "train", UNPLACEABLE)
        leases = await support.device_leases(api, namespace)

    (job_pod,) = [p for p in ran if p.name != "hog"]
    assert_ran_with_claims_devices([job_pod], claim)
    assert job_pod.name != refused.name  # the Job made a new pod
    assert any(s.name == refused.name and s.phase == "Deleted" for s in pods.sightings)
    assert job_pod.owners == ("Job/train",)
    # On the way: back to Pending without devices, and the reason in a condition and an Event.
    after_a = claims.sightings[next(i for i, s in enumerate(claims.sightings) if s.nodes == {0: a}) :]
    assert any(s.phase == constants.PHASE_PENDING and not s.nodes for s in after_a), claims.sightings
    moved_off = [c for c in claims.unplaceable() if c["type"] == "Allocated"]
    assert moved_off and "Insufficient cpu" in moved_off[0]["message"], claims.unplaceable()
    assert events and "Insufficient cpu" in events[0]["message"], events
    # A's GPU was given back: the claim's Leases are B's devices only.
    held = {lease["spec"]["holderIdentity"] for lease in leases}
    mine = [lease for lease in leases if lease["spec"]["holderIdentity"] == claim["metadata"]["uid"]]
    assert len(held) == 2  # "other" on A, "train" on B
    assert {lease["metadata"]["labels"][constants.LABEL_NODE] for lease in mine} == {b}


@pytest.mark.usefixtures("webhook")
async def test_a_bare_pod_that_cannot_be_placed_keeps_its_claim_on_the_node_and_claim_and_pod_say_why(
    api: Api, kubeconfig: str, namespace: str, kwok_gpu_nodes: KwokGpuNodes
) -> None:
    """The same claim and node A, but its pod has no owner to recreate it elsewhere: past the grace
    period (twice over) the claim is still Allocated on A with the same GPU, the pod is not deleted,
    and a condition of the claim and an Event on the pod, both Unplaceable, say why."""
    run = kwok_gpu_nodes.run
    async with (
        a_busy_b_roomy(api, kubeconfig, namespace, kwok_gpu_nodes) as (a, _, pods),
        watching_claim(api, namespace, "train") as claims,
    ):
        first = await create_moving_claim(api, namespace, "train", a, run=run)
        await support.create_pod(api, namespace, bare_claim_pod("solo", "train", run=run, cpu="1"))
        await refused_on(pods, a)

        async def explained() -> list[dict[str, Any]] | None:
            return claims.unplaceable() or None

        (unplaceable, *_) = await support.wait_for(explained, within=30, what="an Unplaceable condition")

        async def pod_event() -> list[dict[str, Any]] | None:
            return await events_of(api, namespace, "Pod", "solo", UNPLACEABLE) or None

        (event, *_) = await support.wait_for(pod_event, within=30, what="an Unplaceable Event on the pod")
        await asyncio.sleep(2 * GRACE_S)  # past the grace period twice over: still no move
        claim = await support.get_claim(api, namespace, "train")
        solo = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/pods/solo")

    assert claim is not None
    assert claim["status"]["phase"] == constants.PHASE_ALLOCATED
    assert support.status_uuids(claim) == support.status_uuids(first)
    assert support.allocated_nodes(claim) == {0: a}
    since = claims.sightings[next(i for i, s in enumerate(claims.sightings) if s.nodes) :]
    assert all(s.phase == constants.PHASE_ALLOCATED and s.nodes == {0: a} for s in since), since
    assert solo["metadata"].get("deletionTimestamp") is None
    assert not any(s.name == "solo" and s.phase == "Deleted" for s in pods.sightings)
    assert "solo" in unplaceable["message"] and a in unplaceable["message"], unplaceable
    assert "Insufficient cpu" in event["message"], event
