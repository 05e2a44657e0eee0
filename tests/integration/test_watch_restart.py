"""A Reflector keeps its cache right across a kube-apiserver restart: no change is missed.

The API server is stopped and started again (``control_plane.restart_apiserver``,
run in a thread so the reflector keeps running meanwhile) while claims are
created, modified and deleted: just before the stop, while it is down (the
writes are retried until the server is back, so they land while the reflector
is still reconnecting) and right after. At the end the reflector's cache must
equal a fresh list, object by object and resourceVersion by resourceVersion,
and for every claim ever touched the last event delivered must say its final
state: ADDED/MODIFIED with the final resourceVersion, or DELETED.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from gpualloc.kube import errors, resources, watching
from gpualloc.kube.client import Api
from tests.integration.chaos_support import until_available


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"count": 1}},
    }


async def test_reflector_cache_matches_a_fresh_list_after_an_apiserver_restart(
    control_plane: Any, api: Api, namespace: str
) -> None:
    crs = resources.CustomResources(api)
    for i in range(6):
        await crs.create_claim(namespace, claim(f"c{i}"))

    last: dict[str, tuple[str, str]] = {}
    touched: set[str] = set()

    def on_event(type_: str, obj: dict[str, Any]) -> None:
        last[watching.object_key(obj)] = (type_, obj["metadata"]["resourceVersion"])

    reflector = watching.Reflector(api, watching.CLAIMS, namespace=namespace, on_event=on_event)
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 10)
        assert len(reflector.cache) == 6

        async def create(name: str) -> None:
            touched.add(f"{namespace}/{name}")
            # AlreadyExists: an earlier try landed but its answer was lost.
            with contextlib.suppress(errors.AlreadyExists):
                await crs.create_claim(namespace, claim(name))

        async def set_phase(name: str, message: str) -> None:
            touched.add(f"{namespace}/{name}")
            await crs.patch_claim_status(
                namespace, name, {"status": {"phase": "Pending", "message": message}}
            )

        async def delete(name: str) -> None:
            touched.add(f"{namespace}/{name}")
            try:
                await crs.delete_claim(namespace, name)
            except errors.NotFound as exc:
                if f'"{name}" not found' not in exc.message:  # not the object: the route is not there yet
                    raise

        # Just before the stop: the reflector may or may not see these on its first watch.
        await set_phase("c0", "before")
        await delete("c1")

        started = time.monotonic()
        restart = asyncio.create_task(asyncio.to_thread(control_plane.restart_apiserver))
        await asyncio.sleep(0.2)  # let the stop begin
        deadline = time.monotonic() + 120
        # While it is down and coming back: each write lands as soon as the server answers again.
        for step in (
            lambda: create("c10"),
            lambda: set_phase("c2", "during"),
            lambda: delete("c3"),
            lambda: create("c11"),
            lambda: set_phase("c11", "during"),
            lambda: set_phase("c0", "during"),
        ):
            await until_available(step, within=deadline - time.monotonic(), interval=0.05)
        await restart
        restarted_in = time.monotonic() - started

        # Right after.
        await create("c12")
        await set_phase("c4", "after")
        await delete("c5")
        await delete("c11")
        await set_phase("c10", "after")

        async def converged() -> dict[str, str]:
            listing = await crs.list_claims(namespace)
            return {watching.object_key(o): o["metadata"]["resourceVersion"] for o in listing["items"]}

        fresh: dict[str, str] = {}
        async with asyncio.timeout(30):
            while True:
                fresh = await converged()
                cached = {k: watching.resource_version_of(o) for k, o in reflector.cache.items()}
                if cached == fresh:
                    break
                await asyncio.sleep(0.1)

        expected_names = {"c0", "c2", "c4", "c10", "c12"}
        assert set(fresh) == {f"{namespace}/{n}" for n in expected_names}
        for key, rv in fresh.items():
            assert last[key] in (("ADDED", rv), ("MODIFIED", rv)), (
                f"{key}: last event {last.get(key)}, now rv {rv}"
            )
        for key in touched - fresh.keys():
            # c11 may live and die while the reflector waits out its backoff: a list-watch cache that
            # never saw it is right. One that saw it must have seen it go.
            if key in last or key != f"{namespace}/c11":
                assert key in last, f"{key}: no event at all"
                assert last[key][0] == "DELETED", f"{key}: last event {last[key]}, but it is gone"
        assert reflector.cache[f"{namespace}/c0"]["status"]["message"] == "during"
        assert reflector.cache[f"{namespace}/c10"]["status"]["message"] == "after"
        # It noticed the restart: it had to list again (after a connection error or a 410).
        assert reflector.lists >= 2
        assert reflector.failures + reflector.gones >= 1
        print(
            f"restart took {restarted_in:.1f} s; reflector: lists={reflector.lists} "
            f"watches={reflector.watches} failures={reflector.failures} gones={reflector.gones} "
            f"events={reflector.events}"
        )
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
