"""The controller's pure parts: NodeViews (views), lock plans (locking), device Leases, status patches
(statuses), retries, gate mode (gates)."""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from controller import allocator, gates, locks, retries, statuses, views
from gpualloc.api import codecs, constants, leases, models, timestamps
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


def taken_among(uuids: set[str]) -> Callable[[str], bool]:
    """``is_taken`` for ``build_node_views``: these device UUIDs are taken."""
    return uuids.__contains__


def test_node_views_mark_the_devices_the_caller_says_are_taken() -> None:
    by_node = {"n1": status("n1", inventory(1))}
    facts = {"n1": views.NodeFacts(name="n1", labels={"zone": "a"}, unschedulable=False)}
    (view,) = views.build_node_views(
        statuses=by_node,
        nodes=facts,
        is_taken=taken_among({uuid(1, 0), uuid(1, 2)}),
        heartbeat_ages={"n1": 0.0},
        stale_after=120,
    )
    assert view.taken == {uuid(1, 0), uuid(1, 2)}
    assert view.labels == {"zone": "a"} and view.node_present and view.ready


def test_node_views_flag_missing_nodes_and_stale_or_unready_statuses() -> None:
    by_node = {
        "fresh": status("fresh", inventory(1)),
        "stale": status("stale", inventory(2)),
        "notready": status("notready", inventory(3, ready=False)),
        "silent": status("silent", inventory(4)),
    }
    ages = {"fresh": 119.0, "stale": 121.0, "notready": 0.0, "silent": None}
    facts = {n: views.NodeFacts(name=n, labels={}, unschedulable=n == "stale") for n in ("fresh", "stale")}
    by_name = {
        v.name: v
        for v in views.build_node_views(
            statuses=by_node, nodes=facts, is_taken=taken_among(set()), heartbeat_ages=ages, stale_after=120
        )
    }
    assert by_name["fresh"].ready and not by_name["stale"].ready and not by_name["notready"].ready
    assert not by_name["silent"].ready
    assert by_name["stale"].unschedulable
    assert not by_name["notready"].node_present


def test_node_views_feed_the_allocator_which_avoids_taken_devices() -> None:
    by_node = {"n1": status("n1", inventory(1, gpus=4))}
    facts = {"n1": views.NodeFacts(name="n1", labels={}, unschedulable=False)}
    node_views = views.build_node_views(
        statuses=by_node,
        nodes=facts,
        is_taken=taken_among({uuid(1, 0), uuid(1, 1)}),
        heartbeat_ages={"n1": 0.0},
        stale_after=120,
    )
    decision = allocator.allocate(claim(count=2), node_views)
    assert decision.allocations
    assert {d.uuid for d in decision.allocations[0].devices} == {uuid(1, 2), uuid(1, 3)}
    assert not allocator.allocate(claim(count=3), node_views).allocations


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
    plan = locks.lock_plan(allocations)
    assert [i.lock_id for i in plan] == sorted([uuid(2, 3), uuid(2, 1), uuid(1, 0)])
    assert all(i.lease == constants.lease_name(i.lock_id) for i in plan)
    assert {i.lock_id: i.node for i in plan}[uuid(1, 0)] == "n1"


def device_lease(item: locks.LockItem, c: models.GpuClaim) -> dict[str, Any]:
    meta = c.metadata
    return leases.device_lease(
        "gpualloc-system",
        lock_id=item.lock_id,
        node=item.node,
        claim_namespace=meta.namespace,
        claim_name=meta.name,
        claim_uid=meta.uid,
        claim_resource_version="42",
        now=NOW,
    )


def test_device_lease_is_held_by_the_claim_stamped_with_its_version_and_kept_by_a_finalizer() -> None:
    item = locks.lock_plan([alloc(0, "n1", 1, (0,))])[0]
    lease = device_lease(item, claim())
    assert lease["spec"]["holderIdentity"] == "uid-c"
    assert lease["metadata"]["finalizers"] == [leases.FINALIZER]
    info = leases.parse(lease)
    assert (info.claim_resource_version, info.node, info.deleting) == ("42", "n1", False)


def test_lease_labels_name_node_claim_and_manager() -> None:
    item = locks.lock_plan([alloc(0, "n1", 1, (0,))])[0]
    assert device_lease(item, claim())["metadata"]["labels"] == {
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
    item = locks.lock_plan([alloc(0, "n1", 1, (0,))])[0]
    long = claim("c" * 253)
    labels = device_lease(item, long)["metadata"]["labels"]
    annotations = device_lease(item, long)["metadata"]["annotations"]
    assert labels[constants.LABEL_CLAIM_NAME] == constants.shorten_label_value("c" * 253)
    assert annotations == {
        constants.LABEL_CLAIM_NAMESPACE: "ns",
        constants.LABEL_CLAIM_NAME: "c" * 253,
        leases.ANNOTATION_CLAIM_RESOURCE_VERSION: "42",
    }
    lease = {"metadata": {"name": item.lease, "labels": labels, "annotations": annotations}}
    assert (leases.parse(lease).claim_namespace, leases.parse(lease).claim_name) == (
        "ns",
        "c" * 253,
    )


def test_a_lease_made_before_the_annotations_is_read_from_its_labels() -> None:
    item = locks.lock_plan([alloc(0, "n1", 1, (0,))])[0]
    lease = {"metadata": {"name": item.lease, "labels": device_lease(item, claim())["metadata"]["labels"]}}
    info = leases.parse(lease)
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
    assert gates.placement_conflict(pod, claim(), allocation) == conflict


def test_placement_conflict_refuses_devices_the_webhook_took_from_an_out_of_date_claim() -> None:
    allocation = alloc(0, "n1", 1, (0, 1))
    holds = ",".join(d.uuid for d in allocation.devices)
    admitted = {"metadata": {"name": "p", "annotations": {constants.ANNOTATION_DEVICES: holds}}, "spec": {}}
    assert gates.placement_conflict(admitted, claim(), allocation) is None
    older = alloc(0, "n1", 1, (2, 3))
    stale = ",".join(d.uuid for d in older.devices)
    admitted["metadata"]["annotations"][constants.ANNOTATION_DEVICES] = stale
    conflict = gates.placement_conflict(admitted, claim(), allocation)
    assert conflict is not None and "out-of-date" in conflict and stale in conflict and holds in conflict


# ------------------------------------------------------------------ status


def test_display_fields_for_one_replica_and_for_a_gang() -> None:
    assert statuses.display_fields([alloc(0, "n1", 1, (3, 0, 1, 2))]) == ("n1", "0,1,2,3")
    gang = [alloc(1, "n2", 2, (2, 3)), alloc(0, "n1", 1, (0, 1)), alloc(2, "n1", 1, (4, 5))]
    assert statuses.display_fields(gang) == ("n1,n2", "n1:0,1;n2:2,3;n1:4,5")


def test_allocated_status_records_phase_allocations_condition_and_display_fields() -> None:
    lost = models.Condition(type=constants.CONDITION_DEVICES_LOST, status="True", reason="x")
    c = claim(generation=3, status_=models.GpuClaimStatus(conditions=(lost,), retry_count=2))
    patch = statuses.allocated_status(c, [alloc(0, "n1", 1, (0, 1))], now=NOW)["status"]
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
    patch = statuses.unallocated_status(
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
    same = statuses.set_condition([old], dataclasses.replace(old, reason="B", last_transition_time="T1"))
    assert same[0].last_transition_time == "T0" and same[0].reason == "B"
    flipped = statuses.set_condition(
        [old], dataclasses.replace(old, status="True", last_transition_time="T1")
    )
    assert flipped[0].last_transition_time == "T1"


def test_status_differs_ignores_timestamps_only() -> None:
    c = claim()
    patch = statuses.unallocated_status(c, phase="Pending", reason="R", message="m", retry_count=0, now=NOW)
    assert statuses.status_differs(c, patch)
    written = codecs.decode(
        models.GpuClaimStatus, {k: v for k, v in patch["status"].items() if v is not None}
    )
    c2 = dataclasses.replace(c, status=written)
    later = statuses.unallocated_status(
        c2, phase="Pending", reason="R", message="m", retry_count=0, now=NOW + datetime.timedelta(hours=1)
    )
    assert not statuses.status_differs(c2, later)
    bumped = statuses.unallocated_status(c2, phase="Pending", reason="R", message="m", retry_count=1, now=NOW)
    assert statuses.status_differs(c2, bumped)


def test_allocation_complete_needs_one_allocation_per_replica() -> None:
    two = models.GpuClaimStatus(
        phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)), alloc(1, "n1", 1, (1,)))
    )
    assert statuses.allocation_complete(claim(replicas=2, status_=two))
    assert not statuses.allocation_complete(claim(replicas=3, status_=two))
    assert not statuses.allocation_complete(
        claim(replicas=2, status_=dataclasses.replace(two, phase="Pending"))
    )


# ------------------------------------------------------------------ device health


def test_problems_name_unhealthy_and_vanished_devices_and_nodes() -> None:
    allocations = [alloc(0, "n1", 1, (0, 1)), alloc(1, "n2", 2, (0,)), alloc(2, "n3", 3, (0,))]
    by_node = {
        "n1": status("n1", inventory(1, gpus=1, unhealthy=(0,))),  # device 1 is gone
        "n2": status("n2", inventory(2)),
    }
    facts = {n: views.NodeFacts(name=n, labels={}, unschedulable=False) for n in ("n1", "n3")}
    problems = statuses.allocation_problems(allocations, statuses=by_node, nodes=facts)
    by_uuid = {p.uuid: p for p in problems}
    assert (
        by_uuid[uuid(1, 0)].reason == statuses.REASON_DEVICE_UNHEALTHY
        and "XID 79" in by_uuid[uuid(1, 0)].detail
    )
    assert "device is gone" in by_uuid[uuid(1, 1)].detail
    assert "node is gone" in by_uuid[uuid(2, 0)].detail
    assert "no GpuNodeStatus" in by_uuid[uuid(3, 0)].detail


def test_devices_lost_condition_turns_true_then_false_and_is_none_when_nothing_changes() -> None:
    c = claim(status_=models.GpuClaimStatus(phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)),)))
    assert statuses.devices_lost_condition(c, [], now=NOW) is None  # healthy, never had a problem
    sick = statuses.Problem(node="n1", uuid=uuid(1, 0), reason=statuses.REASON_DEVICE_UNHEALTHY, detail="d")
    assert statuses.devices_lost_condition(c, [sick], now=NOW) is None  # unhealthy is DevicesUnhealthy's
    problem = statuses.Problem(node="n1", uuid=uuid(1, 0), reason=statuses.REASON_DEVICES_MISSING, detail="d")
    cond = statuses.devices_lost_condition(c, [problem], now=NOW)
    assert cond is not None and cond.status == "True" and cond.reason == "DevicesMissing"
    c2 = dataclasses.replace(c, status=dataclasses.replace(c.status, conditions=(cond,)))
    assert statuses.devices_lost_condition(c2, [problem], now=NOW) is None
    taken = {"gpu-x": "gpu-0/GPU-x is held by claim ns/other"}
    lost = statuses.devices_lost_condition(c2, [problem], taken=taken, now=NOW)
    assert lost is not None and lost.reason == constants.REASON_DEVICES_TAKEN
    assert lost.message.startswith("gpu-0/GPU-x is held by claim ns/other; delete and re-create this claim")
    healed = statuses.devices_lost_condition(c2, [], now=NOW)
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
    problems = statuses.allocation_problems(allocations, statuses={}, nodes={})
    assert len(problems) == 64 * 64
    cond = statuses.devices_lost_condition(c, problems, now=NOW)
    assert cond is not None and cond.reason == "DevicesMissing"
    assert len(cond.message) <= statuses.DEVICES_LOST_MESSAGE_LIMIT < _crd_condition_message_limit()
    kept = cond.message.count(" on ")
    assert 0 < kept < 64 * 64 and cond.message.endswith(f"; ... and {64 * 64 - kept} more")
    # The same problems give the same message, so nothing is rewritten while they last.
    again = dataclasses.replace(c, status=dataclasses.replace(c.status, conditions=(cond,)))
    assert statuses.devices_lost_condition(again, problems, now=NOW) is None


def test_join_capped_keeps_whole_details_and_counts_the_rest() -> None:
    assert statuses.join_capped(["a", "b"], limit=100) == "a; b"
    assert statuses.join_capped(["x" * 10] * 10, limit=50) == "; ".join(["x" * 10] * 2 + ["... and 8 more"])
    assert len(statuses.join_capped(["x" * 10] * 10, limit=50)) <= 50


# ------------------------------------------------------------------ retries


def test_failures_count_only_after_the_backoff_and_exhaust_after_max_retries() -> None:
    policy = models.RetryPolicy(max_retries=2, backoff_seconds=10)
    state = retries.RetryState()
    state, counted = retries.record_failure(state, now=0.0, policy=policy, jitter=0.0)
    assert counted and state.failures == 1 and state.retry_count == 0 and state.not_before == 10.0
    same, counted = retries.record_failure(state, now=5.0, policy=policy, jitter=0.0)
    assert not counted and same == state  # an event-triggered early attempt does not count
    state, counted = retries.record_failure(state, now=10.0, policy=policy, jitter=0.0)
    assert counted and state.retry_count == 1 and state.not_before == 30.0
    assert not retries.retries_exhausted(state, policy)
    state, _ = retries.record_failure(state, now=30.0, policy=policy, jitter=0.0)
    assert state.retry_count == 2 and retries.retries_exhausted(state, policy)
    forever = models.RetryPolicy(max_retries=0, backoff_seconds=1)
    assert not retries.retries_exhausted(retries.RetryState(failures=10_000), forever)


def test_retry_state_resumes_from_the_status_after_a_restart() -> None:
    failed = models.Condition(type="Allocated", status="False", reason="InsufficientDevices")
    c = claim(status_=models.GpuClaimStatus(retry_count=3, conditions=(failed,)))
    assert retries.initial_retry_state(c).retry_count == 3
    assert retries.initial_retry_state(claim()).failures == 0


# ------------------------------------------------------------------ overlay


def leftover(name: str, stamped: str) -> leases.LeaseInfo:
    return leases.LeaseInfo(
        name=name,
        uid=f"uid-{name}",
        holder="uid-c",
        claim_namespace="ns",
        claim_name="c",
        claim_resource_version=stamped,
        node="n1",
        deleting=False,
    )


def test_releasable_leftovers_are_only_those_no_attempt_can_still_record() -> None:
    allocated = claim()
    status = dataclasses.replace(allocated.status, allocations=(alloc(0, "n1", 1, (0,)),))
    meta = dataclasses.replace(allocated.metadata, resource_version="7")
    view = dataclasses.replace(allocated, metadata=meta, status=status)
    listed = leftover(constants.lease_name(uuid(1, 0)), "3")  # recorded: never a leftover
    live = leftover(constants.lease_name(uuid(1, 1)), "7")  # an attempt at this very version may record it
    stale = leftover(constants.lease_name(uuid(1, 2)), "5")  # its attempt's write can no longer succeed
    unstamped = leftover(constants.lease_name(uuid(1, 3)), "")
    assert locks.releasable([listed, live, stale, unstamped], view) == [stale, unstamped]


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
    ops = gates.ungate_patch(pod, allocation)
    assert ops[0]["op"] == "test" and ops[0]["path"] == "/spec/schedulingGates"
    result = jsonpatch.apply_patch(pod, ops)
    assert result["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == f"{uuid(1, 2)},{uuid(1, 3)}"
    assert result["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "n1"}
    assert result["spec"]["schedulingGates"] == [{"name": "other/gate"}]
    assert any("gpu.scheduling~1devices" in op.get("path", "") for op in ops)


def test_ungate_patch_drops_the_gate_list_when_ours_was_the_only_gate() -> None:
    pod = gated_pod()
    pod["spec"]["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]  # type: ignore[index]
    result = jsonpatch.apply_patch(pod, gates.ungate_patch(pod, alloc(0, "n1", 1, (0,))))
    assert "schedulingGates" not in result["spec"]


def test_ungate_patch_fails_to_apply_when_the_gates_changed_meanwhile() -> None:
    pod = gated_pod()
    ops = gates.ungate_patch(pod, alloc(0, "n1", 1, (0,)))
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
    got, _ = gates.pod_allocation(gated_pod(labels={constants.LABEL_JOB_COMPLETION_INDEX: "1"}), gang)
    assert got is not None and got.node_name == "n2"
    none, why = gates.pod_allocation(gated_pod(), gang)
    assert none is None and "2 replicas" in why
    none, why = gates.pod_allocation(gated_pod(annotations={constants.ANNOTATION_REPLICA: "7"}), gang)
    assert none is None and "no replica 7" in why
    single = claim(status_=models.GpuClaimStatus(phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)),)))
    got, _ = gates.pod_allocation(gated_pod(), single)
    assert got is not None and got.replica == 0


@pytest.mark.parametrize("value", ["x", "-1", ""])
def test_a_malformed_replica_index_keeps_the_pod_gated_even_for_a_one_replica_claim(value: str) -> None:
    # As the webhook denies such a pod: it must not fall back to replica 0 here.
    single = claim(status_=models.GpuClaimStatus(phase="Allocated", allocations=(alloc(0, "n1", 1, (0,)),)))
    pod = gated_pod(annotations={constants.ANNOTATION_CLAIM: "c", constants.ANNOTATION_REPLICA: value})
    got, why = gates.pod_allocation(pod, single)
    assert got is None and "annotation gpu.scheduling/replica must be a non-negative integer" in why


def test_seed_is_stable_per_claim_uid() -> None:
    assert views.seed_for("abc") == views.seed_for("abc") != views.seed_for("abd")


class FakeFeed:
    """The part of a Reflector the controller's state uses."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}
        self.synced = None
        self.on_event: Callable[[str, Any], None] | None = None

    def get(self, key: str) -> Any:
        return self.cache.get(key)

    def put(self, obj: dict[str, Any], key: str | None = None) -> None:
        """Store ``obj`` under ``key`` (default: its name) and deliver its event."""
        key = key or obj["metadata"]["name"]
        type_ = "MODIFIED" if key in self.cache else "ADDED"
        self.cache[key] = obj
        assert self.on_event is not None
        self.on_event(type_, obj)

    def delete(self, key: str) -> None:
        obj = self.cache.pop(key, None)
        if obj is not None:
            assert self.on_event is not None
            self.on_event("DELETED", obj)


def state_on_fake_feeds(monotonic: Callable[[], float] = lambda: 0.0) -> tuple[Any, dict[str, FakeFeed]]:
    """A controller ``State`` over fake feeds (which it wires up), and the feeds."""
    from controller import state as controller_state

    feeds = {name: FakeFeed() for name in controller_state.FEEDS}
    st = controller_state.State(
        feeds,  # type: ignore[arg-type]
        lease_namespace="gpualloc-system",
        node_stale_after=120,
        wake=lambda key: None,
        now=lambda: NOW,
        monotonic=monotonic,
    )
    return st, feeds


@pytest.fixture(params=[-5.0, 0.0, 5.0], ids=lambda hours: f"{hours:+.0f}h")
def agent_clock(request: pytest.FixtureRequest) -> datetime.datetime:
    """The agent's clock, hours off the controller's: what counts as fresh must not depend on it."""
    return NOW + datetime.timedelta(hours=request.param)


def test_freshness_counts_from_when_the_controller_saw_the_heartbeat_change_whatever_the_agent_clock(
    agent_clock: datetime.datetime,
) -> None:
    mono = [1000.0]
    st, feeds = state_on_fake_feeds(monotonic=lambda: mono[0])

    def beat(at: datetime.datetime) -> None:
        raw = codecs.encode(status("n1", inventory(1, heartbeat=at)))
        raw["metadata"]["resourceVersion"] = str(int(mono[0]))
        feeds["node_statuses"].put(raw)

    beat(agent_clock)
    assert st.node_ready("n1"), "a first sight counts as a fresh heartbeat"
    mono[0] += 100
    beat(agent_clock + datetime.timedelta(seconds=100))  # the agent is alive: its heartbeat moves
    mono[0] += 100
    assert st.node_ready("n1"), "100 s since the last change seen"
    mono[0] += 21
    assert not st.node_ready("n1"), "121 s without a change: stale, whatever the timestamps say"
    beat(agent_clock + datetime.timedelta(seconds=221))
    assert st.node_ready("n1")


def test_a_renewed_heartbeat_lease_keeps_a_node_fresh_while_its_status_stands_still(
    agent_clock: datetime.datetime,
) -> None:
    mono = [1000.0]
    st, feeds = state_on_fake_feeds(monotonic=lambda: mono[0])
    feeds["node_statuses"].put(codecs.encode(status("n1", inventory(1, heartbeat=agent_clock))))
    parsed = st.statuses["n1"]

    def renew(seconds: float) -> None:
        at = agent_clock + datetime.timedelta(seconds=seconds)
        feeds["heartbeats"].put(leases.heartbeat_lease("gpualloc-system-heartbeats", node="n1", now=at))

    mono[0] += 100
    renew(100)
    mono[0] += 100
    assert st.node_ready("n1"), "100 s since the Lease was renewed, 200 s since the status moved"
    mono[0] += 21
    assert not st.node_ready("n1") and not st.node_index().get("n1").ready
    renew(221)
    assert st.node_ready("n1") and st.node_index().get("n1").ready, "a renewal revives it"
    assert st.statuses["n1"] is parsed
    feeds["heartbeats"].delete("n1")
    mono[0] += 121
    assert not st.node_ready("n1"), "no Lease and no status heartbeat for 121 s"


def test_a_heartbeat_alone_keeps_the_parsed_node_and_wakes_nothing_until_it_revives_a_stale_node() -> None:
    mono = [1000.0]
    woken: list[str] = []
    st, feeds = state_on_fake_feeds(monotonic=lambda: mono[0])
    st.wake = woken.append

    def write(inv: models.NodeInventory) -> None:
        feeds["node_statuses"].put(codecs.encode(status("n1", inv)))

    write(inventory(1, heartbeat=NOW))
    parsed, view = st.statuses["n1"], st.node_index().get("n1")
    assert view is not None and view.ready
    feeds["claims"].put(codecs.encode(claim("waiting", count=1)), key="ns/waiting")  # Pending
    woken.clear()

    mono[0] += 30
    write(inventory(1, heartbeat=NOW + datetime.timedelta(seconds=30)))
    assert st.statuses["n1"] is parsed, "a heartbeat alone is not parsed again"
    assert st.node_index().get("n1") is view, "nor is the node's view rebuilt"
    assert woken == [], "nothing changed that a pending claim could use"
    assert st.heartbeat_age("n1") == 0.0

    mono[0] += 121  # no heartbeat for 121 s: stale, found by the sweep's look at readiness
    assert not st.node_index().get("n1").ready
    st.refresh_readiness()
    woken.clear()
    write(inventory(1, heartbeat=NOW + datetime.timedelta(seconds=151)))
    assert st.node_index().get("n1").ready, "the heartbeat revives the node in the allocator's view"
    assert woken == ["ns/waiting"], "and the pending claims are tried again"

    woken.clear()
    write(inventory(1, heartbeat=NOW + datetime.timedelta(seconds=151), unhealthy=(2,)))
    assert st.statuses["n1"] is not parsed, "a change beside the heartbeat is parsed"
    assert st.node_index().get("n1").inventory.devices[2].health == constants.UNHEALTHY
    assert woken == ["ns/waiting"]


def test_the_cached_part_of_a_gated_pod_drops_what_a_tenant_can_bloat_and_ungates_the_same() -> None:
    pod: dict[str, Any] = gated_pod()
    pod["metadata"]["annotations"]["ballast"] = "x" * 150_000
    pod["metadata"]["labels"] = {**(pod["metadata"].get("labels") or {}), "team": "y" * 60}
    pod["spec"]["containers"] = [{"name": "c", "image": "i", "env": [{"name": "E", "value": "v" * 10_000}]}]
    kept = gates.kept_of_pod(pod)
    assert len(str(kept)) < 1_000
    assert "ballast" not in kept["metadata"]["annotations"] and "containers" not in kept["spec"]
    allocation = alloc(0, "n1", 1, (0, 1))
    patched = jsonpatch.apply_patch(pod, gates.ungate_patch(kept, allocation))
    assert patched == jsonpatch.apply_patch(pod, gates.ungate_patch(pod, allocation))
    assert patched["metadata"]["annotations"]["ballast"] == "x" * 150_000
    assert patched["metadata"]["annotations"][constants.ANNOTATION_DEVICES] == ",".join(
        d.uuid for d in allocation.devices
    )
    assert patched["spec"]["schedulingGates"] == [{"name": "other/gate"}]
    long_claim: dict[str, Any] = gated_pod()
    long_claim["metadata"]["annotations"][constants.ANNOTATION_CLAIM] = "c" * 300
    assert gates.pod_claim(gates.kept_of_pod(long_claim)) is None


def test_the_cached_part_of_a_claim_drops_its_labels_and_annotations_and_reads_the_same() -> None:
    from controller import owners

    allocated = models.GpuClaimStatus(
        phase=constants.PHASE_ALLOCATED, allocations=(alloc(0, "n1", 1, (0, 1)),), message="ok"
    )
    raw = codecs.encode(claim(status_=allocated))
    raw["apiVersion"], raw["kind"] = constants.API_VERSION, constants.CLAIM_KIND
    job = {"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "job-uid", "controller": True}
    raw["metadata"].update(
        resourceVersion="7",
        finalizers=[constants.FINALIZER, "example.com/other"],
        ownerReferences=[job],
        deletionTimestamp="2025-01-02T00:00:00Z",
        labels={"team": "t" * 60},
        annotations={"ballast": "x" * 200_000, "kubectl.kubernetes.io/last-applied-configuration": "{}"},
        managedFields=[{"manager": "kubectl", "fieldsV1": {"f:metadata": {}}}],
    )
    kept = codecs.kept_of_claim(raw)
    assert len(str(kept)) < 2_000
    assert {"labels", "annotations", "managedFields"}.isdisjoint(kept["metadata"])
    parsed, whole = codecs.parse_claim(kept), codecs.parse_claim(raw)
    assert parsed == dataclasses.replace(
        whole, metadata=dataclasses.replace(whole.metadata, labels={}, annotations={})
    )
    assert parsed.metadata.finalizers == (constants.FINALIZER, "example.com/other")
    assert parsed.metadata.deletion_timestamp == "2025-01-02T00:00:00Z"
    assert owners.owner_of(kept) == owners.owner_of(raw) is not None
    assert (kept["apiVersion"], kept["kind"]) == (constants.API_VERSION, constants.CLAIM_KIND)


def test_the_controller_write_through_keeps_the_same_part_of_a_claim_as_its_cache() -> None:
    st, feeds = state_on_fake_feeds()
    answer = _claim_raw("3", annotations={"ballast": "x" * 100_000}, labels={"a": "b"})
    st.remember("claims", answer, reconciling="ns/c")
    cached = feeds["claims"].cache["ns/c"]
    assert cached == codecs.kept_of_claim(answer)
    assert "annotations" not in cached["metadata"] and "labels" not in cached["metadata"]


def test_the_cached_part_of_a_node_is_what_node_facts_reads() -> None:
    node: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": "n1",
            "uid": "node-uid",
            "resourceVersion": "9",
            "labels": {"kubernetes.io/hostname": "n1", constants.LABEL_COST_TIER: "spot"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {
            "unschedulable": True,
            "taints": [{"key": "gpu", "value": "h100", "effect": "NoSchedule"}],
            "podCIDR": "10.0.0.0/24",
        },
        "status": {
            "images": [{"names": [f"registry/image-{i}:v1"], "sizeBytes": i} for i in range(50)],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    kept = views.kept_of_node(node)
    assert views.node_facts(kept) == views.node_facts(node)
    assert views.node_facts(kept).taints and views.node_facts(kept).unschedulable
    assert "status" not in kept and "annotations" not in kept["metadata"]
    assert kept["metadata"]["resourceVersion"] == "9"  # a re-list tells a change by it
    assert len(str(kept)) < 400


def _claim_raw(rv: str, **meta: Any) -> dict[str, Any]:
    raw = codecs.encode(claim())
    raw["metadata"].update(resourceVersion=rv, **meta)
    return raw


@pytest.mark.parametrize("event_first", [True, False])
def test_a_deleted_claim_never_comes_back_into_the_cache_through_a_late_answer(event_first: bool) -> None:
    st, feeds = state_on_fake_feeds()
    claims = feeds["claims"]
    key = "ns/c"
    live = _claim_raw("5", finalizers=[constants.FINALIZER], deletionTimestamp="2025-01-01T00:00:00Z")
    claims.cache[key] = live
    assert claims.on_event is not None
    claims.on_event("ADDED", live)
    # The answer to the patch that removed the last finalizer: the API server has deleted the claim.
    answer = _claim_raw("9", finalizers=[], deletionTimestamp="2025-01-01T00:00:00Z")
    if event_first:
        del claims.cache[key]
        claims.on_event("DELETED", _claim_raw("9", deletionTimestamp="2025-01-01T00:00:00Z"))
    st.remember("claims", answer, reconciling=key)
    assert st.raw_claim(key) is None and st.claim(key) is None
    st.remember("claims", _claim_raw("7", finalizers=[constants.FINALIZER]), reconciling=key)
    assert st.raw_claim(key) is None, "an older answer of the same claim stays out too"


def test_a_gpu_and_its_mig_instances_are_taken_together_as_one_piece_of_silicon() -> None:
    instances = tuple(
        models.MigDevice(index=j, uuid=f"MIG-0000000{j}-0000-0000-0000-000000000000", profile="1g.5gb")
        for j in range(3)
    )
    split = models.Device(index=0, minor=0, uuid="GPU-a", mig=models.MigInfo(enabled=True, devices=instances))
    inv = models.NodeInventory(devices=(split, models.Device(index=1, minor=1, uuid="GPU-b")))
    # An instance held: it and its GPU (never handed out whole meanwhile), not its siblings.
    assert views.taken_on(inv, {instances[1].uuid}.__contains__) == {instances[1].uuid, "GPU-a"}
    # The GPU held whole: every instance with it.
    assert views.taken_on(inv, {"GPU-a"}.__contains__) == {"GPU-a", *(m.uuid for m in instances)}
    assert views.taken_on(inv, {"GPU-b"}.__contains__) == {"GPU-b"}


def test_a_shared_gpus_slot_is_locked_by_a_lease_of_its_own() -> None:
    gpu = uuid(1, 0)
    shared = models.Allocation(
        replica=0, node_name="n1", devices=(models.DeviceRef(index=0, minor=0, uuid=gpu, slot=2),)
    )
    (item,) = locks.lock_plan([shared])
    assert item.lock_id == f"{gpu}-s2"
    assert item.lease == f"gpu-{gpu.lower()}-s2"
