"""A claim's part of an admission (``plans``) and the two decoding passes (``objects``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gpualloc.api import constants, models
from tests import reviews
from webhook import admission, mutations, objects, patches, plans

NS = "team-a"
UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000001"


def allocated(*allocations: models.Allocation, replicas: int = 1) -> models.GpuClaim:
    return models.GpuClaim(
        metadata=models.ObjectMeta(name="train", namespace=NS),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=1), replicas=replicas),
        status=models.GpuClaimStatus(phase=constants.PHASE_ALLOCATED, allocations=allocations),
    )


def allocation(replica: int, node: str, *uuids: str) -> models.Allocation:
    devices = tuple(models.DeviceRef(index=i, minor=i, uuid=u) for i, u in enumerate(uuids))
    return models.Allocation(replica=replica, node_name=node, devices=devices)


def test_a_claims_plan_is_made_once_per_claim_object_and_again_for_a_changed_claim() -> None:
    claim = allocated(allocation(0, "n1", UUID))
    plan = plans.plan_of(claim)
    assert plans.plan_of(claim) is plan
    moved = dataclasses.replace(
        claim, status=dataclasses.replace(claim.status, allocations=(allocation(0, "n2", UUID),))
    )
    assert plans.plan_of(moved) is not plan
    assert plans.plan_of(moved).targets[0].node == "n2"


def test_the_first_allocation_of_a_replica_counts_even_when_it_holds_no_devices() -> None:
    claim = allocated(allocation(0, "n1"), allocation(0, "n2", UUID))
    assert 0 not in plans.plan_of(claim).targets
    pod = {"metadata": {"namespace": NS, "annotations": {constants.ANNOTATION_CLAIM: "train"}}, "spec": {}}
    out = admission.admit(reviews.pod_review(pod, namespace=NS), admission.lookup_from({claim.key: claim}))
    assert out["response"]["allowed"] is False
    assert "holds no devices for replica 0" in out["response"]["status"]["message"]


POD_SHAPES: list[dict[str, Any]] = [
    {},
    {"metadata": {}, "spec": {}},
    {"metadata": {"annotations": {"a/b": "x"}}, "spec": {"nodeSelector": {"zone": "z"}}},
    {"metadata": {"annotations": {constants.ANNOTATION_DEVICES: UUID}}, "spec": {"nodeSelector": {}}},
    {"metadata": {"annotations": {constants.ANNOTATION_DEVICES: "GPU-other"}}, "spec": {}},
    {"spec": {"nodeSelector": {constants.HOSTNAME_LABEL: "n1"}}},
]


@pytest.mark.parametrize("shape", POD_SHAPES)
def test_a_targets_prepared_operations_are_the_ones_the_general_edits_make(shape: dict[str, Any]) -> None:
    target = plans.target(node="n1", devices=allocation(0, "n1", UUID).devices)
    pod = objects.decode_pod(patches.text(shape).encode())
    assert pod is not None
    general: list[patches.Op] = []
    prepared: list[patches.Op] = []
    mutations.pin_to_node(pod, "n1", general)
    mutations.set_annotation(pod, constants.ANNOTATION_DEVICES, UUID, general)
    mutations.pin_to_node(pod, "n1", prepared, target.selector_ops)
    mutations.set_annotation(pod, constants.ANNOTATION_DEVICES, UUID, prepared, target.annotation_ops)
    assert prepared == general


def test_copies_pieces_joined_by_a_path_are_one_copy_per_source_to_that_path() -> None:
    pieces = patches.copies("/spec/initContainers/0/env/", 4, 2, "/env/-")
    assert patches.loads(["/spec/containers/2".join(pieces)]) == [
        {"op": "copy", "from": "/spec/initContainers/0/env/4", "path": "/spec/containers/2/env/-"},
        {"op": "copy", "from": "/spec/initContainers/0/env/5", "path": "/spec/containers/2/env/-"},
    ]


def test_adds_pieces_joined_by_a_path_are_one_add_per_value_at_that_path() -> None:
    pieces = patches.adds("/env/-", ['{"name":"A"}', "[1,2]", '"s"'])
    assert patches.loads(["/spec/containers/3".join(pieces)]) == [
        {"op": "add", "path": "/spec/containers/3/env/-", "value": {"name": "A"}},
        {"op": "add", "path": "/spec/containers/3/env/-", "value": [1, 2]},
        {"op": "add", "path": "/spec/containers/3/env/-", "value": "s"},
    ]
    assert patches.loads(["/x".join(patches.adds("/env", ["[]"]))]) == [
        {"op": "add", "path": "/x/env", "value": []}
    ]


def review_with(resources: dict[str, Any], where: str) -> bytes:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    if where == "pod":
        spec["resources"] = resources
    elif where == "initContainers":
        spec["initContainers"] = [{"name": "init", "resources": resources}]
    else:
        spec["containers"][0]["resources"] = resources
    return patches.text(
        reviews.pod_review({"metadata": {"namespace": NS}, "spec": spec}, namespace=NS)
    ).encode()


@pytest.mark.parametrize("where", ["pod", "initContainers", "containers"])
@pytest.mark.parametrize("part", ["limits", "requests"])
def test_the_fast_pass_refuses_a_pod_naming_an_nvidia_gpu_quantity_and_the_second_pass_reads_it(
    where: str, part: str
) -> None:
    review = objects.decode_review(review_with({part: {"nvidia.com/gpu": "1", "cpu": "2"}}, where))
    assert isinstance(review, objects.RawReview)
    assert review.request is not None
    pod = objects.pod_of(review.request)
    assert pod is not None and mutations.device_plugin_requests(pod)


@pytest.mark.parametrize("resources", [{}, {"limits": {"cpu": "2"}}, {"limits": {"nvidia.com/gpu": None}}])
def test_the_fast_pass_reads_a_pod_that_names_no_nvidia_gpu_quantity(resources: dict[str, Any]) -> None:
    review = objects.decode_review(review_with(resources, "containers"))
    assert isinstance(review, objects.Review)
    assert review.request is not None and review.request.object is not None
    assert mutations.device_plugin_requests(review.request.object) == []
