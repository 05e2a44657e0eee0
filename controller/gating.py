"""The gate: every claim pod waits at it until the controller has checked its claim.

The webhook admits every pod with the annotation ``gpu.scheduling/claim``
behind the scheduling gate ``gpu.scheduling/claim-allocated``: a pod of a claim
not Allocated yet with no devices, a pod of an Allocated claim with the devices
the webhook's watch showed. Once the claim is Allocated, the controller reads
it from the API server (same uid, not being deleted or released) and judges
each pod on that read: the pod gets the ``gpu.scheduling/devices`` annotation
(its replica's UUIDs), a ``kubernetes.io/hostname`` nodeSelector, and loses the
gate (``gates.ungate_patch``). The pod existed before its gate was lifted, so a
release that lists the claim's pods finds it. A pod that cannot be released (no
replica, a conflicting pin, devices from an out-of-date view of the claim, a
Failed or deleted claim) gets a ``StillGated`` Warning, at most once per
``event_interval`` for the same message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from controller import cluster as kube
from controller import gates
from controller.state import State
from controller.writer import Writer
from gpualloc.api import codecs, constants, models
from gpualloc.kube import errors

log = logging.getLogger(__name__)

Obj = dict[str, Any]

EVENT_STILL_GATED = "StillGated"


class PodGate:
    def __init__(
        self,
        cluster: kube.Cluster,
        state: State,
        writer: Writer,
        *,
        requeue: Callable[[str, float], None],
        event_interval: float,
    ) -> None:
        self.cluster = cluster
        self.state = state
        self.writer = writer
        self.requeue = requeue
        self.event_interval = event_interval
        self._warned: dict[str, tuple[str, float]] = {}  # pod key -> (message, monotonic time)

    async def ungate(self, claim: models.GpuClaim) -> None:
        gated = list(self.state.gated_pods(claim.key))
        if not gated:
            return
        current = await self._current(claim)
        if current is None:
            return
        claim = current  # what the pods get is decided on what the API server holds now
        for pod_key, pod in gated:
            allocation, why = gates.pod_allocation(pod, claim)
            if allocation is None:
                self._warn(pod_key, pod, why)
                continue
            conflict = gates.placement_conflict(pod, claim, allocation)
            if conflict is not None:
                self._warn(pod_key, pod, conflict)
                continue
            meta = pod.get("metadata") or {}
            try:
                await self.writer.pod(
                    str(meta.get("namespace", "")),
                    str(meta.get("name", "")),
                    gates.ungate_patch(pod, allocation),
                )
            except errors.NotFound:
                continue
            except (errors.Invalid, errors.BadRequest, errors.Conflict) as exc:
                # The gates changed under us (the patch's test failed): try again with a fresh cache.
                log.info("pod changed while un-gating, retrying", extra={"pod": pod_key, "error": str(exc)})
                self.requeue(claim.key, 1.0)
                continue
            self._warned.pop(pod_key, None)
            log.info(
                "pod un-gated",
                extra={
                    "pod": pod_key,
                    "claim": claim.key,
                    "node": allocation.node_name,
                    "replica": allocation.replica,
                },
            )

    async def _current(self, claim: models.GpuClaim) -> models.GpuClaim | None:
        """The claim as the API server holds it now, if it is still ``claim`` (same uid), not being
        deleted, Allocated and not releasing; else None (and a retry soon).

        A pod names its claim, not the claim's uid, and the caches may be behind: a controller
        whose cache still held a deleted claim released the pods of a new claim of the same name
        onto the old one's devices (the deterministic simulation, seed 1261337); and a pod the
        webhook admitted from an out-of-date view carries devices the claim may have given up
        since (moved off a lost node, say). So the devices are checked against this read. The
        pod existed before it, so a release that starts after it lists the pod and waits."""
        namespace, name = claim.metadata.namespace, claim.metadata.name
        try:
            raw = await self.cluster.get_claim(namespace, name)
        except errors.NotFound:
            return None
        metadata = raw.get("metadata") or {}
        if metadata.get("uid") == claim.metadata.uid and not metadata.get("deletionTimestamp"):
            current = codecs.parse_claim(raw)
            if current.status.phase == constants.PHASE_ALLOCATED and not current.releasing:
                return current
        log.info("claim changed under the cache; not un-gating its pods yet", extra={"claim": claim.key})
        self.requeue(claim.key, 1.0)
        return None

    def warn_gated(self, claim: models.GpuClaim, message: str) -> None:
        """A Warning event on each pod still gated for a claim that will not release it."""
        for pod_key, pod in list(self.state.gated_pods(claim.key)):
            self._warn(pod_key, pod, message)  # events.emit cuts it to 1024

    def _warn(self, pod_key: str, pod: Obj, message: str) -> None:
        mono = time.monotonic()
        last = self._warned.get(pod_key)
        if last is not None and last[0] == message and mono - last[1] < self.event_interval:
            return
        self._warned[pod_key] = (message, mono)
        log.warning("gated pod cannot be released", extra={"pod": pod_key, "reason": message})
        self.writer.emit(pod, EVENT_STILL_GATED, message, "Warning")

    def prune(self) -> None:
        """Forget the warnings of pods that are gone."""
        pods = self.state.feeds["pods"].cache
        for pod_key in [k for k in self._warned if k not in pods]:
            del self._warned[pod_key]
