"""Hypothesis: the controller's node index, rebuilt node by node from watch events, always equals
the views built afresh from its caches (``views.build_node_views``), whatever the events, the
reservations and the passing of time."""

from __future__ import annotations

import datetime
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from controller import views
from gpualloc.api import codecs, constants, leases, models
from tests.property.test_allocator_properties import SETTINGS
from tests.unit.test_controller_pure import NOW, alloc, claim, inventory, state_on_fake_feeds, status, uuid

NODES = 3
GPUS = 4


def _node(name: str, *, cordoned: bool, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"pool": pool}},
        "spec": {"unschedulable": cordoned},
    }


actions = st.one_of(
    st.tuples(st.just("status"), st.integers(0, NODES - 1), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("drop-status"), st.integers(0, NODES - 1)),
    st.tuples(st.just("node"), st.integers(0, NODES - 1), st.booleans(), st.sampled_from(("a", "b"))),
    st.tuples(st.just("drop-node"), st.integers(0, NODES - 1)),
    st.tuples(st.just("lease"), st.integers(0, NODES - 1), st.integers(0, GPUS - 1)),
    st.tuples(st.just("drop-lease"), st.integers(0, NODES - 1), st.integers(0, GPUS - 1)),
    st.tuples(st.just("claim"), st.integers(0, 2), st.integers(0, NODES - 1), st.integers(0, GPUS - 1)),
    st.tuples(st.just("drop-claim"), st.integers(0, 2)),
    st.tuples(st.just("reserve"), st.integers(0, NODES - 1), st.integers(0, GPUS - 1), st.booleans()),
    st.tuples(st.just("wait"), st.sampled_from((1.0, 30.0, 119.0, 121.0))),
)


@SETTINGS
@given(steps=st.lists(actions, max_size=40))
def test_the_index_equals_views_built_afresh_after_every_event(steps: list[tuple[Any, ...]]) -> None:
    clock = [1000.0]
    state, feeds = state_on_fake_feeds(monotonic=lambda: clock[0])
    beat = 0
    for step in steps:
        kind, *args = step
        if kind == "status":
            node, unhealthy, ready = args
            beat += 1
            inv = inventory(
                node,
                GPUS,
                heartbeat=NOW + datetime.timedelta(seconds=beat),
                ready=ready,
                unhealthy=(unhealthy,),
            )
            raw = codecs.encode(status(f"n{node}", inv))
            raw["metadata"]["resourceVersion"] = str(beat)
            feeds["node_statuses"].put(raw)
        elif kind == "drop-status":
            feeds["node_statuses"].delete(f"n{args[0]}")
        elif kind == "node":
            node, cordoned, pool = args
            feeds["nodes"].put(_node(f"n{node}", cordoned=cordoned, pool=pool))
        elif kind == "drop-node":
            feeds["nodes"].delete(f"n{args[0]}")
        elif kind == "lease":
            node, index = args
            body = leases.device_lease(
                "gpualloc-system",
                lock_id=uuid(node, index),
                node=f"n{node}",
                claim_namespace="ns",
                claim_name="x",
                claim_uid="uid-x",
                claim_resource_version="1",
                now=NOW,
            )
            body["metadata"]["uid"] = f"lease-{node}-{index}"
            feeds["leases"].put(body)
        elif kind == "drop-lease":
            feeds["leases"].delete(constants.lease_name(uuid(*args)))
        elif kind == "claim":
            which, node, index = args
            allocated = models.GpuClaimStatus(
                phase=constants.PHASE_ALLOCATED, allocations=(alloc(0, f"n{node}", node, (index,)),)
            )
            raw = codecs.encode(claim(f"c{which}", uid=f"uid-{which}", count=1, status_=allocated))
            beat += 1
            raw["metadata"]["resourceVersion"] = str(beat)
            feeds["claims"].put(raw, key=f"ns/c{which}")
        elif kind == "drop-claim":
            feeds["claims"].delete(f"ns/c{args[0]}")
        elif kind == "reserve":
            node, index, on = args
            names = [constants.lease_name(uuid(node, index))]
            if on:
                state.reserve(names, "uid-r")
            else:
                state.unreserve(names, "uid-r")
        else:
            clock[0] += args[0]
        expected = views.build_node_views(
            statuses=state.statuses,
            nodes=state.facts,
            is_taken=lambda u: (
                constants.lease_name(u) in state.leases
                or constants.lease_name(u) in state.reserved
                or state.listed_by(u) is not None
            ),
            heartbeat_ages={node: state.heartbeat_age(node) for node in state.statuses},
            stale_after=120,
        )
        assert state.node_index().views() == expected, step
