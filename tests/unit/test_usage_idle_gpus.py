"""`gpualloc get usage --idle-after`: the allocated GPUs their agents have seen no process on
(gpualloc.usage.idle_gpus, and the table and JSON of gpualloc.usage_view)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest

from gpualloc import usage, usage_view, views
from gpualloc.api import codecs, constants, models
from tests.unit.test_controller_pure import status

NOW = dt.datetime(2026, 11, 27, 12, 0, 0, tzinfo=dt.UTC)
THIRTY_MINUTES = dt.timedelta(minutes=30)


def _uuid(n: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{n:012d}"


MIG = "MIG-11111111-0000-0000-0000-000000000000"


def _gpu(index: int, idle_since: str | None, **kw: Any) -> models.Device:
    return models.Device(index=index, minor=index, uuid=_uuid(index), idle_since=idle_since, **kw)


def _node(name: str, *devices: models.Device) -> models.GpuNodeStatus:
    return status(name, models.NodeInventory(devices=devices, total=len(devices)))


def _claim(
    name: str, *refs: tuple[str, models.DeviceRef], scheduled: str, phase: str = constants.PHASE_ALLOCATED
) -> models.GpuClaim:
    by_node: dict[str, list[models.DeviceRef]] = {}
    for node, ref in refs:
        by_node.setdefault(node, []).append(ref)
    allocations = tuple(
        models.Allocation(replica=i, node_name=node, devices=tuple(devs))
        for i, (node, devs) in enumerate(sorted(by_node.items()))
    )
    return models.GpuClaim(
        metadata=models.ObjectMeta(name=name, namespace="ml"),
        spec=models.GpuClaimSpec(devices=models.DeviceRequest(count=len(refs))),
        status=models.GpuClaimStatus(phase=phase, allocations=allocations, last_schedule_time=scheduled),
    )


def _ref(index: int, *, uuid: str = "", slot: int | None = None) -> models.DeviceRef:
    return models.DeviceRef(index=index, minor=index, uuid=uuid or _uuid(index), slot=slot)


NODES = [
    _node(
        "gpu-a",
        _gpu(0, "2026-11-27T08:00:00Z"),  # idle long before anyone's allocation
        _gpu(1, None),  # a process runs on it
        _gpu(2, "2026-11-27T11:45:00Z"),  # its last process went 15 minutes ago
        _gpu(
            3,
            "2026-11-27T10:00:00Z",
            mig=models.MigInfo(
                enabled=True, devices=(models.MigDevice(index=0, uuid=MIG, profile="1g.10gb"),)
            ),
        ),
        _gpu(4, "2026-11-27T10:00:00Z", sharing=models.DeviceSharing(strategy="TimeSlicing", replicas=2)),
    ),
    _node("gpu-b", _gpu(5, "2026-11-27T09:00:00Z")),
]


def _idle(*claims: models.GpuClaim, after: dt.timedelta = THIRTY_MINUTES) -> list[tuple[str, str, int, str]]:
    found = usage.idle_gpus(claims, NODES, NOW, idle_after=after)
    return [(g.claim, g.node, g.index, g.idle_since.isoformat()) for g in found]


def test_only_gpus_without_a_process_for_idle_after_are_listed() -> None:
    claim = _claim(
        "train",
        ("gpu-a", _ref(0)),
        ("gpu-a", _ref(1)),
        ("gpu-a", _ref(2)),
        ("gpu-b", _ref(5)),
        scheduled="2026-11-27T09:30:00Z",
    )
    assert _idle(claim) == [
        ("train", "gpu-a", 0, "2026-11-27T09:30:00+00:00"),  # idle for the claim since it got it
        ("train", "gpu-b", 5, "2026-11-27T09:30:00+00:00"),
    ]
    assert [g[2] for g in _idle(claim, after=dt.timedelta(minutes=10))] == [0, 2, 5]


def test_a_gpu_idle_before_a_recent_allocation_is_not_idle_for_the_new_claim() -> None:
    claim = _claim("fresh", ("gpu-a", _ref(0)), scheduled="2026-11-27T11:50:00Z")
    assert _idle(claim) == []


def test_a_mig_instance_and_a_slot_are_reported_as_their_gpu() -> None:
    mig = _claim("mig", ("gpu-a", _ref(3, uuid=MIG)), scheduled="2026-11-27T10:00:00Z")
    shared = _claim("shared", ("gpu-a", _ref(4, slot=1)), scheduled="2026-11-27T10:00:00Z")
    assert _idle(mig, shared) == [
        ("mig", "gpu-a", 3, "2026-11-27T10:00:00+00:00"),
        ("shared", "gpu-a", 4, "2026-11-27T10:00:00+00:00"),
    ]


def test_claims_not_allocated_and_gpus_no_status_lists_are_not_idle() -> None:
    released = _claim(
        "done", ("gpu-a", _ref(0)), scheduled="2026-11-27T09:00:00Z", phase=constants.PHASE_RELEASED
    )
    elsewhere = _claim("gone", ("gpu-z", _ref(0)), scheduled="2026-11-27T09:00:00Z")  # no such node
    assert _idle(released, elsewhere) == []


def test_idle_gpus_table_and_json_name_claim_namespace_node_and_gpu() -> None:
    claim = _claim("train", ("gpu-a", _ref(0)), scheduled="2026-11-27T09:00:00Z")
    found = usage.idle_gpus([claim], NODES, NOW, idle_after=THIRTY_MINUTES)
    lines = usage_view.format_idle_gpus(found, NOW, THIRTY_MINUTES).splitlines()
    assert lines[0] == "Allocated GPUs without a process for 30m or more (their agents' idleSince):"
    assert lines[1].split() == ["NAMESPACE", "CLAIM", "NODE", "GPU", "IDLE"]
    assert lines[2].split() == ["ml", "train", "gpu-a", "gpu-0", "3h"]
    none = usage_view.format_idle_gpus([], NOW, dt.timedelta(seconds=90))
    assert none == "No allocated GPU without a process for 1m30s or more."
    out = json.loads(usage_view.as_json([], now=NOW, since=None, idle=[], idle_gpus=found))
    assert out["idleGpus"] == [
        {
            "namespace": "ml",
            "claim": "train",
            "node": "gpu-a",
            "index": 0,
            "uuid": _uuid(0),
            "idleSince": "2026-11-27T09:00:00Z",
        }
    ]


def _run_cli(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    statuses: list[dict[str, Any]] | None,
    *flags: str,
) -> str:
    claim = _claim("train", ("gpu-a", _ref(0)), scheduled="2026-11-27T09:00:00Z")

    async def fetch(kubeconfig: str | None, lists: dict[str, str | None]) -> dict[str, Any]:
        return {"claims": [codecs.encode(claim)], "leases": [], "pods": []}

    monkeypatch.setattr(views, "fetch", fetch)
    monkeypatch.setattr(views, "_now", lambda: NOW)
    monkeypatch.setattr(usage_view, "_statuses", lambda kubeconfig: statuses)
    assert usage_view.main(["-A", *flags]) == 0
    return capsys.readouterr().out


def test_the_cli_lists_idle_gpus_and_says_so_when_it_may_not_list_the_node_statuses(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = [codecs.encode(n) for n in NODES]
    out = json.loads(_run_cli(monkeypatch, capsys, listed, "-o", "json"))
    assert [(g["claim"], g["index"]) for g in out["idleGpus"]] == [("train", 0)]
    assert [c["name"] for c in out["idle"]] == ["train"]  # the pod-based list is still there
    assert json.loads(_run_cli(monkeypatch, capsys, None, "-o", "json"))["idleGpus"] is None
    table = _run_cli(monkeypatch, capsys, None)
    assert "Idle GPUs not shown: you may not list GpuNodeStatuses." in table
    assert "Allocated but idle (no pod running for 30m or more):" in table
