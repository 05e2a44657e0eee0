"""coordination.k8s.io/v1 Leases, the device locks: raw JSON dicts (camelCase) in and out.

Bodies go out as dicts (the client serialises them as they are) and answers
come back unparsed by the client.

Creating a Lease is atomic in the API server: a second create of the same name
fails with ``errors.AlreadyExists``, which is what makes a Lease a lock.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client import ApiClient, CoordinationV1Api

from gpualloc.api import leases as lease_format
from gpualloc.kube import transport

Obj = dict[str, Any]


async def _call(api: ApiClient, method: str, *args: Any, **kwargs: Any) -> Any:
    """``CoordinationV1Api(api).<method>(*args, **kwargs)`` with the request timeout; its JSON answer."""
    pending = getattr(CoordinationV1Api(api), method)(
        *args, _preload_content=False, _request_timeout=transport.REQUEST_TIMEOUT, **kwargs
    )
    return await transport.call_json(pending)


async def create_lease(
    api: ApiClient,
    namespace: str,
    name: str,
    *,
    holder: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
    duration_seconds: int | None = None,
) -> Obj:
    """Create the Lease held by ``holder``; ``errors.AlreadyExists`` when the name is taken."""
    body = lease_format.body(
        namespace,
        name,
        holder=holder,
        labels=labels,
        annotations=annotations,
        duration_seconds=duration_seconds,
        now=datetime.datetime.now(datetime.UTC),
    )
    result: Obj = await _call(api, "create_namespaced_lease", namespace, body)
    return result


async def create(api: ApiClient, namespace: str, body: Mapping[str, Any]) -> Obj:
    """Create the Lease ``body`` (``gpualloc.api.leases.body``); ``errors.AlreadyExists`` if taken."""
    result: Obj = await _call(api, "create_namespaced_lease", namespace, dict(body))
    return result


async def get_lease(api: ApiClient, namespace: str, name: str) -> Obj:
    """The Lease; ``errors.NotFound`` when there is none."""
    result: Obj = await _call(api, "read_namespaced_lease", name, namespace)
    return result


async def delete_lease(
    api: ApiClient,
    namespace: str,
    name: str,
    *,
    uid: str | None = None,
    resource_version: str | None = None,
) -> None:
    """Delete the Lease, only if it still has this ``uid`` / ``resource_version`` when given.

    ``errors.NotFound`` when it is gone already; ``errors.Conflict`` when a
    precondition does not hold (the Lease was re-created or changed meanwhile).
    """
    preconditions: Obj = {}
    if uid is not None:
        preconditions["uid"] = uid
    if resource_version is not None:
        preconditions["resourceVersion"] = resource_version
    body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions"}
    if preconditions:
        body["preconditions"] = preconditions
    await _call(api, "delete_namespaced_lease", name, namespace, body=body)


async def list_leases(api: ApiClient, namespace: str, label_selector: str = "") -> Obj:
    """The LeaseList (``items``, ``metadata.resourceVersion``)."""
    result: Obj = await _call(api, "list_namespaced_lease", namespace, label_selector=label_selector)
    return result


async def replace_lease(api: ApiClient, namespace: str, name: str, body: Mapping[str, Any]) -> Obj:
    """Update the Lease; the body's ``metadata.resourceVersion`` makes it ``errors.Conflict`` if stale."""
    result: Obj = await _call(api, "replace_namespaced_lease", name, namespace, dict(body))
    return result
