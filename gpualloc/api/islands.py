"""NVLink islands: the connected components of GPUs over NVLink pairs. Pure.

The agent derives a node's islands from what NVML reports, and the controller
derives them again from a published inventory that carries none; both group
the same way, here.
"""

from __future__ import annotations

from collections.abc import Iterable


def islands(indices: Iterable[int], pairs: Iterable[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """Connected components of ``indices`` over ``pairs``; every index is in exactly one.

    Each component is sorted, and the components are ordered by their lowest
    index. Pairs naming an index outside ``indices`` are ignored.
    """
    parent = {i: i for i in indices}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        if a in parent and b in parent:
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for i in parent:
        groups.setdefault(find(i), []).append(i)
    return tuple(sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: g[0]))
