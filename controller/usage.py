"""The controller's GPU-seconds counter (``gpualloc_gpu_seconds_total``), kept pure.

Per namespace, claim, product and profile (``gpualloc.usage``), the counter is

* the seconds of every device Lease held now, ``now - spec.acquireTime``,
  computed from the Lease cache when scraped: the API server's record, so a
  restarted controller, or a standby that took over, reports the same figure
  for every allocation still held;
* plus the seconds of the Leases this process saw go, from their acquireTime
  to when they went (``usage.released_at``), kept in memory for ``kept``
  seconds after the release (Prometheus has the final value by then), then
  dropped with their series.

What a restart loses: a Lease released while no process watched (the seconds
are on no record once the Lease is gone), and the last seconds of a Lease
released less than one scrape interval before a restart (its series is not
exported again, and Prometheus kept its value at the scrape before). A
standby runs the same caches, so a failover loses nothing it saw. A series
never goes down while exported: each one reports at least what it reported
last.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable

from gpualloc import usage

RELEASED_KEPT = 3600.0  # seconds a released claim's series stays exported
SEEN_KEPT = 100_000  # Lease UIDs remembered as counted, against a DELETED seen twice


@dataclasses.dataclass(slots=True)
class _Released:
    seconds: float = 0.0
    last: dt.datetime | None = None  # the latest release counted


class Tally:
    """Seconds of the Leases seen released, and the last figure reported per series."""

    def __init__(self, *, kept: float = RELEASED_KEPT) -> None:
        self.kept = kept
        self._released: dict[usage.Key, _Released] = {}
        self._counted: dict[str, None] = {}  # Lease UIDs, oldest first
        self._reported: dict[usage.Key, float] = {}

    def release(self, held: usage.Holding, observed: dt.datetime) -> None:
        """The Lease ``held`` was seen gone at ``observed`` (counted once per Lease UID)."""
        if held.uid in self._counted:
            return
        self._counted[held.uid] = None
        if len(self._counted) > SEEN_KEPT:
            del self._counted[next(iter(self._counted))]
        end = usage.released_at(held, observed)
        entry = self._released.setdefault(held.key, _Released())
        entry.seconds += usage.seconds_between(held.acquired, end)
        entry.last = end if entry.last is None else max(entry.last, end)

    def totals(self, held: Iterable[usage.Holding], now: dt.datetime) -> dict[usage.Key, float]:
        """Each series' seconds at ``now``: the Leases ``held`` now, plus those released; released
        series older than ``kept`` are dropped first."""
        horizon = now - dt.timedelta(seconds=self.kept)
        live: dict[usage.Key, float] = {}
        for h in held:
            if h.uid not in self._counted:  # a DELETED the cache has not caught up with
                live[h.key] = live.get(h.key, 0.0) + usage.seconds_between(h.acquired, now)
        for key, entry in list(self._released.items()):
            if key not in live and entry.last is not None and entry.last < horizon:
                del self._released[key]
                self._reported.pop(key, None)
        out: dict[usage.Key, float] = {}
        for key in live.keys() | self._released.keys():
            released = self._released.get(key)
            seconds = live.get(key, 0.0) + (released.seconds if released is not None else 0.0)
            out[key] = max(seconds, self._reported.get(key, 0.0))
        for key in self._reported.keys() - out.keys():
            del self._reported[key]  # its Leases went without a release counted: nothing to keep
        self._reported.update(out)
        return out
