"""The controller's one door to Kubernetes: the few reads and writes it makes, and nothing else.

Everything the controller decides comes from its caches (``state``), fed by
watch events; every call it makes to the API server goes through a
``Cluster``. ``KubeCluster`` is the real one; the deterministic simulation
(``tests/simulation``) supplies an in-memory one with the same semantics, so
the same controller code runs against both:

* ``create_lease``: atomic; ``errors.AlreadyExists`` when the name exists
  (also while it is being deleted but held by a finalizer);
* ``delete_lease``: with a uid precondition (and a resourceVersion one when
  given: a share ledger's last entry, ``locking`` rule 8), ``errors.Conflict``
  when the Lease by that name has another uid or version, ``errors.NotFound``
  when there is none; a Lease with finalizers only gets a ``deletionTimestamp``;
* ``replace_lease``: a PUT of the whole Lease, ``errors.Conflict`` when its
  ``metadata.resourceVersion`` is stale. A PUT that empties the finalizers of
  a Lease being deleted removes it, and that removal carries the body's uid
  as a precondition. (A PATCH would not: the API server removes the object
  in a second step without any precondition, which can delete a Lease that
  another claim created meanwhile under the same name. That is how the
  race test double-booked a GPU once; see ``locking.release``.)
* ``patch_claim_status`` / ``patch_claim_metadata``: JSON merge patches with
  a resourceVersion precondition, ``errors.Conflict`` when the claim has
  moved on; the answer is the claim as written (an authoritative read);
* ``patch_quota_status``: the same on a GpuQuota's status (its ledger);
* ``get_claim`` / ``get_lease``: authoritative reads (quorum), not the cache;
* ``list_pods``: an authoritative read of one namespace's pods;
* ``get_workload``: an authoritative read of a claim's owning Job or JobSet
  (``release: OnOwnerCompleted``), ``errors.NotFound`` when it is gone;
* ``evict_pod``: the Eviction API (PodDisruptionBudgets hold: ``errors.Unavailable``
  with status 429 when one does), ``errors.NotFound`` when the pod is gone;
* ``patch_pod``: a JSON Patch (list of operations) on a pod;
* ``emit_event``: best effort, never raises.

With ``--dra``, ``controller.dra`` also writes ResourceClaims through ``KubeCluster`` (its
``dra.ResourceClaims``, not part of ``Cluster``: the simulation runs without DRA):
``create_resource_claim``, ``patch_resource_claim_status`` (a merge patch on the status
subresource with a resourceVersion precondition) and ``delete_resource_claim`` (with a uid
precondition).

With ``--label-free-gpus``, ``controller.labelling`` also writes through ``KubeCluster`` (its
``labelling.NodeLabels``): ``patch_node_labels``, a JSON merge patch of a Node's labels (no
precondition: it sets the steering labels, whatever the rest of the Node says).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gpualloc.api import constants
from gpualloc.api import leases as lease_format
from gpualloc.kube import events, leases, resources, transport
from gpualloc.kube.client import Api

Obj = dict[str, Any]

COMPONENT = "gpualloc-controller"
# Events are sent on at most this many connections at once, so a burst of them never makes a
# Lease create or a status write wait for a connection of the pool.
EVENT_CONNECTIONS = 2
PAGE_SIZE = 500  # pods per page when listing a namespace
RESOURCE_GROUP, RESOURCE_VERSION, RESOURCE_CLAIMS = "resource.k8s.io", "v1", "resourceclaims"


class Cluster(Protocol):
    """What the controller reads and writes. Errors are ``gpualloc.kube.errors``."""

    async def create_lease(self, body: Obj) -> Obj: ...

    async def get_lease(self, name: str) -> Obj: ...

    async def delete_lease(self, name: str, *, uid: str, resource_version: str | None = None) -> None: ...

    async def replace_lease(self, body: Obj) -> Obj: ...

    async def get_claim(self, namespace: str, name: str) -> Obj: ...

    async def patch_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj: ...

    async def patch_claim_metadata(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj: ...

    async def patch_quota_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj: ...

    async def list_pods(self, namespace: str) -> list[Obj]: ...

    async def list_claim_leases(self, uid: str) -> list[Obj]: ...

    async def get_workload(self, namespace: str, api_version: str, resource: str, name: str) -> Obj: ...

    async def evict_pod(self, namespace: str, name: str, *, uid: str = "") -> None: ...

    async def patch_pod(self, namespace: str, name: str, operations: Sequence[Mapping[str, Any]]) -> Obj: ...

    async def emit_event(self, obj: Mapping[str, Any], reason: str, message: str, type_: str) -> None: ...


class KubeCluster:
    """``Cluster`` on a real API server; device Leases live in ``namespace``."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self._crs = resources.CustomResources(api)
        self._event_slots = asyncio.Semaphore(EVENT_CONNECTIONS)

    async def create_lease(self, body: Obj) -> Obj:
        return await leases.create(self.api, self.namespace, body)

    async def get_lease(self, name: str) -> Obj:
        return await leases.get_lease(self.api, self.namespace, name)

    async def delete_lease(self, name: str, *, uid: str, resource_version: str | None = None) -> None:
        await leases.delete_lease(self.api, self.namespace, name, uid=uid, resource_version=resource_version)

    async def replace_lease(self, body: Obj) -> Obj:
        return await leases.replace_lease(self.api, self.namespace, str(body["metadata"]["name"]), body)

    async def get_claim(self, namespace: str, name: str) -> Obj:
        return await self._crs.get_claim(namespace, name)

    async def patch_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        return await self._crs.patch_claim_status(namespace, name, patch, resource_version=resource_version)

    async def patch_claim_metadata(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        return await self._crs.patch_claim(namespace, name, patch, resource_version=resource_version)

    async def patch_quota_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        return await self._crs.patch_quota_status(namespace, name, patch, resource_version=resource_version)

    async def get_workload(self, namespace: str, api_version: str, resource: str, name: str) -> Obj:
        group, _, version = api_version.rpartition("/")
        path = transport.collection_path(group, version, resource, namespace, name)
        result: Obj = await transport.request(self.api, "GET", path)
        return result

    async def evict_pod(self, namespace: str, name: str, *, uid: str = "") -> None:
        """Evict the pod (if it is still the one with ``uid``, when given: a StatefulSet re-creates
        its name). A pod that is not running yet is evicted whatever its PodDisruptionBudget."""
        body: Obj = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if uid:
            body["deleteOptions"] = {"preconditions": {"uid": uid}}
        path = transport.collection_path("", "v1", "pods", namespace, name) + "/eviction"
        await transport.request(self.api, "POST", path, body=body)

    async def list_pods(self, namespace: str) -> list[Obj]:
        items: list[Obj] = []
        token = ""
        while True:
            query = [("limit", str(PAGE_SIZE))]
            if token:
                query.append(("continue", token))
            path = transport.collection_path("", "v1", "pods", namespace)
            page = await transport.request(self.api, "GET", path, query=query)
            items.extend(page.get("items") or [])
            token = str((page.get("metadata") or {}).get("continue") or "")
            if not token:
                return items

    async def list_claim_leases(self, uid: str) -> list[Obj]:
        """The device Leases the claim with this uid holds (by their claim-uid label), and the share
        ledgers it has an entry in (by the entry's label): a few."""
        path = transport.collection_path("coordination.k8s.io", "v1", "leases", self.namespace)
        items: list[Obj] = []
        for selector in (f"{constants.LABEL_CLAIM_UID}={uid}", lease_format.SHARE_LABEL_PREFIX + uid):
            page = await transport.request(self.api, "GET", path, query=[("labelSelector", selector)])
            items.extend(page.get("items") or [])
        return items

    async def patch_pod(self, namespace: str, name: str, operations: Sequence[Mapping[str, Any]]) -> Obj:
        path = transport.collection_path("", "v1", "pods", namespace, name)
        result: Obj = await transport.request(
            self.api, "PATCH", path, body=[dict(op) for op in operations], content_type=transport.JSON_PATCH
        )
        return result

    async def patch_node_labels(self, name: str, labels: Mapping[str, str | None]) -> Obj:
        """Set (or, with None, remove) these labels of Node ``name``; the Node as written."""
        result: Obj = await transport.request(
            self.api,
            "PATCH",
            transport.collection_path("", "v1", "nodes", None, name),
            body={"metadata": {"labels": dict(labels)}},
            content_type=transport.MERGE_PATCH,
        )
        return result

    # ------------------------------------------------------------------ ResourceClaims (controller.dra)

    def _resource_claim_path(self, namespace: str, name: str | None = None) -> str:
        return transport.collection_path(RESOURCE_GROUP, RESOURCE_VERSION, RESOURCE_CLAIMS, namespace, name)

    async def create_resource_claim(self, namespace: str, body: Mapping[str, Any]) -> Obj:
        result: Obj = await transport.request(
            self.api, "POST", self._resource_claim_path(namespace), body=dict(body)
        )
        return result

    async def patch_resource_claim_status(
        self, namespace: str, name: str, patch: Mapping[str, Any], *, resource_version: str
    ) -> Obj:
        result: Obj = await transport.request(
            self.api,
            "PATCH",
            self._resource_claim_path(namespace, name) + "/status",
            body=resources.with_resource_version(patch, resource_version),
            content_type=transport.MERGE_PATCH,
        )
        return result

    async def delete_resource_claim(self, namespace: str, name: str, *, uid: str) -> None:
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}
        await transport.request(self.api, "DELETE", self._resource_claim_path(namespace, name), body=body)

    async def emit_event(self, obj: Mapping[str, Any], reason: str, message: str, type_: str) -> None:
        async with self._event_slots:
            await events.emit(
                self.api, obj=obj, reason=reason, message=message, type_=type_, component=COMPONENT
            )
