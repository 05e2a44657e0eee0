"""The controller's Events: sent in the background, and dropped (counted) past a bound."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from controller import metrics as controller_metrics
from controller import running, settings
from tests.simulation import model


class StuckEvents:
    """A cluster whose event sends never finish until released; nothing else is called."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.release = asyncio.Event()

    async def emit_event(self, obj: Mapping[str, Any], reason: str, message: str, type_: str) -> None:
        await self.release.wait()
        self.sent.append(reason)


async def test_events_past_the_pending_bound_are_dropped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(running, "MAX_PENDING_EVENTS", 3)
    cluster = StuckEvents()
    metrics = controller_metrics.Metrics()
    controller = running.Controller(
        cluster,  # type: ignore[arg-type]
        settings.Settings(namespace="gpu-system"),
        metrics,
        feeds={kind: model.SimFeed(kind) for kind in model.WATCHED},
    )
    claim = {"kind": "GpuClaim", "metadata": {"name": "c", "namespace": "t"}}
    for i in range(5):
        controller._emit(claim, f"Reason{i}", "message")
    assert metrics.registry.get_sample_value("gpualloc_events_dropped_total") == 2
    cluster.release.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert cluster.sent == ["Reason0", "Reason1", "Reason2"]
    # Sent, they no longer count against the bound.
    controller._emit(claim, "Later", "message")
    for _ in range(5):
        await asyncio.sleep(0)
    assert cluster.sent[-1] == "Later"
    assert metrics.registry.get_sample_value("gpualloc_events_dropped_total") == 2
