"""Device health: events in, sticky Unhealthy marks out.

Both sources feed the same ``HealthTracker``: NVML through a worker thread that
blocks in ``nvmlEventSetWait_v2`` with a short timeout (so it stops within a
fraction of a second), the simulated source through its XID injection file.
Application XIDs (a program's own fault: 13 graphics engine exception, 31 MMU
fault, 43 reset channel, 45 preemptive cleanup, 68 video processor exception,
109 context switch timeout) are ignored, as the NVIDIA device plugin does; any
other XID or a double-bit ECC error marks the device Unhealthy until the agent
restarts, since recovering from them takes a GPU reset.

A device that disappears (``GPU_IS_LOST``, or missing from a re-scan) is kept in
the published status as Unhealthy with ``lost: ...``; ``carry_lost`` does that,
purely, from the previous and the current scan, PCIe levels included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from agent import inventory
from gpualloc.runtime import backoff

log = logging.getLogger(__name__)


DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})

KIND_XID = "xid"
KIND_ECC = "ecc"
KIND_LOST = "lost"
# The tail of a mark carried over an agent restart: "XID 79 (before the agent restarted; held 600 s)".
CARRIED_SUFFIX = " (before the agent restarted; held"
ALL_DEVICES = ""  # an event whose device NVML could not name applies to every device


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HealthEvent:
    uuid: str  # ALL_DEVICES when unknown
    kind: str  # KIND_XID | KIND_ECC (a lost device is a scan's business: carry_lost)
    xid: int = 0


def parse_xids(text: str) -> frozenset[int]:
    """``"13,31, 43"`` -> {13, 31, 43}; an empty string ignores nothing."""
    out: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if part:
            out.add(int(part))
    return frozenset(out)


def reason_for(event: HealthEvent, ignored_xids: frozenset[int]) -> str | None:
    """The healthReason an event sets, or None when it does not affect health."""
    if event.kind == KIND_XID:
        if event.xid in ignored_xids:
            return None
        return f"XID {event.xid}"
    if event.kind == KIND_ECC:
        return "double-bit ECC error"
    return None


class HealthTracker:
    """Sticky Unhealthy marks by UUID. Not thread-safe: use from the event loop."""

    def __init__(
        self,
        ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ignored_xids = frozenset(ignored_xids)
        self._marks: dict[str, str] = {}
        self._all: str = ""
        self._carried: dict[str, tuple[str, float]] = {}  # uuid -> (reason, monotonic time it ends)
        self._mono = monotonic

    def carry(self, previous: Mapping[str, str], *, hold: float) -> None:
        """Marks published before this agent started (UUID -> healthReason), kept ``hold`` seconds
        more: a GPU that failed is not handed out the moment its agent restarts, only once it has
        been healthy that long. A new event on it makes its mark sticky again."""
        ends = self._mono() + hold
        for uuid, reason in previous.items():
            base = reason.split(CARRIED_SUFFIX, 1)[0]
            self._carried[uuid] = (f"{base}{CARRIED_SUFFIX} {hold:.0f} s)", ends)

    def apply(self, event: HealthEvent) -> bool:
        """Record an event; True when it changed some device's health."""
        reason = reason_for(event, self.ignored_xids)
        if reason is None:
            log.info("ignoring application XID", extra={"uuid": event.uuid, "xid": event.xid})
            return False
        if event.uuid == ALL_DEVICES:
            if self._all:
                return False
            self._all = reason
            log.warning("all devices unhealthy", extra={"reason": reason})
            return True
        if event.uuid in self._marks:
            return False
        self._marks[event.uuid] = reason
        log.warning("device unhealthy", extra={"uuid": event.uuid, "reason": reason})
        return True

    def marks(self, uuids: Iterable[str]) -> Mapping[str, str]:
        """UUID -> reason for the given devices that are marked Unhealthy."""
        out: dict[str, str] = {}
        now = self._mono()
        for uuid in uuids:
            carried = self._carried.get(uuid)
            if uuid in self._marks:
                out[uuid] = self._marks[uuid]
            elif self._all:
                out[uuid] = self._all
            elif carried is not None and now < carried[1]:
                out[uuid] = carried[0]
        return out


def carry_lost(previous: inventory.NodeFacts | None, current: inventory.NodeFacts) -> inventory.NodeFacts:
    """``current`` plus every device of ``previous`` that is now missing, marked lost.

    A missing device keeps its last facts and index (unless a present device
    now has that index, in which case it cannot be shown and is dropped). The
    PCIe levels of the pairs of every lost device, missing or reported lost by
    the source, are carried over from ``previous`` where ``current`` has none.
    """
    if previous is None:
        return current
    present = {d.uuid for d in current.devices}
    taken = {d.index for d in current.devices}
    carried: list[inventory.DeviceFacts] = []
    for device in previous.devices:
        if device.uuid in present:
            continue
        if device.index in taken:
            log.warning(
                "lost device's index is taken by another; not shown",
                extra={"uuid": device.uuid, "index": device.index},
            )
            continue
        lost = device.lost or "lost: missing from re-scan"
        carried.append(dataclasses.replace(device, lost=lost))
        taken.add(device.index)
    lost_indices = {d.index for d in carried} | {d.index for d in current.devices if d.lost}
    if not lost_indices:
        return current
    ancestors = dict(current.common_ancestors)
    for pair, level in previous.common_ancestors.items():
        if (pair[0] in lost_indices or pair[1] in lost_indices) and pair not in ancestors:
            ancestors[pair] = level
    devices = current.devices
    if carried:
        devices = tuple(sorted((*devices, *carried), key=lambda d: d.index))
    return dataclasses.replace(current, devices=devices, common_ancestors=ancestors)


class EventWaiter(Protocol):
    """A blocking source of health events (NVML's event set)."""

    def wait(self, timeout_ms: int) -> list[HealthEvent]:
        """Block up to ``timeout_ms``; the events that arrived (maybe none)."""
        ...

    def close(self) -> None: ...


class EventThread:
    """Runs ``waiter.wait`` in a daemon thread and posts events to the loop.

    ``stop()`` sets a flag the thread checks after every wait, so it ends within
    one timeout; ``join`` waits for that.
    """

    def __init__(
        self,
        waiter: EventWaiter,
        loop: asyncio.AbstractEventLoop,
        on_event: Callable[[HealthEvent], object],
        *,
        timeout_ms: int = 500,
    ) -> None:
        self._waiter = waiter
        self._loop = loop
        self._on_event = on_event
        self._timeout_ms = timeout_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                events = self._waiter.wait(self._timeout_ms)
                failures = 0
            except Exception:
                failures += 1
                log.exception("health event wait failed")
                # Back off a little so a broken event set cannot spin a core.
                self._stop.wait(backoff.exponential(failures, base=0.2, cap=5.0))
                continue
            for event in events:
                try:
                    self._loop.call_soon_threadsafe(self._on_event, event)
                except RuntimeError:  # the loop is closed: we are shutting down
                    return
        try:
            self._waiter.close()
        except Exception:
            log.exception("closing the health event set failed")

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
