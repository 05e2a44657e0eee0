"""Since when each GPU has had no compute process (pure): the ``idleSince`` the agent publishes.

After every scan the agent hands ``IdleTracker.observe`` the samples, which list
the processes with a CUDA context on each GPU (NVML's compute processes, or the
simulated source's injected ones). A GPU's value:

* none while a process runs on it, or while its processes cannot be listed
  (NVML does not support the call): not known to be idle;
* the time of the first scan that found it without a process, after one that
  found a process: its last process went away between the two scans;
* the time of the first scan that saw the GPU, when this agent has never seen
  a process on it. ``carry`` moves that back to the value the GpuNodeStatus
  held before this agent started, so a restart (an upgrade) does not make
  every idle GPU look newly idle; a process that came and went while no agent
  ran is not seen, as one shorter than a scan interval is not.

The value changes only when a GPU goes from busy to idle or back: a scan that
finds what the last one found changes nothing, so steady state adds no status
write. A GPU missing from a scan's samples (sampling failed, or it is lost)
keeps its value.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping

from agent import inventory
from gpualloc.api import timestamps


class IdleTracker:
    """Per GPU UUID, since when it has had no process; see the module docstring."""

    def __init__(self) -> None:
        self._since: dict[str, dt.datetime | None] = {}  # None: busy, or its processes not listed
        self._seen_busy: set[str] = set()  # GPUs this agent has seen a process on (or not known idle)
        self._carried: dict[str, dt.datetime] = {}  # from the previous status, for GPUs not seen yet

    def observe(self, samples: Iterable[inventory.DeviceSample], now: dt.datetime) -> bool:
        """One scan's samples, taken at ``now``; whether any GPU's value changed."""
        changed = False
        for sample in samples:
            first = sample.uuid not in self._since
            before = self._since.get(sample.uuid)
            if sample.processes or not sample.processes_listed:
                self._seen_busy.add(sample.uuid)
                after = None
            elif before is not None:
                after = before  # still idle: the value stays
            elif first:
                carried = self._carried.pop(sample.uuid, None)
                after = min(now, carried) if carried is not None else now
            else:
                after = now  # its last process went away since the previous scan
            self._since[sample.uuid] = after
            changed = changed or first or after != before
        return changed

    def carry(self, previous: Mapping[str, dt.datetime]) -> bool:
        """The ``idleSince`` values a previous agent published, by GPU UUID: each stands for a GPU
        this agent has found idle and never busy (or not scanned yet), when it is earlier; whether
        a value changed."""
        changed = False
        for uuid, since in previous.items():
            if uuid not in self._since:
                self._carried[uuid] = since
                continue
            mine = self._since[uuid]
            if mine is not None and uuid not in self._seen_busy and since < mine:
                self._since[uuid] = since
                changed = True
        return changed

    def since(self, uuid: str) -> dt.datetime | None:
        """Since when the GPU has had no process; None while busy, unknown or not scanned yet."""
        return self._since.get(uuid)

    def published(self) -> dict[str, str]:
        """``idleSince`` (RFC 3339, whole seconds) of every GPU known to be idle, by UUID."""
        return {uuid: timestamps.format_time(since) for uuid, since in self._since.items() if since}
