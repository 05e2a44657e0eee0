"""Connecting to the API server: a kubeconfig file, else the pod's service account.

gpualloc speaks raw JSON to the API server (``transport``) over one pooled,
kept-alive aiohttp session: ``Api``. It needs no generated client, so its
processes do not load one (kubernetes_asyncio's models alone cost an agent
38 MiB of its memory).

Where the address and credentials come from (``connect``):

* a kubeconfig (``--kubeconfig``, else ``$KUBECONFIG``, every file of it,
  the first to name an entry wins): the current context's cluster (``server``,
  ``certificate-authority`` or ``-data``, ``insecure-skip-tls-verify``) and
  user (``client-certificate``/``client-key`` or their ``-data``, ``token``,
  ``tokenFile``). A user that logs in through an ``exec`` or ``auth-provider``
  plugin (EKS, GKE, AKS) is loaded by kubernetes_asyncio's loader, imported
  only then: ``gpualloc get`` works with such a kubeconfig.
* else in the cluster: ``KUBERNETES_SERVICE_HOST``/``_PORT``, the service
  account's CA and token. The token is read again once a minute: the kubelet
  rotates bound tokens.

The environment is read once, at ``connect``: ``HTTPS_PROXY``/``NO_PROXY``
decide the proxy for the API server's address; the session itself never looks
at the environment or ``~/.netrc`` (``trust_env=False``).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import yaml

log = logging.getLogger(__name__)

# Connections kept to the API server. A process's watches each hold one for as long as they run,
# so a caller with W concurrent workers asks for W plus its watches (the controller does).
DEFAULT_CONNECTIONS = 16
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_S = 60.0
USER_AGENT = "gpualloc"


class ConfigError(Exception):
    """No usable kubeconfig or in-cluster configuration."""


class Api:
    """The API server's address and credentials, and the one session every request goes through."""

    def __init__(
        self,
        host: str,
        *,
        ssl_context: ssl.SSLContext | bool,
        token: Callable[[], str] | None = None,
        connections: int = DEFAULT_CONNECTIONS,
        proxy: str | None = None,
        user_agent: str = USER_AGENT,
    ) -> None:
        self.host = host.rstrip("/")
        self.proxy = proxy
        self.user_agent = user_agent  # the API server's audit log tells clients apart by it
        self._token = token
        connector = aiohttp.TCPConnector(limit=connections, ssl=ssl_context)
        # read_bufsize: a watch event can carry a large object.
        self.session = aiohttp.ClientSession(connector=connector, trust_env=False, read_bufsize=2**21)

    async def send(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "application/json",
        client_timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        """Start a request; the unread response (the caller reads and releases it)."""
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        token = self._token() if self._token is not None else ""
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return await self.session.request(
            method,
            self.host + path,
            params=list(query),
            data=data,
            headers=headers,
            timeout=client_timeout,
            proxy=self.proxy,
        )

    async def close(self) -> None:
        await self.session.close()


async def connect(
    kubeconfig: str | None = None, *, connections: int = DEFAULT_CONNECTIONS, user_agent: str = USER_AGENT
) -> Api:
    """An ``Api`` for ``kubeconfig``, else ``$KUBECONFIG``, else the in-cluster service account
    (module docstring). The caller closes it (``await api.close()``)."""
    path = kubeconfig or os.environ.get("KUBECONFIG") or None
    if path:
        host, ssl_context, token = await _from_kubeconfig(path)
        log.debug("loaded kubeconfig", extra={"kubeconfig": path, "server": host})
    else:
        host, ssl_context, token = _in_cluster()
        log.debug("loaded in-cluster config", extra={"server": host})
    return Api(
        host,
        ssl_context=ssl_context,
        token=token,
        connections=connections,
        proxy=environment_proxy(host),
        user_agent=user_agent,
    )


def environment_proxy(server: str) -> str | None:
    """The proxy the environment names for ``server`` (``HTTPS_PROXY``, unless ``NO_PROXY`` exempts it)."""
    parts = urlsplit(server)
    host = parts.hostname or ""
    if not host or urllib.request.proxy_bypass(host):  # NO_PROXY (on Linux, the environment only)
        return None
    return urllib.request.getproxies_environment().get(parts.scheme or "https")


# ------------------------------------------------------------------ in the cluster


def _in_cluster(root: Path = SERVICE_ACCOUNT) -> tuple[str, ssl.SSLContext, Callable[[], str]]:
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ConfigError(
            "no kubeconfig (--kubeconfig, $KUBECONFIG) and not in a pod (KUBERNETES_SERVICE_HOST is not set)"
        )
    if ":" in host:  # IPv6
        host = f"[{host}]"
    return f"https://{host}:{port}", _tls(ca_file=str(root / "ca.crt")), file_token(root / "token")


def file_token(path: Path, every: float = TOKEN_REREAD_S) -> Callable[[], str]:
    """A token read from ``path``, and read again once ``every`` seconds have passed."""
    token, read_at = "", float("-inf")

    def current() -> str:
        nonlocal token, read_at
        now = time.monotonic()
        if now - read_at >= every:
            token, read_at = path.read_text().strip(), now
        return token

    return current


def _tls(
    *,
    ca_file: str | None = None,
    ca_data: str | None = None,
    cert: tuple[str, str] | None = None,
    verify: bool = True,
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file, cadata=ca_data)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert is not None:
        context.load_cert_chain(*cert)
    return context


# ------------------------------------------------------------------ kubeconfig


def load_kubeconfig(path: str) -> dict[str, Any]:
    """The kubeconfig ``path`` names (``os.pathsep``-separated files, merged as kubectl merges
    them: the first file to name a cluster, user or context wins)."""
    merged: dict[str, Any] = {"clusters": {}, "users": {}, "contexts": {}, "current-context": ""}
    for part in [p for p in path.split(os.pathsep) if p]:
        try:
            doc = yaml.safe_load(Path(part).read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"cannot read kubeconfig {part}: {exc}") from exc
        base = Path(part).resolve().parent
        for kind in ("clusters", "users", "contexts"):
            for entry in doc.get(kind) or []:
                body = dict(entry.get(kind[:-1]) or {})
                body["_dir"] = str(base)  # relative file paths are relative to their kubeconfig
                merged[kind].setdefault(entry.get("name", ""), body)
        merged["current-context"] = merged["current-context"] or doc.get("current-context", "")
    return merged


async def _from_kubeconfig(path: str) -> tuple[str, ssl.SSLContext | bool, Callable[[], str] | None]:
    config = load_kubeconfig(path)
    name = config["current-context"]
    context = config["contexts"].get(name)
    if context is None:
        raise ConfigError(f"kubeconfig {path}: current context {name!r} is not defined")
    cluster = config["clusters"].get(context.get("cluster", ""))
    user = config["users"].get(context.get("user", ""), {})
    if cluster is None or not cluster.get("server"):
        raise ConfigError(f"kubeconfig {path}: context {name!r} names no cluster with a server")
    if "exec" in user or "auth-provider" in user:
        return await _from_plugin(path, name)
    host = str(cluster["server"])
    if not host.startswith("https://"):
        return host, False, _static_token(user)
    with tempfile.TemporaryDirectory(prefix="gpualloc-kubeconfig-") as scratch:
        ca_file, ca_data = _pem(cluster, "certificate-authority", scratch)
        cert_file, _ = _pem(user, "client-certificate", scratch, as_file=True)
        key_file, _ = _pem(user, "client-key", scratch, as_file=True)
        context_ = _tls(
            ca_file=ca_file,
            ca_data=ca_data,
            cert=(cert_file, key_file) if cert_file and key_file else None,
            verify=not cluster.get("insecure-skip-tls-verify", False),
        )
    return host, context_, _static_token(user)


def _pem(
    entry: Mapping[str, Any], key: str, scratch: str, *, as_file: bool = False
) -> tuple[str | None, str | None]:
    """``(file, data)`` of a kubeconfig PEM field given as ``key`` (a path) or ``key-data`` (base64).
    ``as_file``: data is written into ``scratch`` and given as a file (what ssl loads keys from)."""
    if entry.get(f"{key}-data"):
        text = base64.b64decode(entry[f"{key}-data"]).decode()
        if not as_file:
            return None, text
        target = Path(scratch) / key
        target.write_text(text)
        target.chmod(0o600)
        return str(target), None
    if entry.get(key):
        return str(Path(entry["_dir"]) / entry[key]), None
    return None, None


def _static_token(user: Mapping[str, Any]) -> Callable[[], str] | None:
    if user.get("token"):
        value = str(user["token"])
        return lambda: value
    if user.get("tokenFile"):
        return file_token(Path(user["_dir"]) / user["tokenFile"])
    return None


async def _from_plugin(
    path: str, context: str
) -> tuple[str, ssl.SSLContext | bool, Callable[[], str] | None]:
    """A user that logs in through a plugin: kubernetes_asyncio runs it (imported only here). The
    token it gets is used as long as this ``Api`` lives; a CLI call is short."""
    from kubernetes_asyncio import config as k8s_config
    from kubernetes_asyncio.client import Configuration

    loaded = Configuration()
    await k8s_config.load_kube_config(
        config_file=path, context=context, client_configuration=loaded, persist_config=False
    )
    raw = str(loaded.api_key.get("BearerToken") or loaded.api_key.get("authorization") or "")
    token = raw.removeprefix("Bearer ").strip()
    if not str(loaded.host).startswith("https://"):
        return str(loaded.host), False, (lambda: token) if token else None
    context_ = _tls(
        ca_file=loaded.ssl_ca_cert,
        cert=(loaded.cert_file, loaded.key_file) if loaded.cert_file and loaded.key_file else None,
        verify=bool(loaded.verify_ssl),
    )
    return str(loaded.host), context_, (lambda: token) if token else None
