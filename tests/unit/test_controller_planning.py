"""controller.planning: NodeViews from caches, lock plans, status patches, retries, gate mode (pure)."""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable
from pathlib import Path

import jsonpatch
import pytest
import yaml

from controller import allocator, locking, planning
from gpualloc.api import codecs, constants, models, timestamps
from tests import reviews

NOW = datetime.datetime(2025, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)


def uuid(node: int, index: int) -> str:
    return f"GPU-{node:08x}-0000-0000-0000-{index:012x}"


def inventory(
    node: int,
    gpus: int = 4,
    *,
    heartbeat: datetime.datetime = NOW,
    ready: bool = True,
    unhealthy: tuple[int, ...] = (),
) -> models.NodeInventory:
    return models.NodeInventory(
        devices=tuple(
            models.Device(
                index=i,
                minor=i,
                uuid=uuid(node, i),
                health=constants.UNHEALTHY if i in unhealthy else constants.HEALTHY,
                health_reason="XID 79" if i in unhealthy else "",
            )
            for i in range(gpus)
        ),
        total=gpus,
        healthy=gpus - len(unhealthy),
        last_heartbeat_time=timestamps.format_time(heartbeat),
        conditions=(models.Condition(type="Ready", status="True" if ready else "False", reason="x"),),
    )


def status(name: str, inv: models.NodeInventory) -> models.GpuNodeStatus:
    return models.GpuNodeStatus(
        metadata=models.ObjectMeta(name=name), spec=models.GpuNodeStatusSpec(node_name=name), status=inv
    )


def claim(
    name: str = "c",
    *,
    uid: str = "uid-c",
    count: int = 2,
    replicas: int = 1,
    generation: int = 1,
    status_: models.GpuClaimStatus | None = None,
    priority: int = 0,
    created: str = "2025-01-01T00:00:00Z",
) -> models.GpuClaim:
    return models.GpuClaim(
        metadata=models.ObjectMeta(
            name=name,
            namespace="ns",
            uid=uid,
            generation=generation,
            resource_version="7",
            creation_timestamp=created,
        ),
        spec=models.GpuClaimSpec(
            devices=models.DeviceRequest(count=count), replicas=replicas, priority=priority
        ),
        status=status_ or models.GpuClaimStatus(),
    )


def alloc(replica: int, node: str, node_no: int, indices: tuple[int, ...]) -> models.Allocation:
    return models.Allocation(
        replica=replica,
        node_name=node,
        devices=tuple(models.DeviceRef(index=i, minor=i, uuid=uuid(node_no, i)) for i in indices),
    )


# ------------------------------------------------------------------ node views


def held_by_others(holders: dict[str, set[str]], claim_uid: str) -> Callable[[str], bool]:
    """``is_taken`` for ``build_node_views``: a Lease some holder other than ``claim_uid`` holds."""
    return lambda name: bool(holders.get(name, set()) - {claim_uid})


def test_node_views_mark_devices_held_by_other_claims_as_taken_but_not_our_own() -> None:
    statuses = {"n1": status("n1", inventory(1))}
    facts = {"n1": planning.NodeFacts(name="n1", labels={"zone": "a"}, unschedulable=False)}
    holders = {
        constants.lease_name(uuid(1, 0)): {"uid-other"},
        constants.lease_name(uuid(1, 1)): {"uid-c"},
        constants.lease_name(uuid(1, 2)): {"uid-c", "uid-racer"},  # cache and overlay disagree: taken
    }
    (view,) = planning.build_node_views(
        statuses=statuses, nodes=facts, is_taken=held_by_others(holders, "uid-c"), now=NOW, stale_after=120
    )
    assert view.taken == {uuid(1, 0), uuid(1, 2)}
    assert view.labels == {"zone": "a"} and view.node_present and view.ready


def test_node_views_flag_missing_nodes_and_stale_or_unready_statuses() -> None:
    statuses = {
        "fresh": status("fresh", inventory(1, heartbeat=NOW - datetime.timedelta(seconds=119))),
        "stale": status("stale", inventory(2, heartbeat=NOW - datetime.timedelta(seconds=121))),
        "notready": status("notready", inventory(3, ready=False)),
    }
    facts = {n: planning.NodeFacts(name=n, labels={}, unschedulable=n == "stale") for n in ("fresh", "stale")}
    views = {
        v.name: v
        for v in planning.build_node_views(
            statuses=statuses, nodes=facts, is_taken=held_by_others({}, "u"), now=NOW, stale_after=120
        )
    }
    assert views["fresh"].ready and not views["stale"].ready and not views["notready"].ready
    assert views["stale"].unschedulable
    assert not views["notready"].node_present


def test_node_views_feed_the_allocator_which_avoids_taken_devices() -> None:
    statuses = {"n1": status("n1", inventory(1, gpus=4))}
    facts = {"n1": planning.NodeFacts(name="n1", labels={}, unschedulable=False)}
    holders = {constants.lease_name(uuid(1, i)): {"someone"} for i in (0, 1)}
    views = planning.build_node_views(
        statuses=statuses, nodes=facts, is_taken=held_by_others(holders, "uid-c"), now=NOW, stale_after=120
    )
    decision = allocator.allocate(claim(count=2), views)
    assert decision.allocations
    assert {d.uuid for d in decision.allocations[0].devices} == {uuid(1, 2), uuid(1, 3)}
    assert not allocator.allocate(claim(count=3), views).allocations


def test_pending_order_is_priority_then_age_then_name() -> None:
    claims = [
        claim("a", priority=0, created="2025-01-01T00:00:02Z"),
        claim("b", priority=5, created="2025-01-01T00:00:03Z"),
        claim("c", priority=0, created="2025-01-01T00:00:01Z"),
        claim("d", priority=5, created="2025-01-01T00:00:01Z"),
    ]
    assert [c.metadata.name for c in allocator.order_pending(claims)] == ["d", "b", "c", "a"]


# ------------------------------------------------------------------ locking plan


def test_lock_plan_covers_every_device_of_every_replica_sorted_by_uuid() -> None:
    allocations = [alloc(0, "n2", 2, (3, 1)), alloc(1, "n1", 1, (0,))]
    plan = planning.lock_plan(allocations)
    assert [i.uuid for i in plan] == sorted([uuid(2, 3), uuid(2, 1), uuid(1, 0)])
    assert all(i.lease == constants.lease_name(i.uuid) for i in plan)
    assert {i.uuid: i.node for i in plan}[uuid(1, 0)] == "n1"


def test_lease_labels_name_node_claim_and_manager() -> None:
    item = planning.lock_plan([alloc(0, "n1", 1, (0,))])[0]
    assert planning.lease_labels(item, claim()) == {
        constants.LABEL_NODE: "n1",
        constants.LABEL_CLAIM_NAMESPACE: "ns",
        constants.LABEL_CLAIM_NAME: "c",
        constants.LABEL_CLAIM_UID: "uid-c",
        constants.LABEL_MANAGED_BY: "gpualloc",
    }


_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


@pytest.mark.parametrize("length", [1, 63, 64, 200, 253])
def test_shorten_label_value_keeps_names_that_fit_and_shortens_longer_ones_to_a_distinct_valid_value(
    length: int,
) -> None:
    name = ("a." * length)[: length - 1] + "z"  # a DNS subdomain; "." lands before the cut
    value = constants.shorten_label_value(name)
    assert len(value) <= 63 and _LABEL_VALUE.fullmatch(value)
    if length <= 63:
        assert value == name
    else:
        assert value.startswith(name[:52]) and value != name
        assert constants.shorten_label_value(name[:-1] + "y") != value


def test_a_long_claim_name_goes_whole_into_the_annotations_and_shortened_into_the_label() -> None:
    item = planning.lock_plan([alloc(0, "n1", 1, (0,))])[0]
    long = claim("c" * 253)
    labels = planning.lease_labels(item, long)
    annotations = planning.lease_annotations(long)
    assert labels[constants.LABEL_CLAIM_NAME] == constants.shorten_label_value("c" * 253)
    assert annotations == {constants.LABEL_CLAIM_NAMESPACE: "ns", constants.LABEL_CLAIM_NAME: "c" * 253}
    lease = {"metadata": {"name": item.lease, "labels": labels, "annotations": annotations}}
    assert (planning.lease_info(lease).claim_namespace, planning.lease_info(lease).claim_name) == (
        "ns",
        "c" * 253,
    )


def test_a_lease_made_before_the_annotations_is_read_from_its_labels() -> None:
    item = planning.lock_plan([alloc(0, "n1", 1, (0,))])[0]
    lease = {"metadata": {"name": item.lease, "labels": planning.lease_labels(item, claim())}}
    info = planning.lease_info(lease)
    assert (info.claim_namespace, info.claim_name) == ("ns", "c")


@pytest.mark.parametrize(
    ("spec", "conflict"),
    [
        ({}, None),
        ({"nodeSelector": {constants.HOSTNAME_LABEL: "n1"}}, None),
        ({"nodeSelector": {constants.HOSTNAME_LABEL: "n9"}}, "pod is pinned to n9 but claim c is on n1"),
        (
            {"affinity": reviews.name_affinity("In", "n9")},
            "pod is kept off n1, where claim c is, by its required node affinity (metadata.name In [n9])",
        ),
    ],
)
def test_placement_conflict_names_a_selector_or_affinity_that_keeps_a_gated_pod_off_its_node(
    spec: dict[str, object], conflict: str | None
) -> None:
    allocation = alloc(0, "n1", 1, (0,))
    pod = {"metadata": {"name": "p"}, "spec": spec}
    assert planning.placement_conflict(pod, claim(), allocation) == conflict


# ------------------------------------------------------------------ status


def test_display_fields_for_one_replica_and_for_a_gang() -> None:
    assert planning.display_fields([alloc(0, "n1", 1, (3, 0, 1, 2))]) == ("n1", "0,1,2,3")
    gang = [alloc(1, "n2", 2, (2, 3)), alloc(0, "n1", 1, (0, 1)), alloc(2, "n1", 1, (4, 5))]
    assert planning.display_fields(gang) == ("n1,n2", "n1:0,1;n2:2,3;n1:4,5")


def test_allocated_status_records_phase_allocations_condition_and_display_fields() -> None:
    lost = models.Condition(type=constants.CONDITION_DEVICES_LOST, status="True", reason="x")
    c = claim(generation=3, status_=models.GpuClaimStatus(conditions=(lost,), retry_count=2))
    patch = planning.allocated_status(c, [alloc(0, "n1", 1, (0, 1))], now=NOW)["status"]
    assert patch["phase"] == "Allocated"
    assert patch["allocations"][0]["nodeName"] == "n1"
    assert patch["allocations"][0]["devices"][1] == {"index": 1, "minor": 1, "uuid": uuid(1, 1)}
    assert patch["nodes"] == "n1" and patch["devices"] == "0,1"
    assert patch["observedGeneration"] == 3 and patch["retryCount"] == 2
    assert patch["lastScheduleTime"] == "2025-01-02T03:04:05Z"
    (cond,) = patch["conditions"]  # DevicesLost of an earlier life is dropped
    assert cond["type"] == "Allocated" and cond["status"] == "True" and cond["reason"] == "Allocated"
    # The patch decodes back into the model: field names match the API.
    decoded = codecs.decode(models.GpuClaimStatus, {k: v for k, v in patch.items() if v is not None})
    assert decoded.allocations[0].devices[0].uuid == uuid(1, 0)


def test_unallocated_status_clears_the_allocation_and_explains_in_one_line() -> None:
    patch = planning.unallocated_status(
        claim(),
        phase="Pending",
        reason="InsufficientDevices",
        message="0/3 nodes fit:\n  too small",
        retry_count=4,
        now=NOW,
    )["status"]
    assert patch["allocations"] is None and patch["nodes"] == "" and patch["devices"] == ""
    assert patch["message"] == "0/3 nodes fit: too small"
    assert patch["conditions"][0]["status"] == "False"
    assert patch["conditions"][0]["reason"] == "InsufficientDevices"
    assert patch["retryCount"] == 4


def test_set_condition_keeps_the_transition_time_while_the_status_stays() -> None:
    old = models.Condition(type="Allocated", status="False", reason="A", last_transition_time="T0")
    same = planning.set_condition([old], dataclasses.replace(old, reason="B", last_transition_time="T1"))
    assert same[0].last_transition_time == "T0" and same[0].reason == "B"
    flipped = planning.set_condition(
        [old], dataclasses.replace(old, status="True", last_transition_time="T1")
    )
    assert flipped[0].last_transition_time == "T1"


def test_status_differs_ignores_timestamps_only() -> None:
    c = claim()
    patch = planning.unallocated_status(c, phase="Pending", reason="R", message="m", retry_count=0, now=NOW)
    assert planning.status_differs(c, patch)
    written = codecs.decode(
        models.GpuClaimStatus, {k: v for k, v in patch["status"].items() if v is not None}
    )
    c2 = dataclasses.replace(c, status=written)
    later = planning.unallocated_status(
        c2, phase="Pending", reason="R", message="m", retry_count=0, now=NOW + datetime.timedelta(hours=1)
    )
    assert not planning.status_differs(c2, later)
    bumped = planning.unallocated_status(c2, phase="Pending", reason="R", message="m", retry_count=1, now=NOW)
    assert planning.status_differs(c2, bumped)


def test_allocation_complete_needs_one_allocation_per_replica() -> None:
    two = models.GpuClaimStatus(
        phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)), alloc(1, "n1", 1, (1,)))
    )
    assert planning.allocation_complete(claim(replicas=2, status_=two))
    assert not planning.allocation_complete(claim(replicas=3, status_=two))
    assert not planning.allocation_complete(
        claim(replicas=2, status_=dataclasses.replace(two, phase="Pending"))
    )


# ------------------------------------------------------------------ device health


def test_problems_name_unhealthy_and_vanished_devices_and_nodes() -> None:
    allocations = [alloc(0, "n1", 1, (0, 1)), alloc(1, "n2", 2, (0,)), alloc(2, "n3", 3, (0,))]
    statuses = {
        "n1": status("n1", inventory(1, gpus=1, unhealthy=(0,))),  # device 1 is gone
        "n2": status("n2", inventory(2)),
    }
    facts = {n: planning.NodeFacts(name=n, labels={}, unschedulable=False) for n in ("n1", "n3")}
    problems = planning.allocation_problems(allocations, statuses=statuses, nodes=facts)
    by_uuid = {p.uuid: p for p in problems}
    assert (
        by_uuid[uuid(1, 0)].reason == planning.REASON_DEVICE_UNHEALTHY
        and "XID 79" in by_uuid[uuid(1, 0)].detail
    )
    assert "device is gone" in by_uuid[uuid(1, 1)].detail
    assert "node is gone" in by_uuid[uuid(2, 0)].detail
    assert "no GpuNodeStatus" in by_uuid[uuid(3, 0)].detail


def test_devices_lost_condition_turns_true_then_false_and_is_none_when_nothing_changes() -> None:
    c = claim(status_=models.GpuClaimStatus(phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)),)))
    assert planning.devices_lost_condition(c, [], now=NOW) is None  # healthy, never had a problem
    problem = planning.Problem(
        node="n1", uuid=uuid(1, 0), reason=planning.REASON_DEVICE_UNHEALTHY, detail="d"
    )
    cond = planning.devices_lost_condition(c, [problem], now=NOW)
    assert cond is not None and cond.status == "True" and cond.reason == "DeviceUnhealthy"
    c2 = dataclasses.replace(c, status=dataclasses.replace(c.status, conditions=(cond,)))
    assert planning.devices_lost_condition(c2, [problem], now=NOW) is None
    lost = planning.devices_lost_condition(c2, [problem], lost_leases=["gpu-x"], now=NOW)
    assert lost is not None and lost.reason == "DevicesMissing"
    healed = planning.devices_lost_condition(c2, [], now=NOW)
    assert healed is not None and healed.status == "False" and healed.reason == "DevicesHealthy"


def _crd_condition_message_limit() -> int:
    crd = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "helm/gpualloc/crds/gpuclaims.yaml").read_text()
    )
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return int(status["properties"]["conditions"]["items"]["properties"]["message"]["maxLength"])


def test_devices_lost_message_stays_under_the_schema_limit_when_a_whole_64_by_64_gang_is_lost() -> None:
    node = "ip-10-120-33-201.eu-west-1.compute.internal"
    allocations = tuple(alloc(r, f"{node}-{r}", r, tuple(range(64))) for r in range(64))
    c = claim(replicas=64, status_=models.GpuClaimStatus(phase="Allocated", allocations=allocations))
    problems = planning.allocation_problems(allocations, statuses={}, nodes={})
    assert len(problems) == 64 * 64
    cond = planning.devices_lost_condition(c, problems, now=NOW)
    assert cond is not None and cond.reason == "DevicesMissing"
    assert len(cond.message) <= planning.DEVICES_LOST_MESSAGE_LIMIT < _crd_condition_message_limit()
    kept = cond.message.count(" on ")
    assert 0 < kept < 64 * 64 and cond.message.endswith(f"; ... and {64 * 64 - kept} more")
    # The same problems give the same message, so nothing is rewritten while they last.
    again = dataclasses.replace(c, status=dataclasses.replace(c.status, conditions=(cond,)))
    assert planning.devices_lost_condition(again, problems, now=NOW) is None


def test_join_capped_keeps_whole_details_and_counts_the_rest() -> None:
    assert planning.join_capped(["a", "b"], limit=100) == "a; b"
    assert planning.join_capped(["x" * 10] * 10, limit=50) == "; ".join(["x" * 10] * 2 + ["... and 8 more"])
    assert len(planning.join_capped(["x" * 10] * 10, limit=50)) <= 50


# ------------------------------------------------------------------ retries


def test_failures_count_only_after_the_backoff_and_exhaust_after_max_retries() -> None:
    policy = models.RetryPolicy(max_retries=2, backoff_seconds=10)
    state = planning.RetryState()
    state, counted = planning.record_failure(state, now=0.0, policy=policy, jitter=0.0)
    assert counted and state.failures == 1 and state.retry_count == 0 and state.not_before == 10.0
    same, counted = planning.record_failure(state, now=5.0, policy=policy, jitter=0.0)
    assert not counted and same == state  # an event-triggered early attempt does not count
    state, counted = planning.record_failure(state, now=10.0, policy=policy, jitter=0.0)
    assert counted and state.retry_count == 1 and state.not_before == 30.0
    assert not planning.retries_exhausted(state, policy)
    state, _ = planning.record_failure(state, now=30.0, policy=policy, jitter=0.0)
    assert state.retry_count == 2 and planning.retries_exhausted(state, policy)
    forever = models.RetryPolicy(max_retries=0, backoff_seconds=1)
    assert not planning.retries_exhausted(planning.RetryState(failures=10_000), forever)


def test_retry_state_resumes_from_the_status_after_a_restart() -> None:
    failed = models.Condition(type="Allocated", status="False", reason="InsufficientDevices")
    c = claim(status_=models.GpuClaimStatus(retry_count=3, conditions=(failed,)))
    assert planning.initial_retry_state(c).retry_count == 3
    assert planning.initial_retry_state(claim()).failures == 0


# ------------------------------------------------------------------ overlay


def test_overlay_holds_entries_until_observed_or_expired() -> None:
    now = [0.0]
    overlay = locking.Overlay(ttl=10, clock=lambda: now[0])
    overlay.reserve(["a", "b"], "c1")
    overlay.note("a", "c1", "uid-a")
    overlay.drop_reserved(["a", "b"], "c1")  # b was never created
    assert overlay.holders() == {"a": "c1"}
    assert overlay.held_by("c1") == {"a": "uid-a"}
    overlay.observed("a", "c2", "uid-a")  # someone else's: keep
    assert "a" in overlay.holders()
    overlay.observed("a", "c1", "uid-a")
    assert overlay.holders() == {}
    overlay.note("x", "c3")
    now[0] = 11.0
    assert overlay.holders() == {}


# ------------------------------------------------------------------ gate mode


def gated_pod(**extra_meta: object) -> dict[str, object]:
    return {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "annotations": {constants.ANNOTATION_CLAIM: "c"},
            **extra_meta,
        },
        "spec": {
            "schedulingGates": [{"name": "other/gate"}, {"name": constants.SCHEDULING_GATE}],
            "containers": [{"name": "main", "image": "x"}],
        },
    }


def test_ungate_patch_adds_devices_and_hostname_selector_and_removes_only_our_gate() -> None:
    pod = gated_pod()
    allocation = alloc(0, "n1", 1, (2, 3))
    ops = planning.ungate_patch(pod, allocation)
    assert ops[0]["op"] == "test" and ops[0]["path"] == "/spec/schedulingGates"
    result = jsonpatch.apply_patch(pod, ops)
    assert result["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == f"{uuid(1, 2)},{uuid(1, 3)}"
    assert result["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "n1"}
    assert result["spec"]["schedulingGates"] == [{"name": "other/gate"}]
    assert any("gpu.scheduling~1devices" in op.get("path", "") for op in ops)


def test_ungate_patch_drops_the_gate_list_when_ours_was_the_only_gate() -> None:
    pod = gated_pod()
    pod["spec"]["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]  # type: ignore[index]
    result = jsonpatch.apply_patch(pod, planning.ungate_patch(pod, alloc(0, "n1", 1, (0,))))
    assert "schedulingGates" not in result["spec"]


def test_ungate_patch_fails_to_apply_when_the_gates_changed_meanwhile() -> None:
    pod = gated_pod()
    ops = planning.ungate_patch(pod, alloc(0, "n1", 1, (0,)))
    changed = gated_pod()
    changed["spec"]["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]  # type: ignore[index]
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(changed, ops)


def test_pod_allocation_picks_the_replica_and_explains_when_it_cannot() -> None:
    gang = claim(
        replicas=2,
        status_=models.GpuClaimStatus(
            phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)), alloc(1, "n2", 2, (0,)))
        ),
    )
    got, _ = planning.pod_allocation(gated_pod(labels={constants.LABEL_JOB_COMPLETION_INDEX: "1"}), gang)
    assert got is not None and got.node_name == "n2"
    none, why = planning.pod_allocation(gated_pod(), gang)
    assert none is None and "2 replicas" in why
    none, why = planning.pod_allocation(gated_pod(annotations={constants.ANNOTATION_REPLICA: "7"}), gang)
    assert none is None and "no replica 7" in why
    single = claim(status_=models.GpuClaimStatus(phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)),)))
    got, _ = planning.pod_allocation(gated_pod(), single)
    assert got is not None and got.replica == 0


@pytest.mark.parametrize("value", ["x", "-1", ""])
def test_a_malformed_replica_index_keeps_the_pod_gated_even_for_a_one_replica_claim(value: str) -> None:
    # As the webhook denies such a pod: it must not fall back to replica 0 here.
    single = claim(status_=models.GpuClaimStatus(phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)),)))
    pod = gated_pod(annotations={constants.ANNOTATION_CLAIM: "c", constants.ANNOTATION_REPLICA: value})
    got, why = planning.pod_allocation(pod, single)
    assert got is None and "annotation gpu.scheduling/replica must be a non-negative integer" in why


def test_seed_is_stable_per_claim_uid() -> None:
    assert planning.seed_for("abc") == planning.seed_for("abc") != planning.seed_for("abd")
