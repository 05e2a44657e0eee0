"""Topology derivation over random machines: the invariants the allocator relies on."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from agent import inventory


def _bus(i: int) -> str:
    return f"0000:{i + 1:02x}:00.0"


@st.composite
def machines(draw: st.DrawFn) -> inventory.NodeFacts:
    n = draw(st.integers(min_value=1, max_value=10))
    switches = draw(st.lists(st.sampled_from(["0000:e0:00.0", "0000:e1:00.0"]), max_size=2, unique=True))
    links: list[list[inventory.NvLinkEndpoint]] = [[] for _ in range(n)]
    for a, b in itertools.combinations(range(n), 2):
        for _ in range(draw(st.integers(min_value=0, max_value=3))):
            version = draw(st.sampled_from([0, 4, 5, 6, 7]))
            links[a].append(
                inventory.NvLinkEndpoint(
                    link=len(links[a]), active=True, remote_bus_id=_bus(b), remote_type=0, version=version
                )
            )
            links[b].append(
                inventory.NvLinkEndpoint(
                    link=len(links[b]), active=True, remote_bus_id=_bus(a), remote_type=0, version=version
                )
            )
    for i in range(n):
        for switch in switches:
            for _ in range(draw(st.integers(min_value=0, max_value=4))):
                links[i].append(
                    inventory.NvLinkEndpoint(
                        link=len(links[i]),
                        active=True,
                        remote_bus_id=switch,
                        remote_type=draw(st.sampled_from([2, None])),
                    )
                )
    levels = st.sampled_from([0, 10, 20, 30, 40, 50])
    return inventory.NodeFacts(
        source="nvml",
        devices=tuple(
            inventory.DeviceFacts(
                index=i,
                minor=i,
                uuid=f"GPU-{i}",
                pci_bus_id=_bus(i),
                nvlinks=tuple(links[i]),
                pcie_generation=draw(st.integers(0, 6)),
                pcie_width=draw(st.sampled_from([0, 8, 16])),
            )
            for i in range(n)
        ),
        common_ancestors={p: draw(levels) for p in itertools.combinations(range(n), 2)},
    )


@settings(max_examples=300, deadline=None)
@given(machines())
def test_links_cover_every_pair_once_and_islands_partition_by_nvlink_reachability(
    facts: inventory.NodeFacts,
) -> None:
    inv = inventory.derive(facts)
    n = len(facts.devices)
    assert [(ln.a, ln.b) for ln in inv.links] == list(itertools.combinations(range(n), 2))
    assert sorted(i for island in inv.islands for i in island) == list(range(n))
    island_of = {i: k for k, island in enumerate(inv.islands) for i in island}
    for ln in inv.links:
        assert ln.bandwidth_gbps > 0
        if ln.nvlinks:
            assert ln.type == f"NV{ln.nvlinks}"
            assert island_of[ln.a] == island_of[ln.b]
        else:
            assert ln.type in ("PIX", "PXB", "PHB", "NODE", "SYS")
    # Every island is connected through NVLink pairs alone.
    nv = {(ln.a, ln.b) for ln in inv.links if ln.nvlinks}
    for island in inv.islands:
        reached = {island[0]}
        frontier = [island[0]]
        while frontier:
            x = frontier.pop()
            for y in island:
                if y not in reached and ((min(x, y), max(x, y)) in nv):
                    reached.add(y)
                    frontier.append(y)
        assert reached == set(island)


@settings(max_examples=200, deadline=None)
@given(machines())
def test_derivation_does_not_depend_on_device_order(facts: inventory.NodeFacts) -> None:
    shuffled = inventory.NodeFacts(
        source=facts.source, devices=tuple(reversed(facts.devices)), common_ancestors=facts.common_ancestors
    )
    assert inventory.derive(shuffled) == inventory.derive(facts)
