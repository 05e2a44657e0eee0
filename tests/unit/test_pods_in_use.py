"""Pods are the ground truth of use: the GPUs a live pod was given stay taken whatever happened to
its claim (issue 37), and the patches that keep a vanished claim's gated pods from being un-gated."""

from __future__ import annotations

from typing import Any

import jsonpatch
import pytest

from controller import gates, locks
from gpualloc.api import codecs, constants, models
from tests.unit.test_controller_pure import alloc, claim, inventory, state_on_fake_feeds, status, uuid


def pod(
    name: str,
    claim_name: str | None = "c",
    devices: list[str] | None = None,
    *,
    gated: bool = False,
    phase: str = "Running",
    rv: str = "5",
) -> dict[str, Any]:
    annotations: dict[str, str] = {}
    if claim_name is not None:
        annotations[constants.ANNOTATION_CLAIM] = claim_name
    if devices is not None:
        annotations[constants.ANNOTATION_DEVICES] = ",".join(devices)
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "cuda"}], "nodeName": "n1"}
    if gated:
        spec["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]
        del spec["nodeName"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "resourceVersion": rv,
            "annotations": annotations,
            "labels": {"big": "x" * 1000},
        },
        "spec": spec,
        "status": {"phase": phase},
    }


# ------------------------------------------------------------------ pure


def test_only_a_pod_that_names_its_claim_was_given_the_devices_its_annotation_lists() -> None:
    assert gates.given_devices(pod("p", "c", [uuid(1, 0), uuid(1, 1)])) == (
        "c",
        frozenset({uuid(1, 0), uuid(1, 1)}),
    )
    # A devices annotation without the claim annotation never went through the webhook: a tenant
    # could otherwise mark any GPU in use.
    assert gates.given_devices(pod("p", None, [uuid(1, 0)])) is None
    assert gates.given_devices(pod("p", "c", None)) is None
    assert gates.given_devices(pod("p", "c", [])) is None


def test_the_cached_live_pod_keeps_only_identity_node_gate_and_the_two_annotations() -> None:
    kept = gates.kept_of_live_pod(pod("p", "c", [uuid(1, 0)], gated=True))
    assert kept["metadata"] == {
        "name": "p",
        "namespace": "ns",
        "uid": "uid-p",
        "resourceVersion": "5",
        "annotations": {constants.ANNOTATION_CLAIM: "c", constants.ANNOTATION_DEVICES: uuid(1, 0)},
    }
    assert kept["spec"] == {"schedulingGates": [{"name": constants.SCHEDULING_GATE}]}
    assert gates.kept_of_live_pod(pod("q"))["spec"] == {"nodeName": "n1"}
    huge = pod("h", "c" * 300, ["GPU-" + "0" * 20_000])
    assert "annotations" not in gates.kept_of_live_pod(huge)["metadata"], "oversized values are dropped"


def test_held_by_pods_counts_the_devices_of_running_pods_only() -> None:
    pods = [
        pod("a", "c", [uuid(1, 0)]),
        pod("b", "c", [uuid(1, 1)], phase="Succeeded"),  # done: holds nothing
        pod("g", "c", [uuid(1, 2)], gated=True),  # a webhook's view, not a use
        pod("o", "other", [uuid(1, 3)]),
    ]
    assert gates.held_by_pods("c", pods) == frozenset({uuid(1, 0)})
    assert gates.held_by_pods("gone", pods) == frozenset()


def test_a_lease_locks_a_device_its_mig_instance_or_one_of_its_sharing_slots() -> None:
    gpu = uuid(1, 0)
    assert locks.locks_device(constants.lease_name(gpu), gpu)
    assert locks.locks_device(constants.lease_name(constants.slot_id(gpu, 2)), gpu)
    assert not locks.locks_device(constants.lease_name(uuid(1, 1)), gpu)
    assert not locks.locks_device(constants.lease_name(constants.slot_id(uuid(1, 1), 0)), gpu)


def test_an_ungate_decided_on_an_older_read_of_the_pod_fails_once_the_sweep_fenced_it() -> None:
    gated = pod("g", "c", gated=True, rv="5")
    ungate = gates.ungate_patch(gated, alloc(0, "n1", 1, (0,)))
    assert jsonpatch.apply_patch(gated, ungate)["spec"].get("schedulingGates") is None

    fenced = jsonpatch.apply_patch(gated, gates.fence_patch(gated, "uid-old"))
    fenced["metadata"]["resourceVersion"] = "6"  # the API server's answer to that write
    assert fenced["metadata"]["annotations"][constants.ANNOTATION_CLAIM_GONE] == "uid-old"
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(fenced, ungate)


def test_the_fence_fails_on_a_pod_that_was_un_gated_meanwhile() -> None:
    gated = pod("g", "c", gated=True)
    ungated = jsonpatch.apply_patch(gated, gates.ungate_patch(gated, alloc(0, "n1", 1, (0,))))
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(ungated, gates.fence_patch(gated, "uid-old"))


# ------------------------------------------------------------------ the controller's state


def allocated(name: str, uid: str, devices: tuple[int, ...]) -> dict[str, Any]:
    c = claim(
        name,
        uid=uid,
        count=len(devices),
        status_=models.GpuClaimStatus(
            phase=constants.PHASE_ALLOCATED, allocations=(alloc(0, "n1", 1, devices),)
        ),
    )
    raw = codecs.encode(c)
    raw["metadata"]["resourceVersion"] = "7"
    return raw


def test_a_gpu_a_running_pod_was_given_stays_taken_after_its_claim_vanished_until_the_pod_ends() -> None:
    st, feeds = state_on_fake_feeds()
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(1))))
    feeds["claims"].put(allocated("c", "uid-c", (0,)), key="ns/c")
    feeds["live_pods"].put(pod("p", "c", [uuid(1, 0)]), key="ns/p")
    assert st.node_index().get("n1").taken == {uuid(1, 0)}
    assert st.held_by_pods_alone(uuid(1, 0)) == [], "its claim lists it: the claim holds it"

    feeds["claims"].delete("ns/c")  # its finalizer stripped: it vanishes at once
    assert st.held_by_pods_alone(uuid(1, 0)) == ["ns/p"]
    assert st.node_index().get("n1").taken == {uuid(1, 0)}, "the pod still runs on it"

    feeds["claims"].put(allocated("c", "uid-new", (1,)), key="ns/c")  # a new claim of the name
    assert st.held_by_pods_alone(uuid(1, 0)) == ["ns/p"], "which does not list the pod's GPU"
    assert st.node_index().get("n1").taken == {uuid(1, 0), uuid(1, 1)}

    feeds["live_pods"].delete("ns/p")  # Succeeded: it leaves the live pods' field selector
    assert st.held_by_pods_alone(uuid(1, 0)) == []
    assert st.node_index().get("n1").taken == {uuid(1, 1)}


def test_a_gated_pod_holds_nothing_and_a_pod_of_a_shared_claim_does_not_take_the_other_slots() -> None:
    st, feeds = state_on_fake_feeds()
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(1))))
    feeds["live_pods"].put(pod("g", "gone", [uuid(1, 2)], gated=True), key="ns/g")
    assert st.node_index().get("n1").taken == frozenset()
    shared = claim(
        "s",
        uid="uid-s",
        count=1,
        status_=models.GpuClaimStatus(
            phase=constants.PHASE_ALLOCATED,
            allocations=(
                models.Allocation(
                    replica=0,
                    node_name="n1",
                    devices=(models.DeviceRef(index=3, minor=3, uuid=uuid(1, 3), slot=1),),
                ),
            ),
        ),
    )
    raw = codecs.encode(shared)
    raw["metadata"]["resourceVersion"] = "7"
    feeds["claims"].put(raw, key="ns/s")
    feeds["live_pods"].put(pod("p", "s", [uuid(1, 3)]), key="ns/p")
    assert st.held_by_pods_alone(uuid(1, 3)) == [], "its claim lists its slot of that GPU"
