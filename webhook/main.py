"""``gpualloc webhook``: the TLS mutating admission webhook for claim pods.

Serves ``/mutate``, ``/healthz``, ``/readyz`` and ``/metrics`` on the TLS port
(``--port``, default 8443); ``/metrics`` (with the probes) also on plain HTTP
at ``--metrics-port`` (0: off). Claims come from a watch of every GpuClaim that
keeps the Allocated ones (``cache``); any other claim a pod names is read with
one GET. The serving certificate is
reloaded when its files change. On SIGTERM readiness goes false, requests are
still served for ``--shutdown-delay`` seconds, then the server stops and lets
requests in flight finish within ``--shutdown-timeout`` seconds: keep the sum
under the pod's termination grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
from collections.abc import Sequence

from aiohttp import web

from gpualloc.kube import client, resources, watching
from gpualloc.runtime import eventloop, serving, signals
from gpualloc.runtime import logging as runtime_logging
from gpualloc.runtime import options as runtime_options
from webhook import admission, cache, server
from webhook import metrics as metrics_

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpualloc webhook", description=__doc__.split("\n")[0].replace("``", "")
    )
    parser.add_argument("--tls-cert-file", required=False, help="PEM serving certificate (chain)")
    parser.add_argument("--tls-key-file", required=False, help="PEM private key of the certificate")
    parser.add_argument("--port", type=int, default=8443, help="TLS port of /mutate and the probes")
    parser.add_argument(
        "--host",
        default=runtime_options.default_bind_address(),
        help="address to listen on (default: 0.0.0.0 in a pod, else 127.0.0.1)",
    )
    parser.add_argument(
        "--pending",
        choices=("deny", "gate"),
        default="deny",
        help="pods whose claim is not Allocated: deny them with the reason, or admit them behind a "
        "scheduling gate that the controller lifts",
    )
    parser.add_argument(
        "--device-ids",
        choices=("uuid", "index"),
        default="uuid",
        help="CUDA_VISIBLE_DEVICES as GPU UUIDs (default) or host indices (only where containers see "
        "every GPU of the node)",
    )
    parser.add_argument(
        "--allow-device-plugin",
        action="store_true",
        default=False,
        help="admit claim pods that also request nvidia.com/gpu from the device plugin",
    )
    parser.add_argument(
        "--dra",
        action="store_true",
        default=False,
        help="also give each claim pod its replica's ResourceClaim (spec.resourceClaims gpualloc-gpus,"
        " and resources.claims in every container), which the controller's --dra writes",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=server.SHUTDOWN_TIMEOUT,
        help="seconds requests in flight get to finish when stopping",
    )
    parser.add_argument(
        "--shutdown-delay",
        type=float,
        default=2.0,
        help="seconds to keep serving after readiness went false, before stopping",
    )
    parser.add_argument(
        "--cert-poll-interval",
        type=float,
        default=server.CERT_POLL_INTERVAL,
        help="seconds between checks of the certificate files for a rotation",
    )
    runtime_options.add_common(parser, metrics_port=0, health_port=0)
    runtime_options.env_defaults(parser)
    return parser


def main(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    if not args.tls_cert_file or not args.tls_key_file:
        parser.error("--tls-cert-file and --tls-key-file are required (a webhook is only called over TLS)")
    runtime_logging.setup("webhook", fmt=args.log_format, level=args.log_level)
    try:
        return eventloop.run(run(args))
    except KeyboardInterrupt:
        return 130


async def run(args: argparse.Namespace) -> int:
    stop = signals.stop_event()
    try:
        context = server.make_ssl_context(args.tls_cert_file, args.tls_key_file)
    except (OSError, ssl.SSLError) as exc:
        log.error("cannot load the serving certificate", extra={"error": str(exc)})
        return 1
    options = admission.Options(
        pending=args.pending,
        device_ids=args.device_ids,
        allow_device_plugin=args.allow_device_plugin,
        dra=args.dra,
    )
    api = await client.connect(args.kubeconfig)
    try:
        metrics = metrics_.Metrics()
        reflector = watching.Reflector(api, watching.CLAIMS, transform=cache.kept_of_claim)
        claims = cache.ClaimCache(
            reflector, cache.fetch_from(resources.CustomResources(api)), metrics=metrics
        )
        webhook = server.Webhook(claims, options, metrics)
        reloader = server.CertificateReloader(
            context, args.tls_cert_file, args.tls_key_file, interval=args.cert_poll_interval, metrics=metrics
        )
        runner = await server.start(
            webhook, args.host, args.port, ssl_context=context, shutdown_timeout=args.shutdown_timeout
        )
        extra = await serving.start_probe_servers(
            args.bind_address,
            (args.metrics_port, args.health_port),
            ready=webhook.ready,
            registry=metrics.registry,
        )
        try:
            log.info(
                "serving",
                extra={
                    "host": args.host,
                    "port": args.port,
                    "pending": args.pending,
                    "ids": args.device_ids,
                },
            )
            return await _until_stopped(stop, reflector, reloader, webhook, runner, args)
        finally:
            for probe_runner in extra:
                await probe_runner.cleanup()
    finally:
        await api.close()


async def _until_stopped(
    stop: asyncio.Event,
    reflector: watching.Reflector,
    reloader: server.CertificateReloader,
    webhook: server.Webhook,
    runner: web.BaseRunner,
    args: argparse.Namespace,
) -> int:
    """Run the background loops until a signal; a loop that dies stops the process (exit 1)."""
    tasks = [
        asyncio.create_task(reflector.run(), name="claims-reflector"),
        asyncio.create_task(reloader.run(), name="certificate-reloader"),
    ]
    stopper = asyncio.create_task(stop.wait(), name="stop")
    code = 0
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not stopper:
                exc = task.exception()
                log.error(
                    "background loop ended; stopping", extra={"task": task.get_name(), "error": repr(exc)}
                )
                code = 1
        log.info("shutting down", extra={"delay": args.shutdown_delay, "timeout": args.shutdown_timeout})
        await server.stop(webhook, runner, drain_delay=args.shutdown_delay if code == 0 else 0.0)
    finally:
        for task in [*tasks, stopper]:
            task.cancel()
        await asyncio.gather(*tasks, stopper, return_exceptions=True)
    return code
