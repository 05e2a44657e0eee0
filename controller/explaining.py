"""`gpualloc explain claim NAME [-n NS]`: why a claim is pending, node by node.

It reads what the controller reads (claims, GpuNodeStatus, Nodes, the
namespace's GpuQuotas), builds the same node views and node index, and runs
the same allocator with ``explain=True``: the decision the controller would
make, and a verdict per node (``allocator._explain_indexed`` says which nodes
it examines on a large cluster). On more than 50 nodes, nodes that share a
verdict share a row. Devices
count as taken when another claim's status lists them; a plan that fits is
then held to the namespace's quotas as the controller's ledger would hold it.
Nothing is written.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as dt
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from controller import allocator, asks, gates, preemption, quotas
from controller import views as node_views_
from controller.nodes import NodeIndex
from gpualloc import views
from gpualloc.api import codecs, constants, models, taints


def describe_request(claim: models.GpuClaim) -> str:
    spec = claim.spec
    parts = [f"{spec.replicas} x {spec.devices.count} GPU{'s' if spec.devices.count > 1 else ''}"]
    milli = spec.devices.sharing.milli if spec.devices.sharing is not None else None
    if spec.devices.exclusivity == "Shared" and milli:
        parts = [f"{spec.replicas} x a share of {milli} milli-GPU of one GPU"]
    if spec.devices.product:
        parts.append(f'product "{spec.devices.product}"')
    if spec.devices.products:
        parts.append("product " + " or ".join(f'"{p}"' for p in spec.devices.products))
    if spec.devices.min_memory_mib:
        parts.append(f">= {spec.devices.min_memory_mib} MiB")
    if spec.devices.min_compute_capability:
        parts.append(f"compute capability >= {spec.devices.min_compute_capability}")
    if spec.devices.policy != "packed":
        parts.append(f"policy {spec.devices.policy}")
    topology = spec.topology
    if topology.mode != "Ignore":
        bar = f" >= {topology.min_bandwidth_gbps} GB/s" if topology.min_bandwidth_gbps else ""
        parts.append(f"topology {topology.mode}{bar}")
    if spec.node_name:
        parts.append(f"node {spec.node_name}")
    if spec.selector and (spec.selector.match_labels or spec.selector.match_expressions):
        parts.append("a node selector")
    parts.append(f"strategy {spec.strategy}")
    return ", ".join(parts)


def explain(
    claim: models.GpuClaim,
    *,
    claims: Sequence[models.GpuClaim],
    statuses: Mapping[str, models.GpuNodeStatus],
    nodes: Mapping[str, node_views_.NodeFacts],
    now: dt.datetime,
    namespace_quotas: Sequence[models.GpuQuota] = (),
    heartbeats: Mapping[str, str] | None = None,
    pods: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The report `gpualloc explain` prints (pure). ``heartbeats``: each node's latest heartbeat
    (``views.latest_heartbeats``; default: its GpuNodeStatus's own). ``pods``: every pod of the
    cluster, whose requests count against their nodes' allocatable, and whose gated pods of the
    claim ask what they request; None when they could not be listed (not counted then)."""
    if heartbeats is None:
        heartbeats = views.latest_heartbeats(statuses.values(), ())
    lines = [f"Claim {claim.key}: {claim.status.phase or constants.PHASE_PENDING}"]
    lines.append(f"  wants:   {describe_request(claim)}")
    if claim.status.phase == constants.PHASE_ALLOCATED:
        for a in claim.status.allocations:
            devices = ", ".join(
                constants.device_display(d.index, d.uuid) + (f" ({d.milli} milli-GPU)" if d.milli else "")
                for d in a.devices
            )
            lines.append(
                f"  replica {a.replica}: {a.node_name} [{devices}] least {a.min_bandwidth_gbps} GB/s"
            )
        return "\n".join(lines)
    if claim.status.message:
        lines.append(f"  status:  {claim.status.message}")
    # As the controller plans it (--claim-tolerations Allowed, the default): only the tolerations
    # its namespace's GpuQuotas allow.
    kept, refused = asks.allowed_tolerations(claim, namespace_quotas)
    if refused:
        claim = dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, tolerations=kept))
    requested = None
    if pods is not None:
        requested = node_views_.requested_by_node(pods)
        own = [p for p in pods if (p.get("metadata") or {}).get("namespace") == claim.metadata.namespace]
        gated = [p for p in gates.pods_using(claim.metadata.name, own) if gates.is_gated(p)]
        claim = asks.with_pods_requests(claim, (gates.kept_requests(dict(p)) for p in gated))
    taken, milli_used = node_views_.held_by_claims(c for c in claims if c.metadata.uid != claim.metadata.uid)
    node_views = node_views_.build_node_views(
        statuses=statuses,
        nodes=nodes,
        is_taken=taken.__contains__,
        milli_used=milli_used,
        heartbeat_ages={
            name: node_views_.heartbeat_age_by_clock(heartbeats.get(name), now) for name in statuses
        },
        stale_after=node_views_.NODE_STALE_AFTER_S,
        requested=requested,
    )
    index = NodeIndex()
    for view in node_views:
        index.put(view)
    decision = allocator.allocate(claim, index, explain=True)
    verdict = decision.reason
    if decision.ok:
        product = quotas.products_of(decision.allocations, statuses)
        milli, uid = quotas.claim_milli(claim), claim.metadata.uid
        over = [quotas.verdict(q, uid, quotas.merged(q, uid, milli, product)) for q in namespace_quotas]
        held_back = next((why for why in over if why), "")
        fits = f"would fit ({decision.note})" if decision.note else "would fit"
        verdict = f"{fits}, but is held back by its quota: {held_back}" if held_back else fits
    else:
        node_taints = (view.taints for view in node_views)
        note = asks.refused_note(
            refused, taints.claim_tolerations(claim.spec), node_taints, claim.metadata.namespace
        )
        verdict = f"{verdict}; {note}" if note else verdict
    lines.append(f"  now:     {verdict}")
    if not decision.ok and claim.spec.preemption_policy != constants.PREEMPT_NEVER:
        cap = quotas.max_priority(namespace_quotas)

        def priority(c: models.GpuClaim) -> int:
            return c.spec.priority if cap is None else min(c.spec.priority, cap)

        def admit(decision: allocator.Decision) -> str:
            return quotas.admissible(
                namespace_quotas, claim, quotas.products_of(decision.allocations, statuses)
            )

        pool = preemption.candidates(claim, claims, priority=priority, cluster_scope=False)
        plan = preemption.choose(
            claim, pool, node_views, lambda v: allocator.allocate(claim, v), priority=priority, admit=admit
        )
        could = (
            f"would be {plan.describe()}"
            if plan
            else "no claim of lower priority in its namespace frees enough"
        )
        lines.append(f"  preempt: {could} (--preemption-scope Namespace)")
    lines.append("")
    rows = verdict_rows(decision.per_node)
    lines.append(views.table(["NODE", "VERDICT"], rows) if rows else "No GPU nodes are published.")
    if namespace_quotas:
        lines.append("")
        lines.append(views.format_quotas(namespace_quotas, all_namespaces=False))
    return "\n".join(lines)


ROWS_IN_FULL = 50  # up to this many nodes, one row each


def verdict_rows(per_node: Mapping[str, str], in_full: int = ROWS_IN_FULL) -> list[list[str]]:
    """One row per node, or on a large cluster one row per verdict that several nodes share
    ("(1,200 nodes)"), after the nodes with verdicts of their own."""
    if len(per_node) <= in_full:
        return [[name, verdict] for name, verdict in sorted(per_node.items())]
    counts = collections.Counter(per_node.values())
    rows = [[name, verdict] for name, verdict in sorted(per_node.items()) if counts[verdict] <= 3]
    shared = sorted(((n, verdict) for verdict, n in counts.items() if n > 3), key=lambda c: (-c[0], c[1]))
    return rows + [[f"({n:,} nodes)", verdict] for n, verdict in shared]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpualloc explain")
    parser.add_argument("kind", choices=["claim"], help="what to explain")
    parser.add_argument("name", help="the GpuClaim's name")
    parser.add_argument("-n", "--namespace", default="default", help="the claim's namespace")
    parser.add_argument("--kubeconfig", help="path to a kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    views.add_heartbeat_namespace(parser)
    args = parser.parse_args(argv)
    lists = {"claims": None, "statuses": None, "nodes": None, "quotas": args.namespace}
    lists["heartbeats"] = args.heartbeat_namespace
    lists["pods"] = None
    raw = views.run_or_exit(views.fetch(args.kubeconfig, lists))
    claims = [codecs.parse_claim(c) for c in raw["claims"]]
    claim = next((c for c in claims if c.key == f"{args.namespace}/{args.name}"), None)
    if claim is None:
        print(f"error: GpuClaim {args.namespace}/{args.name} not found", file=sys.stderr)
        return 1
    statuses = {s.spec.node_name: s for s in (codecs.parse_node_status(r) for r in raw["statuses"])}
    nodes = {f.name: f for f in (node_views_.node_facts(r) for r in raw["nodes"])}
    namespace_quotas = [codecs.parse_quota(q) for q in raw["quotas"]]
    now = dt.datetime.now(dt.UTC)
    heartbeats = views.latest_heartbeats(statuses.values(), raw["heartbeats"])
    print(
        explain(
            claim,
            claims=claims,
            statuses=statuses,
            nodes=nodes,
            now=now,
            namespace_quotas=namespace_quotas,
            heartbeats=heartbeats,
            pods=raw["pods"] if raw["pods"] is not None else None,
        )
    )
    if raw["pods"] is None:
        print("(the pods' CPU and memory were not counted: you may not list pods in every namespace)")
    return 0
