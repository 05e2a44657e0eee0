"""Shared fixtures: one real local control plane per test session.

- ``control_plane`` (session): etcd + kube-apiserver built from the pinned Go
  modules, with the CRDs from ``helm/gpualloc/crds/`` applied and Established.
  If the binaries cannot be built the tests that need it fail with the build
  error; they are never skipped.
- ``kubeconfig`` (session), ``namespace`` (function), ``api`` (function, async);
  ``fresh_namespace`` and ``delete_if_present`` for fixtures of their own; ``completed_requests``
  reads the audit log.
- Tests under tests/integration, tests/e2e, tests/gpu and tests/node get the markers
  ``integration``, ``e2e``, ``gpu`` and ``node``.
- With ``GPUALLOC_REQUIRE_INTEGRATION=1`` (set by .ci/run) the session fails
  when no integration test ran, or when any integration or node test (the real-node
  tier) was skipped or deselected.
- ``serve`` (function): an aiohttp test client for a request handler on aiohttp's
  low-level server, as ``gpualloc.runtime.serving`` serves one.
- A test that leaves asyncio tasks running fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestClient

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
CRD_DIR = REPO_ROOT / "helm" / "gpualloc" / "crds"
REQUIRE_INTEGRATION = "GPUALLOC_REQUIRE_INTEGRATION"

_DIRECTORY_MARKERS = {"integration": "integration", "e2e": "e2e", "gpu": "gpu", "node": "node"}
# The tiers GPUALLOC_REQUIRE_INTEGRATION=1 counts: a skipped or deselected test of either fails it.
_REQUIRED_MARKERS = ("integration", "node")


# ------------------------------------------------------------------ markers


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = Path(str(item.path)).resolve().relative_to(TESTS_DIR).parts[0]
        except (ValueError, IndexError):
            continue
        marker = _DIRECTORY_MARKERS.get(top)
        if marker is not None:
            item.add_marker(getattr(pytest.mark, marker))


# ------------------------------------------- GPUALLOC_REQUIRE_INTEGRATION=1


class _IntegrationTally:
    def __init__(self) -> None:
        self.ran = 0
        self.skipped: list[str] = []
        self.deselected = 0
        self.problems: list[str] = []


_tally = _IntegrationTally()  # pytest_runtest_logreport gets no config; one session per process


def pytest_configure(config: pytest.Config) -> None:
    global _tally
    _tally = _IntegrationTally()


def pytest_deselected(items: list[pytest.Item]) -> None:
    _tally.deselected += sum(
        1 for item in items if any(item.get_closest_marker(name) is not None for name in _REQUIRED_MARKERS)
    )


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not any(name in report.keywords for name in _REQUIRED_MARKERS):
        return
    if report.skipped:
        _tally.skipped.append(report.nodeid)
    elif report.when == "call":
        _tally.ran += 1


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(REQUIRE_INTEGRATION) != "1" or session.config.option.collectonly:
        return
    tally = _tally
    if tally.ran == 0:
        tally.problems.append("no integration test ran")
    if tally.skipped:
        shown = ", ".join(tally.skipped[:5]) + (" ..." if len(tally.skipped) > 5 else "")
        tally.problems.append(f"{len(tally.skipped)} integration test(s) skipped: {shown}")
    if tally.deselected:
        tally.problems.append(f"{tally.deselected} integration test(s) deselected")
    if tally.problems and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    tally = _tally
    for problem in tally.problems:
        terminalreporter.write_line(f"{REQUIRE_INTEGRATION}=1: {problem}", red=True, bold=True)


# ------------------------------------------------------------ control plane


def progress_printer(config: pytest.Config) -> Any:
    """Print build/start progress even while pytest captures output (a cold build takes minutes)."""
    capture = config.pluginmanager.getplugin("capturemanager")

    def say(message: str) -> None:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                print(f"[control plane] {message}", flush=True)
        else:  # pragma: no cover
            print(f"[control plane] {message}", flush=True)

    return say


def running_control_plane(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, names: list[str] | None = None
) -> Iterator[Any]:
    """Build what is missing of ``names`` (default: every binary), start etcd + kube-apiserver,
    apply the CRDs; yield the plane and stop it afterwards. A BuildError fails the tests."""
    from gpualloc.devcluster import binaries, cluster

    say = progress_printer(request.config)
    paths = binaries.ensure(names, progress=say)
    plane = cluster.ControlPlane(tmp_path_factory.mktemp("controlplane"), binaries=paths, progress=say)
    plane.start()
    try:
        plane.apply_crds(CRD_DIR)
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A running etcd + kube-apiserver with gpualloc's CRDs applied and Established."""
    yield from running_control_plane(request, tmp_path_factory)


@pytest.fixture(scope="session")
def kubeconfig(control_plane: Any) -> str:
    return str(control_plane.kubeconfig)


def _namespace_name(node_name: str) -> str:
    slug = re.sub(r"[^a-z0-9-]+", "-", node_name.lower()).strip("-")[:40].strip("-")
    return f"t-{slug}-{uuid.uuid4().hex[:6]}" if slug else f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def namespace(control_plane: Any, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace (with its ``default`` ServiceAccount), deleted after the test.

    Without kube-controller-manager a deleted namespace stays Terminating, so the
    test's GpuClaims are deleted first: a controller started by a later test then
    only sees them as being deleted.
    """
    yield from fresh_namespace(control_plane, _namespace_name(request.node.name))


def fresh_namespace(control_plane: Any, name: str) -> Iterator[str]:
    """The body of a fixture that yields the namespace ``name``, created with its ``default``
    ServiceAccount, and deletes it afterwards (its GpuClaims first, see ``namespace``)."""
    control_plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    control_plane.ensure_service_account(name)
    try:
        yield name
    finally:
        for path in (f"/apis/gpu.scheduling/v1/namespaces/{name}/gpuclaims", f"/api/v1/namespaces/{name}"):
            delete_if_present(control_plane, path)


def wait_until(
    what: str,
    check: Callable[[], Any],
    *,
    within: float = 60.0,
    every: float = 0.25,
    logs: Callable[[], str] | None = None,
) -> Any:
    """Call ``check`` every ``every`` seconds until it answers something true, and return that; past
    ``within`` seconds, fail naming ``what``, with ``logs()`` where given. Blocking: for the tests
    that drive helm and programs from the test's thread."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            more = f"; {logs()}" if logs else ""
            raise AssertionError(f"timed out after {within:.0f} s waiting for {what}{more}")
        time.sleep(every)


def completed_requests(
    audit_log: Path, *, resource: str, name: str, namespace: str | None = None, subresource: str | None = None
) -> Iterator[dict[str, Any]]:
    """The API server's audit events (stage ResponseComplete) of the requests on one object:
    ``resource``/``name``, in ``namespace`` and on ``subresource`` where given. A line that is not
    JSON (one being written) is skipped."""
    for line in audit_log.read_text().splitlines():
        if f'"{name}"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        ref = event.get("objectRef") or {}
        if (
            event.get("stage") == "ResponseComplete"
            and ref.get("resource") == resource
            and ref.get("name") == name
            and (namespace is None or ref.get("namespace") == namespace)
            and (subresource is None or ref.get("subresource") == subresource)
        ):
            yield event


def delete_if_present(control_plane: Any, path: str) -> None:
    """DELETE ``path`` as the admin; a 404 (already gone) is not an error."""
    from gpualloc.devcluster import cluster

    try:
        control_plane.request("DELETE", path)
    except cluster.RequestError as exc:
        if exc.status != 404:
            raise


@pytest.fixture
async def api(kubeconfig: str) -> AsyncIterator[Any]:
    """gpualloc's own client (``gpualloc.kube.client.Api``) for the local control plane, closed after
    the test."""
    from gpualloc.kube import client

    api_client = await client.connect(kubeconfig)
    try:
        yield api_client
    finally:
        await api_client.close()


async def generated_client(kubeconfig: str) -> Any:
    """kubernetes_asyncio's generated ``ApiClient`` for ``kubeconfig``, for the tests that meet the
    API server as any other client would (the CRDs, RBAC); the caller closes it."""
    from kubernetes_asyncio import client, config

    cfg = client.Configuration()
    await config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
    return client.ApiClient(configuration=cfg)


# ------------------------------------------------------------ serving a handler


class _Served(BaseTestServer):
    """aiohttp's test server around a ``web.Server`` made by ``serving.server`` (its body limit kept)."""

    def __init__(self, server: web.Server) -> None:
        super().__init__()
        self._server = server

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        return web.ServerRunner(self._server, **kwargs)


@pytest.fixture
def serve(aiohttp_client: Any) -> Callable[..., Awaitable[TestClient[web.BaseRequest, None]]]:
    """``await serve(handler, max_body=...)``: a test client of ``handler`` served as production does."""
    from gpualloc.runtime import serving

    async def client(
        handler: serving.Handler, *, max_body: int = serving.DEFAULT_MAX_BODY
    ) -> TestClient[web.BaseRequest, None]:
        served: TestClient[web.BaseRequest, None] = await aiohttp_client(
            _Served(serving.server(handler, max_body=max_body))
        )
        return served

    return client


# ------------------------------------------------------------ leaked tasks


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Fail a test that leaves asyncio tasks running (after its fixtures are torn down)."""
    before = asyncio.all_tasks()
    yield
    for _ in range(3):  # let tasks that were just cancelled finish
        await asyncio.sleep(0)
    current = asyncio.current_task()
    leaked = [task for task in asyncio.all_tasks() - before if task is not current and not task.done()]
    if not leaked:
        return
    for task in leaked:
        task.cancel()
    await asyncio.gather(*leaked, return_exceptions=True)
    pytest.fail(f"the test left {len(leaked)} asyncio task(s) running: {leaked!r}"[:2000], pytrace=False)
