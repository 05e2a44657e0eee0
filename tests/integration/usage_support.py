"""Measuring the GPU-seconds accounting against the device Leases' lifetimes (test and bench).

``LeaseClock`` watches the device Leases of a namespace on its own connection and
notes, per Lease, its ``spec.acquireTime`` and the moment (this process's clock,
the same machine as the controller's) it was seen DELETED: a Lease's lifetime,
independent of the controller. ``scrape`` reads a controller's
``gpualloc_gpu_seconds_total`` over HTTP; ``usage_cli`` runs ``gpualloc get usage``
as a process. ``drift`` is |counted - lifetime| / lifetime.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import socket
import sys
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpualloc.api import constants, leases, timestamps
from gpualloc.kube import watching
from gpualloc.kube.client import Api

ClaimKey = tuple[str, str]  # namespace, name


@dataclasses.dataclass(slots=True)
class LeaseLife:
    claim: ClaimKey
    acquired: dt.datetime
    released: dt.datetime | None = None


class LeaseClock:
    """The device Leases of ``namespace`` as a stranger sees them come and go."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.lives: dict[str, LeaseLife] = {}  # Lease uid ->
        self.reflector = watching.Reflector(
            api, watching.LEASES, namespace=namespace, label_selector=leases.MANAGED, on_event=self._on
        )

    def _on(self, type_: str, raw: dict[str, Any]) -> None:
        meta = raw.get("metadata") or {}
        uid = str(meta.get("uid", ""))
        acquired = timestamps.parse_time((raw.get("spec") or {}).get("acquireTime"))
        if acquired is None:
            return
        life = self.lives.setdefault(uid, LeaseLife(claim=constants.lease_claim(meta), acquired=acquired))
        if type_ == watching.DELETED and life.released is None:
            life.released = dt.datetime.now(dt.UTC)

    def held(self, claim: ClaimKey) -> int:
        """The Leases of ``claim`` not seen DELETED."""
        return sum(1 for life in self.lives.values() if life.claim == claim and life.released is None)

    async def released(self, claim: ClaimKey) -> bool:
        """Whether every Lease of ``claim`` seen was seen DELETED (a probe for ``wait_for``)."""
        return self.held(claim) == 0

    def seconds(self, claim: ClaimKey, now: dt.datetime) -> float:
        """The summed lifetimes of ``claim``'s Leases, up to ``now`` for those still held."""
        return sum(
            ((life.released or now) - life.acquired).total_seconds()
            for life in self.lives.values()
            if life.claim == claim
        )

    async def run(self) -> None:
        await self.reflector.run()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def scrape(port: int) -> dict[ClaimKey, float]:
    """``gpualloc_gpu_seconds_total`` of the controller serving /metrics on ``port``, per claim."""
    async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as answer:
        text = await answer.text()
    out: dict[ClaimKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpualloc_gpu_seconds_total":
                key = (sample.labels["namespace"], sample.labels["claim"])
                out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class CliAnswer:
    now: dt.datetime
    seconds: dict[ClaimKey, float]
    idle: list[str] | None  # the claims listed idle; None when pods could not be listed


async def usage_cli(kubeconfig: str, namespace: str, lease_namespace: str, *extra: str) -> CliAnswer:
    """``gpualloc get usage -n NAMESPACE -o json [extra]``, run as a process."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpualloc.cli",
        "get",
        "usage",
        "--kubeconfig",
        kubeconfig,
        "-n",
        namespace,
        "--lease-namespace",
        lease_namespace,
        "-o",
        "json",
        *extra,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    found = json.loads(out)
    now = timestamps.parse_time(found["now"])
    assert now is not None
    seconds = {(c["namespace"], c["name"]): float(c["gpuSeconds"]) for c in found["claims"]}
    idle = None if found["idle"] is None else [c["name"] for c in found["idle"]]
    return CliAnswer(now=now, seconds=seconds, idle=idle)


def drift(counted: float, lifetime: float) -> float:
    return abs(counted - lifetime) / lifetime
