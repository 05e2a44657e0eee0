"""The ResourceClaims a GpuClaim projects to, and the plan that makes them so (controller.resourceclaims)."""

from __future__ import annotations

import copy
from typing import Any

from controller import resourceclaims as rcs
from gpualloc.api import constants, models

NS = "team-a"
UID = "11111111-2222-3333-4444-555555555555"


def claim(
    *,
    phase: str = constants.PHASE_ALLOCATED,
    nodes: tuple[str, ...] = ("node-a",),
    uuids: tuple[str, ...] = ("GPU-AAAA-1", "GPU-BBBB-2"),
    slot: int | None = None,
    uid: str = UID,
) -> models.GpuClaim:
    allocations = tuple(
        models.Allocation(
            replica=r,
            node_name=node,
            devices=tuple(
                models.DeviceRef(index=i, minor=i, uuid=f"{u}-R{r}", slot=slot) for i, u in enumerate(uuids)
            ),
        )
        for r, node in enumerate(nodes)
    )
    return models.GpuClaim(
        metadata=models.ObjectMeta(name="train", namespace=NS, uid=uid),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=len(uuids)), replicas=len(nodes)),
        status=models.GpuClaimStatus(phase=phase, allocations=allocations if phase == "Allocated" else ()),
    )


def existing(c: models.GpuClaim, *, reserved: int = 0, rv: str = "10") -> dict[str, dict[str, Any]]:
    """What the API server holds once the plan for ``c`` was carried out."""
    out = {}
    for name, want in rcs.wanted(c).items():
        obj = copy.deepcopy(rcs.body(c, want))
        obj["metadata"].update(uid=f"rc-{name}", resourceVersion=rv)
        obj["status"] = {"allocation": rcs.allocation_json(want.allocated)}
        if reserved:
            obj["status"]["reservedFor"] = [
                {"resource": "pods", "name": f"p{i}", "uid": f"u{i}"} for i in range(reserved)
            ]
        out[name] = obj
    return out


def kinds(steps: list[rcs.Step]) -> list[tuple[str, str]]:
    def name(step: rcs.Step) -> str:
        return str(step.body["metadata"]["name"]) if isinstance(step, rcs.Create) else step.name

    return [(type(step).__name__, name(step)) for step in steps]


def test_each_allocated_replica_gets_a_resourceclaim_owned_by_the_gpuclaim_with_its_devices_on_its_node() -> (
    None
):
    c = claim(nodes=("node-a", "node-b"))
    steps = rcs.plan(c, {})
    assert kinds(steps) == [
        ("Create", "train-gpus-0"),
        ("WriteAllocation", "train-gpus-0"),
        ("Create", "train-gpus-1"),
        ("WriteAllocation", "train-gpus-1"),
    ]
    body = steps[2]
    assert isinstance(body, rcs.Create)
    meta = body.body["metadata"]
    assert meta["namespace"] == NS
    assert meta["ownerReferences"] == [
        {
            "apiVersion": constants.API_VERSION,
            "kind": "GpuClaim",
            "name": "train",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": False,
        }
    ]
    assert meta["labels"][constants.LABEL_CLAIM_NAME] == "train"
    assert "finalizers" not in meta  # no delete-protection: kube-controller-manager keeps the allocation
    assert body.body["spec"]["devices"]["requests"] == [
        {"name": "gpus", "exactly": {"deviceClassName": "gpu.gpualloc.dev", "count": 2}}
    ]
    write = steps[3]
    assert isinstance(write, rcs.WriteAllocation)
    assert rcs.allocation_json(write.allocated, "2026-01-02T03:04:05Z") == {
        "allocationTimestamp": "2026-01-02T03:04:05Z",
        "devices": {
            "results": [
                {
                    "request": "gpus",
                    "driver": "gpu.gpualloc.dev",
                    "pool": "node-b",
                    "device": "gpu-aaaa-1-r1",
                },
                {
                    "request": "gpus",
                    "driver": "gpu.gpualloc.dev",
                    "pool": "node-b",
                    "device": "gpu-bbbb-2-r1",
                },
            ]
        },
        "nodeSelector": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}
            ]
        },
    }


def test_a_shared_gpus_device_is_its_slot_in_lower_case() -> None:
    want = rcs.wanted(claim(uuids=("GPU-AAAA-1",), slot=3))["train-gpus-0"]
    assert want.allocated.results == (rcs.Result(pool="node-a", device="gpu-aaaa-1-r0-s3"),)


def test_nothing_is_written_when_the_resourceclaims_already_say_what_the_claim_holds() -> None:
    c = claim(nodes=("node-a", "node-b"))
    assert rcs.plan(c, existing(c)) == []


def test_a_moved_replica_has_its_allocation_removed_then_written_anew_once_no_pod_is_reserved() -> None:
    before = claim(nodes=("node-a", "node-b"))
    after = claim(nodes=("node-a", "node-c"))
    steps = rcs.plan(after, existing(before, rv="42"))
    assert kinds(steps) == [("ClearAllocation", "train-gpus-1"), ("WriteAllocation", "train-gpus-1")]
    assert isinstance(steps[0], rcs.ClearAllocation) and steps[0].resource_version == "42"
    assert isinstance(steps[1], rcs.WriteAllocation)
    assert steps[1].allocated.node == "node-c"


def test_a_moved_replica_waits_while_pods_are_reserved_for_its_resourceclaim() -> None:
    before = claim(nodes=("node-a",))
    after = claim(nodes=("node-c",))
    assert rcs.plan(after, existing(before, reserved=2)) == [rcs.Wait(name="train-gpus-0", reserved=2)]


def test_a_claim_back_to_pending_keeps_its_resourceclaims_without_an_allocation() -> None:
    before = claim()
    steps = rcs.plan(claim(phase=constants.PHASE_PENDING), existing(before))
    assert kinds(steps) == [("ClearAllocation", "train-gpus-0")]


def test_a_claim_gone_or_released_has_its_resourceclaims_deleted_once_no_pod_is_reserved() -> None:
    before = claim()
    assert rcs.plan(None, existing(before)) == [rcs.Delete(name="train-gpus-0", uid="rc-train-gpus-0")]
    released = claim(phase=constants.PHASE_RELEASED)
    assert kinds(rcs.plan(released, existing(before))) == [("Delete", "train-gpus-0")]
    assert kinds(rcs.plan(None, existing(before, reserved=1))) == [("Wait", "train-gpus-0")]


def test_a_resourceclaim_of_an_earlier_gpuclaim_of_the_same_name_is_deleted_not_reused() -> None:
    old = existing(claim(uid="old-uid"))
    assert kinds(rcs.plan(claim(), old)) == [("Delete", "train-gpus-0")]


def test_a_resourceclaim_asking_another_count_is_deleted_since_its_spec_is_immutable() -> None:
    old = existing(claim(uuids=("GPU-AAAA-1",)))
    assert kinds(rcs.plan(claim(), old)) == [("Delete", "train-gpus-0")]


def test_the_claim_of_a_resourceclaim_is_read_from_its_annotation_the_whole_name() -> None:
    long_name = "a" * 200
    c = models.GpuClaim(
        metadata=models.ObjectMeta(name=long_name, namespace=NS, uid=UID),
        spec=claim().spec,
        status=claim().status,
    )
    (want,) = rcs.wanted(c).values()
    body = rcs.body(c, want)
    assert len(body["metadata"]["labels"][constants.LABEL_CLAIM_NAME]) <= 63
    assert rcs.claim_key(body) == f"{NS}/{long_name}"
    assert rcs.allocated_of({"status": {"allocation": rcs.allocation_json(want.allocated)}}) == want.allocated
