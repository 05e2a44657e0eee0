"""The controller's work queue: deduplicated keys, priority order, delayed retries.

Semantics follow client-go's workqueue, which every controller author knows:

* a key is queued at most once; adding it again while it waits is a no-op;
* a key is handed to one worker at a time; adding it while a worker holds it
  marks it dirty, and it is queued again when that worker calls ``done``;
* ``add_after`` schedules a key for later; a sooner request wins, and an
  immediate ``add`` does not wait for a pending delayed one;
* among ready keys the one with the smallest ``order(key)`` goes first, so the
  reconciler can pop the highest-priority, oldest claim first (``order`` is
  evaluated when the key becomes ready).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any


class WorkQueue:
    """An asyncio work queue of string keys. Not thread-safe; one event loop."""

    def __init__(
        self,
        *,
        order: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._order = order or (lambda key: 0)
        self._clock = clock
        self._heap: list[tuple[Any, int, str]] = []
        self._queued: set[str] = set()  # in the heap
        self._processing: set[str] = set()  # handed to a worker
        self._dirty: set[str] = set()  # added while processing
        self._delayed: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        self._seq = itertools.count()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._shutdown = False

    def __len__(self) -> int:
        return len(self._queued)

    def delayed_until(self, key: str) -> float | None:
        """The clock time a delayed add of ``key`` is due, or None."""
        entry = self._delayed.get(key)
        return entry[0] if entry else None

    def add(self, key: str) -> None:
        """Queue ``key`` now (deduplicated)."""
        if self._shutdown:
            return
        if key in self._processing:
            self._dirty.add(key)
            return
        if key in self._queued:
            return
        self._queued.add(key)
        heapq.heappush(self._heap, (self._order(key), next(self._seq), key))
        self._notify()

    def add_after(self, key: str, delay: float) -> None:
        """Queue ``key`` after ``delay`` seconds; an earlier pending request wins."""
        if self._shutdown:
            return
        if delay <= 0:
            self.add(key)
            return
        due = self._clock() + delay
        current = self._delayed.get(key)
        if current is not None:
            if current[0] <= due:
                return
            current[1].cancel()
        loop = asyncio.get_running_loop()
        handle = loop.call_later(delay, self._fire, key, due)
        self._delayed[key] = (due, handle)

    def forget(self, key: str) -> None:
        """Drop a pending delayed add of ``key`` (the key was deleted)."""
        entry = self._delayed.pop(key, None)
        if entry is not None:
            entry[1].cancel()

    def _fire(self, key: str, due: float) -> None:
        entry = self._delayed.get(key)
        if entry is not None and entry[0] == due:
            del self._delayed[key]
            self.add(key)

    def _notify(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def get(self) -> str:
        """Wait for the next ready key and mark it as being processed.

        Raises ``QueueShutDown`` after ``shutdown`` once nothing is ready.
        """
        while not self._heap:
            if self._shutdown:
                raise QueueShutDown
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._notify()  # we were woken for a key; pass it on
                else:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove(waiter)
                raise
        _, _, key = heapq.heappop(self._heap)
        self._queued.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: str) -> None:
        """The worker finished ``key``; queue it again if it was added meanwhile."""
        self._processing.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    def shutdown(self) -> None:
        """Stop accepting keys, cancel delayed adds and wake every waiting worker."""
        self._shutdown = True
        for _, handle in self._delayed.values():
            handle.cancel()
        self._delayed.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)


class QueueShutDown(Exception):
    """``WorkQueue.get`` after ``shutdown`` when nothing is left."""
