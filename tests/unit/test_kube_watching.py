"""The reflector's own logic: diffing a re-list, applying events, and its loop on 410 and failures.

The list and the watch stream are replaced by scripted ones here; what the real
API server sends is checked in tests/integration/test_kube_adapter.py and
tests/integration/test_watch_restart.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from gpualloc.kube import errors, watching


def obj(name: str, rv: str, namespace: str | None = "ns") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": rv}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "gpu.scheduling/v1", "kind": "GpuClaim", "metadata": meta}


def test_object_key_is_namespace_slash_name_or_name_for_cluster_scoped() -> None:
    assert watching.object_key(obj("a", "1")) == "ns/a"
    assert watching.object_key(obj("node-1", "1", namespace=None)) == "node-1"


def test_diff_reports_added_deleted_and_modified_only_where_the_resource_version_changed() -> None:
    old = {"ns/a": obj("a", "1"), "ns/b": obj("b", "2"), "ns/c": obj("c", "3")}
    new = {"ns/a": obj("a", "1"), "ns/b": obj("b", "5"), "ns/d": obj("d", "6")}
    assert watching.diff(old, new) == [
        ("DELETED", old["ns/c"]),
        ("MODIFIED", new["ns/b"]),
        ("ADDED", new["ns/d"]),
    ]


def test_diff_of_equal_caches_is_empty() -> None:
    cache = {"ns/a": obj("a", "1")}
    assert watching.diff(cache, dict(cache)) == []


def make(events: list[tuple[str, dict[str, Any]]] | None = None) -> watching.Reflector:
    on_event = None if events is None else (lambda t, o: events.append((t, o)))
    return watching.Reflector(None, watching.CLAIMS, namespace="ns", on_event=on_event)  # type: ignore[arg-type]


def test_apply_error_410_event_raises_gone_and_leaves_the_cache() -> None:
    reflector = make()
    reflector.cache = {"ns/a": obj("a", "1")}
    status = {"kind": "Status", "status": "Failure", "reason": "Expired", "message": "too old", "code": 410}
    with pytest.raises(errors.Gone):
        reflector.apply({"type": "ERROR", "object": status})
    assert reflector.cache == {"ns/a": obj("a", "1")}


def test_apply_error_event_with_another_code_raises_that_error() -> None:
    with pytest.raises(errors.Unavailable):
        make().apply({"type": "ERROR", "object": {"kind": "Status", "code": 500, "reason": "InternalError"}})


def test_apply_bookmark_moves_the_resource_version_and_emits_nothing() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    reflector = make(seen)
    reflector.apply(
        {"type": "BOOKMARK", "object": {"kind": "GpuClaim", "metadata": {"resourceVersion": "77"}}}
    )
    assert reflector.resource_version == "77"
    assert seen == []
    assert reflector.cache == {}


def test_apply_added_modified_deleted_update_the_cache_before_notifying() -> None:
    seen: list[tuple[str, dict[str, Any], bool]] = []
    reflector = make()
    reflector.on_event = lambda t, o: seen.append((t, o, watching.object_key(o) in reflector.cache))
    reflector.apply({"type": "ADDED", "object": obj("a", "1")})
    reflector.apply({"type": "MODIFIED", "object": obj("a", "2")})
    assert reflector.get("ns/a") == obj("a", "2")
    reflector.apply({"type": "DELETED", "object": obj("a", "3")})
    assert reflector.get("ns/a") is None
    assert [(t, o["metadata"]["resourceVersion"], present) for t, o, present in seen] == [
        ("ADDED", "1", True),
        ("MODIFIED", "2", True),
        ("DELETED", "3", False),
    ]
    assert reflector.resource_version == "3"


def test_a_failing_event_handler_does_not_stop_the_reflector() -> None:
    reflector = make()

    def boom(type_: str, o: dict[str, Any]) -> None:
        raise RuntimeError("handler bug")

    reflector.on_event = boom
    reflector.apply({"type": "ADDED", "object": obj("a", "1")})
    assert reflector.get("ns/a") == obj("a", "1")


class Scripted(watching.Reflector):
    """A reflector whose lists and watches follow a script; the last watch blocks until cancelled."""

    def __init__(self, lists: list[dict[str, dict[str, Any]]], watches: list[list[Any]], **kw: Any) -> None:
        super().__init__(None, watching.CLAIMS, namespace="ns", max_backoff_seconds=0.05, **kw)  # type: ignore[arg-type]
        self.script_lists = lists
        self.script_watches = watches
        self.watched_from: list[str] = []
        self.idle = asyncio.Event()

    async def list_objects(self) -> tuple[dict[str, dict[str, Any]], str]:
        objects = self.script_lists.pop(0)
        if isinstance(objects, BaseException):
            raise objects
        rv = max((int(o["metadata"]["resourceVersion"]) for o in objects.values()), default=0)
        return {k: dict(v) for k, v in objects.items()}, str(rv + 100)

    async def stream(self, resource_version: str) -> AsyncGenerator[dict[str, Any], None]:
        self.watched_from.append(resource_version)
        if not self.script_watches:
            self.idle.set()
            await asyncio.Event().wait()
        for item in self.script_watches.pop(0):
            if isinstance(item, BaseException):
                raise item
            yield item


async def run_until_idle(reflector: Scripted) -> None:
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.idle.wait(), 5)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_run_relists_after_an_error_410_event_and_emits_the_differences() -> None:
    seen: list[tuple[str, str, str]] = []
    gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version"}
    reflector = Scripted(
        lists=[
            {"ns/a": obj("a", "1"), "ns/b": obj("b", "2")},
            # Meanwhile: a modified (and seen by the watch), b deleted, c created - all unseen by the watch.
            {"ns/a": obj("a", "3"), "ns/c": obj("c", "4")},
        ],
        watches=[[{"type": "MODIFIED", "object": obj("a", "3")}, {"type": "ERROR", "object": gone}]],
        on_event=lambda t, o: seen.append((t, o["metadata"]["name"], o["metadata"]["resourceVersion"])),
    )
    await run_until_idle(reflector)
    assert seen == [
        ("ADDED", "a", "1"),
        ("ADDED", "b", "2"),
        ("MODIFIED", "a", "3"),
        # the re-list: b is gone, c is new; a has the resourceVersion the watch delivered, so no event
        ("DELETED", "b", "2"),
        ("ADDED", "c", "4"),
    ]
    assert reflector.cache == {"ns/a": obj("a", "3"), "ns/c": obj("c", "4")}
    assert reflector.gones == 1
    assert reflector.lists == 2
    assert reflector.watched_from == ["102", "104"]
    assert reflector.synced.is_set()


async def test_run_relists_after_a_connection_error_and_after_a_failed_list() -> None:
    reflector = Scripted(
        lists=[
            {"ns/a": obj("a", "1")},
            errors.Unavailable(0, "ClientConnectorError", "connection refused"),
            {"ns/b": obj("b", "5")},
        ],
        watches=[[errors.Unavailable(0, "ServerDisconnectedError", "")]],
    )
    await run_until_idle(reflector)
    assert reflector.cache == {"ns/b": obj("b", "5")}
    assert reflector.failures == 2
    assert reflector.lists == 2  # the failed list is not counted


async def test_run_rewatches_from_the_last_resource_version_when_the_server_ends_a_watch() -> None:
    reflector = Scripted(
        lists=[{"ns/a": obj("a", "1")}],
        watches=[
            [{"type": "MODIFIED", "object": obj("a", "150")}],
            [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "160"}}}],
        ],
    )
    await run_until_idle(reflector)
    assert reflector.watched_from == ["101", "150", "160"]
    assert reflector.lists == 1


async def test_synced_is_not_set_until_a_list_succeeds() -> None:
    reflector = Scripted(lists=[errors.Forbidden(403, "Forbidden", "no")] * 3 + [{}], watches=[])
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.sleep(0)
        assert not reflector.synced.is_set()
        await asyncio.wait_for(reflector.synced.wait(), 5)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert reflector.failures == 3
