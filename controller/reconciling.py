"""Reconciling one claim: allocate it, keep it, release it. The locking rules are in ``locking``.

``reconcile(key)`` looks at the cached claim and does one of:

* **being deleted**: if pods still use it (an authoritative list of its
  namespace's pods: annotated with its name, not Succeeded or Failed, gated
  ones included), it keeps its Leases and says why (condition
  ``InUse``, a ``ReleaseBlocked`` Warning) and looks again every
  ``in_use_poll`` seconds; otherwise it deletes every Lease it holds, emits
  ``Released`` and removes the finalizer ``gpu.scheduling/release-devices``;
* otherwise it first adds that finalizer (before any Lease is taken);
* **Allocated** with ``release: OnPodsCompleted``: lists the namespace's pods;
  while some use it, records them (condition ``InUse``); once pods were seen
  and every one has completed (or is gone), writes phase ``Released`` (no
  devices, ``releasedTime``), releases its Leases and leaves its quotas, and
  emits ``Released``; with ``OnOwnerCompleted`` the same, once the Job or
  JobSet that owns it has finished (``owners``) and no pod uses it;
* **Released**: releases leftovers and leaves its quotas; its pods stay gated;
* **Allocated** with ``onNodeLoss: Reallocate``: once a node it uses has been
  deleted or not ready for the grace period (condition ``NodeLost``) and no pod
  uses it, goes back to Pending without devices behind the same fence, and
  is allocated afresh;
* **Allocated**: releases leftovers, re-creates a recorded Lease that vanished
  (if nobody took it meanwhile), keeps the ``DevicesLost`` condition true to
  the devices' state (reason ``DevicesTaken`` when another claim holds one of
  its Leases: the webhook then refuses its new pods), and un-gates its pods;
* **Failed**: releases leftovers;
* **Pending**: plans on the caches (``allocator.allocate``), has the plan
  admitted by its namespace's quotas (``ledger``; over a quota it stays
  Pending with reason ``QuotaExceeded`` and the quota's message), locks the chosen
  devices (``locking.acquire``; on a device taken meanwhile it plans again, up
  to ``LOCK_ATTEMPTS`` times), writes the status at the resourceVersion it
  planned from, then releases leftovers. When nothing fits: Pending with the
  reason, ``AllocationFailed`` (at most once per ``event_interval`` per claim
  unless the reason changes), retry with backoff (``retryPolicy``), Failed after
  ``maxRetries`` retries.

A running claim is never re-allocated automatically: its pods are bound to
the node and see the devices. To move, delete and re-create the claim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from controller import (
    allocator,
    asks,
    gates,
    locking,
    owners,
    preemption,
    quotas,
    retries,
    statuses,
    views,
    waking,
)
from controller import cluster as kube
from controller import metrics as controller_metrics
from controller.gating import Emit, PodGate
from controller.ledger import Ledger
from controller.nodes import NodeIndex
from controller.state import State
from gpualloc.api import codecs, constants, leases, models, taints, timestamps
from gpualloc.kube import errors, watching

log = logging.getLogger(__name__)

Obj = dict[str, Any]

LOCK_ATTEMPTS = 3  # plans tried per reconcile when another claim wins a device
EVENT_INTERVAL = 60.0  # AllocationFailed at most this often per claim, unless the reason changes
IN_USE_POLL = 5.0  # a claim being deleted that pods still use is looked at again this often


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    namespace: str  # where the device Leases live
    workers: int = 4
    node_stale_after: float = views.NODE_STALE_AFTER_S
    heartbeat_namespace: str = ""  # where the agents renew their heartbeat Leases; "" = not watched
    cost_label: str = constants.LABEL_COST_TIER
    sweep_interval: float = 30.0
    event_interval: float = EVENT_INTERVAL
    in_use_poll: float = IN_USE_POLL
    claim_selector: str = ""  # label selector: handle only these claims (shards, tests); "" = all
    preemption_scope: str = "Namespace"  # whose claims a claim may preempt: Namespace, Cluster or None
    claim_tolerations: str = "Allowed"  # Allowed: those its namespace's GpuQuotas allow; Any: all of them


class Reconciler:
    def __init__(
        self,
        cluster: kube.Cluster,
        state: State,
        gate: PodGate,
        settings: Settings,
        metrics: controller_metrics.Metrics,
        *,
        rng: random.Random,
        emit: Emit,
        requeue: Callable[[str, float], None],
    ) -> None:
        self.cluster = cluster
        self.state = state
        self.gate = gate
        self.settings = settings
        self.metrics = metrics
        self.rng = rng
        self.emit = emit
        self.requeue = requeue
        self._retry: dict[str, retries.RetryState] = {}
        self._failed_event: dict[str, tuple[str, float]] = {}
        self._ownerless: set[str] = set()  # OnOwnerCompleted claims warned about naming no owner
        self._rr_cursor = 0
        self.ledger = Ledger(cluster, state, retry_soon=self._retry_soon)

    def _retry_soon(self, key: str) -> None:
        self.requeue(key, 0.05 + 0.2 * self.rng.random())

    def forget(self, key: str) -> None:
        """The claim is gone: drop what was remembered about it."""
        self._retry.pop(key, None)
        self._failed_event.pop(key, None)
        self._ownerless.discard(key)

    def _now(self) -> datetime.datetime:
        return self.state.now()

    # ------------------------------------------------------------------ entry

    async def reconcile(self, key: str) -> None:
        claim = self.state.claim(key)
        if claim is None:
            return
        if claim.metadata.deletion_timestamp:
            await self._finalize(claim)
            return
        if constants.FINALIZER not in claim.metadata.finalizers:
            added = await self._add_finalizer(claim)
            if added is None:
                return
            claim = added
        if statuses.allocation_complete(claim):
            if claim.spec.release in constants.RELEASES_WHEN_DONE and await self._release_if_done(claim):
                return
            if claim.spec.on_node_loss == constants.NODE_LOSS_REALLOCATE and await self._reallocate_if_lost(
                claim
            ):
                return
            if await self._maintain(claim) and not claim.releasing:
                await self.gate.ungate(claim)
            return
        if claim.status.phase == constants.PHASE_PREEMPTED:
            await self._finish_preemption(claim)
            return
        if claim.status.phase == constants.PHASE_RELEASED:
            await self._release_leftovers(claim, self.state.held_by(claim.metadata.uid).values())
            if not await self.ledger.leave(claim):
                return
            self.gate.warn_gated(
                claim, f"claim {claim.metadata.name} is Released (its pods completed): create a new claim"
            )
            return
        if claim.status.phase == constants.PHASE_FAILED and (
            claim.status.observed_generation >= claim.metadata.generation
        ):
            await self._release_leftovers(claim, self.state.held_by(claim.metadata.uid).values())
            self.gate.warn_gated(
                claim,
                f"claim {claim.metadata.name} is Failed ({claim.status.message or 'no message'}); "
                "the pod stays gated: delete it, or delete and re-create the claim",
            )
            return
        await self._allocate(claim)

    # ------------------------------------------------------------------ writes

    def _written(self, raw: Obj) -> models.GpuClaim:
        """Remember a claim one of our writes returned, and parse it (an authoritative view)."""
        raw.setdefault("apiVersion", constants.API_VERSION)
        raw.setdefault("kind", constants.CLAIM_KIND)
        self.state.remember("claims", raw, reconciling=watching.object_key(raw))
        return codecs.parse_claim(raw)

    async def _write_status(self, claim: models.GpuClaim, patch: Obj) -> models.GpuClaim | None:
        """Patch the status at the resourceVersion ``claim`` was read at; None when it moved on or is gone.

        On Conflict someone wrote the claim since: it is looked at again shortly.
        """
        meta = claim.metadata
        try:
            raw = await self.cluster.patch_claim_status(
                meta.namespace, meta.name, patch, resource_version=meta.resource_version
            )
        except errors.Conflict:
            self._retry_soon(claim.key)
            return None
        except errors.NotFound:
            return None
        return self._written(raw)

    async def _patch_finalizers(self, claim: models.GpuClaim, finalizers: list[str]) -> models.GpuClaim:
        meta = claim.metadata
        raw = await self.cluster.patch_claim_metadata(
            meta.namespace,
            meta.name,
            {"metadata": {"finalizers": finalizers}},
            resource_version=meta.resource_version,
        )
        return self._written(raw)

    async def _add_finalizer(self, claim: models.GpuClaim) -> models.GpuClaim | None:
        try:
            return await self._patch_finalizers(claim, [*claim.metadata.finalizers, constants.FINALIZER])
        except errors.NotFound:
            return None

    async def _release(self, held: Iterable[leases.LeaseInfo]) -> int:
        gone = await locking.release(self.cluster, held)
        for info in gone:
            self.state.forget_lease(info.name, info.uid)
        return len(gone)

    async def _release_leftovers(
        self,
        claim: models.GpuClaim,
        leftovers: Iterable[leases.LeaseInfo],
        view: models.GpuClaim | None = None,
    ) -> None:
        """Release the leftovers (seen before ``view``) that no attempt can record any more (``locking``).

        ``view`` is an authoritative read of the claim made after they were seen:
        the answer to our own write, or else a GET made here.
        """
        recorded = locking.recorded(claim)
        leftovers = [info for info in leftovers if info.name not in recorded]
        if not leftovers:
            return
        if view is None:
            try:
                raw = await self.cluster.get_claim(claim.metadata.namespace, claim.metadata.name)
            except errors.NotFound:
                return  # the sweep releases Leases of claims that are gone
            view = codecs.parse_claim(raw)
            if view.metadata.uid != claim.metadata.uid:
                return
        free = locking.releasable(leftovers, view)
        if free:
            released = await self._release(free)
            log.info("released leftover leases", extra={"claim": claim.key, "leases": released})
        if len(free) < len(leftovers):
            self.requeue(claim.key, 1.0 + self.rng.random())  # an attempt at this very version may be alive

    # ------------------------------------------------------------------ allocate

    async def _allocate(self, claim: models.GpuClaim) -> None:
        key = claim.key
        uid = claim.metadata.uid
        claim, refused_tolerations = self._tolerated(claim)  # planned (and preempting) with these only
        retry = self._retry.get(key)
        if retry is None or retry.generation != claim.metadata.generation:
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
            plan = locking.lock_plan(decision.allocations)
            names = [item.lease for item in plan]
            # Planned and reserved without an await in between: two workers of this process never
            # pick the same device; another process is stopped by the Lease itself.
            self.state.reserve(names, uid)
            try:
                result = await locking.acquire(
                    self.cluster, self.settings.namespace, plan, claim, now=self._now()
                )
            finally:
                self.state.unreserve(names, uid)
            for raw in result.created.values():
                self.state.remember("leases", raw, reconciling=claim.key)
            if result.ok:
                self._advance_cursor(node_index, decision.allocations)
                break
            self.metrics.allocation_failures.labels(reason="LockConflict").inc()
        if result is None or decision is None or not result.ok:
            self.requeue(key, 0.2 + self.rng.random())
            return
        now = self._now()
        patch = statuses.allocated_status(claim, decision.allocations, now=now)
        written = await self._write_status(claim, patch)
        if written is None:
            # Our write failed for good: no status will ever list these Leases (locking, rule 2).
            await self._release(leases.parse(raw) for raw in result.created.values())
            return
        await self._release_leftovers(written, leftovers, written)
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
            written = await self._write_status(claim, patch)
            if written is None:
                return
        await self._release_leftovers(claim, leftovers, written)
        if counted and not exhausted:
            self.metrics.allocation_retries.inc()  # one more retry scheduled with backoff
        if counted:
            self.metrics.allocation_failures.labels(reason=cond_reason).inc()
            last = self._failed_event.get(key)
            if last is None or last[0] != message or mono - last[1] >= self.settings.event_interval:
                self._failed_event[key] = (message, mono)
                self.emit(self.state.raw_claim(key) or {}, "AllocationFailed", message, "Warning")
            log.info("not allocated", extra={"claim": key, "reason": message, "retry": retry.retry_count})
        if parked:
            return
        if not exhausted:
            self.requeue(key, max(0.0, retry.not_before - mono))
        elif written is not None:
            # Once more, as Failed: its leftovers go, and its gated pods are told why they stay gated.
            # Nothing else would wake it: our own write's event does not.
            self.requeue(key, 0.0)

    # ------------------------------------------------------------------ allocated claims

    async def _maintain(self, claim: models.GpuClaim) -> bool:
        """Keep an Allocated claim's locks and its DevicesLost condition true; False when its
        status write did not land (the claim moved on or is gone) and the caller should stop."""
        uid = claim.metadata.uid
        recorded = locking.recorded(claim)
        held = self.state.held_by(uid)
        await self._release_leftovers(claim, held.values())
        await self.ledger.enter_allocated(claim)
        taken: dict[str, str] = {}
        missing = sorted(recorded - held.keys())
        if missing:
            taken = await self._relock(claim, missing)
        problems = statuses.allocation_problems(
            claim.status.allocations, statuses=self.state.statuses, nodes=self.state.facts
        )
        condition = statuses.devices_lost_condition(claim, problems, taken=taken, now=self._now())
        if condition is None:
            return True
        if await self._write_status(claim, statuses.condition_patch(claim, condition)) is None:
            return False
        if condition.status == "True":
            log.warning("devices lost", extra={"claim": claim.key, "reason": condition.message})
            self.emit(self.state.raw_claim(claim.key) or {}, "DeviceUnhealthy", condition.message, "Warning")
        else:
            log.info("devices recovered", extra={"claim": claim.key})
        return True

    async def _relock(self, claim: models.GpuClaim, missing: list[str]) -> dict[str, str]:
        """Re-create recorded Leases that are not in the cache; {lease name: "claim ns/name"} of those
        another claim holds now. A recorded Lease is the claim's, not an attempt's: finding it held by
        the claim's own UID (the cache was only behind) is fine."""
        wanted = set(missing)
        taken: dict[str, str] = {}
        for item in locking.lock_plan(claim.status.allocations):
            if item.lease not in wanted:
                continue
            result = await locking.acquire(
                self.cluster, self.settings.namespace, [item], claim, now=self._now()
            )
            if result.ok:
                for raw in result.created.values():
                    self.state.remember("leases", raw, reconciling=claim.key)
                log.warning(
                    "re-created a vanished device lease", extra={"claim": claim.key, "lease": item.lease}
                )
                continue
            try:
                raw = await self.cluster.get_lease(item.lease)
            except errors.NotFound:
                self.requeue(claim.key, 0.5)  # released meanwhile: try again
                continue
            self.state.remember("leases", raw, reconciling=claim.key)
            info = leases.parse(raw)
            if info.holder != claim.metadata.uid:
                holder = f"{info.claim_namespace}/{info.claim_name}" if info.claim_name else info.holder
                device = constants.device_display(self._minor(claim, item.lock_id), item.lock_id)
                taken[item.lease] = f"{device} is held by claim {holder}"
        return taken

    @staticmethod
    def _minor(claim: models.GpuClaim, lock_id: str) -> int:
        return next(d.minor for a in claim.status.allocations for d in a.devices if d.lock_id == lock_id)

    # ------------------------------------------------------------------ work done

    async def _release_if_done(self, claim: models.GpuClaim) -> bool:
        """``release: OnPodsCompleted``: release the claim once every pod that used it has completed;
        ``OnOwnerCompleted``: once its Job or JobSet has finished and no pod uses it. True when it
        was released now (or its status moved on meanwhile).

        The pods come from an authoritative list. A pod at our scheduling gate counts as using the
        claim (``gates.pods_using``), and a claim nobody has used yet is kept. A pod admitted after
        that list would be missed, so the list that decides is made after a fence: the condition
        ``Releasing``, written first, for which the webhook admits no pod (the deterministic
        simulation found a pod admitted between the list and the release)."""
        pods = await self.cluster.list_pods(claim.metadata.namespace)
        using = gates.pods_using(claim.metadata.name, pods)
        fenced = claim.releasing
        now = self._now()
        if using:
            names = sorted(str((p.get("metadata") or {}).get("name", "")) for p in using)
            condition = statuses.in_use_condition(claim, names, now=now, deleting=False)
            conditions: Sequence[models.Condition] = claim.status.conditions
            if condition is not None:
                conditions = statuses.set_condition(conditions, condition)
            if fenced:
                conditions = statuses.set_condition(
                    conditions, statuses.releasing_condition(claim, on=False, now=now)
                )
            if condition is not None or fenced:
                await self._write_status(claim, statuses.conditions_patch(conditions))
            return False
        done = gates.pods_done(claim.metadata.name, pods)
        if claim.spec.release == constants.RELEASE_ON_OWNER_COMPLETED:
            why = await self._owner_finished(claim)
            if why is None:
                return False
        elif done or statuses.was_used(claim):
            why = f"every pod that used the claim has completed ({len(done)} seen)"
        else:
            return False  # not used yet
        if not fenced:
            fence = statuses.releasing_condition(claim, on=True, now=now)
            written = await self._write_status(claim, statuses.condition_patch(claim, fence))
            return True if written is None else await self._release_if_done(written)  # look again
        written = await self._write_status(claim, statuses.released_status(claim, why=why, now=now))
        if written is None:
            return True
        await self._release_leftovers(written, self.state.held_by(claim.metadata.uid).values(), written)
        if not await self.ledger.leave(written):
            return True  # retried shortly, as a Released claim
        log.info("released: its work is done", extra={"claim": claim.key, "why": why})
        self.emit(self.state.raw_claim(claim.key) or {}, "Released", written.status.message, "Normal")
        return True

    async def _owner_finished(self, claim: models.GpuClaim) -> str | None:
        """``release: OnOwnerCompleted``: how the claim's Job or JobSet finished ("its Job train is
        Complete"), or None while it runs. A claim that names no such owner is kept until deleted,
        with one Warning."""
        raw_claim = self.state.raw_claim(claim.key) or {}
        owner = owners.owner_of(raw_claim)
        if owner is None:
            if claim.key not in self._ownerless:
                self._ownerless.add(claim.key)
                message = (
                    "release: OnOwnerCompleted, but no Job or JobSet owns the claim"
                    " (metadata.ownerReferences): it keeps its GPUs until it is deleted"
                )
                log.warning("no owner to follow", extra={"claim": claim.key})
                self.emit(raw_claim, "NoOwner", message, "Warning")
            return None
        try:
            raw: Obj | None = await self.cluster.get_workload(
                claim.metadata.namespace, owner.api_version, owner.resource, owner.name
            )
        except errors.NotFound:
            raw = None
        how = owners.finished(owner, raw)
        return None if how is None else f"its {owner} is {how}"

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
        now = self._now()
        for victim in plan.victims:
            written = await self._write_status(victim, statuses.preempted_status(victim, by=claim, now=now))
            if written is None:
                break
            log.warning("preempted", extra={"claim": victim.key, "by": claim.key})
            self.emit(self.state.raw_claim(victim.key) or {}, "Preempted", written.status.message, "Warning")
        described = plan.describe()
        self.emit(self.state.raw_claim(claim.key) or {}, "Preempting", described, "Normal")
        return described, statuses.REASON_PREEMPTING

    async def _finish_preemption(self, claim: models.GpuClaim) -> None:
        """A Preempted claim: evict its pods (the Eviction API, so PodDisruptionBudgets hold; one a
        budget blocks is tried again every ``in_use_poll`` seconds), then drop its devices from its
        status, release its Leases and leave its quotas. The phase itself is the fence: the webhook
        admits no pod of a Preempted claim."""
        held = list(self.state.held_by(claim.metadata.uid).values())  # seen before the write below
        if claim.status.allocations:
            pods = await self.cluster.list_pods(claim.metadata.namespace)
            using = gates.pods_using(claim.metadata.name, pods)
            if using:
                blocked = []
                for pod in using:
                    name = str((pod.get("metadata") or {}).get("name", ""))
                    try:
                        await self.cluster.evict_pod(claim.metadata.namespace, name)
                    except errors.NotFound:
                        continue
                    except errors.Unavailable as exc:
                        if exc.status != 429:
                            raise
                        blocked.append(name)
                if blocked:
                    log.info("eviction blocked", extra={"claim": claim.key, "pods": ",".join(blocked)})
                self.requeue(claim.key, self.settings.in_use_poll)
                return
            written = await self._write_status(claim, statuses.preemption_done_status(claim))
            if written is None:
                return
            await self._release_leftovers(written, held, written)
            claim = written
        else:
            await self._release_leftovers(claim, held)
        await self.ledger.leave(claim)
        self.gate.warn_gated(claim, f"claim {claim.metadata.name} was preempted: create a new claim")

    # ------------------------------------------------------------------ lost nodes

    async def _reallocate_if_lost(self, claim: models.GpuClaim) -> bool:
        """``onNodeLoss: Reallocate``: once a node the claim uses has been deleted or not ready (its
        heartbeat stale) for the grace period and no pod uses the claim, send it back to Pending
        without devices, then release its Leases; the next reconcile allocates it afresh. True when
        the status was written (or moved on meanwhile): the caller stops.

        The grace period counts from the ``NodeLost`` condition's transition, so a controller that
        restarts does not start it over. The last look at the pods is made behind the ``Releasing``
        fence, as for ``release: OnPodsCompleted``. The claim keeps its quota entries: it still
        wants the same GPUs, and its next plan is admitted against them."""
        lost = sorted(
            {
                a.node_name
                for a in claim.status.allocations
                if a.node_name not in self.state.facts or not self.state.ready_nodes.get(a.node_name, False)
            }
        )
        now = self._now()
        condition = statuses.node_lost_condition(claim, lost, now=now)
        if condition is not None:
            written = await self._write_status(claim, statuses.condition_patch(claim, condition))
            return True if written is None else await self._reallocate_if_lost(written)
        if not lost:
            return False
        wait = claim.spec.node_loss_grace_period_seconds - statuses.lost_for(claim, now)
        if wait > 0:
            self.requeue(claim.key, wait)
            return False
        pods = await self.cluster.list_pods(claim.metadata.namespace)
        if gates.pods_using(claim.metadata.name, pods):
            if claim.releasing:
                fence = statuses.releasing_condition(claim, on=False, now=now)
                await self._write_status(claim, statuses.condition_patch(claim, fence))
            self.requeue(claim.key, self.settings.in_use_poll)
            return False
        if not claim.releasing:
            fence = statuses.releasing_condition(
                claim, on=True, now=now, why=f"{', '.join(lost)} lost", reason=statuses.REASON_NODE_LOST
            )
            written = await self._write_status(claim, statuses.condition_patch(claim, fence))
            return True if written is None else await self._reallocate_if_lost(written)  # look again
        written = await self._write_status(claim, statuses.reallocating_status(claim, lost, now=now))
        if written is None:
            return True
        await self._release_leftovers(written, self.state.held_by(claim.metadata.uid).values(), written)
        log.warning("allocating afresh: its node was lost", extra={"claim": claim.key, "nodes": lost})
        self.emit(self.state.raw_claim(claim.key) or {}, "Reallocating", written.status.message, "Warning")
        self.requeue(claim.key, 0)
        return True

    # ------------------------------------------------------------------ deleted claims

    async def _finalize(self, claim: models.GpuClaim) -> None:
        self.gate.warn_gated(claim, f"claim {claim.metadata.name} is being deleted; the pod stays gated")
        if constants.FINALIZER not in claim.metadata.finalizers:
            return  # done already; the sweep releases anything left
        uid = claim.metadata.uid
        if claim.status.allocations:
            pods = await self.cluster.list_pods(claim.metadata.namespace)
            using = gates.pods_using(claim.metadata.name, pods)
            if using:
                await self._still_in_use(claim, using)
                return
        held = self.state.held_by(uid)
        released = await self._release(held.values())
        if held or claim.status.allocations:
            count = sum(len(a.devices) for a in claim.status.allocations) or released
            self.emit(
                self.state.raw_claim(claim.key) or {},
                "Released",
                f"released {count} GPU{'s' if count != 1 else ''}",
                "Normal",
            )
        if not await self.ledger.leave(claim):
            return  # a quota's ledger changed meanwhile: retried shortly, the finalizer kept till then
        finalizers = [f for f in claim.metadata.finalizers if f != constants.FINALIZER]
        with contextlib.suppress(errors.NotFound):
            await self._patch_finalizers(claim, finalizers)
        log.info("released", extra={"claim": claim.key, "leases": released})

    async def _still_in_use(self, claim: models.GpuClaim, using: Sequence[Mapping[str, Any]]) -> None:
        names = sorted(str((p.get("metadata") or {}).get("name", "")) for p in using)
        condition = statuses.in_use_condition(claim, names, now=self._now())
        if condition is not None:
            written = await self._write_status(claim, statuses.condition_patch(claim, condition))
            if written is not None:
                log.info("deletion waits for pods", extra={"claim": claim.key, "pods": ",".join(names)})
                self.emit(
                    self.state.raw_claim(claim.key) or {}, "ReleaseBlocked", condition.message, "Warning"
                )
        self.requeue(claim.key, self.settings.in_use_poll)
