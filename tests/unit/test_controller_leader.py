"""Leader election's own rules that need no API server (the rest: tests/integration)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from controller import leader


async def test_a_leader_whose_renewal_hangs_steps_down_at_the_renew_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race test's resumed leader: its renewal stuck on a half-open connection must not keep
    it leading past the renew deadline (here 0.3 s), whatever the client's own timeout."""
    record = {"metadata": {"resourceVersion": "1"}, "spec": {"holderIdentity": "me"}}

    async def created(*_: Any, **__: Any) -> dict[str, Any]:
        return record

    async def not_found(*_: Any, **__: Any) -> dict[str, Any]:
        raise leader.errors.NotFound("no lease")

    async def hangs(*_: Any, **__: Any) -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    monkeypatch.setattr(leader.leases, "get_lease", not_found)
    monkeypatch.setattr(leader.leases, "create_lease", created)
    monkeypatch.setattr(leader.leases, "replace_lease", hangs)
    elector = leader.LeaderElector(
        None,  # type: ignore[arg-type]
        namespace="ns",
        name="lease",
        identity="me",
        lease_duration=1.0,
        renew_deadline=0.3,
        retry_period=0.05,
    )
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(elector.run(), timeout=5)
    assert elector.lost.is_set() and not elector.leading.is_set()
    assert asyncio.get_running_loop().time() - started < 1.0
