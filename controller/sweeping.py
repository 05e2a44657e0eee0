"""The sweep: what no watch event announces.

Every ``sweep_interval`` seconds, and once when this process starts leading:

* Leases whose claim is gone (not in the cache, and a GET says NotFound or
  another UID) are released: with their claim gone, no attempt can ever
  record them (``locking``, rule 3);
* claims whose Leases do not match their status, or whose devices changed,
  and Allocated claims with ``release: OnPodsCompleted`` or ``OnOwnerCompleted``
  (their pods or Job may have completed: neither is watched) are queued for a
  reconcile;
* nodes whose heartbeat went stale or fresh wake the pending claims;
* quota ledger entries of claims that are gone are taken out (``ledger``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from controller import cluster as kube
from controller import locking, statuses
from controller.gating import PodGate
from controller.ledger import Ledger
from controller.state import State
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
        *,
        wake: Callable[[str], None],
    ) -> None:
        self.cluster = cluster
        self.state = state
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
            gone = await locking.release(self.cluster, held.values())
            for info in gone:
                self.state.forget_lease(info.name, info.uid)
            orphans += len(gone)
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
        if locking.recorded(claim) != held or claim.spec.release in constants.RELEASES_WHEN_DONE:
            return True
        problems = statuses.allocation_problems(
            claim.status.allocations, statuses=self.state.statuses, nodes=self.state.facts
        )
        return statuses.devices_lost_condition(claim, problems, now=self.state.now()) is not None

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
