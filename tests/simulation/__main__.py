"""Explore schedules of the deterministic simulation, or replay one with its trace.

    python -m tests.simulation --schedules 10000 --seed 0   # seeds 0..9999, prints schedules/s
    python -m tests.simulation --seed 1234 --trace          # one schedule, every step printed
    python -m tests.simulation --long                       # 1,000,000 schedules on every core

A violation prints its seed, the invariant's message and the last lines of
the schedule's trace (replayed: a schedule depends on its seed only), and the
exit status is 1.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

from tests.simulation import scheduler

LONG = 1_000_000
PROGRESS_EVERY = 5.0  # seconds


def _replay(seed: int, steps: int | None, without: frozenset[str], tail: int | None) -> int:
    with scheduler.Runner() as runner:
        result = runner.run(seed, steps=steps, without=without)
    lines = result.trace if tail is None else result.trace[-tail:]
    if tail is not None and len(result.trace) > tail:
        print(f"... ({len(result.trace) - tail} earlier trace lines; --seed {seed} --trace shows all)")
    print("\n".join(lines))
    summary = ", ".join(f"{k} {v}" for k, v in sorted(result.stats.items()))
    print(f"seed {seed}: {result.steps} steps; {summary}")
    if result.violation is not None:
        print(f"VIOLATION at seed {seed}: {result.violation}")
        return 1
    print(f"seed {seed}: no violation")
    return 0


def _explore(
    first: int, total: int, workers: int, steps: int | None, without: frozenset[str], tail: int
) -> int:
    chunk = max(1, min(200, total // (workers * 4) or 1))
    ranges = [
        (start, min(chunk, first + total - start), steps, without)
        for start in range(first, first + total, chunk)
    ]
    started = time.monotonic()
    last = started
    done = 0
    stats: dict[str, int] = {}
    violation: tuple[int, str] | None = None

    def consume(batch: scheduler.Batch) -> None:
        nonlocal done, violation
        done += batch.schedules
        for what, n in batch.stats.items():
            stats[what] = stats.get(what, 0) + n
        if batch.violation is not None and (violation is None or batch.violation[0] < violation[0]):
            violation = batch.violation

    if workers <= 1:
        for args in ranges:
            consume(scheduler.explore(*args))
            if violation is not None:
                break
            if time.monotonic() - last >= PROGRESS_EVERY:
                last = time.monotonic()
                print(f"{done} schedules, {done / (last - started):.0f}/s", flush=True)
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            for batch in pool.imap_unordered(scheduler.explore_range, ranges):
                consume(batch)
                if violation is not None:
                    pool.terminate()
                    break
                if time.monotonic() - last >= PROGRESS_EVERY:
                    last = time.monotonic()
                    print(f"{done} schedules, {done / (last - started):.0f}/s", flush=True)
    elapsed = time.monotonic() - started
    summary = ", ".join(f"{k} {v}" for k, v in sorted(stats.items()))
    print(f"{done} schedules in {elapsed:.1f} s: {done / elapsed:.0f} schedules/s on {workers} process(es)")
    print(f"totals: {summary}")
    if violation is not None:
        seed, message = violation
        print(f"\nVIOLATION at seed {seed}: {message}\n")
        _replay(seed, steps, without, tail)
        extra = f" --without {','.join(sorted(without))}" if without else ""
        print(f"\nreplay: python -m tests.simulation --seed {seed} --trace{extra}")
        return 1
    print(f"no violation in seeds {first}..{first + total - 1}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.simulation", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the (first) seed (default 0)")
    parser.add_argument("--schedules", type=int, default=None, help="explore this many seeds from --seed")
    parser.add_argument("--trace", action="store_true", help="replay --seed and print its whole trace")
    parser.add_argument("--long", action="store_true", help=f"explore {LONG:,} schedules on every core")
    parser.add_argument("--workers", type=int, default=None, help="processes (default 1; --long: every core)")
    parser.add_argument("--steps", type=int, default=None, help="main-phase steps (default: drawn, 20..50)")
    parser.add_argument(
        "--without",
        default="",
        help=f"comma-separated actions the scheduler leaves out: {', '.join(sorted(scheduler.ACTIONS))}",
    )
    parser.add_argument("--tail", type=int, default=60, help="trace lines shown with a violation")
    args = parser.parse_args(argv)
    without = frozenset(w for w in args.without.split(",") if w)
    unknown = without - scheduler.ACTIONS
    if unknown:
        parser.error(f"unknown --without {sorted(unknown)}; known: {sorted(scheduler.ACTIONS)}")
    if args.trace:
        return _replay(args.seed, args.steps, without, None)
    total = LONG if args.long else (args.schedules if args.schedules is not None else 1000)
    workers = args.workers or ((os.cpu_count() or 1) if args.long else 1)
    return _explore(args.seed, total, workers, args.steps, without, args.tail)


if __name__ == "__main__":
    sys.exit(main())
