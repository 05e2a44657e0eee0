"""The real NvmlSource on a machine with NVIDIA GPUs, checked against nvidia-smi.

Skipped, with the reason, where ``nvidia-smi`` is missing or ``pynvml.nvmlInit()``
fails (no driver, no GPU). Compared:

* ``nvidia-smi -q -x``: driver and CUDA versions; per GPU the UUID, product
  name, minor number, PCI bus id (NVML's form, normalised), framebuffer total,
  maximum PCIe generation and width, and MIG mode;
* ``nvidia-smi --query-gpu=compute_cap`` and the "NUMA Affinity" column of
  ``nvidia-smi topo -m``;
* ``nvidia-smi topo -m``: the link type of every GPU pair (NV<n>, PIX, PXB, PHB,
  NODE, SYS), which is what ``inventory.derive`` must reproduce from NVML facts;
* ``nvidia-smi --query-compute-apps``: the processes with a CUDA context, which
  the usage audit reads.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

import pytest

from agent import health, inventory, nvml
from tests.gpu import smi


@pytest.fixture(scope="module")
def source(nvml_available: None) -> Iterator[nvml.NvmlSource]:
    src = nvml.NvmlSource()
    try:
        yield src
    finally:
        src.close()


def _int_or_zero(text: str | None) -> int:
    """nvidia-smi's number (``16x`` too), or 0 for 'N/A' and the like, as the agent reports unknowns."""
    value = (text or "").strip().removesuffix("x")
    return int(value) if value.isdigit() else 0


def test_devices_match_nvidia_smi_query(source: nvml.NvmlSource, smi_xml: ET.Element) -> None:
    facts = source.scan()
    inv = inventory.derive(facts)
    assert inv.driver_version == smi_xml.findtext("driver_version")
    smi_cuda = (smi_xml.findtext("cuda_version") or "").strip()
    if smi_cuda and smi_cuda != "Not Found":
        assert inv.cuda_version == smi_cuda
    gpus = smi_xml.findall("gpu")
    assert len(inv.devices) == len(gpus)
    by_uuid = {g.findtext("uuid"): g for g in gpus}
    for device in inv.devices:
        gpu = by_uuid[device.uuid]
        assert device.product == gpu.findtext("product_name")
        assert device.minor == int(gpu.findtext("minor_number") or -1)
        assert device.pci_bus_id == inventory.normalize_bus_id(gpu.findtext("pci/pci_bus_id") or "")
        assert re.fullmatch(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]", device.pci_bus_id)
        smi_total = smi.mib(gpu.findtext("fb_memory_usage/total") or "0")
        # nvidia-smi reads the same NVML memory info; drivers that report reserved memory
        # separately can round differently, hence the 1 % allowance.
        assert abs(device.memory_mib - smi_total) <= max(1, smi_total // 100), (device.memory_mib, smi_total)
        assert re.fullmatch(r"GPU-[0-9a-f-]{36}", device.uuid)
        assert re.fullmatch(r"\d{1,2}\.\d{1,2}", device.compute_capability)
        # The maximum PCIe generation and width (what the GPU and its slot can do, not the
        # current, power-saving link state).
        smi_gen = _int_or_zero(gpu.findtext("pci/pci_gpu_link_info/pcie_gen/max_link_gen"))
        smi_width = _int_or_zero(gpu.findtext("pci/pci_gpu_link_info/link_widths/max_link_width"))
        assert device.pcie_generation == smi_gen
        assert device.pcie_width == smi_width


def test_compute_capability_and_numa_node_match_nvidia_smi(source: nvml.NvmlSource) -> None:
    inv = inventory.derive(source.scan())
    rows = smi.run("--query-gpu=uuid,compute_cap", "--format=csv,noheader").strip().splitlines()
    capability = {u.strip(): c.strip() for u, c in (row.split(",") for row in rows)}
    assert {d.uuid: d.compute_capability for d in inv.devices} == capability
    # topo -m's "NUMA Affinity" column; "N/A" where the platform does not say.
    lines = [ln for ln in smi.run("topo", "-m").splitlines() if ln.strip()]
    header = next(ln for ln in lines if "NUMA Affinity" in ln)
    column = next(i for i, cell in enumerate(header.split("\t")) if "NUMA Affinity" in cell)
    for device in inv.devices:
        row = next(ln for ln in lines if ln.split("\t")[0].strip() == f"GPU{device.index}")
        cell = row.split("\t")[column].strip()
        assert device.numa_node == (int(cell) if cell.isdigit() else -1), (device.index, row)


def _topo_matrix(text: str) -> dict[tuple[int, int], str]:
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    header = next(ln for ln in lines if re.search(r"\bGPU0\b", ln))
    columns = header.split()
    gpu_columns = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    matrix: dict[tuple[int, int], str] = {}
    for line in lines[lines.index(header) + 1 :]:
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        row = int(cells[0][3:])
        for col_name, value in zip(gpu_columns, cells[1:], strict=False):
            col = int(col_name[3:])
            if row < col:
                matrix[(row, col)] = value
    return matrix


def test_link_types_match_nvidia_smi_topo(source: nvml.NvmlSource) -> None:
    inv = inventory.derive(source.scan())
    if len(inv.devices) < 2:
        pytest.skip("one GPU: there are no pairs to compare with nvidia-smi topo -m")
    theirs = _topo_matrix(smi.run("topo", "-m"))
    ours = {(ln.a, ln.b): ln.type for ln in inv.links}
    assert ours == theirs


def test_mig_devices_match_nvidia_smi(source: nvml.NvmlSource, smi_xml: ET.Element) -> None:
    inv = inventory.derive(source.scan())
    by_uuid = {g.findtext("uuid"): g for g in smi_xml.findall("gpu")}
    for device in inv.devices:
        mode = (by_uuid[device.uuid].findtext("mig_mode/current_mig") or "N/A").strip()
        if mode == "N/A":
            assert device.mig is None or not device.mig.enabled
        else:
            assert device.mig is not None and device.mig.enabled == (mode == "Enabled")


def _gpu_instances(table: str) -> set[tuple[int, str, int, int]]:
    """(GPU index, profile, placement start, size) of each row of ``nvidia-smi mig -lgi``:
    ``|   0  MIG 1g.10gb          19        9          2:1     |``."""
    row = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+\d+\s+\d+\s+(\d+):(\d+)\s*\|")
    found = set()
    for line in table.splitlines():
        match = row.match(line)
        if match:
            gpu, profile, start, size = match.groups()
            found.add((int(gpu), profile, int(start), int(size)))
    return found


def test_mig_instances_match_nvidia_smi_mig_lgi(source: nvml.NvmlSource) -> None:
    """MIG UUIDs as ``nvidia-smi -L`` lists them; each GPU instance's profile and placement as
    ``nvidia-smi mig -lgi`` prints them."""
    inv = inventory.derive(source.scan())
    in_mig = [d for d in inv.devices if d.mig is not None and d.mig.enabled]
    if not in_mig:
        pytest.skip("no GPU is in MIG mode (nvidia-smi -i N -mig 1, then create instances)")
    listed = set(re.findall(r"UUID: (MIG-[0-9A-Za-z/-]+)\)", smi.run("-L")))
    ours = {m.uuid for d in in_mig for m in d.mig.devices}  # type: ignore[union-attr]
    assert ours == listed
    theirs = _gpu_instances(smi.run("mig", "-lgi"))
    placed = {
        (d.index, m.profile, m.placement_start, m.memory_slices)
        for d in in_mig
        for m in d.mig.devices  # type: ignore[union-attr]
    }
    assert placed == theirs
    assert all(m.compute_slices >= 1 for d in in_mig for m in d.mig.devices)  # type: ignore[union-attr]


async def test_health_events_can_be_registered_and_the_thread_stops(source: nvml.NvmlSource) -> None:
    source.scan()
    waiter = source.open_events()
    assert waiter.registered or waiter.unsupported
    got: list[Any] = []
    thread = health.EventThread(waiter, asyncio.get_running_loop(), got.append, timeout_ms=100)
    thread.start()
    await asyncio.sleep(0.3)
    thread.stop()
    await asyncio.to_thread(thread.join, 2.0)
    assert not thread.alive
    assert all(isinstance(e, health.HealthEvent) for e in got)


def test_samples_read_every_device(source: nvml.NvmlSource) -> None:
    facts = source.scan()
    samples = source.samples()
    assert [s.uuid for s in samples] == [d.uuid for d in facts.devices]
    for s in samples:
        assert s.memory_total_bytes is not None and s.memory_total_bytes > 0


# Holds a CUDA context on the first GPU until stdin closes (ctypes on libcuda: no CUDA toolkit).
_HOLD_CONTEXT = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
device, context = ctypes.c_int(), ctypes.c_void_p()
assert cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device) == 0
print("ready", flush=True)
sys.stdin.read()
"""


def test_compute_processes_match_nvidia_smi_query_compute_apps(source: nvml.NvmlSource) -> None:
    """A process holding a CUDA context is in the agent's samples as nvidia-smi lists it, and the
    agent tells it is in no pod (this test runs outside Kubernetes)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_CONTEXT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        facts = source.scan()
        deadline = time.monotonic() + 10
        while True:
            listed = smi.run("--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader")
            smi_pids = {
                (int(pid), uuid.strip())
                for pid, uuid in (line.split(",") for line in listed.splitlines() if line.strip())
            }
            if any(pid == holder.pid for pid, _ in smi_pids) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        ours = {(p.pid, s.uuid) for s in source.samples() for p in s.processes}
        assert (holder.pid, facts.devices[0].uuid) in smi_pids, listed
        assert ours == smi_pids
        mine = next(p for s in source.samples() for p in s.processes if p.pid == holder.pid)
        assert mine.pod_uid == ""
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=30)
