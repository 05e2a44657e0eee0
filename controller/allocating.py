"""The Pending path of a reconcile: plan a claim, admit it, lock its devices, record them.

``PendingReconciler.allocate`` plans on the caches (``allocator.allocate``), has
the plan admitted by its namespace's quotas (``ledger``; over a quota it stays
Pending with reason ``QuotaExceeded`` and the quota's message), locks the
chosen devices (``locking``; on a device taken meanwhile it plans again, up to
``LOCK_ATTEMPTS`` times), writes the status at the resourceVersion it planned
from, then releases leftovers and un-gates the claim's pods. Every write goes
through the ``Writer``. When nothing fits, a claim of higher priority may
preempt (``preemption``), else it stays Pending with the reason,
``AllocationFailed`` (at most once per ``event_interval`` per claim unless the
reason changes), a retry with backoff (``retryPolicy``), Failed after
``maxRetries`` retries.

How the devices are chosen is ``allocator``'s; this file is the transaction
around the choice.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence

from controller import (
    allocator,
    asks,
    gates,
    locking,
    locks,
    preemption,
    quotas,
    retries,
    statuses,
    views,
    waking,
)
from controller import metrics as controller_metrics
from controller.gating import PodGate
from controller.ledger import Ledger
from controller.nodes import NodeIndex
from controller.settings import Settings
from controller.state import State
from controller.writer import Writer
from gpualloc.api import constants, leases, models, taints, timestamps

log = logging.getLogger(__name__)

LOCK_ATTEMPTS = 3  # plans tried per reconcile when another claim wins a device


class PendingReconciler:
    def __init__(
        self,
        state: State,
        writer: Writer,
        ledger: Ledger,
        gate: PodGate,
        settings: Settings,
        metrics: controller_metrics.Metrics,
        *,
        rng: random.Random,
        requeue: Callable[[str, float], None],
    ) -> None:
        self.state = state
        self.writer = writer
        self.ledger = ledger
        self.gate = gate
        self.settings = settings
        self.metrics = metrics
        self.rng = rng
        self.requeue = requeue
        self._retry: dict[str, retries.RetryState] = {}
        self._failed_event: dict[str, tuple[str, float]] = {}
        self._rr_cursor = 0

    def forget(self, key: str) -> None:
        """The claim is gone: drop what was remembered about it."""
        self._retry.pop(key, None)
        self._failed_event.pop(key, None)

    def _now(self) -> datetime.datetime:
        return self.state.now()

    # ------------------------------------------------------------------ allocate

    async def allocate(self, claim: models.GpuClaim) -> None:
        """Allocate a Pending claim (the module docstring)."""
        key = claim.key
        uid = claim.metadata.uid
        claim, refused_tolerations = self._tolerated(claim)  # planned (and preempting) with these only
        claim = asks.with_pods_requests(
            claim, (gates.requests_of(pod) for _, pod in self.state.gated_pods(key))
        )
        retry = self._retry.get(key)
        if retry is None or retry.generation != claim.metadata.generation:
            self.state.recent.observe_claim(claim)
            if retry is not None:  # the spec changed: a fresh start
                retry = retries.RetryState(generation=claim.metadata.generation)
            else:
                retry = retries.initial_retry_state(claim)
            self._retry[key] = retry
        leftovers = list(self.state.held_by(uid).values())  # seen before any write below
        too_many = self.state.too_many_claims(claim)  # GpuQuota.spec.maxClaims
        if too_many:
            await self._unfit(claim, too_many, leftovers, why=waking.REASON_TOO_MANY_CLAIMS)
            return
        over_quota = self.ledger.check(claim)
        if over_quota:
            await self._unfit(claim, over_quota, leftovers, why=quotas.REASON)
            return
        result: locking.LockResult | None = None
        decision: allocator.Decision | None = None
        for _ in range(LOCK_ATTEMPTS):
            node_index = self.state.node_index()
            decision = allocator.allocate(
                claim,
                node_index,
                seed=views.seed_for(uid),
                round_robin_cursor=self._rr_cursor,
                cost_label=self.settings.cost_label,
                workload=self.state.recent.workload(),
            )
            if not decision.allocations:
                preempting = await self._preempt(claim, node_index)
                if preempting is None:
                    reason = self._with_refused(claim, decision.reason, refused_tolerations, node_index)
                    await self._unfit(claim, reason, leftovers)
                else:
                    message, reason = preempting
                    await self._unfit(claim, message, leftovers, why=reason)
                return
            product = quotas.products_of(decision.allocations, self.state.statuses)
            if not self.ledger.holds(claim, product):
                refused = await self.ledger.admit(claim, product)
                if refused is None:
                    return  # a ledger changed meanwhile: retried shortly
                if refused:
                    await self._unfit(claim, refused, leftovers, why=quotas.REASON)
                    return
                continue  # admitted: plan again, as the caches may have moved while it was written
            plan = locks.lock_plan(decision.allocations)
            names = [item.lease for item in plan]
            # Planned and reserved without an await in between: two workers of this process never
            # pick the same device; another process is stopped by the Lease itself.
            self.state.reserve(names, uid)
            try:
                result = await self.writer.lock(self.settings.namespace, plan, claim, now=self._now())
            finally:
                self.state.unreserve(names, uid)
            if result.ok:
                self._advance_cursor(node_index, decision.allocations)
                break
            self.metrics.allocation_failures.labels(reason="LockConflict").inc()
        if result is not None and result.conflict in {i.name for i in leftovers if i.milli}:
            # Our own earlier attempt's share is in that GPU's ledger, and a share is never adopted
            # (locking, rule 1): say so, which moves the claim on, so that rule 3 releases it.
            message = f"an earlier attempt's share in Lease {result.conflict} is released first"
            await self._unfit(claim, message, leftovers)
            return
        if result is None or decision is None or not result.ok:
            self.requeue(key, 0.2 + self.rng.random())
            return
        now = self._now()
        patch = statuses.allocated_status(claim, decision.allocations, now=now)
        written = await self.writer.claim_status(claim, patch)
        if written is None:
            # Our write failed for good: no status will ever list these Leases (locking, rule 2).
            await self.writer.release(result.held)
            return
        await self.writer.release_leftovers(written, leftovers, written)
        self._retry.pop(key, None)
        self._failed_event.pop(key, None)
        self.metrics.claims_allocated.labels(strategy=claim.spec.strategy).inc()
        created = timestamps.parse_time(claim.metadata.creation_timestamp)
        if created is not None:
            self.metrics.time_to_allocated.observe(max(0.0, (now - created).total_seconds()))
        status = patch["status"]
        log.info(
            "allocated",
            extra={"claim": key, "nodes": status["nodes"], "devices": status["devices"], "uid": uid},
        )
        # No Event: the status written just now says the same (condition Allocated, its message and
        # transition time), and an Event would be one more write per allocation (issue 20).
        await self.gate.ungate(written)

    def _tolerated(self, claim: models.GpuClaim) -> tuple[models.GpuClaim, tuple[models.Toleration, ...]]:
        """The claim with only the tolerations its namespace's GpuQuotas allow, and those it may not
        use (``asks.allowed_tolerations``); as it is with ``--claim-tolerations Any``."""
        if self.settings.claim_tolerations == "Any" or not claim.spec.tolerations:
            return claim, ()
        kept, refused = asks.allowed_tolerations(claim, self.state.quotas(claim.metadata.namespace))
        if not refused:
            return claim, ()
        return dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, tolerations=kept)), refused

    @staticmethod
    def _with_refused(
        claim: models.GpuClaim, reason: str, refused: Sequence[models.Toleration], node_index: NodeIndex
    ) -> str:
        """``reason``, and the refused tolerations that would have let the claim onto a node."""
        if not refused:
            return reason
        note = asks.refused_note(
            refused,
            taints.claim_tolerations(claim.spec),
            (view.taints for view in node_index.views()),
            claim.metadata.namespace,
        )
        return f"{reason}; {note}" if note else reason

    def _advance_cursor(self, node_index: NodeIndex, allocations: Iterable[models.Allocation]) -> None:
        last = list(allocations)[-1].node_name
        if node_index.get(last) is not None:
            self._rr_cursor = node_index.position(last) + 1

    async def _unfit(
        self,
        claim: models.GpuClaim,
        reason: str,
        leftovers: Sequence[leases.LeaseInfo],
        *,
        why: str = statuses.REASON_INSUFFICIENT,
    ) -> None:
        """The attempt failed (``reason``): say so in the status, only if that changes it (an
        attempt that an event triggered before the backoff ran out, with the same reason, writes
        nothing), and try again after the backoff. ``TooManyClaims`` is no attempt: it is not
        counted against ``maxRetries`` and is not retried on a timer; the claim is woken when it
        comes inside its namespace's count limit (``State``)."""
        key = claim.key
        policy = claim.spec.retry_policy
        mono = time.monotonic()
        # The claim may have been deleted (and forgotten) while this reconcile awaited.
        before = self._retry.get(key) or retries.initial_retry_state(claim)
        parked = why == waking.REASON_TOO_MANY_CLAIMS
        if parked:
            retry, counted = before, False
        else:
            retry, counted = retries.record_failure(before, now=mono, policy=policy, jitter=self.rng.random())
        self._retry[key] = retry
        exhausted = not parked and retries.retries_exhausted(retry, policy)
        if exhausted:
            phase, cond_reason = constants.PHASE_FAILED, statuses.REASON_RETRIES_EXHAUSTED
            message = f"{reason} (gave up after {retry.retry_count} retries)"
        else:
            phase, cond_reason = constants.PHASE_PENDING, why
            message = reason
        now = self._now()
        patch = statuses.unallocated_status(
            claim, phase=phase, reason=cond_reason, message=message, retry_count=retry.retry_count, now=now
        )
        # A leftover stamped with this very version may belong to a live attempt, or to a dead one:
        # a write that moves the claim on settles which (locking, rule 3).
        fence = any(info.claim_resource_version == claim.metadata.resource_version for info in leftovers)
        if fence:
            patch["status"]["lastScheduleTime"] = timestamps.format_time(now)
        current = next((c for c in claim.status.conditions if c.type == constants.CONDITION_ALLOCATED), None)
        must_write = (
            counted
            or fence
            or claim.status.phase != phase
            or current is None
            or current.reason != cond_reason
            or claim.status.observed_generation != claim.metadata.generation
        )
        written: models.GpuClaim | None = None
        if must_write and (fence or statuses.status_differs(claim, patch)):
            written = await self.writer.claim_status(claim, patch)
            if written is None:
                return
        await self.writer.release_leftovers(claim, leftovers, written)
        if counted and not exhausted:
            self.metrics.allocation_retries.inc()  # one more retry scheduled with backoff
        if counted:
            self.metrics.allocation_failures.labels(reason=cond_reason).inc()
            last = self._failed_event.get(key)
            if last is None or last[0] != message or mono - last[1] >= self.settings.event_interval:
                self._failed_event[key] = (message, mono)
                self.writer.claim_event(claim, "AllocationFailed", message, "Warning")
            log.info("not allocated", extra={"claim": key, "reason": message, "retry": retry.retry_count})
        if parked:
            return
        if not exhausted:
            self.requeue(key, max(0.0, retry.not_before - mono))
        elif written is not None:
            # Once more, as Failed: its leftovers go, and its gated pods are told why they stay gated.
            # Nothing else would wake it: our own write's event does not.
            self.requeue(key, 0.0)

    # ------------------------------------------------------------------ preemption

    def _priority(self, claim: models.GpuClaim) -> int:
        cap = quotas.max_priority(self.state.quotas(claim.metadata.namespace))
        return claim.spec.priority if cap is None else min(claim.spec.priority, cap)

    async def _preempt(self, claim: models.GpuClaim, node_index: NodeIndex) -> tuple[str, str] | None:
        """A claim that fits nowhere: mark the claims it preempts (``preemption``) Preempted. What it
        waits for and the condition's reason: ("preempting ns/a (4 GPUs, priority 1)", Preempting);
        the quota's message and QuotaExceeded when only plans its namespace's quotas refuse were
        found (nobody is preempted then); None when it may preempt nobody.

        Admission before preemption: a plan counts only if every quota of the claim's namespace
        would admit the claim on the devices it names (``quotas.admissible``; preemption frees
        GPUs, never quota: the victims still count), and the claim is entered in its ledgers (a
        write conditional on each quota's version) before any victim is marked, so no claim is
        preempted for a preemptor held back by its quota.
        A claim that asks more GPUs per replica than any node has never searches.

        A victim is marked with a write conditional on its resourceVersion, so a victim that moved on
        meanwhile is left alone (the next try plans again). Its pods are evicted and its Leases
        released by its own reconciles; this claim is allocated once the Leases are gone."""
        scope = self.settings.preemption_scope
        if claim.spec.preemption_policy == constants.PREEMPT_NEVER or scope == "None":
            return None
        if self._priority(claim) <= 0:
            # Nobody has a lower priority (the CRD's minimum is 0): no need to look at every claim,
            # which the many claims of priority 0 that fit nowhere would each do at every retry.
            return None
        if preemption.exceeds_every_node(claim, (bucket.total for bucket in node_index.buckets())):
            return None  # fits nowhere whoever goes: the many such claims of a flood never search
        every = [c for c in (self.state.claim(key) for key in self.state.claim_keys()) if c is not None]
        waiting = sorted(
            c.key
            for c in every
            if c.status.phase == constants.PHASE_PREEMPTED
            and c.status.preempted_by == claim.key
            and (c.status.allocations or self.state.held_by(c.metadata.uid))
        )
        if waiting:  # preempted already: wait until they have let go (Leases too) rather than preempt more
            message = f"waiting for the claims it preempted to release their GPUs: {', '.join(waiting)}"
            return message, statuses.REASON_PREEMPTING
        pool = preemption.candidates(claim, every, priority=self._priority, cluster_scope=scope == "Cluster")
        if not pool:
            return None
        if claim.spec.replicas == 1:  # searched node by node: only the nodes that hold candidates
            held = {a.node_name for c in pool for a in c.status.allocations}
            node_views = [view for name in sorted(held) if (view := node_index.get(name)) is not None]
        else:
            node_views = node_index.views()
        seed = views.seed_for(claim.metadata.uid)
        namespace_quotas = self.state.quotas(claim.metadata.namespace)
        refused: list[str] = []

        def place(candidate_views: Sequence[allocator.NodeView]) -> allocator.Decision:
            return allocator.allocate(claim, candidate_views, seed=seed, cost_label=self.settings.cost_label)

        def admit(decision: allocator.Decision) -> str:
            if not namespace_quotas:
                return ""
            product = quotas.products_of(decision.allocations, self.state.statuses)
            why = quotas.admissible(namespace_quotas, claim, product)
            if why and not refused:
                refused.append(why)
            return why

        plan = preemption.choose(claim, pool, node_views, place, priority=self._priority, admit=admit)
        if plan is None:
            return (refused[0], quotas.REASON) if refused else None
        # Admitted by the API server before any victim is marked: the ledgers are written at the
        # version they were read at, so a cache that missed another controller's admission can never
        # preempt for a claim its quota then refuses (the deterministic simulation found one, seed
        # 7012999). Its room is then held for it while the victims let go.
        product = quotas.products_of(plan.decision.allocations, self.state.statuses)
        if not self.ledger.holds(claim, product):
            why = await self.ledger.admit(claim, product)
            if why is None:
                return None  # a ledger changed meanwhile: looked at again shortly
            if why:
                return why, quotas.REASON
        cached = self.state.claim(claim.key)
        if cached is None or cached.metadata.resource_version != claim.metadata.resource_version:
            # It moved on while this reconcile planned on the claim as read (deleted, or allocated
            # by another controller and even released since: simulation seeds 9,358,316 and
            # 11,326,617): nobody is preempted for it; its next reconcile looks again. A move that
            # lands after this look cannot be ruled out by any write (a victim's is conditional
            # on the victim's version alone), as with Kubernetes' own preemption.
            return None
        now = self._now()
        for victim in plan.victims:
            written = await self.writer.claim_status(
                victim, statuses.preempted_status(victim, by=claim, now=now)
            )
            if written is None:
                break
            log.warning("preempted", extra={"claim": victim.key, "by": claim.key})
            self.writer.claim_event(victim, "Preempted", written.status.message, "Warning")
        described = plan.describe()
        self.writer.claim_event(claim, "Preempting", described, "Normal")
        return described, statuses.REASON_PREEMPTING
