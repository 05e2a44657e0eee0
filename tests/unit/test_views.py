"""The people-facing tables: node summary, claim list, topology matrix."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest

from gpualloc import views
from gpualloc.api import codecs, constants, leases, models
from tests.unit.test_controller_pure import status

NOW = dt.datetime(2026, 11, 23, 12, 0, 0, tzinfo=dt.UTC)


def _uuid(i: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{i:012x}"


def _node(name: str, n: int, *, unhealthy: int = -1) -> models.GpuNodeStatus:
    devices = tuple(
        models.Device(
            index=i,
            minor=i,
            uuid=_uuid(i),
            numa_node=i // 4,
            health="Unhealthy" if i == unhealthy else "Healthy",
        )
        for i in range(n)
    )
    links = tuple(
        models.Link(
            a=a,
            b=b,
            type="NV18" if (a < 2 and b < 2) else "SYS",
            nvlinks=18 if b < 2 else 0,
            bandwidth_gbps=900 if b < 2 else 32,
        )
        for a in range(n)
        for b in range(a + 1, n)
    )
    inv = models.NodeInventory(
        devices=devices,
        links=links,
        islands=((0, 1),),
        total=n,
        healthy=n,
        product=f"{n}x NVIDIA H100",
        last_heartbeat_time="2026-11-23T11:59:30Z",
    )
    return status(name, inv)


def test_age_uses_kubectl_units() -> None:
    assert views.age("2026-11-23T11:59:15Z", NOW) == "45s"
    assert views.age("2026-11-23T11:48:00Z", NOW) == "12m"
    assert views.age("2026-11-23T09:00:00Z", NOW) == "3h"
    assert views.age("2026-11-18T12:00:00Z", NOW) == "5d"
    assert views.age(None, NOW) == "<unknown>"


def test_nodes_table_counts_allocated_free_and_unhealthy_devices() -> None:
    node = _node("gpu-a", 4, unhealthy=3)
    out = views.format_nodes([node], {_uuid(0): "ns/c"}, NOW)
    header, row = out.splitlines()
    assert header.split()[:7] == ["NODE", "GPUS", "HEALTHY", "ALLOCATED", "FREE", "MIG", "SHARED"]
    assert row.split()[:7] == ["gpu-a", "4", "3", "1", "2", "-", "-"]
    assert "[0,1]" in row and "30s" in row


def test_nodes_table_counts_a_gpu_with_a_held_mig_instance_allocated_and_its_free_instances() -> None:
    node = _node("gpu-m", 3)
    instances = tuple(
        models.MigDevice(index=j, uuid=f"MIG-0000000{j}-0000-0000-0000-000000000000", profile="1g.5gb")
        for j in range(4)
    )
    split = dataclasses.replace(node.status.devices[0], mig=models.MigInfo(enabled=True, devices=instances))
    node = dataclasses.replace(
        node, status=dataclasses.replace(node.status, devices=(split, *node.status.devices[1:]))
    )
    out = views.format_nodes([node], {instances[2].uuid: "ns/small", _uuid(1): "ns/whole"}, NOW)
    row = out.splitlines()[1].split()
    # GPU 0 (split, one instance held) and GPU 1 (whole) allocated; GPU 2 free; 3 of 4 instances open.
    assert row[:6] == ["gpu-m", "3", "3", "2", "1", "3/4"]


def test_nodes_table_shows_the_slots_in_use_of_shared_gpus_and_counts_them_allocated() -> None:
    node = _node("gpu-s", 3)
    offered = models.DeviceSharing(strategy="MPS", replicas=4)
    shared = tuple(dataclasses.replace(d, sharing=offered) for d in node.status.devices[:2])
    node = dataclasses.replace(
        node, status=dataclasses.replace(node.status, devices=(*shared, node.status.devices[2]))
    )
    held = {constants.slot_id(_uuid(0), 0): "ns/a", constants.slot_id(_uuid(0), 3): "ns/b"}
    row = views.format_nodes([node], held, NOW).splitlines()[1].split()
    # GPU 0 (two slots held) allocated; GPU 2 the only whole GPU, free; 2 of 8 slots in use.
    assert row[:7] == ["gpu-s", "3", "3", "1", "1", "-", "2/8"]


def test_nodes_table_shows_the_milli_gpu_used_of_each_gpu_holding_shares() -> None:
    node = _node("gpu-f", 3)
    claims = [
        models.GpuClaim(
            metadata=models.ObjectMeta(name=name, namespace="ns"),
            spec=models.GpuClaimSpec(
                devices=models.DeviceRequest(
                    count=1, exclusivity="Shared", sharing=models.SharingRequest(milli=m)
                )
            ),
            status=models.GpuClaimStatus(
                phase="Allocated",
                allocations=(
                    models.Allocation(
                        replica=0,
                        node_name="gpu-f",
                        devices=(models.DeviceRef(index=i, minor=i, uuid=_uuid(i), milli=m),),
                    ),
                ),
            ),
        )
        for name, i, m in (("a", 0, 600), ("b", 0, 400), ("c", 2, 250))
    ]
    out = views.format_nodes([node], views.allocated_uuids(claims), NOW, shares=views.allocated_milli(claims))
    header, row = out.splitlines()
    assert header.split()[7] == "MILLI"
    # GPUs 0 (full) and 2 (a quarter) hold shares and are not free for a whole claim; GPU 1 is.
    assert row.split()[:8] == ["gpu-f", "3", "3", "2", "1", "-", "-", "0:1000,2:250"]


def test_claims_table_shows_reason_only_while_not_allocated() -> None:
    spec = models.GpuClaimSpec(devices=models.DeviceRequest(count=4), replicas=2)
    pending = models.GpuClaim(
        metadata=models.ObjectMeta(name="big", namespace="ml", creation_timestamp="2026-11-23T11:58:00Z"),
        spec=spec,
        status=models.GpuClaimStatus(phase="Pending", message="0/3 nodes fit: 3 have fewer than 4 free GPUs"),
    )
    allocated = models.GpuClaim(
        metadata=models.ObjectMeta(name="ok", namespace="ml", creation_timestamp="2026-11-23T11:58:00Z"),
        spec=spec,
        status=models.GpuClaimStatus(phase="Allocated", nodes="gpu-a", devices="0,1", message="allocated"),
    )
    out = views.format_claims([pending, allocated], NOW, all_namespaces=True).splitlines()
    assert out[0].split()[0] == "NAMESPACE"
    assert "2x4" in out[1] and "0/3 nodes fit" in out[1]
    assert out[2].split()[:6] == ["ml", "ok", "2x4", "Allocated", "gpu-a", "0,1"]
    assert "allocated" not in out[2].split()[6:]


def test_topology_matrix_is_symmetric_with_self_on_the_diagonal() -> None:
    out = views.format_topology(_node("gpu-a", 3)).splitlines()
    assert out[0].split() == ["GPU0", "GPU1", "GPU2", "NUMA", "Affinity"]
    assert out[1].split() == ["GPU0", "X", "NV18", "SYS", "0"]
    assert out[2].split() == ["GPU1", "NV18", "X", "SYS", "0"]
    assert out[3].split() == ["GPU2", "SYS", "SYS", "X", "0"]
    assert "  [0,1]: 900" in out


# A GpuQuota as the API server returns it (the controller has written its status).
QUOTA = {
    "apiVersion": "gpu.scheduling/v1",
    "kind": "GpuQuota",
    "metadata": {"name": "default", "namespace": "ml", "uid": "q1", "resourceVersion": "7"},
    "spec": {"gpus": 8, "maxPriority": 100, "products": [{"pattern": "*H100*", "gpus": 4}]},
    "status": {
        "used": 6,
        "usedByProduct": {"*H100*": 4},
        "claims": {
            "c1": {"name": "train", "gpus": 4, "product": "NVIDIA H100 80GB HBM3"},
            "c2": {"name": "eval", "gpus": 2, "product": "NVIDIA A100-SXM4-80GB"},
        },
    },
}


def test_quotas_table_shows_used_hard_and_cap_then_a_row_per_product_limit() -> None:
    new = {"metadata": {"name": "burst", "namespace": "ml"}, "spec": {"gpus": 2}}  # no status yet
    quotas = [codecs.parse_quota(new), codecs.parse_quota(QUOTA)]
    out = views.format_quotas(quotas, all_namespaces=True).splitlines()
    assert out[0].split() == ["NAMESPACE", "NAME", "USED", "HARD", "MAX-PRIORITY"]
    assert out[1].split() == ["ml", "burst", "0", "2", "-"]
    assert out[2].split() == ["ml", "default", "6", "8", "100"]
    assert out[3].split() == ["*H100*", "4", "4"]
    assert out[3].index("*H100*") > out[2].index("default")  # indented under its quota
    one_namespace = views.format_quotas(quotas, all_namespaces=False).splitlines()
    assert one_namespace[0].split() == ["NAME", "USED", "HARD", "MAX-PRIORITY"]
    assert one_namespace[2].split() == ["default", "6", "8", "100"]


def test_quotas_table_shows_used_above_hard_as_it_is() -> None:
    # Claims Allocated before the quota existed are entered without a check.
    over = codecs.parse_quota({**QUOTA, "status": {"used": 10}})
    (_, row, product) = views.format_quotas([over], all_namespaces=False).splitlines()
    assert row.split() == ["default", "10", "8", "100"]
    assert product.split() == ["*H100*", "0", "4"]


class FakeFetch:
    """``views.fetch`` answering ``answer`` and keeping what each call asked for."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer
        self.asked: list[Mapping[str, str | None]] = []

    async def __call__(self, kubeconfig: str | None, lists: Mapping[str, str | None]) -> dict[str, Any]:
        self.asked.append(lists)
        return self.answer


@pytest.mark.parametrize(
    ("argv", "namespace"),
    [(["quota", "-n", "ml"], "ml"), (["quotas", "-A"], None), (["quota"], "default")],
)
def test_get_quota_lists_the_quotas_of_a_namespace_or_all(
    argv: list[str],
    namespace: str | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fetch = FakeFetch({"quotas": [QUOTA]})
    monkeypatch.setattr(views, "fetch", fetch)
    assert views.get_main(argv) == 0
    assert fetch.asked == [{"quotas": namespace}]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[0] == ("NAMESPACE" if namespace is None else "NAME")
    assert "default" in lines[1].split() and "*H100*" in lines[2]


def test_get_quota_says_so_when_there_is_none(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(views, "fetch", FakeFetch({"quotas": []}))
    assert views.get_main(["quota", "-n", "ml"]) == 0
    assert capsys.readouterr().out == "No GpuQuotas found in namespace ml.\n"


def test_get_nodes_reads_every_status_and_claim_and_lists_the_nodes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fetch = FakeFetch({"statuses": [codecs.encode(_node("node-a", 4))], "claims": [], "heartbeats": []})
    monkeypatch.setattr(views, "fetch", fetch)
    assert views.get_main(["nodes"]) == 0
    assert fetch.asked == [{"statuses": None, "claims": None, "heartbeats": "gpualloc-system-heartbeats"}]
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "node-a"


def test_the_latest_heartbeat_is_the_lease_renewal_or_the_status_write_whichever_is_later() -> None:
    a, b = _node("node-a", 1), _node("node-b", 1)  # status heartbeats 11:59:30
    renewed = leases.heartbeat_lease("hb", node="node-a", now=NOW - dt.timedelta(seconds=5))
    stale = leases.heartbeat_lease("hb", node="node-b", now=NOW - dt.timedelta(hours=1))
    beats = views.latest_heartbeats([a, b], [renewed, stale])
    assert beats == {"node-a": "2026-11-23T11:59:55.000000Z", "node-b": "2026-11-23T11:59:30Z"}
    rows = views.format_nodes([a, b], {}, NOW, beats).splitlines()
    assert rows[1].split()[-1] == "5s" and rows[2].split()[-1] == "30s"


def test_topo_reads_every_status_and_prints_the_named_nodes_matrix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fetch = FakeFetch({"statuses": [codecs.encode(_node("node-a", 2)), codecs.encode(_node("node-b", 4))]})
    monkeypatch.setattr(views, "fetch", fetch)
    assert views.topo_main(["node-b"]) == 0
    assert fetch.asked == [{"statuses": None}]
    assert capsys.readouterr().out == views.format_topology(_node("node-b", 4)) + "\n"
