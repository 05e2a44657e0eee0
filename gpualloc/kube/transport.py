"""Raw JSON requests to the API server through a ``client.Api``.

Everything in gpualloc works on the camelCase JSON the API server sends, core
objects and custom resources alike: bodies go out as JSON, answers come back
parsed, and a status other than 2xx is the ``errors`` tree's exception.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import aiohttp

from gpualloc.kube import errors
from gpualloc.kube.client import Api

# A plain request that takes longer than this has met a stuck connection, not a slow API server.
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=30, sock_connect=10)

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


async def read_json(response: aiohttp.ClientResponse) -> Any:
    """The parsed body of a response; the tree's error when its status is not 2xx."""
    try:
        with errors.mapped():
            body = await response.read()
    finally:
        response.release()
    if not 200 <= response.status < 300:
        raise errors.from_response(response.status, body, response.reason or "")
    return json.loads(body) if body else None


async def request(
    api: Api,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str = "application/json",
    client_timeout: aiohttp.ClientTimeout = REQUEST_TIMEOUT,
) -> Any:
    """One request to ``path`` (e.g. ``/api/v1/nodes``) with the client's credentials; the JSON answer."""
    response = await send(
        api, method, path, query=query, body=body, content_type=content_type, client_timeout=client_timeout
    )
    return await read_json(response)


async def send(
    api: Api,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str = "application/json",
    client_timeout: aiohttp.ClientTimeout = REQUEST_TIMEOUT,
) -> aiohttp.ClientResponse:
    """Start a request and return the unread aiohttp response (the caller reads and releases it)."""
    with errors.mapped():
        return await api.send(
            method, path, query=query, body=body, content_type=content_type, client_timeout=client_timeout
        )


def collection_path(
    group: str, version: str, plural: str, namespace: str | None = None, name: str | None = None
) -> str:
    """The URL path of a resource collection (or of one object when ``name`` is given)."""
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    if namespace is not None:
        base += f"/namespaces/{quote(namespace, safe='')}"
    base += f"/{plural}"
    if name is not None:
        base += f"/{quote(name, safe='')}"
    return base
