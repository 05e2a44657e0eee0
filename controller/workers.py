"""The worker loop of the controller's work queues (the claims' and the DRA mirror's).

Each worker takes a key, handles it, and tells the queue it is done. A key that failed goes back
after a delay: a ``Conflict`` (or another exception of ``stale``) means a cache was behind a
write, whose watch event re-queues the key too, so it is tried again soon without backoff; any
other error backs off exponentially per key (jittered, ``BACKOFF_BASE`` doubling up to
``BACKOFF_CAP``), and a success clears the key's count.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from controller import queue as work_queue
from gpualloc.kube import errors
from gpualloc.runtime import backoff

log = logging.getLogger(__name__)

BACKOFF_BASE = 0.5
BACKOFF_CAP = 60.0


class Workers:
    """Runs ``handle(key)`` for the keys of ``queue``; ``what`` names the work in logs ("reconcile"),
    ``subject`` the key's kind in their extras ("claim")."""

    def __init__(
        self,
        queue: work_queue.WorkQueue,
        handle: Callable[[str], Awaitable[None]],
        *,
        what: str,
        subject: str = "claim",
        stale: tuple[type[Exception], ...] = (errors.Conflict,),
        rng: random.Random | None = None,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.queue = queue
        self.handle = handle
        self.what = what
        self.subject = subject
        self.stale = stale
        self.rng = rng or random.Random()
        self.observe = observe  # the seconds each key took, success or not
        self.failures: dict[str, int] = {}  # key -> failures in a row

    def forget(self, key: str) -> None:
        """Drop the key's failure count (it was deleted)."""
        self.failures.pop(key, None)

    async def run(self) -> None:
        """One worker, until cancelled."""
        while True:
            key = await self.queue.get()
            started = time.perf_counter()
            try:
                await self.handle(key)
                self.failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except self.stale as exc:
                log.debug(f"{self.what}: stale cache, retrying", extra={self.subject: key, "error": str(exc)})
                self.queue.add_after(key, 0.05 + 0.2 * self.rng.random())
            except Exception as exc:
                failures = self.failures[key] = self.failures.get(key, 0) + 1
                delay = backoff.jittered_up(
                    failures, base=BACKOFF_BASE, cap=BACKOFF_CAP, jitter=self.rng.random()
                )
                extra = {self.subject: key, "retry_in": delay}
                if isinstance(exc, errors.KubeError):
                    log.warning(f"{self.what} failed", extra=extra | {"error": str(exc)})
                else:
                    log.exception(f"{self.what} crashed", extra=extra)
                self.queue.add_after(key, delay)
            finally:
                self.queue.done(key)
                if self.observe is not None:
                    self.observe(time.perf_counter() - started)
