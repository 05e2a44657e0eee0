"""Typed calls on the gpu.scheduling/v1 custom resources: raw JSON dicts in and out.

Patches are JSON merge patches (RFC 7386), sent with the
``application/merge-patch+json`` content type given explicitly: left to itself,
kubernetes_asyncio sends a dict body to a custom object as a JSON Patch, which
the API server rejects (a JSON Patch is a list of operations).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client import ApiClient, CustomObjectsApi

from gpualloc.api import constants
from gpualloc.kube import errors, transport

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

    def __init__(self, api: ApiClient) -> None:
        self._api = CustomObjectsApi(api)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Obj:
        with errors.mapped():
            result = await getattr(self._api, method)(
                constants.GROUP,
                constants.VERSION,
                *args,
                _request_timeout=transport.REQUEST_TIMEOUT,
                **kwargs,
            )
        return dict(result) if isinstance(result, dict) else {}

    # GpuClaim (namespaced)

    async def get_claim(self, namespace: str, name: str) -> Obj:
        return await self._call("get_namespaced_custom_object", namespace, constants.CLAIM_PLURAL, name)

    async def list_claims(self, namespace: str | None = None, label_selector: str = "") -> Obj:
        """The List object: ``items`` and ``metadata.resourceVersion``; every namespace when None."""
        if namespace is None:
            return await self._call(
                "list_cluster_custom_object", constants.CLAIM_PLURAL, label_selector=label_selector
            )
        return await self._call(
            "list_namespaced_custom_object", namespace, constants.CLAIM_PLURAL, label_selector=label_selector
        )

    async def create_claim(self, namespace: str, body: Mapping[str, Any]) -> Obj:
        return await self._call(
            "create_namespaced_custom_object", namespace, constants.CLAIM_PLURAL, dict(body)
        )

    async def patch_claim(
        self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        """A JSON merge patch of the claim (spec, metadata; status is ignored on this endpoint);
        with ``resource_version``, ``Conflict`` if stale."""
        return await self._call(
            "patch_namespaced_custom_object",
            namespace,
            constants.CLAIM_PLURAL,
            name,
            with_resource_version(patch, resource_version),
            _content_type=transport.MERGE_PATCH,
        )

    async def patch_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        """A JSON merge patch on the status subresource; with ``resource_version``, ``Conflict`` if stale."""
        return await self._call(
            "patch_namespaced_custom_object_status",
            namespace,
            constants.CLAIM_PLURAL,
            name,
            with_resource_version(patch, resource_version),
            _content_type=transport.MERGE_PATCH,
        )

    async def patch_quota_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        """A JSON merge patch on a GpuQuota's status; with ``resource_version``, ``Conflict`` if stale."""
        return await self._call(
            "patch_namespaced_custom_object_status",
            namespace,
            constants.QUOTA_PLURAL,
            name,
            with_resource_version(patch, resource_version),
            _content_type=transport.MERGE_PATCH,
        )

    async def delete_claim(self, namespace: str, name: str) -> Obj:
        return await self._call("delete_namespaced_custom_object", namespace, constants.CLAIM_PLURAL, name)

    # GpuNodeStatus (cluster-scoped)

    async def get_node_status(self, name: str) -> Obj:
        return await self._call("get_cluster_custom_object", constants.NODE_STATUS_PLURAL, name)

    async def list_node_statuses(self, label_selector: str = "") -> Obj:
        return await self._call(
            "list_cluster_custom_object", constants.NODE_STATUS_PLURAL, label_selector=label_selector
        )

    async def create_node_status(self, body: Mapping[str, Any]) -> Obj:
        return await self._call("create_cluster_custom_object", constants.NODE_STATUS_PLURAL, dict(body))

    async def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> Obj:
        return await self._call(
            "patch_cluster_custom_object",
            constants.NODE_STATUS_PLURAL,
            name,
            dict(patch),
            _content_type=transport.MERGE_PATCH,
        )

    async def patch_node_status_status(
        self, name: str, patch: Mapping[str, Any], resource_version: str | None = None
    ) -> Obj:
        return await self._call(
            "patch_cluster_custom_object_status",
            constants.NODE_STATUS_PLURAL,
            name,
            with_resource_version(patch, resource_version),
            _content_type=transport.MERGE_PATCH,
        )

    async def delete_node_status(self, name: str) -> Obj:
        return await self._call("delete_cluster_custom_object", constants.NODE_STATUS_PLURAL, name)
