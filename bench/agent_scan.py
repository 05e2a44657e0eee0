"""What the node agent costs: CPU time per scan and the memory of a running agent.

1. CPU time (``time.process_time``) per call, averaged over ``--rounds`` calls:
   * ``SimulatedSource.scan`` on ``h100-sxm-8`` (8 GPUs, 18 NVLinks each to 4 NVSwitches);
   * ``inventory.derive`` of that box (links for 28 pairs, NVSwitch fabric, islands);
   * one full agent round: scan + carry_lost + derive + conditions + the
     compare-with-server check that decides whether to write;
   * ``NvmlSource.scan`` against the in-process fake NVML of tests/unit (the
     Python side of about 500 NVML calls; a real driver adds its own time).
2. Resident memory (``VmRSS``/``VmHWM`` from ``/proc/<pid>/status``) and CPU use
   of a real ``gpualloc agent --source simulated`` process publishing to the
   local kube-apiserver (the one the tests use), sampled once it has published.

With ``--source nvml``, on a machine with an NVIDIA driver, the agent process
reads this machine's GPUs through the real driver instead, and the CPU figures
add ``NvmlSource.scan`` against that driver.

Prints the figures and writes ``bench/results/agent_scan.json`` (``agent_scan_nvml.json``).

    .venv/bin/python bench/agent_scan.py [--source nvml] [--rounds 2000] [--settle 10] [--window 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import procfs

from agent import health, inventory, nvml, publishing, simulated
from gpualloc.api import codecs

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROFILE = "h100-sxm-8"


def cpu_us_per_call(fn: Callable[[], Any], rounds: int) -> float:
    fn()  # warm caches
    start = time.process_time()
    for _ in range(rounds):
        fn()
    return (time.process_time() - start) / rounds * 1e6


def scan_figures(rounds: int, real_driver: bool) -> dict[str, float]:
    source = simulated.SimulatedSource(simulated.load_profile(PROFILE), "bench-node")
    facts = source.scan()
    inv = inventory.derive(facts)
    server_status = codecs.encode(inv)

    def full_round() -> None:
        scanned = health.carry_lost(facts, source.scan())
        derived = inventory.derive(scanned)
        conds = publishing.conditions(source="simulated", source_error="", devices=derived.devices)
        publishing.status_differs(server_status, dataclasses.replace(derived, conditions=conds))

    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    import fake_pynvml  # type: ignore[import-not-found]

    nvml_source = nvml.NvmlSource(
        nvml_module=fake_pynvml.FakeNvml(fake_pynvml.h100_nvswitch_box()), sysfs_root="/nonexistent"
    )
    assert len(inventory.derive(nvml_source.scan()).links) == 28
    figures = {
        "simulated_scan_us": cpu_us_per_call(source.scan, rounds),
        "derive_8gpu_nvswitch_us": cpu_us_per_call(lambda: inventory.derive(facts), rounds),
        "agent_round_us": cpu_us_per_call(full_round, rounds),
        "nvml_scan_fake_driver_us": cpu_us_per_call(nvml_source.scan, max(1, rounds // 10)),
    }
    if real_driver:
        real = nvml.NvmlSource()
        try:
            figures["nvml_scan_real_driver_us"] = cpu_us_per_call(real.scan, max(1, rounds // 10))
        finally:
            real.close()
    return figures


def gpu_count() -> int:
    """How many GPUs the real driver reports here (the agent must publish that many)."""
    source = nvml.NvmlSource()
    try:
        return len(source.scan().devices)
    finally:
        source.close()


def agent_process_figures(settle: float, window: float, source: str) -> dict[str, Any]:
    from gpualloc.devcluster import binaries, cluster

    paths = binaries.ensure(["kube-apiserver", "etcd"], progress=lambda m: print(f"[control plane] {m}"))
    with tempfile.TemporaryDirectory(prefix="agent-bench-") as tmp:
        plane = cluster.ControlPlane(pathlib.Path(tmp), binaries=paths, progress=lambda m: None)
        plane.start()
        proc: subprocess.Popen[bytes] | None = None
        try:
            plane.apply_crds(ROOT / "helm" / "gpualloc" / "crds")
            expected = 8 if source == "simulated" else gpu_count()
            argv = [
                sys.executable,
                "-m",
                "gpualloc.cli",
                "agent",
                "--node-name=bench-node",
                f"--source={source}",
                f"--profile={PROFILE}",  # read by the simulated source only
                f"--kubeconfig={plane.kubeconfig}",
                # As the chart runs it: watching its device Leases and its node's pods (usage audit).
                "--lease-namespace=default",
                "--heartbeat-interval=10",
                "--health-port=0",
                "--metrics-port=0",
                "--log-level=WARNING",
            ]
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the agent exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
                    )
                try:
                    obj = plane.request("GET", "/apis/gpu.scheduling/v1/gpunodestatuses/bench-node")
                    if obj.get("status", {}).get("total") == expected:
                        break
                except cluster.RequestError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the agent did not publish within 60 s")
                time.sleep(0.2)
            time.sleep(settle)
            cpu_start, wall_start = procfs.cpu_seconds(proc.pid), time.monotonic()
            rss = []
            while time.monotonic() - wall_start < window:
                rss.append(procfs.memory_kib(proc.pid)["VmRSS"])
                time.sleep(1.0)
            cpu_used = procfs.cpu_seconds(proc.pid) - cpu_start
            wall = time.monotonic() - wall_start
            status = procfs.memory_kib(proc.pid)
            return {
                "gpus": expected,
                "rss_mib_last": status["VmRSS"] / 1024,
                "rss_mib_max": max(rss) / 1024,
                "hwm_mib": status["VmHWM"] / 1024,
                "idle_cpu_percent": 100.0 * cpu_used / wall,
                "window_s": wall,
            }
        finally:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            plane.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the first publish")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of RSS and CPU sampling")
    parser.add_argument("--skip-process", action="store_true", help="only the in-process CPU figures")
    parser.add_argument(
        "--source",
        choices=("simulated", "nvml"),
        default="simulated",
        help="what the agent process reads: the simulated box, or this machine's GPUs through NVML",
    )
    args = parser.parse_args()

    scans = scan_figures(args.rounds, real_driver=args.source == "nvml")
    print(f"CPU per call, {PROFILE} (8 GPUs, NVSwitch), mean of {args.rounds}:")
    for key, value in scans.items():
        print(f"  {key:<28} {value:9.1f} us")
    process: dict[str, Any] | None = None
    if not args.skip_process:
        process = agent_process_figures(args.settle, args.window, args.source)
        what = f"simulated {PROFILE}" if args.source == "simulated" else "this machine's GPUs through NVML"
        print(f"running agent ({what}, publishing to a local kube-apiserver):")
        rss, peak, hwm = process["rss_mib_last"], process["rss_mib_max"], process["hwm_mib"]
        print(f"  VmRSS {rss:.1f} MiB (max {peak:.1f}, HWM {hwm:.1f})")
        cpu, window = process["idle_cpu_percent"], process["window_s"]
        print(f"  CPU while idle {cpu:.2f} % of one core over {window:.0f} s")

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "source": args.source,
        "profile": PROFILE,
        "rounds": args.rounds,
        "cpu_us_per_call": scans,
        "agent_process": process,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
    }
    path = RESULTS / ("agent_scan.json" if args.source == "simulated" else "agent_scan_nvml.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
