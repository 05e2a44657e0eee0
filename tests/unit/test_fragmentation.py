"""The leastFragmentation strategy (controller.fragmentation) and its place in the allocator."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import pytest

from controller import allocator, fragmentation
from controller.fragmentation import MILLI, Recent, Shape, Workload
from controller.nodes import NodeIndex
from gpualloc.api import models

GIB = 2**30
TWO_GPUS = Shape(gpus=2, cpu=8000, memory=32 * GIB)


def _inventory(name: str, n: int, product: str = "NVIDIA A100-SXM4-40GB") -> models.NodeInventory:
    devices = tuple(
        models.Device(index=i, minor=i, uuid=f"GPU-{name}-{i}", product=product, memory_mib=40960)
        for i in range(n)
    )
    links = tuple(
        models.Link(a=a, b=b, type="NV12", nvlinks=12, bandwidth_gbps=600)
        for a in range(n)
        for b in range(a + 1, n)
    )
    return models.NodeInventory(
        devices=devices, links=links, islands=(tuple(range(n)),), total=n, product=product
    )


def _view(
    name: str,
    n: int = 4,
    *,
    taken: Iterable[int] = (),
    cpu: int | None = None,
    product: str = "NVIDIA A100-SXM4-40GB",
) -> allocator.NodeView:
    allocatable: Mapping[str, int] = {}
    free: Mapping[str, int] = {}
    if cpu is not None:
        allocatable = {"cpu": 64_000, "memory": 512 * GIB, "pods": 110}
        free = {"cpu": cpu, "memory": 512 * GIB, "pods": 100}
    return allocator.NodeView(
        name=name,
        labels={},
        unschedulable=False,
        node_present=True,
        ready=True,
        inventory=_inventory(name, n, product),
        taken=frozenset(f"GPU-{name}-{i}" for i in taken),
        allocatable=allocatable,
        free=free,
    )


def _claim(
    count: int, *, cpu: int = 0, replicas: int = 1, milli: int | None = None, **spec: object
) -> models.GpuClaim:
    devices = models.DeviceRequest(count=count)
    if milli is not None:
        devices = models.DeviceRequest(
            count=count, exclusivity="Shared", sharing=models.SharingRequest(milli=milli)
        )
    return models.GpuClaim(
        metadata=models.ObjectMeta(name="c", namespace="ns", uid="u"),
        spec=models.GpuClaimSpec(
            devices=devices,
            strategy=fragmentation.STRATEGY,
            replicas=replicas,
            pod_resources={"cpu": cpu} if cpu else {},
            **spec,  # type: ignore[arg-type]
        ),
    )


def _nodes_of(decision: allocator.Decision) -> list[str]:
    return [a.node_name for a in decision.allocations]


# ------------------------------------------------------------------ F


def test_free_gpus_that_the_typical_claim_cannot_use_are_fragments() -> None:
    workload = Workload({TWO_GPUS: 1.0})
    assert workload.fragmentation("A100", [MILLI], None, None) == MILLI  # one GPU: no 2-GPU claim fits
    assert workload.fragmentation("A100", [MILLI, MILLI], None, None) == 0
    assert workload.fragmentation("A100", [MILLI, MILLI, 0, 0], None, None) == 0  # taken GPUs add nothing


def test_a_node_without_the_typical_claims_cpu_is_all_fragment() -> None:
    workload = Workload({TWO_GPUS: 1.0})
    assert workload.fragmentation("A100", [MILLI] * 4, 8000, None) == 0
    assert workload.fragmentation("A100", [MILLI] * 4, 7999, None) == 4 * MILLI
    assert workload.fragmentation("A100", [MILLI] * 4, None, 32 * GIB - 1) == 4 * MILLI


def test_shares_leave_fragments_smaller_than_the_typical_share() -> None:
    share = Shape(gpus=1, milli=500)
    workload = Workload({share: 1.0})
    assert workload.fragmentation("A100", [300, 600], None, None) == 300  # 600 holds a share, 300 not
    assert workload.fragmentation("A100", [300, 400], None, None) == 700


def test_a_shape_counts_only_on_the_products_it_accepts() -> None:
    workload = Workload({Shape(gpus=1, products=("NVIDIA A100*",)): 1.0})
    assert workload.fragmentation("NVIDIA A100-SXM4-40GB", [MILLI], None, None) == 0
    assert workload.fragmentation("Tesla T4", [MILLI], None, None) == MILLI


def test_fragmentation_is_weighed_by_each_shapes_frequency() -> None:
    workload = Workload({Shape(gpus=1): 3.0, TWO_GPUS: 1.0})
    assert workload.fragmentation("A100", [MILLI], None, None) == pytest.approx(0.25 * MILLI)


def test_to_pods_without_gpus_every_free_gpu_is_fragment_whatever_the_cpu_left() -> None:
    """FGD's typical tasks include CPU-only ones (the paper's isInvolvedCpuPods): no GPU is of use to
    them, on a node with room for them or not."""
    pods = Shape(gpus=0, cpu=4000, memory=8 * GIB)
    workload = Workload({TWO_GPUS: 3.0, pods: 1.0})
    assert workload.shapes == (pods, TWO_GPUS)
    assert workload.fragmentation("A100", [MILLI, MILLI], 64_000, None) == pytest.approx(0.25 * 2 * MILLI)
    assert workload.fragmentation("A100", [MILLI, MILLI], 0, None) == pytest.approx(2 * MILLI)
    assert workload.fragmentation("A100", [MILLI, 0], 64_000, None) == pytest.approx(MILLI)
    assert workload._cpus == [8000]  # only the shapes with GPUs tell CPU levels apart


def test_equal_states_are_computed_once() -> None:
    workload = Workload({TWO_GPUS: 1.0})
    workload.fragmentation("A100", [MILLI, 0, MILLI], 9000, None)
    workload.fragmentation("A100", [0, MILLI, MILLI], 12000, None)  # same GPUs, same CPU level
    assert len(workload._memo) == 1


# ------------------------------------------------------------------ ranking


def test_the_claim_goes_where_the_rest_still_holds_the_typical_claim() -> None:
    """binpack takes the fuller node and strands its last GPU; leastFragmentation does not."""
    views = [_view("a", taken=[0]), _view("b", taken=[0, 1])]
    workload = Workload({TWO_GPUS: 1.0})
    assert _nodes_of(allocator.allocate(_claim(1), views, workload=workload)) == ["a"]
    binpack = _claim(1)
    binpack = dataclasses.replace(binpack, spec=dataclasses.replace(binpack.spec, strategy="binpack"))
    assert _nodes_of(allocator.allocate(binpack, views)) == ["b"]


def test_the_claims_cpu_counts_where_it_would_leave_gpus_no_pods_can_use() -> None:
    """Two nodes alike but for CPU: on "a" the claim's pods would leave too little CPU for the
    next claim's, stranding its free GPUs."""
    views = [_view("a", cpu=12_000), _view("b", cpu=40_000)]
    workload = Workload({TWO_GPUS: 1.0})
    decision = allocator.allocate(_claim(1, cpu=6000), views, workload=workload)
    assert _nodes_of(decision) == ["b"]


def test_the_score_is_fgds_sigmoid_in_whole_steps() -> None:
    assert fragmentation.score(0) == 50
    assert fragmentation.score(-MILLI) == 73  # a placement that removes a GPU of fragments
    assert fragmentation.score(MILLI) == 26
    assert fragmentation.score(-30) == fragmentation.score(-1) == 50  # near-equal placements tie
    assert fragmentation.score(10**9) == 0 and fragmentation.score(-(10**9)) == 100


def test_a_claim_any_product_will_do_goes_to_the_product_named_claims_need_least() -> None:
    """Node a (T4) is the better fit, but claims that need a T4 are a third of the workload and
    nothing names an A100: the claim that takes either goes to the A100s."""
    t4 = Shape(gpus=1, products=("Tesla T4",))
    workload = Workload({t4: 1.0, Shape(gpus=1): 2.0})
    views = [_view("a", taken=[0, 1, 2], product="Tesla T4"), _view("b", taken=[0])]
    assert _nodes_of(allocator.allocate(_claim(1), views, workload=workload)) == ["b"]
    assert _nodes_of(allocator.allocate(_claim(1), views, workload=Workload({Shape(gpus=1): 1.0}))) == ["a"]
    a100 = "NVIDIA A100-SXM4-40GB"
    # T4s: all the named demand, a quarter of the free GPUs (ratio 4: tier 1); A100s: none named.
    assert fragmentation.pressures(workload, {"Tesla T4": MILLI, a100: 3 * MILLI}) == {"Tesla T4": 1, a100: 0}
    # Ratio 3 (a third of the free GPUs): below PRESSURE_FROM, no pressure.
    assert fragmentation.pressures(workload, {"Tesla T4": MILLI, a100: 2 * MILLI}) == {"Tesla T4": 0, a100: 0}


def test_a_products_pressure_grows_as_its_share_of_the_free_gpus_shrinks() -> None:
    workload = Workload({Shape(gpus=1, products=("Tesla T4",)): 1.0, Shape(gpus=1): 1.0})
    views = [_view("a", taken=[0, 1, 2], product="Tesla T4"), _view("b", n=8, taken=[0], product="V100")]
    free = fragmentation.free_milli(views)
    assert free == {"Tesla T4": MILLI, "V100": 7 * MILLI}
    assert fragmentation.pressures(workload, free)["Tesla T4"] == 2  # 1 / (1/8): 8, a doubling past 4
    assert fragmentation.pressures(workload, {"Tesla T4": 7 * MILLI, "V100": MILLI})["Tesla T4"] == 0  # 8/7
    assert fragmentation.pressures(Workload({Shape(gpus=1): 1.0}), free) == {}  # nothing named


def test_a_share_goes_where_the_gpu_it_lands_on_still_holds_the_typical_share() -> None:
    """Best fit would put a 500 share on "a"'s GPU with 600 left, leaving 100 no share can use;
    against a workload of 500 shares it goes on "b"'s free GPU, which keeps room for the next."""
    half = Shape(gpus=1, milli=500)
    a = _view("a", n=1)
    a = dataclasses.replace(a, taken=frozenset({"GPU-a-0"}), milli_used={"GPU-a-0": 400})
    views = [a, _view("b", n=1)]
    assert _nodes_of(allocator.allocate(_claim(1, milli=500), views, workload=Workload({half: 1.0}))) == ["b"]
    assert _nodes_of(allocator.allocate(_claim(1, milli=500), views)) == ["a"]  # no workload: first fit


def test_among_equal_scores_the_first_node_by_name_goes_first() -> None:
    """First fit, as the paper's simulator breaks FGD's ties: not the smaller node, not the
    best fit."""
    workload = Workload({Shape(gpus=1): 1.0})
    views = [_view("a", n=8), _view("b", n=4, taken=[0, 1])]
    assert _nodes_of(allocator.allocate(_claim(1), views, workload=workload)) == ["a"]


def test_without_a_workload_it_is_first_fit() -> None:
    views = [_view("a", taken=[0]), _view("b", taken=[0, 1]), _view("c")]
    assert _nodes_of(allocator.allocate(_claim(1), views)) == ["a"]
    assert _nodes_of(allocator.allocate(_claim(4), views)) == ["c"]  # the first that fits


def test_the_index_gives_the_same_decision_as_the_list() -> None:
    views = [_view(f"n{i}", taken=range(i % 4)) for i in range(12)]
    workload = Workload({TWO_GPUS: 2.0, Shape(gpus=1): 1.0})
    for count in (1, 2, 3):
        listed = allocator.allocate(_claim(count), views, workload=workload)
        indexed = allocator.allocate(_claim(count), NodeIndex(views), workload=workload)
        assert listed.allocations == indexed.allocations and listed.ok


def test_a_gang_places_every_replica_and_keeps_the_bandwidth_bar() -> None:
    views = [_view("a", taken=[0]), _view("b")]
    workload = Workload({TWO_GPUS: 1.0})
    claim = _claim(2, replicas=3, topology=models.Topology(mode="Required", min_bandwidth_gbps=600))
    decision = allocator.allocate(claim, views, workload=workload)
    assert decision.ok and len(decision.allocations) == 3
    used = [d.uuid for a in decision.allocations for d in a.devices]
    assert len(used) == len(set(used)) == 6
    assert all(a.min_bandwidth_gbps == 600 for a in decision.allocations)


def test_a_bandwidth_bar_no_node_meets_is_still_refused() -> None:
    views = [_view("a")]
    claim = _claim(2, topology=models.Topology(mode="Required", min_bandwidth_gbps=900))
    decision = allocator.allocate(claim, views, workload=Workload({TWO_GPUS: 1.0}))
    assert not decision.ok and "900" in decision.reason


# ------------------------------------------------------------------ pods without GPUs, the workload


def test_pods_without_gpus_go_where_their_cpu_strands_no_gpu() -> None:
    workload = Workload({TWO_GPUS: 1.0})
    pods = Shape(gpus=0, cpu=30_000)
    busy = fragmentation.pods_key(workload, "A100", [0, 0, 0, 0], 34_000, 512 * GIB, pods)
    idle = fragmentation.pods_key(workload, "A100", [MILLI] * 4, 34_000, 512 * GIB, pods)
    assert busy[0] == 0 and idle[0] == 4 * MILLI  # the idle node's GPUs would lose their CPU
    assert busy < idle


def test_recent_keeps_the_frequent_shapes_and_forgets_old_claims() -> None:
    recent = Recent(window=100, refresh=10)
    for _ in range(99):
        recent.observe(Shape(gpus=1))
    recent.observe(Shape(gpus=8))  # 1% of the window: below the coverage cut
    assert recent.workload().shapes == (Shape(gpus=1),)
    for _ in range(100):
        recent.observe(TWO_GPUS)
    assert recent.workload().shapes == (TWO_GPUS,)


def test_recent_takes_a_claims_shape_from_its_spec() -> None:
    recent = Recent(refresh=1)
    recent.observe_claim(_claim(2, cpu=8000))
    (shape,) = recent.workload().shapes
    assert (shape.gpus, shape.milli, shape.cpu) == (2, MILLI, 8000)


def test_recent_keeps_the_pods_without_gpus_it_is_told_of() -> None:
    recent = Recent(refresh=1)
    recent.observe_claim(_claim(2, cpu=8000))
    recent.observe_pod({"cpu": 4000, "memory": 8 * GIB, "pods": 1})
    assert recent.workload().shapes == (Shape(gpus=0, cpu=4000, memory=8 * GIB), Shape(gpus=2, cpu=8000))


def test_recent_keeps_fractional_shares_too() -> None:
    recent = Recent(refresh=1)
    recent.observe_claim(_claim(1, milli=460))
    assert [(s.gpus, s.milli) for s in recent.workload().shapes] == [(1, 460)]
