"""The MIG instances' CDI devices on a real GPU in MIG mode: the agent's ids and capability minors
against the driver's, and its spec against NVIDIA's.

Skipped, with the reason, where NVML cannot be initialised or no GPU is in MIG mode with
instances (``nvidia-smi -i N -mig 1``, then ``nvidia-smi mig -cgi <profiles> -C``). Compared:

* ``nvidia-smi mig -lci``: each MIG device's (GPU, GPU instance id, compute instance id);
* ``/dev/nvidia-caps/nvidia-cap<N>``, where the driver made it: a character device of minor N;
* ``nvidia-ctk cdi generate`` (skipped where it is not installed): the device nodes NVIDIA's spec
  gives each MIG device, in its order, are those of gpualloc's spec.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import dra, inventory, nvml
from gpualloc import cdi
from tests.gpu import smi


@pytest.fixture(scope="module")
def mig_facts(nvml_available: None) -> Iterator[list[inventory.DeviceFacts]]:
    source = nvml.NvmlSource()
    try:
        facts = source.scan()
    finally:
        source.close()
    in_mig = [d for d in facts.devices if d.mig is not None and d.mig.enabled and d.mig.devices]
    if not in_mig:
        pytest.skip("no GPU is in MIG mode with instances (nvidia-smi -i N -mig 1, then mig -cgi ... -C)")
    yield in_mig


def _compute_instances(table: str) -> set[tuple[int, int, int]]:
    """(GPU index, GPU instance id, compute instance id) of each row of ``nvidia-smi mig -lci``:
    ``|   0      1       MIG 3g.40gb          2         0          0:3     |``."""
    row = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+MIG\s+\S+\s+\d+\s+(\d+)\s+\d+:\d+\s*\|")
    return {
        (int(g), int(gi), int(ci))
        for g, gi, ci in (m.groups() for m in map(row.match, table.splitlines()) if m)
    }


def test_each_mig_devices_instance_ids_are_those_nvidia_smi_lists(
    mig_facts: list[inventory.DeviceFacts],
) -> None:
    ours = {(d.index, i.gpu_instance, i.compute_instance) for d in mig_facts for i in d.mig_instances}
    assert len(ours) == sum(len(d.mig.devices) for d in mig_facts if d.mig is not None)
    assert ours == _compute_instances(smi.run("mig", "-lci"))


def test_each_mig_devices_cap_minors_are_read_and_name_the_drivers_cap_nodes(
    mig_facts: list[inventory.DeviceFacts],
) -> None:
    instances = [i for d in mig_facts for i in d.mig_instances]
    assert all(i.gpu_instance_cap is not None and i.compute_instance_cap is not None for i in instances)
    minors = [n for i in instances for n in (i.gpu_instance_cap, i.compute_instance_cap) if n is not None]
    assert len(set(minors)) == len(minors)
    for n in minors:
        path = Path("/dev") / cdi.cap_file(n)
        if path.exists():  # the driver (nvidia-modprobe) makes them when first needed
            info = path.stat()
            assert stat.S_ISCHR(info.st_mode) and os.minor(info.st_rdev) == n


def test_gpuallocs_spec_gives_each_mig_device_the_nodes_nvidias_spec_gives_it(
    mig_facts: list[inventory.DeviceFacts], tmp_path: Path
) -> None:
    ctk = shutil.which("nvidia-ctk")
    if ctk is None:
        pytest.skip("nvidia-ctk (NVIDIA container toolkit) is not on PATH")
    output = tmp_path / "nvidia.json"
    done = subprocess.run(
        [
            ctk,
            "cdi",
            "generate",
            "--format",
            "json",
            "--device-name-strategy",
            "uuid",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"nvidia-ctk cdi generate failed ({done.returncode}): {done.stderr.strip()[:300]}")
    theirs = {
        d["name"]: [n["path"] for n in d["containerEdits"].get("deviceNodes") or []]
        for d in json.loads(output.read_text())["devices"]
    }
    facts = inventory.NodeFacts(source="nvml", devices=tuple(mig_facts))
    spec = cdi.build_spec(dra.gpus(facts), None)
    ours = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    migs = [m.uuid for d in mig_facts if d.mig is not None for m in d.mig.devices]
    for uuid in migs:
        # NVIDIA's may add DRM nodes (/dev/dri/...) for a MIG profile with graphics; gpualloc's does not.
        assert [p for p in theirs[uuid] if not p.startswith("/dev/dri/")] == ours[uuid]
