"""``gpualloc webhook`` as a process against the real API server: readiness, metrics, graceful stop."""

from __future__ import annotations

import asyncio
import signal
import ssl
import sys
from pathlib import Path

import aiohttp

from gpualloc.devcluster import cluster
from tests.integration.tls_support import write_serving_pair


async def status_of(session: aiohttp.ClientSession, url: str) -> int | None:
    try:
        async with session.get(url) as resp:
            await resp.read()
            return resp.status
    except aiohttp.ClientError:
        return None


async def test_webhook_process_becomes_ready_serves_metrics_and_stops_gracefully_on_sigterm(
    kubeconfig: str, tmp_path: Path
) -> None:
    ca, _, _ = write_serving_pair(tmp_path)
    port, metrics_port = cluster.free_ports(2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gpualloc.cli",
        "webhook",
        f"--tls-cert-file={tmp_path / 'tls.crt'}",
        f"--tls-key-file={tmp_path / 'tls.key'}",
        f"--port={port}",
        "--host=127.0.0.1",
        f"--metrics-port={metrics_port}",
        "--bind-address=127.0.0.1",
        f"--kubeconfig={kubeconfig}",
        "--shutdown-delay=3",  # room for the checks below on a loaded machine
        "--log-format=json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    context = ssl.create_default_context(cafile=str(ca))
    base = f"https://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as session:
            for _ in range(300):
                if await status_of(session, f"{base}/readyz") == 200:
                    break
                assert proc.returncode is None, "the webhook exited"
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the webhook never became ready")
            assert await status_of(session, f"{base}/healthz") == 200
            async with session.get(f"{base}/metrics") as resp:
                assert "gpualloc_webhook_admissions_total" in await resp.text()
            async with session.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
                assert "gpualloc_webhook_admission_duration_seconds" in await resp.text()

            proc.send_signal(signal.SIGTERM)
            # Readiness goes false first, while requests are still served (the drain delay).
            seen = None
            for _ in range(40):
                seen = await status_of(session, f"{base}/readyz")
                if seen == 503:
                    break
                await asyncio.sleep(0.05)
            assert seen == 503
            assert await status_of(session, f"{base}/healthz") == 200
        code = await asyncio.wait_for(proc.wait(), 15)
        assert code == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    output = (await proc.stdout.read()).decode() if proc.stdout else ""
    assert '"msg": "shutting down"' in output, output[-2000:]
