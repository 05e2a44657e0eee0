"""The node gpualloc picks must take the claim's pods: CPU, memory and pod slots (issue 41, part 1)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from controller import allocator, asks, explaining, fragmentation, gates, views
from gpualloc.api import codecs, constants, models
from tests.unit.test_allocator import claim, node, nvswitch
from tests.unit.test_controller_pure import inventory, state_on_fake_feeds, status
from tests.unit.test_explaining import NOW, _node

CPU4 = {"cpu": 4000, "memory": 16 * 2**30, "pods": 110}


def fitted(view: allocator.NodeView, allocatable: Mapping[str, int], requested: Mapping[str, int]) -> Any:
    free = {name: value - requested.get(name, 0) for name, value in allocatable.items()}
    return dataclasses.replace(view, allocatable=dict(allocatable), free=free)


def asking(c: models.GpuClaim, **resources: int) -> models.GpuClaim:
    return dataclasses.replace(c, spec=dataclasses.replace(c.spec, pod_resources=resources))


def test_binpack_passes_over_the_fuller_node_whose_cpu_is_all_taken() -> None:
    # The case: a is fuller (binpack's choice), but another claim's pod took its CPU.
    a = fitted(node("a", nvswitch("a"), taken=range(6)), CPU4, {"cpu": 4000, "pods": 1})
    b = fitted(node("b", nvswitch("b")), CPU4, {})
    assert allocator.allocate(asking(claim(1), cpu=1000), [a, b]).allocations[0].node_name == "b"
    assert allocator.allocate(claim(1), [a, b]).allocations[0].node_name == "a", "one pod slot only: a fits"


def test_a_claim_that_fits_nowhere_says_node_by_node_what_its_pods_lack() -> None:
    a = fitted(node("a", nvswitch("a")), CPU4, {"cpu": 4000, "pods": 1})
    b = fitted(node("b", nvswitch("b")), CPU4, {"cpu": 3500})
    decision = allocator.allocate(asking(claim(1), cpu=1000), [a, b])
    assert not decision.ok
    assert decision.reason == (
        "0/2 nodes fit: 2 have too little CPU for the pods"
        " (a: 1 CPU asked, 0 of 4 free; b: 1 CPU asked, 0.5 of 4 free)"
    )
    assert decision.per_node["b"] == "1 CPU asked, 0.5 of 4 free"


def test_a_gangs_replicas_spread_when_one_node_has_cpu_for_only_one_of_them() -> None:
    a = fitted(node("a", nvswitch("a"), taken=range(2)), CPU4, {})
    b = fitted(node("b", nvswitch("b")), CPU4, {})
    gang = asking(claim(2, replicas=2), cpu=3000)
    assert {x.node_name for x in allocator.allocate(gang, [a, b]).allocations} == {"a", "b"}
    together = allocator.allocate(claim(2, replicas=2), [a, b])
    assert {x.node_name for x in together.allocations} == {"a"}, "without the ask both go to the fuller a"


def test_pod_slots_and_memory_count_not_only_cpu() -> None:
    full = fitted(node("a", nvswitch("a")), {**CPU4, "pods": 3}, {"pods": 3})
    small = fitted(node("b", nvswitch("b")), {**CPU4, "memory": 2**30}, {})
    decision = allocator.allocate(asking(claim(1), memory=2 * 2**30), [full, small])
    assert not decision.ok
    assert decision.per_node == {"a": "1 pod asked, 0 of 3 free", "b": "2Gi memory asked, 1Gi of 1Gi free"}


def test_a_node_whose_allocatable_is_not_known_is_not_judged_on_its_pods() -> None:
    assert allocator.allocate(asking(claim(1), cpu=64000), [node("a", nvswitch("a"))]).ok


def test_the_pods_seen_at_the_gate_ask_what_they_request_not_the_spec() -> None:
    spec_says = asking(claim(1), cpu=100)
    planned = asks.with_pods_requests(
        spec_says, [{"cpu": 2000, "pods": 1}, {"cpu": 500, "memory": 10, "pods": 1}]
    )
    assert planned.spec.pod_resources == {"cpu": 2000, "memory": 10, "pods": 1}
    assert asks.with_pods_requests(spec_says, []) is spec_says


def _pod(name: str, node_name: str, cpu: str, **extra: Any) -> dict[str, Any]:
    container = {"name": "c", "resources": {"requests": {"cpu": cpu, **extra}}}
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"},
        "spec": {"nodeName": node_name, "containers": [container]},
        "status": {"phase": "Running"},
    }


def test_the_cached_pod_keeps_its_requests_and_at_most_four_made_up_hugepages_sizes() -> None:
    pod = _pod("p", "n1", "250m", **{f"hugepages-{i}Mi": "2Mi" for i in range(10)})
    kept = gates.kept_of_live_pod(pod)
    assert gates.requests_of(kept)["cpu"] == 250 and gates.requests_of(kept)["pods"] == 1
    assert sum(1 for name in gates.requests_of(kept) if name.startswith("hugepages-")) == 4
    assert "containers" not in kept["spec"]


def test_the_state_sums_the_live_pods_of_each_node_and_frees_what_an_ended_pod_asked() -> None:
    st, feeds = state_on_fake_feeds()
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(2))))
    feeds["nodes"].put(
        views.kept_of_node({"metadata": {"name": "n1"}, "status": {"allocatable": {"cpu": "4"}}})
    )
    feeds["live_pods"].put(gates.kept_of_live_pod(_pod("p1", "n1", "3")), key="ns/p1")
    feeds["live_pods"].put(gates.kept_of_live_pod(_pod("p2", "n1", "500m")), key="ns/p2")
    view = st.node_index().get("n1")
    assert view is not None and view.free["cpu"] == 500 and view.allocatable["cpu"] == 4000
    feeds["live_pods"].delete("ns/p1")
    view = st.node_index().get("n1")
    assert view is not None and view.free["cpu"] == 3500


def test_explain_names_the_cpu_a_node_lacks_counting_every_pod_bound_there() -> None:
    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)}
    nodes = {
        "gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False, allocatable=CPU4)
    }
    c = asking(claim(1), cpu=1000)
    pods = [
        _pod("other", "gpu-node-a", "4"),
        {**_pod("done", "gpu-node-a", "4"), "status": {"phase": "Succeeded"}},
    ]
    out = explaining.explain(c, claims=[c], statuses=statuses, nodes=nodes, now=NOW, pods=pods)
    assert "gpu-node-a: 1 CPU asked, 0 of 4 free" in out
    assert constants.PHASE_PENDING in out
    counted = explaining.explain(c, claims=[c], statuses=statuses, nodes=nodes, now=NOW, pods=pods[1:])
    assert "would fit" in counted, "a Succeeded pod takes nothing"


def test_the_workload_counts_each_pod_bound_without_a_claim_once_and_no_daemonset_or_claim_pod() -> None:
    """strategy leastFragmentation's workload (``State.recent``) holds the pods of the workload that
    take no GPU, as FGD's does: each once, when it is bound or first seen bound."""
    st, feeds = state_on_fake_feeds()
    feeds["live_pods"].put(gates.kept_of_live_pod(_pod("p1", "", "3")), key="ns/p1")
    assert st.recent.workload().shapes == (), "not bound yet"
    for _ in range(2):  # bound, then changed (or listed again)
        feeds["live_pods"].put(gates.kept_of_live_pod(_pod("p1", "n1", "3")), key="ns/p1")
    daemon = _pod("d", "n1", "1")
    daemon["metadata"]["ownerReferences"] = [{"kind": "DaemonSet", "name": "d", "controller": True}]
    feeds["live_pods"].put(gates.kept_of_live_pod(daemon), key="ns/d")
    claimed = _pod("c", "n1", "2")
    claimed["metadata"]["annotations"] = {constants.ANNOTATION_CLAIM: "claim"}
    feeds["live_pods"].put(gates.kept_of_live_pod(claimed), key="ns/c")
    assert list(st.recent._seen) == [fragmentation.Shape(gpus=0, cpu=3000)]
    assert st.recent.workload().shapes == (fragmentation.Shape(gpus=0, cpu=3000),)


def test_a_pod_is_one_per_node_when_a_daemonset_or_a_node_controls_it() -> None:
    def owned(kind: str, controller: bool = True) -> dict[str, Any]:
        return {"ownerReferences": [{"kind": kind, "name": "x", "controller": controller}]}

    assert gates.one_per_node(owned("DaemonSet")) and gates.one_per_node(owned("Node"))
    assert not gates.one_per_node(owned("ReplicaSet"))
    assert not gates.one_per_node(owned("DaemonSet", controller=False))
    assert not gates.one_per_node({"ownerReferences": ["not a mapping"]})
