"""``client.connect``: one pooled, kept-alive session that reads the environment once."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gpualloc.kube import client, transport


def _kubeconfig(tmp_path: pathlib.Path, server: str) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{server}"}}}}]
users: [{{name: u, user: {{token: secret-token}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""
    )
    return str(path)


async def test_requests_share_one_kept_alive_connection_and_carry_the_token(
    tmp_path: pathlib.Path, aiohttp_server: Any
) -> None:
    peers: list[tuple[str, int]] = []
    tokens: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        tokens.append(request.headers.get("Authorization", ""))
        return web.json_response({"kind": "NodeList", "items": []})

    app = web.Application()
    app.router.add_get("/api/v1/nodes", handler)
    server: TestServer = await aiohttp_server(app)
    api = await client.connect(_kubeconfig(tmp_path, f"http://127.0.0.1:{server.port}"), connections=3)
    try:
        session = api.rest_client.pool_manager
        assert session.trust_env is False
        assert session.connector is not None and session.connector.limit == 3
        for _ in range(3):
            assert await transport.request(api, "GET", "/api/v1/nodes") == {"kind": "NodeList", "items": []}
    finally:
        await api.close()
    assert len(set(peers)) == 1, f"one connection reused, not {peers}"
    assert tokens == ["Bearer secret-token"] * 3


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"HTTPS_PROXY": "http://proxy.example:3128"}, "http://proxy.example:3128"),
        ({"HTTPS_PROXY": "http://proxy.example:3128", "NO_PROXY": "10.0.0.1,api.example"}, None),
    ],
)
def test_the_proxy_comes_from_the_environment_once_unless_no_proxy_exempts_the_server(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str | None
) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert client.environment_proxy("https://api.example:6443") == expected
