"""A real node (`gpualloc dev up --real-node`'s): a kubelet and containerd beside the control plane.

One scenario, run once for the module (``real_node_run``): the machine is read, a control plane of
its own starts with kube-scheduler and kube-controller-manager, then the node (containerd, the
kubelet, the simulated agent of an 8-GPU node exposed as CDI devices); a busybox pod is created
and scheduled there, runs to Succeeded, and its log is read through the API server; a container
is run with one GPU's CDI device; a second pod, with a service-account token volume, is left
running; then node and control plane stop, and the machine is read again. Each test asserts one
part of what was seen.

Skipped, with the reason, where a node cannot run (not root, no overlayfs): .ci/run's
GPUALLOC_REQUIRE_INTEGRATION=1 then fails the run, as for any skipped integration test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpualloc.devcluster import binaries, cdi, cluster, images, node
from tests.conftest import CRD_DIR, progress_printer
from tests.node import real_node_support

NAMESPACE = "real-node-test"
MARKER = "hello-from-a-real-container"


@dataclasses.dataclass(kw_only=True)
class Run:
    before: dict[str, Any]
    after: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    pod: dict[str, Any] = dataclasses.field(default_factory=dict)
    log: str = ""
    gpus: list[cdi.Gpu] = dataclasses.field(default_factory=list)
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)
    device_files: dict[str, tuple[bool, int]] = dataclasses.field(default_factory=dict)
    cdi_container_devices: list[str] = dataclasses.field(default_factory=list)
    running_pod_phase: str = ""
    settings_changed_while_up: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    left_by_teardown: list[str] = dataclasses.field(default_factory=list)


def _pod(name: str, command: str, *, token: bool) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": token,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": images.TOOLBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", command],
                }
            ],
        },
    }


def _wait_phase(plane: cluster.ControlPlane, name: str, phases: set[str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        pod: dict[str, Any] = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        if pod.get("status", {}).get("phase") in phases:
            return pod
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} not in {phases} after {timeout} s: {pod.get('status')}")
        time.sleep(0.05)


def _run_with_cdi(programs: node.Programs, real: node.RealNode, device: str, out: Path) -> list[str]:
    """The names in ``/dev`` of a container given one CDI device by name, run with ctr (no kubelet
    involved). The list is written to a bind-mounted file: ctr may drop a short-lived task's output."""
    ctr = [str(programs.binaries["ctr"]), "--address", str(real.address), "--namespace", "k8s.io"]
    out.mkdir(parents=True, exist_ok=True)
    mount = f"type=bind,src={out},dst=/out,options=rbind:rw"
    image = images.full_name(images.TOOLBOX_IMAGE)
    argv = [*ctr, "run", "--rm", "--device", device, "--mount", mount, image, "cdi-check"]
    done = subprocess.run(
        [*argv, "sh", "-c", "ls /dev > /out/devices"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return (out / "devices").read_text().split()


@pytest.fixture(scope="module")
def real_node_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    say = progress_printer(request.config)
    programs = node.ensure_programs(say)
    paths = binaries.ensure(
        ["etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"], progress=say
    )
    run = Run(before=real_node_support.snapshot(programs))
    started = time.monotonic()
    plane = cluster.ControlPlane(
        tmp_path_factory.mktemp("realnode"), binaries=paths, progress=say, real_node=True
    )
    plane.start()
    real: node.RealNode | None = None
    try:
        plane.apply_crds(CRD_DIR)
        plane.ensure_scheduler()
        plane.ensure_controller_manager()
        real = node.RealNode(plane, programs, progress=say, gpu_profile="h100-sxm-8")
        real.start()
        run.timings = {**real.timings, "control plane and node up": time.monotonic() - started}
        plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        plane.ensure_service_account(NAMESPACE)
        command = f"echo {MARKER}; nc -w 2 10.96.0.1 443 </dev/null && echo kubernetes-service-reachable"
        created = time.monotonic()
        plane.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", _pod("hello", command, token=False))
        _wait_phase(plane, "hello", {"Running", "Succeeded", "Failed"}, 60)
        run.timings["pod Running or done"] = time.monotonic() - created
        run.pod = _wait_phase(plane, "hello", {"Succeeded", "Failed"}, 60)
        run.timings["pod Succeeded"] = time.monotonic() - created
        run.log = plane.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/hello/log", accept="*/*")
        run.gpus = list(real.gpus)
        run.spec = json.loads(real.cdi_spec.read_text())
        null = os.stat("/dev/null").st_rdev
        for path in sorted(real.device_dir.iterdir()):
            info = os.stat(path)
            run.device_files[path.name] = (path.is_char_device(), info.st_rdev == null)
        checked = tmp_path_factory.mktemp("cdi-check")
        run.cdi_container_devices = _run_with_cdi(programs, real, cdi.device_name(run.gpus[0]), checked)
        # Left running for the stop: a container, its sandbox's network namespace and a token volume.
        plane.request(
            "POST", f"/api/v1/namespaces/{NAMESPACE}/pods", _pod("sleeper", "sleep 3600", token=True)
        )
        run.running_pod_phase = _wait_phase(plane, "sleeper", {"Running", "Failed"}, 60)["status"]["phase"]
        say(f"resident memory with one pod running (MiB): {real_node_support.node_memory_mib()}")
        up = real_node_support.snapshot(programs)["settings"]
        old = run.before["settings"]
        run.settings_changed_while_up = {k: (old[k], v) for k, v in up.items() if k in old and old[k] != v}
        say(f"kernel settings changed while the node ran (before, during): {run.settings_changed_while_up}")
    finally:
        if real is not None:
            stopping = time.monotonic()
            run.left_by_teardown = real.stop()
            run.timings["node stop"] = time.monotonic() - stopping
        plane.stop()
        run.after = real_node_support.snapshot(programs)
        say(f"real node timings (s): {', '.join(f'{k} {v:.2f}' for k, v in run.timings.items())}")
    yield run


def test_a_busybox_pod_runs_to_succeeded_on_the_real_node_and_its_log_is_read_through_the_api_server(
    real_node_run: Run,
) -> None:
    assert real_node_run.pod["spec"]["nodeName"] == node.NODE_NAME  # placed by kube-scheduler
    assert real_node_run.pod["status"]["phase"] == "Succeeded", real_node_run.pod["status"]
    assert MARKER in real_node_run.log


def test_a_pod_reaches_the_api_server_at_the_kubernetes_service_address(real_node_run: Run) -> None:
    assert "kubernetes-service-reachable" in real_node_run.log


def test_a_pod_with_a_service_account_token_runs_on_the_real_node(real_node_run: Run) -> None:
    assert real_node_run.running_pod_phase == "Running"


def test_the_simulated_gpus_are_cdi_devices_backed_by_files_with_dev_nulls_numbers(
    real_node_run: Run,
) -> None:
    gpus = real_node_run.gpus
    assert len(gpus) == 8
    assert real_node_run.spec["kind"] == "gpualloc.dev/gpu"
    assert sorted(d["name"] for d in real_node_run.spec["devices"]) == sorted(g.uuid for g in gpus)
    paths = [n["path"] for d in real_node_run.spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert sorted(paths) == sorted(f"/dev/nvidia{g.minor}" for g in gpus)
    expected = {"nvidiactl", *(f"nvidia{g.minor}" for g in gpus)}
    assert set(real_node_run.device_files) == expected
    assert all(is_char and same for is_char, same in real_node_run.device_files.values())


def test_a_container_given_one_gpus_cdi_device_sees_exactly_that_device_node_and_nvidiactl(
    real_node_run: Run,
) -> None:
    seen = {name for name in real_node_run.cdi_container_devices if name.startswith("nvidia")}
    assert seen == {f"nvidia{real_node_run.gpus[0].minor}", "nvidiactl"}


def test_stopping_the_node_leaves_no_mount_interface_iptables_rule_netns_process_or_changed_setting(
    real_node_run: Run,
) -> None:
    assert real_node_run.left_by_teardown == []
    assert real_node_support.differences(real_node_run.before, real_node_run.after) == []
