"""Allocation quality over time: binpack, spread, random and a naive first-fit.

A seeded synthetic trace (Poisson arrivals, exponential lifetimes, claim sizes
1/2/4/8 GPUs with a skew towards small claims) is replayed on a fixed cluster
(32 nodes x 8 GPUs: 16 NVSwitch H100 boxes and 16 PCIe L40S boxes), each
strategy calling ``controller.allocator.allocate`` directly against a simulated
lease set (the UUIDs held by running claims). A claim that does not fit is
dropped, not queued, so every strategy sees the same trace.

Measured per strategy and seed:

* admitted before the first failure (from an empty cluster);
* acceptance overall and for 8-GPU claims;
* fragmentation: free GPUs *stranded* on nodes that cannot host an 8-GPU claim
  (nodes with fewer than 8 free), as a share of all free GPUs, sampled on a
  fixed time grid and averaged over the steady state (t >= 2 mean lifetimes);
* the least pairwise bandwidth of multi-GPU placements on PCIe boxes.

Writes ``bench/results/quality_study.json`` and ``bench/results/quality_study.png``
and prints a markdown table.

    .venv/bin/python bench/quality_study.py [--seeds 10] [--arrivals 3000]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import pathlib
import random
import statistics
import sys
from collections.abc import Callable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import allocator_decision as boxes_mod

from controller import allocator
from gpualloc.api import models

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
SIZES = (1, 2, 4, 8)
WEIGHTS = (0.45, 0.25, 0.18, 0.12)
STRATEGIES = ("binpack", "spread", "random", "first-fit")
GPUS_PER_NODE = 8


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    time: float
    lifetime: float
    size: int


def trace(seed: int, *, arrivals: int, load: float, capacity: int) -> list[Arrival]:
    """Poisson arrivals at an offered load of ``load`` x capacity, mean lifetime 1."""
    rng = random.Random(seed)
    mean_size = sum(s * w for s, w in zip(SIZES, WEIGHTS, strict=True))
    rate = load * capacity / mean_size  # arrivals per mean lifetime
    t, out = 0.0, []
    for _ in range(arrivals):
        t += rng.expovariate(rate)
        out.append(Arrival(time=t, lifetime=rng.expovariate(1.0), size=rng.choices(SIZES, WEIGHTS)[0]))
    return out


Placer = Callable[[int, dict[str, set[str]], int], tuple[str, tuple[models.Device, ...]] | None]


def make_placer(strategy: str, cluster: Sequence[tuple[str, models.NodeInventory]], seed: int) -> Placer:
    inventories = dict(cluster)

    if strategy == "first-fit":

        def first_fit(
            size: int, held: dict[str, set[str]], step: int
        ) -> tuple[str, tuple[models.Device, ...]] | None:
            for name in sorted(inventories):
                free = [d for d in inventories[name].devices if d.uuid not in held[name]]
                if len(free) >= size:
                    return name, tuple(sorted(free, key=lambda d: d.index)[:size])
            return None

        return first_fit

    def via_allocator(
        size: int, held: dict[str, set[str]], step: int
    ) -> tuple[str, tuple[models.Device, ...]] | None:
        views = [
            allocator.NodeView(
                name=name,
                labels={},
                unschedulable=False,
                node_present=True,
                ready=True,
                inventory=inv,
                taken=frozenset(held[name]),
            )
            for name, inv in cluster
        ]
        claim = boxes_mod.gpu_claim(size, strategy=strategy)
        decision = allocator.allocate(claim, views, seed=seed * 1_000_003 + step)
        if not decision.allocations:
            return None
        (alloc,) = decision.allocations
        by_uuid = {d.uuid: d for d in inventories[alloc.node_name].devices}
        return alloc.node_name, tuple(by_uuid[ref.uuid] for ref in alloc.devices)

    return via_allocator


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    admitted: int
    failed: int
    admitted_before_first_failure: int
    acceptance: float
    acceptance_by_size: dict[str, float | None]
    pcie_multi_gpu_least_gbps_mean: float | None
    stranded_share_series: list[float]


def least_bandwidth(inv: models.NodeInventory, devices: Sequence[models.Device]) -> int:
    table = {(min(link.a, link.b), max(link.a, link.b)): link.bandwidth_gbps for link in inv.links}
    return min(
        table.get((min(a.index, b.index), max(a.index, b.index)), 0)
        for a, b in itertools.combinations(devices, 2)
    )


def replay(
    strategy: str,
    cluster: Sequence[tuple[str, models.NodeInventory]],
    arrivals: Sequence[Arrival],
    seed: int,
    grid: Sequence[float],
) -> Run:
    place = make_placer(strategy, cluster, seed)
    inventories = dict(cluster)
    held: dict[str, set[str]] = {name: set() for name, _ in cluster}
    departures: list[tuple[float, int, str, tuple[str, ...]]] = []
    admitted = failed = 0
    first_failure: int | None = None
    by_size = {s: [0, 0] for s in SIZES}  # size -> [admitted, arrived]
    pcie_bw: list[int] = []
    stranded_series: list[float] = []
    grid_iter = iter(grid)
    next_sample = next(grid_iter, None)

    def sample_until(t: float) -> None:
        nonlocal next_sample
        while next_sample is not None and next_sample <= t:
            free_per_node = [GPUS_PER_NODE - len(h) for h in held.values()]
            free = sum(free_per_node)
            stranded = sum(f for f in free_per_node if f < GPUS_PER_NODE)
            stranded_series.append(stranded / free if free else 0.0)
            next_sample = next(grid_iter, None)

    for step, arrival in enumerate(arrivals):
        while departures and departures[0][0] <= arrival.time:
            t, _, name, uuids = heapq.heappop(departures)
            sample_until(t)
            held[name].difference_update(uuids)
        sample_until(arrival.time)
        by_size[arrival.size][1] += 1
        placed = place(arrival.size, held, step)
        if placed is None:
            failed += 1
            if first_failure is None:
                first_failure = admitted
            continue
        name, devices = placed
        assert not held[name] & {d.uuid for d in devices}, "double booking"
        held[name].update(d.uuid for d in devices)
        heapq.heappush(
            departures, (arrival.time + arrival.lifetime, step, name, tuple(d.uuid for d in devices))
        )
        admitted += 1
        by_size[arrival.size][0] += 1
        if len(devices) > 1 and not inventories[name].islands:
            pcie_bw.append(least_bandwidth(inventories[name], devices))
    return Run(
        admitted=admitted,
        failed=failed,
        admitted_before_first_failure=first_failure if first_failure is not None else admitted,
        acceptance=admitted / len(arrivals),
        acceptance_by_size={str(s): (a / n if n else None) for s, (a, n) in by_size.items()},
        pcie_multi_gpu_least_gbps_mean=statistics.fmean(pcie_bw) if pcie_bw else None,
        stranded_share_series=stranded_series,
    )


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--arrivals", type=int, default=3000)
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--load", type=float, default=0.9, help="offered load as a share of all GPUs")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "quality_study.json")
    parser.add_argument("--plot", type=pathlib.Path, default=RESULTS / "quality_study.png")
    args = parser.parse_args(argv)

    cluster = boxes_mod.cluster(args.nodes)
    capacity = args.nodes * GPUS_PER_NODE
    traces = {
        seed: trace(seed, arrivals=args.arrivals, load=args.load, capacity=capacity)
        for seed in range(args.seeds)
    }
    horizon = min(t[-1].time for t in traces.values())
    step = 0.05
    grid = [i * step for i in range(int(horizon / step) + 1)]
    steady_from = next(i for i, t in enumerate(grid) if t >= 2.0)

    runs: dict[str, list[Run]] = {s: [] for s in STRATEGIES}
    for strategy in STRATEGIES:
        for seed, arrivals in traces.items():
            runs[strategy].append(replay(strategy, cluster, arrivals, seed, grid))
        print(f"replayed {strategy}", file=sys.stderr)

    summary: dict[str, dict[str, float | None]] = {}
    for strategy, results in runs.items():
        before = [float(r.admitted_before_first_failure) for r in results]
        acc = [r.acceptance for r in results]
        acc8 = [r.acceptance_by_size["8"] or 0.0 for r in results]
        stranded = [statistics.fmean(r.stranded_share_series[steady_from:]) for r in results]
        bws = [
            r.pcie_multi_gpu_least_gbps_mean for r in results if r.pcie_multi_gpu_least_gbps_mean is not None
        ]
        summary[strategy] = {
            "admitted_before_first_failure_mean": _mean_sd(before)[0],
            "admitted_before_first_failure_sd": _mean_sd(before)[1],
            "acceptance_mean": _mean_sd(acc)[0],
            "acceptance_8gpu_mean": _mean_sd(acc8)[0],
            "stranded_share_mean": _mean_sd(stranded)[0],
            "stranded_share_sd": _mean_sd(stranded)[1],
            "pcie_multi_gpu_least_gbps_mean": _mean_sd(bws)[0] if bws else None,
        }

    lines = [
        f"Cluster {args.nodes} nodes x {GPUS_PER_NODE} GPUs (half NVSwitch, half PCIe), "
        f"offered load {args.load:.0%}, {args.arrivals} arrivals x {args.seeds} seeds, "
        f"size weights {dict(zip(SIZES, WEIGHTS, strict=True))}",
        "",
        "| strategy | admitted before first failure | acceptance | 8-GPU acceptance "
        "| stranded free GPUs (steady state) | PCIe multi-GPU least GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for strategy, s in summary.items():
        bw = s["pcie_multi_gpu_least_gbps_mean"]
        bw_text = f"{bw:.1f}" if bw is not None else "n/a"
        lines.append(
            f"| {strategy} | {s['admitted_before_first_failure_mean']:.0f} "
            f"± {s['admitted_before_first_failure_sd']:.0f} "
            f"| {s['acceptance_mean']:.1%} | {s['acceptance_8gpu_mean']:.1%} "
            f"| {s['stranded_share_mean']:.1%} ± {s['stranded_share_sd']:.1%} "
            f"| {bw_text} |"
        )
    table = "\n".join(lines)
    print(table)

    _plot(args.plot, grid, runs, summary, steady_from)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "quality_study",
                "nodes": args.nodes,
                "gpus_per_node": GPUS_PER_NODE,
                "mix": "alternating NVSwitch H100 and PCIe L40S boxes (bench/allocator_decision.py)",
                "sizes": dict(zip(map(str, SIZES), WEIGHTS, strict=True)),
                "offered_load": args.load,
                "arrivals": args.arrivals,
                "seeds": args.seeds,
                "mean_lifetime": 1.0,
                "sample_step": step,
                "steady_state_from": 2.0,
                "summary": summary,
                "per_seed": {
                    strategy: [
                        {k: v for k, v in dataclasses.asdict(r).items() if k != "stranded_share_series"}
                        for r in results
                    ]
                    for strategy, results in runs.items()
                },
                "markdown": table,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out} and {args.plot}", file=sys.stderr)
    return 0


COLOURS = {"binpack": "#1b9e77", "spread": "#d95f02", "random": "#7570b3", "first-fit": "#666666"}


def _plot(
    path: pathlib.Path,
    grid: Sequence[float],
    runs: dict[str, list[Run]],
    summary: dict[str, dict[str, float | None]],
    steady_from: int,
) -> None:
    fig, (ax_time, ax_bar) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2, 1]})
    window = 10  # samples: a rolling mean over half a lifetime keeps the lines readable
    for strategy, results in runs.items():
        series = [r.stranded_share_series for r in results]
        n = min(len(s) for s in series)
        mean = [statistics.fmean(s[i] for s in series) * 100 for i in range(n)]
        smooth = [statistics.fmean(mean[max(0, i - window + 1) : i + 1]) for i in range(n)]
        ax_time.plot(grid[:n], smooth, label=strategy, color=COLOURS[strategy], linewidth=1.6)
    ax_time.axvspan(grid[steady_from], grid[-1], color="#f2f2f2", zorder=0, label="steady state (averaged)")
    ax_time.set_xlabel("time (mean claim lifetimes)")
    ax_time.set_ylabel("free GPUs stranded on nodes with < 8 free (%)")
    ax_time.set_title(
        f"Fragmentation: free GPUs that cannot serve an 8-GPU claim\n"
        f"(mean of {len(next(iter(runs.values())))} seeds, rolling mean over 0.5 lifetimes)",
        fontsize=11,
    )
    ax_time.set_ylim(0, 105)
    ax_time.legend(loc="lower right", fontsize=9, framealpha=0.95)
    ax_time.grid(alpha=0.3)

    names = list(summary)
    means = [summary[s]["admitted_before_first_failure_mean"] or 0 for s in names]
    ax_bar.bar(range(len(names)), means, color=[COLOURS[s] for s in names], alpha=0.85, width=0.65)
    top = 1.0
    for x, strategy in enumerate(names):
        points = [r.admitted_before_first_failure for r in runs[strategy]]
        top = max(top, *points)
        jitter = [x + (i - (len(points) - 1) / 2) * 0.04 for i in range(len(points))]
        ax_bar.scatter(jitter, points, s=14, color="black", zorder=3, label="one seed" if x == 0 else None)
        ax_bar.text(
            x, 4, f"{means[x]:.0f}", ha="center", va="bottom", color="white", fontsize=10, weight="bold"
        )
    ax_bar.set_xticks(
        range(len(names)),
        [f"{s}\n({summary[s]['acceptance_mean'] or 0:.0%} acc.)" for s in names],
        fontsize=9,
    )
    ax_bar.set_ylabel("claims admitted before the first failure")
    ax_bar.set_xlabel("(acc. = share of all arrivals accepted over the whole trace)", fontsize=9)
    ax_bar.set_title("Admitted before the first failure\n(bar: mean; dots: seeds)", fontsize=11)
    ax_bar.set_ylim(0, top * 1.1)
    ax_bar.legend(loc="upper right", fontsize=9)
    ax_bar.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
