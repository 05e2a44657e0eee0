"""The sweep: what no watch event announces.

Every ``sweep_interval`` seconds, and once when this process starts leading:

* Leases whose claim is gone (not in the cache, and a GET says NotFound or
  another UID) are released: with their claim gone, no attempt can ever
  record them (``locking``, rule 3); but not while a live pod that names the
  claim was given the Lease's device (an authoritative list of the claim's
  namespace's pods, made after the claim was found gone: ``gates.held_by_pods``).
  Pods are the ground truth of use: a claim whose finalizer was stripped, or
  that vanished otherwise, leaves its GPUs locked until its pods end. A pod of
  its name still at our gate may be un-gated onto those GPUs by a controller
  that read the claim before it vanished, so each one is fenced first
  (``gates.fence_patch``; an un-gate tests the pod's resourceVersion); until
  every fence holds, nothing is released;
* claims whose Leases do not match their status, or whose devices changed,
  and Allocated claims with ``release: OnPodsCompleted`` or ``OnOwnerCompleted``
  (their pods or Job may have completed: neither is watched) are queued for a
  reconcile;
* nodes whose heartbeat went stale or fresh wake the pending claims they could hold;
* quota ledger entries of claims that are gone are taken out (``ledger``),
  once they hold no Lease and their pods hold no device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from controller import cluster as kube
from controller import gates, locks, statuses
from controller.gating import PodGate
from controller.ledger import Ledger
from controller.state import State
from controller.writer import Writer
from gpualloc.api import constants, leases
from gpualloc.kube import errors

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(
        self,
        cluster: kube.Cluster,
        state: State,
        gate: PodGate,
        ledger: Ledger,
        writer: Writer,
        *,
        wake: Callable[[str], None],
    ) -> None:
        self.cluster = cluster  # reads; every write goes through the writer
        self.state = state
        self.writer = writer
        self.gate = gate
        self.ledger = ledger
        self.wake = wake
        self.sweeps = 0

    async def sweep(self) -> None:
        if not self.state.synced():
            return
        self.sweeps += 1
        orphans = 0
        for holder, held in sorted(self.state.holders().items()):
            if self.state.claim_key_of(holder) is not None or await self._claim_exists(holder, held.values()):
                continue
            free = await self._not_used_by_pods(held.values())
            orphans += len(await self.writer.release(free))
        if orphans:
            log.info("released leases of vanished claims", extra={"leases": orphans})
        for quota in self.state.all_quotas():
            await self.ledger.drop_gone(quota)
        for key in self.state.claim_keys():
            if self._needs_attention(key):
                self.wake(key)
        self.state.refresh_readiness()
        self.gate.prune()

    def _needs_attention(self, key: str) -> bool:
        claim = self.state.claim(key)
        if claim is None:
            return False
        held = set(self.state.held_by(claim.metadata.uid))
        if claim.metadata.deletion_timestamp or claim.status.phase != constants.PHASE_ALLOCATED:
            return bool(held)  # a reconcile releases them
        if locks.recorded(claim) != held or claim.spec.release in constants.RELEASES_WHEN_DONE:
            return True
        problems = statuses.allocation_problems(
            claim.status.allocations, statuses=self.state.statuses, nodes=self.state.facts
        )
        return statuses.devices_lost_condition(claim, problems, now=self.state.now()) is not None

    async def _not_used_by_pods(self, held: Iterable[leases.LeaseInfo]) -> list[leases.LeaseInfo]:
        """The Leases of a vanished claim that none of its live pods needs any more (module docstring)."""
        held = list(held)
        named = next((i for i in held if i.claim_name), None)
        if named is None:
            return held
        pods = await self.cluster.list_pods(named.claim_namespace)
        devices = gates.held_by_pods(named.claim_name, pods)
        kept = [info for info in held if any(locks.locks_device(info.name, uuid) for uuid in devices)]
        if len(kept) < len(held) and not await self._fence(named, pods):
            kept = held
        if kept:
            log.warning(
                "leases of a vanished claim kept: its pods still use them",
                extra={
                    "claim": f"{named.claim_namespace}/{named.claim_name}",
                    "leases": ",".join(sorted(i.name for i in kept)),
                },
            )
        return [info for info in held if info not in kept]

    async def _fence(self, named: leases.LeaseInfo, pods: Iterable[dict[str, Any]]) -> bool:
        """Fence every pod of the vanished claim still at our gate (module docstring); False when one
        changed meanwhile (un-gated, say): its claim's Leases are looked at again by the next sweep."""
        for pod in gates.pods_using(named.claim_name, pods):
            if not gates.is_gated(pod):
                continue
            meta = pod.get("metadata") or {}
            if (meta.get("annotations") or {}).get(constants.ANNOTATION_CLAIM_GONE) == named.holder:
                continue  # fenced by an earlier sweep, and not un-gated since
            try:
                await self.writer.pod(
                    named.claim_namespace, str(meta.get("name", "")), gates.fence_patch(pod, named.holder)
                )
            except errors.NotFound:
                continue
            except (errors.Invalid, errors.BadRequest, errors.Conflict):
                return False
        return True

    async def _claim_exists(self, uid: str, held: Iterable[leases.LeaseInfo]) -> bool:
        """Ask the API server (not the cache) whether the claim holding these Leases still exists."""
        named = next((i for i in held if i.claim_name), None)
        if named is None:
            return False  # a managed Lease naming no claim is nobody's
        try:
            raw = await self.cluster.get_claim(named.claim_namespace, named.claim_name)
        except errors.NotFound:
            return False
        return str((raw.get("metadata") or {}).get("uid", "")) == uid
