"""Hypothesis: the allocator never double-books, gives exact counts, honours Required topology,
finds the best set on small nodes, is deterministic, and places gangs all-or-nothing."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller import allocator
from controller.nodes import in_mig_mode
from gpualloc.api import constants, models

SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BANDWIDTHS = (0, 16, 32, 64, 112, 300, 600, 900)


@st.composite
def inventories(draw: st.DrawFn, name: str) -> tuple[models.NodeInventory, frozenset[str]]:
    n = draw(st.integers(1, 8))
    devices = tuple(
        models.Device(
            index=i,
            minor=i,
            uuid=f"GPU-{name}-{i}",
            product="NVIDIA H100 80GB HBM3",
            memory_mib=81559,
            compute_capability="9.0",
            numa_node=draw(st.integers(0, 1)),
            health=draw(st.sampled_from((constants.HEALTHY,) * 5 + (constants.UNHEALTHY,))),
            mig=models.MigInfo(enabled=True) if draw(st.integers(0, 7)) == 0 else None,
        )
        for i in range(n)
    )
    links = []
    for a, b in itertools.combinations(range(n), 2):
        if draw(st.integers(0, 9)) == 0:
            continue  # a missing link: 0 GB/s
        bw = draw(st.sampled_from(BANDWIDTHS))
        kind = f"NV{bw // 50}" if bw >= 100 else draw(st.sampled_from(("PIX", "PXB", "NODE", "SYS")))
        links.append(models.Link(a=a, b=b, type=kind, bandwidth_gbps=bw))
    islands: tuple[tuple[int, ...], ...] = ()
    if draw(st.booleans()):
        islands = _nvlink_components(n, links)
    taken = frozenset(d.uuid for d in devices if draw(st.integers(0, 3)) == 0)
    inv = models.NodeInventory(devices=devices, links=tuple(links), islands=islands, total=n)
    return inv, taken


def _nvlink_components(n: int, links: Sequence[models.Link]) -> tuple[tuple[int, ...], ...]:
    comp = {i: {i} for i in range(n)}
    for link in links:
        if link.type.startswith("NV") and comp[link.a] is not comp[link.b]:
            merged = comp[link.a] | comp[link.b]
            for i in merged:
                comp[i] = merged
    return tuple(sorted({tuple(sorted(c)) for c in comp.values()}))


@st.composite
def clusters(draw: st.DrawFn, max_nodes: int = 4, healthy_nodes: bool = False) -> list[allocator.NodeView]:
    count = draw(st.integers(1, max_nodes))
    views = []
    for i in range(count):
        name = f"node-{i}"
        inv, taken = draw(inventories(name))
        odd = not healthy_nodes and draw(st.integers(0, 7)) == 0
        views.append(
            allocator.NodeView(
                name=name,
                labels={"pool": draw(st.sampled_from(("a", "b")))},
                unschedulable=odd and draw(st.booleans()),
                node_present=not (odd and draw(st.booleans())),
                ready=not (odd and draw(st.booleans())),
                inventory=inv,
                taken=taken,
            )
        )
    return views


@st.composite
def claims(draw: st.DrawFn, *, single: bool = False) -> models.GpuClaim:
    mode = draw(st.sampled_from(constants.TOPOLOGY_MODES))
    count = draw(st.integers(1, 8))
    policy = draw(st.sampled_from(constants.POLICIES))
    prefer_ids: tuple[int, ...] = ()
    if policy == "preferIds":  # index 8 never exists on these nodes
        prefer_ids = tuple(draw(st.lists(st.integers(0, 8), min_size=count, max_size=9, unique=True)))
    return models.GpuClaim(
        metadata=models.ObjectMeta(name="c", namespace="ns"),
        spec=models.GpuClaimSpec(
            devices=models.DeviceRequest(count=count, policy=policy, prefer_ids=prefer_ids),
            topology=models.Topology(mode=mode, min_bandwidth_gbps=draw(st.sampled_from((0, 32, 112, 600)))),
            strategy=draw(st.sampled_from(constants.STRATEGIES)),
            replicas=1 if single else draw(st.integers(1, 3)),
        ),
    )


def _bw(inv: models.NodeInventory, a: int, b: int) -> int:
    best = 0
    for link in inv.links:
        if {link.a, link.b} == {a, b}:
            best = max(best, link.bandwidth_gbps)
    return best


def _least(inv: models.NodeInventory, indices: Sequence[int]) -> int | None:
    pairs = list(itertools.combinations(indices, 2))
    return min(_bw(inv, a, b) for a, b in pairs) if pairs else None


def _same_island(inv: models.NodeInventory, indices: Sequence[int]) -> bool:
    islands = inv.islands or _nvlink_components(len(inv.devices), inv.links)
    return any(set(indices) <= set(island) for island in islands)


def _free(view: allocator.NodeView, claim: models.GpuClaim | None = None) -> list[models.Device]:
    assert view.inventory is not None
    pinned = None
    if claim is not None and claim.spec.devices.policy == "preferIds":
        pinned = set(claim.spec.devices.prefer_ids)
    return [
        d
        for d in view.inventory.devices
        if d.health == constants.HEALTHY
        and not in_mig_mode(d)
        and d.uuid not in view.taken
        and (pinned is None or d.index in pinned)
    ]


def _eligible(view: allocator.NodeView) -> bool:
    return view.node_present and not view.unschedulable and view.ready and view.inventory is not None


def _meets(claim: models.GpuClaim, inv: models.NodeInventory, indices: Sequence[int]) -> bool:
    topo = claim.spec.topology
    if topo.mode != "Required" or len(indices) < 2:
        return True
    if topo.min_bandwidth_gbps > 0:
        least = _least(inv, indices)
        return least is not None and least >= topo.min_bandwidth_gbps
    return _same_island(inv, indices)


def _has_valid_set(claim: models.GpuClaim, view: allocator.NodeView) -> bool:
    assert view.inventory is not None
    free = [d.index for d in _free(view, claim)]
    return any(
        _meets(claim, view.inventory, s) for s in itertools.combinations(free, claim.spec.devices.count)
    )


@SETTINGS
@given(nodes=clusters(), claim=claims(), seed=st.integers(0, 3), cursor=st.integers(0, 5))
def test_allocations_are_safe_exact_and_respect_required_topology(
    nodes: list[allocator.NodeView], claim: models.GpuClaim, seed: int, cursor: int
) -> None:
    d = allocator.allocate(claim, nodes, seed=seed, round_robin_cursor=cursor)
    by_name = {v.name: v for v in nodes}
    # Gang: every replica or none, and the reason says which.
    assert len(d.allocations) in (0, claim.spec.replicas)
    assert (d.reason == "") == bool(d.allocations)
    assert "\n" not in d.reason
    seen: set[str] = set()
    for replica, alloc in enumerate(d.allocations):
        assert alloc.replica == replica
        view = by_name[alloc.node_name]
        assert _eligible(view)
        assert view.inventory is not None
        own = {dev.uuid: dev for dev in view.inventory.devices}
        uuids = [ref.uuid for ref in alloc.devices]
        assert len(uuids) == claim.spec.devices.count  # exact count
        assert len(set(uuids)) == len(uuids)
        for ref in alloc.devices:
            dev = own[ref.uuid]  # on the replica's node
            assert (dev.index, dev.minor) == (ref.index, ref.minor)
            assert dev.health == constants.HEALTHY  # never unhealthy
            assert not in_mig_mode(dev)  # never a GPU in MIG mode, whole
            assert ref.uuid not in view.taken  # never taken
        assert not seen & set(uuids)  # never twice across replicas
        seen |= set(uuids)
        indices = [ref.index for ref in alloc.devices]
        if claim.spec.devices.policy == "preferIds":
            assert set(indices) <= set(claim.spec.devices.prefer_ids)  # pinned
        assert _meets(claim, view.inventory, indices)  # Required never violated
        assert alloc.min_bandwidth_gbps == (_least(view.inventory, indices) or 0)


@SETTINGS
@given(nodes=clusters(), claim=claims(single=True))
def test_a_single_replica_is_placed_whenever_some_node_has_a_valid_set(
    nodes: list[allocator.NodeView], claim: models.GpuClaim
) -> None:
    possible = any(_eligible(v) and _has_valid_set(claim, v) for v in nodes)
    d = allocator.allocate(claim, nodes)
    assert bool(d.allocations) == possible
    if not possible:
        assert d.reason.startswith(f"0/{len(nodes)} nodes fit: ")
        assert set(d.per_node) == {v.name for v in nodes}


@SETTINGS
@given(nodes=clusters(max_nodes=1, healthy_nodes=True), claim=claims(single=True))
def test_preferred_packed_set_has_the_brute_force_best_least_bandwidth(
    nodes: list[allocator.NodeView], claim: models.GpuClaim
) -> None:
    spec = claim.spec
    claim = models.GpuClaim(
        metadata=claim.metadata,
        spec=models.GpuClaimSpec(
            devices=models.DeviceRequest(count=spec.devices.count, policy="packed"),
            topology=models.Topology(mode="Preferred"),
            strategy=spec.strategy,
        ),
    )
    (view,) = nodes
    assert view.inventory is not None
    free = [dev.index for dev in _free(view)]
    d = allocator.allocate(claim, nodes)
    if len(free) < spec.devices.count:
        assert not d.allocations
        return
    best = max((_least(view.inventory, s) or 0) for s in itertools.combinations(free, spec.devices.count))
    (alloc,) = d.allocations
    assert (_least(view.inventory, [ref.index for ref in alloc.devices]) or 0) == best


@SETTINGS
@given(nodes=clusters(), claim=claims(), seed=st.integers(0, 3), cursor=st.integers(0, 5), data=st.data())
def test_decisions_are_deterministic_and_independent_of_node_order(
    nodes: list[allocator.NodeView], claim: models.GpuClaim, seed: int, cursor: int, data: st.DataObject
) -> None:
    first = allocator.allocate(claim, nodes, seed=seed, round_robin_cursor=cursor)
    again = allocator.allocate(claim, list(nodes), seed=seed, round_robin_cursor=cursor)
    assert first == again
    shuffled = data.draw(st.permutations(nodes))
    assert allocator.allocate(claim, shuffled, seed=seed, round_robin_cursor=cursor) == first
    explained = allocator.allocate(claim, nodes, seed=seed, round_robin_cursor=cursor, explain=True)
    assert explained.allocations == first.allocations
    assert explained.reason == first.reason


@SETTINGS
@given(nodes=clusters(healthy_nodes=True), claim=claims())
def test_gang_is_all_or_nothing_and_a_failed_gang_reports_replicas_placed(
    nodes: list[allocator.NodeView], claim: models.GpuClaim
) -> None:
    d = allocator.allocate(claim, nodes)
    replicas = claim.spec.replicas
    if d.allocations:
        assert len(d.allocations) == replicas
        # Taking the gang's devices really is possible: the sum per node fits in the free devices.
        for name in {a.node_name for a in d.allocations}:
            used = sum(len(a.devices) for a in d.allocations if a.node_name == name)
            view = next(v for v in nodes if v.name == name)
            assert used <= len(_free(view))
    elif replicas > 1 and any(_has_valid_set(claim, v) for v in nodes):
        # At least one replica could be placed, so the reason counts how many did.
        assert d.reason.startswith("only ")
        placed = int(d.reason.split()[1])
        assert 1 <= placed < replicas
