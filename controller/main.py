"""``gpualloc controller``: allocate GpuClaims, one Lease per GPU, optionally behind leader election."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from controller import cluster, leader, running, settings, views
from controller import metrics as controller_metrics
from gpualloc.api import constants
from gpualloc.api import leases as lease_format
from gpualloc.kube import client
from gpualloc.runtime import eventloop, options, serving, signals
from gpualloc.runtime import logging as runtime_logging

log = logging.getLogger(__name__)

USER_AGENT = "gpualloc-controller"
DEFAULT_NAMESPACE = constants.DEFAULT_NAMESPACE
EXIT_LOST_LEADERSHIP = 1


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpualloc controller", description="Allocate GpuClaims: pick GPUs, lock each with a Lease."
    )
    parser.add_argument(
        "--namespace",
        default=DEFAULT_NAMESPACE,
        help="namespace of the device Leases and the election Lease"
        f" (default POD_NAMESPACE, else {DEFAULT_NAMESPACE})",
    )
    parser.add_argument(
        "--leader-elect",
        type=parse_bool,
        nargs="?",
        const=True,
        default=True,
        help="elect a leader through a Lease; --leader-elect=false runs without",
    )
    parser.add_argument(
        "--leader-election-id", default="gpualloc-controller", help="name of the election Lease"
    )
    parser.add_argument("--leader-election-lease-duration", type=float, default=15.0, help="seconds")
    parser.add_argument("--leader-election-renew-deadline", type=float, default=10.0, help="seconds")
    parser.add_argument("--leader-election-retry-period", type=float, default=2.0, help="seconds")
    parser.add_argument(
        "--leader-election-release-on-cancel",
        type=parse_bool,
        nargs="?",
        const=True,
        default=True,
        help="give the election Lease up on a clean shutdown",
    )
    parser.add_argument(
        "--identity", default="", help="this candidate's name (default POD_NAME or host_random)"
    )
    parser.add_argument("--workers", type=int, default=4, help="claims reconciled at the same time")
    parser.add_argument(
        "--node-stale-after",
        type=float,
        default=views.NODE_STALE_AFTER_S,
        help="seconds without a new heartbeat (the node's Lease renewed, or its GpuNodeStatus heartbeat"
        " moved) after which a node is stale",
    )
    parser.add_argument(
        "--heartbeat-namespace",
        default=None,
        help="namespace of the agents' heartbeat Leases (default <namespace>-heartbeats)",
    )
    parser.add_argument(
        "--cost-label", default=constants.LABEL_COST_TIER, help="node label read by strategy costOptimized"
    )
    parser.add_argument("--sweep-interval", type=float, default=30.0, help="seconds between sweeps")
    parser.add_argument(
        "--in-use-poll",
        type=float,
        default=settings.IN_USE_POLL,
        help="seconds between looks at a deleted claim that pods still use",
    )
    parser.add_argument(
        "--claim-selector",
        default="",
        help="label selector: allocate only the GpuClaims it matches (default all); controllers with"
        " different selectors can share one Lease namespace",
    )
    parser.add_argument(
        "--preemption-scope",
        choices=("Namespace", "Cluster", "None"),
        default="Namespace",
        help="whose claims a claim of higher priority may preempt: its namespace's (default), any"
        " namespace's, or nobody's",
    )
    parser.add_argument(
        "--claim-tolerations",
        choices=("Allowed", "Any"),
        default="Allowed",
        help="which of a claim's tolerations the allocator honours: those a GpuQuota of its namespace"
        " allows in spec.allowedTolerations (default), or all of them (single-tenant clusters)",
    )
    parser.add_argument(
        "--dra",
        type=parse_bool,
        nargs="?",
        const=True,
        default=False,
        help="write a resource.k8s.io/v1 ResourceClaim (driver gpu.gpualloc.dev) for each allocated"
        " replica, owned by its GpuClaim, for kube-scheduler and the kubelet (needs resource.k8s.io/v1)",
    )
    parser.add_argument(
        "--label-free-gpus",
        type=parse_bool,
        nargs="?",
        const=True,
        default=False,
        help=f'keep the label {constants.LABEL_FREE_GPUS} on every GPU node: "true" while it has a whole'
        ' GPU free for a claim, else "shares" while a shared GPU has milli-GPU left, else "false" (the'
        ' chart\'s packing.steerPodsWithoutClaim steers pods without GPUs to "false" nodes first, then'
        ' "shares"; needs patch on nodes)',
    )
    parser.add_argument(
        "--label-interval",
        type=float,
        default=settings.LABEL_INTERVAL,
        help="seconds between the free-GPUs label's passes",
    )
    options.add_common(parser, metrics_port=8080, health_port=8081)
    options.env_defaults(parser, fallbacks={**options.DOWNWARD_API, "namespace": "POD_NAMESPACE"})
    return parser


def default_identity() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


async def run(argv: Sequence[str], *, stop: asyncio.Event | None = None) -> int:
    """Run the controller until ``stop`` is set or the task is cancelled; the exit code.

    Returns 1 when it led and lost the election Lease (like client-go, it
    stops rather than risk two leaders; the pod restarts it as a standby).
    """
    args = build_parser().parse_args(list(argv))
    stop = stop or asyncio.Event()
    identity = args.identity or default_identity()
    # A connection per worker, and one for each watch (claims, leases, statuses, nodes, pods, quotas,
    # and with --dra the ResourceClaims and the mirror's workers).
    # The audit log tells controllers apart by the user agent (the benchmark counts requests by it).
    api = await client.connect(
        args.kubeconfig,
        connections=args.workers + 8 + (3 if args.dra else 0) + (1 if args.label_free_gpus else 0),
        user_agent=f"{USER_AGENT}/{identity}",
    )
    metrics = controller_metrics.Metrics()
    controller = running.Controller(
        cluster.KubeCluster(api, args.namespace),
        settings.Settings(
            namespace=args.namespace,
            workers=args.workers,
            node_stale_after=args.node_stale_after,
            heartbeat_namespace=lease_format.heartbeat_namespace(args.namespace, args.heartbeat_namespace),
            cost_label=args.cost_label,
            sweep_interval=args.sweep_interval,
            in_use_poll=args.in_use_poll,
            claim_selector=args.claim_selector,
            preemption_scope=args.preemption_scope,
            claim_tolerations=args.claim_tolerations,
            dra=args.dra,
            label_free_gpus=args.label_free_gpus,
            label_interval=args.label_interval,
        ),
        metrics,
    )
    elector: leader.LeaderElector | None = None
    if args.leader_elect:
        elector = leader.LeaderElector(
            api,
            namespace=args.namespace,
            name=args.leader_election_id,
            identity=identity,
            lease_duration=args.leader_election_lease_duration,
            renew_deadline=args.leader_election_renew_deadline,
            retry_period=args.leader_election_retry_period,
            release_on_cancel=args.leader_election_release_on_cancel,
        )
    lost = elector.lost.is_set if elector is not None else (lambda: False)
    ready = running.make_ready_check(controller, lost)
    runners: list[web.BaseRunner] = []
    tasks: list[asyncio.Task[None]] = []
    code = 0
    try:
        runners.append(
            await serving.start_probes(
                args.bind_address, args.health_port, ready=ready, registry=metrics.registry
            )
        )
        if args.metrics_port and args.metrics_port != args.health_port:
            runners.append(
                await serving.start_probes(
                    args.bind_address, args.metrics_port, ready=ready, registry=metrics.registry
                )
            )
        tasks.append(asyncio.create_task(controller.run_caches(), name="caches"))
        stopping = asyncio.create_task(stop.wait(), name="stop")
        if elector is not None:
            election = asyncio.create_task(elector.run(), name="election")
            tasks.append(election)
            leading = asyncio.create_task(elector.leading.wait(), name="leading")
            await asyncio.wait([stopping, leading, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
            leading.cancel()
        if not stop.is_set() and not tasks[0].done():
            log.info("starting to reconcile", extra={"namespace": args.namespace, "workers": args.workers})
            tasks.append(asyncio.create_task(controller.run_active(), name="active"))
            watch: list[asyncio.Task[Any]] = [stopping, *tasks]
            await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
        if elector is not None and elector.lost.is_set():
            code = EXIT_LOST_LEADERSHIP
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.error("controller task failed", exc_info=task.exception())
                code = code or 1
        stopping.cancel()
    finally:
        for task in reversed(tasks):
            task.cancel()
        for task in reversed(tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for runner in runners:
            await runner.cleanup()
        await api.close()
    return code


async def _main(argv: Sequence[str]) -> int:
    return await run(argv, stop=signals.stop_event())


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    runtime_logging.setup("controller", fmt=args.log_format, level=args.log_level)
    return eventloop.run(_main(argv))
