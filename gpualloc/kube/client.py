"""Connecting to the API server: a kubeconfig file, else the pod's service account."""

from __future__ import annotations

import logging
import os

from kubernetes_asyncio import config
from kubernetes_asyncio.client import ApiClient, Configuration

log = logging.getLogger(__name__)


async def connect(kubeconfig: str | None = None) -> ApiClient:
    """An ``ApiClient`` for ``kubeconfig``, else ``$KUBECONFIG``, else the in-cluster service account.

    The configuration is loaded into a fresh ``Configuration``, never the
    library's global default, so two clients in one process do not share
    credentials. The caller closes the client (``await api.close()``).
    """
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    cfg = Configuration()
    if path:
        await config.load_kube_config(config_file=path, client_configuration=cfg, persist_config=False)
        log.debug("loaded kubeconfig", extra={"kubeconfig": path, "server": cfg.host})
    else:
        config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        log.debug("loaded in-cluster config", extra={"server": cfg.host})
    return ApiClient(configuration=cfg)
