"""Hypothesis: a ``NodeIndex`` gives exactly the decision of the full search over its views, and
stays equal to an index built afresh whatever sequence of node changes it went through."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from controller import allocator
from controller.nodes import NodeIndex, NodeView
from gpualloc.api import constants, models
from tests.property.test_allocator_properties import SETTINGS, claims, inventories

TIERS = ("low", "medium", "high", "spot")


@st.composite
def alike_clusters(draw: st.DrawFn, max_nodes: int = 12) -> list[NodeView]:
    """Up to ``max_nodes`` nodes made from a few inventories, so that many tie on every key."""
    templates = [draw(inventories(f"t{i}")) for i in range(draw(st.integers(1, 3)))]
    views = []
    for i in range(draw(st.integers(1, max_nodes))):
        name = f"node-{draw(st.integers(0, 99)):02d}-{i}"
        inv, taken = templates[draw(st.integers(0, len(templates) - 1))]
        rename = {d.uuid: f"GPU-{name}-{d.index}" for d in inv.devices}
        devices = tuple(dataclasses.replace(d, uuid=rename[d.uuid]) for d in inv.devices)
        if draw(st.booleans()):  # take some more, so free counts differ between copies
            taken = taken | {d.uuid for d in inv.devices if draw(st.integers(0, 3)) == 0}
        labels = {"pool": draw(st.sampled_from(("a", "b")))}
        tier = draw(st.sampled_from((*TIERS, None)))
        if tier is not None:
            labels[constants.LABEL_COST_TIER] = tier
        odd = draw(st.integers(0, 9)) == 0
        views.append(
            NodeView(
                name=name,
                labels=labels,
                unschedulable=odd and draw(st.booleans()),
                node_present=not (odd and draw(st.booleans())),
                ready=not (odd and draw(st.booleans())),
                inventory=dataclasses.replace(inv, devices=devices),
                taken=frozenset(rename[u] for u in taken),
            )
        )
    return views


@st.composite
def varied_claims(draw: st.DrawFn) -> models.GpuClaim:
    claim = draw(claims(single=draw(st.booleans())))
    spec = claim.spec
    if draw(st.integers(0, 3)) == 0:
        selector = models.LabelSelector(match_labels={"pool": draw(st.sampled_from(("a", "b")))})
        spec = dataclasses.replace(spec, selector=selector)
    if draw(st.integers(0, 5)) == 0:
        spec = dataclasses.replace(spec, devices=dataclasses.replace(spec.devices, min_memory_mib=90_000))
    return dataclasses.replace(claim, spec=spec)


@SETTINGS
@given(views=alike_clusters(), claim=varied_claims())
def test_an_index_gives_the_decision_of_the_full_search(
    views: list[NodeView], claim: models.GpuClaim
) -> None:
    full = allocator.allocate(claim, views)
    index = NodeIndex(views)
    indexed = allocator.allocate(claim, index)
    assert indexed.allocations == full.allocations
    assert indexed.note == full.note
    if index.most_free() < claim.spec.devices.count:  # refused without visiting a node
        assert indexed.reason.endswith(f"(at most {index.most_free()} on one node)")
    elif not full.ok:  # the reasons come from the full search
        assert indexed.reason == full.reason
        assert indexed.per_node == full.per_node


@SETTINGS
@given(views=alike_clusters(), claim=varied_claims())
def test_explain_over_the_index_decides_as_the_full_search_and_gives_every_node_a_line(
    views: list[NodeView], claim: models.GpuClaim
) -> None:
    full = allocator.allocate(claim, views, explain=True)
    explained = allocator.allocate(claim, NodeIndex(views), explain=True)
    assert explained.allocations == full.allocations
    assert set(explained.per_node) == {v.name for v in views}
    if full.ok:
        assert explained.per_node[explained.allocations[0].node_name].startswith("chosen:")
    else:
        assert explained.reason.startswith(f"0/{len(views)} nodes fit: ") or explained.reason == full.reason


@SETTINGS
@given(views=alike_clusters(), claim=varied_claims(), cost_label=st.sampled_from(("", "other/tier")))
def test_an_index_for_another_cost_label_still_decides_as_the_full_search(
    views: list[NodeView], claim: models.GpuClaim, cost_label: str
) -> None:
    label = cost_label or constants.LABEL_COST_TIER
    full = allocator.allocate(claim, views, cost_label=label)
    indexed = allocator.allocate(claim, NodeIndex(views), cost_label=label)
    assert indexed.allocations == full.allocations


@SETTINGS
@given(
    first=alike_clusters(),
    changes=st.lists(st.tuples(st.booleans(), alike_clusters(max_nodes=3)), max_size=6),
)
def test_an_index_changed_node_by_node_equals_one_built_afresh(
    first: list[NodeView], changes: list[tuple[bool, list[NodeView]]]
) -> None:
    index = NodeIndex(first)
    current = {v.name: v for v in first}
    for remove, views in changes:
        for view in views:
            if remove:
                index.remove(view.name)
                current.pop(view.name, None)
            else:
                index.put(view)
                current[view.name] = view
    fresh = NodeIndex(current.values())
    assert index.views() == fresh.views() == [current[name] for name in sorted(current)]
    assert dict(index.buckets()) == dict(fresh.buckets())
    assert all(index.position(v.name) == i for i, v in enumerate(index.views()))
