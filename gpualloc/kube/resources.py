"""Typed calls on the gpu.scheduling/v1 custom resources: raw JSON dicts in and out.

Patches are JSON merge patches (RFC 7386), sent with the
``application/merge-patch+json`` content type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import transport
from gpualloc.kube.client import Api

Obj = dict[str, Any]


def with_resource_version(patch: Mapping[str, Any], resource_version: str | None) -> Obj:
    """``patch`` (not modified) with ``metadata.resourceVersion`` set, making the write conditional.

    A merge patch that carries a resourceVersion is applied only if the object
    still has it; otherwise the API server answers 409 Conflict.
    """
    out = dict(patch)
    if resource_version is not None:
        metadata = dict(out.get("metadata") or {})
        metadata["resourceVersion"] = resource_version
        out["metadata"] = metadata
    return out


class CustomResources:
    """GpuClaim (namespaced) and GpuNodeStatus (cluster-scoped) calls; errors are the ``errors`` tree."""

    def __init__(self, api: Api) -> None:
        self._api = api

    async def _call(
        self,
        method: str,
        plural: str,
        *,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str = "",
        body: Any = None,
        label_selector: str = "",
        content_type: str = "application/json",
    ) -> Obj:
        path = transport.collection_path(constants.GROUP, constants.VERSION, plural, namespace, name)
        query = [("labelSelector", label_selector)] if label_selector else []
        result = await transport.request(
            self._api,
            method,
            path + (f"/{subresource}" if subresource else ""),
            query=query,
            body=body,
            content_type=content_type,
        )
        return dict(result) if isinstance(result, dict) else {}

    # GpuClaim (namespaced)

    async def get_claim(self, namespace: str, name: str) -> Obj:
        return await self._call("GET", constants.CLAIM_PLURAL, namespace=namespace, name=name)

    async def list_claims(self, namespace: str | None = None, label_selector: str = "") -> Obj:
        """The List object: ``items`` and ``metadata.resourceVersion``; every namespace when None."""
        return await self._call(
            "GET", constants.CLAIM_PLURAL, namespace=namespace, label_selector=label_selector
        )

    async def create_claim(self, namespace: str, body: Mapping[str, Any]) -> Obj:
        return await self._call("POST", constants.CLAIM_PLURAL, namespace=namespace, body=dict(body))

    async def patch_claim(
        self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        """A JSON merge patch of the claim (spec, metadata; status is ignored on this endpoint);
        with ``resource_version``, ``Conflict`` if stale."""
        return await self._call(
            "PATCH",
            constants.CLAIM_PLURAL,
            namespace=namespace,
            name=name,
            body=with_resource_version(patch, resource_version),
            content_type=transport.MERGE_PATCH,
        )

    async def patch_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        """A JSON merge patch on the status subresource; with ``resource_version``, ``Conflict`` if stale."""
        return await self._call(
            "PATCH",
            constants.CLAIM_PLURAL,
            namespace=namespace,
            name=name,
            subresource="status",
            body=with_resource_version(patch, resource_version),
            content_type=transport.MERGE_PATCH,
        )

    async def patch_quota_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        """A JSON merge patch on a GpuQuota's status; with ``resource_version``, ``Conflict`` if stale."""
        return await self._call(
            "PATCH",
            constants.QUOTA_PLURAL,
            namespace=namespace,
            name=name,
            subresource="status",
            body=with_resource_version(patch, resource_version),
            content_type=transport.MERGE_PATCH,
        )

    async def delete_claim(self, namespace: str, name: str) -> Obj:
        return await self._call("DELETE", constants.CLAIM_PLURAL, namespace=namespace, name=name)

    # GpuNodeStatus (cluster-scoped)

    async def get_node_status(self, name: str) -> Obj:
        return await self._call("GET", constants.NODE_STATUS_PLURAL, name=name)

    async def list_node_statuses(self, label_selector: str = "") -> Obj:
        return await self._call("GET", constants.NODE_STATUS_PLURAL, label_selector=label_selector)

    async def create_node_status(self, body: Mapping[str, Any]) -> Obj:
        return await self._call("POST", constants.NODE_STATUS_PLURAL, body=dict(body))

    async def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> Obj:
        return await self._call(
            "PATCH",
            constants.NODE_STATUS_PLURAL,
            name=name,
            body=dict(patch),
            content_type=transport.MERGE_PATCH,
        )

    async def patch_node_status_status(
        self, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        return await self._call(
            "PATCH",
            constants.NODE_STATUS_PLURAL,
            name=name,
            subresource="status",
            body=with_resource_version(patch, resource_version),
            content_type=transport.MERGE_PATCH,
        )

    async def delete_node_status(self, name: str) -> Obj:
        return await self._call("DELETE", constants.NODE_STATUS_PLURAL, name=name)
