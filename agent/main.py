"""``gpualloc agent``: scan the GPUs, watch their health, publish GpuNodeStatus.

Tasks of a running agent (``Agent.run``), all in one event loop:

* scanning: every ``--scan-interval`` (and at once when asked) read the source
  in a worker thread, keep devices that vanished as lost, take samples for
  /metrics, wake the publisher. When the source cannot be read (NVML not
  initialised) it publishes ``NvmlReady=False`` with the error and retries with
  backoff; with ``--fail-on-init-error`` the first such failure ends the agent
  with exit code 1 instead.
* health: NVML's event set in a thread (``health.EventThread``), or the XID
  injection file of the simulated source; both feed one ``HealthTracker``.
* publishing: ``publishing.Publisher.run`` (write the status on change, renew the
  heartbeat Lease in ``--heartbeat-namespace``).
* leases: a Reflector on the device Leases labelled with this node, for
  ``status.allocated`` and the lease gauges.
* the usage audit (``audit``; ``--process-audit``): a Reflector on this node's
  pods (a few fields each); after every scan, the processes NVML sees on each
  GPU are checked against the claims holding it, the unexpected ones published
  in ``status.unexpectedProcesses``, counted in
  ``gpualloc_gpu_unexpected_processes`` and, when new, told in a Warning Event
  on the Node.
* idle times (``idleness``): after every scan the same processes give each
  GPU's ``idleSince`` (since when it has had none; absent while one runs),
  which moves only when a GPU goes from busy to idle or back. At start the
  previous GpuNodeStatus's values are carried over for GPUs still idle.
* probes and metrics (``gpualloc.runtime.serving``).
* the DRA kubelet plugin (``--kubelet-plugin``; ``kubelet_plugin``): the kubelet's
  plugin-registration and DRA gRPC services on unix sockets under ``--kubelet-root``, answering
  NodePrepareResources with the CDI device IDs of a ResourceClaim's GPUs on this node; after every
  scan it is given the GPUs (and, in ``--cdi-mode gpualloc``, writes their CDI spec in ``--cdi-dir``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from agent import audit, dra, health, idleness, inventory, kubelet_plugin, publishing, simulated
from agent import metrics as agent_metrics
from gpualloc.api import constants, models, timestamps
from gpualloc.api import leases as lease_format
from gpualloc.kube import client, errors, events, resources, transport, watching
from gpualloc.runtime import backoff, eventloop, options, serving, signals
from gpualloc.runtime import logging as runtime_logging

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_INIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TASK_FAILED = 3

MAX_RETRY_SECONDS = 60.0
REASON_UNEXPECTED_PROCESS = "UnexpectedGpuProcess"  # the Warning Event of the usage audit


def _xids(text: str) -> frozenset[int]:
    try:
        return health.parse_xids(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated XID numbers: {exc}") from exc


def _sharing(text: str) -> models.DeviceSharing | None:
    try:
        return inventory.parse_sharing(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpualloc agent",
        description="Read this node's GPUs (NVML or a simulated profile) and publish its GpuNodeStatus.",
    )
    parser.add_argument("--node-name", default=None, help="the node this agent runs on (default $NODE_NAME)")
    parser.add_argument(
        "--source", choices=("nvml", "simulated"), default="nvml", help="where devices come from"
    )
    parser.add_argument(
        "--profile",
        default="h100-sxm-8",
        help=f"simulated profile: a shipped name ({', '.join(simulated.profile_names())}) or a YAML path",
    )
    parser.add_argument(
        "--heartbeat-interval", type=_positive, default=30.0, help="seconds between heartbeats"
    )
    parser.add_argument(
        "--scan-interval", type=_positive, default=10.0, help="seconds between device scans and samples"
    )
    parser.add_argument(
        "--fail-on-init-error",
        action="store_true",
        help="exit non-zero when NVML cannot be initialised, instead of publishing NvmlReady=False",
    )
    parser.add_argument(
        "--ignored-xids",
        type=_xids,
        default=health.DEFAULT_IGNORED_XIDS,
        help="application XIDs that do not make a GPU Unhealthy (default 13,31,43,45,68,109)",
    )
    parser.add_argument(
        "--recovery-seconds",
        type=float,
        default=600.0,
        help="a GPU published Unhealthy before this agent started stays Unhealthy this long (default 600)",
    )
    parser.add_argument(
        "--xid-inject-file",
        default=None,
        help="simulated source: a file of '<index> <xid|ecc|lost>' and '<index> process <pid> [<pod>]' lines",
    )
    parser.add_argument(
        "--node-labels",
        action="store_true",
        help="label the Node with gpu.scheduling/gpu.count, gpu.product, gpu.memory",
    )
    parser.add_argument(
        "--sharing",
        type=_sharing,
        default=None,
        help="offer each GPU not in MIG mode to Shared claims: TimeSlicing:N or MPS:N (N slots)",
    )
    parser.add_argument(
        "--process-audit",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report processes on GPUs that no claim holding them accounts for (needs the Leases and pods)",
    )
    parser.add_argument(
        "--lease-namespace",
        default=None,
        help="namespace of the device Leases (default $POD_NAMESPACE; empty: do not track Leases)",
    )
    parser.add_argument(
        "--heartbeat-namespace",
        default=None,
        help="namespace of the node heartbeat Leases (default <lease namespace>-heartbeats; empty, or no"
        " lease namespace: the GpuNodeStatus carries every heartbeat)",
    )
    parser.add_argument(
        "--kubelet-plugin",
        action="store_true",
        help="serve as the kubelet's DRA plugin of driver gpu.gpualloc.dev (registration, DRA sockets)",
    )
    parser.add_argument(
        "--kubelet-root",
        default="/var/lib/kubelet",
        help="the kubelet's root directory: its plugins_registry/ and plugins/ hold the plugin's sockets",
    )
    parser.add_argument(
        "--cdi-mode",
        choices=dra.MODES,
        default="gpualloc",
        help="gpualloc: write this node's CDI spec (kind gpualloc.dev/gpu) and answer its names;"
        " nvidia: answer nvidia.com/gpu=<UUID>, the names of NVIDIA's own spec (nvidia-ctk cdi generate)",
    )
    parser.add_argument(
        "--cdi-dir", default="/var/run/cdi", help="where the CDI spec is written (--cdi-mode gpualloc)"
    )
    parser.add_argument(
        "--device-dir",
        default="/dev",
        help="where this node's GPU device files are (/dev; the local real node's made-up files elsewhere)",
    )
    options.add_common(parser, metrics_port=8080, health_port=8081)
    options.env_defaults(parser, fallbacks={**options.DOWNWARD_API, "lease_namespace": "POD_NAMESPACE"})
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if not args.node_name:
        parser.error("--node-name is required (or set NODE_NAME)")
    problem = kubelet_plugin.socket_problem(args.kubelet_root) if args.kubelet_plugin else ""
    if problem:
        parser.error(f"--kubelet-root {args.kubelet_root}: {problem}")
    return args


def make_source(args: argparse.Namespace) -> inventory.Source:
    if args.source == "simulated":
        return simulated.SimulatedSource(simulated.load_profile(args.profile), args.node_name)
    from agent import nvml  # only here: the simulated agent never loads pynvml

    return nvml.NvmlSource()


def _node_path(name: str) -> str:
    return transport.collection_path("", "v1", "nodes", name=name)


class Agent:
    """One node's agent. ``run(stop)`` returns the exit code."""

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        source: inventory.Source | None = None,
        api: Any | None = None,
        wall_clock: Callable[[], dt.datetime] = publishing.utc_now,
    ) -> None:
        self.args = args
        self.node_name: str = args.node_name
        self.source = source if source is not None else make_source(args)
        self._api = api
        self._own_api = api is None
        self.tracker = health.HealthTracker(args.ignored_xids)
        self.idle = idleness.IdleTracker()  # each GPU's idleSince, from the samples' processes
        self._wall = wall_clock
        self.metrics = agent_metrics.AgentMetrics(self.node_name)
        self.facts: inventory.NodeFacts | None = None
        self.sharing: models.DeviceSharing | None = args.sharing  # the Node's label may override it
        self.source_error = ""
        self.scans = 0
        self.wake = asyncio.Event()  # publisher: something changed
        self.rescan = asyncio.Event()  # scanner: look again now
        self.publisher: publishing.Publisher | None = None
        self.leases: watching.Reflector | None = None
        self.pods: watching.Reflector | None = None  # this node's pods, for the usage audit
        self._reported: set[tuple[str, int]] = set()  # (GPU UUID, pid) told in an Event already
        self.injections: simulated.InjectionWatcher | None = None
        self._event_thread: health.EventThread | None = None
        self._event_generation = -1
        self._labels_applied: dict[str, str] | None = None
        self.plugin: kubelet_plugin.KubeletPlugin | None = None  # --kubelet-plugin

    # -- what to publish ------------------------------------------------------

    def desired(self) -> models.NodeInventory:
        facts = self.facts or inventory.NodeFacts(source=self.source.name)
        uuids = [d.uuid for d in facts.devices]
        inv = inventory.derive(
            facts,
            unhealthy=self.tracker.marks(uuids),
            held=self.metrics.leases,
            sharing=self.sharing,
            idle=self.idle.published(),
        )
        conds = publishing.conditions(
            source=self.source.name, source_error=self.source_error, devices=inv.devices
        )
        strays = tuple(self.metrics.unexpected[: audit.MAX_REPORTED])
        inv = dataclasses.replace(inv, conditions=conds, unexpected_processes=strays)
        self.metrics.inventory = inv
        if self.plugin is not None:
            self.plugin.set_health(dra.health(inv.devices))
        return inv

    def on_health_event(self, event: health.HealthEvent) -> None:
        if self.tracker.apply(event):
            self.wake.set()

    def _on_lease(self, kind: str, obj: dict[str, Any]) -> None:
        self._recount_leases()

    def _recount_leases(self) -> None:
        if self.leases is None:
            return
        offered = inventory.derive(self.facts, sharing=self.sharing).devices if self.facts else ()
        by_lease = {constants.lease_name(lock_id): lock_id for d in offered for lock_id in d.lock_ids}
        holders: dict[str, agent_metrics.LeaseHolder] = {}
        shares: dict[str, tuple[agent_metrics.LeaseHolder, ...]] = {}
        for lease in map(lease_format.parse, self.leases.cache.values()):
            uuid = by_lease.get(lease.name)
            held = tuple(
                agent_metrics.LeaseHolder(
                    claim_namespace=h.claim_namespace, claim_name=h.claim_name, claim_uid=h.holder
                )
                for h in lease_format.holdings(lease)  # a share ledger's entries, or the Lease
            )
            if uuid is not None and held:
                holders[uuid] = held[0]
                if lease.ledger:
                    shares[uuid] = held
        if holders != self.metrics.leases or shares != self.metrics.shares:
            self.metrics.leases, self.metrics.shares = holders, shares
            self.wake.set()

    # -- scanning -------------------------------------------------------------

    async def scan_once(self) -> bool:
        """One scan; False when the source could not be read."""
        started = time.perf_counter()
        try:
            facts = await asyncio.to_thread(self.source.scan)
        except Exception as exc:  # a bad NVML state must never end the agent
            why = str(exc) if isinstance(exc, inventory.SourceUnavailable) else f"scan failed: {exc!r}"
            self.metrics.source_ready = False
            if why != self.source_error:
                log.error(
                    "device source unavailable",
                    extra={"node": self.node_name, "error": why},
                    exc_info=not isinstance(exc, inventory.SourceUnavailable),
                )
            self.source_error = why or "source unavailable"
            self.wake.set()
            return False
        finally:
            self.metrics.scan_duration.observe(time.perf_counter() - started)
        self.scans += 1
        self.facts = health.carry_lost(self.facts, facts)
        if self.source_error:
            log.info("device source available again", extra={"node": self.node_name})
        self.source_error = ""
        self.metrics.source_ready = True
        if self.plugin is not None:
            self.plugin.update(dra.gpus(self.facts))
        self._recount_leases()
        try:
            self.metrics.samples = await asyncio.to_thread(self.source.samples)
            self.idle.observe(self.metrics.samples, self._wall())
        except Exception:
            log.warning("sampling failed", exc_info=True)
        await self.audit_processes()
        await self._ensure_event_thread()
        self.wake.set()
        return True

    async def audit_processes(self) -> None:
        """The usage audit of the last samples (module docstring); a Warning Event on the Node for
        each unexpected process not told before."""
        if self.leases is None or not self.leases.synced.is_set() or not self.args.process_audit:
            return  # until the Leases are listed nothing is known to be held: no false alarm at start
        pods = None  # not listed yet: only processes on GPUs no claim holds can be judged
        if self.pods is not None and self.pods.synced.is_set():
            pods = audit.pods_by_uid(self.pods.cache.values())
        devices = self.desired().devices
        found = audit.unexpected(
            devices, self.metrics.samples, self.metrics.leases, pods, self.metrics.shares
        )
        self.metrics.unexpected = found
        current = {(p.uuid, p.pid) for p in found}
        for stray in found:
            if (stray.uuid, stray.pid) in self._reported or self._api is None:
                continue
            message = audit.describe(stray)
            log.warning("unexpected process on a GPU", extra={"node": self.node_name, "detail": message})
            node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.node_name}}
            await events.emit(
                self._api,
                obj=node,
                reason=REASON_UNEXPECTED_PROCESS,
                message=message,
                type_="Warning",
                component="gpualloc-agent",
            )
        self._reported = current

    async def _ensure_event_thread(self) -> None:
        open_events = getattr(self.source, "open_events", None)
        generation = int(getattr(self.source, "generation", 0))
        if open_events is None or generation == self._event_generation:
            return
        await self._stop_event_thread()
        try:
            waiter = await asyncio.to_thread(open_events)
        except Exception as exc:
            log.warning("cannot watch health events", extra={"error": str(exc)})
            return
        self._event_thread = health.EventThread(waiter, asyncio.get_running_loop(), self.on_health_event)
        self._event_thread.start()
        self._event_generation = generation

    async def _stop_event_thread(self) -> None:
        thread, self._event_thread = self._event_thread, None
        if thread is not None:
            thread.stop()
            await asyncio.to_thread(thread.join, 5.0)

    async def scan_loop(self) -> None:
        failures = 0
        while True:
            ok = await self.scan_once()
            failures = 0 if ok else failures + 1
            delay = (
                self.args.scan_interval
                if ok
                else backoff.exponential(failures, base=1.0, cap=MAX_RETRY_SECONDS)
            )
            await self._label_node()
            self.rescan.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.rescan.wait(), delay)

    # -- Kubernetes -----------------------------------------------------------

    def heartbeat_namespace(self) -> str:
        """Where this agent renews its heartbeat Lease ("": it heartbeats in the GpuNodeStatus)."""
        return lease_format.heartbeat_namespace(
            self.args.lease_namespace or "", self.args.heartbeat_namespace
        )

    async def lookup_node(self, name: str) -> dict[str, Any] | None:
        """The Node; NotFound is raised, and the Publisher takes it for no Node."""
        assert self._api is not None
        node = await transport.request(self._api, "GET", _node_path(name))
        return node if isinstance(node, dict) else None

    async def read_sharing_label(self) -> None:
        """The Node's ``gpu.scheduling/sharing`` label, read once at start, overrides ``--sharing`` on
        this node (``inventory.parse_sharing_label``). A label that cannot be read or parsed leaves
        ``--sharing`` in force, and says so."""
        try:
            node = await self.lookup_node(self.node_name)
        except errors.KubeError as exc:
            log.warning(
                "cannot read the Node's sharing label", extra={"node": self.node_name, "error": str(exc)}
            )
            return
        value = ((node or {}).get("metadata") or {}).get("labels", {}).get(constants.LABEL_SHARING)
        if value is None:
            return
        try:
            self.sharing = inventory.parse_sharing_label(str(value))
        except ValueError as exc:
            log.error(
                "the Node's sharing label is wrong; --sharing applies",
                extra={"node": self.node_name, "label": constants.LABEL_SHARING, "error": str(exc)},
            )
            return
        log.info(
            "sharing set by the Node's label",
            extra={"node": self.node_name, "label": constants.LABEL_SHARING, "value": value},
        )

    async def _label_node(self) -> None:
        if not self.args.node_labels or self._api is None or self.facts is None:
            return
        labels = publishing.node_labels(self.desired())
        if labels == self._labels_applied:
            return
        try:
            await transport.request(
                self._api,
                "PATCH",
                _node_path(self.node_name),
                body={"metadata": {"labels": labels}},
                content_type=transport.MERGE_PATCH,
            )
            self._labels_applied = labels
            log.info("node labelled", extra={"node": self.node_name, "labels": labels})
        except errors.KubeError as exc:
            log.warning("cannot label the Node", extra={"node": self.node_name, "error": str(exc)})

    async def carry_previous(self) -> None:
        """What this node's GpuNodeStatus said before this agent started, carried over: its
        Unhealthy GPUs (``carry_health``) and its idle times (``IdleTracker.carry``)."""
        assert self._api is not None
        try:
            obj = await resources.CustomResources(self._api).get_node_status(self.node_name)
        except errors.NotFound:
            return
        except errors.KubeError as exc:
            log.warning(
                "cannot read the previous GpuNodeStatus", extra={"node": self.node_name, "error": str(exc)}
            )
            return
        before = publishing.read_status(obj.get("status"))
        devices = before.devices if before else ()
        idle = {d.uuid: t for d in devices if (t := timestamps.parse_time(d.idle_since)) is not None}
        if self.idle.carry(idle):
            self.wake.set()
        self.carry_health(devices)

    def carry_health(self, devices: Sequence[models.Device]) -> None:
        """GPUs the previous GpuNodeStatus showed Unhealthy stay Unhealthy for
        ``--recovery-seconds`` (``HealthTracker.carry``): a restart after an XID does not hand the
        GPU out at once."""
        previous = {
            d.uuid: d.health_reason or constants.UNHEALTHY for d in devices if d.health != constants.HEALTHY
        }
        if not previous:
            return
        hold = self.args.recovery_seconds
        self.tracker.carry(previous, hold=hold)
        asyncio.get_running_loop().call_later(hold + 0.1, self.wake.set)  # published Healthy then
        log.warning(
            "GPUs Unhealthy before this agent started stay so for a while",
            extra={"node": self.node_name, "devices": ",".join(sorted(previous)), "seconds": hold},
        )

    async def start_kubelet_plugin(self) -> None:
        """Serve the kubelet's registration and DRA sockets, with the GPUs of the first scan."""
        assert self._api is not None
        plugin = kubelet_plugin.KubeletPlugin(
            node=self.node_name,
            kubelet_root=self.args.kubelet_root,
            read_claim=kubelet_plugin.claim_reader(self._api),
            loop=asyncio.get_running_loop(),
            mode=self.args.cdi_mode,
            cdi_dir=self.args.cdi_dir,
            device_dir=self.args.device_dir,
        )
        if self.facts is not None:
            plugin.update(dra.gpus(self.facts))
        plugin.set_health(dra.health(self.desired().devices))
        await asyncio.to_thread(plugin.start)
        self.plugin = plugin

    def ready(self) -> bool:
        return self.publisher is not None and self.publisher.ready()

    # -- the whole agent ------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        tasks: list[asyncio.Task[Any]] = []
        runners: list[Any] = []
        try:
            # First scan before anything else: --fail-on-init-error decides here.
            if not await self.scan_once() and self.args.fail_on_init_error:
                log.error(
                    "device source failed to initialise; exiting (--fail-on-init-error)",
                    extra={"node": self.node_name, "error": self.source_error},
                )
                return EXIT_INIT_FAILED
            if self._api is None:
                self._api = await client.connect(self.args.kubeconfig)
            await self.read_sharing_label()
            await self.carry_previous()
            if self.args.kubelet_plugin:
                await self.start_kubelet_plugin()
            beats = self.heartbeat_namespace()
            self.publisher = publishing.Publisher(
                resources.CustomResources(self._api),
                self.node_name,
                heartbeat_interval=self.args.heartbeat_interval,
                node_lookup=self.lookup_node,
                renew_heartbeat=(
                    publishing.heartbeat_renewer(self._api, beats, self.node_name, self.lookup_node)
                    if beats
                    else None
                ),
                metrics=self.metrics,
            )
            runners.extend(
                await serving.start_probe_servers(
                    self.args.bind_address,
                    (self.args.health_port, self.args.metrics_port),
                    ready=self.ready,
                    registry=self.metrics.registry,
                )
            )
            tasks.append(asyncio.create_task(self.publisher.run(self.desired, self.wake), name="publish"))
            tasks.append(asyncio.create_task(self.scan_loop(), name="scan"))
            if self.args.lease_namespace:
                self.leases = watching.Reflector(
                    self._api,
                    watching.LEASES,
                    namespace=self.args.lease_namespace,
                    label_selector=f"{constants.LABEL_NODE}={self.node_name}",
                    on_event=self._on_lease,
                )
                tasks.append(asyncio.create_task(self.leases.run(), name="leases"))
                if self.args.process_audit:
                    self.pods = watching.Reflector(
                        self._api,
                        watching.PODS,
                        field_selector=f"spec.nodeName={self.node_name}",
                        transform=audit.pod_ref,
                    )
                    tasks.append(asyncio.create_task(self.pods.run(), name="pods"))
            else:
                log.info(
                    "no --lease-namespace: device Leases are not tracked", extra={"node": self.node_name}
                )
            if self.args.xid_inject_file:
                if isinstance(self.source, simulated.SimulatedSource):
                    self.injections = simulated.InjectionWatcher(
                        self.args.xid_inject_file,
                        self.source,
                        on_event=self.on_health_event,
                        on_rescan=self.rescan.set,
                    )
                    tasks.append(asyncio.create_task(self.injections.run(), name="xid-inject"))
                else:
                    log.warning("--xid-inject-file only applies to --source simulated")
            log.info(
                "agent running",
                extra={
                    "node": self.node_name,
                    "source": self.source.name,
                    "devices": len(self.desired().devices),
                },
            )
            stopper = asyncio.create_task(stop.wait(), name="stop")
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            failed = [t for t in done if t is not stopper and (t.cancelled() or t.exception() is not None)]
            for task in failed:
                exc = None if task.cancelled() else task.exception()
                log.error("agent task ended unexpectedly", extra={"task": task.get_name()}, exc_info=exc)
            return EXIT_TASK_FAILED if failed else EXIT_OK
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._stop_event_thread()
            if self.plugin is not None:
                await asyncio.to_thread(self.plugin.stop)
            for runner in runners:
                await runner.cleanup()
            await asyncio.to_thread(self.source.close)
            if self._own_api and self._api is not None:
                await self._api.close()


async def _amain(args: argparse.Namespace) -> int:
    stop = signals.stop_event()
    return await Agent(args).run(stop)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    runtime_logging.setup("agent", fmt=args.log_format, level=args.log_level)
    try:
        return eventloop.run(_amain(args))
    except simulated.ProfileError as exc:
        log.error("bad simulated profile", extra={"error": str(exc)})
        print(f"gpualloc agent: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
