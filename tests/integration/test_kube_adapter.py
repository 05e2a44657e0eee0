"""gpualloc.kube against the real local kube-apiserver: CRUD, the error tree, leases, events, reflectors."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gpualloc.kube import client, errors, events, leases, resources, transport, watching
from gpualloc.kube.client import Api


def claim(name: str, count: int = 1, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"devices": {"count": count}},
    }


def node_status(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuNodeStatus",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {"nodeName": name},
    }


@pytest.fixture
async def node_status_name(api: Api) -> AsyncIterator[str]:
    """A unique GpuNodeStatus name (cluster-scoped), deleted after the test."""
    name = f"t-node-{uuid.uuid4().hex[:8]}"
    yield name
    with contextlib.suppress(errors.NotFound):
        await resources.CustomResources(api).delete_node_status(name)


def without_ca(kubeconfig: str, target: Path) -> str:
    """A copy of ``kubeconfig`` at ``target`` without the cluster's CA."""
    lines = Path(kubeconfig).read_text().splitlines()
    target.write_text("\n".join(line for line in lines if "certificate-authority" not in line))
    return str(target)


async def test_connect_verifies_the_api_server_and_presents_the_kubeconfigs_client_certificate(
    kubeconfig: str, tmp_path: Path
) -> None:
    api = await client.connect(kubeconfig)
    try:
        version = await transport.request(api, "GET", "/version")
        assert version["major"] == "1"
        assert api.host.startswith("https://127.0.0.1:")
        # /api needs an authenticated user: the client certificate (the admin's) was presented.
        assert "v1" in (await transport.request(api, "GET", "/api"))["versions"]
    finally:
        await api.close()
    # A kubeconfig without the cluster's CA does not trust the API server.
    api = await client.connect(without_ca(kubeconfig, tmp_path / "kubeconfig"))
    try:
        with pytest.raises(errors.Unavailable, match="certificate"):
            await transport.request(api, "GET", "/version")
    finally:
        await api.close()


async def test_claim_create_get_list_patch_delete(api: Api, namespace: str) -> None:
    crs = resources.CustomResources(api)
    created = await crs.create_claim(namespace, claim("train", count=2))
    assert created["metadata"]["namespace"] == namespace
    assert created["spec"]["devices"]["count"] == 2
    assert created["spec"]["devices"]["exclusivity"] == "Exclusive"  # the schema's default applied

    got = await crs.get_claim(namespace, "train")
    assert got["metadata"]["uid"] == created["metadata"]["uid"]

    listing = await crs.list_claims(namespace)
    assert [i["metadata"]["name"] for i in listing["items"]] == ["train"]
    assert listing["metadata"]["resourceVersion"]
    everywhere = await crs.list_claims()
    assert any(i["metadata"]["uid"] == created["metadata"]["uid"] for i in everywhere["items"])

    patched = await crs.patch_claim(namespace, "train", {"metadata": {"labels": {"team": "a"}}})
    assert patched["metadata"]["labels"] == {"team": "a"}
    assert patched["spec"]["devices"]["count"] == 2  # a merge patch keeps what it does not mention
    assert [
        i["metadata"]["name"] for i in (await crs.list_claims(namespace, label_selector="team=a"))["items"]
    ] == ["train"]
    assert (await crs.list_claims(namespace, label_selector="team=b"))["items"] == []

    await crs.delete_claim(namespace, "train")
    with pytest.raises(errors.NotFound):
        await crs.get_claim(namespace, "train")


async def test_merge_patch_of_claim_status_merges_into_the_status_subresource(
    api: Api, namespace: str
) -> None:
    crs = resources.CustomResources(api)
    await crs.create_claim(namespace, claim("c"))
    first = await crs.patch_claim_status(
        namespace, "c", {"status": {"phase": "Pending", "message": "waiting"}}
    )
    assert first["status"] == {"phase": "Pending", "message": "waiting"}
    second = await crs.patch_claim_status(namespace, "c", {"status": {"retryCount": 2, "message": None}})
    # Merged, not replaced: phase stays, retryCount is added, a null removes message.
    assert second["status"] == {"phase": "Pending", "retryCount": 2}
    # The status endpoint ignores spec changes, the main endpoint ignores status changes.
    third = await crs.patch_claim_status(namespace, "c", {"spec": {"devices": {"count": 5}}})
    assert third["spec"]["devices"]["count"] == 1
    fourth = await crs.patch_claim(namespace, "c", {"status": {"phase": "Allocated"}})
    assert fourth["status"]["phase"] == "Pending"


async def test_patch_claim_status_with_a_stale_resource_version_is_a_conflict(
    api: Api, namespace: str
) -> None:
    crs = resources.CustomResources(api)
    created = await crs.create_claim(namespace, claim("c"))
    stale = created["metadata"]["resourceVersion"]
    fresh = await crs.patch_claim_status(
        namespace, "c", {"status": {"phase": "Pending"}}, resource_version=stale
    )
    assert fresh["metadata"]["resourceVersion"] != stale
    with pytest.raises(errors.Conflict) as info:
        await crs.patch_claim_status(namespace, "c", {"status": {"phase": "Failed"}}, resource_version=stale)
    assert info.value.status == 409
    assert not isinstance(info.value, errors.AlreadyExists)
    assert (await crs.get_claim(namespace, "c"))["status"]["phase"] == "Pending"


async def test_claim_not_found_already_exists_and_invalid(api: Api, namespace: str) -> None:
    crs = resources.CustomResources(api)
    with pytest.raises(errors.NotFound):
        await crs.get_claim(namespace, "missing")
    with pytest.raises(errors.NotFound):
        await crs.delete_claim(namespace, "missing")
    with pytest.raises(errors.NotFound):
        await crs.patch_claim_status(namespace, "missing", {"status": {"phase": "Pending"}})

    await crs.create_claim(namespace, claim("dup"))
    with pytest.raises(errors.AlreadyExists) as exists:
        await crs.create_claim(namespace, claim("dup"))
    assert exists.value.reason == "AlreadyExists"

    with pytest.raises(errors.Invalid) as invalid:
        await crs.create_claim(namespace, claim("zero", count=0))
    assert invalid.value.status == 422
    assert "count" in invalid.value.message
    with pytest.raises(errors.Invalid):
        await crs.patch_claim_status(namespace, "dup", {"status": {"phase": "Bogus"}})


async def test_node_status_crud_conflict_and_not_found(api: Api, node_status_name: str) -> None:
    crs = resources.CustomResources(api)
    name = node_status_name
    created = await crs.create_node_status(node_status(name, labels={"t": name}))
    assert "namespace" not in created["metadata"]
    with pytest.raises(errors.AlreadyExists):
        await crs.create_node_status(node_status(name))
    assert (await crs.get_node_status(name))["spec"]["nodeName"] == name
    assert [
        i["metadata"]["name"] for i in (await crs.list_node_statuses(label_selector=f"t={name}"))["items"]
    ] == [name]
    labelled = await crs.patch_node_status(name, {"metadata": {"labels": {"extra": "1"}}})
    assert labelled["metadata"]["labels"] == {"t": name, "extra": "1"}

    rv = labelled["metadata"]["resourceVersion"]
    updated = await crs.patch_node_status_status(name, {"status": {"source": "simulated", "total": 8}}, rv)
    assert updated["status"] == {"source": "simulated", "total": 8}
    with pytest.raises(errors.Conflict):
        await crs.patch_node_status_status(name, {"status": {"total": 4}}, resource_version=rv)
    with pytest.raises(errors.Invalid):
        await crs.patch_node_status_status(name, {"status": {"source": "guessed"}})

    await crs.delete_node_status(name)
    with pytest.raises(errors.NotFound):
        await crs.get_node_status(name)
    with pytest.raises(errors.NotFound):
        await crs.delete_node_status(name)


async def test_lease_is_a_lock_create_twice_is_already_exists(api: Api, namespace: str) -> None:
    labels = {"gpu.scheduling/node": "n1", "gpu.scheduling/claim-uid": "uid-1"}
    created = await leases.create_lease(
        api, namespace, "gpu-abc", holder="uid-1", labels=labels, duration_seconds=30
    )
    assert created["spec"]["holderIdentity"] == "uid-1"
    assert created["spec"]["leaseDurationSeconds"] == 30
    assert created["metadata"]["labels"] == labels
    with pytest.raises(errors.AlreadyExists):
        await leases.create_lease(api, namespace, "gpu-abc", holder="uid-2", labels={})
    got = await leases.get_lease(api, namespace, "gpu-abc")
    assert got["spec"]["holderIdentity"] == "uid-1"  # the second create changed nothing
    listing = await leases.list_leases(api, namespace, label_selector="gpu.scheduling/node=n1")
    assert [i["metadata"]["name"] for i in listing["items"]] == ["gpu-abc"]
    assert (await leases.list_leases(api, namespace, label_selector="gpu.scheduling/node=n2"))["items"] == []


async def test_lease_replace_with_a_stale_resource_version_is_a_conflict(api: Api, namespace: str) -> None:
    created = await leases.create_lease(api, namespace, "gpu-r", holder="uid-1", labels={})
    body = dict(created, spec=dict(created["spec"], holderIdentity="uid-2"))
    replaced = await leases.replace_lease(api, namespace, "gpu-r", body)
    assert replaced["spec"]["holderIdentity"] == "uid-2"
    with pytest.raises(errors.Conflict):
        await leases.replace_lease(api, namespace, "gpu-r", body)  # still carries the old resourceVersion


async def test_lease_delete_preconditions(api: Api, namespace: str) -> None:
    created = await leases.create_lease(api, namespace, "gpu-d", holder="uid-1", labels={})
    with pytest.raises(errors.Conflict):
        await leases.delete_lease(api, namespace, "gpu-d", uid="00000000-0000-0000-0000-000000000000")
    with pytest.raises(errors.Conflict):
        await leases.delete_lease(api, namespace, "gpu-d", resource_version="1")
    await leases.get_lease(api, namespace, "gpu-d")  # still there
    await leases.delete_lease(
        api,
        namespace,
        "gpu-d",
        uid=created["metadata"]["uid"],
        resource_version=created["metadata"]["resourceVersion"],
    )
    with pytest.raises(errors.NotFound):
        await leases.get_lease(api, namespace, "gpu-d")
    with pytest.raises(errors.NotFound):
        await leases.delete_lease(api, namespace, "gpu-d")


async def test_emit_records_an_event_on_the_object_and_never_raises(api: Api, namespace: str) -> None:
    obj = await resources.CustomResources(api).create_claim(namespace, claim("evt"))
    await events.emit(
        api, obj=obj, reason="Allocated", message="2 GPUs on n1", component="gpualloc-controller"
    )
    listing = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events")
    (event,) = listing["items"]
    assert event["reason"] == "Allocated"
    assert event["message"] == "2 GPUs on n1"
    assert event["type"] == "Normal"
    assert event["source"]["component"] == "gpualloc-controller"
    assert event["reportingComponent"] == "gpualloc-controller"
    assert event["count"] == 1
    involved = event["involvedObject"]
    assert involved["kind"] == "GpuClaim"
    assert involved["apiVersion"] == "gpu.scheduling/v1"
    assert involved["uid"] == obj["metadata"]["uid"]
    assert involved["namespace"] == namespace
    assert event["metadata"]["name"].startswith("evt.")
    # A namespace that does not exist: logged, not raised.
    ghost = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "no-such-ns-x"}}
    await events.emit(api, obj=ghost, reason="X", message="y", type_="Warning", component="c")


async def eventually(predicate: Any, seconds: float = 10.0) -> None:
    async with asyncio.timeout(seconds):
        while not predicate():  # noqa: ASYNC110 - polling a plain list filled by a callback
            await asyncio.sleep(0.05)


async def test_reflector_sees_added_modified_deleted_claims(api: Api, namespace: str) -> None:
    crs = resources.CustomResources(api)
    await crs.create_claim(namespace, claim("before"))
    seen: list[tuple[str, str, str]] = []
    reflector = watching.Reflector(
        api,
        watching.CLAIMS,
        namespace=namespace,
        on_event=lambda t, o: seen.append((t, o["metadata"]["name"], o["metadata"]["resourceVersion"])),
    )
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 10)
        assert seen == [
            ("ADDED", "before", reflector.cache[f"{namespace}/before"]["metadata"]["resourceVersion"])
        ]
        assert reflector.cache[f"{namespace}/before"]["kind"] == "GpuClaim"  # list items get kind/apiVersion

        a = await crs.create_claim(namespace, claim("a"))
        b = await crs.patch_claim_status(namespace, "a", {"status": {"phase": "Pending"}})
        await crs.delete_claim(namespace, "before")
        await eventually(lambda: len(seen) >= 4)
        assert seen[1:3] == [
            ("ADDED", "a", a["metadata"]["resourceVersion"]),
            ("MODIFIED", "a", b["metadata"]["resourceVersion"]),
        ]
        assert seen[3][:2] == ("DELETED", "before")
        assert len(seen) == 4
        assert set(reflector.cache) == {f"{namespace}/a"}
        # The cache holds the object as the API server wrote it, but for its managedFields.
        assert b["metadata"]["managedFields"]
        assert reflector.get(f"{namespace}/a") == watching.without_managed_fields(b)
        assert reflector.lists == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_reflector_of_a_core_kind_holds_camel_case_dicts(api: Api, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p1", "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "c", "image": "example.invalid/x:1"}], "restartPolicy": "Never"},
    }
    await transport.request(api, "POST", f"/api/v1/namespaces/{namespace}/pods", body=pod)
    reflector = watching.Reflector(api, watching.PODS, namespace=namespace, label_selector="app=x")
    task = asyncio.create_task(reflector.run())
    try:
        await asyncio.wait_for(reflector.synced.wait(), 10)
        cached = reflector.get(f"{namespace}/p1")
        assert cached is not None
        assert cached["apiVersion"] == "v1" and cached["kind"] == "Pod"
        assert "resourceVersion" in cached["metadata"]
        assert cached["spec"]["restartPolicy"] == "Never"
        assert "resource_version" not in cached["metadata"]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_watch_from_a_too_old_resource_version_is_gone(api: Api, namespace: str) -> None:
    # The API server's watch cache starts at the resourceVersion it had when it started, far past 1:
    # a watch from "1" is answered 410 Gone (here as an ERROR event in the stream; either way Gone).
    reflector = watching.Reflector(api, watching.CLAIMS, namespace=namespace)
    with pytest.raises(errors.Gone):
        async with asyncio.timeout(10), contextlib.aclosing(reflector.stream("1")) as stream:
            async for event in stream:
                reflector.apply(event)
