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
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpualloc import cdi
from gpualloc.api import constants
from gpualloc.devcluster import binaries, cluster, components, images, node
from tests.conftest import CRD_DIR, progress_printer, wait_until
from tests.node import podresources

NAMESPACE = "dra-e2e"
CLAIMS = ("first", "second")
DONE = "done"  # release: OnPodsCompleted; its pod exits at once
PLAIN = "no-claim"
LISTED = "end-of-listing"
RESOURCE = "/apis/resource.k8s.io/v1"
CLAIM_PATH = f"/apis/gpu.scheduling/v1/namespaces/{NAMESPACE}/gpuclaims"
LIST_DEVICES = f"ls /dev; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; echo {LISTED}"


@dataclasses.dataclass(kw_only=True)
class Seen:
    """What one pod's container saw, from its log."""

    nvidia: list[str]  # the nvidia* names in its /dev
    cuda_visible_devices: str
    pod: dict[str, Any]


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


def _claim(name: str, release: str = "OnDelete") -> dict[str, Any]:
    return {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"count": 1}, "release": release},
    }


def _pod(name: str, command: str, *, claim: str | None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": images.TOOLBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
    }
    metadata: dict[str, Any] = {"name": name, "namespace": NAMESPACE}
    if claim is None:
        container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    else:
        metadata["annotations"] = {constants.ANNOTATION_CLAIM: claim}
    spec = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _get(plane: cluster.ControlPlane, path: str) -> dict[str, Any]:
    found: dict[str, Any] = plane.request("GET", path)
    return found


def _allocated(plane: cluster.ControlPlane, name: str) -> dict[str, Any]:
    def allocated() -> dict[str, Any] | None:
        claim = _get(plane, f"{CLAIM_PATH}/{name}")
        return claim if (claim.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED else None

    claim: dict[str, Any] = wait_until(f"GpuClaim {name} Allocated", allocated, within=60)
    resource_claim = (
        f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{constants.resource_claim_name(name, 0)}"
    )

    def mirrored() -> bool:
        try:
            return bool((_get(plane, resource_claim).get("status") or {}).get("allocation"))
        except cluster.RequestError as exc:
            if exc.status == 404:
                return False
            raise

    wait_until(f"the ResourceClaim of {name} allocated", mirrored, within=60)
    return claim


def _start_pod(plane: cluster.ControlPlane, pod: dict[str, Any], run: Run) -> None:
    """Create the pod and time it to Running (or done, for a pod that exits at once)."""
    name = pod["metadata"]["name"]
    created = time.monotonic()
    plane.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)

    def started() -> bool:
        phase = (_get(plane, f"/api/v1/namespaces/{NAMESPACE}/pods/{name}").get("status") or {}).get("phase")
        if phase == "Failed":
            raise AssertionError(f"pod {name} failed")
        return phase in ("Running", "Succeeded")

    wait_until(f"pod {name} Running", started, within=90, every=0.05)
    run.running_s[name] = time.monotonic() - created


def _seen(plane: cluster.ControlPlane, name: str) -> Seen:
    def listed() -> str | None:
        text: str = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/log", accept="*/*")
        return text if LISTED in text else None

    text: str = wait_until(f"pod {name} to list /dev", listed, within=60)
    words = text.split()
    cuda = next((w.split("=", 1)[1] for w in words if w.startswith("CUDA_VISIBLE_DEVICES=")), "")
    return Seen(
        nvidia=sorted(w for w in words if w.startswith("nvidia")),
        cuda_visible_devices=cuda,
        pod=_get(plane, f"/api/v1/namespaces/{NAMESPACE}/pods/{name}"),
    )


def _device(claim: dict[str, Any]) -> dict[str, Any]:
    (allocation,) = claim["status"]["allocations"]
    (device,) = allocation["devices"]
    found: dict[str, Any] = device
    return found


def _release_on_completion(plane: cluster.ControlPlane, run: Run) -> None:
    plane.request("POST", CLAIM_PATH, _claim(DONE, "OnPodsCompleted"))
    _allocated(plane, DONE)
    plane.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", _pod(DONE, "ls /dev; exit 0", claim=DONE))

    def released() -> dict[str, Any] | None:
        claim = _get(plane, f"{CLAIM_PATH}/{DONE}")
        return claim if (claim.get("status") or {}).get("phase") == constants.PHASE_RELEASED else None

    run.done_claim = wait_until("GpuClaim done Released after its pod exited", released, within=90)
    selector = f"{constants.LABEL_CLAIM_NAMESPACE}={NAMESPACE},{constants.LABEL_CLAIM_NAME}={DONE}"
    leases_path = f"/apis/coordination.k8s.io/v1/namespaces/{components.NAMESPACE}/leases"

    def leases_gone() -> bool:
        found = plane.request("GET", f"{leases_path}?labelSelector={selector}")["items"]
        run.done_leases_after = [lease["metadata"]["name"] for lease in found]
        return not found

    def resource_claim_gone() -> bool:
        path = f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{constants.resource_claim_name(DONE, 0)}"
        try:
            plane.request("GET", path)
        except cluster.RequestError as exc:
            run.done_resource_claim_status = exc.status
            return exc.status == 404
        run.done_resource_claim_status = 200
        return False

    wait_until("the device Leases of done gone", leases_gone, within=30)
    wait_until("the ResourceClaim of done gone", resource_claim_gone, within=30)


@pytest.fixture(scope="module")
def e2e_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    say = progress_printer(request.config)
    programs = node.ensure_programs(say)
    paths = binaries.ensure(
        ["etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"], progress=say
    )
    run = Run()
    plane = cluster.ControlPlane(tmp_path_factory.mktemp("e2e"), binaries=paths, progress=say, real_node=True)
    plane.start()
    real: node.RealNode | None = None
    try:
        plane.apply_crds(CRD_DIR)
        plane.ensure_scheduler()
        plane.ensure_controller_manager()
        real = node.RealNode(plane, programs, progress=say, gpu_profile="h100-sxm-8")
        real.start()
        components.start(plane, dra=True)
        plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        plane.ensure_service_account(NAMESPACE)
        for name in CLAIMS:
            plane.request("POST", CLAIM_PATH, _claim(name))
            run.claims[name] = _allocated(plane, name)
        _start_pod(plane, _pod(PLAIN, f"{LIST_DEVICES}; sleep 3600", claim=None), run)
        for name in CLAIMS:
            _start_pod(plane, _pod(name, f"{LIST_DEVICES}; sleep 3600", claim=name), run)
        for name in (*CLAIMS, PLAIN):
            run.seen[name] = _seen(plane, name)
        run.pod_resources = podresources.list_claims(podresources.socket_path(real.kubelet_root))
        _release_on_completion(plane, run)
        say(
            "created to Running (s): "
            + ", ".join(f"{name} {seconds:.2f}" for name, seconds in run.running_s.items())
            + f" (claim pods: {', '.join(CLAIMS)}; without a claim: {PLAIN})"
        )
    finally:
        try:
            components.stop(plane)
            if real is not None:
                run.left_by_teardown = real.stop()
        finally:
            plane.stop()
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
