"""The steering labels (``--label-free-gpus``, controller.labelling): which nodes need which values,
and a pass over the controller's caches that writes only those."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from controller import labelling, nodes
from gpualloc.api import codecs, constants, leases
from tests.unit.test_controller_pure import NOW, inventory, state_on_fake_feeds, status, uuid

KEY = constants.LABEL_FREE_GPUS
BUSY = constants.LABEL_BUSY


def values(changes: Mapping[str, Mapping[str, str]], key: str = KEY) -> dict[str, str]:
    return {name: labels[key] for name, labels in changes.items() if key in labels}


def test_a_node_with_a_free_gpu_needs_true_and_one_without_needs_false() -> None:
    free = {"a": 2, "b": 0, "c": 1}
    labels: dict[str, Mapping[str, str]] = {"a": {}, "b": {"team": "x"}, "c": {KEY: "false"}}
    got = nodes.steering_labels(free, labels)
    assert got == {"a": {KEY: "true"}, "b": {KEY: "false"}, "c": {KEY: "true"}}


def test_a_node_without_a_free_gpu_but_room_for_shares_needs_shares() -> None:
    free = {"a": 0, "b": 0, "c": 1}
    labels: dict[str, Mapping[str, str]] = {"a": {KEY: "false"}, "b": {KEY: "false"}, "c": {}}
    got = nodes.steering_labels(free, labels, share_room={"a", "c"})
    assert values(got) == {"a": "shares", "c": "true"}  # a whole GPU free comes first; b has no room


def test_only_the_labels_that_differ_are_written() -> None:
    free = {"a": 2, "b": 0}
    labels: dict[str, Mapping[str, str]] = {"a": {KEY: "true", BUSY: "false"}, "b": {KEY: "false"}}
    assert nodes.steering_labels(free, labels, requested={"a": 10.0, "b": 10.0}) == {"b": {BUSY: "false"}}
    assert nodes.steering_labels(free, labels, requested={"a": 80.0}) == {"a": {BUSY: "true"}}


def test_nodes_gpualloc_does_not_know_and_statuses_without_a_node_are_left_alone() -> None:
    free = {"gpu-without-node": 1}
    labels: dict[str, Mapping[str, str]] = {"cpu-only": {}, "cpu-labelled": {KEY: "true"}}
    assert nodes.steering_labels(free, labels, requested={"cpu-only": 90.0, "gpu-without-node": 90.0}) == {}


def test_a_value_not_true_or_false_is_corrected() -> None:
    assert nodes.steering_labels({"a": 0}, {"a": {KEY: "yes"}}) == {"a": {KEY: "false"}}


def view(cpu: tuple[int, int] | None, memory: tuple[int, int] | None) -> nodes.NodeView:
    """A node with (allocatable, free) of CPU and memory; None: not known."""
    allocatable = {r: a for r, pair in (("cpu", cpu), ("memory", memory)) if pair for a in pair[:1]}
    free = {r: f for r, pair in (("cpu", cpu), ("memory", memory)) if pair for f in pair[1:]}
    return nodes.NodeView(
        name="n",
        labels={},
        unschedulable=False,
        node_present=True,
        ready=True,
        inventory=None,
        taken=frozenset(),
        allocatable=allocatable,
        free=free,
    )


def test_a_nodes_requested_percent_averages_its_cpu_and_memory() -> None:
    gib = 1 << 30
    assert nodes.requested_percent(view((32_000, 8_000), (64 * gib, 16 * gib))) == 75
    assert nodes.requested_percent(view((32_000, 0), (64 * gib, 32 * gib))) == 75  # 100% + 50%
    assert nodes.requested_percent(view((32_000, -8_000), (64 * gib, 64 * gib))) == 62.5  # overcommitted


def test_a_node_whose_allocatable_or_pods_are_not_known_has_no_requested_percent() -> None:
    assert nodes.requested_percent(view(None, None)) is None
    assert nodes.requested_percent(view((32_000, 1_000), None)) is None
    assert nodes.requested_percent(view((0, 0), (1 << 30, 0))) is None


def test_a_node_turns_busy_at_75_percent_and_stays_busy_down_to_70() -> None:
    assert (nodes.BUSY_PERCENT, nodes.BUSY_HYSTERESIS) == (75, 5)
    for label in (None, "false"):
        assert nodes.busy(75, label) is True and nodes.busy(74.9, label) is False
    assert nodes.busy(70, "true") is True and nodes.busy(69.9, "true") is False


def test_the_busy_label_follows_the_requested_percent_with_its_hysteresis() -> None:
    free = {"a": 0, "b": 0, "c": 0}
    labels: dict[str, Mapping[str, str]] = {
        "a": {KEY: "false", BUSY: "true"},
        "b": {KEY: "false", BUSY: "true"},
        "c": {KEY: "false"},
    }
    got = nodes.steering_labels(free, labels, requested={"a": 72.0, "b": 69.0, "c": 72.0})
    assert got == {"b": {BUSY: "false"}, "c": {BUSY: "false"}}  # a stays busy at 72%


class FakeNodes:
    """``labelling.NodeLabels`` over a dict of Nodes: a merge patch of the labels, a new version."""

    def __init__(self, nodes_: Mapping[str, dict[str, Any]]) -> None:
        self.nodes = {name: dict(node) for name, node in nodes_.items()}
        self.patches: list[tuple[str, dict[str, str | None]]] = []

    async def patch_node_labels(self, name: str, labels: Mapping[str, str | None]) -> dict[str, Any]:
        self.patches.append((name, dict(labels)))
        node = self.nodes[name]
        merged = {**node["metadata"].get("labels", {}), **labels}
        meta = {
            **node["metadata"],
            "labels": {k: v for k, v in merged.items() if v is not None},
            "resourceVersion": str(int(node["metadata"]["resourceVersion"]) + 1),
        }
        self.nodes[name] = {**node, "metadata": meta}
        return self.nodes[name]


def node(name: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1", "labels": labels},
    }


def device_lease(node_index: int, gpu: int, node_name: str) -> dict[str, Any]:
    return leases.device_lease(
        "gpualloc-system",
        lock_id=uuid(node_index, gpu),
        node=node_name,
        claim_namespace="ns",
        claim_name="c",
        claim_uid="uid-c",
        claim_resource_version="42",
        now=NOW,
    )


def test_a_pass_labels_gpu_nodes_by_their_free_gpus_writes_through_and_writes_nothing_twice() -> None:
    st, feeds = state_on_fake_feeds()
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(1, 2))))
    feeds["node_statuses"].put(codecs.encode(status("n2", inventory(2, 1, unhealthy=(0,)))))
    feeds["node_statuses"].put(codecs.encode(status("gone", inventory(3, 1))))  # no Node
    for raw in (node("n1"), node("n2"), node("cpu")):
        feeds["nodes"].put(raw)
    cluster = FakeNodes({"n1": node("n1"), "n2": node("n2"), "cpu": node("cpu")})
    labeller = labelling.Labeller(cluster, st)

    asyncio.run(labeller.label())
    assert sorted(cluster.patches) == [("n1", {KEY: "true"}), ("n2", {KEY: "false"})]
    assert st.facts["n1"].labels[KEY] == "true", "the answer is written through into the Node cache"
    assert labeller.writes == {"free-gpus=true": 1, "free-gpus=false": 1}

    cluster.patches.clear()
    asyncio.run(labeller.label())
    assert cluster.patches == [], "nothing differs: nothing written"

    for gpu in (0, 1):
        lease = device_lease(1, gpu, "n1")
        feeds["leases"].put(lease, key=f"gpualloc-system/{lease['metadata']['name']}")
    asyncio.run(labeller.label())
    assert cluster.patches == [("n1", {KEY: "false"})], "its last free GPU taken"

    cluster.patches.clear()
    feeds["leases"].delete(f"gpualloc-system/{constants.lease_name(uuid(1, 0))}")
    asyncio.run(labeller.label())
    assert cluster.patches == [("n1", {KEY: "true"})], "a GPU freed again"


def test_a_pass_labels_a_node_busy_once_its_pods_ask_three_quarters_of_its_cpu_and_memory() -> None:
    from controller import gates, views
    from tests.unit.test_pod_fit import _pod

    st, feeds = state_on_fake_feeds()
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(1, 2))))
    allocatable = {"cpu": "8", "memory": "16Gi"}
    kept = views.kept_of_node({**node("n1"), "status": {"allocatable": allocatable}})
    feeds["nodes"].put(kept)
    cluster = FakeNodes({"n1": kept})
    labeller = labelling.Labeller(cluster, st)
    asyncio.run(labeller.label())
    assert cluster.patches == [("n1", {KEY: "true", BUSY: "false"})], "one patch for both labels"

    cluster.patches.clear()
    feeds["live_pods"].put(gates.kept_of_live_pod(_pod("p1", "n1", "8", memory="8Gi")), key="ns/p1")
    asyncio.run(labeller.label())
    assert cluster.patches == [("n1", {BUSY: "true"})], "all the CPU and half the memory: 75% on average"
    assert labeller.writes == {"free-gpus=true": 1, "busy=false": 1, "busy=true": 1}

    cluster.patches.clear()
    feeds["live_pods"].delete("ns/p1")
    asyncio.run(labeller.label())
    assert cluster.patches == [("n1", {BUSY: "false"})], "the pod gone"


def test_a_node_whose_agent_is_not_ready_has_no_free_gpu() -> None:
    st, feeds = state_on_fake_feeds()
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(1, 2, ready=False))))
    feeds["nodes"].put(node("n1", **{KEY: "true"}))
    cluster = FakeNodes({"n1": node("n1", **{KEY: "true"})})
    asyncio.run(labelling.Labeller(cluster, st).label())
    assert cluster.patches == [("n1", {KEY: "false"})]


def test_the_label_is_off_by_default_and_turned_on_by_flag_or_environment(monkeypatch: Any) -> None:
    from controller import main

    assert main.build_parser().parse_args([]).label_free_gpus is False
    assert main.build_parser().parse_args(["--label-free-gpus"]).label_free_gpus is True
    monkeypatch.setenv("GPUALLOC_LABEL_FREE_GPUS", "true")
    args = main.build_parser().parse_args([])
    assert args.label_free_gpus is True and args.label_interval == labelling.INTERVAL
