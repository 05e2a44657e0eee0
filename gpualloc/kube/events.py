"""core/v1 Events on objects, best effort: a failure is logged, never raised."""

from __future__ import annotations

import datetime
import logging
import secrets
from collections.abc import Mapping
from typing import Any

from gpualloc.api import timestamps
from gpualloc.kube import transport
from gpualloc.kube.client import Api

log = logging.getLogger(__name__)

Obj = dict[str, Any]

MAX_MESSAGE = 1024


def event_body(
    *,
    obj: Mapping[str, Any],
    reason: str,
    message: str,
    type_: str,
    component: str,
    now: datetime.datetime,
    suffix: str,
) -> Obj:
    """The Event ``emit`` creates for ``obj`` (a raw object dict)."""
    metadata = obj.get("metadata") or {}
    name = str(metadata.get("name", "unknown"))
    namespace = metadata.get("namespace")
    involved: Obj = {"apiVersion": obj.get("apiVersion", ""), "kind": obj.get("kind", ""), "name": name}
    for key in ("namespace", "uid", "resourceVersion"):
        if metadata.get(key):
            involved[key] = metadata[key]
    stamp = timestamps.format_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{name}.{suffix}", "namespace": namespace or "default"},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": type_,
        "source": {"component": component},
        "reportingComponent": component,
        "reportingInstance": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def emit(
    api: Api,
    *,
    obj: Mapping[str, Any],
    reason: str,
    message: str,
    type_: str = "Normal",
    component: str,
) -> None:
    """Record an Event on ``obj`` (cluster-scoped objects get theirs in ``default``). Never raises."""
    body = event_body(
        obj=obj,
        reason=reason,
        message=message,
        type_=type_,
        component=component,
        now=datetime.datetime.now(datetime.UTC),
        suffix=secrets.token_hex(8),
    )
    namespace = body["metadata"]["namespace"]
    try:
        await transport.request(
            api, "POST", transport.collection_path("", "v1", "events", namespace), body=body
        )
    except Exception as exc:  # best effort: an event is never worth failing the caller
        # The API server refuses new objects in a namespace being deleted: nobody would read them.
        level = logging.DEBUG if "because it is being terminated" in str(exc) else logging.WARNING
        log.log(
            level,
            "could not record event",
            extra={"reason": reason, "object": body["involvedObject"]["name"], "error": str(exc)},
        )
