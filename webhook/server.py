"""HTTP for the webhook: its request handler, TLS, and reloading the certificate when its files change.

Paths, all on the one TLS port (the kubelet probes it with ``scheme: HTTPS``,
so a replica is ready only when it serves with its certificate), served by
``Webhook.handle`` on aiohttp's low-level server (``serving.start``):

* ``POST /mutate``: an ``admission.k8s.io/v1`` AdmissionReview. A body over
  3 MiB (the API server's own request limit) is refused with 413 before it is
  read; a body that cannot be read (a broken ``Content-Encoding``, a client
  gone before the whole body came), is not JSON, or has no ``request.uid`` to
  answer, gets 400; everything else gets 200 with an AdmissionReview echoing
  the uid, a denial included. An unexpected failure is answered with a
  denial, never a 500. Another method gets 405.
* ``GET /healthz`` and ``GET /livez``: 200 while the process serves.
* ``GET /readyz``: 200 once the claim cache has synced, 503 before and while
  shutting down.
* ``GET /metrics``: Prometheus text (also served over plain HTTP on
  ``--metrics-port`` by ``gpualloc.runtime.serving``, for scrapers without TLS).
* anything else: 404.

Certificate rotation: cert-manager and the kubelet replace a mounted Secret by
swapping the ``..data`` symlink to a new directory. ``CertificateReloader``
polls the resolved paths' identity (path, inode, mtime, size) every few
seconds; on a change it loads the new pair into a scratch context first (a
half-written pair is left for the next poll), then into the SAME SSLContext
the listening socket uses: new handshakes present the new certificate,
connections already open keep theirs, nothing restarts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from typing import Protocol

from aiohttp import web
from cryptography import x509

from gpualloc.runtime import serving
from webhook import admission
from webhook import metrics as metrics_

log = logging.getLogger(__name__)

MAX_BODY = 3 * 1024 * 1024  # the API server refuses larger requests itself
CERT_POLL_INTERVAL = 2.0
SHUTDOWN_TIMEOUT = 10.0


class ClaimSource(Protocol):
    """What the webhook needs from the claim cache (``cache.ClaimCache``)."""

    def synced(self) -> bool: ...

    async def lookup_for(self, ref: tuple[str, str] | None) -> admission.ClaimLookup: ...


class Webhook:
    """The webhook's request handler (``handle``) and serving state: set ``stopping`` to turn
    readiness off before shutting down."""

    def __init__(
        self,
        claims: ClaimSource,
        options: admission.Options | None = None,
        metrics: metrics_.Metrics | None = None,
    ) -> None:
        self.claims = claims
        self.options = options or admission.Options()
        self.metrics = metrics or metrics_.Metrics()
        self.stopping = False
        self._probes = serving.probes(ready=self.ready, registry=self.metrics.registry)

    def ready(self) -> bool:
        return not self.stopping and self.claims.synced()

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """``/mutate``, else the probes and metrics."""
        if request.path != "/mutate":
            return await self._probes(request)
        if request.method != "POST":
            return web.Response(status=405, text="method not allowed\n", headers={"Allow": "POST"})
        return await mutate(self, request)


# ------------------------------------------------------------------ /mutate


def _bad_request(webhook: Webhook, started: float, message: str) -> web.Response:
    webhook.metrics.admissions.record(admission.INVALID, time.perf_counter() - started)
    return web.Response(status=400, text=message + "\n")


async def mutate(webhook: Webhook, request: web.BaseRequest) -> web.Response:
    """Decode the review, decide, encode the answer."""
    started = time.perf_counter()
    try:
        body = await request.read()  # raises 413 past MAX_BODY
    except web.HTTPRequestEntityTooLarge:
        webhook.metrics.admissions.record(admission.INVALID, time.perf_counter() - started)
        raise
    except (web.RequestPayloadError, ConnectionResetError) as unreadable:
        # A Content-Encoding its bytes do not follow, or a client gone before its whole body came.
        return _bad_request(webhook, started, f"the body could not be read: {unreadable}")
    try:
        prepared = admission.decode(body)
    except (admission.NotJSON, admission.BadReview) as invalid:
        return _bad_request(webhook, started, str(invalid))
    if isinstance(prepared, admission.PodCreate):
        uid = prepared.uid
        try:
            lookup = await webhook.claims.lookup_for(prepared.claim_ref)  # the watch cache, or one GET
            decision = admission.decide(prepared, lookup, webhook.options)
        except Exception as failure:  # never a 500: the API server shows the denial to the user
            log.exception("admission failed", extra={"uid": uid})
            answer = admission.deny(
                uid,
                f"the gpualloc webhook failed: {type(failure).__name__}",
                code=500,
                reason="InternalError",
            )
            decision = admission.Decision(answer=answer, outcome=admission.ERROR)
    else:
        decision = prepared  # not a claim pod: answered by decode
    text = admission.encode(decision.answer)
    webhook.metrics.admissions.record(decision.outcome, time.perf_counter() - started)
    status = decision.answer.response.status
    if decision.outcome in (admission.DENIED, admission.INVALID) and status is not None:
        log.info(
            "denied",
            extra={
                "uid": decision.answer.response.uid,
                "outcome": decision.outcome,
                "reason": status.message,
            },
        )
    return web.Response(body=text, content_type="application/json")  # JSON is UTF-8 (RFC 8259: no charset)


async def start(
    webhook: Webhook,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
) -> web.BaseRunner:
    """Serve ``webhook`` on ``host:port``, request bodies up to MAX_BODY; ``stop`` ends it."""
    return await serving.start(
        webhook.handle,
        host,
        port,
        ssl_context=ssl_context,
        shutdown_timeout=shutdown_timeout,
        max_body=MAX_BODY,
    )


# ------------------------------------------------------------------ TLS


def make_ssl_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A server context, TLS 1.2 at least, with the pair loaded. Made once; reloads reuse it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


FileIdentity = tuple[str, int, int, int, int]


def file_identity(path: str) -> FileIdentity | None:
    """(resolved path, device, inode, mtime ns, size); None when the file cannot be read."""
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    return (real, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def not_after(cert_file: str) -> float | None:
    """The certificate's notAfter as a Unix time (None if unreadable)."""
    try:
        with open(cert_file, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
    except (OSError, ValueError):
        return None
    return cert.not_valid_after_utc.timestamp()


class CertificateReloader:
    """Polls the certificate and key files; loads a changed pair into ``context`` in place."""

    def __init__(
        self,
        context: ssl.SSLContext,
        cert_file: str,
        key_file: str,
        *,
        interval: float = CERT_POLL_INTERVAL,
        metrics: metrics_.Metrics | None = None,
    ) -> None:
        self.context = context
        self.cert_file = cert_file
        self.key_file = key_file
        self.interval = interval
        self.metrics = metrics
        self.reloads = 0
        self.failures = 0
        self._seen = self._identity()
        self._record_expiry()

    def _identity(self) -> tuple[FileIdentity | None, FileIdentity | None]:
        return (file_identity(self.cert_file), file_identity(self.key_file))

    def _record_expiry(self) -> None:
        expiry = not_after(self.cert_file)
        if self.metrics is not None and expiry is not None:
            self.metrics.cert_expiry.set(expiry)

    def check(self) -> bool:
        """Reload if the files changed since the last good load; True when a new pair went in."""
        now = self._identity()
        cert_id, key_id = now
        if now == self._seen or cert_id is None or key_id is None:
            return False
        cert_path, key_path = cert_id[0], key_id[0]
        try:
            # A scratch context first: loading a mismatched pair into the live one could leave it
            # with the new certificate and no key. Files half-written now are retried next poll.
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path)
            self.context.load_cert_chain(cert_path, key_path)
        except (OSError, ssl.SSLError) as exc:
            self.failures += 1
            if self.metrics is not None:
                self.metrics.cert_reloads.labels("failure").inc()
            log.warning("certificate reload failed; keeping the current one", extra={"error": str(exc)})
            return False
        if self._identity() != now:
            return False  # changed while loading: load again next poll
        self._seen = now
        self.reloads += 1
        if self.metrics is not None:
            self.metrics.cert_reloads.labels("success").inc()
        self._record_expiry()
        log.info("serving certificate reloaded", extra={"cert": cert_path})
        return True

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.check()


# ------------------------------------------------------------------ running


async def stop(webhook: Webhook, runner: web.BaseRunner, *, drain_delay: float = 0.0) -> None:
    """Graceful stop: readiness goes false, requests keep being served for ``drain_delay`` seconds
    (while endpoints drop this replica), then the runner shuts down."""
    webhook.stopping = True
    if drain_delay > 0:
        await asyncio.sleep(drain_delay)
    await runner.cleanup()
