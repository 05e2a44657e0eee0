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
* **Pending**: the Pending path (``allocating``): plan, admit, lock, record.

Every write goes through the ``Writer``, which updates the caches with its answer.

A running claim is never re-allocated automatically: its pods are bound to
the node and see the devices. To move, delete and re-create the claim.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from controller import cluster as kube
from controller import failures, gates, healing, locks, owners, statuses, unplaceable
from controller import metrics as controller_metrics
from controller.allocating import PendingReconciler
from controller.gating import PodGate
from controller.ledger import Ledger
from controller.settings import Settings
from controller.state import State
from controller.writer import Writer
from gpualloc.api import constants, leases, models
from gpualloc.kube import errors

log = logging.getLogger(__name__)

Obj = dict[str, Any]


class Reconciler:
    def __init__(
        self,
        cluster: kube.Cluster,
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
        self.cluster = cluster  # reads; every write goes through the writer
        self.state = state
        self.writer = writer
        self.ledger = ledger
        self.gate = gate
        self.settings = settings
        self.rng = rng
        self.requeue = requeue
        self.pending = PendingReconciler(
            state, writer, ledger, gate, settings, metrics, rng=rng, requeue=requeue
        )
        self.healer = healing.Healer(
            cluster=cluster, state=state, writer=writer, ledger=ledger, settings=settings, requeue=requeue
        )
        self._ownerless: set[str] = set()  # OnOwnerCompleted claims warned about naming no owner

    def forget(self, key: str) -> None:
        """The claim is gone: drop what was remembered about it."""
        self.pending.forget(key)
        self._ownerless.discard(key)

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
            if await self._move_if_unplaceable(claim):
                return
            problems = statuses.allocation_problems(
                claim.status.allocations, statuses=self.state.statuses, nodes=self.state.facts
            )
            if await self.healer.heal(claim, problems):
                return
            if await self._maintain(claim, problems) and not claim.releasing:
                await self.gate.ungate(claim)
            return
        if claim.status.phase == constants.PHASE_PREEMPTED:
            await self._finish_preemption(claim)
            return
        if claim.status.phase == constants.PHASE_RELEASED:
            await self.writer.release_leftovers(claim, self.state.held_by(claim.metadata.uid).values())
            if not await self.ledger.leave(claim):
                return
            self.gate.warn_gated(
                claim, f"claim {claim.metadata.name} is Released (its pods completed): create a new claim"
            )
            return
        if claim.status.phase == constants.PHASE_FAILED and (
            claim.status.observed_generation >= claim.metadata.generation
        ):
            await self.writer.release_leftovers(claim, self.state.held_by(claim.metadata.uid).values())
            self.gate.warn_gated(
                claim,
                f"claim {claim.metadata.name} is Failed ({claim.status.message or 'no message'}); "
                "the pod stays gated: delete it, or delete and re-create the claim",
            )
            return
        await self.pending.allocate(claim)

    # ------------------------------------------------------------------ writes and reads

    async def _add_finalizer(self, claim: models.GpuClaim) -> models.GpuClaim | None:
        try:
            return await self.writer.claim_finalizers(
                claim, [*claim.metadata.finalizers, constants.FINALIZER]
            )
        except errors.NotFound:
            return None

    async def _pods(self, claim: models.GpuClaim) -> tuple[list[Obj], list[Mapping[str, Any]]]:
        """An authoritative list of the claim's namespace's pods, and those of them that use the
        claim (``gates.pods_using``: named by it, not Succeeded or Failed, gated ones included)."""
        pods = await self.cluster.list_pods(claim.metadata.namespace)
        return pods, gates.pods_using(claim.metadata.name, pods)

    # ------------------------------------------------------------------ allocated claims

    async def _maintain(self, claim: models.GpuClaim, problems: Sequence[statuses.Problem]) -> bool:
        """Keep an Allocated claim's locks and its DevicesLost and DevicesUnhealthy conditions true
        (an Event on the claim, and on the Node of a failed GPU, when one turns True); False when
        its status write did not land (the claim moved on or is gone) and the caller should stop."""
        uid = claim.metadata.uid
        recorded = locks.recorded(claim)
        held = self.state.held_by(uid)
        await self.writer.release_leftovers(claim, held.values())
        await self.ledger.enter_allocated(claim)
        taken: dict[str, str] = {}
        missing = sorted(recorded - held.keys())
        if missing:
            taken = await self._relock(claim, missing)
        now = self.state.now()
        lost = statuses.devices_lost_condition(claim, problems, taken=taken, now=now)
        failing = failures.condition(claim, problems, now=now)
        changed = [c for c in (lost, failing) if c is not None]
        if not changed:
            return True
        conditions: Sequence[models.Condition] = claim.status.conditions
        for condition in changed:
            conditions = statuses.set_condition(conditions, condition)
        if await self.writer.claim_status(claim, statuses.conditions_patch(conditions)) is None:
            return False
        for condition in changed:
            if condition.status != "True":
                log.info("devices recovered", extra={"claim": claim.key, "condition": condition.type})
                continue
            log.warning("devices lost", extra={"claim": claim.key, "reason": condition.message})
            self.writer.claim_event(claim, condition.reason, condition.message, "Warning")
        if failing is not None and failing.status == "True":
            if claim.spec.on_device_failure == constants.DEVICE_FAILURE_REALLOCATE:
                # Its own write wakes nobody: look again when the grace period, counted from now, is over.
                self.requeue(claim.key, claim.spec.device_failure_grace_period_seconds)
            for problem in failures.unhealthy(problems):
                message = f"{problem.detail}: held by claim {claim.key}"
                self.writer.emit(healing.node_event_target(problem.node), failing.reason, message, "Warning")
        return True

    async def _relock(self, claim: models.GpuClaim, missing: list[str]) -> dict[str, str]:
        """Re-create recorded Leases that are not in the cache; {lease name: "claim ns/name"} of those
        another claim holds now. A recorded Lease is the claim's, not an attempt's: finding it held by
        the claim's own UID (the cache was only behind) is fine."""
        wanted = set(missing)
        taken: dict[str, str] = {}
        for item in locks.lock_plan(claim.status.allocations):
            if item.lease not in wanted:
                continue
            result = await self.writer.lock(self.settings.namespace, [item], claim, now=self.state.now())
            if result.ok:
                log.warning(
                    "re-created a vanished device lease", extra={"claim": claim.key, "lease": item.lease}
                )
                continue
            try:
                info = await self.writer.lease(item.lease, reconciling=claim.key)
            except errors.NotFound:
                self.requeue(claim.key, 0.5)  # released meanwhile: try again
                continue
            holdings = leases.holdings(info)  # a ledger's entries, or the Lease
            if all(h.holder != claim.metadata.uid for h in holdings):
                holder = ", ".join(
                    f"{h.claim_namespace}/{h.claim_name}" if h.claim_name else h.holder for h in holdings
                )
                device = constants.device_display(self._minor(claim, item.lock_id), item.lock_id)
                what = "is shared by claims" if info.ledger else "is held by claim"
                taken[item.lease] = f"{device} {what} {holder or '(none, being deleted)'}"
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
        pods, using = await self._pods(claim)
        fenced = statuses.fence_reason(claim) == statuses.REASON_PODS_COMPLETED  # its own fence
        now = self.state.now()
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
                await self.writer.claim_status(claim, statuses.conditions_patch(conditions))
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
            written = await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
            return True if written is None else await self._release_if_done(written)  # look again
        written = await self.writer.claim_status(claim, statuses.released_status(claim, why=why, now=now))
        if written is None:
            return True
        await self.writer.release_leftovers(written, self.state.held_by(claim.metadata.uid).values(), written)
        if not await self.ledger.leave(written):
            return True  # retried shortly, as a Released claim
        log.info("released: its work is done", extra={"claim": claim.key, "why": why})
        self.writer.claim_event(claim, "Released", written.status.message, "Normal")
        return True

    async def _owner_finished(self, claim: models.GpuClaim) -> str | None:
        """``release: OnOwnerCompleted``: how the claim's Job or JobSet finished ("its Job train is
        Complete"), or None while it runs. A claim that names no such owner is kept until deleted,
        with one Warning."""
        owner = owners.owner_of(self.state.raw_claim(claim.key) or {})
        if owner is None:
            if claim.key not in self._ownerless:
                self._ownerless.add(claim.key)
                message = (
                    "release: OnOwnerCompleted, but no Job or JobSet owns the claim"
                    " (metadata.ownerReferences): it keeps its GPUs until it is deleted"
                )
                log.warning("no owner to follow", extra={"claim": claim.key})
                self.writer.claim_event(claim, "NoOwner", message, "Warning")
            return None
        try:
            raw: Obj | None = await self.cluster.get_workload(
                claim.metadata.namespace, owner.api_version, owner.resource, owner.name
            )
        except errors.NotFound:
            raw = None
        how = owners.finished(owner, raw)
        return None if how is None else f"its {owner} is {how}"

    # ------------------------------------------------------------------ preempted claims

    async def _finish_preemption(self, claim: models.GpuClaim) -> None:
        """A Preempted claim: evict its pods (the Eviction API, so PodDisruptionBudgets hold; one a
        budget blocks is tried again every ``in_use_poll`` seconds), then drop its devices from its
        status, release its Leases and leave its quotas. The phase itself is the fence: the webhook
        admits no pod of a Preempted claim."""
        held = list(self.state.held_by(claim.metadata.uid).values())  # seen before the write below
        if claim.status.allocations:
            _, using = await self._pods(claim)
            if using:
                blocked = []
                for pod in using:
                    name = str((pod.get("metadata") or {}).get("name", ""))
                    try:
                        await self.writer.evict(claim.metadata.namespace, name)
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
            written = await self.writer.claim_status(claim, statuses.preemption_done_status(claim))
            if written is None:
                return
            await self.writer.release_leftovers(written, held, written)
            claim = written
        else:
            await self.writer.release_leftovers(claim, held)
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
        now = self.state.now()
        condition = statuses.node_lost_condition(claim, lost, now=now)
        if condition is not None:
            written = await self.writer.claim_status(claim, statuses.condition_patch(claim, condition))
            return True if written is None else await self._reallocate_if_lost(written)
        if not lost:
            return False
        wait = claim.spec.node_loss_grace_period_seconds - statuses.lost_for(claim, now)
        if wait > 0:
            self.requeue(claim.key, wait)
            return False
        _, using = await self._pods(claim)
        if using:
            if statuses.fence_reason(claim) == statuses.REASON_NODE_LOST:  # its own fence
                fence = statuses.releasing_condition(claim, on=False, now=now)
                await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
            self.requeue(claim.key, self.settings.in_use_poll)
            return False
        if statuses.fence_reason(claim) != statuses.REASON_NODE_LOST:
            fence = statuses.releasing_condition(
                claim, on=True, now=now, why=f"{', '.join(lost)} lost", reason=statuses.REASON_NODE_LOST
            )
            written = await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
            return True if written is None else await self._reallocate_if_lost(written)  # look again
        written = await self.writer.claim_status(claim, statuses.reallocating_status(claim, lost, now=now))
        if written is None:
            return True
        await self.writer.release_leftovers(written, self.state.held_by(claim.metadata.uid).values(), written)
        log.warning("allocating afresh: its node was lost", extra={"claim": claim.key, "nodes": lost})
        self.writer.claim_event(claim, "Reallocating", written.status.message, "Warning")
        self.requeue(claim.key, 0)
        return True

    # ------------------------------------------------------------------ unplaceable pods

    async def _move_if_unplaceable(self, claim: models.GpuClaim) -> bool:
        """A claim whose pods kube-scheduler cannot place on its node (``unplaceable``). True when
        the caller should stop.

        Once a pod has been Unschedulable for the grace period and no pod of the claim is bound
        (judged on the cache), the claim is fenced (``Releasing``, reason ``Unplaceable``: the
        webhook admits no pod of it). Behind the fence, on an authoritative list, the stuck pods
        are evicted (each on its uid: a pod the scheduler bound meanwhile lifts the fence
        instead), and only once no pod uses the claim does it go back to Pending without those
        nodes and release its Leases, as a release does: no GPU is let go while a pod may run on
        it. Their owners re-create the pods, which wait at the gate for the new node. A bare pod
        keeps the claim where it is (condition ``Unplaceable``, reason ``BarePod``, and an Event
        on the pod)."""
        now = self.state.now()
        grace = claim.spec.unschedulable_grace_period_seconds
        if statuses.fence_reason(claim) == statuses.REASON_UNPLACEABLE:
            return await self._move_fenced(claim, grace=grace, now=now)
        verdict = unplaceable.judge(self.state.live_pods_of(claim.key), grace=grace, now=now)
        bare = verdict.bare if verdict is not None and verdict.wait <= 0 else ()
        condition = statuses.unplaceable_condition(claim, bare, verdict.message if verdict else "", now=now)
        if condition is not None:
            written = await self.writer.claim_status(claim, statuses.condition_patch(claim, condition))
            if written is not None and bare:
                log.warning("a bare pod holds the claim", extra={"claim": claim.key, "pods": ",".join(bare)})
                for pod in self.state.live_pods_of(claim.key):
                    if str((pod.get("metadata") or {}).get("name", "")) in bare:
                        self.writer.emit(pod, statuses.REASON_UNPLACEABLE, condition.message, "Warning")
            self.requeue(claim.key, 0)
            return True
        if verdict is None or bare:
            return False
        if verdict.wait > 0:
            self.requeue(claim.key, verdict.wait)
            return False
        if claim.releasing:
            return False  # another path's fence: it decides first
        fence = statuses.unplaceable_fence(claim, verdict.pods, verdict.message, now=now)
        await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
        self.requeue(claim.key, 0)
        return True

    async def _move_fenced(self, claim: models.GpuClaim, *, grace: float, now: dt.datetime) -> bool:
        """``_move_if_unplaceable`` behind its fence. The stuck pods are evicted first, then the
        pods still at the gate (they hold no GPU, but a gate that read the claim before the fence
        could still lift theirs onto this node); their owners create them again for the new one."""
        _, listed_pods = await self._pods(claim)
        using = [p for p in listed_pods if not gates.is_gated(p)]
        gated = [p for p in listed_pods if gates.is_gated(p)]
        if not using and gated:
            # They hold no GPU yet, but a gate that read the claim before the fence may still lift
            # theirs with these devices (found on the failed-GPU path, seed 600,940): they go
            # first, and their owners create them again for the new node.
            for pod in gated:
                meta = pod.get("metadata") or {}
                with contextlib.suppress(errors.NotFound, errors.Conflict):
                    await self.writer.evict(
                        claim.metadata.namespace, str(meta.get("name", "")), uid=str(meta.get("uid", ""))
                    )
            self.requeue(claim.key, 0.5)
            return True
        if not using:
            written = await self.writer.claim_status(claim, statuses.unplaceable_status(claim, now=now))
            if written is None:
                return True
            uid = claim.metadata.uid
            await self.writer.release_leftovers(written, self.state.held_by(uid).values(), written)
            log.warning("allocating afresh: its pods could not be scheduled", extra={"claim": claim.key})
            self.writer.claim_event(claim, statuses.REASON_UNPLACEABLE, written.status.message, "Warning")
            self.requeue(claim.key, 0)
            return True
        listed = unplaceable.judge([gates.kept_of_live_pod(dict(p)) for p in using], grace=grace, now=now)
        stuck = set(listed.pods) if listed is not None and listed.moves else set()
        names = {str((p.get("metadata") or {}).get("name", "")) for p in using}
        if not stuck:
            # A pod was bound, or is no longer refused: the claim stays where it is.
            fence = statuses.releasing_condition(claim, on=False, now=now)
            await self.writer.claim_status(claim, statuses.condition_patch(claim, fence))
            return True
        for pod in using:
            meta = pod.get("metadata") or {}
            if meta.get("name") in stuck:
                with contextlib.suppress(errors.NotFound, errors.Conflict):
                    await self.writer.evict(
                        claim.metadata.namespace, str(meta["name"]), uid=str(meta.get("uid", ""))
                    )
        log.info(
            "evicted pods that could not be scheduled",
            extra={"claim": claim.key, "pods": ",".join(sorted(stuck))},
        )
        # Pods of the claim that are neither bound nor refused (just released from the gate) are
        # waited for; the evicted ones are gone at the next look.
        self.requeue(claim.key, 0.5 if names <= stuck else self.settings.in_use_poll)
        return True

    # ------------------------------------------------------------------ deleted claims

    async def _finalize(self, claim: models.GpuClaim) -> None:
        self.gate.warn_gated(claim, f"claim {claim.metadata.name} is being deleted; the pod stays gated")
        if constants.FINALIZER not in claim.metadata.finalizers:
            return  # done already; the sweep releases anything left
        uid = claim.metadata.uid
        if claim.status.allocations:
            _, using = await self._pods(claim)
            if using:
                await self._still_in_use(claim, using)
                return
        # An authoritative list, not the cache: a Lease the cache has not seen yet would outlive
        # the claim's quota entries, which go next (the simulation, seed 10,395,109). No attempt
        # can record a Lease any more: the deletion moved the claim's version on (rule 3).
        listed = await self.cluster.list_claim_leases(uid)
        held = [info for raw in listed if (info := leases.held_by(raw, uid)) is not None]
        gone = await self.writer.release(held)
        released = len(gone)
        if len(gone) < len(held):
            self.requeue(claim.key, self.settings.in_use_poll)  # one changed hands meanwhile: look again
            return
        if held or claim.status.allocations:
            count = sum(len(a.devices) for a in claim.status.allocations) or released
            self.writer.claim_event(
                claim,
                "Released",
                f"released {count} GPU{'s' if count != 1 else ''}",
                "Normal",
            )
        if not await self.ledger.leave(claim):
            return  # a quota's ledger changed meanwhile: retried shortly, the finalizer kept till then
        finalizers = [f for f in claim.metadata.finalizers if f != constants.FINALIZER]
        with contextlib.suppress(errors.NotFound):
            await self.writer.claim_finalizers(claim, finalizers)
        log.info("released", extra={"claim": claim.key, "leases": released})

    async def _still_in_use(self, claim: models.GpuClaim, using: Sequence[Mapping[str, Any]]) -> None:
        names = sorted(str((p.get("metadata") or {}).get("name", "")) for p in using)
        condition = statuses.in_use_condition(claim, names, now=self.state.now())
        if condition is not None:
            written = await self.writer.claim_status(claim, statuses.condition_patch(claim, condition))
            if written is not None:
                log.info("deletion waits for pods", extra={"claim": claim.key, "pods": ",".join(names)})
                self.writer.claim_event(claim, "ReleaseBlocked", condition.message, "Warning")
        self.requeue(claim.key, self.settings.in_use_poll)
