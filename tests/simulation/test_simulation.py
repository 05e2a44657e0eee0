"""The deterministic simulation: its model's semantics, its determinism, a broad exploration of
schedules, and the schedules that found the double-bookings of issue 18, pinned by seed.

The exploration runs ``GPUALLOC_SIM_SCHEDULES`` schedules (default 10,000) on up to two
processes and prints the rate. A failure prints the seed, the invariant and the end of the
trace; ``python -m tests.simulation --seed N --trace`` replays it.

A pinned seed names one schedule of this simulator as it is: a change to the scheduler's
choices or the scenarios changes what every seed does, and the seeds then need finding again
(``python -m tests.simulation --schedules N`` on the old controller, see README.md here).
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from controller import gates, healing, locking, reconciling, views
from gpualloc.api import constants, leases, models
from gpualloc.kube import errors, watching
from tests.simulation import invariants, model, scheduler

SCHEDULES = int(os.environ.get("GPUALLOC_SIM_SCHEDULES", "10000"))
FIRST_SEED = int(os.environ.get("GPUALLOC_SIM_SEED", "0"))
WORKERS = max(1, min(2, os.cpu_count() or 1))
CHUNK = 250


@pytest.fixture(scope="module")
def runner() -> Iterator[scheduler.Runner]:
    with scheduler.Runner() as r:
        yield r


def _failure(runner: scheduler.Runner, seed: int, without: frozenset[str] = frozenset()) -> str:
    """The violation of ``seed`` with the end of its trace, for an assertion message."""
    result = runner.run(seed, without=without)
    tail = "\n".join(result.trace[-60:])
    extra = f" --without {','.join(sorted(without))}" if without else ""
    return (
        f"seed {seed}: {result.violation}\n--- last trace lines:\n{tail}\n"
        f"replay: python -m tests.simulation --seed {seed} --trace{extra}"
    )


# ------------------------------------------------------------------ the model


def _server() -> model.ApiServer:
    server = model.ApiServer(clock=scheduler.VirtualClock().now)
    server.subscribe("c0")
    return server


def _lease_body(name: str, holder: str, finalizers: list[str] | None = None) -> dict[str, object]:
    metadata: dict[str, object] = {
        "name": name,
        "namespace": model.NAMESPACE,
        "labels": {constants.LABEL_MANAGED_BY: constants.MANAGED_BY},
    }
    if finalizers:
        metadata["finalizers"] = finalizers
    return {"metadata": metadata, "spec": {"holderIdentity": holder}}


def test_a_merge_patch_that_changes_nothing_keeps_the_resource_version() -> None:
    server = _server()
    claim = server.create_claim("ns", "c", {"devices": {"count": 1}})
    rv = claim["metadata"]["resourceVersion"]
    written = server.patch_claim_status("ns", "c", {"status": {"phase": "Pending"}}, resource_version=rv)
    assert written["metadata"]["resourceVersion"] != rv
    again = server.patch_claim_status(
        "ns", "c", {"status": {"phase": "Pending"}}, resource_version=written["metadata"]["resourceVersion"]
    )
    assert again["metadata"]["resourceVersion"] == written["metadata"]["resourceVersion"]
    assert [t for t, _ in server.watches["c0"].queues["claims"]] == [watching.ADDED, watching.MODIFIED]


def test_a_stale_resource_version_is_a_conflict_and_none_deletes_a_key() -> None:
    server = _server()
    claim = server.create_claim("ns", "c", {"devices": {"count": 1}})
    rv = claim["metadata"]["resourceVersion"]
    written = server.patch_claim_status(
        "ns", "c", {"status": {"phase": "Allocated", "nodes": "n0"}}, resource_version=rv
    )
    with pytest.raises(errors.Conflict):
        server.patch_claim_status("ns", "c", {"status": {"phase": "Pending"}}, resource_version=rv)
    cleared = server.patch_claim_status(
        "ns", "c", {"status": {"nodes": None}}, resource_version=written["metadata"]["resourceVersion"]
    )
    assert cleared["status"] == {"phase": "Allocated"}
    assert cleared["metadata"]["generation"] == 1  # status writes leave the generation alone


def test_a_claim_with_finalizers_is_terminating_until_they_are_emptied() -> None:
    server = _server()
    claim = server.create_claim("ns", "c", {"devices": {"count": 1}})
    with_finalizer = server.patch_claim_metadata(
        "ns",
        "c",
        {"metadata": {"finalizers": [constants.FINALIZER]}},
        resource_version=claim["metadata"]["resourceVersion"],
    )
    server.delete_claim("ns", "c")
    terminating = server.get_claim("ns", "c")
    assert terminating["metadata"]["deletionTimestamp"]
    with pytest.raises(errors.Conflict):  # the finalizer patch saw the claim before the delete
        server.patch_claim_metadata(
            "ns",
            "c",
            {"metadata": {"finalizers": []}},
            resource_version=with_finalizer["metadata"]["resourceVersion"],
        )
    with pytest.raises(errors.Invalid):  # no new finalizer on a claim being deleted
        server.patch_claim_metadata(
            "ns",
            "c",
            {"metadata": {"finalizers": [constants.FINALIZER, "other"]}},
            resource_version=terminating["metadata"]["resourceVersion"],
        )
    server.patch_claim_metadata(
        "ns",
        "c",
        {"metadata": {"finalizers": []}},
        resource_version=terminating["metadata"]["resourceVersion"],
    )
    assert server.claim("ns", "c") is None
    assert server.watches["c0"].queues["claims"][-1][0] == watching.DELETED


def test_lease_create_is_the_lock_even_while_a_finalizer_keeps_it_terminating() -> None:
    server = _server()
    lease = server.create_lease(_lease_body("gpu-a", "claim-1", ["gpu.scheduling/keep"]))
    uid = lease["metadata"]["uid"]
    with pytest.raises(errors.AlreadyExists):
        server.create_lease(_lease_body("gpu-a", "claim-2"))
    with pytest.raises(errors.Conflict):
        server.delete_lease("gpu-a", uid="another-uid")
    assert server.delete_lease("gpu-a", uid=uid) is None  # only marked
    assert server.lease("gpu-a") is not None
    assert server.lease("gpu-a")["metadata"]["deletionTimestamp"]  # type: ignore[index]
    with pytest.raises(errors.AlreadyExists):
        server.create_lease(_lease_body("gpu-a", "claim-2"))
    terminating = server.get_lease("gpu-a")
    emptied = {**terminating, "metadata": {**terminating["metadata"], "finalizers": []}}
    second = server.replace_lease(emptied)
    assert isinstance(second, model.Then) and server.lease("gpu-a") is not None
    assert second.step() == emptied
    assert server.lease("gpu-a") is None
    with pytest.raises(errors.NotFound):
        server.delete_lease("gpu-a", uid=uid)
    server.create_lease(_lease_body("gpu-a", "claim-2"))


def test_emptying_a_terminating_lease_removes_it_later_guarded_by_a_puts_uid_not_a_patchs() -> None:
    # As genericregistry.Store.Update: the update's check, then (deleteWithoutFinalizers) a
    # removal conditional on the uid of the request's body: a PUT has one, a PATCH none.
    server = _server()
    first = server.create_lease(_lease_body("gpu-a", "claim-1", ["gpu.scheduling/keep"]))
    uid = first["metadata"]["uid"]
    server.delete_lease("gpu-a", uid=uid)
    terminating = server.get_lease("gpu-a")
    emptied = {**terminating, "metadata": {**terminating["metadata"], "finalizers": []}}
    put, other_put = server.replace_lease(emptied), server.replace_lease(emptied)
    patch = server.patch_lease_finalizers("gpu-a", uid=uid)
    assert isinstance(put, model.Then) and isinstance(other_put, model.Then) and isinstance(patch, model.Then)
    put.step()  # the first request removes the Lease; another claim takes the name
    server.create_lease(_lease_body("gpu-a", "claim-2"))
    with pytest.raises(errors.Conflict):
        other_put.step()  # the other PUT's removal fails its uid precondition
    assert server.lease("gpu-a")["spec"]["holderIdentity"] == "claim-2"  # type: ignore[index]
    patch.step()  # the PATCH's removal, checked against nothing, removes claim-2's Lease
    assert server.lease("gpu-a") is None


def test_a_label_selector_watch_sees_an_object_leave_as_deleted() -> None:
    server = _server()
    body = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "labels": {constants.LABEL_GATED: "true"},
            "annotations": {constants.ANNOTATION_CLAIM: "c"},
        },
        "spec": {"schedulingGates": [{"name": constants.SCHEDULING_GATE}]},
    }
    server.create_pod(body, claim_uid="claim-1")
    with pytest.raises(errors.Invalid):  # a failed "test" is answered 422
        server.patch_pod("ns", "p", [{"op": "test", "path": "/spec/schedulingGates", "value": []}])
    server.patch_pod(
        "ns",
        "p",
        [
            {"op": "remove", "path": "/metadata/labels/gpu.scheduling~1gated"},
            {"op": "remove", "path": "/spec/schedulingGates"},
        ],
    )
    assert [t for t, _ in server.watches["c0"].queues["pods"]] == [watching.ADDED, watching.DELETED]
    assert server.pod_claim_uid["ns/p"] == ""  # un-gated while no claim "c" exists


def test_a_feed_applies_events_and_reports_a_relist_as_differences() -> None:
    feed = model.SimFeed("claims")
    seen: list[tuple[str, str]] = []
    feed.on_event = lambda type_, obj: seen.append((type_, watching.object_key(obj)))
    a = {"metadata": {"name": "a", "namespace": "ns", "resourceVersion": "1"}}
    b = {"metadata": {"name": "b", "namespace": "ns", "resourceVersion": "2"}}
    feed.apply(watching.ADDED, a)
    feed.relist({"ns/b": b})
    assert seen == [("ADDED", "ns/a"), ("DELETED", "ns/a"), ("ADDED", "ns/b")]
    assert feed.synced.is_set() and feed.get("ns/b") == b


def test_every_admin_deleted_lease_is_exempt_only_until_its_holder_recreates_it() -> None:
    server = _server()
    server.create_lease(_lease_body("gpu-a", "claim-1"))
    assert server.admin_delete_lease("gpu-a")
    assert ("gpu-a", "claim-1") in server.admin_vanished
    server.create_lease(_lease_body("gpu-a", "claim-2"))
    assert ("gpu-a", "claim-1") in server.admin_vanished  # taken by another: still not claim-1's fault
    assert server.admin_delete_lease("gpu-a")
    server.create_lease(_lease_body("gpu-a", "claim-1"))
    assert ("gpu-a", "claim-1") not in server.admin_vanished


# ------------------------------------------------------------------ the scheduler


def test_a_schedule_depends_on_its_seed_only(runner: scheduler.Runner) -> None:
    first = runner.run(7)
    second = runner.run(7)
    assert first.trace == second.trace
    assert first.trace != runner.run(8).trace


def test_the_invariants_catch_a_device_listed_twice() -> None:
    server = _server()
    for name in ("a", "b"):
        claim = server.create_claim("ns", name, {"devices": {"count": 1}})
        status = {
            "phase": "Pending",
            "allocations": [
                {"replica": 0, "nodeName": "n0", "devices": [{"index": 0, "minor": 0, "uuid": "GPU-1"}]}
            ],
        }
        server.patch_claim_status(
            "ns", name, {"status": status}, resource_version=claim["metadata"]["resourceVersion"]
        )
    with pytest.raises(invariants.Violation) as caught:
        invariants.check_step(server, {"GPU-1": "n0/0"})
    assert caught.value.number == 1 and "n0/0 is listed by both ns/a and ns/b" in caught.value.message


def test_the_invariants_catch_a_gpu_listed_whole_and_its_mig_instance_by_another_claim() -> None:
    server = _server()
    server.add_gpu_node("n1", 2, mig=[0])
    gpu, instance = model.gpu_uuid("n1", 0), model.mig_uuid("n1", 0, 1)
    for name, uuid in (("whole", gpu), ("slice", instance)):
        claim = server.create_claim("ns", name, {"devices": {"count": 1}})
        status = {
            "phase": "Pending",
            "allocations": [
                {"replica": 0, "nodeName": "n1", "devices": [{"index": 0, "minor": 0, "uuid": uuid}]}
            ],
        }
        server.patch_claim_status(
            "ns", name, {"status": status}, resource_version=claim["metadata"]["resourceVersion"]
        )
    with pytest.raises(invariants.Violation) as caught:
        invariants.check_step(server, {gpu: "n1/0"})
    assert caught.value.number == 1
    assert (
        caught.value.message
        == "GPU n1/0 is listed whole by ns/whole while ns/slice list MIG instances or slots of it"
    )
    # Two instances of one GPU, each to its own claim, are fine.
    server.delete_claim("ns", "whole")
    claim = server.create_claim("ns", "other-slice", {"devices": {"count": 1}})
    status = {
        "phase": "Pending",
        "allocations": [
            {
                "replica": 0,
                "nodeName": "n1",
                "devices": [{"index": 0, "minor": 0, "uuid": model.mig_uuid("n1", 0, 0)}],
            }
        ],
    }
    server.patch_claim_status(
        "ns", "other-slice", {"status": status}, resource_version=claim["metadata"]["resourceVersion"]
    )
    invariants.check_step(server, {})


def _list(server: model.ApiServer, name: str, *devices: dict[str, Any]) -> None:
    """Claim ``ns/name`` whose status lists ``devices`` on n0, as a controller would write it."""
    claim = server.create_claim("ns", name, {"devices": {"count": len(devices)}})
    status = {"phase": "Pending", "allocations": [{"replica": 0, "nodeName": "n0", "devices": list(devices)}]}
    server.patch_claim_status(
        "ns", name, {"status": status}, resource_version=claim["metadata"]["resourceVersion"]
    )


def test_the_invariants_catch_a_slot_a_gpu_lacks_a_slot_twice_and_a_gpu_whole_and_shared() -> None:
    gpu = model.gpu_uuid("n0", 1)

    def slot(k: int) -> dict[str, Any]:
        return {"index": 1, "minor": 1, "uuid": gpu, "slot": k}

    def caught(server: model.ApiServer) -> str:
        with pytest.raises(invariants.Violation) as violation:
            invariants.check_step(server, {gpu: "n0/1"})
        assert violation.value.number == 1
        return violation.value.message

    server = _server()
    server.add_gpu_node("n0", 2, shared={1: 2})
    _list(server, "a", slot(0))
    _list(server, "b", slot(1))
    invariants.check_step(server, {})  # two claims on the GPU's two slots: fine
    _list(server, "c", slot(2))
    assert caught(server) == f"ns/c lists {gpu}-s2, a slot that no GPU has"  # a third claim: no slot
    server.delete_claim("ns", "c")
    _list(server, "d", slot(1))
    assert "is listed by both ns/b and ns/d" in caught(server)
    server.delete_claim("ns", "d")
    _list(server, "whole", {"index": 1, "minor": 1, "uuid": gpu})
    assert (
        caught(server)
        == "GPU n0/1 is listed whole by ns/whole while ns/a, ns/b list MIG instances or slots of it"
    )


def test_no_schedule_breaks_an_invariant() -> None:
    """``SCHEDULES`` seeded schedules on up to two processes; the first violation fails the test."""
    ranges = [
        (start, min(CHUNK, FIRST_SEED + SCHEDULES - start), None, frozenset[str]())
        for start in range(FIRST_SEED, FIRST_SEED + SCHEDULES, CHUNK)
    ]
    started = time.monotonic()
    done = 0
    stats: dict[str, int] = {}
    violations: list[tuple[int, str]] = []
    with multiprocessing.get_context("spawn").Pool(WORKERS) as pool:
        for batch in pool.imap_unordered(scheduler.explore_range, ranges):
            done += batch.schedules
            for what, n in batch.stats.items():
                stats[what] = stats.get(what, 0) + n
            if batch.violation is not None:
                violations.append(batch.violation)
                pool.terminate()
                break
    elapsed = time.monotonic() - started
    print(
        f"\nsimulation: {done} schedules in {elapsed:.1f} s ({done / elapsed:.0f}/s on {WORKERS} processes); "
        + ", ".join(f"{k} {v}" for k, v in sorted(stats.items()))
    )
    if violations:
        seed = min(violations)[0]
        with scheduler.Runner() as runner:
            pytest.fail(_failure(runner, seed), pytrace=False)
    assert done == SCHEDULES


# ------------------------------------------------------------------ regressions (issue 18)

# (seed, actions left out, what the old controller (commit cf09560) did in that schedule).
# Every seed below was found before the simulation drew quotas, OnPodsCompleted, Reallocate and MIG
# claims: it runs without them, so that it still names the schedule it was found as (each is drawn
# from an RNG of its own).
# Seeds found before the simulation had tenants who strip a claim's finalizers, and preemption
# across namespaces, run without them.
# Seeds found before nodes had CPU and kube-scheduler placed pods (issue 41), and before claims
# moved off a failed GPU (issue 40), run without them too.
# Seeds found before claims asked for milli-GPU shares (issue 39) run without them too, and seeds
# found before claims asked for leastFragmentation run without it.
_BEFORE_FRAGMENTATION = frozenset({"fragmentation"})
_BEFORE_MILLI = frozenset({"milli"}) | _BEFORE_FRAGMENTATION
_BEFORE_FIT = frozenset({"unplaceable", "heal"}) | _BEFORE_MILLI
_BEFORE_STRIPS = frozenset({"strip-finalizer", "preempt-cluster"}) | _BEFORE_FIT
_PINNED = frozenset({"quota", "release", "reallocate", "preempt", "mig", "stale-pod"}) | _BEFORE_STRIPS
# Seeds found before the simulation had stale webhooks (the "stale-pod" action) run without them.
_BEFORE_STALE_PODS = frozenset({"stale-pod"}) | _BEFORE_STRIPS
_NO_ADMIN_NO_DELETE = _PINNED | {"admin-delete-lease", "delete-claim", "fail-call"}
_NO_ADMIN = _PINNED | {"admin-delete-lease", "fail-call", "crash"}
_NO_DELETE = _PINNED | {"delete-claim", "fail-call", "crash"}
REGRESSIONS = [
    pytest.param(
        4308,
        _NO_ADMIN_NO_DELETE,
        "(a) c2's attempt for claim-5 creates n0/2; c0's attempt for claim-5 meets AlreadyExists on "
        "n0/2, reads it held by claim-5 and adopts it, creates n0/3, writes Allocated [n0/2, n0/3]; "
        "c2 then meets n0/1 held by claim-6 and rolls back n0/2: Allocated ns-a/c0 lists n0/2, no Lease",
        id="a-adopted-lease-rolled-back-by-the-other-attempt",
    ),
    pytest.param(
        853,
        _PINNED,
        "(a) c1's attempt for claim-6 creates n0/2; c0's attempt adopts it (held by my UID), creates "
        "n0/3, writes Allocated [n0/2, n0/3]; c1 meets n0/1 held by claim-11 and rolls back n0/2",
        id="a-default-actions",
    ),
    pytest.param(
        279,
        _NO_ADMIN,
        "(b) ns-a/c0 (claim-5) is Allocated [n0/0], pod ns-a/p2 runs on n0/0, the user deletes the "
        "claim, c1 finalizes it and deletes Lease n0/0 while p2 runs",
        id="b-claim-deleted-while-its-pod-runs",
    ),
    pytest.param(
        32,
        _PINNED,
        "(b) pod ns-a/p3 runs on n0/0 of ns-a/c1; the claim is deleted; c1 releases Lease n0/0",
        id="b-default-actions",
    ),
    pytest.param(
        199,
        _NO_DELETE,
        "(c) ns-a/c3 (claim-5) is Allocated [n0/0, n0/1]; an admin deletes Lease n0/0; c0's attempt "
        "for claim-6, which had met AlreadyExists on n0/0, reads NotFound, creates it again and holds "
        "the GPU of an Allocated claim",
        id="c-admin-deleted-lease-taken-by-another-claim",
    ),
    pytest.param(
        24,
        _PINNED,
        "(c) an admin deletes Lease n0/0 of ns-b/c2 (claim-5) as it is being Allocated; claim-7 takes it",
        id="c-default-actions",
    ),
    pytest.param(
        1183,
        _PINNED,
        "invariant 0: a claim's DELETED event during its reconcile dropped its retry state and the "
        "reconcile raised KeyError in _unfit",
        id="old-keyerror-in-unfit",
    ),
    pytest.param(
        455,
        _PINNED,
        "(d) found on commit 5c95727, which emptied a Terminating Lease's finalizers with a JSON "
        "Patch: c1.2 and c0 both release n1/1 (lease-9); both PATCHes pass their uid test; c0's "
        "removes it; c0 creates n1/1 for claim-10; c1.2's removal, checked against nothing, deletes "
        "claim-10's Lease; ns-a/c0 is Allocated [n1/0, n1/1] with no Lease on n1/1 (the race test's "
        "seed 18)",
        id="d-patch-removal-deletes-the-next-claims-lease",
    ),
]


@pytest.mark.parametrize(("seed", "without", "found"), REGRESSIONS)
def test_a_schedule_that_broke_an_invariant_on_the_old_controller_holds_now(
    runner: scheduler.Runner, seed: int, without: frozenset[str], found: str
) -> None:
    result = runner.run(seed, without=without)
    assert result.violation is None, f"{found}\n{_failure(runner, seed, without)}"


# Found by this simulation on the first fixed controller (commits 8ea2b11, a640028): a claim being
# deleted counted the pods that use it from a list of its namespace's pods, in which a gated pod did
# not count; another controller whose cache still showed the claim Allocated un-gated that pod (the
# un-gate patch's test of the gates still held) after the list was taken; the Leases were released
# while the pod then ran on the devices. Fixed: gated pods count as using the claim (gates.pods_using).
KNOWN = [
    pytest.param(
        9280,
        "c0 lists ns-a's pods for the deleted ns-a/c3 (p1 gated) and releases n0/0 after c1.2, whose "
        "cache shows ns-a/c3 Allocated, un-gated p1 onto n0/0",
        id="gated-pod-ungated-after-the-release-check",
    ),
    pytest.param(
        114908,
        "c0 lists ns-a's pods for the deleted ns-a/c3 (p1 gated); c1 un-gates p1 onto n0/0, n0/1; "
        "c0 deletes Lease n0/0",
        id="gated-pod-ungated-during-finalize",
    ),
]


@pytest.mark.parametrize(("seed", "found"), KNOWN)
def test_a_pod_ungated_while_its_claim_is_released_keeps_the_claim(
    runner: scheduler.Runner, seed: int, found: str
) -> None:
    result = runner.run(seed, without=_PINNED)
    assert result.violation is None, f"{found}\n{_failure(runner, seed, _PINNED)}"


# Found at commit 7d60acd, in seeds past 1,200,000: ns-a/c1 (claim-5, Allocated a MIG instance,
# OnPodsCompleted) was deleted and created again under its name (claim-8) with a gated pod p1. c2,
# whose cache still held claim-5 Allocated, listed ns-a's pods, found p1 naming c1, and un-gated it
# onto claim-5's instance, whose Lease was being released (invariant 3). Its status write had met a
# Conflict, but nothing else fenced the un-gating. Fixed: un-gating first reads the claim from the
# API server and goes on only for the same uid, not deleting (gating.PodGate._current).
def test_a_stale_cache_does_not_ungate_the_pod_of_a_new_claim_of_the_same_name(
    runner: scheduler.Runner,
) -> None:
    result = runner.run(1261337, without=_BEFORE_STALE_PODS)
    assert result.violation is None, _failure(runner, 1261337, _BEFORE_STALE_PODS)


# Found by the long run at b635076 (seed 3,634,710, after 634,710 schedules without a violation):
# ns-a/c1 (claim-8) was deleted while c0 reconciled an older view of it; c1 removed its finalizer,
# then c0's stale reconcile admitted claim-8 into the quota's ledger. ns-a/c1 was created again
# (claim-11), and both caches re-listed, so neither saw claim-8's DELETED: its uid still mapped to
# ns-a/c1, and the sweep's drop_gone took claim-8 for alive, so the quota counted its 2 GPUs for
# ever (invariant 4). Fixed: a claim event whose uid differs from the one cached under its key buries
# the old uid and unmaps it (State, _key_to_uid).
def test_a_claim_recreated_under_its_name_unseen_does_not_stay_in_a_quota(
    runner: scheduler.Runner,
) -> None:
    result = runner.run(3634710, without=_BEFORE_STRIPS)
    assert result.violation is None, _failure(runner, 3634710, _BEFORE_STRIPS)


# Found on the first fixed controller: liveness, not safety. c1's finalizer patch of ns-a/c2 was
# applied (rv 9) but answered only after c1 had seen the claim's DELETED event (rv 18); writing the
# answer through into the cache (State.remember) brought the deleted claim back, and since no event
# would ever remove it again, c1 allocated it for ever: create a Lease, the status write is
# NotFound, release the Lease, over and over. Fixed: State remembers the uids it saw DELETED and
# never writes them through again.
def test_a_late_answer_does_not_bring_a_deleted_claim_back(runner: scheduler.Runner) -> None:
    result = runner.run(103609, without=_PINNED)
    assert result.violation is None
    assert result.settled, "\n".join(result.trace[-40:])


# Quotas (issue 19): the ledger's writes are conditional on the quota's resourceVersion. Without
# that precondition two controllers admit past the limit, and the simulation finds it: the check
# can fail.
def test_a_ledger_written_without_its_precondition_lets_racing_controllers_pass_a_quota(
    runner: scheduler.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    conditional = scheduler.SimCluster.patch_quota_status

    async def unconditional(
        self: scheduler.SimCluster, namespace: str, name: str, patch: Any, *, resource_version: str
    ) -> Any:
        return await conditional(self, namespace, name, patch, resource_version="")

    monkeypatch.setattr(scheduler.SimCluster, "patch_quota_status", unconditional)
    result = runner.run(30, without=_BEFORE_STALE_PODS)
    assert result.violation is not None and result.violation.number == 5, result.violation
    monkeypatch.undo()
    assert runner.run(30, without=_BEFORE_STALE_PODS).violation is None


# Before 479bb54 the webhook admitted a pod of a claim it saw Allocated without the gate, so a
# webhook whose watch was behind (the "stale-pod" action) started pods on devices their claim no
# longer held (seed 240; seed 101 until the finalize listed its Leases, which moved every schedule
# after it). Now every claim pod waits at the gate until the controller has checked its claim and
# devices.
def test_a_stale_webhook_without_the_gate_starts_a_pod_on_devices_no_claim_holds(
    runner: scheduler.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    gated_create = model.ApiServer.create_pod

    def ungated_create(self: model.ApiServer, body: dict[str, Any], *, claim_uid: str) -> dict[str, Any]:
        spec = dict(body.get("spec") or {})
        annotations = (body.get("metadata") or {}).get("annotations") or {}
        if constants.ANNOTATION_DEVICES in annotations and spec.pop("schedulingGates", None):
            body = {**body, "spec": spec, "status": {"phase": "Running"}}
            body["metadata"] = {**body["metadata"], "labels": {}}
        return gated_create(self, body, claim_uid=claim_uid)

    monkeypatch.setattr(model.ApiServer, "create_pod", ungated_create)
    result = runner.run(240, without=_BEFORE_STRIPS)
    assert result.violation is not None and result.violation.number == 3, result.violation
    monkeypatch.undo()
    assert runner.run(240, without=_BEFORE_STRIPS).violation is None, _failure(runner, 240, _BEFORE_STRIPS)


# Found by the long run at 5e73342 (seed 7,012,999, after 12,999 schedules without a violation):
# c1.2 judged ns-a/c3's plan (3 H100s, under a *H100* limit of 3) on a cached ledger that missed
# c0.2's admission of ns-a/c1, counted its own victim ns-a/c2 as leaving, and preempted it for a
# claim the stored ledger then refused (invariant 7). Fixed: preemption frees GPUs, not quota, and
# the preemptor is entered in its ledgers, by writes conditional on their versions, before any
# victim is marked.
def test_a_stale_ledger_does_not_preempt_for_a_claim_its_quota_then_refuses(runner: scheduler.Runner) -> None:
    result = runner.run(7012999, without=_BEFORE_FIT)
    assert result.violation is None, _failure(runner, 7012999, _BEFORE_FIT)


# Found by the long run at ff02aab / 8945e5f: neither was a double-booking, both were the model's
# reading of a claim by its name. Seed 8,004,063: an un-gater read ns-a/c1 before a tenant
# stripped it and its patch landed after; the pod is bound to the claim version whose devices it
# was given, whose Lease the sweep keeps while the pod uses it. Seed 8,399,575: a preemptor was
# admitted and then stripped, and a new claim took its key before its victim was marked.
@pytest.mark.parametrize("seed", [8004063, 8399575])
def test_a_stripped_claims_name_reused_is_read_as_the_claim_that_acted(
    runner: scheduler.Runner, seed: int
) -> None:
    result = runner.run(seed, without=_BEFORE_FIT)
    assert result.violation is None, _failure(runner, seed, _BEFORE_FIT)


# Found by the long run at 02f77da (seed 9,358,316): ns-a/c2 was admitted and began locking; its
# user deleted it, another controller released it and took it out of the ledger, and the first
# controller's reconcile, still holding the claim as read before the deletion, found no room and
# marked ns-a/c0 Preempted for it (invariant 7). Fixed: a reconcile whose claim its cache shows
# deleted preempts nobody; the model passes a preemptor deleted after it was admitted, as no write
# can rule out a deletion between the controller's last look and a victim's write.
def test_a_claim_deleted_while_it_planned_preempts_nobody(runner: scheduler.Runner) -> None:
    result = runner.run(9358316, without=_BEFORE_FIT)
    assert result.violation is None, _failure(runner, 9358316, _BEFORE_FIT)
    assert not [line for line in result.trace if "phase=Preempted" in line], _failure(
        runner, 9358316, _BEFORE_FIT
    )


# Found by the long run at 887fea8 (seed 10,395,109; also on 332c6e7): an admin deleted ns-a/c0's
# Lease (its finalizer kept it) and its user deleted the claim; the controller that finalized it
# had not seen the Lease yet, released nothing, took the claim out of its quota's ledger, and a new
# claim was admitted while the old Lease still held a GPU for it (invariant 5). Fixed: a claim being
# deleted releases the Leases an authoritative list (by their claim-uid label) shows, not the
# cache's, before it leaves its quotas.
def test_a_deleted_claim_leaves_its_quota_only_after_every_lease_the_api_server_holds_for_it(
    runner: scheduler.Runner,
) -> None:
    result = runner.run(10395109, without=_BEFORE_FIT)
    assert result.violation is None, _failure(runner, 10395109, _BEFORE_FIT)


# Found by the long run at b057db8 (seed 11,326,617): c0 planned ns-a/c1 on the claim as read while
# Pending; c1 allocated it meanwhile, its pod completed and it was Released and left its quota; c0,
# still on the old read and with a cache that had not seen it move, marked ns-b/c0 Preempted for
# it (invariant 7). No write can rule that out (a victim's is conditional on the victim's version
# alone): the model passes a preemptor admitted once that has moved on (no longer Pending), and
# the controller preempts nobody for a claim its cache shows moved on.
def test_a_preemptor_released_after_its_admission_is_read_as_admitted(runner: scheduler.Runner) -> None:
    result = runner.run(11326617, without=_BEFORE_FIT)
    assert result.violation is None, _failure(runner, 11326617, _BEFORE_FIT)


# Issue 41: nodes have CPU, kube-scheduler places the claim pods the controller releases from the
# gate, and claims whose pods it cannot place move.
def test_the_simulated_scheduler_binds_refuses_and_claims_move(runner: scheduler.Runner) -> None:
    totals: dict[str, int] = {}
    for seed in [*range(5000, 5800), 6220]:
        for what, n in runner.run(seed, keep_trace=False, without=_BEFORE_FRAGMENTATION).stats.items():
            totals[what] = totals.get(what, 0) + n
    assert totals.get("bound_pods", 0) > 50 and totals.get("unschedulable_pods", 0) > 5, totals
    assert totals.get("moved_pods", 0) >= 2, totals  # seeds 5464 and 6220 move a claim


def test_invariant_9_catches_a_claim_that_keeps_its_gpus_for_pods_that_cannot_run(
    runner: scheduler.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never_moves(self: object, claim: models.GpuClaim) -> bool:
        return False

    monkeypatch.setattr(reconciling.Reconciler, "_move_if_unplaceable", never_moves)
    found = runner.run(5464, keep_trace=False, without=_BEFORE_MILLI).violation
    assert found is not None and found.number == 9, found
    monkeypatch.undo()
    assert runner.run(5464, keep_trace=False, without=_BEFORE_MILLI).violation is None


def test_invariant_8_catches_a_pod_released_onto_another_node(
    runner: scheduler.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = gates.ungate_patch

    def elsewhere(pod: dict[str, Any], allocation: models.Allocation) -> list[dict[str, Any]]:
        other = "n1" if allocation.node_name == "n0" else "n0"
        return real(pod, dataclasses.replace(allocation, node_name=other))

    monkeypatch.setattr(gates, "ungate_patch", elsewhere)
    found = next(
        (r.violation for seed in range(5000, 5800) if (r := runner.run(seed, keep_trace=False)).violation),
        None,
    )
    assert found is not None and found.number == 8, found


# Issue 40: a GPU under an onDeviceFailure: Reallocate claim fails, and the claim's replica moves.
def test_gpus_fail_under_reallocate_claims_and_those_claims_move(runner: scheduler.Runner) -> None:
    totals: dict[str, int] = {}
    for seed in range(1000):
        for what, n in runner.run(seed, keep_trace=False).stats.items():
            totals[what] = totals.get(what, 0) + n
    assert totals.get("failed_gpus", 0) > 20 and totals.get("healed_claims", 0) >= 5, totals


def test_invariant_3_catches_a_replica_moved_while_its_pod_still_runs(
    runner: scheduler.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never_evicts(self: object, claim: models.GpuClaim, moving: object) -> bool:
        return False  # as if no pod of the replica used its GPUs

    monkeypatch.setattr(healing.Healer, "_evict", never_evicts)
    found = runner.run(672, keep_trace=False, without=_BEFORE_FRAGMENTATION).violation
    assert found is not None and found.number == 3, found
    monkeypatch.undo()
    assert runner.run(672, keep_trace=False, without=_BEFORE_FRAGMENTATION).violation is None


def test_seed_600940_a_gate_that_read_the_claim_before_the_fence_cannot_lift_a_pod_onto_a_moved_replica(
    runner: scheduler.Runner,
) -> None:
    """The long mode found it (a8072f4): a failed replica's pod, still gated when the healer listed
    the pods behind its fence, was un-gated onto the old GPU by a controller whose GET of the claim
    came before the fence; the move then released that GPU under it (invariant 3). Gated pods of
    a moving replica are now evicted too."""
    result = runner.run(600940, without=_BEFORE_FRAGMENTATION)
    assert result.violation is None, _failure(runner, 600940, _BEFORE_FRAGMENTATION)


def test_seed_30022646_a_stripped_claims_share_counts_as_the_share(runner: scheduler.Runner) -> None:
    """The long mode found it (cc5cbde): a tenant stripped the finalizers of a claim holding 600
    milli of a GPU while its pod ran; invariant 5 counted that pod's GPU as a whole one and fired
    at 1.25 GPUs against a quota of 1, where the namespace held 0.85 (the controller's ledger kept
    the 600). A flaw of the model's invariant, not of the controller."""
    result = runner.run(30022646)
    assert result.violation is None, _failure(runner, 30022646, frozenset())


# ------------------------------------------------------------------ milli-GPU shares (issue 39)


def test_a_lease_delete_with_a_stale_resource_version_is_a_conflict_and_changes_nothing() -> None:
    server = _server()
    lease = server.create_lease(_lease_body("gpu-a", "claim-1", ["gpu.scheduling/keep"]))
    meta = lease["metadata"]
    with pytest.raises(errors.Conflict):
        server.delete_lease("gpu-a", uid=meta["uid"], resource_version=meta["resourceVersion"] + "0")
    assert not server.get_lease("gpu-a")["metadata"].get("deletionTimestamp")
    server.delete_lease("gpu-a", uid=meta["uid"], resource_version=meta["resourceVersion"])
    assert server.get_lease("gpu-a")["metadata"]["deletionTimestamp"]


def _allocated(server: model.ApiServer, name: str, uuid: str, milli: int | None) -> None:
    claim = server.create_claim("ns-a", name, {"devices": {"count": 1}})
    device: dict[str, Any] = {"index": 0, "minor": 0, "uuid": uuid}
    if milli is not None:
        device["milli"] = milli
    status = {"phase": "Allocated", "allocations": [{"replica": 0, "nodeName": "n0", "devices": [device]}]}
    server.patch_claim_status(
        "ns-a", name, {"status": status}, resource_version=claim["metadata"]["resourceVersion"]
    )


def test_invariant_10_fires_on_shares_past_a_gpu_and_on_a_share_beside_a_whole_claim() -> None:
    shares = _server()
    _allocated(shares, "c0", "GPU-a", 600)
    _allocated(shares, "c1", "GPU-b", 600)
    assert invariants.share_problem(shares, {}) is None
    _allocated(shares, "c2", "GPU-a", 400)
    assert invariants.share_problem(shares, {}) is None  # exactly the whole GPU
    _allocated(shares, "c3", "GPU-b", 401)
    problem = invariants.share_problem(shares, {"GPU-b": "n0/1"})
    assert problem is not None and "n0/1 is shared past the whole of it: 1001" in problem
    beside = _server()
    _allocated(beside, "c0", "GPU-a", 250)
    _allocated(beside, "c1", "GPU-a", None)
    problem = invariants.share_problem(beside, {})
    assert problem is not None and "listed whole (or in part) by ns-a/c1" in problem


def test_invariant_10_fires_on_a_stored_ledger_past_a_gpu() -> None:
    server = _server()
    entries = {
        f"claim-{k}": leases.share_entry(
            milli=500, claim_namespace="ns-a", claim_name=f"c{k}", claim_resource_version="1"
        )
        for k in range(3)
    }
    server.create_lease(
        leases.share_lease(model.NAMESPACE, uuid="GPU-a", node="n0", entries=entries, now=_NOW)
    )
    problem = invariants.share_problem(server, {})
    assert problem is not None and "share ledger sums to 1500 milli-GPU" in problem


_NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def _first_violation(runner: scheduler.Runner, seeds: range) -> invariants.Violation | None:
    return next((r.violation for seed in seeds if (r := runner.run(seed, keep_trace=False)).violation), None)


def test_invariant_10_catches_a_ledger_that_lets_shares_past_the_gpu(
    runner: scheduler.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    def ignoring_the_sum(lease: leases.LeaseInfo, uid: str, milli: int) -> bool:
        return lease.ledger and not lease.deleting and all(s.holder != uid for s in lease.shares)

    monkeypatch.setattr(locking, "fits", ignoring_the_sum)
    monkeypatch.setattr(views, "shares_on", lambda inventory, taken, milli_used: {})  # planning blind too
    found = _first_violation(runner, range(2000))
    assert found is not None and found.number == 10, found


def test_invariant_10_catches_a_share_put_into_a_whole_claims_lease(
    runner: scheduler.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    def ignoring_whole_holders(lease: leases.LeaseInfo, uid: str, milli: int) -> bool:
        return (not lease.deleting and lease.used_milli + milli <= leases.WHOLE_MILLI) or not lease.ledger

    real = views.shares_on

    def whole_as_shared(
        inventory: models.NodeInventory, taken: frozenset[str], milli_used: Any
    ) -> dict[str, int]:
        return {
            **{d.uuid: 0 for d in inventory.devices if d.uuid in taken},
            **real(inventory, taken, milli_used),
        }

    monkeypatch.setattr(locking, "fits", ignoring_whole_holders)
    monkeypatch.setattr(views, "shares_on", whole_as_shared)  # planning offers whole-held GPUs to shares
    found = _first_violation(runner, range(2000))
    assert found is not None and found.number == 10 and "listed whole" in found.message, found


def test_milli_shares_are_allocated_side_by_side_on_one_gpu(runner: scheduler.Runner) -> None:
    totals: dict[str, int] = {}
    for seed in range(400):
        for what, n in runner.run(seed, keep_trace=False).stats.items():
            totals[what] = totals.get(what, 0) + n
    assert totals.get("shared_ledgers", 0) >= 5, totals
