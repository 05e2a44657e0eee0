"""`gpualloc get usage`: GPU-hours per namespace and claim, from the API server's records.

The figures are those of ``gpualloc.usage``: the device Leases held now (from
their acquireTime, in the controller's namespace, ``--lease-namespace``) and the
claims in phase Released (from lastScheduleTime to releasedTime). A reader who
may not list the Leases gets the Allocated claims' statuses instead (whole
seconds). ``--since`` counts only the hours after that much time ago.

Then what is allocated but idle for ``--idle-after``: the GPUs of Allocated claims on which
their agent has seen no compute process (``usage.idle_gpus``, from the GpuNodeStatuses'
``idleSince``), and the Allocated claims that no pod has used (``usage.idle_claims``, from the
pods). A reader who may not list GpuNodeStatuses, or pods, is told so instead.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import re
from collections.abc import Sequence
from typing import Any

from gpualloc import usage, views
from gpualloc.api import codecs, constants

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> dt.timedelta:
    """``90s``, ``30m``, ``24h``, ``7d``, ``1h30m``: a positive duration; ValueError otherwise."""
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r} (e.g. 30m, 24h, 7d)")
    return dt.timedelta(seconds=sum(float(n) * _UNIT_SECONDS[u] for n, u in parts))


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def by_namespace(claims: Sequence[usage.ClaimUsage]) -> dict[str, float]:
    """GPU-seconds per namespace."""
    totals: dict[str, float] = {}
    for c in claims:
        totals[c.namespace] = totals.get(c.namespace, 0.0) + c.seconds
    return dict(sorted(totals.items()))


def span(duration: dt.timedelta) -> str:
    """``--idle-after`` as people write it: ``30m``, ``1h30m``, ``45s``."""
    seconds, out = int(duration.total_seconds()), ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            out += f"{seconds // size}{unit}"
            seconds %= size
    return out or "0s"


def format_idle(idle: Sequence[usage.IdleClaim], now: dt.datetime, idle_after: dt.timedelta) -> str:
    """The Allocated claims no pod has used for ``idle_after``, or a line saying there is none."""
    if not idle:
        return f"No Allocated claim without a running pod for {span(idle_after)} or more."
    rows = [
        [c.namespace, c.claim, str(c.gpus), ",".join(c.nodes), views.age(c.idle_since.isoformat(), now)]
        for c in idle
    ]
    title = f"Allocated but idle (no pod running for {span(idle_after)} or more):"
    return title + "\n" + views.table(["NAMESPACE", "CLAIM", "GPUS", "NODES", "IDLE"], rows)


def format_idle_gpus(idle: Sequence[usage.IdleGpu], now: dt.datetime, idle_after: dt.timedelta) -> str:
    """The allocated GPUs without a process for ``idle_after``, or a line saying there is none."""
    if not idle:
        return f"No allocated GPU without a process for {span(idle_after)} or more."
    rows = [
        [g.namespace, g.claim, g.node, f"gpu-{g.index}", views.age(g.idle_since.isoformat(), now)]
        for g in idle
    ]
    title = f"Allocated GPUs without a process for {span(idle_after)} or more (their agents' idleSince):"
    return title + "\n" + views.table(["NAMESPACE", "CLAIM", "NODE", "GPU", "IDLE"], rows)


def format_usage(claims: Sequence[usage.ClaimUsage], *, all_namespaces: bool) -> str:
    """The claims' table, then each namespace's total."""
    head = ["CLAIM", "PHASE", "GPUS", "PRODUCT", "GPU-HOURS"]
    rows = [[c.claim, c.phase, str(c.gpus), ",".join(c.products) or "-", hours(c.seconds)] for c in claims]
    if all_namespaces:
        head = ["NAMESPACE", *head]
        rows = [[c.namespace, *row] for c, row in zip(claims, rows, strict=True)]
    totals = views.table(
        ["NAMESPACE", "GPU-HOURS"], [[ns, hours(s)] for ns, s in by_namespace(claims).items()]
    )
    return views.table(head, rows) + "\n\n" + totals


def as_json(
    claims: Sequence[usage.ClaimUsage],
    *,
    now: dt.datetime,
    since: dt.datetime | None,
    idle: Sequence[usage.IdleClaim] | None = None,
    idle_gpus: Sequence[usage.IdleGpu] | None = None,
) -> str:
    def stamp(when: dt.datetime | None) -> str | None:
        return None if when is None else when.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")

    return json.dumps(
        {
            "now": stamp(now),
            "since": stamp(since),
            "namespaces": {ns: {"gpuSeconds": round(s, 3)} for ns, s in by_namespace(claims).items()},
            "claims": [
                {
                    "namespace": c.namespace,
                    "name": c.claim,
                    "phase": c.phase,
                    "gpus": c.gpus,
                    "products": list(c.products),
                    "heldSeconds": round(c.held_seconds, 3),
                    "releasedSeconds": round(c.released_seconds, 3),
                    "gpuSeconds": round(c.seconds, 3),
                }
                for c in claims
            ],
            "idle": None
            if idle is None
            else [
                {
                    "namespace": c.namespace,
                    "name": c.claim,
                    "gpus": c.gpus,
                    "nodes": list(c.nodes),
                    "idleSince": stamp(c.idle_since),
                }
                for c in idle
            ],
            "idleGpus": None
            if idle_gpus is None
            else [
                {
                    "namespace": g.namespace,
                    "claim": g.claim,
                    "node": g.node,
                    "index": g.index,
                    "uuid": g.uuid,
                    "idleSince": stamp(g.idle_since),
                }
                for g in idle_gpus
            ],
        },
        indent=2,
    )


def _statuses(kubeconfig: str | None) -> list[dict[str, Any]] | None:
    """The GpuNodeStatuses, which name each device's product and its idleSince; None for a reader
    who may not list them."""
    from gpualloc.kube import errors

    try:
        found: list[dict[str, Any]] = asyncio.run(views.fetch(kubeconfig, {"statuses": None}))["statuses"]
    except errors.Forbidden:
        return None
    return found


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpualloc get usage")
    parser.add_argument("--kubeconfig", help="path to a kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    parser.add_argument("-n", "--namespace", default="default", help="namespace of the claims")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="in every namespace")
    parser.add_argument(
        "--since", default="", help="only the hours after this long ago (e.g. 24h; default: all)"
    )
    parser.add_argument(
        "--lease-namespace",
        default=constants.DEFAULT_NAMESPACE,
        help=f"the controller's namespace, with the device Leases (default {constants.DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--idle-after",
        default="30m",
        help="list the allocated GPUs without a process, and the Allocated claims without a running pod,"
        " for this long (default 30m)",
    )
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")
    args = parser.parse_args(argv)
    now = views._now()
    try:
        since = now - parse_duration(args.since) if args.since else None
        idle_after = parse_duration(args.idle_after)
    except ValueError as exc:
        parser.error(str(exc))
    namespace = None if args.all_namespaces else args.namespace
    raw = views.run_or_exit(
        views.fetch(args.kubeconfig, {"claims": namespace, "leases": args.lease_namespace, "pods": namespace})
    )
    claims = [codecs.parse_claim(c) for c in raw["claims"]]
    listed = _statuses(args.kubeconfig)
    statuses = [codecs.parse_node_status(s) for s in listed or ()]
    held = None
    if raw["leases"] is not None:
        held = [
            h
            for h in usage.holdings(raw["leases"], usage.device_kinds(statuses))
            if namespace is None or h.namespace == namespace
        ]
    found = usage.claim_usage(held, claims, now, since=since)
    idle = None if raw["pods"] is None else usage.idle_claims(claims, raw["pods"], now, idle_after=idle_after)
    idle_gpus = None if listed is None else usage.idle_gpus(claims, statuses, now, idle_after=idle_after)
    if args.output == "json":
        print(as_json(found, now=now, since=since, idle=idle, idle_gpus=idle_gpus))
        return 0
    where = "any namespace" if namespace is None else f"namespace {namespace}"
    print(
        format_usage(found, all_namespaces=args.all_namespaces)
        if found
        else f"No GPU usage found in {where}."
    )
    print()
    print(
        format_idle_gpus(idle_gpus, now, idle_after)
        if idle_gpus is not None
        else "Idle GPUs not shown: you may not list GpuNodeStatuses."
    )
    print()
    print(
        format_idle(idle, now, idle_after)
        if idle is not None
        else "Idle claims not shown: you may not list pods."
    )
    return 0
