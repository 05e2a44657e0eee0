"""What CustomResources, leases and events put on the wire, captured at the aiohttp session (no server)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpualloc.kube import errors, events, leases, resources
from gpualloc.kube.client import Api


class FakeResponse:
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = "OK" if status < 400 else "Error"
        self.headers = {"content-type": "application/json"}
        self._body = json.dumps(body).encode()

    async def read(self) -> bytes:
        return self._body

    def release(self) -> None:
        pass


class Recorder:
    """Stands in for the client's aiohttp session.request: records requests, answers a canned body."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.status = 200
        self.body: Any = {"kind": "GpuClaim", "metadata": {"name": "c"}}

    async def __call__(self, method: str, url: str, **kwargs: Any) -> FakeResponse:
        self.requests.append({"method": method, "url": url, **kwargs})
        return FakeResponse(self.status, self.body)

    def only(self, method: str, path: str) -> Any:
        """The JSON body of the one request made, once it is checked to be ``method`` on ``path``."""
        (sent,) = self.requests
        assert sent["method"] == method
        assert sent["url"].endswith(path)
        return json.loads(sent["data"])


@pytest.fixture
async def recorded() -> AsyncIterator[tuple[Api, Recorder]]:
    api = Api("https://127.0.0.1:1", ssl_context=False)
    recorder = Recorder()
    api.session.request = recorder  # type: ignore[method-assign]
    try:
        yield api, recorder
    finally:
        await api.close()


async def test_patch_claim_status_is_sent_as_a_json_merge_patch_on_the_status_subresource(
    recorded: tuple[Api, Recorder],
) -> None:
    api, recorder = recorded
    crs = resources.CustomResources(api)
    await crs.patch_claim_status("team-a", "train", {"status": {"phase": "Allocated"}})
    sent = recorder.only("PATCH", "/apis/gpu.scheduling/v1/namespaces/team-a/gpuclaims/train/status")
    assert sent == {"status": {"phase": "Allocated"}}
    assert recorder.requests[0]["headers"]["Content-Type"] == "application/merge-patch+json"


async def test_every_patch_method_sends_merge_patch_not_json_patch(
    recorded: tuple[Api, Recorder],
) -> None:
    api, recorder = recorded
    crs = resources.CustomResources(api)
    await crs.patch_claim("ns", "c", {"metadata": {"labels": {"a": "b"}}})
    await crs.patch_node_status("n", {"spec": {"nodeName": "n"}})
    await crs.patch_node_status_status("n", {"status": {"total": 8}})
    types = [r["headers"]["Content-Type"] for r in recorder.requests]
    assert types == ["application/merge-patch+json"] * 3
    urls = [r["url"] for r in recorder.requests]
    assert urls[0].endswith("/apis/gpu.scheduling/v1/namespaces/ns/gpuclaims/c")
    assert urls[1].endswith("/apis/gpu.scheduling/v1/gpunodestatuses/n")
    assert urls[2].endswith("/apis/gpu.scheduling/v1/gpunodestatuses/n/status")


async def test_patch_status_with_resource_version_puts_it_in_metadata_without_touching_the_callers_dict(
    recorded: tuple[Api, Recorder],
) -> None:
    api, recorder = recorded
    crs = resources.CustomResources(api)
    patch = {"status": {"phase": "Failed"}, "metadata": {"annotations": {"x": "y"}}}
    await crs.patch_claim_status("ns", "c", patch, resource_version="42")
    sent = json.loads(recorder.requests[0]["data"])
    assert sent == {
        "status": {"phase": "Failed"},
        "metadata": {"annotations": {"x": "y"}, "resourceVersion": "42"},
    }
    assert patch == {"status": {"phase": "Failed"}, "metadata": {"annotations": {"x": "y"}}}


async def test_api_errors_come_back_as_the_tree(recorded: tuple[Api, Recorder]) -> None:
    api, recorder = recorded
    recorder.status = 409
    recorder.body = {"kind": "Status", "reason": "AlreadyExists", "message": "exists", "code": 409}
    with pytest.raises(errors.AlreadyExists):
        await resources.CustomResources(api).create_claim("ns", {"metadata": {"name": "c"}})
    with pytest.raises(errors.AlreadyExists):
        await leases.create_lease(api, "ns", "gpu-x", holder="uid-1", labels={})


async def test_create_lease_sends_holder_labels_and_duration_in_camel_case(
    recorded: tuple[Api, Recorder],
) -> None:
    api, recorder = recorded
    recorder.body = {"kind": "Lease", "metadata": {"name": "gpu-x", "resourceVersion": "7"}}
    out = await leases.create_lease(
        api,
        "gpualloc-system",
        "gpu-x",
        holder="uid-1",
        labels={"gpu.scheduling/node": "n1"},
        duration_seconds=30,
    )
    assert out == {"kind": "Lease", "metadata": {"name": "gpu-x", "resourceVersion": "7"}}
    body = recorder.only("POST", "/apis/coordination.k8s.io/v1/namespaces/gpualloc-system/leases")
    assert body["metadata"] == {
        "name": "gpu-x",
        "namespace": "gpualloc-system",
        "labels": {"gpu.scheduling/node": "n1"},
    }
    assert body["spec"]["holderIdentity"] == "uid-1"
    assert body["spec"]["leaseDurationSeconds"] == 30
    assert body["spec"]["acquireTime"].endswith("Z")


async def test_delete_lease_sends_uid_and_resource_version_preconditions(
    recorded: tuple[Api, Recorder],
) -> None:
    api, recorder = recorded
    recorder.body = {"kind": "Status", "status": "Success"}
    await leases.delete_lease(api, "ns", "gpu-x", uid="u-1", resource_version="9")
    sent = recorder.only("DELETE", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/gpu-x")
    assert sent["preconditions"] == {"uid": "u-1", "resourceVersion": "9"}


async def test_emit_posts_a_core_event_on_the_object_and_swallows_errors(
    recorded: tuple[Api, Recorder],
) -> None:
    api, recorder = recorded
    recorder.status = 403
    recorder.body = {"kind": "Status", "reason": "Forbidden", "message": "no", "code": 403}
    obj = {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "metadata": {"name": "train", "namespace": "team-a", "uid": "u-1", "resourceVersion": "5"},
    }
    await events.emit(
        api, obj=obj, reason="Allocated", message="ok", type_="Normal", component="gpualloc-controller"
    )
    body = recorder.only("POST", "/api/v1/namespaces/team-a/events")
    assert body["involvedObject"] == {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "name": "train",
        "namespace": "team-a",
        "uid": "u-1",
        "resourceVersion": "5",
    }
    assert body["metadata"]["name"].startswith("train.") and len(body["metadata"]["name"]) > len("train.")
    assert (body["reason"], body["type"], body["count"]) == ("Allocated", "Normal", 1)
    assert body["source"] == {"component": "gpualloc-controller"}
    assert body["reportingComponent"] == "gpualloc-controller"
    assert body["firstTimestamp"] == body["lastTimestamp"]
