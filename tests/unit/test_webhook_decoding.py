"""The replica's allocation an admission reads, and the two decoding passes (``objects``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpualloc.api import constants, models
from tests import admitting, reviews
from webhook import mutations, objects

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


def test_the_first_allocation_of_a_replica_counts_even_when_it_holds_no_devices() -> None:
    claim = allocated(allocation(0, "n1"), allocation(0, "n2", UUID))
    pod = {"metadata": {"namespace": NS, "annotations": {constants.ANNOTATION_CLAIM: "train"}}, "spec": {}}
    out = admitting.admit(reviews.pod_review(pod, namespace=NS), admitting.lookup_from({claim.key: claim}))
    assert out["response"]["allowed"] is False
    assert "holds no devices for replica 0" in out["response"]["status"]["message"]


def review_with(resources: dict[str, Any], where: str) -> bytes:
    spec: dict[str, Any] = {"containers": [{"name": "main"}]}
    if where == "pod":
        spec["resources"] = resources
    elif where == "initContainers":
        spec["initContainers"] = [{"name": "init", "resources": resources}]
    else:
        spec["containers"][0]["resources"] = resources
    return json.dumps(
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
