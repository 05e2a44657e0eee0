"""`make demo` end to end: the README's first command keeps working.

Runs the demo module as a process with ``--exit`` on its own control plane
(the binaries are already built by the session fixture's cache) and checks
what it promises: every pod on the node its claim names with the claim's
devices, the unfit claim pending with a per-node reason, and nothing left
running afterwards.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any


def run_demo(state: Path, *, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpualloc.demo", "--exit", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_demo_places_every_pod_explains_the_unfit_claim_and_tears_down(
    control_plane: Any, tmp_path: Path
) -> None:
    # control_plane: the session's binaries are built (or the build error fails this test).
    state = tmp_path / "demo"
    result = run_demo(state, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "ERROR" not in out
    pods = out.split("=== Pods")[1].split("=== Claims")[0]
    for pod in ("notebook", "trainer", "ddp-0-", "ddp-1-"):
        assert pod in pods
    table = out.split("=== Claims")[1].split("===")[0].splitlines()[2:]
    claims = {line.split()[0]: line for line in table if line}
    assert all(claims[name].split()[2] == "Allocated" for name in ("notebook", "trainer", "clique-gang"))
    assert claims["ddp"].split()[2] in ("Allocated", "Released")  # its Job's pods may be done already
    assert claims["a100-quad"].split()[2] == "Pending"
    # Claims go in one at a time, so the placement is the same on every run.
    decided = [line.split("GpuClaim ", 1)[1] for line in out.splitlines() if "  GpuClaim " in line]
    names = ["notebook", "trainer", "ddp", "a100-quad", "clique-gang", "ddp"]
    assert [line.split(":")[0] for line in decided] == names
    assert decided[0] == "notebook: Allocated on gpu-node-c GPUs 0"
    assert decided[2].startswith("ddp: Allocated on gpu-node-a GPUs ") and "gpu-node-c GPUs " in decided[2]
    # The gang stays in the clique of gpu-node-a and gpu-node-c (a is full: both on c).
    assert decided[4].startswith("clique-gang: Allocated on gpu-node-c GPUs "), decided[4]
    assert decided[4].count("gpu-node-c") == 2
    # ddp's Indexed Job completes (kwok finishes Job pods): release OnPodsCompleted gives its GPUs back.
    assert decided[5].startswith("ddp: Released at "), decided[5]
    assert "released 8 GPUs: every pod that used the claim has completed" in decided[5]
    explain = out.split("gpualloc explain claim a100-quad)")[1]
    assert "gpu-node-b   no 4-GPU set with >=600 GB/s" in explain
    assert "stopped every process the demo started" in out
    leftover = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True, check=False)
    assert leftover.stdout == "", f"processes left running: {leftover.stdout}"


def test_demo_refuses_a_state_dir_that_is_not_empty(tmp_path: Path) -> None:
    (tmp_path / "etcd").mkdir()
    result = run_demo(tmp_path, timeout=60)
    assert result.returncode == 2
    assert f"--state-dir {tmp_path} is not empty" in result.stderr
    assert "starting the local control plane" not in result.stdout
