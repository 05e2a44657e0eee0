"""``client.connect``: one pooled, kept-alive session that reads the environment once."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
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
        session = api.session
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


async def _echo_server(aiohttp_server: Any, tokens: list[str]) -> TestServer:
    async def handler(request: web.Request) -> web.Response:
        tokens.append(request.headers.get("Authorization", ""))
        return web.json_response({"kind": "NodeList", "items": []})

    app = web.Application()
    app.router.add_get("/api/v1/nodes", handler)
    server: TestServer = await aiohttp_server(app)
    return server


async def test_a_users_exec_plugin_is_run_for_its_token(tmp_path: pathlib.Path, aiohttp_server: Any) -> None:
    tokens: list[str] = []
    server = await _echo_server(aiohttp_server, tokens)
    credential = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "kind": "ExecCredential",
        "status": {"token": "from-the-plugin"},
    }
    plugin = tmp_path / "login"
    plugin.write_text(f"#!{sys.executable}\nimport json\nprint(json.dumps({credential!r}))\n")
    plugin.chmod(0o755)
    path = tmp_path / "kubeconfig"
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{server.port}"}}}}]
users: [{{name: u, user: {{exec: {{apiVersion: client.authentication.k8s.io/v1, command: "{plugin}",
  interactiveMode: Never}}}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""
    )
    api = await client.connect(str(path))
    try:
        await transport.request(api, "GET", "/api/v1/nodes")
    finally:
        await api.close()
    assert tokens == ["Bearer from-the-plugin"]


async def test_in_a_pod_the_service_account_token_is_read_again_when_it_rotates(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("first\n")
    read = client.file_token(token, every=0.0)
    assert read() == "first"
    token.write_text("second\n")  # the kubelet rotated it
    assert read() == "second"
    cached = client.file_token(token, every=3600.0)
    assert cached() == "second"
    token.write_text("third\n")
    assert cached() == "second"  # not read again within the hour

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    with pytest.raises(client.ConfigError, match="not in a pod"):
        await client.connect()


def test_kubeconfig_files_merge_as_kubectl_merges_them(tmp_path: pathlib.Path) -> None:
    first = tmp_path / "a"
    first.write_text(
        "clusters: [{name: c, cluster: {server: https://one, certificate-authority: ca.crt}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"
    )
    second = tmp_path / "b"
    second.write_text(
        "clusters: [{name: c, cluster: {server: https://two}}]\n"
        "users: [{name: u, user: {token: t}}]\ncurrent-context: y\n"
    )
    merged = client.load_kubeconfig(f"{first}{os.pathsep}{second}")
    assert merged["current-context"] == "x"
    assert merged["clusters"]["c"]["server"] == "https://one"  # the first file to name it wins
    assert merged["clusters"]["c"]["_dir"] == str(tmp_path)  # relative paths: from their file
    assert merged["users"]["u"]["token"] == "t"


def test_the_components_run_without_loading_the_generated_client() -> None:
    """kubernetes_asyncio's models cost every process 38 MiB: no component imports them."""
    script = (
        "import sys\n"
        "import agent.main, certs.main, controller.main, webhook.main, gpualloc.cli\n"
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('kubernetes_asyncio')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_cached_objects_leave_out_managed_fields() -> None:
    from gpualloc.kube import watching

    obj = {"metadata": {"name": "c", "managedFields": [{"manager": "kubectl"}]}, "spec": {"x": 1}}
    kept = watching.without_managed_fields(obj)
    assert kept == {"metadata": {"name": "c"}, "spec": {"x": 1}}
    assert obj["metadata"]["managedFields"], "the caller's object is not changed"
    plain = {"metadata": {"name": "d"}}
    assert watching.without_managed_fields(plain) is plain
