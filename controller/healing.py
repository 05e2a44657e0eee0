"""The path of an Allocated claim whose GPU failed: ``onDeviceFailure: Reallocate``.

``Healer.heal`` moves only the replicas that hold an Unhealthy GPU (``failures``), once the
``DevicesUnhealthy`` condition has been True for ``deviceFailureGracePeriodSeconds``:

1. It plans their new GPUs on the caches first; when none fit, nothing moves (the condition says
   why) and it looks again later: evicting pods that have nowhere to go helps nobody.
2. It fences the claim (``Releasing``, reason ``DeviceFailed``: the webhook admits no pod of it
   while it moves), then, on an authoritative list of the pods, evicts the moving replicas' pods
   through the Eviction API (PodDisruptionBudgets hold; a blocked one is tried again every
   ``in_use_poll`` seconds). Pods of the other replicas are not touched.
3. Once no pod of a moving replica uses its GPUs, it plans again, locks the new GPUs (``locking``:
   Leases created by this attempt, stamped with the claim's resourceVersion) and writes the new
   allocations conditional on that version, lifting the fence in the same write. The old GPUs of
   the moved replicas are then leftovers (no status lists them, their version is gone) and are
   released by rule 3 of ``locking``; the kept replicas' Leases are never touched.

Every write goes through the ``Writer``; the decisions are ``failures``' and ``allocator``'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from controller import allocator, failures, gates, locks, quotas, statuses, views
from controller import cluster as kube
from controller.ledger import Ledger
from controller.settings import Settings
from controller.state import State
from controller.writer import Writer
from gpualloc.api import constants, models
from gpualloc.kube import errors

log = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class Healer:
    cluster: kube.Cluster  # reads; every write goes through the writer
    state: State
    writer: Writer
    ledger: Ledger
    settings: Settings
    requeue: Callable[[str, float], None]

    async def heal(self, claim: models.GpuClaim, problems: Sequence[statuses.Problem]) -> bool:
        """Move the failed replicas of an ``onDeviceFailure: Reallocate`` claim (module docstring).
        True when the caller should stop (a write was made, or is awaited)."""
        fenced = statuses.fence_reason(claim) == failures.REASON_DEVICE_FAILED
        reallocate = claim.spec.on_device_failure == constants.DEVICE_FAILURE_REALLOCATE
        moving = failures.failed(claim, problems) if reallocate else []
        if not moving:
            if fenced:  # the GPU is back before the move: lift our fence
                fence = statuses.releasing_condition(claim, on=False, now=self.state.now())
                await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
                return True
            return False
        if claim.releasing and not fenced:
            return False  # another path's fence: it decides first
        now = self.state.now()
        if not failures.unhealthy_since(claim):
            return False  # the condition is written first (the caller's _maintain): the grace counts from it
        wait = claim.spec.device_failure_grace_period_seconds - failures.unhealthy_for(claim, now)
        if wait > 0:
            self.requeue(claim.key, wait)
            return False
        placed, why_not = self._plan(claim, moving)
        if not placed:
            if fenced:
                fence = statuses.releasing_condition(claim, on=False, now=now)
                await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
            log.warning("a failed replica has nowhere to go", extra={"claim": claim.key, "reason": why_not})
            self.requeue(claim.key, max(self.settings.in_use_poll, 5.0))
            return False
        if not fenced:
            why = f"replica {', '.join(map(str, moving))} holds a failed GPU"
            fence = statuses.releasing_condition(
                claim, on=True, now=now, why=why, reason=failures.REASON_DEVICE_FAILED
            )
            written = await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
            return True if written is None else await self.heal(written, problems)  # look again
        if await self._evict(claim, moving):
            return True
        return await self._move(claim, moving, problems)

    def _plan(self, claim: models.GpuClaim, moving: Sequence[int]) -> tuple[list[models.Allocation], str]:
        """New allocations for the ``moving`` replicas, on the caches; ([], why) when none fit."""
        index = self.state.node_index()
        labels = {name: facts.labels for name, facts in self.state.facts.items()}
        tries = [failures.replacement(claim, moving, labels)]
        loose = failures.unbound(claim, moving)
        if loose is not None:
            tries.append(loose)
        reason = ""
        for asked in tries:
            decision = allocator.allocate(
                asked,
                index,
                seed=views.seed_for(claim.metadata.uid),
                cost_label=self.settings.cost_label,
            )
            if decision.allocations:
                return failures.renumbered(decision.allocations, moving), ""
            reason = decision.reason
        return [], reason

    async def _evict(self, claim: models.GpuClaim, moving: Sequence[int]) -> bool:
        """Evict the pods of the ``moving`` replicas; True while any is left, the claim looked at
        again later. Gated pods too: they hold no GPU yet, but a gate that read the claim before
        the fence may still lift theirs with the old devices (the simulation, seed 600,940); their
        owners create them again, and the webhook admits them once the move is written."""
        pods = await self.cluster.list_pods(claim.metadata.namespace)
        using = [p for p in gates.pods_using(claim.metadata.name, pods) if gates.replica_index(p) in moving]
        if not using:
            return False
        blocked = []
        for pod in using:
            meta = pod.get("metadata") or {}
            try:
                await self.writer.evict(
                    claim.metadata.namespace, str(meta.get("name", "")), uid=str(meta.get("uid", ""))
                )
            except (errors.NotFound, errors.Conflict):
                continue
            except errors.Unavailable as exc:
                if exc.status != 429:
                    raise
                blocked.append(str(meta.get("name", "")))
        log.info(
            "evicting the pods of a failed replica",
            extra={"claim": claim.key, "replicas": ",".join(map(str, moving)), "blocked": ",".join(blocked)},
        )
        self.requeue(claim.key, self.settings.in_use_poll if blocked else 0.5)
        return True

    async def _move(
        self, claim: models.GpuClaim, moving: Sequence[int], problems: Sequence[statuses.Problem]
    ) -> bool:
        """Lock the moving replicas' new GPUs and record them (module docstring, step 3)."""
        uid = claim.metadata.uid
        leftovers = list(self.state.held_by(uid).values())  # seen before any write below
        placed, why_not = self._plan(claim, moving)
        if not placed:
            self.requeue(claim.key, max(self.settings.in_use_poll, 5.0))
            log.warning("a failed replica has nowhere to go", extra={"claim": claim.key, "reason": why_not})
            return True
        kept = [a for a in claim.status.allocations if a.replica not in moving]
        product = quotas.products_of([*kept, *placed], self.state.statuses)
        if not self.ledger.holds(claim, product):
            log.warning(
                "the new GPUs are not admitted by a quota", extra={"claim": claim.key, "product": product}
            )
            self.requeue(claim.key, max(self.settings.in_use_poll, 5.0))
            return True
        plan = locks.lock_plan(placed)
        names = [item.lease for item in plan]
        self.state.reserve(names, uid)
        try:
            result = await self.writer.lock(self.settings.namespace, plan, claim, now=self.state.now())
        finally:
            self.state.unreserve(names, uid)
        if not result.ok:
            self.requeue(claim.key, 0.5)
            return True
        why = "; ".join(p.detail for p in failures.unhealthy(problems))
        patch = failures.replaced_status(claim, placed, why=why, now=self.state.now())
        written = await self.writer.claim_status(claim, patch)
        if written is None:
            # Our write failed for good: no status will ever list these Leases (locking, rule 2).
            await self.writer.release(result.held)
            return True
        await self.writer.release_leftovers(written, leftovers, written)
        log.warning("moved a failed replica", extra={"claim": claim.key, "moved": written.status.message})
        self.writer.claim_event(claim, failures.REASON_REALLOCATED, written.status.message, "Normal")
        self.requeue(claim.key, 0)
        return True


def node_event_target(node: str) -> dict[str, object]:
    """The object an Event about a Node names."""
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "uid": node}}
