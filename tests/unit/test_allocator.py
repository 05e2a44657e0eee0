"""The pure allocator: strategies, policies, topology, selectors and its one-line reasons."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest

from controller import allocator, asks, screening
from controller import nodes as node_tables
from gpualloc.api import models

# ------------------------------------------------------------------ builders


def _devices(n: int, *, prefix: str, numa_split: int | None = None, **kw: object) -> list[models.Device]:
    split = numa_split if numa_split is not None else max(1, n // 2)
    return [
        models.Device(
            index=i,
            minor=i,
            uuid=f"GPU-{prefix}-{i}",
            product=str(kw.get("product", "NVIDIA H100 80GB HBM3")),
            memory_mib=int(kw.get("memory_mib", 81559)),  # type: ignore[call-overload]
            compute_capability=str(kw.get("cc", "9.0")),
            numa_node=i // split,
        )
        for i in range(n)
    ]


def nvswitch(name: str, n: int = 8) -> models.NodeInventory:
    """Every GPU on one NVSwitch fabric: all pairs NV18, 900 GB/s, one island."""
    links = tuple(
        models.Link(a=a, b=b, type="NV18", nvlinks=18, bandwidth_gbps=900)
        for a in range(n)
        for b in range(a + 1, n)
    )
    return models.NodeInventory(
        devices=tuple(_devices(n, prefix=name)), links=links, islands=(tuple(range(n)),), total=n
    )


def bridged(name: str) -> models.NodeInventory:
    """8 GPUs with NVLink bridges on the non-adjacent pairs 0-2, 1-3 and on 4-5, 6-7; PCIe elsewhere."""
    bridges = {(0, 2), (1, 3), (4, 5), (6, 7)}
    links = []
    for a in range(8):
        for b in range(a + 1, 8):
            if (a, b) in bridges:
                links.append(models.Link(a=a, b=b, type="NV4", nvlinks=4, bandwidth_gbps=112))
            elif a // 4 == b // 4:
                links.append(models.Link(a=a, b=b, type="NODE", bandwidth_gbps=32))
            else:
                links.append(models.Link(a=a, b=b, type="SYS", bandwidth_gbps=16))
    return models.NodeInventory(
        devices=tuple(_devices(8, prefix=name, product="NVIDIA RTX A6000", cc="8.6", memory_mib=49140)),
        links=tuple(links),
        islands=((0, 2), (1, 3), (4, 5), (6, 7)),
        total=8,
    )


def pcie(name: str, n: int = 8) -> models.NodeInventory:
    """PCIe only: PIX pairs (0,1), (2,3)...; NODE within a socket; SYS across."""
    links = []
    half = n // 2
    for a in range(n):
        for b in range(a + 1, n):
            if a // 2 == b // 2:
                links.append(models.Link(a=a, b=b, type="PIX", bandwidth_gbps=64))
            elif a // half == b // half:
                links.append(models.Link(a=a, b=b, type="NODE", bandwidth_gbps=32))
            else:
                links.append(models.Link(a=a, b=b, type="SYS", bandwidth_gbps=16))
    return models.NodeInventory(
        devices=tuple(_devices(n, prefix=name, product="NVIDIA L40S", cc="8.9", memory_mib=46068)),
        links=tuple(links),
        total=n,
    )


def node(
    name: str,
    inventory: models.NodeInventory | None,
    *,
    taken: Iterable[int] = (),
    labels: Mapping[str, str] | None = None,
    unschedulable: bool = False,
    present: bool = True,
    ready: bool = True,
) -> allocator.NodeView:
    uuids = (
        frozenset(d.uuid for d in inventory.devices if d.index in set(taken)) if inventory else frozenset()
    )
    return allocator.NodeView(
        name=name,
        labels=dict(labels or {}),
        unschedulable=unschedulable,
        node_present=present,
        ready=ready,
        inventory=inventory,
        taken=uuids,
    )


def unhealthy(inv: models.NodeInventory, *indices: int) -> models.NodeInventory:
    devices = tuple(
        models.Device(
            index=d.index,
            minor=d.minor,
            uuid=d.uuid,
            product=d.product,
            memory_mib=d.memory_mib,
            compute_capability=d.compute_capability,
            numa_node=d.numa_node,
            health="Unhealthy" if d.index in indices else d.health,
            health_reason="XID 79" if d.index in indices else "",
        )
        for d in inv.devices
    )
    return models.NodeInventory(devices=devices, links=inv.links, islands=inv.islands, total=inv.total)


def claim(
    count: int = 1,
    *,
    name: str = "c",
    namespace: str = "default",
    policy: str = "packed",
    prefer_ids: Sequence[int] = (),
    product: str | None = None,
    min_memory_mib: int | None = None,
    min_cc: str | None = None,
    mode: str = "Preferred",
    min_bw: int = 0,
    strategy: str = "binpack",
    replicas: int = 1,
    priority: int = 0,
    selector: models.LabelSelector | None = None,
    node_name: str | None = None,
    created: str = "2025-01-01T00:00:00Z",
    exclusivity: str = "Exclusive",
    mig_profile: str = "",
    sharing: models.SharingRequest | None = None,
) -> models.GpuClaim:
    return models.GpuClaim(
        metadata=models.ObjectMeta(name=name, namespace=namespace, creation_timestamp=created),
        spec=models.GpuClaimSpec(
            devices=models.DeviceRequest(
                count=count,
                exclusivity=exclusivity,
                mig_profile=mig_profile,
                sharing=sharing,
                policy=policy,
                prefer_ids=tuple(prefer_ids),
                product=product,
                min_memory_mib=min_memory_mib,
                min_compute_capability=min_cc,
            ),
            selector=selector,
            node_name=node_name,
            topology=models.Topology(mode=mode, min_bandwidth_gbps=min_bw),
            strategy=strategy,
            priority=priority,
            replicas=replicas,
        ),
    )


def picked(decision: allocator.Decision, replica: int = 0) -> tuple[str, tuple[int, ...]]:
    alloc = decision.allocations[replica]
    return alloc.node_name, tuple(d.index for d in alloc.devices)


# ------------------------------------------------------------------ topology


def test_contiguous_pair_on_bridged_box_is_a_bridged_pair_not_0_1() -> None:
    d = allocator.allocate(claim(2, policy="contiguous"), [node("n", bridged("n"))])
    assert picked(d) == ("n", (0, 2))
    assert d.allocations[0].min_bandwidth_gbps == 112


def test_packed_pair_on_bridged_box_prefers_the_bridge_over_neighbouring_indices() -> None:
    d = allocator.allocate(claim(2), [node("n", bridged("n"), taken=[0])])
    # 0 is taken: 2 lost its partner; the best pair left is a bridge: 1-3.
    assert picked(d) == ("n", (1, 3))


def test_single_gpu_packs_onto_a_device_whose_bridge_partner_is_taken() -> None:
    d = allocator.allocate(claim(1), [node("n", bridged("n"), taken=[0])])
    assert picked(d) == ("n", (2,))


def test_nvswitch_any_four_of_eight_are_equal_so_fewest_numa_then_lowest_indices_win() -> None:
    d = allocator.allocate(claim(4), [node("n", nvswitch("n"))])
    assert picked(d) == ("n", (0, 1, 2, 3))
    assert d.allocations[0].min_bandwidth_gbps == 900
    d = allocator.allocate(claim(4), [node("n", nvswitch("n"), taken=[0])])
    assert picked(d) == ("n", (4, 5, 6, 7))  # 1,2,3 + one of NUMA 1 would span two NUMA nodes
    d = allocator.allocate(claim(4), [node("n", nvswitch("n"), taken=[0, 5])])
    assert picked(d) == ("n", (1, 2, 3, 4))
    assert d.allocations[0].min_bandwidth_gbps == 900


def test_required_bandwidth_fails_on_pcie_with_a_one_line_reason() -> None:
    d = allocator.allocate(claim(4, mode="Required", min_bw=600), [node("p", pcie("p"))])
    assert d.allocations == ()
    assert d.reason == "0/1 nodes fit: 1 has no 4-GPU set with >=600 GB/s"
    assert d.per_node["p"] == "no 4-GPU set with >=600 GB/s among 8 usable GPUs (best 32 GB/s)"


def test_required_bandwidth_picks_the_node_that_meets_the_bar_even_if_binpack_prefers_another() -> None:
    nodes = [node("a-pcie", pcie("a-pcie"), taken=[0, 1, 2, 3]), node("b-nvs", nvswitch("b-nvs"))]
    d = allocator.allocate(claim(2, mode="Required", min_bw=600), nodes)
    assert picked(d)[0] == "b-nvs"
    d = allocator.allocate(claim(2, mode="Preferred"), nodes)
    assert picked(d)[0] == "a-pcie"  # binpack first; topology only breaks ties across nodes


def test_preferred_with_a_bandwidth_is_a_soft_bar_met_where_some_node_can() -> None:
    nodes = [node("a-pcie", pcie("a-pcie"), taken=[0, 1, 2, 3]), node("b-nvs", nvswitch("b-nvs"))]
    d = allocator.allocate(claim(2, mode="Preferred", min_bw=600), nodes)
    assert picked(d)[0] == "b-nvs"  # binpack prefers a-pcie, but only b-nvs reaches 600 GB/s
    assert d.note == ""


def test_preferred_with_a_bandwidth_nobody_reaches_takes_the_best_there_is_and_says_so() -> None:
    nodes = [node("a-pcie", pcie("a-pcie"), taken=[0, 1, 2, 3]), node("b-pcie", pcie("b-pcie"))]
    d = allocator.allocate(claim(2, mode="Preferred", min_bw=600), nodes)
    assert picked(d) == picked(allocator.allocate(claim(2, mode="Preferred"), nodes))
    assert d.note == "below the preferred 600 GB/s: 0/2 nodes fit: 2 have no 2-GPU set with >=600 GB/s"


def test_required_without_a_bandwidth_means_one_nvlink_island() -> None:
    d = allocator.allocate(claim(2, mode="Required"), [node("n", bridged("n"), taken=[0, 1, 4, 6])])
    assert d.allocations == ()
    assert d.reason == "0/1 nodes fit: 1 has no 2-GPU set inside one NVLink island"
    d = allocator.allocate(claim(2, mode="Required"), [node("n", bridged("n"), taken=[0, 1])])
    assert picked(d) == ("n", (4, 5))


def test_required_single_gpu_has_no_pairs_and_always_meets_the_bar() -> None:
    d = allocator.allocate(claim(1, mode="Required", min_bw=900), [node("p", pcie("p"))])
    assert d.ok and d.allocations[0].min_bandwidth_gbps == 0


def test_spread_policy_spans_numa_nodes() -> None:
    d = allocator.allocate(claim(2, policy="spread"), [node("p", pcie("p"))])
    assert picked(d) == ("p", (0, 4))  # one GPU per socket; all such pairs equal, lowest indices win


def test_ignore_topology_still_packs_and_is_deterministic() -> None:
    d1 = allocator.allocate(claim(2, mode="Ignore"), [node("p", pcie("p"), taken=[0])])
    d2 = allocator.allocate(claim(2, mode="Ignore"), [node("p", pcie("p"), taken=[0])])
    assert d1 == d2
    # No bandwidth or NUMA terms: the pair that cuts the least bandwidth to the free GPUs left wins.
    assert picked(d1) == ("p", (2, 3))
    assert d1.allocations[0].min_bandwidth_gbps == 64


def test_contiguous_eight_on_a_sixteen_gpu_node_stays_in_one_island_via_beam_search() -> None:
    # Two 8-GPU NVSwitch boards joined by SYS; C(16, 8) = 12870 > the exhaustive limit.
    links = []
    for a in range(16):
        for b in range(a + 1, 16):
            same = a // 8 == b // 8
            links.append(
                models.Link(a=a, b=b, type="NV18" if same else "SYS", bandwidth_gbps=900 if same else 16)
            )
    inv = models.NodeInventory(
        devices=tuple(_devices(16, prefix="big", numa_split=8)),
        links=tuple(links),
        islands=(tuple(range(8)), tuple(range(8, 16))),
        total=16,
    )
    d = allocator.allocate(claim(8, policy="contiguous"), [node("big", inv, taken=[0])])
    assert picked(d) == ("big", tuple(range(8, 16)))
    d = allocator.allocate(claim(8, mode="Required", min_bw=600), [node("big", inv, taken=[0, 9])])
    assert d.reason == "0/1 nodes fit: 1 has no 8-GPU set with >=600 GB/s"


# ------------------------------------------------------------------ strategies


def test_binpack_picks_the_fullest_node() -> None:
    nodes = [node("a", nvswitch("a"), taken=[0, 1]), node("b", nvswitch("b"), taken=range(6))]
    assert picked(allocator.allocate(claim(1), nodes))[0] == "b"


def test_spread_picks_the_node_with_most_free_gpus() -> None:
    nodes = [node("big", nvswitch("big"), taken=range(5)), node("small", nvswitch("small", 4), taken=[0, 1])]
    assert picked(allocator.allocate(claim(1, strategy="spread"), nodes))[0] == "big"  # 3 free > 2 free


def test_least_loaded_picks_the_lowest_allocated_fraction() -> None:
    nodes = [node("big", nvswitch("big"), taken=range(5)), node("small", nvswitch("small", 4), taken=[0, 1])]
    assert picked(allocator.allocate(claim(1, strategy="leastLoaded"), nodes))[0] == "small"  # 50% < 62.5%


def test_best_fit_leaves_the_fewest_gpus_over_where_binpack_prefers_the_fuller_node() -> None:
    nodes = [
        node("four", nvswitch("four", 4), taken=[0]),
        node("sixteen", nvswitch("sixteen", 16), taken=range(10)),
    ]
    assert picked(allocator.allocate(claim(2, strategy="bestFit"), nodes))[0] == "four"  # 1 left over vs 4
    assert picked(allocator.allocate(claim(2, strategy="binpack"), nodes))[0] == "sixteen"  # 62.5% vs 25%


def test_random_is_seeded_and_deterministic() -> None:
    nodes = [node(f"n{i}", nvswitch(f"n{i}")) for i in range(6)]
    c = claim(1, strategy="random")
    picks = {seed: picked(allocator.allocate(c, nodes, seed=seed))[0] for seed in range(20)}
    assert all(picked(allocator.allocate(c, nodes, seed=s))[0] == n for s, n in picks.items())
    assert len(set(picks.values())) > 1


def test_round_robin_follows_the_cursor_over_sorted_names_and_skips_nodes_that_do_not_fit() -> None:
    nodes = [node("c", nvswitch("c")), node("a", nvswitch("a")), node("b", nvswitch("b"), taken=range(8))]
    c = claim(1, strategy="roundRobin")
    assert picked(allocator.allocate(c, nodes, round_robin_cursor=0))[0] == "a"
    assert picked(allocator.allocate(c, nodes, round_robin_cursor=1))[0] == "c"  # b is full
    assert picked(allocator.allocate(c, nodes, round_robin_cursor=2))[0] == "c"
    assert picked(allocator.allocate(c, nodes, round_robin_cursor=3))[0] == "a"  # wraps


def test_round_robin_gang_moves_on_after_each_replica() -> None:
    nodes = [node(n, nvswitch(n)) for n in ("a", "b", "c")]
    d = allocator.allocate(claim(1, strategy="roundRobin", replicas=3), nodes, round_robin_cursor=1)
    assert [a.node_name for a in d.allocations] == ["b", "c", "a"]


def test_cost_optimized_prefers_cheaper_tiers_and_puts_unlabelled_nodes_last() -> None:
    label = "gpu.scheduling/cost-tier"
    nodes = [
        node("cheap", nvswitch("cheap"), labels={label: "low"}, taken=range(7)),
        node("mid", nvswitch("mid"), labels={label: "medium"}),
        node("none", nvswitch("none"), taken=range(6)),
        node("pricey", nvswitch("pricey"), labels={label: "high"}),
    ]
    assert picked(allocator.allocate(claim(1, strategy="costOptimized"), nodes))[0] == "cheap"
    assert picked(allocator.allocate(claim(2, strategy="costOptimized"), nodes))[0] == "mid"
    custom = allocator.allocate(claim(2, strategy="costOptimized"), nodes, cost_preference=("high", "medium"))
    assert picked(custom)[0] == "pricey"
    other = allocator.allocate(
        claim(1, strategy="costOptimized"), nodes, cost_label="tier", cost_preference=("low",)
    )
    assert picked(other)[0] == "cheap"  # no node has "tier": all last, binpack decides


def test_equal_strategy_scores_break_ties_by_bandwidth_then_name() -> None:
    nodes = [node("a", pcie("a")), node("b", nvswitch("b")), node("c", nvswitch("c"))]
    assert picked(allocator.allocate(claim(2), nodes)) == ("b", (0, 1))
    assert picked(allocator.allocate(claim(2, mode="Ignore"), nodes))[0] == "a"


# ------------------------------------------------------------------ selectors and devices


def _sel(*exprs: tuple[str, str, tuple[str, ...]], **labels: str) -> models.LabelSelector:
    return models.LabelSelector(
        match_labels=labels,
        match_expressions=tuple(models.SelectorRequirement(key=k, operator=o, values=v) for k, o, v in exprs),
    )


def test_selector_operators_follow_kubernetes_semantics() -> None:
    labels = {"zone": "a", "gpus": "8", "pool": "train"}
    m = asks.matches_selector
    assert m(None, labels) and m(_sel(), labels) and m(_sel(), {})
    assert m(_sel(zone="a"), labels) and not m(_sel(zone="b"), labels)
    assert m(_sel(("zone", "In", ("a", "b"))), labels)
    assert not m(_sel(("zone", "In", ("b",))), labels)
    assert not m(_sel(("missing", "In", ("a",))), labels)
    assert m(_sel(("zone", "NotIn", ("b",))), labels) and m(_sel(("missing", "NotIn", ("a",))), labels)
    assert not m(_sel(("zone", "NotIn", ("a",))), labels)
    assert m(_sel(("pool", "Exists", ())), labels) and not m(_sel(("x", "Exists", ())), labels)
    assert m(_sel(("x", "DoesNotExist", ())), labels) and not m(_sel(("pool", "DoesNotExist", ())), labels)
    assert m(_sel(("gpus", "Gt", ("4",))), labels) and not m(_sel(("gpus", "Gt", ("8",))), labels)
    assert m(_sel(("gpus", "Lt", ("9",))), labels) and not m(_sel(("gpus", "Lt", ("8",))), labels)
    assert not m(_sel(("zone", "Gt", ("1",))), labels)  # not an integer
    assert not m(_sel(("missing", "Lt", ("1",))), labels)
    assert not m(_sel(("zone", "Matches", ("a",))), labels)
    assert not m(_sel(("zone", "In", ("a",)), pool="infer"), labels)  # all terms must hold


def test_selector_and_node_name_restrict_candidates() -> None:
    nodes = [node("a", nvswitch("a"), labels={"pool": "x"}), node("b", nvswitch("b"), labels={"pool": "y"})]
    d = allocator.allocate(claim(1, selector=_sel(pool="y")), nodes)
    assert picked(d)[0] == "b"
    d = allocator.allocate(claim(1, selector=_sel(pool="z")), nodes)
    assert d.reason == "0/2 nodes fit: 2 do not match the selector"
    d = allocator.allocate(claim(1, node_name="a", selector=_sel(pool="y")), nodes)
    assert d.reason == '0/2 nodes fit: 1 is not the requested nodeName "a", 1 does not match the selector'
    d = allocator.allocate(claim(1, node_name="zz"), nodes)
    assert d.reason == 'nodeName "zz" is not a known GPU node (0/2 nodes fit)'


def test_product_memory_and_compute_capability_filters() -> None:
    nodes = [node("l40s", pcie("l40s")), node("h100", nvswitch("h100")), node("a6000", bridged("a6000"))]
    assert picked(allocator.allocate(claim(1, product="NVIDIA H100*"), nodes))[0] == "h100"
    assert not allocator.allocate(claim(1, product="nvidia h100*"), nodes).ok  # case-sensitive
    assert picked(allocator.allocate(claim(1, min_memory_mib=48000, strategy="spread"), nodes))[0] in {
        "h100",
        "a6000",
    }
    d = allocator.allocate(claim(1, min_cc="8.9", product="NVIDIA [LR]*"), nodes)
    assert picked(d)[0] == "l40s"
    assert picked(allocator.allocate(claim(1, min_cc="9.0"), nodes))[0] == "h100"
    d = allocator.allocate(claim(2, min_cc="10.0"), nodes)
    assert (
        d.reason == "0/3 nodes fit: 3 have fewer than 2 free healthy GPUs matching compute capability >=10.0"
    )
    assert d.per_node["h100"] == "0 of 8 GPUs usable (8 not matching compute capability >=10.0); need 2"


def test_compute_capability_compares_as_integers_not_strings() -> None:
    assert asks.parse_compute_capability("10.0") == (10, 0)
    assert asks.parse_compute_capability("9") == (9, 0)
    assert asks.parse_compute_capability("8.10") == (8, 10) > (8, 9)
    assert asks.parse_compute_capability("x.y") is None


def test_unhealthy_and_taken_devices_are_never_given() -> None:
    inv = unhealthy(nvswitch("n"), 1, 2)
    d = allocator.allocate(claim(4), [node("n", inv, taken=[0, 7])])
    assert picked(d) == ("n", (3, 4, 5, 6))
    d = allocator.allocate(claim(5), [node("n", inv, taken=[0, 7])])
    assert d.per_node["n"] == "4 of 8 GPUs usable (2 taken, 2 unhealthy); need 5"


def test_a_gpu_in_mig_mode_is_never_given_whole_and_the_reason_says_so() -> None:
    inv = nvswitch("n", 4)
    mig = models.MigInfo(enabled=True)
    inv = dataclasses.replace(
        inv, devices=tuple(dataclasses.replace(d, mig=mig) if d.index in (1, 2) else d for d in inv.devices)
    )
    d = allocator.allocate(claim(2), [node("n", inv)])
    assert picked(d) == ("n", (0, 3))
    d = allocator.allocate(claim(3), [node("n", inv)])
    assert d.per_node["n"] == "2 of 4 GPUs usable (2 in MIG mode (use a MIG claim)); need 3"
    pinned = allocator.allocate(claim(1, policy="preferIds", prefer_ids=[2]), [node("n", inv)])
    assert pinned.per_node["n"] == "preferIds 2: 2 in MIG mode (use a MIG claim); 0 usable, need 1"


def mig_box(name: str, taken_whole: Iterable[int] = ()) -> models.NodeInventory:
    """Four GPUs; 0 and 1 in MIG mode, as the a100-mig profile splits a GPU: 3g.20gb at 0,
    2g.10gb at 4, two 1g.5gb at 6 and 7 (listed out of placement order)."""
    inv = nvswitch(name, 4)
    split = (
        ("1g.5gb", 7, 1, 4864),
        ("3g.20gb", 0, 4, 19968),
        ("2g.10gb", 4, 2, 9856),
        ("1g.5gb", 6, 1, 4864),
    )

    def instances(gpu: int) -> models.MigInfo:
        return models.MigInfo(
            enabled=True,
            devices=tuple(
                models.MigDevice(
                    index=j,
                    uuid=f"MIG-{name}-{gpu}-{j}",
                    profile=profile,
                    memory_mib=mib,
                    placement_start=start,
                    memory_slices=size,
                    compute_slices=int(profile[0]),
                )
                for j, (profile, start, size, mib) in enumerate(split)
            ),
        )

    return dataclasses.replace(
        inv,
        devices=tuple(
            dataclasses.replace(d, mig=instances(d.index)) if d.index < 2 else d for d in inv.devices
        ),
    )


def mig_picked(decision: allocator.Decision, replica: int = 0) -> tuple[str, tuple[str, ...]]:
    alloc = decision.allocations[replica]
    return alloc.node_name, tuple(d.uuid for d in alloc.devices)


def test_a_mig_claim_gets_instances_of_its_profile_packed_in_placement_order() -> None:
    views = [node("m", mig_box("m"))]
    one = allocator.allocate(claim(1, exclusivity="MIG", mig_profile="1g.5gb"), views)
    assert mig_picked(one) == ("m", ("MIG-m-0-3",))  # the 1g.5gb at slice 6 before the one at 7
    assert one.allocations[0].devices[0].index == 0  # the parent GPU
    two = allocator.allocate(claim(2, exclusivity="MIG", mig_profile="1g.5gb"), views)
    assert mig_picked(two) == ("m", ("MIG-m-0-3", "MIG-m-0-0"))  # both of GPU 0 first
    either = allocator.allocate(claim(1, exclusivity="MIG", mig_profile="2g.10gb, 3g.20gb"), views)
    assert mig_picked(either) == ("m", ("MIG-m-0-1",))  # 3g.20gb is placed first on GPU 0
    anything = allocator.allocate(claim(1, exclusivity="MIG"), views)
    assert mig_picked(anything) == ("m", ("MIG-m-0-1",))
    # Taken instances are skipped (the caller marks every instance of a GPU held whole taken).
    held = {"MIG-m-0-3", "MIG-m-0-0", *mig_box("m").devices[1].lock_ids}
    busy = [dataclasses.replace(views[0], taken=frozenset(held))]
    assert not allocator.allocate(claim(1, exclusivity="MIG", mig_profile="1g.5gb"), busy).ok
    spare = [dataclasses.replace(views[0], taken=frozenset({"MIG-m-0-3", "MIG-m-0-0", "GPU-m-0"}))]
    assert mig_picked(allocator.allocate(claim(1, exclusivity="MIG", mig_profile="1g.5gb"), spare)) == (
        "m",
        ("MIG-m-1-3",),
    )
    # Whole-GPU claims still never get a GPU in MIG mode.
    assert picked(allocator.allocate(claim(2), views)) == ("m", (2, 3))


def test_a_mig_claim_that_fits_nowhere_says_why() -> None:
    views = [node("m", mig_box("m")), node("plain", nvswitch("plain"))]
    d = allocator.allocate(claim(5, exclusivity="MIG", mig_profile="1g.5gb"), views)
    assert d.reason == (
        "0/2 nodes fit: 1 has fewer than 5 free MIG instances matching MIG profile 1g.5gb, "
        "1 has no GPU in MIG mode"
    )
    assert d.per_node["m"] == "4 of 8 MIG instances usable (0 taken or unhealthy); need 5"
    pinned = allocator.allocate(claim(1, exclusivity="MIG", policy="preferIds", prefer_ids=[0]), views)
    assert pinned.reason == "policy preferIds names whole GPUs; a MIG claim cannot use it"


def shared_box(name: str, slots: int = 4, strategy: str = "TimeSlicing", n: int = 4) -> models.NodeInventory:
    """``n`` GPUs the agent offers with ``--sharing <strategy>:<slots>``; GPU 0 in MIG mode (not shared)."""
    inv = nvswitch(name, n)
    offered = models.DeviceSharing(strategy=strategy, replicas=slots)
    return dataclasses.replace(
        inv,
        devices=tuple(
            dataclasses.replace(d, mig=models.MigInfo(enabled=True))
            if d.index == 0
            else dataclasses.replace(d, sharing=offered)
            for d in inv.devices
        ),
    )


def shared(
    count: int = 1, *, most: int | None = None, strategy: str = "TimeSlicing", **kw: Any
) -> models.GpuClaim:
    request = models.SharingRequest(strategy=strategy, max_claims_per_gpu=most)
    return claim(count, exclusivity="Shared", sharing=request, **kw)


def slots_of(decision: allocator.Decision) -> list[tuple[int, int | None]]:
    return [(d.index, d.slot) for a in decision.allocations for d in a.devices]


def hold(view: allocator.NodeView, decision: allocator.Decision) -> allocator.NodeView:
    """The view once the decision's Leases exist (``views.taken_on``'s closure: the GPU too)."""
    held = {lock for a in decision.allocations for d in a.devices for lock in (d.lock_id, d.uuid)}
    return dataclasses.replace(view, taken=view.taken | held)


def test_shared_claims_fill_one_gpu_slot_by_slot_and_the_fifth_goes_elsewhere() -> None:
    view = node("s", shared_box("s", slots=4))
    got = []
    for _ in range(5):
        decision = allocator.allocate(shared(most=4), [view])
        got += slots_of(decision)
        view = hold(view, decision)
    # The fullest shared GPU first: GPU 1's four slots, then GPU 2 (GPU 0 is in MIG mode).
    assert got == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
    lease = {d.lock_id for d in decision.allocations[0].devices}
    assert lease == {"GPU-s-2-s0"}


def test_a_shared_gpu_is_never_given_whole_nor_to_a_claim_that_wants_fewer_sharers() -> None:
    views = [node("s", shared_box("s", slots=4))]
    whole = allocator.allocate(claim(1), views)
    assert whole.per_node["s"] == (
        "0 of 4 GPUs usable (1 in MIG mode (use a MIG claim), 3 shared (use a Shared claim)); need 1"
    )
    fewer = allocator.allocate(shared(most=2), views)
    assert fewer.reason == "0/1 nodes fit: 1 has no GPU shared by TimeSlicing of at most 2 claims"
    mps = allocator.allocate(shared(strategy="MPS"), views)
    assert mps.reason == "0/1 nodes fit: 1 has no GPU shared by MPS"
    pinned = allocator.allocate(claim(1, policy="preferIds", prefer_ids=[2]), views)
    assert pinned.per_node["s"] == "preferIds 2: 2 shared (use a Shared claim); 0 usable, need 1"


def test_a_shared_claim_takes_no_slot_of_a_gpu_held_whole_and_its_replicas_use_different_gpus() -> None:
    view = node("s", shared_box("s", slots=2))
    gpu1 = shared_box("s", slots=2).devices[1]
    held_whole = dataclasses.replace(view, taken=view.taken | set(gpu1.lock_ids))
    assert slots_of(allocator.allocate(shared(), [held_whole])) == [(2, 0)]
    # A gang's replicas are separate workers: each gets GPUs of its own, never another slot of a
    # GPU an earlier replica took; three shared GPUs cannot hold two replicas of two.
    assert allocator.allocate(shared(2, replicas=2), [view]).reason.startswith("only 1 of 2 replicas fit")
    five = node("s", shared_box("s", slots=2, n=5))
    assert slots_of(allocator.allocate(shared(2, replicas=2), [five])) == [(1, 0), (2, 0), (3, 0), (4, 0)]
    full = allocator.allocate(shared(4), [view])
    assert full.reason == "0/1 nodes fit: 1 has fewer than 4 TimeSlicing GPUs with a free slot"


def test_a_node_tainted_against_the_claim_is_skipped_and_explained() -> None:
    gpu_pool = models.Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")
    reserved = models.Taint(key="team", value="ml", effect="NoExecute")
    soft = models.Taint(key="spot", value="true", effect="PreferNoSchedule")
    views = [
        dataclasses.replace(node("a", nvswitch("a")), taints=(reserved,)),
        dataclasses.replace(node("b", nvswitch("b")), taints=(gpu_pool,)),
    ]
    # The GKE/AKS GPU pool taint is tolerated by default; another taint needs the claim's toleration.
    assert picked(allocator.allocate(claim(8, node_name="b"), views)) == ("b", tuple(range(8)))
    refused = allocator.allocate(claim(8, node_name="a"), views)
    assert refused.per_node["a"] == "tainted team=ml:NoExecute, which the claim does not tolerate"
    assert (
        refused.reason == '0/2 nodes fit: 1 is tainted team=ml:NoExecute, 1 is not the requested nodeName "a"'
    )
    tolerant = dataclasses.replace(
        claim(8, node_name="a"),
        spec=dataclasses.replace(
            claim(8, node_name="a").spec, tolerations=(models.Toleration(key="team", operator="Exists"),)
        ),
    )
    assert picked(allocator.allocate(tolerant, views)) == ("a", tuple(range(8)))
    soft_only = [dataclasses.replace(node("c", nvswitch("c")), taints=(soft,))]
    assert picked(allocator.allocate(claim(1), soft_only))[0] == "c"  # PreferNoSchedule does not block


def test_prefer_ids_pins_the_indices() -> None:
    d = allocator.allocate(claim(2, policy="preferIds", prefer_ids=[7, 3]), [node("n", bridged("n"))])
    assert picked(d) == ("n", (3, 7))
    d = allocator.allocate(claim(2, policy="preferIds", prefer_ids=[1, 3, 6]), [node("n", bridged("n"))])
    assert picked(d) == ("n", (1, 3))  # the bridged pair among the three


def test_prefer_ids_failure_names_taken_unhealthy_and_missing_indices() -> None:
    inv = unhealthy(nvswitch("n"), 1)
    c = claim(3, policy="preferIds", prefer_ids=[0, 1, 9], node_name="n")
    d = allocator.allocate(c, [node("n", inv, taken=[0]), node("m", nvswitch("m"))])
    assert d.reason == (
        '0/2 nodes fit: 1 is not the requested nodeName "n", '
        "1 cannot give preferIds 0,1,9 (9 missing; 1 unhealthy; 0 taken)"
    )
    assert d.per_node["n"] == "preferIds 0,1,9: 9 missing; 1 unhealthy; 0 taken; 0 usable, need 3"
    too_few = allocator.allocate(claim(3, policy="preferIds", prefer_ids=[0, 0, 1]), [node("n", inv)])
    assert too_few.reason.startswith("policy preferIds lists 2 distinct indices but count is 3")


# ------------------------------------------------------------------ node states and reasons


def test_cordoned_not_ready_missing_node_and_missing_status_each_have_a_reason() -> None:
    nodes = [
        node("a", nvswitch("a"), unschedulable=True),
        node("b", nvswitch("b"), unschedulable=True),
        node("c", nvswitch("c"), ready=False),
        node("d", nvswitch("d"), present=False),
        node("e", None),
        node("f", nvswitch("f"), taken=range(6)),
    ]
    d = allocator.allocate(claim(4), nodes)
    assert d.allocations == ()
    assert d.reason == (
        "0/6 nodes fit: 2 are cordoned, 1 has no Node object, 1 has no GpuNodeStatus, 1 is not ready, "
        "1 has fewer than 4 free healthy GPUs"
    )
    assert "\n" not in d.reason
    assert d.per_node == {
        "a": "cordoned (spec.unschedulable)",
        "b": "cordoned (spec.unschedulable)",
        "c": "GpuNodeStatus not Ready or heartbeat stale (agent down?)",
        "d": "the Node object does not exist",
        "e": "no GpuNodeStatus (agent not running?)",
        "f": "2 of 8 GPUs usable (6 taken); need 4",
    }


def test_reason_counts_most_common_first_like_the_issue_example() -> None:
    nodes = [node(f"small{i}", nvswitch(f"small{i}"), taken=range(5)) for i in range(7)]
    nodes += [node(f"pcie{i}", pcie(f"pcie{i}")) for i in range(4)]
    nodes += [node("cordoned", nvswitch("cordoned"), unschedulable=True)]
    d = allocator.allocate(claim(4, mode="Required", min_bw=600), nodes)
    assert d.reason == (
        "0/12 nodes fit: 7 have fewer than 4 free healthy GPUs, "
        "4 have no 4-GPU set with >=600 GB/s, 1 is cordoned"
    )


def test_no_nodes_and_invalid_claims_give_actionable_reasons() -> None:
    assert allocator.allocate(claim(1), []).reason == "0/0 nodes fit: no GPU nodes are known"
    nodes = [node("n", nvswitch("n"))]
    assert allocator.allocate(claim(1, exclusivity="Shared"), nodes).reason == (
        "0/1 nodes fit: 1 has no GPU shared by TimeSlicing"
    )
    assert allocator.allocate(claim(0), nodes).reason == "devices.count must be at least 1 (got 0)"
    assert "minComputeCapability" in allocator.allocate(claim(1, min_cc="nine"), nodes).reason
    assert "unknown strategy" in allocator.allocate(claim(1, strategy="cheapest"), nodes).reason


def test_explain_searches_every_node_without_changing_the_decision() -> None:
    nodes = [node("a", nvswitch("a"), taken=range(4)), node("b", pcie("b")), node("c", nvswitch("c"))]
    quick = allocator.allocate(claim(2), nodes)
    full = allocator.allocate(claim(2), nodes, explain=True)
    assert quick.allocations == full.allocations
    assert "not searched" in quick.per_node["b"]
    assert full.per_node["b"].startswith("fits: gpus 0,1 (min 64 GB/s")
    assert full.per_node["a"].startswith("chosen: replica 0 took gpus 4,5")


# ------------------------------------------------------------------ gangs


def test_gang_replicas_get_disjoint_devices_and_may_share_a_node() -> None:
    d = allocator.allocate(claim(4, replicas=2), [node("n", nvswitch("n"))])
    assert [picked(d, r) for r in range(2)] == [("n", (0, 1, 2, 3)), ("n", (4, 5, 6, 7))]
    assert [a.replica for a in d.allocations] == [0, 1]


def test_gang_is_all_or_nothing_and_says_how_many_replicas_fit() -> None:
    nodes = [
        node("a", nvswitch("a")),
        node("b", nvswitch("b"), taken=range(4)),
        node("c", pcie("c"), unschedulable=True),
    ]
    d = allocator.allocate(claim(4, replicas=4), nodes)
    assert d.allocations == ()
    assert (
        d.reason
        == "only 3 of 4 replicas fit: of 3 nodes, 2 have fewer than 4 free healthy GPUs, 1 is cordoned"
    )
    ok = allocator.allocate(claim(4, replicas=3), nodes)
    assert sorted(a.node_name for a in ok.allocations) == ["a", "a", "b"]


def test_order_pending_is_priority_then_age_then_name() -> None:
    cs = [
        claim(name="late", created="2025-01-02T00:00:00Z"),
        claim(name="b", created="2025-01-01T00:00:00Z"),
        claim(name="a", created="2025-01-01T00:00:00Z", namespace="z"),
        claim(name="a", created="2025-01-01T00:00:00Z"),
        claim(name="urgent", created="2025-01-03T00:00:00Z", priority=10),
    ]
    order = [c.key for c in allocator.order_pending(cs)]
    assert order == ["default/urgent", "default/a", "default/b", "z/a", "default/late"]


# ------------------------------------------------------------------ gangs across nodes

CLIQUE = "nvidia.com/gpu.clique"


def gang(replicas: int, count: int, mode: str = "Required") -> models.GpuClaim:
    c = claim(count, replicas=replicas)
    topology = dataclasses.replace(c.spec.topology, same_node_label=CLIQUE, same_node_label_mode=mode)
    return dataclasses.replace(c, spec=dataclasses.replace(c.spec, topology=topology))


def cliques(layout: Mapping[str, Sequence[int]]) -> list[allocator.NodeView]:
    """Nodes per clique value, each entry the number of GPUs taken on an 8-GPU node."""
    views = []
    for value, taken_counts in layout.items():
        for i, taken in enumerate(taken_counts):
            name = f"{value}-{i}"
            views.append(node(name, nvswitch(name), taken=range(taken), labels={CLIQUE: value}))
    return views


def test_a_required_gang_lands_inside_one_clique_the_fullest_that_takes_it() -> None:
    views = [*cliques({"a": [6, 6], "b": [4, 4], "c": [0, 0]}), node("loose", nvswitch("loose"))]
    d = allocator.allocate(gang(4, 2), views)
    assert {a.node_name for a in d.allocations} == {"b-0", "b-1"}  # a is too full, c is kept whole
    d = allocator.allocate(gang(4, 4), views)  # 16 GPUs: only c has them
    assert {a.node_name for a in d.allocations} == {"c-0", "c-1"} and len(d.allocations) == 4


def test_a_required_gang_that_no_clique_takes_stays_unplaced_with_a_reason_per_clique() -> None:
    views = [*cliques({"a": [4], "b": [0]}), node("loose", nvswitch("loose"))]
    d = allocator.allocate(gang(3, 4), views)
    assert d.allocations == ()
    assert d.reason.startswith(
        f"no {CLIQUE} domain takes all 3 replicas ({CLIQUE}=a: only 1 of 3 replicas fit"
    )
    assert f"; {CLIQUE}=b: only 2 of 3 replicas fit" in d.reason and d.reason.endswith(
        f"; 1 node without {CLIQUE})"
    )
    assert d.per_node["loose"] == f"has no label {CLIQUE}"
    assert d.per_node["a-0"].startswith(f"{CLIQUE}=a: ")


def test_a_preferred_gang_puts_the_most_replicas_in_one_clique_and_the_rest_anywhere() -> None:
    views = [*cliques({"a": [0], "b": [0, 0]}), node("loose", nvswitch("loose"))]
    d = allocator.allocate(gang(3, 8, mode="Preferred"), views)
    assert [a.replica for a in d.allocations] == [0, 1, 2]
    assert {a.node_name for a in d.allocations[:2]} == {"b-0", "b-1"}
    assert d.allocations[2].node_name in {"a-0", "loose"}
    uuids = [dev.uuid for a in d.allocations for dev in a.devices]
    assert len(set(uuids)) == len(uuids) == 24


def test_the_memo_keeps_one_inventory_per_node_however_often_each_is_parsed_anew() -> None:
    # The controller parses every GpuNodeStatus heartbeat into a new inventory object: the memo
    # must not keep the old ones (the 1-hour soak's controller grew by 14 MiB/h until it held 1024).
    names = ("n0", "n1", "n2", "n3")
    node_tables.PREPARED.clear()  # other tests' nodes
    for _ in range(300):
        views = [node(name, nvswitch(name)) for name in names]  # new objects each time
        assert allocator.allocate(claim(2), views).allocations
    assert len(node_tables.PREPARED) <= len(names)
    assert all(
        node_tables.PREPARED[name].inventory is v.inventory for name, v in zip(names, views, strict=True)
    )


def count_screened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the nodes the allocator screens from now on, in order."""
    screened: list[str] = []
    real = screening.screen

    def counting(view: allocator.NodeView, *args: Any) -> Any:
        screened.append(view.name)
        return real(view, *args)

    monkeypatch.setattr(allocator, "screen", counting)
    return screened


def test_an_index_finds_the_winner_without_screening_every_node(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1,000 nodes: the even ones have 2 GPUs free, the odd ones 8 (binpack takes the fullest).
    views = [
        node(f"n{i:04d}", nvswitch(f"n{i:04d}"), taken=range(6) if i % 2 == 0 else ()) for i in range(1000)
    ]
    index = node_tables.NodeIndex(views)
    screened = count_screened(monkeypatch)
    by_index = allocator.allocate(claim(2), index)
    assert picked(by_index) == ("n0000", (6, 7))
    assert screened == ["n0000"]
    # Three GPUs fit only the odd nodes: the even ones' bucket is never visited.
    screened.clear()
    assert picked(allocator.allocate(claim(3), index)) == ("n0001", (0, 1, 2))
    assert screened == ["n0001"]
    # More than any node has free: refused at once, without screening a node.
    crowded = node_tables.NodeIndex([node("x", nvswitch("x"), taken=range(5))])
    screened.clear()
    assert allocator.allocate(claim(4), crowded).reason == (
        "0/1 nodes fit: none has 4 free healthy GPUs (at most 3 on one node)"
    )
    assert screened == []
    # The full search screens them all, and decides the same.
    screened.clear()
    assert picked(allocator.allocate(claim(3), views)) == ("n0001", (0, 1, 2))
    assert len(set(screened)) == 1000


def test_a_set_that_must_span_two_numa_nodes_is_found_on_the_first_tied_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two NUMA nodes of four GPUs each: 8 GPUs, or 4 where only 2 + 2 are free, span both on
    # every node. The bound says so, and the search stops at the first node instead of looking
    # on every tied node for a set on one NUMA node.
    empty = [node(f"e{i:04d}", nvswitch(f"e{i:04d}")) for i in range(1000)]
    split = [node(f"s{i:04d}", nvswitch(f"s{i:04d}"), taken=(0, 1, 4, 5)) for i in range(1000)]
    screened = count_screened(monkeypatch)
    assert picked(allocator.allocate(claim(8), node_tables.NodeIndex(empty))) == ("e0000", tuple(range(8)))
    assert screened == ["e0000"]
    screened.clear()
    assert picked(allocator.allocate(claim(4), node_tables.NodeIndex(split))) == ("s0000", (2, 3, 6, 7))
    assert screened == ["s0000"]
    # The full search finds the same set, and searches one node of each group of tied nodes.
    screened.clear()
    assert picked(allocator.allocate(claim(4), split)) == ("s0000", (2, 3, 6, 7))
    assert len(set(screened)) == 1000  # (it screens every node; it searches the first)
    # Where one node has its 4 free GPUs on one NUMA node, it wins over the split ones.
    mixed = [*split[:999], node("s0999", nvswitch("s0999"), taken=(0, 1, 2, 3))]
    screened.clear()
    assert picked(allocator.allocate(claim(4), node_tables.NodeIndex(mixed))) == ("s0999", (4, 5, 6, 7))
    assert screened == ["s0999"]


def test_fewest_numa_nodes_a_set_can_span() -> None:
    assert node_tables.fewest_numa_nodes((4, 4), 8) == 2
    assert node_tables.fewest_numa_nodes((4, 4), 4) == 1
    assert node_tables.fewest_numa_nodes((3, 2, 2), 4) == 2
    assert node_tables.fewest_numa_nodes((2, 2, 1), 5) == 3
    assert node_tables.fewest_numa_nodes((1,), 1) == 1
    assert node_tables.per_numa(nvswitch("n").devices) == (4, 4)


def test_a_node_set_search_is_remembered_until_its_free_devices_change() -> None:
    inv = pcie("n1")  # two NUMA nodes of four: the best pair depends on which GPUs are free
    first = allocator.allocate(claim(2), [node("n1", inv, taken=[0])])
    searches = node_tables.prepare("n1", inv, 1).searches
    remembered = dict(searches)
    again = allocator.allocate(claim(2), [node("n1", inv, taken=[0])])
    assert picked(again) == picked(first)
    assert searches == remembered  # answered from the memo: nothing searched anew
    moved = allocator.allocate(claim(2), [node("n1", inv, taken=[0, 2, 3])])
    assert len(searches) == len(remembered) + 1  # other free GPUs: searched anew
    assert picked(moved)[1] != picked(first)[1] and not {0, 2, 3} & set(picked(moved)[1])
    searches.clear()
    assert picked(allocator.allocate(claim(2), [node("n1", inv, taken=[0, 2, 3])])) == picked(moved)
