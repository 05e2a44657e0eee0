"""Raw JSON requests through a kubernetes_asyncio ``ApiClient``.

The generated API classes turn core objects into snake_case model instances;
everything in gpualloc works on the camelCase JSON the API server sends, the
same shape as the custom resources. Calls made here ask the client not to
preload (``_preload_content=False``), so the aiohttp response comes back as it
is: its status is checked here (the client only checks it when it preloads) and
its body parsed as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp
from kubernetes_asyncio.client import ApiClient

from gpualloc.kube import errors

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


async def call_json(pending: Awaitable[Any]) -> Any:
    """Await a generated API call made with ``_preload_content=False`` and return its JSON body."""
    with errors.mapped():
        response = await pending
    return await read_json(response)


async def request(
    api: ApiClient,
    method: str,
    path: str,
    *,
    query: Sequence[tuple[str, str]] = (),
    body: Any = None,
    content_type: str = "application/json",
    client_timeout: aiohttp.ClientTimeout = REQUEST_TIMEOUT,
) -> Any:
    """One request to ``path`` (e.g. ``/api/v1/nodes``) with the client's credentials; the JSON answer."""
    return await call_json(
        send(
            api,
            method,
            path,
            query=query,
            body=body,
            content_type=content_type,
            client_timeout=client_timeout,
        )
    )


async def send(
    api: ApiClient,
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
        response: aiohttp.ClientResponse = await api.call_api(
            path,
            method,
            query_params=list(query),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
            _preload_content=False,
            _request_timeout=client_timeout,
        )
    return response


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
