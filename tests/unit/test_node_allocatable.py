"""The controller's view of a Node keeps its allocatable (controller.views), parsed to units."""

from __future__ import annotations

from typing import Any

from controller import views


def _node(**status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "gpu-node-a", "uid": "u", "resourceVersion": "7", "labels": {"a": "b"}},
        "spec": {"podCIDR": "10.0.0.0/24"},
        "status": {
            "images": [{"names": [f"registry/image-{i}:v1"], "sizeBytes": i} for i in range(50)],
            "conditions": [{"type": "Ready", "status": "True"}],
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110"},
            **status,
        },
    }


ALLOCATABLE = {
    "cpu": "63500m",
    "memory": "503Gi",
    "ephemeral-storage": "900Gi",
    "pods": "110",
    "hugepages-1Gi": "0",
    "hugepages-2Mi": "1Gi",
    "nvidia.com/gpu": "8",
    "example.com/nic": "4",
}


def test_the_cached_node_keeps_the_allocatable_of_the_counted_resources_and_no_other_status() -> None:
    kept = views.kept_of_node(_node(allocatable=ALLOCATABLE))
    uncounted = ("nvidia.com/gpu", "example.com/nic")
    assert kept["status"] == {"allocatable": {k: v for k, v in ALLOCATABLE.items() if k not in uncounted}}
    assert len(str(kept)) < 500


def test_node_facts_read_the_allocatable_in_millicores_bytes_and_a_count() -> None:
    facts = views.node_facts(_node(allocatable=ALLOCATABLE))
    assert facts.allocatable == {
        "cpu": 63_500,
        "memory": 503 * 2**30,
        "ephemeral-storage": 900 * 2**30,
        "pods": 110,
        "hugepages-1Gi": 0,
        "hugepages-2Mi": 2**30,
    }


def test_the_cached_node_gives_the_same_facts_as_the_whole_node() -> None:
    node = _node(allocatable=ALLOCATABLE)
    assert views.node_facts(views.kept_of_node(node)) == views.node_facts(node)


def test_a_node_without_allocatable_keeps_no_status_and_has_none() -> None:
    node = _node()
    assert "status" not in views.kept_of_node(node)
    assert views.node_facts(node).allocatable == {}
    assert views.node_facts({"metadata": {"name": "n"}}).allocatable == {}


def test_a_malformed_allocatable_value_is_left_out_not_fatal() -> None:
    facts = views.node_facts(_node(allocatable={"cpu": "many", "memory": "1Gi", "pods": None}))
    assert facts.allocatable == {"memory": 2**30}
    assert views.node_facts(_node(allocatable=["cpu"])).allocatable == {}
