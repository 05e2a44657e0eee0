"""The quota ledgers' writes: entering a claim before it takes GPUs, taking it out after.

The rules and why they hold are in ``quotas``. Every write here is a merge
patch of a GpuQuota's status at the resourceVersion the decision was made
from; a Conflict means someone changed that ledger since, and the claim is
looked at again shortly.
"""

from __future__ import annotations

import logging

from controller import cluster as kube
from controller import gates, quotas
from controller.state import State
from controller.writer import Writer
from gpualloc.api import codecs, models
from gpualloc.kube import errors

log = logging.getLogger(__name__)


class Ledger:
    def __init__(self, cluster: kube.Cluster, state: State, writer: Writer) -> None:
        self.cluster = cluster  # reads; every write goes through the writer
        self.state = state
        self.writer = writer

    def check(self, claim: models.GpuClaim) -> str:
        """Why the claim cannot be admitted whatever its plan ("" when it may be)."""
        milli = quotas.claim_milli(claim)
        for quota in self.state.quotas(claim.metadata.namespace):
            why = quotas.verdict(
                quota, claim.metadata.uid, quotas.merged(quota, claim.metadata.uid, milli, "")
            )
            if why:
                return why
        return ""

    def holds(self, claim: models.GpuClaim, product: str) -> bool:
        """Does every quota of the namespace hold the claim for ``product``?"""
        milli = quotas.claim_milli(claim)
        return all(
            quotas.covers(q, claim.metadata.uid, milli, product)
            for q in self.state.quotas(claim.metadata.namespace)
        )

    async def admit(self, claim: models.GpuClaim, product: str) -> str | None:
        """Enter the claim, counted for ``product``, in every quota of its namespace.

        "" when every one holds it now; the quota's message when one cannot; None
        when a ledger changed meanwhile (the claim is retried shortly)."""
        milli = quotas.claim_milli(claim)
        uid = claim.metadata.uid
        for quota in self.state.quotas(claim.metadata.namespace):
            if quotas.covers(quota, uid, milli, product):
                continue
            entry = quotas.merged(quota, uid, milli, product)
            why = quotas.verdict(quota, uid, entry)
            if why:
                return why
            if not await self.writer.quota_status(
                quota, quotas.entry_patch(quota, claim, entry), reconciling=claim.key
            ):
                return None
            log.info("admitted by quota", extra={"claim": claim.key, "quota": quota.key, "gpus": entry.gpus})
        return ""

    async def enter_allocated(self, claim: models.GpuClaim) -> None:
        """An Allocated claim missing from a ledger (allocated before the quota existed) is entered
        without a check: it holds its GPUs already."""
        uid = claim.metadata.uid
        milli = quotas.claim_milli(claim)
        product = quotas.products_of(claim.status.allocations, self.state.statuses)
        for quota in self.state.quotas(claim.metadata.namespace):
            if not quotas.covers(quota, uid, milli, product):
                entry = quotas.merged(quota, uid, milli, product)
                await self.writer.quota_status(
                    quota, quotas.entry_patch(quota, claim, entry), reconciling=claim.key
                )

    async def leave(self, claim: models.GpuClaim) -> bool:
        """Take the claim (its GPUs released) out of every ledger; False when one changed meanwhile."""
        uid = claim.metadata.uid
        for quota in self.state.quotas(claim.metadata.namespace):
            if uid in quota.status.claims and not await self.writer.quota_status(
                quota, quotas.removal_patch(quota, [uid]), reconciling=claim.key
            ):
                return False
        return True

    async def drop_gone(self, quota: models.GpuQuota) -> None:
        """Take out the entries of claims that no longer exist (an authoritative read says so) once
        their GPUs are free: no Lease of theirs is left (the sweep keeps those that their live pods
        use) and no live pod that names them holds a device their namespace's claim of that name
        does not list. Until then the quota counts the GPUs their pods still use."""
        gone: list[str] = []
        pods: list[dict[str, object]] | None = None
        for uid, entry in sorted(quota.status.claims.items()):
            if self.state.claim_key_of(uid) is not None or self.state.held_by(uid):
                continue  # alive as far as we know (its own reconcile takes it out), or still locking GPUs
            try:
                raw = await self.cluster.get_claim(quota.metadata.namespace, entry.name)
            except errors.NotFound:
                raw = None
            if raw is not None and codecs.decode_meta(raw).uid == uid:
                continue
            if pods is None:
                pods = await self.cluster.list_pods(quota.metadata.namespace)
            devices = gates.held_by_pods(entry.name, pods)
            listed = codecs.parse_claim(raw).status.allocations if raw is not None else ()
            if devices - {d.uuid for a in listed for d in a.devices}:
                continue  # its pods still run on GPUs no claim of that name lists
            gone.append(uid)
        if gone:
            await self.writer.quota_status(quota, quotas.removal_patch(quota, gone), reconciling="")
            log.info("dropped gone claims from a quota", extra={"quota": quota.key, "claims": ",".join(gone)})
