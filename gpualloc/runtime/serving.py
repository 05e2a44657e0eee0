"""Serving HTTP with aiohttp's low-level server, and the health probes and metrics.

One handler per server, no router: a component's handler looks at the path
itself (the webhook answers ``/mutate`` and hands the rest to the probes).
aiohttp's ``web.Server`` skips the ``Application``'s routing, match info and
middleware machinery, which costs the webhook about 6% of its CPU per admission
(BENCHMARKS.md, "Webhook under vegeta"). This is the one place that departs from
STYLE.md's aiohttp app factory, ``web.AppKey`` and ``cleanup_ctx``, on purpose:
components keep their state on their handler's object instead.

``requests_up_to`` builds aiohttp's ``BaseRequest`` itself, an API aiohttp does
not document; ``tests/unit/test_webhook_server.py`` posts a body of exactly the
limit and one byte more, so an aiohttp upgrade that changes it fails there.

The probes: ``/healthz`` and ``/livez`` answer 200 while the event loop runs
(the process is alive); ``/readyz`` answers 200 only while ``ready()`` is true
(e.g. the caches have synced), else 503; ``/metrics`` is the Prometheus text
format of a registry. Any other path is 404.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable, Iterable

import prometheus_client
from aiohttp import abc, web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

ReadyCheck = Callable[[], bool]
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
RequestFactory = Callable[
    [RawRequestMessage, StreamReader, RequestHandler, abc.AbstractStreamWriter, "asyncio.Task[None]"],
    web.BaseRequest,
]

# Shorter than any pod's termination grace period (30 s by default).
SHUTDOWN_TIMEOUT = 5.0
# aiohttp's own default: the largest request body ``request.read()`` accepts (413 past it).
DEFAULT_MAX_BODY = 1024**2


def probes(*, ready: ReadyCheck, registry: prometheus_client.CollectorRegistry | None = None) -> Handler:
    """The handler of ``/healthz``, ``/livez``, ``/readyz`` and ``/metrics``; 404 for other paths.

    ``registry`` defaults to the process-wide default registry.
    """
    scraped = registry if registry is not None else prometheus_client.REGISTRY

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path not in ("/healthz", "/livez", "/readyz", "/metrics"):
            return web.Response(status=404, text="not found\n")
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="method not allowed\n", headers={"Allow": "GET, HEAD"})
        if path == "/metrics":
            body = prometheus_client.generate_latest(scraped)
            return web.Response(body=body, headers={"Content-Type": prometheus_client.CONTENT_TYPE_LATEST})
        if path == "/readyz":
            try:
                is_ready = ready()
            except Exception as exc:  # a failing check means not ready, not a 500
                return web.Response(status=503, text=f"not ready: {exc}\n")
            if not is_ready:
                return web.Response(status=503, text="not ready\n")
        return web.Response(text="ok\n")

    return handle


def requests_up_to(max_body: int) -> RequestFactory:
    """aiohttp's request factory, with request bodies of up to ``max_body`` bytes."""

    def make(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: abc.AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> web.BaseRequest:
        loop = asyncio.get_running_loop()
        return web.BaseRequest(message, payload, protocol, writer, task, loop, client_max_size=max_body)

    return make


def server(handler: Handler, *, max_body: int = DEFAULT_MAX_BODY) -> web.Server:
    """aiohttp's low-level server for ``handler``, with no access log; ``request.read()`` raises
    413 past ``max_body`` bytes."""
    return web.Server(handler, request_factory=requests_up_to(max_body), access_log=None)


async def start(
    handler: Handler,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
    max_body: int = DEFAULT_MAX_BODY,
) -> web.BaseRunner:
    """Serve ``handler`` on ``host:port`` (over TLS with ``ssl_context``); the caller does
    ``await runner.cleanup()``, which lets requests in flight finish for up to
    ``shutdown_timeout`` seconds, then closes the connections."""
    runner = web.ServerRunner(server(handler, max_body=max_body), shutdown_timeout=shutdown_timeout)
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
) -> web.BaseRunner:
    """Serve ``/healthz``, ``/livez``, ``/readyz`` and ``/metrics`` on ``host:port`` (port 0: any free port).

    The caller does ``await runner.cleanup()``; ``bound_port(runner)`` tells the port.
    """
    return await start(probes(ready=ready, registry=registry), host, port)


async def start_probe_servers(
    host: str,
    ports: Iterable[int],
    *,
    ready: ReadyCheck,
    registry: prometheus_client.CollectorRegistry | None = None,
) -> list[web.BaseRunner]:
    """``start_probes`` once per distinct port, 0 meaning off; those started are cleaned up on a failure."""
    runners: list[web.BaseRunner] = []
    try:
        for port in sorted({p for p in ports if p}):
            runners.append(await start_probes(host, port, ready=ready, registry=registry))
    except BaseException:
        for runner in runners:
            await runner.cleanup()
        raise
    return runners


def bound_port(runner: web.BaseRunner) -> int:
    """The port the runner's first site listens on (useful after asking for port 0)."""
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise RuntimeError("the runner is not listening on a TCP port")
