"""The people-facing tables: node summary, claim list, topology matrix."""

from __future__ import annotations

import datetime as dt

from gpualloc import views
from gpualloc.api import models

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
    return models.GpuNodeStatus(
        metadata=models.ObjectMeta(name=name), spec=models.GpuNodeStatusSpec(node_name=name), status=inv
    )


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
    assert header.split()[:5] == ["NODE", "GPUS", "HEALTHY", "ALLOCATED", "FREE"]
    assert row.split()[:5] == ["gpu-a", "4", "3", "1", "2"]
    assert "[0,1]" in row and "30s" in row


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
