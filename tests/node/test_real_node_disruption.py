"""Disruptions of real pods on the real node, the whole stack as `gpualloc dev up --real-node` runs
it (issue 42, part 3): preemption evicts a real pod, its PodDisruptionBudget respected, and `kubectl
drain` evicts claim pods from the node.

One scenario for the module. Preemption: claim ``low`` (8 GPUs, priority 1) holds the whole node
and its pod runs, a PDB (``minAvailable: 1``) guarding it; claim ``high`` (4 GPUs, priority 5)
fits nowhere and preempts ``low``, but the PDB holds the eviction back: the pod keeps running and
``high`` waits; once the PDB is deleted the pod is evicted (the kubelet stops its container),
``high`` is Allocated on ``low``'s GPUs only once that pod's container has stopped, and its own pod
sees exactly its 4 GPUs. Drain: ``kubectl drain`` of the node evicts ``high``'s pod (the node
cordoned), ``high`` keeps its GPUs (release OnDelete) and its ResourceClaim is no longer reserved
for the pod; a claim made while the node is cordoned waits; after ``kubectl uncordon`` it is
Allocated and a new pod of ``high`` runs again with the same GPUs.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpualloc import cdi
from gpualloc.api import constants
from gpualloc.devcluster import node
from tests.conftest import progress_printer, wait_until
from tests.node.stack_support import LIST_DEVICES, Seen, Stack, devices, running_stack

NAMESPACE = "disruption"
KUBECTL = "/usr/bin/kubectl"
HELD_BACK_S = 6.0  # how long the PDB is watched holding the eviction back


@dataclasses.dataclass(kw_only=True)
class Run:
    low: dict[str, Any] = dataclasses.field(default_factory=dict)
    low_pod_while_held: str = ""  # its phase while the PDB held the eviction back
    high_while_held: str = ""
    low_while_held: dict[str, Any] = dataclasses.field(default_factory=dict)
    high: dict[str, Any] = dataclasses.field(default_factory=dict)  # Allocated after the PDB went
    low_after: dict[str, Any] = dataclasses.field(default_factory=dict)
    low_pod_gone: bool = False
    low_pod_at_allocation: dict[str, Any] | None = None  # the evicted pod when high was Allocated
    low_pod_gone_after_allocation_s: float = 0.0
    high_seen: Seen | None = None
    drain: subprocess.CompletedProcess[str] | None = None
    high_pod_gone_after_drain: bool = False
    node_unschedulable: bool = False
    high_after_drain: dict[str, Any] = dataclasses.field(default_factory=dict)
    reserved_after_drain: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    late_while_cordoned: str = ""
    late_after_uncordon: str = ""
    high_seen_after_uncordon: Seen | None = None
    left_by_teardown: list[str] = dataclasses.field(default_factory=list)


def _kubectl(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(stack.plane.kubeconfig)}
    return subprocess.run([KUBECTL, *args], capture_output=True, text=True, timeout=120, env=env, check=False)


def _pod_phase(stack: Stack, name: str) -> str:
    pod = stack.get_or_none(f"{stack.pods}/{name}")
    return "" if pod is None else str((pod.get("status") or {}).get("phase", ""))


def _preemption(stack: Stack, run: Run) -> None:
    pdbs = f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets"
    stack.create_claim("low", 8, priority=1)
    run.low = stack.wait_allocated("low")
    stack.create_pod("low-worker", "sleep 3600", claim="low")
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "keep-low"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "low-worker"}}},
    }
    stack.plane.request("POST", pdbs, pdb)

    def budget_computed() -> bool:  # kube-controller-manager's disruption controller
        status = stack.get(f"{pdbs}/keep-low").get("status") or {}
        return status.get("currentHealthy") == 1 and status.get("disruptionsAllowed") == 0

    wait_until("the PDB's status", budget_computed, within=30)
    stack.create_claim("high", 4, priority=5)

    def preempting() -> bool:
        high = stack.get(f"{stack.claims}/high")
        return "preempting" in ((high.get("status") or {}).get("message") or "")

    wait_until("high to say whom it preempts", preempting, within=30)
    time.sleep(HELD_BACK_S)
    run.low_pod_while_held = _pod_phase(stack, "low-worker")
    run.high_while_held = stack.claim_phase("high")
    run.low_while_held = stack.get(f"{stack.claims}/low")
    stack.plane.request("DELETE", f"{pdbs}/keep-low")
    run.high = stack.wait_allocated("high")
    allocated = time.monotonic()
    run.low_pod_at_allocation = stack.get_or_none(f"{stack.pods}/low-worker")
    run.low_after = stack.get(f"{stack.claims}/low")
    stack.wait_pod_gone("low-worker", within=60)
    run.low_pod_gone_after_allocation_s = time.monotonic() - allocated
    run.low_pod_gone = True
    stack.create_pod("high-worker", f"{LIST_DEVICES}; sleep 3600", claim="high")
    run.high_seen = stack.seen("high-worker")


def _drain(stack: Stack, run: Run) -> None:
    run.drain = _kubectl(
        stack, "drain", node.NODE_NAME, "--force", "--ignore-daemonsets", "--grace-period=1", "--timeout=90s"
    )
    run.high_pod_gone_after_drain = stack.get_or_none(f"{stack.pods}/high-worker") is None
    run.node_unschedulable = bool(stack.get(f"/api/v1/nodes/{node.NODE_NAME}")["spec"].get("unschedulable"))
    run.high_after_drain = stack.get(f"{stack.claims}/high")

    def unreserved() -> bool:  # kube-controller-manager's resourceclaim controller lets the pod go
        found = stack.get(stack.resource_claim("high"))
        run.reserved_after_drain = (found.get("status") or {}).get("reservedFor") or []
        return not run.reserved_after_drain

    wait_until("the ResourceClaim of high no longer reserved", unreserved, within=30)
    stack.create_claim("late", 1)
    time.sleep(3)
    run.late_while_cordoned = stack.claim_phase("late")
    uncordon = _kubectl(stack, "uncordon", node.NODE_NAME)
    assert uncordon.returncode == 0, uncordon.stderr
    run.late_after_uncordon = str(stack.wait_allocated("late")["status"]["phase"])
    stack.create_pod("high-again", f"{LIST_DEVICES}; sleep 3600", claim="high")
    run.high_seen_after_uncordon = stack.seen("high-again")


@pytest.fixture(scope="module")
def disruption_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run = Run()
    say = progress_printer(request.config)
    with running_stack(tmp_path_factory.mktemp("disrupt"), NAMESPACE, say) as stack:
        _preemption(stack, run)
        pod = run.low_pod_at_allocation
        say(
            "when high was Allocated, the evicted pod was "
            + (
                "gone"
                if pod is None
                else f"{pod['status'].get('phase')} (deleted at {pod['metadata'].get('deletionTimestamp')})"
            )
            + f"; gone {run.low_pod_gone_after_allocation_s:.2f} s later"
        )
        _drain(stack, run)
    run.left_by_teardown = stack.left_by_teardown
    yield run


def _files(claim: dict[str, Any]) -> list[str]:
    return sorted([*(cdi.device_file(int(d["minor"])) for d in devices(claim)), cdi.CONTROL_DEVICE])


def test_a_pdb_holds_the_preemption_of_a_real_running_pod_back(disruption_run: Run) -> None:
    run = disruption_run
    assert run.low_pod_while_held == "Running"
    assert run.high_while_held == constants.PHASE_PENDING
    held = (
        {d["uuid"] for d in devices(run.low_while_held)}
        if run.low_while_held["status"].get("allocations")
        else set()
    )
    assert held == {d["uuid"] for d in devices(run.low)}


def test_once_the_pdb_allows_it_the_pod_is_evicted_and_the_preemptor_gets_the_gpus(
    disruption_run: Run,
) -> None:
    run = disruption_run
    assert run.low_pod_gone
    assert run.low_after["status"]["phase"] == constants.PHASE_PREEMPTED
    assert run.low_after["status"]["preemptedBy"] == f"{NAMESPACE}/high"
    assert {d["uuid"] for d in devices(run.high)} <= {d["uuid"] for d in devices(run.low)}


def test_the_preemptor_is_allocated_only_once_the_evicted_pods_container_has_stopped(
    disruption_run: Run,
) -> None:
    pod = disruption_run.low_pod_at_allocation
    assert pod is None or pod["status"].get("phase") in ("Succeeded", "Failed"), pod and pod["status"]


def test_the_preemptors_pod_sees_exactly_its_four_gpus(disruption_run: Run) -> None:
    seen = disruption_run.high_seen
    assert seen is not None
    assert seen.nvidia == _files(disruption_run.high)
    assert seen.cuda_visible_devices == ",".join(d["uuid"] for d in devices(disruption_run.high))


def test_kubectl_drain_evicts_the_claim_pod_and_cordons_the_node(disruption_run: Run) -> None:
    run = disruption_run
    assert run.drain is not None and run.drain.returncode == 0, run.drain and run.drain.stderr
    assert run.high_pod_gone_after_drain
    assert run.node_unschedulable


def test_a_drained_claim_keeps_its_gpus_and_its_resource_claim_is_released_by_the_pod(
    disruption_run: Run,
) -> None:
    run = disruption_run
    assert run.high_after_drain["status"]["phase"] == constants.PHASE_ALLOCATED
    assert devices(run.high_after_drain) == devices(run.high)
    assert run.reserved_after_drain == []


def test_a_claim_made_while_the_node_is_cordoned_waits_until_it_is_uncordoned(disruption_run: Run) -> None:
    assert disruption_run.late_while_cordoned == constants.PHASE_PENDING
    assert disruption_run.late_after_uncordon == constants.PHASE_ALLOCATED


def test_after_uncordon_a_new_pod_of_the_drained_claim_sees_its_gpus_again(disruption_run: Run) -> None:
    seen = disruption_run.high_seen_after_uncordon
    assert seen is not None
    assert seen.pod["spec"]["nodeName"] == node.NODE_NAME
    assert seen.nvidia == _files(disruption_run.high)


def test_the_node_leaves_nothing_behind_after_the_disruptions(disruption_run: Run) -> None:
    assert disruption_run.left_by_teardown == []
