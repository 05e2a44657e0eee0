"""GPU-seconds per claim against the real API server: the controller's counter and `gpualloc get
usage` agree with the device Leases' lifetimes to 1%, across a controller restart."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator

from gpualloc.kube import resources
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration import usage_support as usage

HOLD = 4.0  # seconds the first claims hold their GPUs before one is released
MAX_DRIFT = 0.01


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@contextlib.asynccontextmanager
async def watching(clock: usage.LeaseClock) -> AsyncIterator[None]:
    task = asyncio.create_task(clock.run())
    try:
        await asyncio.wait_for(clock.reflector.synced.wait(), 30)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def scraped(
    port: int, claims: list[usage.ClaimKey], clock: usage.LeaseClock
) -> dict[usage.ClaimKey, float]:
    """Scrape until every claim has a series (a controller just started has to list first); then
    check each against the Leases' lifetimes at the moment of the scrape."""

    async def probe() -> tuple[dt.datetime, dict[usage.ClaimKey, float], dt.datetime] | None:
        before = _now()
        try:
            found = await usage.scrape(port)
        except OSError:
            return None
        return (before, found, _now()) if all(c in found for c in claims) else None

    before, found, after = await support.wait_for(probe, within=30, what=f"series of {claims}")
    for claim in claims:
        low, high = clock.seconds(claim, before), clock.seconds(claim, after)
        assert low * (1 - MAX_DRIFT) <= found[claim] <= high * (1 + MAX_DRIFT), (
            claim,
            found[claim],
            low,
            high,
        )
    return found


async def test_gpu_seconds_follow_the_leases_lifetimes_across_a_controller_restart(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    crs = resources.CustomResources(api)
    clock = usage.LeaseClock(api, namespace)
    first, second = usage.free_port(), usage.free_port()
    done, kept, spanning = (namespace, "done"), (namespace, "kept"), (namespace, "spanning")
    async with watching(clock):
        argv = support.controller_argv(namespace, "--metrics-port", str(first), run=run)
        async with support.running_controller(kubeconfig, argv):
            for name, count in (("done", 2), ("kept", 1), ("spanning", 3)):
                await crs.create_claim(namespace, support.claim_body(name, count, run=run))
            for name in ("done", "kept", "spanning"):
                await support.wait_phase(api, namespace, name, "Allocated")
            await asyncio.sleep(HOLD)
            await crs.delete_claim(namespace, "done")
            await support.wait_for(lambda: clock.released(done), within=30, what="done's Leases deleted")
            assert clock.seconds(done, _now()) >= 2 * HOLD
            before_restart = await scraped(first, [done, kept, spanning], clock)

        # A new controller: what it reports for the Leases still held is their whole lifetime.
        argv = support.controller_argv(namespace, "--metrics-port", str(second), run=run)
        async with support.running_controller(kubeconfig, argv):
            after_restart = await scraped(second, [kept, spanning], clock)
            assert after_restart[kept] >= before_restart[kept]
            assert done not in after_restart  # released before it started: the documented limit

            answer = await usage.usage_cli(kubeconfig, namespace, namespace, "--idle-after", "1s")
            for claim in (kept, spanning):
                assert usage.drift(answer.seconds[claim], clock.seconds(claim, answer.now)) <= MAX_DRIFT
            assert answer.idle == ["kept", "spanning"]  # Allocated, and no pod ever used them

            await crs.delete_claim(namespace, "spanning")
            await support.wait_for(
                lambda: clock.released(spanning), within=30, what="spanning's Leases deleted"
            )
            final = await scraped(second, [spanning], clock)
            assert usage.drift(final[spanning], clock.seconds(spanning, _now())) <= MAX_DRIFT
            await crs.delete_claim(namespace, "kept")
