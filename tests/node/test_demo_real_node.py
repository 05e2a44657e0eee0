"""`make demo DEMO_ARGS=--real-node` as a user runs it: the pods really run on the real node and the
demo prints what each container saw (issue 42, part 4)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from gpualloc import demo


def test_the_real_node_demo_prints_that_each_container_saw_exactly_its_claims_gpus() -> None:
    with tempfile.TemporaryDirectory(prefix="gpualloc-demo-") as state:  # short: the plugin's socket
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpualloc.demo",
                "--real-node",
                "--exit",
                "--state-dir",
                str(Path(state) / "s"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    rows = {
        line.split()[0]: line.split() for line in out.splitlines() if line.split()[-1:] in (["yes"], ["NO"])
    }
    pods = [f"{name}-pod" for name, _ in demo.REAL_NODE_CLAIMS]
    assert sorted(rows) == sorted([*pods, demo.REAL_NODE_PLAIN_POD]), out
    assert all(row[-1] == "yes" for row in rows.values()), out
    for (_, count), pod in zip(demo.REAL_NODE_CLAIMS, pods, strict=True):
        assert len([word for word in rows[pod] if word.startswith("nvidia") and word != "nvidiactl"]) == count
    assert "(none)" in rows[demo.REAL_NODE_PLAIN_POD]
    assert "the machine is as it was" in out
