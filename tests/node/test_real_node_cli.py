"""`gpualloc dev up --real-node`, `dev image import` and `dev down` as a user runs them.

`dev up --real-node` runs as a process of its own; an image built here is imported with `dev image
import` and a pod runs from it; a second pod is left running; the `dev up` process is killed with
SIGKILL (nothing of its own cleanup runs) and `dev down` must still leave the machine as it was.
With its simulated GPUs the node is a DRA node by itself: the agent is the kubelet's plugin and
gpualloc's controller and webhook run with `--dra`; `dev down` stops them too.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from gpualloc.devcluster import cluster, images, node
from tests.conftest import progress_printer
from tests.node import real_node_support

IMPORTED = "gpualloc/imported-check:1"


def _gpualloc(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "gpualloc.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def _pod(name: str, image: str, command: str) -> dict[str, Any]:
    container = {"name": "main", "image": image, "imagePullPolicy": "Never", "command": ["sh", "-c", command]}
    spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _wait_phase(state_dir: Path, name: str, phases: set[str]) -> str:
    deadline = time.monotonic() + 60
    while True:
        pod = real_node_support.request(state_dir, "GET", f"/api/v1/namespaces/default/pods/{name}")
        phase = str(pod.get("status", {}).get("phase"))
        if phase in phases or time.monotonic() > deadline:
            return phase
        time.sleep(0.1)


def test_dev_down_after_dev_up_was_killed_leaves_the_machine_as_it_was_and_an_imported_image_ran(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    say = progress_printer(request.config)
    programs = node.ensure_programs(say)
    before = real_node_support.snapshot(programs)
    # A short path: the DRA plugin's socket, <state>/node/kubelet/plugins/gpu.gpualloc.dev/dra.sock,
    # must fit a unix socket's 107 bytes, and pytest's tmp_path is long.
    state_dir = Path(tempfile.mkdtemp(prefix="gpualloc-dev-", dir="/tmp"))
    log = tmp_path / "dev-up.log"
    started = time.monotonic()
    with log.open("w") as out:
        argv = [
            sys.executable,
            "-m",
            "gpualloc.cli",
            "dev",
            "up",
            "--state-dir",
            str(state_dir),
            "--real-node",
        ]
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    components_pids: dict[str, int] = {}
    try:
        while "ready: kubeconfig" not in log.read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() - started < 180, log.read_text()
            time.sleep(0.1)
        say(f"`gpualloc dev up --real-node` ready in {time.monotonic() - started:.1f} s")
        assert "controller and webhook" in log.read_text() and "with --dra" in log.read_text()
        components_pids = {
            name: entry["pid"]
            for name, entry in cluster.load_state(state_dir)["processes"].items()
            if name in ("controller", "webhook")
        }
        assert sorted(components_pids) == ["controller", "webhook"]
        busybox = programs.busybox_root / "bin" / "busybox"
        toolbox = images.toolbox_image(busybox.read_bytes(), ["bin/sh", "bin/echo", "bin/sleep"])
        archive = tmp_path / "imported.oci.tar"
        archive.write_bytes(images.build_archive(images.Image(name=IMPORTED, entries=toolbox.entries)))

        imported = _gpualloc("dev", "image", "import", str(archive), "--state-dir", str(state_dir))
        assert imported.returncode == 0, imported.stderr
        assert images.full_name(IMPORTED) in imported.stdout

        for name, image, command in (
            ("imported", IMPORTED, "echo ran-the-imported-image"),
            ("sleeper", images.TOOLBOX_IMAGE, "sleep 3600"),
        ):
            real_node_support.request(
                state_dir, "POST", "/api/v1/namespaces/default/pods", _pod(name, image, command)
            )
        assert _wait_phase(state_dir, "imported", {"Succeeded", "Failed"}) == "Succeeded"
        log_text = real_node_support.request(
            state_dir, "GET", "/api/v1/namespaces/default/pods/imported/log", accept="*/*"
        )
        assert "ran-the-imported-image" in log_text
        assert _wait_phase(state_dir, "sleeper", {"Running", "Failed"}) == "Running"
    finally:
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
        down = _gpualloc("dev", "down", "--state-dir", str(state_dir))
    after = real_node_support.snapshot(programs)

    shutil.rmtree(state_dir, ignore_errors=True)
    assert down.returncode == 0, down.stdout + down.stderr
    # A killed component its parent has not reaped yet is a zombie: gone (cluster.alive).
    assert [name for name, pid in components_pids.items() if cluster.alive(pid)] == []
    assert "the machine is as it was" in down.stdout
    assert real_node_support.differences(before, after) == []
