"""Health probes and metrics over HTTP: ``/healthz``, ``/readyz``, ``/metrics``.

``/healthz`` answers 200 while the event loop runs (the process is alive);
``/readyz`` answers 200 only while ``ready()`` is true (e.g. the caches have
synced), else 503; ``/metrics`` is the Prometheus text format of a registry.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterable

import prometheus_client
from aiohttp import web

ReadyCheck = Callable[[], bool]

READY: web.AppKey[ReadyCheck] = web.AppKey("ready")
REGISTRY: web.AppKey[prometheus_client.CollectorRegistry] = web.AppKey(
    "registry", prometheus_client.CollectorRegistry
)

# Shorter than any pod's termination grace period (30 s by default).
SHUTDOWN_TIMEOUT = 5.0


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    try:
        ready = request.app[READY]()
    except Exception as exc:  # a failing check means not ready, not a 500
        return web.Response(status=503, text=f"not ready: {exc}\n")
    if ready:
        return web.Response(text="ok\n")
    return web.Response(status=503, text="not ready\n")


async def metrics(request: web.Request) -> web.Response:
    body = prometheus_client.generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})


def add_probes(
    app: web.Application, *, ready: ReadyCheck, registry: prometheus_client.CollectorRegistry | None = None
) -> None:
    """Add ``/healthz``, ``/livez``, ``/readyz`` and ``/metrics`` to ``app`` (the webhook's TLS app too).

    ``registry`` defaults to the process-wide default registry.
    """
    app[READY] = ready
    app[REGISTRY] = registry if registry is not None else prometheus_client.REGISTRY
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)


def make_probe_app(
    *, ready: ReadyCheck, registry: prometheus_client.CollectorRegistry | None = None
) -> web.Application:
    """The probe and metrics app; ``registry`` defaults to the process-wide default registry."""
    app = web.Application()
    add_probes(app, ready=ready, registry=registry)
    return app


async def start_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
) -> web.AppRunner:
    """Serve ``app`` on ``host:port`` (over TLS with ``ssl_context``); the caller does
    ``await runner.cleanup()``, which lets requests in flight finish for up to
    ``shutdown_timeout`` seconds, then closes the connections."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner


async def start_probes(
    host: str,
    port: int,
    *,
    ready: ReadyCheck,
    registry: prometheus_client.CollectorRegistry | None = None,
) -> web.AppRunner:
    """Serve ``/healthz``, ``/readyz`` and ``/metrics`` on ``host:port`` (port 0: any free port).

    The caller does ``await runner.cleanup()``; ``bound_port(runner)`` tells the port.
    """
    return await start_app(make_probe_app(ready=ready, registry=registry), host, port)


async def start_probe_servers(
    host: str,
    ports: Iterable[int],
    *,
    ready: ReadyCheck,
    registry: prometheus_client.CollectorRegistry | None = None,
) -> list[web.AppRunner]:
    """``start_probes`` once per distinct port, 0 meaning off; those started are cleaned up on a failure."""
    runners: list[web.AppRunner] = []
    try:
        for port in sorted({p for p in ports if p}):
            runners.append(await start_probes(host, port, ready=ready, registry=registry))
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        raise
    return runners


def bound_port(runner: web.AppRunner) -> int:
    """The port the runner's first site listens on (useful after asking for port 0)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise RuntimeError("the runner is not listening on a TCP port")
