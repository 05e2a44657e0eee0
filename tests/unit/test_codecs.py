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
