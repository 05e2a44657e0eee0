"""`gpualloc get nodes|claims|quotas` and `gpualloc topo NODE`: what people look at.

The formatting functions are pure (models in, text out) and unit-tested; the
``*_main`` functions read the cluster through a kubeconfig the way kubectl does
(``--kubeconfig``, else ``$KUBECONFIG``, else ``~/.kube/config``, else
in-cluster). Installed as ``kubectl-gpualloc`` too, so ``kubectl gpualloc get
nodes`` works.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpualloc.api import codecs, constants, leases, models, timestamps

# Where the chart's default release (namespace gpualloc-system) keeps the agents' heartbeat Leases.
HEARTBEAT_NAMESPACE = leases.heartbeat_namespace(constants.DEFAULT_NAMESPACE)


def age(timestamp: str | None, now: dt.datetime) -> str:
    """kubectl-style age: 45s, 12m, 3h, 5d."""
    then = timestamps.parse_time(timestamp)
    if then is None:
        return "<unknown>"
    seconds = max(0, int((now - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size or (unit == "m" and seconds >= size):
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def latest_heartbeats(
    statuses: Iterable[models.GpuNodeStatus], heartbeat_leases: Iterable[Mapping[str, Any]]
) -> dict[str, str]:
    """Each node's latest heartbeat, by the agent's clock: its heartbeat Lease's renewTime, or its
    GpuNodeStatus's lastHeartbeatTime (written with every status change) when that is later."""
    latest: dict[str, tuple[dt.datetime, str]] = {}
    stamps = [(s.spec.node_name, s.status.last_heartbeat_time or "") for s in statuses]
    stamps += [
        (str((lease.get("metadata") or {}).get("name", "")), leases.renewed_at(lease))
        for lease in heartbeat_leases
    ]
    for node, text in stamps:
        when = timestamps.parse_time(text)
        if when is not None and (node not in latest or when > latest[node][0]):
            latest[node] = (when, text)
    return {node: text for node, (_, text) in latest.items()}


def table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Left-aligned columns separated by three spaces, like kubectl."""
    rows = [list(headers), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(headers))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def allocated_uuids(claims: Iterable[models.GpuClaim]) -> dict[str, str]:
    """Lock id (``DeviceRef.lock_id``: a UUID, or a shared GPU's slot) -> ``namespace/claim`` for
    every device an Allocated claim holds."""
    held: dict[str, str] = {}
    for claim in claims:
        for allocation in claim.status.allocations:
            for device in allocation.devices:
                held[device.lock_id] = claim.key
    return held


def allocated_milli(claims: Iterable[models.GpuClaim]) -> dict[str, int]:
    """GPU UUID -> the milli-GPU that claims' shares (``sharing.milli``) hold of it."""
    used: dict[str, int] = {}
    for claim in claims:
        for allocation in claim.status.allocations:
            for device in allocation.devices:
                if device.milli:
                    used[device.uuid] = used.get(device.uuid, 0) + device.milli
    return used


def format_nodes(
    nodes: Sequence[models.GpuNodeStatus],
    held: dict[str, str],
    now: dt.datetime,
    heartbeats: Mapping[str, str] | None = None,
    shares: Mapping[str, int] | None = None,
) -> str:
    """The node table; HEARTBEAT is the age of ``heartbeats[node]`` (``latest_heartbeats``), else of
    the GpuNodeStatus's own heartbeat; MILLI the milli-GPU used of each GPU that holds shares
    (``allocated_milli``: ``<index>:<milli>``, of 1000)."""
    beats = heartbeats or {}
    shares = shares or {}
    rows = []
    for node in sorted(nodes, key=lambda n: n.metadata.name):
        inv = node.status
        # A GPU is allocated when it, one of its MIG instances or one of its slots is; FREE counts
        # the GPUs a claim of whole GPUs could get (healthy, not in MIG mode, not shared), MIG the
        # free instances of GPUs in MIG mode, SHARED the slots in use of shared GPUs.
        used = sum(1 for d in inv.devices if any(u in held for u in d.lock_ids))
        healthy = sum(1 for d in inv.devices if d.health == constants.HEALTHY)
        in_mig = [d for d in inv.devices if d.mig is not None and d.mig.enabled]
        sharing = [d for d in inv.devices if d.shared]
        free = sum(
            1
            for d in inv.devices
            if d.health == constants.HEALTHY
            and d not in in_mig
            and d not in sharing
            and not any(u in held for u in d.lock_ids)
        )
        slots = sum(len(d.slot_ids) for d in sharing)
        slots_used = sum(1 for d in sharing for s in d.slot_ids if s in held or d.uuid in held)
        shared = f"{slots_used}/{slots}" if sharing else "-"
        instances = [(d, m) for d in in_mig for m in (d.mig.devices if d.mig is not None else ())]
        open_instances = sum(
            1
            for d, m in instances
            if d.health == constants.HEALTHY and m.uuid not in held and d.uuid not in held
        )
        mig = f"{open_instances}/{len(instances)}" if in_mig else "-"
        milli = ",".join(f"{d.index}:{shares[d.uuid]}" for d in inv.devices if d.uuid in shares) or "-"
        islands = " ".join("[" + ",".join(map(str, i)) + "]" for i in inv.islands if len(i) > 1) or "-"
        rows.append(
            [
                node.metadata.name,
                str(inv.total),
                str(healthy),
                str(used),
                str(free),
                mig,
                shared,
                milli,
                inv.product or "-",
                islands,
                age(beats.get(node.spec.node_name) or inv.last_heartbeat_time, now),
            ]
        )
    headers = [
        "NODE",
        "GPUS",
        "HEALTHY",
        "ALLOCATED",
        "FREE",
        "MIG",
        "SHARED",
        "MILLI",
        "PRODUCT",
        "NVLINK ISLANDS",
        "HEARTBEAT",
    ]
    return table(headers, rows)


def format_claims(claims: Sequence[models.GpuClaim], now: dt.datetime, *, all_namespaces: bool) -> str:
    rows = []
    for claim in sorted(claims, key=lambda c: (c.metadata.namespace, c.metadata.name)):
        status = claim.status
        row = [
            claim.metadata.name,
            f"{claim.spec.replicas}x{claim.spec.devices.count}",
            status.phase or constants.PHASE_PENDING,
            status.nodes or "-",
            status.devices or "-",
            age(claim.metadata.creation_timestamp, now),
            "" if status.phase == constants.PHASE_ALLOCATED else status.message,
        ]
        rows.append([claim.metadata.namespace, *row] if all_namespaces else row)
    headers = ["NAME", "GPUS", "PHASE", "NODE", "DEVICES", "AGE", "MESSAGE"]
    return table(["NAMESPACE", *headers] if all_namespaces else headers, rows)


def format_quotas(quotas: Sequence[models.GpuQuota], *, all_namespaces: bool) -> str:
    """One row per GpuQuota (GPUs its ledger holds, its hard limit, its priority cap), then an
    indented row per product limit. USED comes from the quota's status, as the controller wrote
    it; it may be above HARD (claims Allocated before the quota existed)."""
    rows = []
    for quota in sorted(quotas, key=lambda q: (q.metadata.namespace, q.metadata.name)):
        cap = "-" if quota.spec.max_priority is None else str(quota.spec.max_priority)
        row = [quota.metadata.name, str(quota.status.used), str(quota.spec.gpus), cap]
        rows.append([quota.metadata.namespace, *row] if all_namespaces else row)
        for limit in quota.spec.products:
            used = quota.status.used_by_product.get(limit.pattern, 0)
            row = [f"  {limit.pattern}", str(used), str(limit.gpus), ""]
            rows.append(["", *row] if all_namespaces else row)
    headers = ["NAME", "USED", "HARD", "MAX-PRIORITY"]
    return table(["NAMESPACE", *headers] if all_namespaces else headers, rows)


def format_topology(node: models.GpuNodeStatus) -> str:
    """A matrix like ``nvidia-smi topo -m``, from the published links."""
    inv = node.status
    indices = [d.index for d in sorted(inv.devices, key=lambda d: d.index)]
    kind = {(link.a, link.b): link.type for link in inv.links}
    bandwidth = {(link.a, link.b): link.bandwidth_gbps for link in inv.links}
    names = [f"GPU{i}" for i in indices]
    rows = []
    for a in indices:
        cells = []
        for b in indices:
            pair = (min(a, b), max(a, b))
            cells.append("X" if a == b else kind.get(pair, "?"))
        numa = next((d.numa_node for d in inv.devices if d.index == a), -1)
        rows.append([f"GPU{a}", *cells, "N/A" if numa < 0 else str(numa)])
    out = [table(["", *names, "NUMA Affinity"], rows), ""]
    out.append("Least bandwidth per NVLink island (GB/s, bidirectional):")
    for island in inv.islands:
        pairs = [(a, b) for i, a in enumerate(island) for b in island[i + 1 :]]
        least = min((bandwidth.get(p, 0) for p in pairs), default=0)
        out.append(f"  [{','.join(map(str, island))}]: {least if pairs else '-'}")
    out += [
        "",
        "Legend:",
        "  X    = Self",
        "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes",
        "  NODE = Connection traversing PCIe and the interconnect between host bridges within a NUMA node",
        "  PHB  = Connection traversing PCIe and a PCIe host bridge (typically the CPU)",
        "  PXB  = Connection traversing multiple PCIe bridges (without the host bridge)",
        "  PIX  = Connection traversing at most a single PCIe bridge",
        "  NV#  = Connection traversing a bonded set of # NVLinks",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------ the edges


def kubeconfig_path(explicit: str | None) -> str | None:
    """kubectl's order: the flag, $KUBECONFIG (every file in it, merged), ~/.kube/config;
    None means in-cluster."""
    if explicit:
        return explicit
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"]
    default = Path.home() / ".kube" / "config"
    return str(default) if default.exists() else None


# Lists a user may lack the right to read, and what they read as then.
OPTIONAL_LISTS: dict[str, list[Any] | None] = {"heartbeats": [], "pods": None, "leases": None}


async def fetch(kubeconfig: str | None, lists: Mapping[str, str | None]) -> dict[str, Any]:
    """The items of each list that ``lists`` names (``claims``, ``statuses``: GpuNodeStatuses,
    ``nodes``: core Nodes, ``quotas``, ``heartbeats``: the heartbeat Leases), in the namespace it
    maps to (None: every namespace; ignored for the cluster-scoped ones), read over one connection.
    The heartbeat Leases are only a better heartbeat: a user who may not list them gets none;
    one who may not list every pod gets None for ``pods``."""
    from gpualloc.kube import client, errors, transport, watching

    kinds = {
        "claims": watching.CLAIMS,
        "statuses": watching.NODE_STATUSES,
        "nodes": watching.NODES,
        "quotas": watching.QUOTAS,
        "heartbeats": watching.LEASES,
        "leases": watching.LEASES,  # the device Leases (`gpualloc get usage`)
        "pods": watching.PODS,
    }
    api = await client.connect(kubeconfig_path(kubeconfig))
    out: dict[str, Any] = {}
    try:
        for name, namespace in lists.items():
            try:
                out[name] = (await transport.request(api, "GET", kinds[name].path(namespace)))["items"]
            except (errors.Forbidden, errors.NotFound):
                if name not in OPTIONAL_LISTS:
                    raise
                out[name] = OPTIONAL_LISTS[name]
        return out
    finally:
        await api.close()


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--kubeconfig", help="path to a kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    return parser


def add_heartbeat_namespace(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--heartbeat-namespace",
        default=HEARTBEAT_NAMESPACE,
        help=f"where the agents' heartbeat Leases are (default {HEARTBEAT_NAMESPACE}, the chart's"
        " agent.heartbeatNamespace in release namespace gpualloc-system)",
    )


def run_or_exit(coro: Any) -> dict[str, Any]:
    """Run a fetch; on an API error print it and exit 1 (no traceback for people)."""
    from gpualloc.kube import errors

    try:
        result: dict[str, Any] = asyncio.run(coro)
        return result
    except errors.KubeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc


# What `gpualloc get` lists, singular or plural as kubectl takes them.
KINDS = {
    "node": "nodes",
    "nodes": "nodes",
    "claim": "claims",
    "claims": "claims",
    "quota": "quotas",
    "quotas": "quotas",
}


def get_main(argv: Sequence[str]) -> int:
    if list(argv[:1]) == ["usage"]:  # its own flags: `gpualloc get usage [-n NS | -A] [--since 24h]`
        from gpualloc import usage_view

        return usage_view.main(argv[1:])
    parser = _parser("gpualloc get")
    parser.add_argument("what", choices=[*KINDS, "usage"], help="what to list (usage: GPU-hours)")
    parser.add_argument("-n", "--namespace", default="default", help="namespace of the claims or quotas")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="in every namespace")
    add_heartbeat_namespace(parser)
    args = parser.parse_args(argv)
    what = KINDS[args.what]
    if what == "nodes":
        lists = {"statuses": None, "claims": None, "heartbeats": args.heartbeat_namespace}
        raw = run_or_exit(fetch(args.kubeconfig, lists))
        nodes = [codecs.parse_node_status(n) for n in raw["statuses"]]
        claims = [codecs.parse_claim(c) for c in raw["claims"]]
        beats = latest_heartbeats(nodes, raw["heartbeats"])
        out = format_nodes(nodes, allocated_uuids(claims), _now(), beats, allocated_milli(claims))
        print(out if nodes else "No GPU nodes found.")
        return 0
    namespace = None if args.all_namespaces else args.namespace
    where = "any namespace" if args.all_namespaces else f"namespace {args.namespace}"
    raw = run_or_exit(fetch(args.kubeconfig, {what: namespace}))
    if what == "quotas":
        quotas = [codecs.parse_quota(q) for q in raw["quotas"]]
        listed = format_quotas(quotas, all_namespaces=args.all_namespaces) if quotas else ""
        print(listed or f"No GpuQuotas found in {where}.")
        return 0
    claims = [codecs.parse_claim(c) for c in raw["claims"]]
    listed = format_claims(claims, _now(), all_namespaces=args.all_namespaces) if claims else ""
    print(listed or f"No GpuClaims found in {where}.")
    return 0


def topo_main(argv: Sequence[str]) -> int:
    parser = _parser("gpualloc topo")
    parser.add_argument("node", help="node name (the GpuNodeStatus of the same name)")
    args = parser.parse_args(argv)
    raw = run_or_exit(fetch(args.kubeconfig, {"statuses": None}))
    for item in raw["statuses"]:
        if item.get("metadata", {}).get("name") == args.node:
            print(format_topology(codecs.parse_node_status(item)))
            return 0
    known = ", ".join(sorted(i["metadata"]["name"] for i in raw["statuses"])) or "none"
    print(f"error: no GpuNodeStatus named {args.node!r} (known: {known})", file=sys.stderr)
    return 1
