"""List, watch, re-list: a local cache of one kind that survives 410 Gone and API server restarts.

A ``Reflector`` lists the kind (which gives a resourceVersion), then watches
from it. When the API server ends the watch (its ``timeoutSeconds``), it
watches again from the last resourceVersion it saw, bookmarks included. When the
resourceVersion is too old (410 Gone, as an HTTP status or as an ERROR event in
the stream) or the connection fails (the API server restarted), it backs off,
lists again, and reports the differences between the new list and its cache as
ADDED, MODIFIED (only where the resourceVersion changed) and DELETED events,
then watches from the new list. So every change reaches ``on_event``: changes
that happened while it was not watching arrive folded into the re-list's
differences, the way a level-triggered controller needs them.

The watch is read straight from the HTTP stream: every kind is plain camelCase
JSON, the same shape as the custom resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import aiohttp

from gpualloc.api import constants
from gpualloc.kube import errors, transport
from gpualloc.kube.client import Api
from gpualloc.runtime import backoff

log = logging.getLogger(__name__)

Obj = dict[str, Any]
EventHandler = Callable[[str, Obj], None]

ADDED = "ADDED"
MODIFIED = "MODIFIED"
DELETED = "DELETED"
BOOKMARK = "BOOKMARK"
ERROR = "ERROR"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ResourceKind:
    """Where a kind lives in the API: ``group`` is "" for the core group."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None) -> str:
        """The collection's URL path, in ``namespace`` or across all of them."""
        return transport.collection_path(
            self.group, self.version, self.plural, namespace if self.namespaced else None
        )


CLAIMS = ResourceKind(
    group=constants.GROUP,
    version=constants.VERSION,
    plural=constants.CLAIM_PLURAL,
    kind=constants.CLAIM_KIND,
    namespaced=True,
)
NODE_STATUSES = ResourceKind(
    group=constants.GROUP,
    version=constants.VERSION,
    plural=constants.NODE_STATUS_PLURAL,
    kind=constants.NODE_STATUS_KIND,
    namespaced=False,
)
QUOTAS = ResourceKind(
    group=constants.GROUP,
    version=constants.VERSION,
    plural=constants.QUOTA_PLURAL,
    kind=constants.QUOTA_KIND,
    namespaced=True,
)
NODES = ResourceKind(group="", version="v1", plural="nodes", kind="Node", namespaced=False)
LEASES = ResourceKind(
    group="coordination.k8s.io", version="v1", plural="leases", kind="Lease", namespaced=True
)
PODS = ResourceKind(group="", version="v1", plural="pods", kind="Pod", namespaced=True)


def object_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name``, or ``name`` for a cluster-scoped object."""
    metadata = obj.get("metadata") or {}
    name = str(metadata.get("name", ""))
    namespace = metadata.get("namespace")
    return f"{namespace}/{name}" if namespace else name


def resource_version_of(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


def diff(old: Mapping[str, Obj], new: Mapping[str, Obj]) -> list[tuple[str, Obj]]:
    """The events that turn cache ``old`` into ``new`` (both keyed by ``object_key``).

    DELETED carries the last object the cache knew; MODIFIED is reported only
    where the resourceVersion changed. Pure; in a stable order (deletions first).
    """
    events: list[tuple[str, Obj]] = [(DELETED, old[key]) for key in sorted(old.keys() - new.keys())]
    for key in sorted(new):
        if key not in old:
            events.append((ADDED, new[key]))
        elif resource_version_of(old[key]) != resource_version_of(new[key]):
            events.append((MODIFIED, new[key]))
    return events


# The first pause after a failed list or watch; it doubles up to ``max_backoff_seconds``.
BACKOFF_BASE_SECONDS = 0.2


class Reflector:
    """A cache of one kind, kept by list -> watch -> re-list until cancelled.

    ``cache`` maps ``namespace/name`` (or ``name``) to the raw object, or to what
    ``transform`` keeps of it (a cache of objects tenants create should hold only
    what its reader needs); treat the dicts as read-only. Lists are read
    ``page_size`` objects at a time. ``on_event(type, obj)`` runs after the cache was
    updated, for every ADDED/MODIFIED/DELETED, including those a re-list
    found; an exception it raises is logged and does not stop the reflector.
    """

    def __init__(
        self,
        api: Api,
        kind: ResourceKind,
        *,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
        on_event: EventHandler | None = None,
        watch_timeout_seconds: int = 300,
        max_backoff_seconds: float = 5.0,
        rng: random.Random | None = None,
        transform: Callable[[Obj], Obj] | None = None,
        page_size: int = 500,
    ) -> None:
        self.api = api
        self.kind = kind
        self.namespace = namespace if kind.namespaced else None
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.on_event = on_event
        self.watch_timeout_seconds = watch_timeout_seconds
        self.max_backoff_seconds = max_backoff_seconds
        self._rng = rng or random.Random()
        self.transform = transform
        self.page_size = page_size
        self.cache: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.resource_version = ""
        # Counters, for logs and tests: lists done, watches started, 410s met, other failures,
        # events emitted (watched or found by a re-list), watch events received (bookmarks included).
        self.lists = 0
        self.watches = 0
        self.gones = 0
        self.failures = 0
        self.events = 0
        self.watch_events = 0

    def get(self, key: str) -> Obj | None:
        return self.cache.get(key)

    def __repr__(self) -> str:
        where = f" in {self.namespace}" if self.namespace else ""
        return f"<Reflector {self.kind.plural}{where} rv={self.resource_version} objects={len(self.cache)}>"

    async def run(self) -> None:
        """List, then watch and re-list as needed, until cancelled."""
        failures = 0  # in a row, without an event or a clean end of a watch in between
        need_list = True
        while True:
            seen = self.watch_events
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                started = time.monotonic()
                await self.watch_once()
                if self.watch_events == seen and time.monotonic() - started < 1.0:
                    # Ended at once with nothing said: the API server is going away. Do not spin.
                    failures += 1
                    await asyncio.sleep(self._backoff(failures))
                else:
                    failures = 0
                continue
            except errors.Gone as exc:
                self.gones += 1
                log.info("watch expired, re-listing", extra={"kind": self.kind.plural, "error": str(exc)})
            except (errors.KubeError, ValueError, KeyError, TypeError) as exc:  # API errors, malformed data
                self.failures += 1
                log.warning(
                    "list/watch failed, re-listing after a pause",
                    extra={"kind": self.kind.plural, "error": str(exc), "failures": failures + 1},
                )
            need_list = True
            # A watch that delivered something was progress: start the backoff again from the bottom.
            failures = 1 if self.watch_events != seen else failures + 1
            await asyncio.sleep(self._backoff(failures))

    def _backoff(self, failures: int) -> float:
        # Jittered down: many reflectors cut off by one API server restart come back spread out,
        # and none waits longer than max_backoff_seconds.
        return backoff.jittered_down(
            failures, self._rng, base=BACKOFF_BASE_SECONDS, cap=self.max_backoff_seconds
        )

    def _selectors(self) -> list[tuple[str, str]]:
        query: list[tuple[str, str]] = []
        if self.label_selector:
            query.append(("labelSelector", self.label_selector))
        if self.field_selector:
            query.append(("fieldSelector", self.field_selector))
        return query

    async def list_objects(self) -> tuple[dict[str, Obj], str]:
        """One full list, ``page_size`` objects a page: the objects by key and the list's resourceVersion."""
        objects: dict[str, Obj] = {}
        token = ""
        while True:
            query = [*self._selectors(), ("limit", str(self.page_size))]
            if token:
                query.append(("continue", token))
            listing = await transport.request(self.api, "GET", self.kind.path(self.namespace), query=query)
            for item in listing.get("items") or []:
                # List items leave out apiVersion and kind; watch events carry them. Make both the same.
                item.setdefault("apiVersion", self.kind.api_version)
                item.setdefault("kind", self.kind.kind)
                objects[object_key(item)] = self._kept(item)
            metadata = listing["metadata"]
            token = str(metadata.get("continue") or "")
            if not token:
                return objects, str(metadata["resourceVersion"])

    def _kept(self, obj: Obj) -> Obj:
        """What the cache keeps of ``obj``: all of it but ``managedFields``, or what ``transform``
        makes of it."""
        obj = without_managed_fields(obj)
        return obj if self.transform is None else self.transform(obj)

    async def relist(self) -> None:
        """List again, replace the cache, and emit the differences."""
        objects, resource_version = await self.list_objects()
        self.lists += 1
        events = diff(self.cache, objects)
        self.cache = objects
        self.resource_version = resource_version
        log.debug(
            "listed",
            extra={
                "kind": self.kind.plural,
                "objects": len(objects),
                "changes": len(events),
                "rv": resource_version,
            },
        )
        for type_, obj in events:
            self._notify(type_, obj)
        self.synced.set()

    async def watch_once(self) -> None:
        """Watch from ``resource_version`` until the API server ends the stream."""
        self.watches += 1
        async with contextlib.aclosing(self.stream(self.resource_version)) as events:
            async for event in events:
                self.apply(event)

    def apply(self, event: Mapping[str, Any]) -> None:
        """Apply one watch event to the cache; raise ``errors.Gone`` (or another error) for ERROR."""
        type_ = event.get("type")
        obj = event.get("object")
        if type_ == ERROR:
            raise errors.from_status(obj if isinstance(obj, dict) else {})
        if not isinstance(obj, dict):
            raise ValueError(f"watch event without an object: {str(event)[:200]}")
        self.watch_events += 1
        rv = resource_version_of(obj)
        if type_ == BOOKMARK:
            if rv:
                self.resource_version = rv
            return
        key = object_key(obj)
        obj = self._kept(obj)
        if type_ in (ADDED, MODIFIED):
            self.cache[key] = obj
        elif type_ == DELETED:
            self.cache.pop(key, None)
        else:
            log.warning("unknown watch event type", extra={"kind": self.kind.plural, "type": type_})
            return
        if rv:
            self.resource_version = rv
        self._notify(str(type_), obj)

    def _notify(self, type_: str, obj: Obj) -> None:
        self.events += 1
        if self.on_event is None:
            return
        try:
            self.on_event(type_, obj)
        except Exception:
            log.exception("event handler failed", extra={"kind": self.kind.plural, "object": object_key(obj)})

    async def stream(self, resource_version: str) -> AsyncGenerator[Obj, None]:
        """The decoded events of one watch from ``resource_version`` (the API server's JSON lines)."""
        timeout = max(1, int(self.watch_timeout_seconds * (0.9 + 0.2 * self._rng.random())))
        query = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", str(timeout)),
            *self._selectors(),
        ]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        response = await transport.send(
            self.api,
            "GET",
            self.kind.path(self.namespace),
            query=query,
            # The server ends the watch after `timeout`; a silent socket well past that is a dead one.
            client_timeout=aiohttp.ClientTimeout(sock_connect=10, sock_read=timeout + 30),
        )
        try:
            if not 200 <= response.status < 300:
                await transport.read_json(response)  # raises the mapped error
                return
            while True:
                with errors.mapped():
                    line = await response.content.readline()
                if not line:
                    return  # the server closed the watch
                if not line.strip():
                    continue
                event = json.loads(line)
                if not isinstance(event, dict):
                    raise ValueError(f"watch line is not an object: {line[:200]!r}")
                if "type" not in event and "code" in event:  # a bare Status instead of an event
                    raise errors.from_status(event)
                yield event
        finally:
            response.close()


def without_managed_fields(obj: Obj) -> Obj:
    """``obj`` without ``metadata.managedFields`` (server-side apply's bookkeeping, which nothing in
    gpualloc reads, and which is often the largest part of a cached object), as client-go's
    informers drop it."""
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict) or "managedFields" not in metadata:
        return obj
    return {**obj, "metadata": {k: v for k, v in metadata.items() if k != "managedFields"}}


async def run_reflectors(*reflectors: Reflector) -> None:
    """Run several reflectors until cancelled; cancelling this cancels them all."""
    async with asyncio.TaskGroup() as group:
        for reflector in reflectors:
            group.create_task(reflector.run(), name=repr(reflector))
