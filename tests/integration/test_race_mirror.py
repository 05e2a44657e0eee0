"""The race test's safety mirror (chaos_support.Mirror), fed by hand: no API server needed.

It must flag a double-booked GPU, an Allocated claim whose Lease is missing
or held by another claim, and a claim pod running on a device its claim does not
hold, and must not flag what only watch streams arriving out of step make look wrong.
"""

from __future__ import annotations

from typing import Any

from gpualloc.api import constants, leases
from tests.integration.chaos_support import CLAIMS, LEASES, PODS, Mirror, Timeline

NS = "ns"
RUN = "r1"
GPU = "GPU-00000000-0000-0000-0000-000000000001"
LEASE = constants.lease_name(GPU)


def claim(
    name: str, rv: int, *, uid: str = "", gpus: tuple[str, ...] = (), deleting: bool = False
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": NS,
        "uid": uid or f"uid-{name}",
        "resourceVersion": str(rv),
        "labels": {"gpualloc.test/run": RUN},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": constants.PHASE_PENDING}
    if gpus:
        status = {
            "phase": constants.PHASE_ALLOCATED,
            "allocations": [{"replica": 0, "nodeName": "n", "devices": [{"uuid": g} for g in gpus]}],
        }
    return {"metadata": metadata, "spec": {"devices": {"count": max(1, len(gpus))}}, "status": status}


def lease(rv: int, holder: str, name: str = LEASE) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "resourceVersion": str(rv),
            "labels": {constants.LABEL_MANAGED_BY: constants.MANAGED_BY},
        },
        "spec": {"holderIdentity": holder},
    }


def event(type_: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": type_, "object": obj}


def bookmark(rv: int) -> dict[str, Any]:
    return {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(rv)}}}


def mirror() -> Mirror:
    m = Mirror(None, NS, label="gpualloc.test/run", value=RUN, timeline=Timeline())  # type: ignore[arg-type]
    m._relisted(CLAIMS, {}, 1)
    m._relisted(LEASES, {}, 1)
    return m


def test_a_status_that_arrives_before_its_lease_is_not_a_violation() -> None:
    m = mirror()
    m._watched(CLAIMS, event("ADDED", claim("a", 2)))
    m._watched(CLAIMS, event("MODIFIED", claim("a", 4, gpus=(GPU,))))  # written after the Lease (3)
    assert m.lag() == 2  # waits for the Lease stream to pass revision 4
    m._watched(LEASES, event("ADDED", lease(3, "uid-a")))
    m._watched(LEASES, bookmark(5))

    assert m.lag() == 0
    assert m.revision == 4
    assert not m.violations


def test_a_lease_deleted_before_the_status_is_seen_cleared_is_not_a_violation() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(LEASES, event("DELETED", lease(6, "uid-a")))  # released after the status was cleared (5)
    m._watched(CLAIMS, event("MODIFIED", claim("a", 5, deleting=True)))
    m._watched(CLAIMS, bookmark(7))

    assert m.revision == 6
    assert not m.violations


def test_two_claims_listing_one_gpu_is_a_violation() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(CLAIMS, event("ADDED", claim("b", 4, gpus=(GPU,))))
    m._watched(LEASES, bookmark(5))

    assert any("listed by 2 claims" in v for v in m.violations), m.violations
    assert any("ns/b" in v and "held='uid-a'" in v for v in m.violations), m.violations


def test_an_allocated_claim_without_its_lease_is_a_violation() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(LEASES, event("DELETED", lease(4, "uid-a")))
    m._watched(CLAIMS, bookmark(5))

    assert len(m.violations) == 1 and "has no Lease" in m.violations[0], m.violations


def test_a_claim_being_deleted_counts_only_while_it_holds_the_lease() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,), deleting=True)))
    m._watched(LEASES, event("DELETED", lease(4, "uid-a")))  # its finalizer released the GPU
    m._watched(LEASES, event("ADDED", lease(5, "uid-b")))
    m._watched(CLAIMS, event("ADDED", claim("b", 6, gpus=(GPU,))))
    m._watched(LEASES, bookmark(7))
    assert not m.violations

    m2 = mirror()
    m2._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m2._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,), deleting=True)))
    m2._watched(CLAIMS, event("ADDED", claim("b", 4, gpus=(GPU,))))  # while a still holds it
    m2._watched(LEASES, bookmark(5))
    assert any("listed by 2 claims" in v for v in m2.violations), m2.violations


def test_inside_a_relist_window_only_the_state_at_the_list_is_checked() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(LEASES, bookmark(3))
    # The claims watch breaks at 3. Meanwhile the claim is released (5) and its Lease deleted (6);
    # the Lease stream reports that, the claims stream only the re-list at 8.
    m._watched(LEASES, event("DELETED", lease(6, "uid-a")))
    m._watched(LEASES, bookmark(9))
    m._relisted(CLAIMS, {f"{NS}/a": claim("a", 5)}, 8)

    assert m.revision == 8
    assert not m.violations
    assert m.stats["events in re-list windows"] == 1

    # The same break, but the re-list still shows the GPU listed without its Lease.
    m2 = mirror()
    m2._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m2._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m2._watched(LEASES, event("DELETED", lease(6, "uid-a")))
    m2._watched(LEASES, bookmark(9))
    m2._relisted(CLAIMS, {f"{NS}/a": claim("a", 3, gpus=(GPU,))}, 8)

    assert len(m2.violations) == 1 and "after re-list" in m2.violations[0], m2.violations


def preempted(c: dict[str, Any]) -> dict[str, Any]:
    return {**c, "status": {**c["status"], "phase": constants.PHASE_PREEMPTED}}


def test_a_preempted_claim_may_list_what_it_holds_until_its_pods_are_evicted_but_not_longer() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(CLAIMS, event("MODIFIED", preempted(claim("a", 4, gpus=(GPU,)))))  # pods being evicted
    m._watched(LEASES, bookmark(5))
    assert not m.violations
    m._watched(LEASES, event("DELETED", lease(6, "uid-a")))  # released before the status let go
    m._watched(CLAIMS, bookmark(7))
    assert len(m.violations) == 1 and "is Preempted and lists" in m.violations[0], m.violations


SLOT_0, SLOT_1 = constants.slot_id(GPU, 0), constants.slot_id(GPU, 1)
SILICON = {constants.lease_name(SLOT_0): LEASE, constants.lease_name(SLOT_1): LEASE}


def slot_claim(name: str, rv: int, slot: int) -> dict[str, Any]:
    c = claim(name, rv, gpus=(GPU,))
    c["status"]["allocations"][0]["devices"][0]["slot"] = slot
    return c


def silicon_mirror() -> Mirror:
    m = Mirror(None, NS, label="gpualloc.test/run", value=RUN, timeline=Timeline(), silicon=SILICON)  # type: ignore[arg-type]
    m._relisted(CLAIMS, {}, 1)
    m._relisted(LEASES, {}, 1)
    return m


def test_two_claims_on_two_slots_of_one_gpu_are_fine_but_the_gpu_whole_beside_them_is_a_violation() -> None:
    m = silicon_mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a", constants.lease_name(SLOT_0))))
    m._watched(LEASES, event("ADDED", lease(3, "uid-b", constants.lease_name(SLOT_1))))
    m._watched(CLAIMS, event("ADDED", slot_claim("a", 4, 0)))
    m._watched(CLAIMS, event("ADDED", slot_claim("b", 5, 1)))
    m._watched(LEASES, bookmark(6))
    assert not m.violations

    m._watched(LEASES, event("ADDED", lease(7, "uid-c")))
    m._watched(CLAIMS, event("ADDED", claim("c", 8, gpus=(GPU,))))
    m._watched(LEASES, bookmark(9))
    assert any(
        f"{LEASE} is listed whole by ['ns/c'] and in parts by ['ns/a', 'ns/b']" in v for v in m.violations
    ), m.violations


def test_a_slot_the_gpu_does_not_have_is_a_violation() -> None:
    m = silicon_mirror()
    third = constants.lease_name(constants.slot_id(GPU, 2))
    m._watched(LEASES, event("ADDED", lease(2, "uid-a", third)))
    m._watched(CLAIMS, event("ADDED", slot_claim("a", 3, 2)))
    m._watched(LEASES, bookmark(4))
    assert any(f"list {third}, which no GPU has" in v for v in m.violations), m.violations


# ------------------------------------------------------------------ pods: no claim in use released


def pod(name: str, rv: int, claim_name: str, *, uses: str = GPU, gated: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "env": [{"name": "CUDA_VISIBLE_DEVICES", "value": uses}]}]
    }
    if gated:
        spec["schedulingGates"] = [{"name": constants.SCHEDULING_GATE}]
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "resourceVersion": str(rv),
            "labels": {"gpualloc.test/run": RUN},
            "annotations": {constants.ANNOTATION_CLAIM: claim_name, constants.ANNOTATION_DEVICES: uses},
        },
        "spec": spec,
    }


def pod_mirror() -> Mirror:
    m = Mirror(None, NS, label="gpualloc.test/run", value=RUN, timeline=Timeline(), pods=True)  # type: ignore[arg-type]
    for kind in (CLAIMS, LEASES, PODS):
        m._relisted(kind, {}, 1)
    return m


def test_a_claim_released_while_its_pod_runs_is_a_violation() -> None:
    m = pod_mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(PODS, event("ADDED", pod("p", 4, "a")))
    m._watched(CLAIMS, event("MODIFIED", claim("a", 5, gpus=(GPU,), deleting=True)))
    m._watched(LEASES, event("DELETED", lease(6, "uid-a")))  # released while p still runs
    for kind in (CLAIMS, PODS):
        m._watched(kind, bookmark(7))

    assert len(m.violations) == 1, m.violations
    assert "pod ns/p uses" in m.violations[0] and "held=None" in m.violations[0]


def test_a_release_after_the_pod_is_gone_is_not_a_violation_whatever_order_the_streams_arrive_in() -> None:
    m = pod_mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(LEASES, event("DELETED", lease(7, "uid-a")))  # seen before the pod's deletion (6)
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(CLAIMS, event("MODIFIED", claim("a", 5, gpus=(GPU,), deleting=True)))
    m._watched(CLAIMS, event("DELETED", claim("a", 8, gpus=(GPU,), deleting=True)))
    m._watched(PODS, event("ADDED", pod("p", 4, "a")))
    m._watched(PODS, event("DELETED", pod("p", 6, "a")))
    for kind in (CLAIMS, LEASES, PODS):
        m._watched(kind, bookmark(9))

    assert m.revision == 8
    assert not m.violations


def test_a_gated_pod_with_devices_no_claim_holds_is_not_a_violation_until_its_gate_is_lifted() -> None:
    other = "GPU-00000000-0000-0000-0000-000000000002"
    m = pod_mirror()
    m._watched(LEASES, event("ADDED", lease(2, "uid-a")))
    m._watched(CLAIMS, event("ADDED", claim("a", 3, gpus=(GPU,))))
    m._watched(PODS, event("ADDED", pod("stale", 4, "a", uses=other, gated=True)))
    for kind in (CLAIMS, LEASES):
        m._watched(kind, bookmark(5))
    assert not m.violations

    m._watched(PODS, event("MODIFIED", pod("stale", 6, "a", uses=other)))  # the gate lifted
    for kind in (CLAIMS, LEASES):
        m._watched(kind, bookmark(7))
    assert len(m.violations) == 1 and "which its claim ns/a (uid uid-a) does not list" in m.violations[0]


def share_claim(name: str, rv: int, milli: int) -> dict[str, Any]:
    """An Allocated claim holding a milli-GPU share of ``GPU``."""
    body = claim(name, rv, gpus=(GPU,))
    body["status"]["allocations"][0]["devices"][0]["milli"] = milli
    return body


def share_ledger(rv: int, shares: dict[str, int]) -> dict[str, Any]:
    """``GPU``'s Lease as a share ledger holding these shares (claim uid -> milli)."""
    entries = {
        uid: leases.share_entry(milli=m, claim_namespace=NS, claim_name=uid, claim_resource_version="1")
        for uid, m in shares.items()
    }
    raw = leases.with_ledger(lease(rv, ""), entries)
    raw["metadata"]["labels"][leases.LABEL_SHARES] = leases.SHARES_MARK
    return raw


def test_shares_of_one_gpu_up_to_the_whole_are_fine_and_past_it_a_violation() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", share_ledger(2, {"uid-a": 600, "uid-b": 400})))
    m._watched(CLAIMS, event("ADDED", share_claim("a", 3, 600)))
    m._watched(CLAIMS, event("ADDED", share_claim("b", 4, 400)))
    m._watched(LEASES, bookmark(5))
    assert not m.violations

    m._watched(LEASES, event("MODIFIED", share_ledger(6, {"uid-a": 600, "uid-b": 400, "uid-c": 100})))
    m._watched(CLAIMS, event("ADDED", share_claim("c", 7, 100)))
    m._watched(LEASES, bookmark(8))
    assert any(f"{LEASE} is shared past the whole GPU" in v for v in m.violations), m.violations
    assert any(f"{LEASE}'s share ledger sums past the whole GPU" in v for v in m.violations), m.violations


def test_a_share_beside_a_claim_listing_the_gpu_whole_is_a_violation() -> None:
    m = mirror()
    m._watched(LEASES, event("ADDED", share_ledger(2, {"uid-a": 300})))
    m._watched(CLAIMS, event("ADDED", share_claim("a", 3, 300)))
    m._watched(CLAIMS, event("ADDED", claim("w", 4, gpus=(GPU,))))
    m._watched(LEASES, bookmark(5))
    assert any("['ns/w'] whole, {'ns/a': 300} in shares" in v for v in m.violations), m.violations
