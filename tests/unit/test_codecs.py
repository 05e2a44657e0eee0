"""Raw dicts <-> models."""

from __future__ import annotations

import pytest

from gpualloc.api import codecs, models


def test_claim_body_leaves_out_empty_lists_the_crd_would_reject() -> None:
    spec = models.GpuClaimSpec(devices=models.DeviceRequest(count=2), selector=models.LabelSelector())
    body = codecs.claim_body("c", spec, namespace="ns")
    assert "preferIds" not in body["spec"]["devices"]
    assert "selector" not in body["spec"]
    assert body["spec"]["devices"]["count"] == 2
    assert body["metadata"] == {"name": "c", "namespace": "ns"}


def test_claim_round_trips_through_encode_and_decode() -> None:
    raw = {
        "metadata": {"name": "c", "namespace": "ns", "uid": "u", "labels": {"a": "b"}},
        "spec": {
            "devices": {"count": 2, "policy": "preferIds", "preferIds": [0, 2], "minMemoryMiB": 40000},
            "topology": {"mode": "Required", "minBandwidthGBps": 600},
            "selector": {"matchExpressions": [{"key": "k", "operator": "In", "values": ["x"]}]},
        },
    }
    claim = codecs.parse_claim(raw)
    assert claim.spec.devices.prefer_ids == (0, 2)
    assert claim.spec.devices.min_memory_mib == 40000
    assert claim.spec.topology.min_bandwidth_gbps == 600
    again = codecs.decode(models.GpuClaimSpec, codecs.encode(claim.spec))
    assert again == claim.spec


def test_decode_names_the_bad_field() -> None:
    with pytest.raises(codecs.DecodeError, match=r"spec\.devices\.count: expected an integer"):
        codecs.parse_claim({"metadata": {"name": "c"}, "spec": {"devices": {"count": "two"}}})
    with pytest.raises(codecs.DecodeError, match=r"spec\.devices\.count: required"):
        codecs.parse_claim({"metadata": {"name": "c"}, "spec": {"devices": {}}})


@pytest.mark.parametrize(
    ("status", "message"),
    [
        ({"devices": [{"index": 0, "minor": 0, "uuid": "GPU-a"}, {"index": 1, "minor": 1, "uuid": 7}]},
         "status.devices[1].uuid: expected a string, got 7"),
        ({"devices": [{"index": 0, "minor": 0, "uuid": "GPU-a", "mig": {"devices": [{"index": 0}]}}]},
         "status.devices[0].mig.devices[0].uuid: required"),
        ({"islands": [[0, 1], [2, "x"]]}, "status.islands[1][1]: expected an integer, got 'x'"),
        ({"devices": "none"}, "status.devices: expected a list, got str"),
    ],
)  # fmt: skip
def test_decode_names_the_bad_field_through_lists_and_nested_objects(status: dict, message: str) -> None:
    raw = {"metadata": {"name": "n"}, "spec": {"nodeName": "n"}, "status": status}
    with pytest.raises(codecs.DecodeError) as info:
        codecs.parse_node_status(raw)
    assert str(info.value) == message


def test_a_map_of_models_names_the_bad_key() -> None:
    raw = {
        "metadata": {"name": "q", "namespace": "ns"},
        "spec": {"gpus": 4},
        "status": {"claims": {"uid-1": {"name": "c", "gpus": "x"}}},
    }
    with pytest.raises(codecs.DecodeError, match=r"^status\.claims\.uid-1\.gpus: expected an integer"):
        codecs.parse_quota(raw)


def test_a_quotas_claim_bound_and_allowed_tolerations_round_trip() -> None:
    raw = {
        "metadata": {"name": "q", "namespace": "ns"},
        "spec": {
            "gpus": 4,
            "maxClaims": 100,
            "allowedTolerations": [{"key": "team", "value": "a", "effect": "NoSchedule"}],
        },
    }
    quota = codecs.parse_quota(raw)
    assert quota.spec.max_claims == 100
    assert quota.spec.allowed_tolerations == (models.Toleration(key="team", value="a", effect="NoSchedule"),)
    assert codecs.decode(models.GpuQuotaSpec, codecs.encode(quota.spec)) == quota.spec
    bare = codecs.parse_quota({"metadata": {"name": "q"}, "spec": {"gpus": 1}})
    assert (bare.spec.max_claims, bare.spec.allowed_tolerations) == (None, ())


def test_a_claims_pod_resources_are_read_in_millicores_bytes_and_a_count_and_written_back() -> None:
    raw = {
        "metadata": {"name": "c"},
        "spec": {
            "devices": {"count": 1},
            "podResources": {"cpu": "1500m", "memory": "16Gi", "pods": 2, "hugepages-2Mi": "1000Ki"},
            "unschedulableGracePeriodSeconds": 120,
        },
    }
    spec = codecs.parse_claim(raw).spec
    assert spec.pod_resources == {"cpu": 1500, "memory": 16 * 2**30, "pods": 2, "hugepages-2Mi": 1_024_000}
    assert spec.unschedulable_grace_period_seconds == 120
    written = codecs.encode(spec)["podResources"]
    assert written == {"cpu": "1500m", "memory": 16 * 2**30, "pods": 2, "hugepages-2Mi": 1_024_000}
    assert codecs.decode(models.GpuClaimSpec, codecs.encode(spec)) == spec


def test_a_claim_without_pod_resources_asks_none_and_waits_60_s_on_an_unschedulable_pod() -> None:
    spec = codecs.parse_claim({"metadata": {"name": "c"}, "spec": {"devices": {"count": 1}}}).spec
    assert (spec.pod_resources, spec.unschedulable_grace_period_seconds) == ({}, 60)
    assert "podResources" not in codecs.claim_body("c", spec)["spec"]


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"cpu": "lots"}, "spec.podResources.cpu: not a quantity: 'lots'"),
        ({"memory": "1e1.5"}, "spec.podResources.memory: not a quantity: '1e1.5'"),
        ({"cpu": 1.5}, "spec.podResources.cpu: not a quantity: 1.5"),
        ({"pods": -1}, "spec.podResources.pods: must not be negative, got -1"),
        (["cpu"], "spec.podResources: expected an object, got list"),
    ],
)
def test_a_pod_resource_that_is_not_a_non_negative_quantity_is_named(resources: object, message: str) -> None:
    raw = {"metadata": {"name": "c"}, "spec": {"devices": {"count": 1}, "podResources": resources}}
    with pytest.raises(codecs.DecodeError) as info:
        codecs.parse_claim(raw)
    assert str(info.value) == message
