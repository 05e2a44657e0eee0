"""coordination.k8s.io/v1 Leases, the device locks and the node heartbeats: raw JSON dicts
(camelCase) in and out.

Bodies go out as dicts (the client serialises them as they are) and answers
come back unparsed by the client.

Creating a Lease is atomic in the API server: a second create of the same name
fails with ``errors.AlreadyExists``, which is what makes a Lease a lock.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from gpualloc.api import leases as lease_format
from gpualloc.kube import transport
from gpualloc.kube.client import Api

Obj = dict[str, Any]


def _path(namespace: str, name: str | None = None) -> str:
    return transport.collection_path("coordination.k8s.io", "v1", "leases", namespace, name)


async def create_lease(
    api: Api,
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
    result: Obj = await transport.request(api, "POST", _path(namespace), body=body)
    return result


async def create(api: Api, namespace: str, body: Mapping[str, Any]) -> Obj:
    """Create the Lease ``body`` (``gpualloc.api.leases.body``); ``errors.AlreadyExists`` if taken."""
    result: Obj = await transport.request(api, "POST", _path(namespace), body=dict(body))
    return result


async def get_lease(api: Api, namespace: str, name: str) -> Obj:
    """The Lease; ``errors.NotFound`` when there is none."""
    result: Obj = await transport.request(api, "GET", _path(namespace, name))
    return result


async def delete_lease(
    api: Api,
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
    await transport.request(api, "DELETE", _path(namespace, name), body=body)


async def list_leases(api: Api, namespace: str, label_selector: str = "") -> Obj:
    """The LeaseList (``items``, ``metadata.resourceVersion``)."""
    query = [("labelSelector", label_selector)] if label_selector else []
    result: Obj = await transport.request(api, "GET", _path(namespace), query=query)
    return result


async def replace_lease(api: Api, namespace: str, name: str, body: Mapping[str, Any]) -> Obj:
    """Update the Lease; the body's ``metadata.resourceVersion`` makes it ``errors.Conflict`` if stale."""
    result: Obj = await transport.request(api, "PUT", _path(namespace, name), body=dict(body))
    return result


async def renew(api: Api, namespace: str, name: str, now: datetime.datetime) -> Obj:
    """Move a heartbeat Lease's renewTime to ``now`` (a merge patch); ``errors.NotFound`` if missing."""
    result: Obj = await transport.request(
        api,
        "PATCH",
        _path(namespace, name),
        body=lease_format.renewal(now),
        content_type=transport.MERGE_PATCH,
    )
    return result
