"""Leader election through a ``coordination.k8s.io/v1`` Lease, as client-go does it.

One controller leads and allocates; the others keep their caches warm and
wait. Every ``retry_period`` a candidate reads the Lease: when it is held by
someone else and the record has not changed for the lease duration (measured
on the candidate's own monotonic clock from the moment it *observed* the last
change, so clock skew between machines does not matter), the candidate takes
it with a ``replace`` carrying the resourceVersion it read; a concurrent
taker gets ``Conflict`` and loses. The leader renews every ``retry_period``
and steps down when it could not renew for ``renew_deadline`` (shorter than
the lease duration, so it stops before anyone can take over). A standby thus
takes over between ``lease_duration - retry_period`` and
``lease_duration + retry_period`` after the leader's last renewal.

An acquire whose answer is lost (a reset connection, a timeout) may still have
been written: the Lease then names a candidate that does not know it leads and
goes on campaigning. Its next attempt reads the Lease, finds itself the holder
and renews, and only then does it lead; if the Lease expired meanwhile and
another candidate took it, it stays a standby, having never led. client-go
behaves the same way.

With ``release_on_cancel`` a leader that is shut down cleanly empties the
holder, so a standby takes over at its next poll instead of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

from gpualloc.api import leases as lease_format
from gpualloc.kube import errors, leases
from gpualloc.kube.client import Api

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class LeaderElector:
    def __init__(
        self,
        api: Api,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        release_on_cancel: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not retry_period < renew_deadline < lease_duration:
            raise ValueError("need retry period < renew deadline < lease duration")
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.release_on_cancel = release_on_cancel
        self._clock = clock
        self.leading = asyncio.Event()  # set while this process leads
        self.lost = asyncio.Event()  # set when it led and had to step down
        self.holder = ""  # the holder last observed
        self._record: Obj | None = None  # the Lease as last read or written
        self._observed_rv = ""
        self._observed_at = 0.0

    async def run(self) -> None:
        """Campaign until leading, then renew until the renewals fail; returns after stepping down."""
        try:
            while True:
                if await self._try():
                    break
                await asyncio.sleep(self.retry_period)
            self.leading.set()
            log.info("became leader", extra={"identity": self.identity, "lease": self.name})
            last_renew = self._clock()
            while True:
                await asyncio.sleep(self.retry_period)
                if await self._try():
                    last_renew = self._clock()
                elif self._clock() - last_renew >= self.renew_deadline or self.holder != self.identity:
                    log.error(
                        "leadership lost",
                        extra={"identity": self.identity, "holder": self.holder, "lease": self.name},
                    )
                    self.leading.clear()
                    self.lost.set()
                    return
        except asyncio.CancelledError:
            if self.leading.is_set() and self.release_on_cancel:
                await asyncio.shield(self._release())
            self.leading.clear()
            raise

    async def _try(self) -> bool:
        """One attempt to acquire or renew; True when this process holds the Lease afterwards.

        An attempt takes at most the renew deadline, as client-go's renew does. A leader paused
        past its lease (SIGSTOP in the race test) may resume with its renewal stuck on a
        connection a network fault left half open: without the bound it went on leading until
        the client's 30 s request timeout, where the deadline should have stopped it."""
        try:
            async with asyncio.timeout(self.renew_deadline):
                return await self._try_once()
        except TimeoutError:
            log.warning("leader election attempt timed out", extra={"lease": self.name})
            self._record = None
            return False
        except errors.Conflict:
            self._record = None  # someone else wrote it: read it again next time
            return False
        except errors.KubeError as exc:
            log.warning("leader election attempt failed", extra={"error": str(exc), "lease": self.name})
            self._record = None
            return False

    async def _try_once(self) -> bool:
        now = datetime.datetime.now(datetime.UTC)
        record = self._record if self.leading.is_set() and self._record is not None else None
        if record is None:
            try:
                record = await leases.get_lease(self.api, self.namespace, self.name)
            except errors.NotFound:
                created = await leases.create_lease(
                    self.api,
                    self.namespace,
                    self.name,
                    holder=self.identity,
                    labels={},
                    duration_seconds=round(self.lease_duration),
                )
                self._remember(created)
                return True
        self._observe(record)
        spec = record.get("spec") or {}
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        if self.holder and self.holder != self.identity and self._clock() < self._observed_at + duration:
            return False
        body = copy.deepcopy(record)
        new_spec = body.setdefault("spec", {})
        new_spec["holderIdentity"] = self.identity
        new_spec["leaseDurationSeconds"] = round(self.lease_duration)
        new_spec["renewTime"] = lease_format.micro_time(now)
        if self.holder != self.identity:
            new_spec["acquireTime"] = lease_format.micro_time(now)
            new_spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
        written = await leases.replace_lease(self.api, self.namespace, self.name, body)
        self._remember(written)
        return True

    def _observe(self, record: Obj) -> None:
        rv = str((record.get("metadata") or {}).get("resourceVersion", ""))
        if rv != self._observed_rv:
            self._observed_rv = rv
            self._observed_at = self._clock()
        self.holder = str((record.get("spec") or {}).get("holderIdentity") or "")

    def _remember(self, record: Obj) -> None:
        self._record = record
        self._observe(record)

    async def _release(self) -> None:
        """Give the Lease up (empty holder) so a standby need not wait for it to expire."""
        record = self._record
        if record is None:
            return
        body = copy.deepcopy(record)
        spec = body.setdefault("spec", {})
        spec["holderIdentity"] = None
        spec["leaseDurationSeconds"] = 1
        spec["renewTime"] = lease_format.micro_time(datetime.datetime.now(datetime.UTC))
        with contextlib.suppress(errors.KubeError, asyncio.TimeoutError):
            async with asyncio.timeout(3):
                await leases.replace_lease(self.api, self.namespace, self.name, body)
                log.info("released leadership", extra={"identity": self.identity, "lease": self.name})
