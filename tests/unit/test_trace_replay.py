"""The openb trace replay's pure parts: the workload, the cluster's accounting, the baselines
(Random, BestFit, FGD) and the gpualloc policy's use of the allocator (bench/trace_replay.py,
bench/packing_policies.py)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import packing_policies as pp
import trace_replay as tr

from controller import fragmentation


def _task(
    name: str, *, cpu: int = 1000, memory: int = 1024, gpus: int = 1, milli: int = 1000, spec: str = ""
) -> pp.Task:
    return pp.Task(name=name, cpu=cpu, memory=memory, gpus=gpus, milli=milli if gpus else 0, spec=spec)


def _node(
    name: str, *, gpus: int = 2, model: str = "T4", cpu: int = 64_000, memory: int = 262_144
) -> pp.Node:
    return pp.Node(name=name, cpu=cpu, memory=memory, gpus=gpus, model=model)


def _mixed_trace(n: int) -> list[pp.Task]:
    rng = random.Random(7)
    shapes = [dict(gpus=1, milli=460), dict(gpus=1, milli=1000), dict(gpus=2), dict(gpus=8), dict(gpus=0)]
    return [_task(f"t-{i:04d}", **rng.choice(shapes)) for i in range(n)]  # type: ignore[arg-type]


def _choosers(cluster: pp.Cluster) -> dict[str, tr.Chooser]:
    ledger = pp.FragLedger(pp.Fragmentation(pp.typical_tasks(_mixed_trace(200)), cluster), cluster)
    policy = tr.AllocatorPolicy(cluster, random.Random(1))
    return {
        "random": lambda t: pp.choose_random(cluster, t, random.Random(3)),
        "bestfit": lambda t: pp.choose_bestfit(cluster, t),
        "fgd": lambda t: pp.choose_fgd(cluster, t, ledger),
        "gpualloc": policy.choose,
    }


# ------------------------------------------------------------------ the workload


def test_inflation_stops_at_the_target_and_never_past_it() -> None:
    tasks = _mixed_trace(300)
    capacity = 1000 * pp.MILLI  # the trace asks about 750 GPUs: the rest is drawn
    workload = tr.inflate(tasks, capacity, 1.3, seed=42)
    asked = sum(t.total_milli for t in workload)
    assert asked <= 1.3 * capacity
    # It stopped at the first draw that would have crossed the target, so it is within one task of it.
    assert asked > 1.3 * capacity - 8 * pp.MILLI
    assert len(workload) > len(tasks)


def test_inflation_submits_every_trace_task_once_before_any_drawn_one_in_a_seeded_order() -> None:
    tasks = _mixed_trace(100)
    workload = tr.inflate(tasks, 10_000 * pp.MILLI, 1.3, seed=42)
    first = workload[: len(tasks)]
    assert sorted(t.name for t in first) == sorted(t.name for t in tasks)
    assert all("-drawn-" in t.name for t in workload[len(tasks) :])
    assert [t.name for t in tr.inflate(tasks, 10_000 * pp.MILLI, 1.3, seed=42)] == [t.name for t in workload]
    assert [t.name for t in tr.inflate(tasks, 10_000 * pp.MILLI, 1.3, seed=43)] != [t.name for t in workload]


def test_inflation_removes_tasks_when_the_trace_alone_asks_more_than_the_target() -> None:
    tasks = _mixed_trace(300)
    capacity = 50 * pp.MILLI
    workload = tr.inflate(tasks, capacity, 1.3, seed=1)
    assert sum(t.total_milli for t in workload) <= 1.3 * capacity
    assert len(workload) < len(tasks)


def test_the_measure_averages_the_records_that_round_to_each_percent() -> None:
    arrived = np.array([0.2, 99.6, 100.4, 101.0, 129.8])
    values = np.array([0.1, 90.0, 92.0, 93.0, 95.0])
    curve = tr.discrete(arrived, values)
    assert curve[100] == 91.0  # 99.6 and 100.4
    assert curve[130] == 95.0
    assert curve[1] == 0.1  # no record rounds to 1: the one within a percent of it (0.2)
    assert 2 not in curve and 50 not in curve  # none within a percent either


def test_each_seed_names_the_nodes_by_a_permutation_of_its_own_as_the_papers_simulator_does() -> None:
    nodes = [_node(f"openb-node-{i:04d}") for i in range(200)]
    renamed = tr.seeded_names(list(reversed(nodes)), seed=42)
    # The node at position i in name order gets the i-th number: a permutation of 0..n-1, 4 digits.
    assert [n.name.split("-", 1)[1] for n in renamed] == [n.name for n in nodes]
    assert sorted(int(n.name[:4]) for n in renamed) == list(range(200))
    assert all(n.name[4] == "-" for n in renamed)
    assert tr.seeded_names(nodes, seed=42) == renamed  # the same seed, the same names
    first = pp.Cluster(renamed).nodes[0].name
    assert pp.Cluster(tr.seeded_names(nodes, seed=43)).nodes[0].name != first  # another node first
    assert first != "0000-openb-node-0000"  # not the trace's own first node


# ------------------------------------------------------------------ the cluster's accounting


@pytest.mark.parametrize("policy", ["random", "bestfit", "fgd", "gpualloc"])
def test_shares_of_a_gpu_never_add_up_past_1000_and_a_shared_gpu_is_never_given_whole(policy: str) -> None:
    cluster = pp.Cluster([_node(f"n{i}", gpus=2) for i in range(3)])
    choose = _choosers(cluster)[policy]
    rng = random.Random(5)
    whole_on: dict[tuple[int, int], int] = {}
    for i in range(60):
        task = _task(f"t{i}", milli=rng.choice([130, 460, 810, 1000]), cpu=100, memory=10)
        found = choose(task)
        if found is None:
            continue
        for g in found.gpus:
            if task.milli == pp.MILLI:
                assert cluster.left[found.node, g] == pp.MILLI, "a GPU with a share was given whole"
                whole_on[(found.node, g)] = i
        cluster.place(task, found)
        assert (cluster.left >= 0).all() and (cluster.left <= pp.MILLI).all()
    assert cluster.allocated_milli == pp.MILLI * 6 - int(cluster.left.sum())


def test_the_cluster_refuses_a_share_past_what_is_left_on_the_gpu() -> None:
    cluster = pp.Cluster([_node("n0", gpus=1)])
    cluster.place(_task("a", milli=600), pp.Placement(node=0, gpus=(0,)))
    with pytest.raises(ValueError, match="cannot take 500"):
        cluster.place(_task("b", milli=500), pp.Placement(node=0, gpus=(0,)))
    with pytest.raises(ValueError, match="cannot take 1000"):
        cluster.place(_task("c", milli=1000), pp.Placement(node=0, gpus=(0,)))


@pytest.mark.parametrize("policy", ["random", "bestfit", "fgd", "gpualloc"])
@pytest.mark.parametrize("spec", ["V100M16|V100M32", "V100M32", "P100"])
def test_a_constrained_task_lands_only_on_its_models(policy: str, spec: str) -> None:
    models = ["T4", "V100M16", "V100M32", "A10", "P100", "G2"]
    cluster = pp.Cluster([_node(f"n{i}-{m}", model=m, gpus=2) for i, m in enumerate(models * 2)])
    choose = _choosers(cluster)[policy]
    accepted = set(spec.split("|"))
    landed = 0
    for i in range(10):
        task = _task(f"t{i}", spec=spec, milli=460 if i % 2 else 1000, cpu=100, memory=10)
        found = choose(task)
        if found is None:
            break
        assert cluster.nodes[found.node].model in accepted
        cluster.place(task, found)
        landed += 1
    assert landed >= 4  # the accepted models' GPUs filled before it stopped
    assert choose(_task("cpu-only", gpus=0)) is not None  # a CPU-only task needs no GPU model


def test_a_task_lands_only_where_its_cpu_and_memory_fit() -> None:
    cluster = pp.Cluster([_node("a", cpu=4000), _node("b", memory=1000), _node("c")])
    for name, choose in _choosers(cluster).items():
        found = choose(_task("t", cpu=8000, memory=2000))
        assert found is not None and cluster.nodes[found.node].name == "c", name


# ------------------------------------------------------------------ the policies


def test_fgd_picks_the_node_whose_fragmentation_grows_least() -> None:
    # The typical tasks ask one whole GPU, so a GPU with less than 1000 left is a fragment.
    cluster = pp.Cluster([_node("a-empty", gpus=2), _node("b-shared", gpus=2)])
    cluster.place(_task("earlier", milli=600), pp.Placement(node=1, gpus=(1,)))
    typical = pp.typical_tasks([_task(f"w{i}") for i in range(10)])
    ledger = pp.FragLedger(pp.Fragmentation(typical, cluster), cluster)
    assert ledger.now.tolist() == [0.0, 400.0]  # b's shared GPU has 400 left: a fragment
    # 300 milli on a's empty GPU leaves a 700 fragment (+700); on b's shared GPU, 100 (-300).
    found = pp.choose_fgd(cluster, _task("share", milli=300), ledger)
    assert found == pp.Placement(node=1, gpus=(1,))
    # Ties go to the first node by name: BestFit would also take b, but for less left over.
    assert pp.choose_bestfit(cluster, _task("share", milli=300)) == pp.Placement(node=1, gpus=(1,))


def test_fgd_sends_a_whole_gpu_task_where_no_typical_task_loses_its_fit() -> None:
    # Typical tasks ask two whole GPUs; a has 3 free (one is left over whatever happens), b has 2.
    cluster = pp.Cluster([_node("a", gpus=3), _node("b", gpus=2)])
    typical = pp.typical_tasks([_task(f"w{i}", gpus=2) for i in range(10)])
    ledger = pp.FragLedger(pp.Fragmentation(typical, cluster), cluster)
    # One GPU on a leaves 2 free (still a fit, 0 fragment); on b it leaves 1 (a 1000 fragment).
    assert pp.choose_fgd(cluster, _task("one"), ledger) == pp.Placement(node=0, gpus=(0,))


def test_typical_tasks_cover_the_asked_share_most_frequent_first() -> None:
    tasks = (
        [_task(f"a{i}") for i in range(6)]
        + [_task(f"b{i}", milli=460) for i in range(3)]
        + [_task("c", gpus=2)]
    )
    typical = pp.typical_tasks(tasks, coverage=0.9)
    assert [(t.milli, t.gpus) for t in typical] == [(1000, 1), (460, 1)]
    assert [round(t.weight, 4) for t in typical] == [round(6 / 9, 4), round(3 / 9, 4)]


def test_gpualloc_places_whole_gpu_tasks_through_the_allocator_binpacking_on_the_fullest_node() -> None:
    cluster = pp.Cluster([_node("a", gpus=4), _node("b", gpus=4)])
    cluster.place(_task("earlier", gpus=2), pp.Placement(node=1, gpus=(0, 1)))
    policy = tr.AllocatorPolicy(cluster, random.Random(1), strategy="binpack")
    found = policy.choose(_task("t", gpus=2))
    assert found == pp.Placement(node=1, gpus=(2, 3))  # binpack: b is fuller
    assert policy.by_allocator == 1


def test_gpualloc_is_offered_only_the_nodes_where_the_tasks_cpu_fits() -> None:
    cluster = pp.Cluster([_node("a", gpus=4), _node("b", gpus=4, cpu=20_000)])
    cluster.place(_task("earlier", gpus=1, cpu=16_000), pp.Placement(node=1, gpus=(0,)))
    policy = tr.AllocatorPolicy(cluster, random.Random(1))
    # binpack would take b (fuller), but b has 4,000 milli-CPU left.
    found = policy.choose(_task("t", gpus=1, cpu=8000))
    assert found is not None and cluster.nodes[found.node].name == "a"


def test_gpualloc_places_a_share_through_the_allocator_on_a_shared_gpu_it_fits() -> None:
    cluster = pp.Cluster([_node("a", gpus=2), _node("b", gpus=2)])
    cluster.place(_task("x", milli=300), pp.Placement(node=0, gpus=(1,)))
    cluster.place(_task("y", milli=600), pp.Placement(node=1, gpus=(0,)))
    policy = tr.AllocatorPolicy(cluster, random.Random(1), strategy="binpack")
    first = policy.choose(_task("t", milli=400))
    assert first == pp.Placement(node=1, gpus=(0,))  # 400 left there: the share fills it
    cluster.place(_task("t", milli=400), first)
    second = policy.choose(_task("u", milli=500))
    assert second == pp.Placement(node=0, gpus=(1,))  # 700 left: no whole GPU broken into
    assert policy.by_allocator == 2 and "sharing_tasks" not in policy.stand_in


@pytest.mark.parametrize(("scoring", "expected"), [("LeastAllocated", "a"), ("MostAllocated", "b")])
def test_gpualloc_stand_in_for_cpu_only_tasks_spreads_or_packs_as_kube_scheduler_is_configured(
    scoring: str, expected: str
) -> None:
    cluster = pp.Cluster([_node("a"), _node("b")])
    cluster.place(_task("earlier", gpus=0, cpu=32_000, memory=131_072), pp.Placement(node=1, gpus=()))
    policy = tr.AllocatorPolicy(cluster, random.Random(1), scoring, steer=False)
    found = policy.choose(_task("cpu", gpus=0, cpu=4000, memory=16_384))
    assert found is not None and cluster.nodes[found.node].name == expected
    assert policy.stand_in["cpu_only_tasks"] == 1


@pytest.mark.parametrize(("steer", "expected"), [(False, "a"), (True, "b")])
def test_the_charts_steering_packs_a_cpu_only_task_onto_the_busy_node_among_those_without_a_free_gpu(
    steer: bool, expected: str
) -> None:
    """a, b and c have no whole GPU free, each has room for shares; a's tasks ask half its CPU and
    memory, b's over 75% on average (98% and 54%), c's under (97% and 50%); d, as busy as b, has a
    whole GPU free."""
    cluster = pp.Cluster([_node(name, gpus=1) for name in "abcd"])
    for i in range(3):
        cluster.place(_task(f"share-{i}", milli=500), pp.Placement(node=i, gpus=(0,)))
    cluster.place(_task("half", gpus=0, cpu=32_000, memory=131_072), pp.Placement(node=0, gpus=()))
    cluster.place(_task("earlier", gpus=0, cpu=62_000, memory=140_000), pp.Placement(node=1, gpus=()))
    cluster.place(_task("under", gpus=0, cpu=61_000, memory=131_072), pp.Placement(node=2, gpus=()))
    cluster.place(_task("as-busy", gpus=0, cpu=63_000, memory=141_024), pp.Placement(node=3, gpus=()))
    policy = tr.AllocatorPolicy(cluster, random.Random(1), steer=steer)
    found = policy.choose(_task("cpu", gpus=0, cpu=500, memory=1024))
    assert found is not None and cluster.nodes[found.node].name == expected  # a: the emptiest


@pytest.mark.parametrize(("steer", "expected"), [(False, "a"), (True, "b")])
def test_the_charts_steering_sends_a_cpu_only_task_to_a_node_without_a_whole_free_gpu(
    steer: bool, expected: str
) -> None:
    cluster = pp.Cluster([_node("a", gpus=2), _node("b", gpus=2)])
    cluster.place(_task("busy", gpus=2, cpu=8000), pp.Placement(node=1, gpus=(0, 1)))
    policy = tr.AllocatorPolicy(cluster, random.Random(1), steer=steer)
    found = policy.choose(_task("cpu", gpus=0, cpu=4000, memory=16_384))
    assert found is not None and cluster.nodes[found.node].name == expected  # a: emptier, GPUs free


def test_the_charts_steering_prefers_a_node_with_no_gpu_room_to_one_with_room_for_shares() -> None:
    cluster = pp.Cluster([_node("a", gpus=1), _node("b", gpus=1), _node("c", gpus=1)])
    cluster.place(_task("share", milli=500, cpu=8000), pp.Placement(node=0, gpus=(0,)))  # a: "shares"
    cluster.place(_task("whole", cpu=8000), pp.Placement(node=1, gpus=(0,)))  # b: "false"
    policy = tr.AllocatorPolicy(cluster, random.Random(1))  # steered by default
    found = policy.choose(_task("cpu", gpus=0, cpu=4000, memory=16_384))
    assert found is not None and cluster.nodes[found.node].name == "b"  # c is emptier, a as empty


def test_gpualloc_with_least_fragmentation_leaves_room_for_the_claims_it_has_seen() -> None:
    cluster = pp.Cluster([_node("a", gpus=4), _node("b", gpus=4)])
    cluster.place(_task("earlier-a", gpus=1), pp.Placement(node=0, gpus=(0,)))
    cluster.place(_task("earlier-b", gpus=2), pp.Placement(node=1, gpus=(0, 1)))
    policy = tr.AllocatorPolicy(cluster, random.Random(1), strategy="leastFragmentation")
    for _ in range(3):  # the claims seen ask two GPUs
        policy.recent.observe(fragmentation.Shape(gpus=2, cpu=1000, memory=1024 * tr.MIB))
    # binpack would take b and leave it one GPU, which no 2-GPU claim can use; a keeps two.
    assert policy.choose(_task("t", gpus=1)) == pp.Placement(node=0, gpus=(1,))
    assert policy.by_allocator == 1


def test_the_not_shipped_cpu_only_scoring_puts_pods_where_the_gpus_are_in_use_and_says_so() -> None:
    cluster = pp.Cluster([_node("a", gpus=2), _node("b", gpus=2)])
    cluster.place(_task("busy", gpus=2), pp.Placement(node=1, gpus=(0, 1)))
    policy = tr.AllocatorPolicy(cluster, random.Random(1), "leastFragmentation", "leastFragmentation")
    policy.choose(_task("seen", gpus=1))  # the workload: 1-GPU claims
    found = policy.choose(_task("cpu", gpus=0, cpu=4000, memory=16_384))
    assert found is not None and cluster.nodes[found.node].name == "b"
    assert "NOT SHIPPED" in tr.gpualloc_notes("leastFragmentation")["cpu_only_tasks"]
    assert "NOT SHIPPED" not in tr.gpualloc_notes("LeastAllocated")["cpu_only_tasks"]


def test_the_gpualloc_policy_defaults_to_the_charts_defaults_where_mutating_policies_are_served() -> None:
    cluster = pp.Cluster([_node("a", gpus=4)])
    policy = tr.AllocatorPolicy(cluster, random.Random(1))
    assert (policy.strategy, policy.steer) == ("leastFragmentation", True)
    assert tr.Job(policy="gpualloc", seed=42, nodes=(), tasks=(), inflate=1.3).steer
