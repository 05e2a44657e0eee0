"""How long one allocation decision takes on a large cluster.

1,000 nodes x 8 GPUs (half NVSwitch H100 boxes, half PCIe L40S boxes), half of
all devices taken at random, claims of 1, 2, 4 and 8 GPUs and a 4 x 4-GPU gang, and
``leastFragmentation`` (which ranks every node) against a fixed workload.
Each case runs ``--decisions`` times, cycling over several taken-sets, and
reports p50/p99 in milliseconds; the explain cases run as ``gpualloc explain``
does, on the index (and, for comparison, on a list, where every node is
searched). Writes ``bench/results/allocator_decision.json``.

    .venv/bin/python bench/allocator_decision.py [--nodes 1000] [--decisions 200]
    .venv/bin/python bench/allocator_decision.py --sweep 100,300,1000,3000,10000 --decisions 100

The box builders here are reused by ``bench/quality_study.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import platform
import random
import statistics
import sys
import time

from controller import allocator, fragmentation
from controller.fragmentation import Shape
from controller.nodes import NodeIndex
from gpualloc.api import models

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
# leastFragmentation's workload, as the controller's recent claims give it: whole-GPU claims of
# each size, shares, and a fifth of the claims naming the H100s.
WORKLOAD = fragmentation.Workload(
    {
        Shape(gpus=1): 4.0,
        Shape(gpus=2): 2.0,
        Shape(gpus=4): 1.0,
        Shape(gpus=8): 1.0,
        Shape(gpus=1, milli=500): 2.0,
        Shape(gpus=1, products=("NVIDIA H100*",)): 2.5,
    }
)


def nvswitch_box(name: str, n: int = 8) -> models.NodeInventory:
    """An HGX-style board: every GPU on the NVSwitch fabric, 900 GB/s between any two."""
    devices = tuple(
        models.Device(
            index=i,
            minor=i,
            uuid=f"GPU-{name}-{i}",
            product="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            compute_capability="9.0",
            numa_node=i * 2 // n,
        )
        for i in range(n)
    )
    links = tuple(
        models.Link(a=a, b=b, type="NV18", nvlinks=18, bandwidth_gbps=900)
        for a, b in itertools.combinations(range(n), 2)
    )
    return models.NodeInventory(
        devices=devices,
        links=links,
        islands=(tuple(range(n)),),
        total=n,
        healthy=n,
        product=devices[0].product,
    )


def pcie_box(name: str, n: int = 8) -> models.NodeInventory:
    """PCIe only: pairs behind one switch (PIX, 64 GB/s), NODE within a socket (32), SYS across (16)."""
    devices = tuple(
        models.Device(
            index=i,
            minor=i,
            uuid=f"GPU-{name}-{i}",
            product="NVIDIA L40S",
            memory_mib=46068,
            compute_capability="8.9",
            numa_node=i * 2 // n,
        )
        for i in range(n)
    )
    links = []
    for a, b in itertools.combinations(range(n), 2):
        if a // 2 == b // 2:
            links.append(models.Link(a=a, b=b, type="PIX", bandwidth_gbps=64))
        elif a * 2 // n == b * 2 // n:
            links.append(models.Link(a=a, b=b, type="NODE", bandwidth_gbps=32))
        else:
            links.append(models.Link(a=a, b=b, type="SYS", bandwidth_gbps=16))
    return models.NodeInventory(
        devices=devices, links=tuple(links), total=n, healthy=n, product=devices[0].product
    )


def cluster(n_nodes: int) -> list[tuple[str, models.NodeInventory]]:
    """Node names and inventories, alternating NVSwitch and PCIe boxes."""
    out = []
    for i in range(n_nodes):
        name = f"gpu-{i:04d}"
        out.append((name, nvswitch_box(name) if i % 2 == 0 else pcie_box(name)))
    return out


def views(
    boxes: list[tuple[str, models.NodeInventory]], taken: dict[str, frozenset[str]]
) -> list[allocator.NodeView]:
    return [
        allocator.NodeView(
            name=name,
            labels={"kubernetes.io/hostname": name},
            unschedulable=False,
            node_present=True,
            ready=True,
            inventory=inv,
            taken=taken.get(name, frozenset()),
        )
        for name, inv in boxes
    ]


def gpu_claim(
    count: int, *, replicas: int = 1, strategy: str = "binpack", name: str = "bench"
) -> models.GpuClaim:
    return models.GpuClaim(
        metadata=models.ObjectMeta(name=name, namespace="bench", creation_timestamp="2025-01-01T00:00:00Z"),
        spec=models.GpuClaimSpec(
            devices=models.DeviceRequest(count=count), strategy=strategy, replicas=replicas
        ),
    )


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    pos = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[pos]


def measure(
    claim: models.GpuClaim,
    states: list[list[allocator.NodeView]],
    decisions: int,
    *,
    indexed: bool = False,
    explain: bool = False,
    cold: bool = False,
    workload: fragmentation.Workload | None = None,
) -> dict[str, object]:
    """``decisions`` allocate() calls cycling over ``states``: wall and CPU ms per call.

    ``indexed``: each state as a ``NodeIndex``, built once (the controller keeps
    one up to date from watch events), as the controller calls allocate().
    """
    inputs: list[list[allocator.NodeView] | NodeIndex] = [NodeIndex(s) if indexed else s for s in states]
    allocator.allocate(claim, inputs[0], explain=explain, workload=workload)  # warm-up
    samples: list[float] = []
    cpu: list[float] = []
    placed = 0
    for i in range(decisions):
        nodes = inputs[i % len(inputs)]
        if cold:
            assert isinstance(nodes, list)
            nodes = [
                dataclasses.replace(v, inventory=dataclasses.replace(v.inventory)) if v.inventory else v
                for v in nodes
            ]
        t0, c0 = time.perf_counter(), time.thread_time()
        decision = allocator.allocate(claim, nodes, explain=explain, workload=workload)
        cpu.append((time.thread_time() - c0) * 1000)
        samples.append((time.perf_counter() - t0) * 1000)
        placed += bool(decision.allocations)
    return {
        "search": "index" if indexed else "full",
        "explain": explain,
        "cold": cold,
        "decisions": decisions,
        "placed": placed,
        "p50_ms": round(statistics.median(samples), 3),
        "p99_ms": round(_percentile(samples, 0.99), 3),
        "mean_ms": round(statistics.fmean(samples), 3),
        "cpu_p50_ms": round(statistics.median(cpu), 3),
        "cpu_p99_ms": round(_percentile(cpu, 0.99), 3),
    }


def taken_states(boxes: list[tuple[str, models.NodeInventory]], count: int) -> list[list[allocator.NodeView]]:
    """``count`` clusters with half of all devices taken at random."""
    states = []
    for s in range(count):
        rng = random.Random(s)
        taken = {name: frozenset(d.uuid for d in inv.devices if rng.random() < 0.5) for name, inv in boxes}
        states.append(views(boxes, taken))
    return states


def sweep(sizes: list[int], decisions: int, out: pathlib.Path) -> None:
    """Decision time against node count, full search and index, for a 1- and a 4-GPU claim; a plot."""
    rows = []
    for n in sizes:
        states = taken_states(cluster(n), 3)
        for label, claim in (("1 GPU", gpu_claim(1)), ("4 GPUs", gpu_claim(4))):
            for indexed in (False, True):
                row = {"nodes": n, "case": label, **measure(claim, states, decisions, indexed=indexed)}
                rows.append(row)
                print(
                    f"{n:6d} nodes  {label:7s} {row['search']:5s}  cpu p50 {row['cpu_p50_ms']:8.3f} ms"
                    f"  p99 {row['cpu_p99_ms']:8.3f} ms"
                )
    result = {
        "benchmark": "allocator_scaling",
        "note": "CPU ms per allocate() call (thread_time); half of all GPUs taken; 8 GPUs per node",
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg()[0],
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in ("1 GPU", "4 GPUs"):
        for search, style in (("full", "--"), ("index", "-")):
            points = [
                (r["nodes"], r["cpu_p99_ms"]) for r in rows if r["case"] == label and r["search"] == search
            ]
            xs, ys = zip(*points, strict=True)
            name = "full search (before)" if search == "full" else "node index (now)"
            ax.plot(xs, ys, style, marker="o", label=f"{label}, {name}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GPU nodes (8 GPUs each, half taken)")
    ax.set_ylabel("CPU per decision, p99 (ms)")
    ax.set_title("allocator decision time against cluster size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out.with_suffix('.png')}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--decisions", type=int, default=200)
    parser.add_argument("--states", type=int, default=5, help="distinct random taken-sets to cycle over")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "allocator_decision.json")
    parser.add_argument(
        "--sweep",
        default="",
        help="comma-separated node counts: decision time against cluster size, with a plot "
        "(bench/results/allocator_scaling.json and .png)",
    )
    args = parser.parse_args(argv)
    if args.sweep:
        sizes = [int(n) for n in args.sweep.split(",")]
        sweep(sizes, args.decisions, RESULTS / "allocator_scaling.json")
        return 0

    boxes = cluster(args.nodes)
    states = taken_states(boxes, args.states)

    # (label, claim, explain, cold): cold = fresh inventory objects every decision, so the
    # allocator's per-inventory memo never hits (a caller that re-parses every GpuNodeStatus).
    # Each case is measured with the full search (a list of views) and, where it applies, with
    # the index the controller keeps and `gpualloc explain` builds (cold always searches every
    # node; explain on a list searches every node, on the index only the nodes it shows).
    cases: list[tuple[str, models.GpuClaim, bool, bool]] = [
        ("1 GPU", gpu_claim(1), False, False),
        ("2 GPUs", gpu_claim(2), False, False),
        ("4 GPUs", gpu_claim(4), False, False),
        ("8 GPUs", gpu_claim(8), False, False),
        ("4 x 4-GPU gang", gpu_claim(4, replicas=4), False, False),
        ("2 GPUs, spread", gpu_claim(2, strategy="spread"), False, False),
        ("2 GPUs, leastFragmentation", gpu_claim(2, strategy=fragmentation.STRATEGY), False, False),
        ("2 GPUs, explain", gpu_claim(2), True, False),
        ("4 GPUs, explain", gpu_claim(4), True, False),
        ("9 GPUs, explain (fits nowhere)", gpu_claim(9), True, False),
        ("2 GPUs, cold (fresh inventories)", gpu_claim(2), False, True),
    ]
    rows = []
    for label, claim, explain, cold in cases:
        for indexed in (False, True) if not cold else (False,):
            workload = WORKLOAD if claim.spec.strategy == fragmentation.STRATEGY else None
            found = measure(
                claim, states, args.decisions, indexed=indexed, explain=explain, cold=cold, workload=workload
            )
            row = {"case": label, **found}
            rows.append(row)
            print(
                f"{label:40s} {row['search']:5s} "
                f"wall p50 {row['p50_ms']:8.3f} ms  p99 {row['p99_ms']:8.3f} ms  "
                f"cpu p50 {row['cpu_p50_ms']:8.3f} ms  p99 {row['cpu_p99_ms']:8.3f} ms  "
                f"placed {row['placed']}/{args.decisions}"
            )

    free = sum(len(inv.devices) - len(v.taken) for v, (_, inv) in zip(states[0], boxes, strict=True))
    result = {
        "benchmark": "allocator_decision",
        "nodes": args.nodes,
        "gpus_per_node": 8,
        "mix": "alternating NVSwitch H100 (900 GB/s all pairs) and PCIe L40S (PIX 64 / NODE 32 / SYS 16)",
        "taken_fraction": 0.5,
        "free_gpus_state0": free,
        "states": args.states,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "note": (
            "per allocate() call: wall clock (perf_counter) and the thread's CPU time (thread_time), "
            "on a shared 2-core machine with other work running, so wall p99 includes waiting for a CPU; "
            "explain=True on a list searches every node, on the index the chosen node and 16 more "
            "that fit (allocator._explain_indexed); cold = fresh inventory objects (no memo hits); "
            "search=index: the NodeIndex the controller keeps, built once per state"
        ),
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
