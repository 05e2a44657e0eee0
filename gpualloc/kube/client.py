"""Connecting to the API server: a kubeconfig file, else the pod's service account."""

from __future__ import annotations

import logging
import os
import urllib.request
from urllib.parse import urlsplit

import aiohttp
from kubernetes_asyncio import config
from kubernetes_asyncio.client import ApiClient, Configuration

log = logging.getLogger(__name__)

# Connections kept to the API server. A process's watches each hold one for as long as they run,
# so a caller with W concurrent workers asks for W plus its watches (the controller does).
DEFAULT_CONNECTIONS = 16


async def connect(kubeconfig: str | None = None, *, connections: int = DEFAULT_CONNECTIONS) -> ApiClient:
    """An ``ApiClient`` for ``kubeconfig``, else ``$KUBECONFIG``, else the in-cluster service account.

    The configuration is loaded into a fresh ``Configuration``, never the
    library's global default, so two clients in one process do not share
    credentials. The caller closes the client (``await api.close()``).

    Connections are kept alive and pooled, at most ``connections`` at once.
    The environment is read once, here: ``HTTPS_PROXY``/``NO_PROXY`` decide the
    proxy for the API server's address. The library's own session would read
    ``~/.netrc`` and the proxy variables again in a thread on every request.
    """
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    cfg = Configuration()
    if path:
        await config.load_kube_config(config_file=path, client_configuration=cfg, persist_config=False)
        log.debug("loaded kubeconfig", extra={"kubeconfig": path, "server": cfg.host})
    else:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        log.debug("loaded in-cluster config", extra={"server": cfg.host})
    cfg.connection_pool_maxsize = connections
    if cfg.proxy is None:
        cfg.proxy = environment_proxy(cfg.host or "")
    api = ApiClient(configuration=cfg)
    library_session = api.rest_client.pool_manager
    api.rest_client.pool_manager = aiohttp.ClientSession(
        connector=library_session.connector,
        trust_env=False,
        read_bufsize=2**21,  # as the library's: a watch event can carry a large object
    )
    library_session.detach()  # the connector now belongs to our session
    return api


def environment_proxy(server: str) -> str | None:
    """The proxy the environment names for ``server`` (``HTTPS_PROXY``, unless ``NO_PROXY`` exempts it)."""
    parts = urlsplit(server)
    host = parts.hostname or ""
    if not host or urllib.request.proxy_bypass(host):  # NO_PROXY (on Linux, the environment only)
        return None
    return urllib.request.getproxies_environment().get(parts.scheme or "https")
