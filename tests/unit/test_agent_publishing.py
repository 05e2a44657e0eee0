"""The publisher's decisions (what to write, when), against a recording stub of CustomResources.

The stub only records calls and applies merge patches to a dict; what the API
server really does with them is proven in tests/integration/test_agent_apiserver.py.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

import pytest

from agent import inventory, publishing, simulated
from gpualloc.api import codecs, constants, models
from gpualloc.kube import errors

NODE = "gpu-node-1"


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class StubResources:
    def __init__(self) -> None:
        self.obj: dict[str, Any] | None = None
        self.calls: list[tuple[str, Any]] = []
        self.rv = 0
        self.fail_next: list[Exception] = []

    def _bump(self) -> dict[str, Any]:
        assert self.obj is not None
        self.rv += 1
        self.obj["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(self.obj)

    async def get_node_status(self, name: str) -> dict[str, Any]:
        self.calls.append(("get", name))
        if self.obj is None:
            raise errors.NotFound(404, "NotFound", name)
        return copy.deepcopy(self.obj)

    async def create_node_status(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("create", copy.deepcopy(body)))
        self.obj = {k: copy.deepcopy(v) for k, v in body.items() if k != "status"}
        return self._bump()

    async def patch_node_status(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("patch", copy.deepcopy(patch)))
        assert self.obj is not None
        self.obj = _merge(self.obj, {"metadata": patch["metadata"]})
        return self._bump()

    async def patch_node_status_status(
        self, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> dict[str, Any]:
        self.calls.append(("status", (copy.deepcopy(patch), resource_version)))
        if self.fail_next:
            raise self.fail_next.pop(0)
        if self.obj is None:
            raise errors.NotFound(404, "NotFound", name)
        if resource_version is not None and resource_version != self.obj["metadata"]["resourceVersion"]:
            raise errors.Conflict(409, "Conflict", "stale")
        self.obj = _merge(self.obj, {"status": patch["status"]})
        return self._bump()

    def writes(self) -> list[str]:
        return [kind for kind, _ in self.calls if kind in ("create", "patch", "status")]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> dt.datetime:
        return dt.datetime(2026, 11, 23, 12, 0, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=self.t - 1000.0)


NODE_OBJ = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "node-uid-1"}}


def _publisher(
    stub: StubResources,
    clock: Clock,
    node: dict[str, Any] | None = NODE_OBJ,
    renewed: list[dt.datetime] | None = None,
) -> publishing.Publisher:
    """A publisher on ``stub``; with ``renewed``, it renews a heartbeat Lease (recorded there)."""

    async def lookup(name: str) -> dict[str, Any] | None:
        return copy.deepcopy(node) if node else None

    async def renew(now: dt.datetime) -> None:
        assert renewed is not None
        renewed.append(now)

    return publishing.Publisher(
        stub,  # type: ignore[arg-type]
        NODE,
        heartbeat_interval=10.0,
        node_lookup=lookup,
        renew_heartbeat=renew if renewed is not None else None,
        wall_clock=clock.wall,
        monotonic=clock.mono,
    )


def _inventory(unhealthy: dict[str, str] | None = None) -> models.NodeInventory:
    source = simulated.SimulatedSource(simulated.load_profile("a100-pcie-4-nvlink"), NODE)
    inv = inventory.derive(source.scan(), unhealthy=unhealthy)
    conds = publishing.conditions(source="simulated", source_error="", devices=inv.devices)
    return dataclasses.replace(inv, conditions=conds)


async def _published() -> tuple[StubResources, Clock, publishing.Publisher, models.NodeInventory]:
    """A publisher on a stub after its first step: (stub, clock, publisher, the inventory it published)."""
    stub, clock = StubResources(), Clock()
    pub = _publisher(stub, clock)
    inv = _inventory()
    await pub.step(inv)
    return stub, clock, pub, inv


async def _run_until(
    pub: publishing.Publisher, current: Callable[[], models.NodeInventory], done: Callable[[], bool]
) -> None:
    """``pub.run`` until ``done()`` (2 s at most), then cancelled."""
    task = asyncio.create_task(pub.run(current, asyncio.Event()))
    try:
        for _ in range(100):
            if done():
                break
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_first_round_creates_with_owner_reference_then_writes_the_status() -> None:
    stub, clock = StubResources(), Clock()
    pub = _publisher(stub, clock)
    assert await pub.step(_inventory()) == "status"
    kind, body = stub.calls[1]
    assert kind == "create"
    assert body["spec"] == {"nodeName": NODE}
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid-1"}
    ]
    assert stub.writes() == ["create", "status"]
    assert stub.obj is not None
    status = codecs.decode(models.NodeInventory, stub.obj["status"])
    assert status.total == 4 and status.last_heartbeat_time == "2026-11-23T12:00:00Z"
    assert pub.ready()


async def test_missing_node_creates_without_owner_reference_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stub, clock = StubResources(), Clock()
    with caplog.at_level(logging.WARNING):
        await _publisher(stub, clock, node=None).step(_inventory())
    assert "ownerReferences" not in stub.calls[1][1]["metadata"]
    assert any("without an ownerReference" in r.getMessage() for r in caplog.records)


async def test_without_change_the_lease_is_renewed_each_interval_and_the_status_every_tenth() -> None:
    stub, clock, renewed = StubResources(), Clock(), []
    pub = _publisher(stub, clock, renewed=renewed)
    inv = _inventory()
    assert await pub.step(inv) == "status"
    results = []
    for _ in range(200):  # 200 s in 1 s rounds; the interval is 10 s
        clock.t += 1.0
        results.append(await pub.step(inv))
    assert results.count("heartbeat") == 18 and results.count("refresh") == 2, results
    assert results.count("status") == 0
    assert renewed[0] == clock.wall() - dt.timedelta(seconds=190), "the first renewal one interval in"
    refreshes = [body for kind, body in stub.calls if kind == "status"][1:]
    assert [patch["status"]["lastHeartbeatTime"] for patch, _ in refreshes] == [
        "2026-11-23T12:01:40Z",
        "2026-11-23T12:03:20Z",
    ]
    assert all(
        set(patch["status"]) == {"lastHeartbeatTime", "conditions"} and rv is None for patch, rv in refreshes
    )


async def test_without_a_heartbeat_namespace_the_status_carries_every_heartbeat() -> None:
    stub, clock, pub, inv = await _published()
    results = []
    for _ in range(30):  # 30 s in 1 s rounds
        clock.t += 1.0
        results.append(await pub.step(inv))
    assert results.count("refresh") == 3 and results.count("status") == 0
    beat = [body for kind, body in stub.calls if kind == "status"][-1]
    patch, rv = beat
    assert set(patch["status"]) == {"lastHeartbeatTime", "conditions"}
    assert rv is None
    assert patch["status"]["lastHeartbeatTime"] == "2026-11-23T12:00:30Z"


async def test_a_change_is_written_at_once_conditionally_on_the_resource_version() -> None:
    stub, clock, pub, _ = await _published()
    clock.t += 1.0
    uuid = _inventory().devices[2].uuid
    assert await pub.step(_inventory({uuid: "XID 79"})) == "status"
    patch, rv = stub.calls[-1][1]
    assert rv == "2"
    device = patch["status"]["devices"][2]
    assert (device["health"], device["healthReason"]) == ("Unhealthy", "XID 79")
    assert patch["status"]["healthy"] == 3


class PruningStub(StubResources):
    """A server whose GpuNodeStatus CRD predates ``idleSince``: it drops the field from every write."""

    async def patch_node_status_status(
        self, name: str, patch: dict[str, Any], resource_version: str | None = None
    ) -> dict[str, Any]:
        for device in patch["status"].get("devices") or ():
            device.pop("idleSince", None)
        return await super().patch_node_status_status(name, patch, resource_version)


async def test_a_status_the_server_keeps_only_in_part_is_not_rewritten_every_round(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stub, clock = PruningStub(), Clock()
    pub = _publisher(stub, clock, renewed=[])
    base = _inventory()
    idle = tuple(dataclasses.replace(d, idle_since="2026-11-23T11:00:00Z") for d in base.devices)
    inv = dataclasses.replace(base, devices=idle)
    with caplog.at_level(logging.WARNING, logger="agent.publishing"):
        assert await pub.step(inv) == "status"
        results = []
        for _ in range(200):  # 200 s in 1 s rounds, each woken as a scan would
            clock.t += 1.0
            results.append(await pub.step(inv))
    # One rewrite, after the refresh at 100 s (its answer is a new copy), not one per round.
    assert results.count("status") == 1 and results.count("refresh") == 1, results
    assert results.index("status") == results.index("refresh") + 1
    assert [r.getMessage() for r in caplog.records].count(
        "the API server did not keep the whole status: is the GpuNodeStatus CRD older than this agent?"
        " Apply the chart's CRDs (kubectl apply --server-side)"
    ) == 1
    clock.t += 1.0
    uuid = inv.devices[2].uuid
    changed = dataclasses.replace(
        inv,
        devices=tuple(
            dataclasses.replace(d, health="Unhealthy", health_reason="XID 79") if d.uuid == uuid else d
            for d in inv.devices
        ),
    )
    assert await pub.step(changed) == "status"  # a real change is still written at once


async def test_condition_transition_time_holds_while_its_status_holds() -> None:
    stub, clock, pub, _ = await _published()
    clock.t += 100.0
    await pub.step(_inventory({_inventory().devices[0].uuid: "XID 79"}))  # Ready message changes, not status
    assert stub.obj is not None
    ready = next(c for c in stub.obj["status"]["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == "2026-11-23T12:00:00Z"
    assert ready["message"] == "4 devices, 3 healthy"
    failing = dataclasses.replace(
        _inventory(),
        conditions=publishing.conditions(source="nvml", source_error="nvmlInit failed", devices=()),
    )
    clock.t += 5.0
    await pub.step(failing)
    ready = next(c for c in stub.obj["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["lastTransitionTime"]) == ("False", "2026-11-23T12:01:45Z")


async def test_someone_elses_status_change_is_undone_at_the_next_round() -> None:
    stub, clock, pub, inv = await _published()
    clock.t += 10.0
    assert stub.obj is not None
    stub.obj["status"]["total"] = 99  # a heartbeat response shows the foreign write
    await pub.step(inv)
    clock.t += 1.0
    assert await pub.step(inv) == "status"
    assert stub.obj["status"]["total"] == 4


async def test_keys_the_new_status_lacks_are_nulled_in_the_patch() -> None:
    stub, _, pub, _ = await _published()
    assert stub.obj is not None
    stub.obj["status"]["legacyField"] = "x"
    pub.server = copy.deepcopy(stub.obj)
    pub.server["status"]["total"] = 0  # force a full write
    await pub.step(_inventory())
    patch, _ = stub.calls[-1][1]
    assert patch["status"]["legacyField"] is None
    assert "legacyField" not in stub.obj["status"]


async def test_existing_object_gets_its_missing_owner_reference() -> None:
    stub, clock = StubResources(), Clock()
    await _publisher(stub, clock, node=None).step(_inventory())
    await _publisher(stub, clock).step(_inventory())  # a restarted agent; the Node exists now
    assert stub.obj is not None
    assert stub.obj["metadata"]["ownerReferences"][0]["uid"] == "node-uid-1"


async def test_run_rereads_after_a_conflict_and_retries_after_unavailable() -> None:
    stub, clock, pub, inv = await _published()
    clock.t += 1.0
    stub.fail_next = [
        errors.Unavailable(503, "ServiceUnavailable", "restarting"),
        errors.Conflict(409, "Conflict", "x"),
    ]
    changed = _inventory({inv.devices[1].uuid: "XID 79"})
    await _run_until(pub, lambda: changed, lambda: bool(stub.obj and stub.obj["status"]["healthy"] == 3))
    assert stub.obj is not None and stub.obj["status"]["healthy"] == 3
    assert pub.errors == 2
    gets_after_conflict = [k for k, _ in stub.calls[3:] if k == "get"]
    assert gets_after_conflict  # the Conflict dropped the copy and it was read again


async def test_run_recreates_the_object_when_it_was_deleted() -> None:
    stub, clock, pub, inv = await _published()
    stub.obj = None  # deleted behind the agent's back
    clock.t += 10.0
    await _run_until(pub, lambda: inv, lambda: stub.obj is not None and "status" in stub.obj)
    assert stub.writes().count("create") == 2
    assert stub.obj is not None and stub.obj["status"]["total"] == 4


def test_status_differs_ignores_heartbeat_and_transition_times() -> None:
    inv = _inventory()
    stamped = dataclasses.replace(
        inv,
        last_heartbeat_time="2026-01-01T00:00:00Z",
        conditions=tuple(
            dataclasses.replace(c, last_transition_time="2026-01-01T00:00:00Z") for c in inv.conditions
        ),
    )
    assert not publishing.status_differs(codecs.encode(stamped), inv)
    assert publishing.status_differs(codecs.encode(dataclasses.replace(stamped, allocated=1)), inv)
    assert publishing.status_differs({}, inv)
    assert publishing.status_differs({"devices": "junk"}, inv)


def test_conditions_report_nvml_errors_and_lost_devices() -> None:
    conds = {
        c.type: c
        for c in publishing.conditions(
            source="nvml", source_error="NVML Shared Library Not Found", devices=()
        )
    }
    assert (conds["Ready"].status, conds["Ready"].reason) == ("False", "SourceUnavailable")
    assert (conds[constants.CONDITION_NVML_READY].status, conds[constants.CONDITION_NVML_READY].message) == (
        "False",
        "NVML Shared Library Not Found",
    )
    lost = models.Device(
        index=3, minor=3, uuid="GPU-x", health="Unhealthy", health_reason="lost: GPU is lost"
    )
    conds = {c.type: c for c in publishing.conditions(source="simulated", source_error="", devices=(lost,))}
    assert constants.CONDITION_NVML_READY not in conds
    assert conds[constants.CONDITION_DEVICES_LOST].status == "True"
    assert conds[constants.CONDITION_DEVICES_LOST].message == "gpu-3/GPU-x: lost: GPU is lost"


def test_node_labels_are_gfd_style_and_valid_label_values() -> None:
    labels = publishing.node_labels(_inventory())
    assert labels == {
        "gpu.scheduling/gpu.count": "4",
        "gpu.scheduling/gpu.product": "NVIDIA-A100-80GB-PCIe",
        "gpu.scheduling/gpu.memory": "81920",
    }
    assert publishing.sanitize_label_value("  weird/name (rev 2) ") == "weird-name-rev-2"
    assert len(publishing.sanitize_label_value("x" * 100)) == 63
