"""The set search: the best set of a node's usable devices for one replica (pure).

Every set of ``count`` devices is scored when there are at most ``EXHAUSTIVE_LIMIT`` of them,
otherwise a beam search of width ``BEAM_WIDTH`` grows sets one device at a time. The measures
and the keys of each policy are in the allocator's module docstring ("Sets").
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

from controller.asks import Ask
from controller.screening import Miss, Screened, SlotDevice
from gpualloc.api import models

EXHAUSTIVE_LIMIT = 5000
BEAM_WIDTH = 48
NO_PAIRS = 1 << 40  # "least pairwise bandwidth" of a set with a single device

Key = tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    devices: tuple[models.Device, ...]
    least_bw: int  # NO_PAIRS for a single device
    numa: int
    islands: int
    key: Key

    @property
    def reported_bw(self) -> int:
        return 0 if self.least_bw == NO_PAIRS else self.least_bw

    def describe(self) -> str:
        if isinstance(self.devices[0], SlotDevice):
            slots = [d for d in self.devices if isinstance(d, SlotDevice)]
            return ", ".join(f"slot {d.slot} of gpu {d.index}" for d in slots)
        if self.devices[0].uuid.startswith("MIG-"):
            return ", ".join(f"{d.product} of gpu {d.index}" for d in self.devices)
        idx = ",".join(str(d.index) for d in self.devices)
        if len(self.devices) == 1:
            return f"gpu {idx}"
        return f"gpus {idx} (min {self.least_bw} GB/s, {self.numa} NUMA node{'s' if self.numa != 1 else ''})"


SEARCHES_KEPT = 64  # set searches remembered per inventory (``nodes.Prepared.searches``)


def best_set(node: Screened, ask: Ask) -> Choice | Miss:
    """The best set of ``ask.count`` of the node's usable devices, or why there is none.

    The answer depends only on the inventory, the usable devices and the ask's
    set terms, so it is remembered on the prepared inventory: the nodes a
    strategy ranks first are searched again for claim after claim until their
    free devices change."""
    if ask.exclusivity != "Exclusive":  # instances and slots in screening's order (packing)
        return Choice(tuple(node.usable[: ask.count]), NO_PAIRS, 1, 1, ())
    searches = node.prep.searches
    key = (tuple(d.index for d in node.usable), ask.count, ask.mode, ask.policy, ask.min_bw)
    found: Choice | Miss | None = searches.get(key)
    if found is None:
        if len(searches) >= SEARCHES_KEPT:
            searches.clear()
        found = searches[key] = _search_set(node, ask)
    return found


def _search_set(node: Screened, ask: Ask) -> Choice | Miss:
    devs = node.usable
    m, k = len(devs), ask.count
    matrix, isl = node.prep.topology()
    idx = [d.index for d in devs]
    bw = [[matrix[a][b] for b in idx] for a in idx]
    numa = [d.numa_node for d in devs]
    island = [isl[i] for i in idx]
    rowsum = [sum(row) for row in bw]
    topo = ask.mode != "Ignore"
    required = ask.mode == "Required" and k > 1
    policy = ask.policy

    def key(combo: Sequence[int], least: int, internal: int) -> tuple[Key, int, int]:
        n_numa = len({numa[p] for p in combo})
        n_isl = len({island[p] for p in combo})
        cut = sum(rowsum[p] for p in combo) - 2 * internal
        order = tuple(idx[p] for p in combo)
        bw_term = -least if topo else 0
        numa_term = n_numa if topo else 0
        if policy == "spread":
            full: Key = (-n_numa, bw_term, cut, order)
        elif policy == "contiguous":
            full = (n_isl, bw_term, numa_term, cut, order)
        else:
            full = (bw_term, numa_term, cut, order)
        return full, n_numa, n_isl

    def meets(least: int, n_isl: int) -> bool:
        if not required:
            return True
        return least >= ask.min_bw if ask.min_bw > 0 else n_isl == 1

    best: Choice | None = None
    best_least_any = -1  # best least bandwidth seen, for the failure message
    if math.comb(m, k) <= EXHAUSTIVE_LIMIT:
        for combo in itertools.combinations(range(m), k):
            least, internal = NO_PAIRS, 0
            for i, p in enumerate(combo):
                row = bw[p]
                for q in combo[i + 1 :]:
                    b = row[q]
                    internal += b
                    if b < least:
                        least = b
            full, n_numa, n_isl = key(combo, least, internal)
            best_least_any = max(best_least_any, least)
            if not meets(least, n_isl):
                continue
            if best is None or full < best.key:
                best = Choice(tuple(devs[p] for p in combo), least, n_numa, n_isl, full)
    else:
        best, best_least_any = _beam(devs, bw, k, key, meets)

    if best is None:
        if ask.min_bw > 0:
            phrase = f"no {k}-GPU set with >={ask.min_bw} GB/s"
            detail = f"{phrase} among {m} usable GPUs (best {max(best_least_any, 0)} GB/s)"
        else:
            phrase = f"no {k}-GPU set inside one NVLink island"
            detail = f"{phrase} among {m} usable GPUs"
        return Miss(8, f"has {phrase}", f"have {phrase}", detail)
    return best


def _beam(
    devs: list[models.Device],
    bw: list[list[int]],
    k: int,
    key: Any,
    meets: Any,
) -> tuple[Choice | None, int]:
    """Grow sets one device at a time, keeping the ``BEAM_WIDTH`` best partial sets."""
    m = len(devs)
    # (key, combo sorted, least, internal)
    beam: list[tuple[Key, tuple[int, ...], int, int]] = []
    for p in range(m):
        full, _, _ = key((p,), NO_PAIRS, 0)
        beam.append((full, (p,), NO_PAIRS, 0))
    beam.sort()
    beam = beam[:BEAM_WIDTH]
    best_least = -1
    for size in range(2, k + 1):
        grown: dict[tuple[int, ...], tuple[Key, tuple[int, ...], int, int]] = {}
        for _, combo, least, internal in beam:
            for p in range(m):
                if p in combo:
                    continue
                new = tuple(sorted((*combo, p)))
                if new in grown:
                    continue
                row = bw[p]
                n_least = min(least, *(row[q] for q in combo))
                n_internal = internal + sum(row[q] for q in combo)
                full, _, n_isl = key(new, n_least, n_internal)
                if size == k:
                    best_least = max(best_least, n_least)
                if not meets(n_least, n_isl):
                    continue  # the least bandwidth only falls and islands only grow: prune
                grown[new] = (full, new, n_least, n_internal)
        beam = sorted(grown.values())[:BEAM_WIDTH]
        if not beam:
            return None, best_least
    full, combo, least, _ = beam[0]
    _, n_numa, n_isl = key(combo, least, 0)
    return Choice(tuple(devs[p] for p in combo), least, n_numa, n_isl, full), best_least
