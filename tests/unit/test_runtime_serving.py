"""The probes: /healthz always 200, /readyz follows ready(), /metrics is Prometheus text; 404 and
405 otherwise; no access log."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import prometheus_client
import pytest

from gpualloc.runtime import serving


async def test_readyz_flips_from_503_to_200_when_ready(serve: Any) -> None:
    state = {"ready": False}
    client = await serve(serving.probes(ready=lambda: state["ready"]))
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/readyz")).status == 503
    state["ready"] = True
    assert (await client.get("/readyz")).status == 200


async def test_readyz_is_503_when_the_check_raises(serve: Any) -> None:
    def broken() -> bool:
        raise RuntimeError("cache not there")

    client = await serve(serving.probes(ready=broken))
    response = await client.get("/readyz")
    assert response.status == 503
    assert "cache not there" in await response.text()


async def test_metrics_serves_the_given_registry_in_prometheus_text_format(serve: Any) -> None:
    registry = prometheus_client.CollectorRegistry()
    counter = prometheus_client.Counter("gpualloc_test_things", "things", registry=registry)
    counter.inc(3)
    client = await serve(serving.probes(ready=lambda: True, registry=registry))
    response = await client.get("/metrics")
    assert response.status == 200
    assert response.headers["Content-Type"] == prometheus_client.CONTENT_TYPE_LATEST
    assert "gpualloc_test_things_total 3.0" in await response.text()


async def test_start_probes_binds_the_given_host_and_cleans_up() -> None:
    runner = await serving.start_probes("127.0.0.1", 0, ready=lambda: True)
    try:
        port = serving.bound_port(runner)
        assert runner.addresses[0][0] == "127.0.0.1"
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/readyz") as r:
            assert r.status == 200
    finally:
        await runner.cleanup()


async def test_other_paths_get_404_and_other_methods_405(serve: Any) -> None:
    client = await serve(serving.probes(ready=lambda: True))
    assert (await client.get("/mutate")).status == 404
    response = await client.post("/healthz")
    assert response.status == 405
    assert response.headers["Allow"] == "GET, HEAD"


async def test_a_served_request_writes_no_access_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    runner = await serving.start_probes("127.0.0.1", 0, ready=lambda: True)
    try:
        url = f"http://127.0.0.1:{serving.bound_port(runner)}/healthz"
        async with aiohttp.ClientSession() as session, session.get(url) as r:
            assert r.status == 200
    finally:
        await runner.cleanup()
    assert [record for record in caplog.records if record.name == "aiohttp.access"] == []
