"""Rotating the serving certificate under a running webhook, the way the kubelet updates a Secret volume.

The kubelet writes a Secret's files into a new ``..<timestamp>`` directory and
swaps the ``..data`` symlink to it; ``tls.crt`` and ``tls.key`` are symlinks
through ``..data``. The webhook must present the new certificate on new
handshakes without a restart and without failing a request. No API server is
involved: claims come from an in-memory store.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509

from certs import building, keys
from gpualloc.api import constants
from gpualloc.runtime import eventloop
from tests import reviews
from webhook import cache, server

NOW = datetime.datetime.now(datetime.UTC)
CA_KEY = keys.generate_key("ecdsa")
CA = building.build_ca(CA_KEY, now=NOW, serial=1000)


def serving_pair(serial: int) -> tuple[bytes, bytes]:
    key = keys.generate_key("ecdsa")
    cert = building.build_serving_cert(
        key,
        ca_cert=CA,
        ca_key=CA_KEY,
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
        now=NOW,
        serial=serial,
    )
    return building.cert_pem(cert), building.key_pem(key)


class SecretVolume:
    """A directory laid out like a kubelet-projected Secret, updated by the same atomic symlink swap."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0

    def write(self, cert_pem: bytes, key_pem: bytes) -> None:
        self.generation += 1
        data_dir = self.root / f"..2025_01_01_00_00_{self.generation:02d}.000000"
        data_dir.mkdir()
        (data_dir / "tls.crt").write_bytes(cert_pem)
        (data_dir / "tls.key").write_bytes(key_pem)
        tmp_link = self.root / "..data_tmp"
        os.symlink(data_dir.name, tmp_link)
        os.replace(tmp_link, self.root / "..data")  # the atomic step
        for name in ("tls.crt", "tls.key"):
            if not (self.root / name).is_symlink():
                os.symlink(f"..data/{name}", self.root / name)

    @property
    def cert_file(self) -> str:
        return str(self.root / "tls.crt")

    @property
    def key_file(self) -> str:
        return str(self.root / "tls.key")


def client_context() -> ssl.SSLContext:
    context = ssl.create_default_context(cadata=building.cert_pem(CA).decode())
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


async def peer_serial(port: int) -> int:
    """The serial of the certificate a fresh TLS handshake is given."""
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context())
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return int(x509.load_der_x509_certificate(der).serial_number)
    finally:
        writer.close()
        await writer.wait_closed()


REVIEW = reviews.pod_review(
    {
        "metadata": {"name": "p", "annotations": {constants.ANNOTATION_CLAIM: "missing"}},
        "spec": {"containers": [{"name": "c"}]},
    },
    namespace="ns",
    uid="rot",
)


@contextlib.asynccontextmanager
async def _serving(tmp_path: Path) -> AsyncIterator[tuple[SecretVolume, server.CertificateReloader, int]]:
    volume = SecretVolume(tmp_path)
    volume.write(*serving_pair(1))
    context = server.make_ssl_context(volume.cert_file, volume.key_file)
    webhook = server.Webhook(cache.ClaimCache(cache.StaticStore([]), _no_fetch))
    reloader = server.CertificateReloader(context, volume.cert_file, volume.key_file, interval=0.05)
    runner = await server.start(webhook, "127.0.0.1", 0, ssl_context=context, shutdown_timeout=2)
    task = asyncio.create_task(reloader.run())
    try:
        yield volume, reloader, runner.addresses[0][1]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[tuple[SecretVolume, server.CertificateReloader, int]]:
    async with _serving(tmp_path) as served:
        yield served


async def _no_fetch(namespace: str, name: str) -> dict[str, Any] | None:
    return None


async def _wait_for(predicate: Any) -> None:
    for _ in range(500):  # 10 s
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out waiting")


async def test_rotated_certificate_is_presented_on_new_handshakes_with_no_failed_request(
    running: tuple[SecretVolume, server.CertificateReloader, int],
) -> None:
    await _rotate_under_load(*running)


def test_rotation_on_the_event_loop_the_webhook_runs_on(tmp_path: Path) -> None:
    """``gpualloc webhook`` runs on uvloop (``gpualloc.runtime.eventloop``), whose TLS transport is
    not asyncio's: the same rotation, on that loop."""

    async def scenario() -> str:
        async with _serving(tmp_path) as served:
            await _rotate_under_load(*served)
        return type(asyncio.get_running_loop()).__module__

    assert eventloop.run(scenario()).startswith("uvloop")


async def _rotate_under_load(volume: SecretVolume, reloader: server.CertificateReloader, port: int) -> None:
    url = f"https://127.0.0.1:{port}/mutate"
    assert await peer_serial(port) == 1
    results = {"ok": 0, "failed": 0}
    errors: list[str] = []
    stop = asyncio.Event()

    async def loop(force_close: bool) -> None:
        connector = aiohttp.TCPConnector(ssl=client_context(), force_close=force_close)
        async with aiohttp.ClientSession(connector=connector) as session:
            while not stop.is_set():
                try:
                    async with session.post(url, json=REVIEW) as resp:
                        body = await resp.json()
                        assert resp.status == 200 and body["response"]["uid"] == "rot"
                    results["ok"] += 1
                except Exception as exc:  # counted, and shown if any
                    results["failed"] += 1
                    errors.append(repr(exc))

    # One client keeps its connection (old handshake), one handshakes for every request.
    clients = [asyncio.create_task(loop(False)), asyncio.create_task(loop(True))]
    try:
        await _wait_for(lambda: results["ok"] >= 20)
        volume.write(*serving_pair(2))
        await _wait_for(lambda: reloader.reloads == 1)
        before = results["ok"]
        await _wait_for(lambda: results["ok"] >= before + 20)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert await peer_serial(port) == 2
    assert results["failed"] == 0, errors[:3]
    assert results["ok"] >= 40


async def test_a_mismatched_pair_is_not_loaded_and_the_old_certificate_keeps_serving(
    running: tuple[SecretVolume, server.CertificateReloader, int],
) -> None:
    volume, reloader, port = running
    cert_pem, _ = serving_pair(3)
    _, other_key = serving_pair(4)
    volume.write(cert_pem, other_key)  # a certificate with somebody else's key
    await _wait_for(lambda: reloader.failures >= 1)
    assert reloader.reloads == 0
    assert await peer_serial(port) == 1
    volume.write(*serving_pair(5))  # the next good pair goes in
    await _wait_for(lambda: reloader.reloads == 1)
    assert await peer_serial(port) == 5


async def test_server_requires_tls_1_2_at_least_and_speaks_it(
    running: tuple[SecretVolume, server.CertificateReloader, int],
) -> None:
    _, reloader, port = running
    assert reloader.context.minimum_version == ssl.TLSVersion.TLSv1_2
    context = client_context()
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        assert writer.get_extra_info("ssl_object").version() == "TLSv1.2"
    finally:
        writer.close()
        await writer.wait_closed()
