"""Keeping the node's GpuNodeStatus true, and its heartbeat Lease renewed.

``Publisher.step(desired)`` is one round:

1. If it holds no copy of the object, it reads it, or creates it when missing
   (``spec.nodeName`` and an ownerReference to the Node, so the object goes
   when the Node goes; without a Node it creates it without one and says so).
2. It compares the desired status with the object's status as the API server
   last returned it, ignoring ``lastHeartbeatTime`` and the conditions'
   ``lastTransitionTime``. If they differ it writes the whole status (a merge
   patch on the status subresource, conditional on the resourceVersion it
   read; keys the server has that the new status lacks are set to null).
   When the server's answer lacks part of what was written (it prunes the
   fields a GpuNodeStatus CRD older than the agent lacks), it says so once and
   does not write that status again until it changes or a refresh brings a new
   copy: a stale CRD costs a write per refresh, not one per round.
3. Otherwise, when ``heartbeat_interval`` has passed since its last write, it
   renews the node's heartbeat Lease (``gpualloc.api.leases.heartbeat_lease``,
   created when missing), as the kubelet renews its node Lease. Every
   ``STATUS_REFRESH_INTERVALS`` intervals (every interval when it has no
   heartbeat namespace) it writes the status's own heartbeat instead:
   ``lastHeartbeatTime`` and the conditions (whose transition times do not move
   while their status holds).

A status write's response becomes the new copy, so a change somebody else made
to the status is seen and undone at the next round after the next status
write, a few minutes at most. ``run`` loops: it waits for a wake-up (the scan
found something, a health event, a Lease) or the next heartbeat, and on errors
backs off (0.2 s doubling to 10 s); a Conflict or a NotFound drops the copy so
the next round re-reads (or re-creates) the object.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from agent import metrics as agent_metrics
from gpualloc.api import codecs, constants, models, timestamps
from gpualloc.api import leases as lease_format
from gpualloc.kube import errors, leases, resources
from gpualloc.kube.client import Api
from gpualloc.runtime import backoff

log = logging.getLogger(__name__)

Obj = dict[str, Any]
NodeLookup = Callable[[str], Awaitable[Obj | None]]
Renew = Callable[[dt.datetime], Awaitable[None]]

LABEL_GPU_COUNT = f"{constants.GROUP}/gpu.count"
LABEL_GPU_PRODUCT = f"{constants.GROUP}/gpu.product"
LABEL_GPU_MEMORY = f"{constants.GROUP}/gpu.memory"

MAX_BACKOFF = 10.0
STATUS_REFRESH_INTERVALS = 10  # the status's own heartbeat: every 10th (5 min at the default 30 s)


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# ------------------------------------------------------------------ pure parts


def comparable(inv: models.NodeInventory) -> models.NodeInventory:
    """The status without the fields a heartbeat moves."""
    return dataclasses.replace(
        inv,
        last_heartbeat_time=None,
        conditions=tuple(
            dataclasses.replace(c, last_transition_time="")
            for c in sorted(inv.conditions, key=lambda c: c.type)
        ),
    )


def read_status(server_status: Mapping[str, Any] | None) -> models.NodeInventory | None:
    """The server's status as a model; None when it is empty or unreadable (then it is rewritten)."""
    if not server_status:
        return None
    try:
        return codecs.decode(models.NodeInventory, dict(server_status), "status")
    except codecs.DecodeError:
        return None


def status_differs(server_status: Mapping[str, Any] | None, desired: models.NodeInventory) -> bool:
    """True when the server's status is not ``desired`` (timestamps aside)."""
    current = read_status(server_status)
    return current is None or comparable(current) != comparable(desired)


def merge_conditions(
    desired: Sequence[models.Condition], current: Sequence[models.Condition], now: str
) -> tuple[models.Condition, ...]:
    """``desired`` with each lastTransitionTime kept while the type's status holds, else ``now``."""
    by_type = {c.type: c for c in current}
    out = []
    for cond in desired:
        old = by_type.get(cond.type)
        if old is not None and old.status == cond.status and old.last_transition_time:
            out.append(dataclasses.replace(cond, last_transition_time=old.last_transition_time))
        else:
            out.append(dataclasses.replace(cond, last_transition_time=now))
    return tuple(out)


def conditions(
    *,
    source: str,
    source_error: str,
    devices: Sequence[models.Device],
) -> tuple[models.Condition, ...]:
    """Ready, NvmlReady (NVML source only) and DevicesLost, without timestamps."""
    out: list[models.Condition] = []
    if source_error:
        out.append(
            models.Condition(
                type=constants.CONDITION_READY,
                status="False",
                reason="SourceUnavailable",
                message=source_error[:32768],
            )
        )
    else:
        healthy = sum(1 for d in devices if d.health == constants.HEALTHY)
        out.append(
            models.Condition(
                type=constants.CONDITION_READY,
                status="True",
                reason="Publishing",
                message=f"{len(devices)} devices, {healthy} healthy",
            )
        )
    if source == "nvml":
        out.append(
            models.Condition(
                type=constants.CONDITION_NVML_READY,
                status="False" if source_error else "True",
                reason="InitFailed" if source_error else "Initialized",
                message=source_error[:32768],
            )
        )
    lost = [d for d in devices if d.health_reason.startswith("lost:")]
    lost_words = (f"{constants.device_display(d.index, d.uuid)}: {d.health_reason}" for d in lost)
    out.append(
        models.Condition(
            type=constants.CONDITION_DEVICES_LOST,
            status="True" if lost else "False",
            reason="DevicesLost" if lost else "NoDevicesLost",
            message="; ".join(lost_words)[:32768],
        )
    )
    return tuple(out)


def owner_reference(node: Mapping[str, Any]) -> Obj:
    meta = node.get("metadata") or {}
    return {"apiVersion": "v1", "kind": "Node", "name": meta.get("name", ""), "uid": meta.get("uid", "")}


def node_status_body(node_name: str, node: Mapping[str, Any] | None) -> Obj:
    metadata: Obj = {"name": node_name, "labels": {constants.LABEL_MANAGED_BY: constants.MANAGED_BY}}
    if node is not None:
        metadata["ownerReferences"] = [owner_reference(node)]
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.NODE_STATUS_KIND,
        "metadata": metadata,
        "spec": {"nodeName": node_name},
    }


_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9._-]+")


def sanitize_label_value(text: str) -> str:
    """Free text made a valid label value: ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA-H100-80GB-HBM3``.

    Each run of characters a label value may not hold becomes ``-``; the result
    is cut to 63 characters and trimmed of non-alphanumerics at both ends. (An
    object name is valid already and only needs shortening:
    ``constants.shorten_label_value``.)
    """
    value = _LABEL_VALUE_BAD.sub("-", text)[:63]
    return value.strip("-._")


def node_labels(inv: models.NodeInventory) -> dict[str, str]:
    """GFD-style labels: count, product and memory (MiB) of the node's first GPU model."""
    if not inv.devices:
        return {LABEL_GPU_COUNT: "0"}
    first = min(inv.devices, key=lambda d: d.index)
    return {
        LABEL_GPU_COUNT: str(len(inv.devices)),
        LABEL_GPU_PRODUCT: sanitize_label_value(first.product),
        LABEL_GPU_MEMORY: str(first.memory_mib),
    }


def heartbeat_renewer(api: Api, namespace: str, node_name: str, node_lookup: NodeLookup) -> Renew:
    """Renews ``node_name``'s heartbeat Lease in ``namespace``, creating it when it is missing,
    owned by the Node when there is one (the garbage collector deletes it with the Node)."""

    async def renew(now: dt.datetime) -> None:
        try:
            await leases.renew(api, namespace, node_name, now)
        except errors.NotFound:
            node = await node_lookup(node_name)
            owner = owner_reference(node) if node is not None else None
            body = lease_format.heartbeat_lease(namespace, node=node_name, now=now, owner=owner)
            with contextlib.suppress(errors.AlreadyExists):  # another round of ours made it meanwhile
                await leases.create(api, namespace, body)

    return renew


# -------------------------------------------------------------------- the loop


class Publisher:
    """Writes one node's GpuNodeStatus; see the module docstring."""

    def __init__(
        self,
        crs: resources.CustomResources,
        node_name: str,
        *,
        heartbeat_interval: float,
        node_lookup: NodeLookup,
        renew_heartbeat: Renew | None = None,
        metrics: agent_metrics.AgentMetrics | None = None,
        wall_clock: Callable[[], dt.datetime] = utc_now,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.crs = crs
        self.node_name = node_name
        self.heartbeat_interval = heartbeat_interval
        self.node_lookup = node_lookup
        self.renew_heartbeat = renew_heartbeat
        self.metrics = metrics
        self._wall = wall_clock
        self._mono = monotonic
        self.server: Obj | None = None  # the object as the API server last returned it
        self.last_write: float | None = None  # monotonic time of the last successful write
        self.last_status_write: float | None = None  # ... of the status (a change, or its heartbeat)
        self.writes: dict[str, int] = {"create": 0, "status": 0, "heartbeat": 0, "refresh": 0, "owner": 0}
        self.errors = 0
        # (resourceVersion, what was written) when the answer to the last status write lacked part of it
        self._kept_less: tuple[str, models.NodeInventory] | None = None

    # -- state ---------------------------------------------------------------

    def ready(self) -> bool:
        """Ready while writes succeed: one in the last three heartbeat intervals (at least 30 s)."""
        if self.last_write is None:
            return False
        return self._mono() - self.last_write <= max(3 * self.heartbeat_interval, 30.0)

    def seconds_until_heartbeat(self) -> float:
        if self.last_write is None:
            return 0.0
        return max(0.0, self.last_write + self.heartbeat_interval - self._mono())

    def _count(self, kind: str) -> None:
        self.writes[kind] += 1
        self.last_write = self._mono()
        if self.metrics is not None:
            self.metrics.status_writes.labels(kind).inc()

    # -- one round -------------------------------------------------------------

    async def step(self, desired: models.NodeInventory) -> str | None:
        """Bring the object up to ``desired``; the kind of write made, if any. Raises KubeError."""
        if self.server is None:
            self.server = await self._ensure()
        status = self.server.get("status") or {}
        now = timestamps.format_time(self._wall())
        current = read_status(status)
        conds = merge_conditions(desired.conditions, current.conditions if current else (), now)
        rv = (self.server.get("metadata") or {}).get("resourceVersion")
        if current is None or comparable(current) != comparable(desired):
            if self._kept_less == (rv, comparable(desired)):
                return await self._heartbeat(now, conds)  # written already: no rewrite on every round
            full = dataclasses.replace(desired, conditions=conds, last_heartbeat_time=now)
            body = codecs.encode(full)
            for key in status:
                if key not in body:
                    body[key] = None
            self.server = await self.crs.patch_node_status_status(
                self.node_name, {"status": body}, resource_version=rv or None
            )
            self._count("status")
            self.last_status_write = self.last_write
            log.info(
                "status written",
                extra={"node": self.node_name, "total": full.total, "healthy": full.healthy},
            )
            self._check_kept(desired)
            return "status"
        return await self._heartbeat(now, conds)

    def _check_kept(self, desired: models.NodeInventory) -> None:
        """Whether the API server kept the whole status just written. When it did not (it prunes
        the fields its GpuNodeStatus CRD lacks: a CRD older than this agent), the same status is
        not written again until it changes or the server's copy does (a refresh), and it says so."""
        answer = read_status((self.server or {}).get("status"))
        rv = ((self.server or {}).get("metadata") or {}).get("resourceVersion")
        if answer is not None and comparable(answer) == comparable(desired):
            self._kept_less = None
            return
        if self._kept_less is None:
            log.warning(
                "the API server did not keep the whole status: is the GpuNodeStatus CRD older than this"
                " agent? Apply the chart's CRDs (kubectl apply --server-side)",
                extra={"node": self.node_name},
            )
        self._kept_less = (str(rv), comparable(desired))

    async def _heartbeat(self, now: str, conds: tuple[models.Condition, ...]) -> str | None:
        """The status is as desired: renew the heartbeat when due (module docstring, step 3)."""
        if self.last_write is not None and self._mono() - self.last_write < self.heartbeat_interval:
            return None
        refresh_after = STATUS_REFRESH_INTERVALS * self.heartbeat_interval
        if (
            self.renew_heartbeat is None
            or self.last_status_write is None
            or self._mono() - self.last_status_write >= refresh_after
        ):
            patch = {
                "status": {
                    "lastHeartbeatTime": now,
                    "conditions": [codecs.encode(c) for c in conds],
                }
            }
            self.server = await self.crs.patch_node_status_status(self.node_name, patch)
            self._count("refresh")
            self.last_status_write = self.last_write
            return "refresh"
        await self.renew_heartbeat(self._wall())
        self._count("heartbeat")
        return "heartbeat"

    async def _lookup_node(self) -> Obj | None:
        try:
            return await self.node_lookup(self.node_name)
        except errors.NotFound:
            return None
        except errors.Unavailable:
            raise
        except errors.KubeError as exc:
            log.warning("cannot read the Node", extra={"node": self.node_name, "error": str(exc)})
            return None

    async def _ensure(self) -> Obj:
        try:
            obj = await self.crs.get_node_status(self.node_name)
        except errors.NotFound:
            node = await self._lookup_node()
            if node is None:
                log.warning(
                    "Node object not found; creating the GpuNodeStatus without an ownerReference",
                    extra={"node": self.node_name},
                )
            try:
                obj = await self.crs.create_node_status(node_status_body(self.node_name, node))
                self._count("create")
                log.info("GpuNodeStatus created", extra={"node": self.node_name, "owned": node is not None})
            except errors.AlreadyExists:
                obj = await self.crs.get_node_status(self.node_name)
            return obj
        refs = (obj.get("metadata") or {}).get("ownerReferences") or []
        node = await self._lookup_node()
        if node is not None:
            want = owner_reference(node)
            if not any(r.get("kind") == "Node" and r.get("uid") == want["uid"] for r in refs):
                others = [r for r in refs if r.get("kind") != "Node"]
                obj = await self.crs.patch_node_status(
                    self.node_name, {"metadata": {"ownerReferences": [*others, want]}}
                )
                self._count("owner")
                log.info("ownerReference to the Node set", extra={"node": self.node_name})
        return obj

    # -- the loop ----------------------------------------------------------------

    async def run(self, desired: Callable[[], models.NodeInventory], wake: asyncio.Event) -> None:
        """Publish until cancelled. ``wake`` asks for a round now."""
        failures = 0
        while True:
            wake.clear()
            try:
                await self.step(desired())
                failures = 0
                timeout = self.seconds_until_heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                self.errors += 1
                if self.metrics is not None:
                    self.metrics.publish_errors.inc()
                if isinstance(exc, errors.Conflict | errors.NotFound | codecs.DecodeError):
                    self.server = None  # re-read (or re-create) before the next write
                timeout = backoff.exponential(failures, base=0.2, cap=MAX_BACKOFF)
                level = logging.WARNING if isinstance(exc, errors.KubeError) else logging.ERROR
                log.log(
                    level,
                    "publishing failed; retrying",
                    extra={"node": self.node_name, "error": str(exc), "retry_in": timeout},
                    exc_info=not isinstance(exc, errors.KubeError),
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout)
