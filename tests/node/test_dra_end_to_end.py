"""gpualloc on the real node, the whole stack as `gpualloc dev up --real-node` runs it: each
container gets exactly its claim's GPUs, enforced by the kubelet and the runtime (issue 42, part 3).

One scenario for the module: a control plane with kube-scheduler and kube-controller-manager, the
real node with its simulated 8-GPU agent as the kubelet's DRA plugin, and the controller and the
webhook with ``--dra`` (``gpualloc.devcluster.components``). Two GpuClaims of one GPU each, and a
busybox pod naming each (annotation ``gpu.scheduling/claim``) that lists ``/dev`` and prints its
``CUDA_VISIBLE_DEVICES``, then sleeps; a pod without a claim asking ``NVIDIA_VISIBLE_DEVICES=all``
does the same. What each container saw is read from its log through the API server; the kubelet's
PodResources API (``List``) is asked which devices each container has. A third claim, ``release:
OnPodsCompleted``, has a pod that lists ``/dev`` and exits: the claim turns Released, its device
Leases and its ResourceClaim go. Then everything stops and the node leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from gpualloc import cdi
from gpualloc.api import constants
from gpualloc.devcluster import components, node
from tests.conftest import progress_printer, wait_until
from tests.node import podresources
from tests.node.stack_support import LIST_DEVICES, Seen, Stack, devices, running_stack

NAMESPACE = "dra-e2e"
CLAIMS = ("first", "second")
DONE = "done"  # release: OnPodsCompleted; its pod exits at once
PLAIN = "no-claim"


@dataclasses.dataclass(kw_only=True)
class Run:
    claims: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # Allocated
    seen: dict[str, Seen] = dataclasses.field(default_factory=dict)  # pod name -> what it saw
    running_s: dict[str, float] = dataclasses.field(default_factory=dict)  # created to Running
    pod_resources: dict[tuple[str, str, str], list[podresources.ClaimDevices]] = dataclasses.field(
        default_factory=dict
    )
    done_claim: dict[str, Any] = dataclasses.field(default_factory=dict)
    done_leases_after: list[str] = dataclasses.field(default_factory=list)
    done_resource_claim_status: int = 0
    left_by_teardown: list[str] = dataclasses.field(default_factory=list)


def _device(claim: dict[str, Any]) -> dict[str, Any]:
    (device,) = devices(claim)
    return device


def _release_on_completion(stack: Stack, run: Run) -> None:
    stack.create_claim(DONE, release="OnPodsCompleted")
    stack.wait_allocated(DONE)
    stack.create_pod(DONE, "ls /dev; exit 0", claim=DONE)
    run.done_claim = stack.wait_phase(DONE, constants.PHASE_RELEASED, within=90)
    selector = f"{constants.LABEL_CLAIM_NAMESPACE}={NAMESPACE},{constants.LABEL_CLAIM_NAME}={DONE}"
    leases_path = f"/apis/coordination.k8s.io/v1/namespaces/{components.NAMESPACE}/leases"

    def leases_gone() -> bool:
        found = stack.get(f"{leases_path}?labelSelector={selector}")["items"]
        run.done_leases_after = [lease["metadata"]["name"] for lease in found]
        return not found

    def resource_claim_gone() -> bool:
        gone = stack.get_or_none(stack.resource_claim(DONE)) is None
        run.done_resource_claim_status = 404 if gone else 200
        return gone

    wait_until("the device Leases of done gone", leases_gone, within=30)
    wait_until("the ResourceClaim of done gone", resource_claim_gone, within=30)


@pytest.fixture(scope="module")
def e2e_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    run = Run()
    say = progress_printer(request.config)
    with running_stack(tmp_path_factory.mktemp("e2e"), NAMESPACE, say) as stack:
        for name in CLAIMS:
            stack.create_claim(name)
            run.claims[name] = stack.wait_allocated(name)
        run.running_s[PLAIN] = stack.create_pod(PLAIN, f"{LIST_DEVICES}; sleep 3600", claim=None)
        for name in CLAIMS:
            run.running_s[name] = stack.create_pod(name, f"{LIST_DEVICES}; sleep 3600", claim=name)
        for name in (*CLAIMS, PLAIN):
            run.seen[name] = stack.seen(name)
        run.pod_resources = podresources.list_claims(podresources.socket_path(stack.real.kubelet_root))
        _release_on_completion(stack, run)
        say(
            "created to Running (s): "
            + ", ".join(f"{name} {seconds:.2f}" for name, seconds in run.running_s.items())
            + f" (claim pods: {', '.join(CLAIMS)}; without a claim: {PLAIN})"
        )
    run.left_by_teardown = stack.left_by_teardown
    yield run


def test_a_claim_pods_container_lists_exactly_its_claims_gpu_and_nvidiactl(e2e_run: Run) -> None:
    seen = e2e_run.seen["first"]
    assert seen.pod["spec"]["nodeName"] == node.NODE_NAME
    device = _device(e2e_run.claims["first"])
    assert seen.nvidia == sorted([cdi.device_file(int(device["minor"])), cdi.CONTROL_DEVICE])


def test_a_claim_pods_cuda_visible_devices_is_its_claims_gpu(e2e_run: Run) -> None:
    assert e2e_run.seen["first"].cuda_visible_devices == _device(e2e_run.claims["first"])["uuid"]


def test_a_pod_of_a_second_claim_on_the_same_node_sees_only_its_own_gpu(e2e_run: Run) -> None:
    first, second = (_device(e2e_run.claims[name]) for name in CLAIMS)
    assert first["uuid"] != second["uuid"]
    seen = e2e_run.seen["second"]
    assert seen.pod["spec"]["nodeName"] == node.NODE_NAME
    assert seen.nvidia == sorted([cdi.device_file(int(second["minor"])), cdi.CONTROL_DEVICE])
    assert seen.cuda_visible_devices == second["uuid"]


def test_a_pod_without_a_claim_asking_for_all_gpus_sees_none(e2e_run: Run) -> None:
    seen = e2e_run.seen[PLAIN]
    assert seen.pod["spec"]["nodeName"] == node.NODE_NAME
    assert seen.nvidia == []
    assert "resourceClaims" not in seen.pod["spec"]


def test_the_kubelets_pod_resources_api_reports_each_claim_pods_gpu_as_its_cdi_device(e2e_run: Run) -> None:
    for name in CLAIMS:
        device = _device(e2e_run.claims[name])
        (claim,) = e2e_run.pod_resources[(NAMESPACE, name, "main")]
        assert claim.claim == constants.resource_claim_name(name, 0)
        assert claim.namespace == NAMESPACE
        assert claim.devices == (
            f"{constants.DRA_DRIVER}/{node.NODE_NAME}/{constants.dra_device_name(device['uuid'])}",
        )
        assert claim.cdi_devices == (f"{cdi.KIND}={device['uuid']}",)


def test_the_kubelets_pod_resources_api_reports_no_claim_for_the_pod_without_one(e2e_run: Run) -> None:
    assert e2e_run.pod_resources[(NAMESPACE, PLAIN, "main")] == []


def test_an_on_pods_completed_claim_is_released_after_its_real_container_exits(e2e_run: Run) -> None:
    assert e2e_run.done_claim["status"]["phase"] == constants.PHASE_RELEASED


def test_a_released_claims_device_leases_and_resource_claim_are_gone(e2e_run: Run) -> None:
    assert e2e_run.done_leases_after == []
    assert e2e_run.done_resource_claim_status == 404


def test_the_node_leaves_nothing_behind_after_the_whole_stack_ran(e2e_run: Run) -> None:
    assert e2e_run.left_by_teardown == []
