"""Topology helpers over a node's inventory: bandwidth lookups and NVLink islands (pure).

The agent publishes one ``Link`` per unordered pair of devices and, usually, the
NVLink islands it derived. The allocator only ever reads these as data: a pair
with no link entry has bandwidth 0, and a device that no island lists is an
island of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpualloc.api import islands, models


def is_nvlink(link_type: str) -> bool:
    """``NV<n>`` in ``nvidia-smi topo -m`` terms (NVSwitch-attached pairs report NV too)."""
    return link_type.upper().startswith("NV")


def bandwidths(links: Iterable[models.Link]) -> dict[tuple[int, int], int]:
    """``(a, b) -> GB/s`` with ``a < b``; duplicates keep the highest figure, self-links are dropped."""
    table: dict[tuple[int, int], int] = {}
    for link in links:
        if link.a == link.b:
            continue
        pair = (link.a, link.b) if link.a < link.b else (link.b, link.a)
        bw = max(0, link.bandwidth_gbps)
        if bw > table.get(pair, -1):
            table[pair] = bw
    return table


def bandwidth(table: Mapping[tuple[int, int], int], a: int, b: int) -> int:
    """Bandwidth between host indices ``a`` and ``b``; 0 for a missing link."""
    return table.get((a, b) if a < b else (b, a), 0)


def island_ids(inventory: models.NodeInventory) -> dict[int, int]:
    """Host index -> island number for every device of the node.

    The published ``islands`` win when present; otherwise islands are the
    connected components of the NVLink (``NV*``) links. Devices in no island get
    an island of their own. Island numbers are stable: ordered by lowest index.
    """
    indices = sorted({d.index for d in inventory.devices})
    groups: list[list[int]]
    if inventory.islands:
        seen: set[int] = set()
        groups = []
        for island in inventory.islands:
            members = sorted({i for i in island if i not in seen})
            seen.update(members)
            if members:
                groups.append(members)
        groups.extend([i] for i in indices if i not in seen)
    else:
        nvlink = ((link.a, link.b) for link in inventory.links if is_nvlink(link.type) and link.a != link.b)
        groups = [list(group) for group in islands.islands(indices, nvlink)]
    groups.sort(key=lambda g: min(g))
    return {i: n for n, group in enumerate(groups) for i in group}
