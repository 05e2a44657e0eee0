"""NVLink islands: the connected components of GPUs over NVLink pairs. Pure.

The agent derives a node's islands from what NVML reports, and the controller
derives them again from a published inventory that carries none; both group
the same way, here. ``DisjointSets`` is the union-find under it, which the
agent also uses for its NVSwitch fabrics (GPUs and switches, by name).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class DisjointSets(Generic[T]):
    """Union-find: every item is in one set, its own until ``union`` joins two.

    ``find`` adds an item it has not seen, in a set of its own. Which member
    represents a set is an implementation detail: compare ``find`` results.
    """

    __slots__ = ("_parent",)

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._parent: dict[T, T] = {x: x for x in items}

    def __contains__(self, x: object) -> bool:
        return x in self._parent

    def find(self, x: T) -> T:
        """The representative of ``x``'s set (with path halving)."""
        parent = self._parent
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: T, b: T) -> None:
        """Join the sets of ``a`` and ``b``."""
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self._parent[rb] = ra

    def groups(self) -> list[list[T]]:
        """Every set, members in the order first seen; the sets in the order of their first member."""
        out: dict[T, list[T]] = {}
        for x in self._parent:
            out.setdefault(self.find(x), []).append(x)
        return list(out.values())


def islands(indices: Iterable[int], pairs: Iterable[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """Connected components of ``indices`` over ``pairs``; every index is in exactly one.

    Each component is sorted, and the components are ordered by their lowest
    index. Pairs naming an index outside ``indices`` are ignored.
    """
    sets = DisjointSets(indices)
    for a, b in pairs:
        if a in sets and b in sets:
            sets.union(a, b)
    return tuple(sorted((tuple(sorted(g)) for g in sets.groups()), key=lambda g: g[0]))
