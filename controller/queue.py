"""The controller's work queue: deduplicated keys, fair priority order, delayed retries.

Semantics follow client-go's workqueue, which every controller author knows:

* a key is queued at most once; adding it again while it waits is a no-op;
* a key is handed to one worker at a time; adding it while a worker holds it
  marks it dirty, and it is queued again when that worker calls ``done``;
* ``add_after`` schedules a key for later; a sooner request wins, and an
  immediate ``add`` does not wait for a pending delayed one;
* ``forget`` drops a pending delayed add (the key was deleted);
* ``shutdown`` stops accepting keys and wakes every waiting worker.

Order (where client-go's queue is FIFO): ``order(key)`` gives a ``Rank``,
evaluated when the key becomes ready. Every ready key of a lower ``band`` goes
before any key of a higher one (the reconciler's bands: claims being deleted
first, then by priority, high first). Within a band the ``tenant``s (the
reconciler's: namespaces) take turns, round-robin: each turn hands out the
tenant's smallest ``age``, and a tenant with more ready keys goes to the back
of the line. So one tenant's thousands of claims cannot starve another
tenant's claim of the same band: it waits for at most one key of each other
tenant with ready keys in its band, not for all of them (kube-scheduler's
queue is by priority then age alone; Kueue's fair sharing takes turns
between queues in the same way).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Any, NamedTuple


class Rank(NamedTuple):
    """Where a ready key goes: its band (lower first), its tenant (turns within a band), its age
    within the tenant (lower first)."""

    band: Any = 0
    tenant: str = ""
    age: Any = 0


@dataclasses.dataclass(slots=True)
class _Band:
    tenants: dict[str, list[tuple[Any, int, str]]] = dataclasses.field(default_factory=dict)  # heaps
    turns: collections.deque[str] = dataclasses.field(default_factory=collections.deque)


class WorkQueue:
    """An asyncio work queue of string keys. Not thread-safe; one event loop."""

    def __init__(
        self,
        *,
        order: Callable[[str], Rank] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._order = order or (lambda key: Rank())
        self._clock = clock
        self._bands: dict[Any, _Band] = {}
        self._band_heap: list[Any] = []  # the bands with ready keys, each once
        self._queued: set[str] = set()  # ready, in a band
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
        rank = self._order(key)
        band = self._bands.get(rank.band)
        if band is None:
            band = self._bands[rank.band] = _Band()
            heapq.heappush(self._band_heap, rank.band)
        heap = band.tenants.get(rank.tenant)
        if heap is None:
            heap = band.tenants[rank.tenant] = []
            band.turns.append(rank.tenant)
        heapq.heappush(heap, (rank.age, next(self._seq), key))
        self._notify()

    def _pop(self) -> str:
        """The next ready key: the lowest band's next tenant's oldest."""
        band_key = self._band_heap[0]
        band = self._bands[band_key]
        tenant = band.turns.popleft()
        heap = band.tenants[tenant]
        _, _, key = heapq.heappop(heap)
        if heap:
            band.turns.append(tenant)
        else:
            del band.tenants[tenant]
            if not band.tenants:
                del self._bands[band_key]
                heapq.heappop(self._band_heap)
        return key

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
        while not self._band_heap:
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
        key = self._pop()
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
