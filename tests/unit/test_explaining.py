"""`gpualloc explain`: a per-node reason for a claim that cannot fit."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Mapping
from typing import Any

import pytest

from controller import explaining, views
from gpualloc import views as cli_views
from gpualloc.api import codecs, leases, models
from tests.unit.test_controller_pure import status

NOW = dt.datetime(2026, 11, 23, 12, 0, 0, tzinfo=dt.UTC)
READY = models.Condition(type="Ready", status="True", reason="Heartbeat")


def _node(
    name: str, product: str, nvlink_pairs: set[tuple[int, int]] | None, n: int = 4
) -> models.GpuNodeStatus:
    devices = tuple(
        models.Device(
            index=i,
            minor=i,
            uuid=f"GPU-{name[-1] * 8}-0000-0000-0000-{i:012x}",
            product=product,
            memory_mib=81920,
            numa_node=0,
        )
        for i in range(n)
    )
    links = []
    for a in range(n):
        for b in range(a + 1, n):
            nv = nvlink_pairs is None or (a, b) in nvlink_pairs
            links.append(
                models.Link(
                    a=a,
                    b=b,
                    type="NV12" if nv else "SYS",
                    nvlinks=12 if nv else 0,
                    bandwidth_gbps=600 if nv else 32,
                )
            )
    inv = models.NodeInventory(
        devices=devices,
        links=tuple(links),
        total=n,
        healthy=n,
        last_heartbeat_time="2026-11-23T11:59:50Z",
        conditions=(READY,),
    )
    return status(name, inv)


def _claim(name: str, uid: str, **devices: object) -> models.GpuClaim:
    spec = models.GpuClaimSpec(
        devices=models.DeviceRequest(count=4, **devices),  # type: ignore[arg-type]
        topology=models.Topology(mode="Required", min_bandwidth_gbps=600),
    )
    return models.GpuClaim(metadata=models.ObjectMeta(name=name, namespace="default", uid=uid), spec=spec)


def _allocated(devices: tuple[models.Device, ...]) -> models.GpuClaimStatus:
    """Allocated on gpu-node-a, holding ``devices``."""
    refs = tuple(models.DeviceRef(index=d.index, minor=d.minor, uuid=d.uuid) for d in devices)
    return models.GpuClaimStatus(
        phase="Allocated", allocations=(models.Allocation(replica=0, node_name="gpu-node-a", devices=refs),)
    )


def test_explain_gives_each_node_its_own_reason() -> None:
    statuses = {
        "gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None),
        "gpu-node-b": _node("gpu-node-b", "NVIDIA A100-PCIE-80GB", {(0, 1), (2, 3)}),
    }
    nodes = {name: views.NodeFacts(name=name, labels={}, unschedulable=False) for name in statuses}
    claim = _claim("a100-quad", "u1", product="NVIDIA A100*")
    out = explaining.explain(claim, claims=[claim], statuses=statuses, nodes=nodes, now=NOW)
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("gpu-node-")}
    assert set(rows) == {"gpu-node-a", "gpu-node-b"}
    assert "A100" in rows["gpu-node-a"]  # no device matches the product glob
    assert "600" in rows["gpu-node-b"]  # bridged pairs only: no 4-set reaches 600 GB/s
    assert rows["gpu-node-a"] != rows["gpu-node-b"]
    assert "0/2 nodes fit" in out


def test_explain_counts_devices_other_claims_hold() -> None:
    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)}
    nodes = {"gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False)}
    holder_devices = statuses["gpu-node-a"].status.devices[:1]
    holder = models.GpuClaim(
        metadata=models.ObjectMeta(name="holder", namespace="default", uid="u0"),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=1)),
        status=_allocated(holder_devices),
    )
    claim = _claim("quad", "u1")
    out = explaining.explain(claim, claims=[holder, claim], statuses=statuses, nodes=nodes, now=NOW)
    assert "would fit" not in out and "0/1 nodes fit" in out
    free = explaining.explain(claim, claims=[claim], statuses=statuses, nodes=nodes, now=NOW)
    assert "would fit" in free


def _sharer(name: str, device: models.Device, milli: int) -> models.GpuClaim:
    ref = models.DeviceRef(index=device.index, minor=device.minor, uuid=device.uuid, milli=milli)
    request = models.DeviceRequest(count=1, exclusivity="Shared", sharing=models.SharingRequest(milli=milli))
    return models.GpuClaim(
        metadata=models.ObjectMeta(name=name, namespace="default", uid=f"u-{name}"),
        spec=models.GpuClaimSpec(devices=request),
        status=models.GpuClaimStatus(
            phase="Allocated",
            allocations=(models.Allocation(replica=0, node_name="gpu-node-a", devices=(ref,)),),
        ),
    )


def test_explain_says_why_a_share_does_not_fit_and_where_one_would() -> None:
    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None, n=2)}
    nodes = {"gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False)}
    gpus = statuses["gpu-node-a"].status.devices
    others = [_sharer("a", gpus[0], 700), _sharer("b", gpus[1], 550)]
    request = models.DeviceRequest(count=1, exclusivity="Shared", sharing=models.SharingRequest(milli=500))
    claim = models.GpuClaim(
        metadata=models.ObjectMeta(name="half", namespace="default", uid="u-half"),
        spec=models.GpuClaimSpec(devices=request),
    )
    out = explaining.explain(claim, claims=[*others, claim], statuses=statuses, nodes=nodes, now=NOW)
    assert "wants:   1 x a share of 500 milli-GPU of one GPU" in out
    assert "0/1 nodes fit: 1 has no GPU with 500 milli-GPU free" in out, out
    assert "2 of 2 GPUs free or shared, the most free has 450 milli-GPU (0 with room); need 500" in out
    fits = explaining.explain(claim, claims=[others[0], claim], statuses=statuses, nodes=nodes, now=NOW)
    assert "would fit" in fits, fits


def test_explain_shows_the_quota_message_of_a_claim_held_back_by_its_quota() -> None:
    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)}
    nodes = {"gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False)}
    message = "namespace ml would use 10 of 8 GPUs (quota ml/default)"
    claim = dataclasses.replace(
        _claim("quad", "u1"), status=models.GpuClaimStatus(phase="Pending", message=message)
    )
    out = explaining.explain(claim, claims=[claim], statuses=statuses, nodes=nodes, now=NOW)
    assert f"  status:  {message}" in out.splitlines()


def test_explain_says_a_claim_that_would_fit_is_held_back_by_its_quota_and_lists_the_quotas() -> None:
    from gpualloc.api import codecs

    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)}
    nodes = {"gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False)}
    claim = _claim("quad", "u1")
    quota = codecs.parse_quota(
        {
            "metadata": {"name": "default", "namespace": "default"},
            "spec": {"gpus": 6},
            "status": {"used": 3, "claims": {"u0": {"name": "other", "gpus": 3, "product": "x"}}},
        }
    )
    out = explaining.explain(
        claim, claims=[claim], statuses=statuses, nodes=nodes, now=NOW, namespace_quotas=[quota]
    )
    assert (
        "  now:     would fit, but is held back by its quota: "
        "namespace default would use 7 of 6 GPUs (quota default/default)"
    ) in out.splitlines()
    assert (
        "default" in out.splitlines()[-1] and " 3 " in out.splitlines()[-1] and " 6 " in out.splitlines()[-1]
    )
    roomy = dataclasses.replace(quota, spec=dataclasses.replace(quota.spec, gpus=8))
    out = explaining.explain(
        claim, claims=[claim], statuses=statuses, nodes=nodes, now=NOW, namespace_quotas=[roomy]
    )
    assert "  now:     would fit" in out.splitlines()


def test_explain_names_whom_a_claim_that_does_not_fit_would_preempt() -> None:
    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)}
    nodes = {"gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False)}
    devices = statuses["gpu-node-a"].status.devices
    holder = dataclasses.replace(
        _claim("low", "u-low"),
        spec=dataclasses.replace(_claim("low", "u-low").spec, priority=1),
        status=_allocated(devices),
    )
    high = _claim("high", "u-high")
    high = dataclasses.replace(high, spec=dataclasses.replace(high.spec, priority=5))
    out = explaining.explain(high, claims=[holder, high], statuses=statuses, nodes=nodes, now=NOW)
    assert "preempt: would be preempting default/low (4 GPUs, priority 1)" in out
    never = dataclasses.replace(high, spec=dataclasses.replace(high.spec, preemption_policy="Never"))
    assert "preempt:" not in explaining.explain(
        never, claims=[holder, never], statuses=statuses, nodes=nodes, now=NOW
    )
    equal = dataclasses.replace(high, spec=dataclasses.replace(high.spec, priority=1))
    out = explaining.explain(equal, claims=[holder, equal], statuses=statuses, nodes=nodes, now=NOW)
    assert "preempt: no claim of lower priority in its namespace frees enough" in out


def test_explain_main_reads_the_claims_statuses_nodes_heartbeat_leases_pods_and_the_namespaces_quotas(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked: list[Mapping[str, str | None]] = []
    claim = _claim("a100-quad", "u1", product="NVIDIA A100*")
    node = _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)
    now = dt.datetime.now(dt.UTC)  # main judges freshness by the clock
    an_hour_ago = (now - dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    node = dataclasses.replace(node, status=dataclasses.replace(node.status, last_heartbeat_time=an_hour_ago))
    lease = leases.heartbeat_lease(cli_views.HEARTBEAT_NAMESPACE, node="gpu-node-a", now=now)

    async def fetch(kubeconfig: str | None, lists: Mapping[str, str | None]) -> dict[str, Any]:
        asked.append(lists)
        return {
            "claims": [codecs.encode(claim)],
            "statuses": [codecs.encode(node)],
            "nodes": [{"metadata": {"name": "gpu-node-a"}, "spec": {}}],
            "quotas": [],
            "heartbeats": [lease] if renewed else [],
            "pods": [],
        }

    monkeypatch.setattr(cli_views, "fetch", fetch)
    renewed = True
    assert explaining.main(["claim", "a100-quad"]) == 0
    assert asked == [
        {
            "claims": None,
            "statuses": None,
            "nodes": None,
            "quotas": "default",
            "heartbeats": "gpualloc-system-heartbeats",
            "pods": None,
        }
    ]
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gpu-node-a"))
    assert "A100" in row  # fresh by its Lease: the node's own reason, no device matches the product glob
    renewed = False  # the status's heartbeat alone is an hour old: not ready
    assert explaining.main(["claim", "a100-quad"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("gpu-node-a"))
    assert "heartbeat stale" in row, row


def _quota(**spec: Any) -> models.GpuQuota:
    return models.GpuQuota(
        metadata=models.ObjectMeta(name="q", namespace="default"), spec=models.GpuQuotaSpec(**spec)
    )


def test_explain_plans_with_only_the_tolerations_the_namespace_allows_and_names_the_refused_one() -> None:
    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)}
    reserved = models.Taint(key="team", value="reserved", effect="NoSchedule")
    nodes = {
        "gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False, taints=(reserved,))
    }
    toleration = models.Toleration(key="team", value="reserved", effect="NoSchedule")
    claim = _claim("c", "u1")
    claim = dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, tolerations=(toleration,)))

    refused = explaining.explain(claim, claims=[claim], statuses=statuses, nodes=nodes, now=NOW)
    now_line = next(line for line in refused.splitlines() if line.startswith("  now:"))
    assert "would fit" not in now_line
    assert "team=reserved:NoSchedule" in now_line and "not allowed in namespace default" in now_line

    allowed = explaining.explain(
        claim,
        claims=[claim],
        statuses=statuses,
        nodes=nodes,
        now=NOW,
        namespace_quotas=[_quota(gpus=8, allowed_tolerations=(toleration,))],
    )
    assert "  now:     would fit" in allowed


def test_explain_shows_no_preemption_for_a_plan_the_quota_would_refuse() -> None:
    statuses = {"gpu-node-a": _node("gpu-node-a", "NVIDIA H100 80GB HBM3", None)}
    nodes = {"gpu-node-a": views.NodeFacts(name="gpu-node-a", labels={}, unschedulable=False)}
    holder = _claim("low", "u-low")
    holder = dataclasses.replace(
        holder,
        status=models.GpuClaimStatus(
            phase="Allocated",
            allocations=(
                models.Allocation(
                    replica=0,
                    node_name="gpu-node-a",
                    devices=tuple(
                        models.DeviceRef(index=d.index, minor=d.minor, uuid=d.uuid)
                        for d in statuses["gpu-node-a"].status.devices
                    ),
                ),
            ),
        ),
    )
    wanting = _claim("high", "u-high")
    wanting = dataclasses.replace(wanting, spec=dataclasses.replace(wanting.spec, priority=5))

    def report(*quotas: models.GpuQuota) -> str:
        out = explaining.explain(
            wanting,
            claims=[holder, wanting],
            statuses=statuses,
            nodes=nodes,
            now=NOW,
            namespace_quotas=quotas,
        )
        return next(line for line in out.splitlines() if line.startswith("  preempt:"))

    assert "would be preempting default/low" in report(_quota(gpus=8))
    no_h100 = _quota(gpus=8, products=(models.ProductLimit(pattern="*H100*", gpus=0),))
    assert "would be preempting" not in report(no_h100), "its quota would refuse it on the H100s"
