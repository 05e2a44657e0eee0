"""Two versions of the webhook under the same load, paired: CPU per admission, new ÷ old.

    .venv/bin/python bench/webhook_paired.py OLD_REV [--new NEW_REV] [--rounds 12]

Why: on this shared 2-CPU VM a webhook's CPU per request drifts by ±10% from
minute to minute, and between two processes of the same code. That is more than
most changes to the webhook save, and ``webhook_vegeta.py``'s sequential sweeps
(a minute per server) cannot tell such a change from the drift. Here both
versions run side by side and take turns, a few seconds each, so the drift falls
on both alike.

What runs, all on 127.0.0.1:

* each version is ``git archive``d into a temporary directory and run from it as
  ``gpualloc webhook``, interpreted, with this checkout's virtual environment; the
  new one is the working tree unless ``--new`` names a revision;
* a real kube-apiserver + etcd holds the benchmark's Allocated claim (as in
  ``webhook_vegeta.py``, whose helpers this uses), and the request is its 11.8 KB review;
* both webhooks are pinned to CPU 0, vegeta and the API server to CPU 1.

Per round: both webhooks are started fresh (so each round draws new hash seeds
and memory layouts), their answers are checked equal, each gets a 2 s warm-up,
then ``--steps`` pairs of 5 s closed-loop vegeta steps at 16 connections,
alternating, the first server alternating between rounds. A round's figure is
each server's median CPU per request over its steps (``/proc``), and the ratio
new ÷ old. The summary is the median ratio over rounds.

Writes bench/results/webhook_paired.json and prints each round.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import local_plane  # noqa: E402
import webhook_request as request_shape  # noqa: E402
import webhook_vegeta as vegeta_bench  # noqa: E402

from gpualloc.devcluster import binaries, cluster  # noqa: E402

RESULT = ROOT / "bench" / "results" / "webhook_paired.json"
WORKERS = 16
STEP_SECONDS = 5.0


def export(revision: str, into: Path) -> Path:
    """The tree of ``revision`` in ``into`` (``git archive``), which is returned."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def start_webhook(
    source: Path, port: int, certs: tuple[str, str, str], kubeconfig: Path
) -> subprocess.Popen[bytes]:
    """``gpualloc webhook`` from ``source``, interpreted, pinned to the servers' CPU."""
    _, cert, key = certs
    argv = [
        "taskset", "-c", str(vegeta_bench.SERVER_CPU),
        str(ROOT / ".venv" / "bin" / "python"), "-m", "gpualloc.cli",
        *vegeta_bench.webhook_args(cert, key, port, kubeconfig),
    ]  # fmt: skip
    env = {"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(argv, cwd=source, env=env, stdout=subprocess.DEVNULL)


def one_round(
    index: int,
    sources: dict[str, Path],
    certs: tuple[str, str, str],
    plane: Any,
    tmp: Path,
    steps: int,
    vegeta: Path,
) -> dict[str, Any]:
    ca = certs[0]
    body = (tmp / "review.json").read_bytes()
    ports = dict(zip(sources, cluster.free_ports(len(sources)), strict=True))
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, source in sources.items():
            processes[name] = start_webhook(source, ports[name], certs, plane.kubeconfig)
        shapes = []
        for name, process in processes.items():
            vegeta_bench.wait_ready(ports[name], ca, "/readyz", process)
            shapes.append(vegeta_bench.answer_shape(vegeta_bench.post_review(ports[name], ca, body)))
            targets = tmp / f"targets-{name}.txt"
            targets.write_text(
                f"POST https://127.0.0.1:{ports[name]}/mutate?timeout=5s\n"
                f"Content-Type: application/json\n@{tmp / 'review.json'}\n"
            )
            vegeta_bench.attack(vegeta, targets, ca, process.pid, tmp, "warm", duration=2, workers=WORKERS)
        if shapes[0] != shapes[1]:
            raise RuntimeError(f"the two versions answer differently: {shapes}")
        order = list(processes) if index % 2 == 0 else list(reversed(processes))
        cpu: dict[str, list[float]] = {name: [] for name in processes}
        for _ in range(steps):
            for name in order:
                report = vegeta_bench.attack(
                    vegeta, tmp / f"targets-{name}.txt", ca, processes[name].pid, tmp, "step",
                    duration=STEP_SECONDS, workers=WORKERS,
                )  # fmt: skip
                if report["errors"]:
                    raise RuntimeError(f"{name}: {report['errors']} errors: {report['error_samples']}")
                cpu[name].append(report["server_cpu_us_per_request"])
    finally:
        vegeta_bench.stop_all(list(processes.values()))
    medians = {name: statistics.median(values) for name, values in cpu.items()}
    return {
        "first": order[0],
        "cpu_us_per_request": cpu,
        "median": medians,
        "ratio": medians["new"] / medians["old"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="webhook-paired-") as scratch:
        tmp = Path(scratch)
        sources = {"old": export(args.old, tmp / "old")}
        sources["new"] = export(args.new, tmp / "new") if args.new else ROOT
        certs = request_shape.make_certs(tmp / "certs")
        (tmp / "review.json").write_bytes(request_shape.review_body())
        bins = binaries.ensure(["etcd", "kube-apiserver", "vegeta"])
        plane = vegeta_bench.start_cluster(tmp / "cluster", bins)
        rounds = []
        try:
            for index in range(args.rounds):
                result = one_round(index, sources, certs, plane, tmp, args.steps, bins["vegeta"])
                rounds.append(result)
                print(
                    f"round {index + 1}/{args.rounds}: old {result['median']['old']:.1f} µs, "
                    f"new {result['median']['new']:.1f} µs per request, new/old {result['ratio']:.3f}",
                    flush=True,
                )
        finally:
            plane.stop()
    ratios = [r["ratio"] for r in rounds]
    return {
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["bench/webhook_paired.py", *sys.argv[1:]]),
        "old": args.old,
        "new": args.new or "working tree",
        "workers": WORKERS,
        "step_seconds": STEP_SECONDS,
        "rounds": rounds,
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", help="the revision to compare against (e.g. HEAD~1)")
    parser.add_argument("--new", default="", help="a revision instead of the working tree")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2, help="steps of each server per round")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    report = run(args)
    local_plane.write(args.out, report)
    low, high = report["ratio_range"]
    median = report["ratio_median"]
    print(f"new/old CPU per request: median {median:.3f} over {args.rounds} rounds ({low:.3f} to {high:.3f})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
