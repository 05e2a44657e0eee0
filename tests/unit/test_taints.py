"""Taints and tolerations as the kube-scheduler matches them (gpualloc/api/taints.py)."""

from __future__ import annotations

import pytest

from gpualloc.api import models, taints

GPU = models.Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")


@pytest.mark.parametrize(
    ("toleration", "tolerated"),
    [
        (models.Toleration(key="nvidia.com/gpu", operator="Exists"), True),
        (models.Toleration(key="nvidia.com/gpu", value="present"), True),
        (models.Toleration(key="nvidia.com/gpu", value="absent"), False),
        (models.Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoExecute"), False),
        (models.Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule"), True),
        (models.Toleration(operator="Exists"), True),  # an empty key with Exists: everything
        (models.Toleration(key="other", operator="Exists"), False),
    ],
)
def test_a_toleration_matches_a_taint_as_the_scheduler_does(
    toleration: models.Toleration, tolerated: bool
) -> None:
    assert taints.tolerates(toleration, GPU) is tolerated


def test_only_blocking_taints_of_a_node_count_and_the_gpu_pool_taint_is_tolerated_by_default() -> None:
    node = {
        "spec": {
            "taints": [
                {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                {"key": "spot", "value": "true", "effect": "PreferNoSchedule"},
                {"key": "team", "effect": "NoExecute"},
            ]
        }
    }
    found = taints.node_taints(node)
    assert [str(t) for t in found] == ["nvidia.com/gpu=present:NoSchedule", "team:NoExecute"]
    spec = models.GpuClaimSpec(devices=models.DeviceRequest(count=1))
    assert taints.untolerated(found, taints.claim_tolerations(spec)) == found[1]
    tolerant = models.GpuClaimSpec(
        devices=models.DeviceRequest(count=1), tolerations=(models.Toleration(key="team", operator="Exists"),)
    )
    assert taints.untolerated(found, taints.claim_tolerations(tolerant)) is None
