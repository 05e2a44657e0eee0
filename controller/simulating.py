"""`gpualloc simulate -f claim.yaml`: where a claim would land, before it is submitted.

It takes one snapshot of what the controller reads (claims, GpuNodeStatuses, Nodes, the
namespace's GpuQuotas, heartbeats, pods) and runs the controller's own decisions on it: the
allocator (``explain=True``, so a claim that fits nowhere gets a verdict per node), the
namespace's quotas as the ledger admits a claim (``quotas.admissible``), the tolerations its
quotas allow (``asks.allowed_tolerations``), and preemption (``preemption.choose`` with the
namespace's priority cap). ``--count N`` places copies one after another on the snapshot, each
placed copy's devices taken and its GPUs entered in the quota ledger, until one does not fit.

Nothing is written: every call is a GET. A tenant runs it with its own rights; what it may not
list is left out and the report says what that leaves uncounted (another namespace's claims:
the GPUs they hold look free, so the answer may be optimistic).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from controller import allocator, asks, explaining, preemption, quotas, waking
from controller import views as node_views_
from controller.nodes import NodeIndex
from gpualloc import views
from gpualloc.api import codecs, constants, models, requests, taints

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
SCOPES = ("Namespace", "Cluster")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    """What the controller would read, as one user could list it."""

    claims: Sequence[models.GpuClaim]
    statuses: Mapping[str, models.GpuNodeStatus]  # by node name
    nodes: Mapping[str, node_views_.NodeFacts]
    quotas: Sequence[models.GpuQuota]  # the claim's namespace's
    now: dt.datetime
    heartbeats: Mapping[str, str] | None = None  # ``views.latest_heartbeats``; None: the statuses' own
    pods: Sequence[Mapping[str, Any]] | None = None  # every pod; None when not listed
    unseen: tuple[str, ...] = ()  # what could not be listed, and what that leaves uncounted


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """The simulation's answer: the copies that landed, and why the next one did not."""

    asked: int
    landed: tuple[tuple[models.Allocation, ...], ...]  # per copy placed, its allocations
    notes: tuple[str, ...] = ()  # per copy placed, the allocator's note ("" for none)
    reason: str = ""  # why the next copy does not land ("" when every copy asked landed)
    per_node: Mapping[str, str] = dataclasses.field(default_factory=dict)  # the allocator's verdicts
    quota: str = ""  # the quota that holds the next copy back
    taint: str = ""  # the refused tolerations that would have let it on a node
    victims: tuple[models.GpuClaim, ...] = ()  # whom it would preempt to land
    preemption: str = ""  # what preemption would do, in words ("" when not asked)
    ahead: tuple[str, ...] = ()  # pending claims the controller would try first (not placed here)

    @property
    def fits(self) -> bool:
        return bool(self.landed)


def bad_input(claim: models.GpuClaim) -> str:
    """Why the controller would refuse the claim outright (``asks.parse``); "" when it would not."""
    parsed = asks.parse(claim)
    return parsed if isinstance(parsed, str) else ""


def _copy(claim: models.GpuClaim, number: int) -> models.GpuClaim:
    """Copy ``number`` of the claim, with a uid of its own (nothing in the cluster has it)."""
    meta = dataclasses.replace(claim.metadata, uid=f"simulated-{number}")
    return dataclasses.replace(claim, metadata=meta, status=models.GpuClaimStatus())


def _entered(quota: models.GpuQuota, claim: models.GpuClaim, product: str) -> models.GpuQuota:
    """The quota once its ledger holds ``claim`` as ``product``."""
    uid = claim.metadata.uid
    entry = quotas.merged(quota, uid, quotas.claim_milli(claim), product)
    entry = dataclasses.replace(entry, name=claim.metadata.name)
    status = dataclasses.replace(quota.status, claims={**quota.status.claims, uid: entry})
    return dataclasses.replace(quota, status=status)


def simulate(
    claim: models.GpuClaim, snapshot: Snapshot, *, count: int = 1, cluster_scope: bool = False
) -> Outcome:
    """Place ``count`` copies of ``claim`` one after another on ``snapshot`` (pure): the copies
    that land, and for the first that does not, the allocator's verdicts, the quota or taint that
    holds it back and whom it would preempt (``cluster_scope``: --preemption-scope Cluster)."""
    namespace = claim.metadata.namespace
    ledger = list(snapshot.quotas)
    kept, refused = asks.allowed_tolerations(claim, ledger)
    if refused:
        claim = dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, tolerations=kept))
    heartbeats = snapshot.heartbeats
    if heartbeats is None:
        heartbeats = views.latest_heartbeats(snapshot.statuses.values(), ())
    ages = {
        name: node_views_.heartbeat_age_by_clock(heartbeats.get(name), snapshot.now)
        for name in snapshot.statuses
    }
    requested: dict[str, dict[str, int]] | None = None
    if snapshot.pods is not None:
        requested = node_views_.requested_by_node(snapshot.pods)
    holding = list(snapshot.claims)  # and each copy placed so far, as Allocated
    ahead = pending_ahead(claim, snapshot.claims)
    landed: list[tuple[models.Allocation, ...]] = []
    notes: list[str] = []
    # GpuQuota.spec.maxClaims: the controller considers only the namespace's oldest claims, and a
    # claim submitted now is the newest.
    limit = waking.max_claims(list(ledger))
    existing = sum(1 for c in snapshot.claims if c.metadata.namespace == namespace)
    for number in range(count):
        if limit is not None and existing + number >= limit[0]:
            why = waking.too_many_message(namespace, limit[1], limit[0], existing + number + 1)
            return Outcome(
                asked=count, landed=tuple(landed), notes=tuple(notes), reason=why, quota=why, ahead=ahead
            )
        copy = _copy(claim, number)
        taken, milli_used = node_views_.held_by_claims(holding)
        node_views = node_views_.build_node_views(
            statuses=snapshot.statuses,
            nodes=snapshot.nodes,
            is_taken=taken.__contains__,
            milli_used=milli_used,
            heartbeat_ages=ages,
            stale_after=node_views_.NODE_STALE_AFTER_S,
            requested=requested,
        )
        index = NodeIndex()
        for view in node_views:
            index.put(view)
        decision = allocator.allocate(copy, index, seed=node_views_.seed_for(copy.metadata.uid), explain=True)
        if not decision.ok:
            note = asks.refused_note(
                refused, taints.claim_tolerations(copy.spec), (v.taints for v in node_views), namespace
            )
            victims, said = _preemption(copy, snapshot, ledger, node_views, cluster_scope=cluster_scope)
            return Outcome(
                asked=count,
                landed=tuple(landed),
                notes=tuple(notes),
                reason=decision.reason,
                per_node=decision.per_node,
                taint=note,
                victims=victims,
                preemption=said,
                ahead=ahead,
            )
        product = quotas.products_of(decision.allocations, snapshot.statuses)
        held_back = quotas.admissible(ledger, copy, product)
        if held_back:
            return Outcome(
                asked=count,
                landed=tuple(landed),
                notes=tuple(notes),
                reason=f"it would fit, but is held back by its quota: {held_back}",
                quota=held_back,
                ahead=ahead,
            )
        landed.append(decision.allocations)
        notes.append(decision.note)
        holding.append(
            dataclasses.replace(copy, status=models.GpuClaimStatus(allocations=decision.allocations))
        )
        if requested is not None and copy.spec.pod_resources:
            for allocation in decision.allocations:
                requests.add(requested.setdefault(allocation.node_name, {}), copy.spec.pod_resources)
        ledger = [_entered(q, copy, product) for q in ledger]
    return Outcome(asked=count, landed=tuple(landed), notes=tuple(notes), ahead=ahead)


def pending_ahead(claim: models.GpuClaim, claims: Sequence[models.GpuClaim]) -> tuple[str, ...]:
    """The pending claims (not being deleted) that the controller's queue would take before a claim
    submitted now (``allocator.order_key``: higher priority first, then older): the simulation does
    not place them first, so they may take GPUs it counts as free."""
    return tuple(
        other.key
        for other in allocator.order_pending(claims)
        if other.status.phase in ("", constants.PHASE_PENDING)
        and not other.metadata.deletion_timestamp
        and other.spec.priority >= claim.spec.priority
    )


def _preemption(
    claim: models.GpuClaim,
    snapshot: Snapshot,
    ledger: Sequence[models.GpuQuota],
    node_views: Sequence[allocator.NodeView],
    *,
    cluster_scope: bool,
) -> tuple[tuple[models.GpuClaim, ...], str]:
    """Whom the controller would preempt so that ``claim`` lands, and that in words."""
    scope = f"--preemption-scope {'Cluster' if cluster_scope else 'Namespace'}"
    if claim.spec.preemption_policy == constants.PREEMPT_NEVER:
        return (), "none: its preemptionPolicy is Never"
    cap = quotas.max_priority(ledger)

    def priority(c: models.GpuClaim) -> int:
        # The cap is the claim's namespace's: other namespaces' claims keep their own priority here.
        own = c.metadata.namespace == claim.metadata.namespace
        return c.spec.priority if cap is None or not own else min(c.spec.priority, cap)

    def admit(decision: allocator.Decision) -> str:
        return quotas.admissible(ledger, claim, quotas.products_of(decision.allocations, snapshot.statuses))

    pool = preemption.candidates(claim, snapshot.claims, priority=priority, cluster_scope=cluster_scope)
    plan = preemption.choose(
        claim, pool, node_views, lambda v: allocator.allocate(claim, v), priority=priority, admit=admit
    )
    if plan is None:
        where = "in the cluster" if cluster_scope else "in its namespace"
        return (), f"none: no claim of lower priority {where} frees enough ({scope})"
    return plan.victims, f"would land {plan.describe()} ({scope})"


# ------------------------------------------------------------------ the report


def _devices(allocation: models.Allocation) -> str:
    return ", ".join(constants.device_display(d.index, d.uuid) for d in allocation.devices)


def render_text(claim: models.GpuClaim, outcome: Outcome, snapshot: Snapshot) -> str:
    """What ``gpualloc simulate`` prints (pure)."""
    lines = [f"Claim {claim.key} (simulated: nothing was written)"]
    lines.append(f"  wants:   {explaining.describe_request(claim)}")
    many = outcome.asked > 1
    if many:
        lines.append(f"  fits:    {len(outcome.landed)} of {outcome.asked} such claims now")
    for number, (allocations, note) in enumerate(zip(outcome.landed, outcome.notes, strict=True)):
        prefix = f"  claim {number + 1}, " if many else "  "
        for a in allocations:
            least = f" least {a.min_bandwidth_gbps} GB/s" if len(a.devices) > 1 else ""
            lines.append(f"{prefix}replica {a.replica}: would land on {a.node_name} [{_devices(a)}]{least}")
        if note:
            lines.append(f"  note:    {note}")
    if outcome.reason:
        which = f"claim {len(outcome.landed) + 1}" if many else "it"
        verdict = f"{outcome.reason}; {outcome.taint}" if outcome.taint else outcome.reason
        lines.append(f"  not:     {which} does not land: {verdict}")
    if outcome.preemption:
        lines.append(f"  preempt: {outcome.preemption}")
    if outcome.ahead:
        listed = ", ".join(outcome.ahead[:5]) + (", ..." if len(outcome.ahead) > 5 else "")
        lines.append(
            f"  queue:   {len(outcome.ahead)} pending claims come first and were not placed: {listed}"
        )
    if outcome.per_node:
        lines.append("")
        lines.append(views.table(["NODE", "VERDICT"], explaining.verdict_rows(outcome.per_node)))
    elif outcome.reason and not snapshot.statuses:
        lines.append("")
        lines.append("No GPU nodes are published.")
    if snapshot.quotas:
        lines.append("")
        lines.append(views.format_quotas(snapshot.quotas, all_namespaces=False))
    if snapshot.unseen:
        lines.append("")
        lines += [f"not counted: {what}" for what in snapshot.unseen]
    return "\n".join(lines)


def render_json(claim: models.GpuClaim, outcome: Outcome, snapshot: Snapshot) -> dict[str, Any]:
    """The same report as data (``-o json``)."""
    return {
        "claim": claim.key,
        "asked": outcome.asked,
        "fits": len(outcome.landed),
        "landed": [[codecs.encode(a) for a in allocations] for allocations in outcome.landed],
        "notes": list(outcome.notes),
        "reason": outcome.reason,
        "quota": outcome.quota,
        "taint": outcome.taint,
        "preemption": outcome.preemption,
        "victims": [v.key for v in outcome.victims],
        "pendingAhead": list(outcome.ahead),
        "perNode": dict(outcome.per_node),
        "notCounted": list(snapshot.unseen),
    }


# ------------------------------------------------------------------ the edges


class Unlistable(Exception):
    """A list the simulation cannot do without (GpuNodeStatuses) is forbidden to this user."""


async def fetch(kubeconfig: str | None, namespace: str, heartbeat_namespace: str) -> dict[str, Any]:
    """One snapshot, with only GETs, as far as this user may list: the raw items of each list, and
    ``unseen``: what it could not list and what that leaves uncounted."""
    from gpualloc.kube import client, errors, transport, watching

    api = await client.connect(views.kubeconfig_path(kubeconfig))
    unseen: list[str] = []

    async def items(kind: Any, where: str | None) -> list[dict[str, Any]] | None:
        try:
            listed: list[dict[str, Any]] = (await transport.request(api, "GET", kind.path(where)))["items"]
            return listed
        except errors.Forbidden:
            return None

    try:
        statuses = await items(watching.NODE_STATUSES, None)
        if statuses is None:
            raise Unlistable(
                "you may not list GpuNodeStatuses (cluster-scoped): without them there are no GPUs to"
                " place on. A namespace's edit role cannot grant them; a cluster admin can (see"
                ' docs/operations.md, "What if: gpualloc simulate")'
            )
        claims = await items(watching.CLAIMS, None)
        if claims is None:
            claims = await items(watching.CLAIMS, namespace) or []
            unseen.append(
                f"GpuClaims outside namespace {namespace} (you may not list them): the GPUs they hold"
                " were counted as free, and none of them could be preempted"
            )
        nodes = await items(watching.NODES, None)
        if nodes is None:
            unseen.append(
                "Nodes (you may not list them): their labels, taints, cordons and allocatable were not"
                " checked; each GpuNodeStatus's labels stood in for its Node's"
            )
        quota_items = await items(watching.QUOTAS, namespace)
        if quota_items is None:
            unseen.append(f"GpuQuotas of namespace {namespace} (you may not list them)")
        heartbeats = await items(watching.LEASES, heartbeat_namespace)
        pods = await items(watching.PODS, None)
        if pods is None:
            unseen.append("the pods' CPU and memory (you may not list pods in every namespace)")
        return {
            "statuses": statuses,
            "claims": claims,
            "nodes": nodes,
            "quotas": quota_items or [],
            "heartbeats": heartbeats or [],
            "pods": pods,
            "unseen": unseen,
        }
    finally:
        await api.close()


def snapshot_of(raw: Mapping[str, Any], now: dt.datetime) -> Snapshot:
    """The snapshot from ``fetch``'s raw lists."""
    statuses = {s.spec.node_name: s for s in (codecs.parse_node_status(r) for r in raw["statuses"])}
    if raw["nodes"] is None:
        # Not visible: each node as present, schedulable and untainted, labelled as its status is.
        nodes = {
            name: node_views_.NodeFacts(name=name, labels=dict(s.metadata.labels), unschedulable=False)
            for name, s in statuses.items()
        }
    else:
        nodes = {f.name: f for f in (node_views_.node_facts(r) for r in raw["nodes"])}
    return Snapshot(
        claims=[codecs.parse_claim(c) for c in raw["claims"]],
        statuses=statuses,
        nodes=nodes,
        quotas=[codecs.parse_quota(q) for q in raw["quotas"]],
        now=now,
        heartbeats=views.latest_heartbeats(statuses.values(), raw["heartbeats"]),
        pods=raw["pods"],
        unseen=tuple(raw["unseen"]),
    )


def read_claim(text: str, namespace: str | None) -> models.GpuClaim:
    """The GpuClaim of a YAML (or JSON) document, in ``namespace`` (else its own, else default).
    Raises ValueError saying what is wrong."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"not YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("not a GpuClaim: the document is not a mapping")
    if raw.get("kind") != constants.CLAIM_KIND:
        raise ValueError(f"not a GpuClaim: kind is {raw.get('kind')!r}")
    if raw.get("apiVersion") not in (None, constants.API_VERSION):
        raise ValueError(f"apiVersion {raw.get('apiVersion')!r} is not {constants.API_VERSION}")
    metadata = dict(raw.get("metadata") or {})
    metadata["namespace"] = namespace or metadata.get("namespace") or "default"
    metadata.setdefault("name", "simulated")
    metadata.pop("uid", None)
    try:
        claim = codecs.parse_claim({**raw, "metadata": metadata, "status": {}})
    except codecs.DecodeError as exc:
        raise ValueError(str(exc)) from None
    problem = bad_input(claim)
    if problem:
        raise ValueError(problem)
    return claim


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gpualloc simulate",
        description="Say where a GpuClaim would land now, and whom it would preempt, without submitting it.",
    )
    parser.add_argument("-f", "--filename", required=True, help="the GpuClaim's YAML ('-': standard input)")
    parser.add_argument("-n", "--namespace", help="the claim's namespace (default: the file's, else default)")
    parser.add_argument(
        "--count", type=int, default=1, help="how many such claims to place, one after another"
    )
    parser.add_argument(
        "--preemption-scope", choices=SCOPES, default="Namespace", help="whose claims preemption may take"
    )
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.add_argument("--kubeconfig", help="path to a kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    views.add_heartbeat_namespace(parser)
    args = parser.parse_args(argv)
    if args.count < 1:
        print("error: --count must be at least 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
        claim = read_claim(text, args.namespace)
    except (OSError, ValueError) as exc:
        print(f"error: {args.filename}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    from gpualloc.kube import errors

    try:
        raw = asyncio.run(fetch(args.kubeconfig, claim.metadata.namespace, args.heartbeat_namespace))
    except (Unlistable, errors.KubeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    snapshot = snapshot_of(raw, dt.datetime.now(dt.UTC))
    outcome = simulate(claim, snapshot, count=args.count, cluster_scope=args.preemption_scope == "Cluster")
    if args.output == "json":
        print(json.dumps(render_json(claim, outcome, snapshot), indent=2))
    else:
        print(render_text(claim, outcome, snapshot))
    return EXIT_FITS if outcome.fits else EXIT_DOES_NOT_FIT
