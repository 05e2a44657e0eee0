"""`gpualloc simulate`: the pure decision on a snapshot, and reading the claim file."""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path

import pytest

from controller import simulating
from controller import views as node_views
from gpualloc.api import models
from tests.unit.test_controller_pure import status

NOW = dt.datetime(2026, 11, 27, 12, 0, 0, tzinfo=dt.UTC)
READY = models.Condition(type="Ready", status="True", reason="Heartbeat")
H100 = "NVIDIA H100 80GB HBM3"


def _node(name: str, n: int = 8, product: str = H100) -> models.GpuNodeStatus:
    devices = tuple(
        models.Device(
            index=i, minor=i, uuid=f"GPU-{name}-{i:04d}", product=product, memory_mib=81920, numa_node=0
        )
        for i in range(n)
    )
    links = tuple(
        models.Link(a=a, b=b, type="NV18", nvlinks=18, bandwidth_gbps=900)
        for a in range(n)
        for b in range(a + 1, n)
    )
    inv = models.NodeInventory(
        devices=devices,
        links=links,
        islands=(tuple(range(n)),),
        total=n,
        healthy=n,
        last_heartbeat_time="2026-11-27T11:59:50Z",
        conditions=(READY,),
    )
    return status(name, inv)


def _claim(
    name: str, count: int, *, namespace: str = "team", priority: int = 0, **spec: object
) -> models.GpuClaim:
    return models.GpuClaim(
        metadata=models.ObjectMeta(name=name, namespace=namespace, uid=f"uid-{name}"),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=count), priority=priority, **spec),  # type: ignore[arg-type]
    )


def _holding(claim: models.GpuClaim, node: models.GpuNodeStatus, indices: range) -> models.GpuClaim:
    refs = tuple(models.DeviceRef(index=i, minor=i, uuid=node.status.devices[i].uuid) for i in indices)
    status = models.GpuClaimStatus(
        phase="Allocated",
        allocations=(models.Allocation(replica=0, node_name=node.spec.node_name, devices=refs),),
    )
    return dataclasses.replace(claim, status=status)


def _quota(gpus: int, *, namespace: str = "team", **spec: object) -> models.GpuQuota:
    return models.GpuQuota(
        metadata=models.ObjectMeta(name="q", namespace=namespace),
        spec=models.GpuQuotaSpec(gpus=gpus, **spec),  # type: ignore[arg-type]
    )


def _snapshot(
    statuses: list[models.GpuNodeStatus],
    claims: list[models.GpuClaim] | None = None,
    quotas: list[models.GpuQuota] | None = None,
    facts: dict[str, node_views.NodeFacts] | None = None,
) -> simulating.Snapshot:
    nodes = {
        s.spec.node_name: node_views.NodeFacts(name=s.spec.node_name, labels={}, unschedulable=False)
        for s in statuses
    }
    nodes.update(facts or {})
    return simulating.Snapshot(
        claims=claims or [],
        statuses={s.spec.node_name: s for s in statuses},
        nodes=nodes,
        quotas=quotas or [],
        now=NOW,
    )


def test_a_claim_that_fits_lands_on_free_gpus_and_never_on_held_ones() -> None:
    a = _node("node-a")
    held = _holding(_claim("held", 6), a, range(6))
    outcome = simulating.simulate(_claim("new", 2), _snapshot([a], [held]))
    assert outcome.fits and not outcome.reason
    (allocation,) = outcome.landed[0]
    assert allocation.node_name == "node-a"
    assert sorted(d.index for d in allocation.devices) == [6, 7]


def test_count_places_copies_one_after_another_and_says_why_the_next_does_not_fit() -> None:
    a, b = _node("node-a"), _node("node-b")
    held = _holding(_claim("held", 6), a, range(6))
    outcome = simulating.simulate(_claim("new", 4), _snapshot([a, b], [held]), count=5)
    assert len(outcome.landed) == 2  # node-a has 2 free GPUs, node-b twice 4
    used = [d.uuid for copy in outcome.landed for alloc in copy for d in alloc.devices]
    assert len(used) == len(set(used)) == 8
    assert {alloc.node_name for copy in outcome.landed for alloc in copy} == {"node-b"}
    assert outcome.reason and outcome.per_node
    assert "node-a" in outcome.per_node and "node-b" in outcome.per_node


def test_count_stops_when_the_quota_is_full_and_names_the_quota() -> None:
    a = _node("node-a")
    outcome = simulating.simulate(_claim("new", 2), _snapshot([a], quotas=[_quota(5)]), count=4)
    assert len(outcome.landed) == 2  # 2 + 2 of 5; the third would make 6
    assert outcome.quota == "namespace team would use 6 of 5 GPUs (quota team/q)"
    assert "held back by its quota" in outcome.reason


def test_max_claims_counts_the_namespaces_claims_and_each_copy_as_the_newest() -> None:
    a = _node("node-a")
    mine = [_claim("one", 1), _claim("two", 1), _claim("theirs", 1, namespace="other")]
    outcome = simulating.simulate(_claim("new", 1), _snapshot([a], mine, [_quota(8, max_claims=3)]), count=4)
    assert len(outcome.landed) == 1
    assert outcome.quota.startswith("namespace team has 4 GpuClaims and GpuQuota q allows 3 (spec.maxClaims)")


def test_a_quota_that_holds_the_first_claim_back_means_it_does_not_fit() -> None:
    a = _node("node-a")
    mine = _holding(_claim("mine", 3), a, range(3))
    quota = _quota(4)
    quota = dataclasses.replace(
        quota,
        status=models.GpuQuotaStatus(
            used=3, claims={"uid-mine": models.QuotaEntry(name="mine", gpus=3, product=H100)}
        ),
    )
    outcome = simulating.simulate(_claim("new", 2), _snapshot([a], [mine], [quota]))
    assert not outcome.fits
    assert outcome.quota == "namespace team would use 5 of 4 GPUs (quota team/q)"


def test_it_names_the_lower_priority_claims_it_would_preempt_in_its_namespace() -> None:
    a = _node("node-a")
    low = _holding(_claim("low", 4, priority=1), a, range(4))
    other = _holding(_claim("other", 4, namespace="elsewhere"), a, range(4, 8))
    outcome = simulating.simulate(_claim("new", 4, priority=5), _snapshot([a], [low, other]))
    assert not outcome.fits
    assert [v.key for v in outcome.victims] == ["team/low"]
    assert "preempting team/low (4 GPUs, priority 1)" in outcome.preemption
    assert "--preemption-scope Namespace" in outcome.preemption


def test_namespace_scope_preempts_no_other_namespace_but_cluster_scope_may() -> None:
    a = _node("node-a", n=4)
    other = _holding(_claim("other", 4, namespace="elsewhere"), a, range(4))
    snapshot = _snapshot([a], [other])
    new = _claim("new", 4, priority=5)
    assert simulating.simulate(new, snapshot).victims == ()
    wide = simulating.simulate(new, snapshot, cluster_scope=True)
    assert [v.key for v in wide.victims] == ["elsewhere/other"]


def test_the_namespace_priority_cap_keeps_it_from_preempting_what_its_priority_would() -> None:
    a = _node("node-a", n=4)
    low = _holding(_claim("low", 4, priority=1), a, range(4))
    outcome = simulating.simulate(
        _claim("new", 4, priority=9), _snapshot([a], [low], [_quota(8, max_priority=1)])
    )
    assert outcome.victims == ()
    assert outcome.preemption.startswith("none: no claim of lower priority")


def test_a_claim_that_never_preempts_says_so() -> None:
    a = _node("node-a", n=4)
    low = _holding(_claim("low", 4, priority=1), a, range(4))
    new = _claim("new", 4, priority=9, preemption_policy="Never")
    outcome = simulating.simulate(new, _snapshot([a], [low]))
    assert outcome.victims == () and outcome.preemption == "none: its preemptionPolicy is Never"


def test_a_toleration_its_quotas_do_not_allow_is_named_as_what_holds_it_back() -> None:
    a = _node("node-a")
    taint = models.Taint(key="pool", value="research", effect="NoSchedule")
    tainted = node_views.NodeFacts(name="node-a", labels={}, unschedulable=False, taints=(taint,))
    toleration = models.Toleration(key="pool", operator="Equal", value="research", effect="NoSchedule")
    new = _claim("new", 1, tolerations=(toleration,))
    refused = simulating.simulate(new, _snapshot([a], quotas=[_quota(8)], facts={"node-a": tainted}))
    assert not refused.fits
    assert "toleration pool=research:NoSchedule is not allowed in namespace team" in refused.taint
    allowed = _quota(8, allowed_tolerations=(toleration,))
    assert simulating.simulate(new, _snapshot([a], quotas=[allowed], facts={"node-a": tainted})).fits


def test_the_text_report_says_where_it_lands_and_what_was_not_counted() -> None:
    a = _node("node-a")
    snapshot = dataclasses.replace(_snapshot([a]), unseen=("GpuClaims outside namespace team",))
    claim = _claim("new", 2)
    text = simulating.render_text(claim, simulating.simulate(claim, snapshot), snapshot)
    assert "Claim team/new (simulated: nothing was written)" in text
    assert (
        "replica 0: would land on node-a [gpu-0/GPU-node-a-0000, gpu-1/GPU-node-a-0001] least 900 GB/s"
        in text
    )
    assert "not counted: GpuClaims outside namespace team" in text
    data = simulating.render_json(claim, simulating.simulate(claim, snapshot, count=9), snapshot)
    assert data["fits"] == 4 and data["asked"] == 9 and data["reason"]
    assert data["landed"][0][0]["nodeName"] == "node-a"


def test_a_large_cluster_groups_nodes_that_share_a_verdict() -> None:
    statuses = [_node(f"node-{i:03d}", n=2) for i in range(60)]
    claim = _claim("new", 4)
    snapshot = _snapshot(statuses)
    outcome = simulating.simulate(claim, snapshot)
    assert not outcome.fits
    text = simulating.render_text(claim, outcome, snapshot)
    assert "(60 nodes)" in text and "node-001" not in text


def test_pending_claims_of_equal_or_higher_priority_are_named_as_coming_first() -> None:
    a = _node("node-a")
    waiting = [_claim("urgent", 8, priority=5), _claim("peer", 8), _claim("later", 8, priority=-1)]
    failed = dataclasses.replace(_claim("gone", 8, priority=9), status=models.GpuClaimStatus(phase="Failed"))
    snapshot = _snapshot([a], [*waiting, failed])
    claim = _claim("new", 2)
    outcome = simulating.simulate(claim, snapshot)
    assert outcome.fits and outcome.ahead == ("team/urgent", "team/peer")
    text = simulating.render_text(claim, outcome, snapshot)
    assert "queue:   2 pending claims come first and were not placed: team/urgent, team/peer" in text


CLAIM_YAML = """
apiVersion: gpu.scheduling/v1
kind: GpuClaim
metadata: {name: train, namespace: ml}
spec:
  devices: {count: 2}
"""


def test_read_claim_takes_the_namespace_flag_over_the_file() -> None:
    assert simulating.read_claim(CLAIM_YAML, None).key == "ml/train"
    assert simulating.read_claim(CLAIM_YAML, "other").key == "other/train"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("kind: Pod\n", "not a GpuClaim"),
        ("- a\n", "not a mapping"),
        (CLAIM_YAML.replace("count: 2", "count: 0"), "devices.count must be at least 1"),
        (CLAIM_YAML.replace("count: 2", "count: two"), "spec.devices.count"),
        (CLAIM_YAML + "  replicas: 0\n", "replicas must be at least 1"),
    ],
)
def test_read_claim_refuses_what_the_controller_would(text: str, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        simulating.read_claim(text, None)


def test_bad_input_exits_2_before_reaching_any_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "claim.yaml"
    path.write_text(CLAIM_YAML.replace("count: 2", "count: 0"))
    assert simulating.main(["-f", str(path), "--kubeconfig", str(tmp_path / "absent")]) == 2
    assert "devices.count must be at least 1" in capsys.readouterr().err
    assert simulating.main(["-f", str(tmp_path / "missing.yaml")]) == 2
