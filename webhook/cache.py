"""Claims for the admission decision: a watch-fed cache of the Allocated ones, and one GET otherwise.

The cache is a ``gpualloc.kube.watching.Reflector`` over every GpuClaim in the
cluster that keeps (``kept_of_claim``) only the claims whose pods it mutates
without asking: the Allocated ones, of which there are at most as many as
GPUs in the cluster, whoever creates claims. Every other claim (Pending,
Failed, Released, Preempted: thousands a tenant may create) is held as
``NOT_KEPT``, its key alone, so the webhook's memory does not grow with claims
that no pod can run with yet. An admission reads the cache with a dict lookup
(parsed claims are memoized per raw object, so a claim is parsed once per
change, not once per pod). A claim the cache does not hold (not Allocated, not
synced yet, or created a moment ago and not yet seen on the watch) is read
with one GET, bounded by ``get_timeout`` so the answer still reaches the API
server inside the webhook's ``timeoutSeconds``: the decision is the same as
from the cache, made on a fresher copy. A GET that fails denies the pod (fail
closed) with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from gpualloc.api import codecs, constants, models
from gpualloc.kube import errors, resources, watching
from webhook import admission
from webhook import metrics as metrics_

log = logging.getLogger(__name__)

Fetch = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]

GET_TIMEOUT = 3.0  # seconds; the webhook's own timeoutSeconds is 5
PARSED_SLACK = 16  # memoized claims kept beyond twice the cache's size before dead ones are dropped

# What the cache holds for a claim it does not keep: one shared empty object (treat as read-only).
NOT_KEPT: dict[str, Any] = {}


def kept_of_claim(raw: dict[str, Any]) -> dict[str, Any]:
    """The Reflector transform: an Allocated claim's part that gpualloc reads
    (``codecs.kept_of_claim``); ``NOT_KEPT`` for any other claim (read with a GET when a pod
    names it)."""
    if (raw.get("status") or {}).get("phase") != constants.PHASE_ALLOCATED:
        return NOT_KEPT
    return codecs.kept_of_claim(raw)


class ClaimStore(Protocol):
    """What the cache reads from a Reflector: its objects by ``namespace/name``, and whether it synced."""

    @property
    def cache(self) -> Mapping[str, dict[str, Any]]: ...

    @property
    def synced(self) -> asyncio.Event: ...


def fetch_from(crs: resources.CustomResources) -> Fetch:
    """A Fetch that GETs the claim; None when it does not exist."""

    async def fetch(namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            return await crs.get_claim(namespace, name)
        except errors.NotFound:
            return None

    return fetch


class ClaimCache:
    """Parsed claims by ``(namespace, name)`` from a store, with a GET on a miss."""

    def __init__(
        self,
        store: ClaimStore,
        fetch: Fetch,
        *,
        metrics: metrics_.Metrics | None = None,
        get_timeout: float = GET_TIMEOUT,
    ) -> None:
        self.store = store
        self.fetch = fetch
        self.metrics = metrics
        self.get_timeout = get_timeout
        # key -> (the raw object it was parsed from, the model); identity tells a stale entry.
        self._parsed: dict[str, tuple[Mapping[str, Any], models.GpuClaim]] = {}

    def synced(self) -> bool:
        return self.store.synced.is_set()

    def contains(self, namespace: str, name: str) -> bool:
        """The cache can answer for the claim (it holds it, and keeps it)."""
        raw = self.store.cache.get(f"{namespace}/{name}")
        return raw is not None and raw is not NOT_KEPT

    def get(self, namespace: str, name: str, /) -> models.GpuClaim | None:
        """The cached claim (a ClaimLookup); raises codecs.DecodeError for a malformed one, and
        admission.ClaimUnavailable for one the cache does not keep (``lookup_for`` GETs those)."""
        key = f"{namespace}/{name}"
        raw = self.store.cache.get(key)
        if raw is None or raw is NOT_KEPT:
            self._parsed.pop(key, None)
            if raw is NOT_KEPT:
                raise admission.ClaimUnavailable(f"claim {key} is not cached; it must be read")
            return None
        memo = self._parsed.get(key)
        if memo is not None and memo[0] is raw:
            return memo[1]
        claim = codecs.parse_claim(raw)
        # Entries of deleted claims (each keeps its last raw object alive) are dropped once they
        # could outnumber the live ones: at most about as many dead as live, whatever the churn.
        if len(self._parsed) > 2 * len(self.store.cache) + PARSED_SLACK:
            self._parsed = {k: v for k, v in self._parsed.items() if k in self.store.cache}
        self._parsed[key] = (raw, claim)
        return claim

    async def lookup_for(self, ref: tuple[str, str] | None) -> admission.ClaimLookup:
        """A ClaimLookup that can answer for ``ref``: the cache, or the cache plus one GET's result."""
        if ref is None or self.contains(*ref):
            return self.get
        namespace, name = ref
        if self.metrics is not None:
            self.metrics.cache_misses.inc()
        try:
            async with asyncio.timeout(self.get_timeout):
                raw = await self.fetch(namespace, name)
        except (errors.KubeError, TimeoutError) as exc:
            if self.metrics is not None:
                self.metrics.lookup_errors.inc()
            reason = str(exc) or f"no answer from the API server in {self.get_timeout:g}s"
            log.warning("claim lookup failed", extra={"claim": f"{namespace}/{name}", "error": reason})
            return _failing(admission.ClaimUnavailable(reason))
        if raw is None:
            fetched: models.GpuClaim | None = None
        else:
            try:
                fetched = codecs.parse_claim(raw)
            except codecs.DecodeError as error:
                return _failing(error)

        def lookup(ns: str, n: str, /) -> models.GpuClaim | None:
            if (ns, n) == ref:
                return fetched
            return self.get(ns, n)

        return lookup


def _failing(exc: Exception) -> admission.ClaimLookup:
    def lookup(namespace: str, name: str, /) -> models.GpuClaim | None:
        raise exc

    return lookup


class StaticStore:
    """A ClaimStore over fixed raw claims, already synced: for the benchmark and tests, no API server."""

    def __init__(self, claims: list[dict[str, Any]] | None = None) -> None:
        self.cache: dict[str, dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.synced.set()
        for raw in claims or ():
            self.put(raw)

    def put(self, raw: dict[str, Any]) -> None:
        """Hold ``raw`` under the Reflector's key for it (``namespace/name``)."""
        self.cache[watching.object_key(raw)] = raw
