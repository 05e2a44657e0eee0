"""The agent as the real node's DRA kubelet plugin: a pod's container gets exactly its
ResourceClaim's GPU (issue 42, part 2, the node side).

One scenario per GPU profile (a whole H100; an A100's MIG instance, whose CDI device adds its GPU
and compute instances' ``/dev/nvidia-caps`` nodes): a control plane with kube-scheduler and
kube-controller-manager, the real node (containerd, kubelet ``gpualloc-node-0``) without its own
agent, the simulated GPUs' device files and CDI spec, and an agent process with
``--kubelet-plugin`` registered with that kubelet. A DeviceClass ``gpu.gpualloc.dev`` and a
ResourceClaim allocated on the node for one device are made by hand, as the chart and the
controller make them; a busybox pod naming the claim in ``spec.resourceClaims`` and one without
it (asking ``NVIDIA_VISIBLE_DEVICES=all``) list the nvidia device files under ``/dev``.

Skipped, with the reason, where a node cannot run (not root, no overlayfs).
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent import dra, simulated
from controller import resourceclaims
from gpualloc import cdi
from gpualloc.api import constants
from gpualloc.devcluster import binaries, cluster, images, node
from tests.conftest import CRD_DIR, progress_printer, wait_until

NAMESPACE = "dra-node-test"
WHOLE_PROFILE, MIG_PROFILE = "h100-sxm-8", "a100-mig"
CLAIM = "one-gpu-gpus-0"
RESOURCE = "/apis/resource.k8s.io/v1"


@dataclasses.dataclass(kw_only=True)
class Run:
    expected: list[str] = dataclasses.field(default_factory=list)  # the claim pod's nvidia files
    registered: bool = False
    claim_pod: dict[str, Any] = dataclasses.field(default_factory=dict)
    claim_pod_devices: list[str] = dataclasses.field(default_factory=list)
    plain_pod: dict[str, Any] = dataclasses.field(default_factory=dict)
    plain_pod_devices: list[str] = dataclasses.field(default_factory=list)
    reserved_for: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sockets_after_stop: list[str] = dataclasses.field(default_factory=list)
    left_by_teardown: list[str] = dataclasses.field(default_factory=list)


def _pod(name: str, *, claim: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": images.TOOLBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["find", "/dev", "-name", "nvidia*", "!", "-type", "d"],
        "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "containers": [container],
    }
    if claim:
        spec["resourceClaims"] = [{"name": constants.DRA_POD_CLAIM, "resourceClaimName": CLAIM}]
        container["resources"] = {"claims": [{"name": constants.DRA_POD_CLAIM}]}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": spec,
    }


def _allocate_one_device(plane: cluster.ControlPlane, uuid: str) -> None:
    """The DeviceClass (the chart's) and a ResourceClaim allocated on the node (the controller's)."""
    plane.request(
        "POST",
        f"{RESOURCE}/deviceclasses",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": constants.DRA_DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{constants.DRA_DRIVER}"'}}]},
        },
    )
    request = {
        "name": constants.DRA_REQUEST,
        "exactly": {"deviceClassName": constants.DRA_DRIVER, "count": 1},
    }
    path = f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims"
    created = plane.request(
        "POST",
        path,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": CLAIM, "namespace": NAMESPACE},
            "spec": {"devices": {"requests": [request]}},
        },
    )
    result = resourceclaims.Result(pool=node.NODE_NAME, device=constants.dra_device_name(uuid))
    allocation = resourceclaims.allocation_json(
        resourceclaims.Allocated(node=node.NODE_NAME, results=(result,))
    )
    # kube-scheduler (PreBind, with DRADeviceBindingConditions and DRAResourceClaimDeviceStatus on, as
    # in 1.36) sets allocationTimestamp where it is missing when it adds the pod to reservedFor, and
    # the API server refuses that change of an immutable allocation: the pod is never bound. So the
    # allocation carries one from the start.
    allocation["allocationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    created["status"] = {"allocation": allocation}
    plane.request("PUT", f"{path}/{CLAIM}/status", created)


def _finished(plane: cluster.ControlPlane, name: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        pod: dict[str, Any] = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        return pod if pod.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    found: dict[str, Any] = wait_until(f"pod {name} to finish", done, within=90)
    return found


def _log(plane: cluster.ControlPlane, name: str) -> list[str]:
    text: str | None = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/log", accept="*/*")
    return (text or "").split()  # an empty log comes back as no body


def _claimed(gpus: list[cdi.Gpu], profile: str) -> tuple[str, list[str]]:
    """The device the claim names (the third GPU; on a MIG profile, the first MIG instance) and the
    nvidia files its container must list, exactly."""
    if profile == MIG_PROFILE:
        gpu = next(g for g in gpus if g.migs)
        mig = gpu.migs[0]
        assert mig.caps is not None, "the simulated source gives every MIG instance its cap minors"
        caps = [f"/dev/{cdi.cap_file(minor)}" for minor in mig.caps]
        return mig.uuid, [f"/dev/{cdi.device_file(gpu.minor)}", f"/dev/{cdi.CONTROL_DEVICE}", *caps]
    gpu = gpus[2]
    return gpu.uuid, [f"/dev/{cdi.device_file(gpu.minor)}", f"/dev/{cdi.CONTROL_DEVICE}"]


@pytest.fixture(scope="module", params=[WHOLE_PROFILE, MIG_PROFILE])
def dra_node_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    profile: str = request.param
    say = progress_printer(request.config)
    programs = node.ensure_programs(say)
    paths = binaries.ensure(
        ["etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"], progress=say
    )
    run = Run()
    plane = cluster.ControlPlane(
        tmp_path_factory.mktemp("dranode"), binaries=paths, progress=say, real_node=True
    )
    plane.start()
    real: node.RealNode | None = None
    agent: subprocess.Popen[bytes] | None = None
    agent_log = plane.logs_dir / "dra-agent.log"
    try:
        plane.apply_crds(CRD_DIR)
        plane.ensure_scheduler()
        plane.ensure_controller_manager()
        real = node.RealNode(plane, programs, progress=say, gpu_profile=None)
        real.start()
        source = simulated.SimulatedSource(simulated.load_profile(profile), node.NODE_NAME)
        gpus = dra.gpus(source.scan())
        real.expose_gpus(gpus)  # the device files (/dev/null's numbers) the spec's hostPaths name
        device, run.expected = _claimed(gpus, profile)
        metrics, health = cluster.free_ports(2)
        argv = [
            sys.executable,
            "-m",
            "gpualloc.cli",
            "agent",
            "--source",
            "simulated",
            "--profile",
            profile,
        ]
        argv += [
            "--node-name",
            node.NODE_NAME,
            "--kubeconfig",
            str(plane.kubeconfig),
            "--lease-namespace",
            "",
        ]
        argv += ["--metrics-port", str(metrics), "--health-port", str(health), "--log-format", "text"]
        argv += [
            "--kubelet-plugin",
            "--kubelet-root",
            str(real.dir / "kubelet"),
            "--device-dir",
            str(real.device_dir),
        ]
        with agent_log.open("wb") as out:
            agent = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        wait_until(
            "the kubelet to register the plugin",
            lambda: "registered with the kubelet" in agent_log.read_text(),
            within=60,
            logs=agent_log.read_text,
        )
        run.registered = True
        plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        plane.ensure_service_account(NAMESPACE)
        _allocate_one_device(plane, device)
        for name, claim in (("with-claim", True), ("without-claim", False)):
            plane.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", _pod(name, claim=claim))
        run.claim_pod = _finished(plane, "with-claim")
        run.plain_pod = _finished(plane, "without-claim")
        run.claim_pod_devices = _log(plane, "with-claim")
        run.plain_pod_devices = _log(plane, "without-claim")
        rc = plane.request("GET", f"{RESOURCE}/namespaces/{NAMESPACE}/resourceclaims/{CLAIM}")
        run.reserved_for = rc.get("status", {}).get("reservedFor") or []
        say(f"claim pod's /dev: {run.claim_pod_devices}; plain pod's /dev: {run.plain_pod_devices}")
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(20)
            if real is not None:
                kubelet = real.dir / "kubelet"
                run.sockets_after_stop = [str(p) for p in kubelet.glob("plugins*/**/*.sock")]
        if real is not None:
            run.left_by_teardown = real.stop()
        plane.stop()
    yield run


def test_the_kubelet_registers_the_agent_as_the_dra_plugin_of_gpu_gpualloc_dev(dra_node_run: Run) -> None:
    assert dra_node_run.registered


def test_a_pod_naming_a_claim_of_one_device_sees_exactly_its_device_nodes_and_nvidiactl(
    dra_node_run: Run,
) -> None:
    """A whole GPU: its /dev/nvidia<minor>. A MIG instance: its GPU's, and its two nvidia-caps."""
    assert dra_node_run.claim_pod["status"]["phase"] == "Succeeded", dra_node_run.claim_pod["status"]
    assert dra_node_run.claim_pod["spec"]["nodeName"] == node.NODE_NAME
    assert sorted(dra_node_run.claim_pod_devices) == sorted(dra_node_run.expected)


def test_a_pod_without_a_claim_sees_no_gpu_even_asking_for_all(dra_node_run: Run) -> None:
    assert dra_node_run.plain_pod["status"]["phase"] == "Succeeded", dra_node_run.plain_pod["status"]
    assert dra_node_run.plain_pod_devices == []


def test_the_plugins_sockets_are_gone_after_the_agent_stops_and_the_node_leaves_nothing(
    dra_node_run: Run,
) -> None:
    assert dra_node_run.sockets_after_stop == []
    assert dra_node_run.left_by_teardown == []
