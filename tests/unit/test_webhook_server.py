"""The webhook's HTTP layer and claim cache, over the aiohttp test client (plain HTTP, in process)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest

from gpualloc.api import codecs, constants, models
from gpualloc.kube import errors
from gpualloc.runtime import serving
from tests import admitting, reviews
from webhook import admission, cache, server
from webhook import metrics as metrics_

NS = "team-a"


def raw_claim(name: str = "train", *, phase: str = "Allocated", node: str = "node-1") -> dict[str, Any]:
    spec = models.GpuClaimSpec(devices=models.DeviceRequest(count=1))
    body = codecs.claim_body(name, spec, NS)
    body["metadata"]["resourceVersion"] = "1"
    status: dict[str, Any] = {"phase": phase, "message": "waiting for GPUs"}
    if phase == "Allocated":
        status["allocations"] = [
            {"replica": 0, "nodeName": node, "devices": [{"index": 0, "minor": 0, "uuid": "GPU-abc"}]}
        ]
    body["status"] = status
    return body


def review(claim: str | None = "train", uid: str = "u-1") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p", "namespace": NS}
    if claim is not None:
        meta["annotations"] = {constants.ANNOTATION_CLAIM: claim}
    return reviews.pod_review(
        {"metadata": meta, "spec": {"containers": [{"name": "c"}]}}, namespace=NS, uid=uid
    )


class CountingFetch:
    def __init__(self, result: Mapping[str, Any] | None = None, error: Exception | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.result = result
        self.error = error

    async def __call__(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.calls.append((namespace, name))
        if self.error is not None:
            raise self.error
        return self.result


async def client_for(serve: Any, claims: server.ClaimSource, **kwargs: Any) -> Any:
    return await serve(server.Webhook(claims, **kwargs).handle, max_body=server.MAX_BODY)


async def test_mutate_answers_an_allocated_claim_pod_with_a_patch_from_the_cache(serve: Any) -> None:
    fetch = CountingFetch()
    claims = cache.ClaimCache(cache.StaticStore([raw_claim()]), fetch)
    client = await client_for(serve, claims)
    for _ in range(3):
        resp = await client.post("/mutate", json=review())
        assert resp.status == 200
        body = await resp.json()
        assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
        assert body["response"]["uid"] == "u-1" and body["response"]["patchType"] == "JSONPatch"
    assert fetch.calls == [], "a cached claim costs no API call"


async def test_cache_miss_does_one_get_per_admission(serve: Any) -> None:
    fetch = CountingFetch(result=raw_claim("late"))
    claims = cache.ClaimCache(cache.StaticStore([]), fetch)
    client = await client_for(serve, claims)
    body = await (await client.post("/mutate", json=review("late"))).json()
    assert body["response"]["allowed"] is True and "patch" in body["response"]
    assert fetch.calls == [(NS, "late")]


async def test_pods_without_the_annotation_need_no_lookup(serve: Any) -> None:
    fetch = CountingFetch()
    client = await client_for(serve, cache.ClaimCache(cache.StaticStore([]), fetch))
    body = await (await client.post("/mutate", json=review(None))).json()
    assert body["response"] == {"uid": "u-1", "allowed": True}
    assert fetch.calls == []


async def test_failed_get_denies_the_pod_with_the_reason(serve: Any) -> None:
    fetch = CountingFetch(error=errors.Unavailable(503, "ServiceUnavailable", "apiserver is down"))
    client = await client_for(serve, cache.ClaimCache(cache.StaticStore([]), fetch))
    resp = await client.post("/mutate", json=review())
    assert resp.status == 200
    out = (await resp.json())["response"]
    assert out["allowed"] is False and out["status"]["code"] == 503
    assert "apiserver is down" in out["status"]["message"]


async def test_slow_get_is_cut_short_and_denied(serve: Any) -> None:
    async def slow(namespace: str, name: str) -> Mapping[str, Any] | None:
        await asyncio.sleep(10)
        return None

    claims = cache.ClaimCache(cache.StaticStore([]), slow, get_timeout=0.05)
    client = await client_for(serve, claims)
    out = (await (await client.post("/mutate", json=review())).json())["response"]
    assert out["allowed"] is False and "no answer from the API server" in out["status"]["message"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 100_000, "JSON object"),
        (b'{"request": {"uid": "u", "object": ' + b"[" * 100_000, "not JSON"),
        (b'{"request": "u"}', "no request object"),
        (b"[]", "JSON object"),
        (b'{"request": {}}', "no uid"),
        (b"{}", "no request"),
    ],
)
async def test_malformed_bodies_get_400(serve: Any, body: bytes, fragment: str) -> None:
    client = await client_for(serve, cache.ClaimCache(cache.StaticStore([]), CountingFetch()))
    resp = await client.post("/mutate", data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    assert fragment in await resp.text()


async def test_a_body_its_content_encoding_does_not_decode_gets_400(serve: Any) -> None:
    client = await client_for(serve, cache.ClaimCache(cache.StaticStore([]), CountingFetch()))
    resp = await client.post(
        "/mutate",
        data=b"this is not gzip",
        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
    )
    assert resp.status == 400
    assert "could not be read" in await resp.text()


async def test_body_over_three_mebibytes_is_refused_with_413(serve: Any) -> None:
    client = await client_for(serve, cache.ClaimCache(cache.StaticStore([]), CountingFetch()))
    resp = await client.post("/mutate", data=b" " * (server.MAX_BODY + 1))
    assert resp.status == 413


async def test_unexpected_failure_is_a_denial_not_a_500(serve: Any) -> None:
    class Broken:
        def synced(self) -> bool:
            return True

        async def lookup_for(self, ref: tuple[str, str] | None) -> admission.ClaimLookup:
            raise RuntimeError("boom")

    client = await client_for(serve, Broken())
    resp = await client.post("/mutate", json=review())
    assert resp.status == 200
    out = (await resp.json())["response"]
    assert out["uid"] == "u-1" and out["allowed"] is False and out["status"]["code"] == 500


async def test_readyz_follows_the_cache_sync_and_turns_false_when_stopping(serve: Any) -> None:
    store = cache.StaticStore([])
    store.synced.clear()
    webhook = server.Webhook(cache.ClaimCache(store, CountingFetch()))
    client = await serve(webhook.handle)
    assert (await client.get("/readyz")).status == 503
    assert (await client.get("/healthz")).status == 200
    store.synced.set()
    assert (await client.get("/readyz")).status == 200
    webhook.stopping = True
    assert (await client.get("/readyz")).status == 503
    assert (await client.get("/healthz")).status == 200


async def test_metrics_count_admissions_by_outcome_and_time_them(serve: Any) -> None:
    metrics = metrics_.Metrics()
    claims = cache.ClaimCache(
        cache.StaticStore([raw_claim(), raw_claim("p", phase="Pending")]), CountingFetch()
    )
    client = await client_for(serve, claims, metrics=metrics)
    await client.post("/mutate", json=review())
    await client.post("/mutate", json=review("p"))
    await client.post("/mutate", json=review(None))
    await client.post("/mutate", data=b"x")
    text = await (await client.get("/metrics")).text()
    assert 'gpualloc_webhook_admissions_total{outcome="mutated"} 1.0' in text
    assert 'gpualloc_webhook_admissions_total{outcome="denied"} 1.0' in text
    assert 'gpualloc_webhook_admissions_total{outcome="allowed"} 1.0' in text
    assert 'gpualloc_webhook_admissions_total{outcome="invalid"} 1.0' in text
    assert "gpualloc_webhook_admission_duration_seconds_count 4.0" in text


async def test_graceful_stop_finishes_a_request_in_flight() -> None:
    entered, release = asyncio.Event(), asyncio.Event()

    class Slow:  # every claim is a cache miss whose GET takes until ``release``
        def synced(self) -> bool:
            return True

        def contains(self, namespace: str, name: str) -> bool:
            return False

        def get(self, namespace: str, name: str, /) -> None:
            return None

        async def lookup_for(self, ref: tuple[str, str] | None) -> admission.ClaimLookup:
            entered.set()
            await release.wait()
            return admitting.lookup_from({})

    webhook = server.Webhook(Slow())
    runner = await server.start(webhook, "127.0.0.1", 0, ssl_context=None, shutdown_timeout=5)
    port = runner.addresses[0][1]
    async with aiohttp.ClientSession() as session:
        pending = asyncio.create_task(session.post(f"http://127.0.0.1:{port}/mutate", json=review()))
        await asyncio.wait_for(entered.wait(), 10)  # the request is in the handler
        stopping = asyncio.create_task(server.stop(webhook, runner))
        await asyncio.sleep(0.2)
        assert not webhook.ready()
        release.set()
        resp = await pending
        assert resp.status == 200
        assert (await resp.json())["response"]["uid"] == "u-1"
        await stopping


# ------------------------------------------------------------------ the cache itself


def test_cache_parses_a_claim_once_per_change() -> None:
    store = cache.StaticStore([raw_claim()])
    claims = cache.ClaimCache(store, CountingFetch())
    first = claims.get(NS, "train")
    assert first is not None and first.status.phase == "Allocated"
    assert claims.get(NS, "train") is first
    store.put(raw_claim(phase="Pending"))
    second = claims.get(NS, "train")
    assert second is not None and second is not first and second.status.phase == "Pending"
    del store.cache[f"{NS}/train"]
    assert claims.get(NS, "train") is None


async def test_cache_lookup_for_a_missing_claim_answers_none() -> None:
    fetch = CountingFetch(result=None)
    claims = cache.ClaimCache(cache.StaticStore([]), fetch)
    lookup = await claims.lookup_for((NS, "gone"))
    assert lookup(NS, "gone") is None
    assert fetch.calls == [(NS, "gone")]


async def test_fetch_from_maps_not_found_to_none() -> None:
    class Crs:
        async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
            raise errors.NotFound(404, "NotFound", 'gpuclaims.gpu.scheduling "x" not found')

    fetch = cache.fetch_from(Crs())  # type: ignore[arg-type]
    assert await fetch(NS, "x") is None


async def test_a_body_of_the_api_servers_limit_is_read_and_one_byte_more_is_413() -> None:
    """As ``main`` serves it (``server.start``): the limit is 3 MiB, not aiohttp's 1 MiB default."""
    webhook = server.Webhook(cache.ClaimCache(cache.StaticStore([]), CountingFetch()))
    runner = await server.start(webhook, "127.0.0.1", 0, ssl_context=None)
    port = serving.bound_port(runner)
    try:
        async with aiohttp.ClientSession() as session:
            padded = b" " * (3 * 1024 * 1024 - 2) + b"{}"
            async with session.post(f"http://127.0.0.1:{port}/mutate", data=padded) as resp:
                assert resp.status == 400 and "no request" in await resp.text()  # read whole, then judged
            async with session.post(f"http://127.0.0.1:{port}/mutate", data=padded + b" ") as resp:
                assert resp.status == 413
    finally:
        await runner.cleanup()


async def test_a_client_gone_before_its_whole_body_is_counted_invalid_without_an_error_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    webhook = server.Webhook(cache.ClaimCache(cache.StaticStore([]), CountingFetch()))
    runner = await server.start(webhook, "127.0.0.1", 0, ssl_context=None)
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", serving.bound_port(runner))
        writer.write(b'POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"request": ')
        await writer.drain()
        writer.close()  # 11 of the 1,000 bytes sent
        for _ in range(200):
            if webhook.metrics.admissions.counts[admission.INVALID]:
                break
            await asyncio.sleep(0.01)
    finally:
        await runner.cleanup()
    assert webhook.metrics.admissions.counts[admission.INVALID] == 1
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


async def test_other_paths_are_404_and_other_methods_405(serve: Any) -> None:
    client = await client_for(serve, cache.ClaimCache(cache.StaticStore([]), CountingFetch()))
    assert (await client.get("/mutate")).status == 405
    assert (await client.post("/readyz")).status == 405
    assert (await client.get("/nothing-here")).status == 404
    assert (await client.get("/livez")).status == 200


def test_the_claim_cache_forgets_deleted_claims_whatever_the_churn() -> None:
    store = cache.StaticStore([])
    claims = cache.ClaimCache(store, CountingFetch())
    for i in range(1000):
        raw = raw_claim(f"c-{i}")
        store.put(raw)
        assert claims.get(NS, f"c-{i}") is not None
        if i >= 10:
            del store.cache[f"{NS}/c-{i - 10}"]  # the watch's DELETED
    assert len(claims._parsed) <= 2 * len(store.cache) + cache.PARSED_SLACK + 1


# ------------------------------------------------------------------ what the watch cache keeps


def test_the_watch_cache_keeps_allocated_claims_only_and_holds_a_shared_marker_for_the_rest() -> None:
    allocated = raw_claim()
    allocated["metadata"]["annotations"] = {"ballast": "x" * 10_000}
    kept = cache.kept_of_claim(allocated)
    assert kept["status"]["allocations"] and "annotations" not in kept["metadata"]
    for phase in ("Pending", "Failed", "Released", "Preempted", ""):
        assert cache.kept_of_claim(raw_claim("p", phase=phase)) is cache.NOT_KEPT


async def test_a_claim_the_cache_does_not_keep_is_read_with_a_get_and_decided_the_same(serve: Any) -> None:
    store = cache.StaticStore([])
    for i in range(3000):  # a flood of Pending claims costs the cache their keys, nothing more
        store.cache[f"{NS}/flood-{i}"] = cache.kept_of_claim(raw_claim(f"flood-{i}", phase="Pending"))
    assert all(value is cache.NOT_KEPT for value in store.cache.values())
    store.cache[f"{NS}/train"] = cache.kept_of_claim(raw_claim())
    fetch = CountingFetch(result=raw_claim("flood-7", phase="Pending"))
    claims = cache.ClaimCache(store, fetch)
    assert not claims.contains(NS, "flood-7") and claims.contains(NS, "train")
    with pytest.raises(admission.ClaimUnavailable):
        claims.get(NS, "flood-7")
    client = await client_for(serve, claims)
    body = await (await client.post("/mutate", json=review("flood-7"))).json()
    assert body["response"]["allowed"] is False
    assert "is Pending, not Allocated" in body["response"]["status"]["message"]
    assert fetch.calls == [(NS, "flood-7")]
    body = await (await client.post("/mutate", json=review("train"))).json()
    assert body["response"]["allowed"] is True and fetch.calls == [(NS, "flood-7")]
