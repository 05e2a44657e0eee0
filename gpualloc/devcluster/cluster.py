"""The local control plane: etcd and kube-apiserver, plus kube-scheduler,
kube-controller-manager and kwok on demand, as processes on loopback.

Everything lives in one state directory: the PKI, etcd's data, one log file per
process, the API server's audit log, the kubeconfig (client certificate of a
``system:masters`` user) and ``cluster.json`` (ports and process ids, which
``gpualloc dev down`` reads). Each process runs in its own process group;
``stop()`` sends SIGTERM, then SIGKILL after a timeout, and reaps it.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import functools
import http.client
import json
import logging
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from gpualloc.api import constants
from gpualloc.devcluster import binaries as binaries_mod
from gpualloc.devcluster import pki as pki_mod

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_STAGES = binaries_mod.HACK_DIR / "tools" / "kwok" / "stages.yaml"
CRD_DIR = binaries_mod.REPO_ROOT / "helm" / "gpualloc" / "crds"
FIELD_MANAGER = "gpualloc-dev"
STATE_FILE = "cluster.json"

# Controllers that need a cloud provider or node CIDRs, which this cluster has not; and the node
# lifecycle controller: the Nodes here are fake (the tests' have no kubelet at all), and it would
# taint every one it hears no heartbeat from node.kubernetes.io/unreachable after 50 s, which
# kube-scheduler and gpualloc's allocator rightly avoid. (TaintNodesByCondition's not-ready taint
# on a new Node is lifted where the Node is made, as that controller would once it is Ready.)
_DISABLED_CONTROLLERS = (
    "cloud-node-lifecycle-controller",
    "node-route-controller",
    "service-lb-controller",
    "node-ipam-controller",
    "node-lifecycle-controller",
)

_AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    # One event per request (ResponseComplete; long-running requests also log ResponseStarted).
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}

# Taints that TaintNodesByCondition puts on a new Node until the node-lifecycle controller lifts them.
_CONDITION_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})

# Order in which processes are stopped: dependants before what they depend on.
_STOP_ORDER = (
    "webhook",
    "controller",
    "kwok",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
)


class ControlPlaneError(RuntimeError):
    """A process did not start, died, or did not become ready in time."""


class RequestError(ControlPlaneError):
    """The API server answered a request with an error status."""

    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        text = body if isinstance(body, str) else json.dumps(body)
        super().__init__(f"{method} {path}: HTTP {status}: {text[:500]}")
        self.status = status
        self.body = body


def free_ports(count: int) -> list[int]:
    """``count`` different TCP ports on 127.0.0.1 that nothing listens on right now.

    All are held open until the last is chosen: the kernel picks ``bind(0)``
    ports at random, and ports taken one by one, each released before the next
    is picked, can repeat (measured: 0.3% of runs for the demo's nine).
    """
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def process_matches(pid: int, executable: str) -> bool:
    """Whether ``pid`` is alive and still runs ``executable`` (guards against reused pids)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    argv0 = cmdline.split(b"\0", 1)[0].decode(errors="replace")
    return argv0 == executable


def terminate_group(pid: int, *, timeout: float, is_alive: Callable[[], bool]) -> None:
    """SIGTERM the process group ``pid``, then SIGKILL it if still alive after ``timeout``."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not is_alive():
                return
            time.sleep(0.05)


class _Process:
    """One started program: its argv, log file and Popen."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: Mapping[str, str] | None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n==== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log_file.flush()
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        popen = self.popen
        if popen is None:
            return
        if popen.poll() is None:
            terminate_group(popen.pid, timeout=timeout, is_alive=lambda: popen.poll() is None)
        else:
            # The leader is gone; make sure nothing else of its group lingers.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()
        self.popen = None

    def failure(self, what: str) -> ControlPlaneError:
        code = self.popen.poll() if self.popen is not None else None
        last_lines = binaries_mod.tail(self.log_path, 30)
        return ControlPlaneError(
            f"{self.name} {what} (exit status {code}); last lines of {self.log_path}:\n{last_lines}"
        )


Process = _Process


class ControlPlane:
    """A real etcd + kube-apiserver on loopback, and the optional extras.

    ``start()`` brings up etcd and kube-apiserver and writes ``kubeconfig``;
    ``ensure_scheduler()``, ``ensure_controller_manager()`` and ``ensure_kwok()``
    start the others when a caller needs them; ``stop()`` stops all of them.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        binaries: Mapping[str, Path],
        progress: Progress | None = None,
        ready_timeout: float = 90.0,
        real_node: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir).resolve()
        # A real kubelet joins (gpualloc.devcluster.node): the API server reaches it by its
        # InternalIP with the admin's client certificate, and calls webhooks at their pods' IPs.
        self.real_node = real_node
        self.binaries: dict[str, Path] = dict(binaries)
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.audit_log = self.state_dir / "audit.log"
        self.logs_dir = self.state_dir / "logs"
        self.pki = pki_mod.Pki(directory=self.state_dir / "pki")
        self.ports: dict[str, int] = {}
        self.server = ""
        self._progress: Progress = progress or (lambda message: log.info("%s", message))
        self._ready_timeout = ready_timeout
        self._processes: dict[str, _Process] = {}
        self._lock = threading.RLock()
        self._ssl: ssl.SSLContext | None = None
        self._atexit_registered = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start etcd and kube-apiserver, wait for /readyz, write the kubeconfig."""
        with self._lock:
            started = time.monotonic()
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._stop_leftovers()
            pki_mod.ensure(self.pki.directory)
            self._ssl = self._client_context()
            self._choose_ports()
            self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
            self._write_audit_policy()
            self._write_kubeconfig()
            if not self._atexit_registered:
                atexit.register(self.stop)
                self._atexit_registered = True
            try:
                self._start_etcd()
                self._start_apiserver()
            except BaseException:
                self.stop()
                raise
            self._progress(f"kube-apiserver ready at {self.server} in {time.monotonic() - started:.1f} s")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every process this object started (SIGTERM, then SIGKILL), and reap them."""
        with self._lock:
            for name in _STOP_ORDER:
                process = self._processes.pop(name, None)
                if process is not None:
                    process.stop(timeout)
            self._save_state()
            if self._atexit_registered:
                atexit.unregister(self.stop)
                self._atexit_registered = False

    def running(self) -> dict[str, int]:
        """name -> pid of the processes that are alive now."""
        with self._lock:
            return {
                name: process.pid
                for name, process in self._processes.items()
                if process.running() and process.pid is not None
            }

    def check_alive(self) -> None:
        """Raise ControlPlaneError if a process this object started has exited."""
        with self._lock:
            for process in self._processes.values():
                if not process.running():
                    raise process.failure("exited")

    def restart_apiserver(self, *, stop_timeout: float = 10.0) -> None:
        """Stop kube-apiserver and start it again on the same port; wait for /readyz.

        The stop is SIGTERM, then SIGKILL after ``stop_timeout`` seconds: open watches
        keep a terminating API server alive until then.
        """
        with self._lock:
            process = self._processes.pop("kube-apiserver", None)
            if process is not None:
                process.stop(stop_timeout)
            self._start_apiserver()

    # ------------------------------------------------------------------- extras

    def ensure_scheduler(self) -> None:
        """Start kube-scheduler unless it runs; wait for its /healthz."""
        with self._lock:
            if self._is_running("kube-scheduler"):
                return
            port = self._port("scheduler")
            argv = [
                str(self.binaries["kube-scheduler"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
                "--v=1",
            ]
            process = self._spawn("kube-scheduler", argv)
            self._wait_healthz(process, port)

    def ensure_controller_manager(self) -> None:
        """Start kube-controller-manager unless it runs; wait for its /healthz."""
        with self._lock:
            if self._is_running("kube-controller-manager"):
                return
            port = self._port("controller-manager")
            controllers = ",".join(["*", *(f"-{name}" for name in _DISABLED_CONTROLLERS)])
            argv = [
                str(self.binaries["kube-controller-manager"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
                f"--controllers={controllers}",
                "--allocate-node-cidrs=false",
                f"--service-account-private-key-file={self.pki.service_account_key}",
                f"--root-ca-file={self.pki.ca_cert}",
                "--use-service-account-credentials=true",
                f"--cluster-signing-cert-file={self.pki.ca_cert}",
                f"--cluster-signing-key-file={self.pki.ca_key}",
                f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
                "--v=1",
            ]
            process = self._spawn("kube-controller-manager", argv)
            self._wait_healthz(process, port)

    def start_process(self, name: str, argv: list[str]) -> None:
        """Start one of gpualloc's own components (``controller``, ``webhook``) as a process of this
        control plane: recorded in its state file, stopped before the rest by ``stop()`` and by
        ``gpualloc dev down``, checked by ``check_alive()``."""
        if name not in _STOP_ORDER:
            raise ValueError(f"{name} is not a process the control plane knows how to stop")
        with self._lock:
            if self._is_running(name):
                raise ControlPlaneError(f"{name} already runs")
            self._spawn(name, argv)

    def stop_process(self, name: str, timeout: float = 10.0) -> None:
        """Stop a process ``start_process`` started, if it runs."""
        with self._lock:
            process = self._processes.pop(name, None)
            if process is not None:
                process.stop(timeout)
            self._save_state()

    def ensure_kwok(self) -> None:
        """Start kwok, managing Nodes annotated ``kwok.x-k8s.io/node=fake``, unless it runs."""
        with self._lock:
            if self._is_running("kwok"):
                return
            home = self.state_dir / "kwok"  # kwok also reads ~/.kwok/kwok.yaml: keep it ours
            home.mkdir(parents=True, exist_ok=True)
            argv = [
                str(self.binaries["kwok"]),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={KWOK_STAGES}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--manage-nodes-with-label-selector=",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.244.255.254",
                "--node-lease-duration-seconds=40",
            ]
            env = {**os.environ, "HOME": str(home)}
            process = self._spawn("kwok", argv, env=env)
            time.sleep(0.2)
            if not process.running():
                raise process.failure("exited at start")

    def add_kwok_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        *,
        cpu: str = "64",
        memory: str = "512Gi",
        pods: str = "110",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        """Create a fake Node that kwok manages and wait until it is Ready; returns the Node."""
        self.ensure_kwok()
        resources = {"cpu": cpu, "memory": memory, "pods": pods}
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    constants.HOSTNAME_LABEL: name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **dict(labels or {}),
                },
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {},
            "status": {"allocatable": resources, "capacity": resources},
        }
        try:
            self.request("POST", "/api/v1/nodes", body)
        except RequestError as exc:
            if exc.status != 409:
                raise
        return self.wait_node_ready(name, timeout=timeout, hint="is kwok running?")

    def wait_node_ready(
        self, name: str, *, timeout: float, hint: str = "", alive: Callable[[], None] | None = None
    ) -> dict[str, Any]:
        """Wait until Node ``name`` is Ready, lift the condition taints a new Node carries (as the
        node-lifecycle controller would, which this cluster runs without); returns the Node.
        ``alive`` (default: check_alive) raises when what should make it Ready has died."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                node: dict[str, Any] = self.request("GET", f"/api/v1/nodes/{name}")
            except RequestError as exc:
                if exc.status != 404:  # a kubelet registers its Node a moment after it starts
                    raise
                node = {}
            conditions = node.get("status", {}).get("conditions") or []
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
            taints = node.get("spec", {}).get("taints") or []
            kept = [t for t in taints if t.get("key") not in _CONDITION_TAINTS]
            if ready and kept == taints:
                return node
            if ready:
                # The node-lifecycle controller lifts these once the node is Ready; without
                # kube-controller-manager nothing would, and no pod could be scheduled there.
                try:
                    patched: dict[str, Any] = self.request(
                        "PATCH",
                        f"/api/v1/nodes/{name}",
                        {
                            "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                            "spec": {"taints": kept},
                        },
                        content_type="application/merge-patch+json",
                    )
                except RequestError as exc:
                    if exc.status != 409:  # kwok wrote the node meanwhile: read it again
                        raise
                    continue
                return patched
            if time.monotonic() > deadline:
                detail = f" ({hint})" if hint else ""
                raise ControlPlaneError(f"node {name} not Ready after {timeout:.0f} s{detail}")
            (alive or self.check_alive)()
            time.sleep(0.1)

    # --------------------------------------------------------------------- CRDs

    def apply_crds(self, directory: Path = CRD_DIR, *, timeout: float = 30.0) -> list[str]:
        """Server-side apply every CustomResourceDefinition in ``directory``; wait for Established."""
        names: list[str] = []
        served: list[str] = []
        for path in sorted(directory.glob("*.yaml")):
            for document in yaml.safe_load_all(path.read_text()):
                if not document or document.get("kind") != "CustomResourceDefinition":
                    continue
                name = document["metadata"]["name"]
                self.request(
                    "PATCH",
                    f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
                    f"?fieldManager={FIELD_MANAGER}&force=true",
                    document,
                    content_type="application/apply-patch+yaml",
                )
                names.append(name)
                spec = document["spec"]
                scope = "" if spec["scope"] == "Cluster" else "/namespaces/default"
                served.append(
                    f"/apis/{spec['group']}/{spec['versions'][0]['name']}{scope}/{spec['names']['plural']}"
                )
        if not names:
            raise ControlPlaneError(f"no CustomResourceDefinition found in {directory}")
        deadline = time.monotonic() + timeout
        for name in names:
            while not self._crd_established(name):
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"CRD {name} not Established after {timeout:.0f} s")
                time.sleep(0.05)
        # Established is not yet serving: the first calls can still get 429 "storage is
        # (re)initializing" or 404. Wait until each resource answers a list.
        for resource in served:
            while not self._serves(resource):
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"{resource} not served {timeout:.0f} s after applying the CRDs")
                time.sleep(0.05)
        return names

    def _serves(self, path: str) -> bool:
        try:
            self.request("GET", path + "?limit=1")
        except RequestError as exc:
            if exc.status in (404, 429, 503):
                return False
            raise
        return True

    def _crd_established(self, name: str) -> bool:
        crd = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        conditions = {c["type"]: c["status"] for c in crd.get("status", {}).get("conditions") or []}
        return conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True"

    # -------------------------------------------------------------------- HTTP

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        accept: str = "application/json",
        timeout: float = 30.0,
    ) -> Any:
        """One call to the API server as the admin user; returns the decoded JSON body."""
        status, payload = self._raw_request(method, path, body, content_type, accept, timeout)
        if status >= 400:
            raise RequestError(method, path, status, payload)
        return payload

    def ensure_service_account(self, namespace: str, name: str = "default") -> None:
        """Create the ServiceAccount unless it exists. The API server refuses pods in a namespace
        until its ``default`` one exists, and kube-controller-manager (if it runs) makes it later."""
        try:
            self.request(
                "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name}}
            )
        except RequestError as exc:
            if exc.status != 409:  # 409: it exists already
                raise

    def version(self) -> dict[str, Any]:
        """The API server's /version."""
        result: dict[str, Any] = self.request("GET", "/version")
        return result

    def _raw_request(
        self, method: str, path: str, body: Any, content_type: str, accept: str, timeout: float
    ) -> tuple[int, Any]:
        if self._ssl is None:
            raise ControlPlaneError("the control plane has not been started")
        connection = http.client.HTTPSConnection(
            "127.0.0.1", self.ports["apiserver"], context=self._ssl, timeout=timeout
        )
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Accept": accept, "User-Agent": "gpualloc-devcluster"}
            if data is not None:
                headers["Content-Type"] = content_type
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, raw.decode(errors="replace")

    def _client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        context.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return context

    # ---------------------------------------------------------------- internals

    def _is_running(self, name: str) -> bool:
        process = self._processes.get(name)
        if process is None:
            return False
        if process.running():
            return True
        process.stop()
        del self._processes[name]
        return False

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> _Process:
        process = _Process(name, argv, self.logs_dir / f"{name}.log", env)
        process.start()
        self._processes[name] = process
        self._save_state()
        return process

    def _port(self, role: str) -> int:
        if role not in self.ports or not _port_is_free(self.ports[role]):
            self.ports[role] = free_port()
            self._save_state()
        return self.ports[role]

    def _choose_ports(self) -> None:
        previous = self._load_state().get("ports", {})
        roles = ("etcd-client", "etcd-peer", "apiserver")
        spare = [p for p in free_ports(len(roles)) if p not in previous.values()]
        for role in roles:
            port = previous.get(role)
            self.ports[role] = port if isinstance(port, int) and _port_is_free(port) else spare.pop()

    def _start_etcd(self) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd-client']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        argv = [
            str(self.binaries["etcd"]),
            "--name=default",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync=true",  # a throwaway cluster: speed over durability
            "--log-level=warn",
        ]
        process = self._spawn("etcd", argv)

        def healthy() -> str | None:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.ports["etcd-client"], timeout=2)
                try:
                    connection.request("GET", "/health")
                    response = connection.getresponse()
                    if response.status == 200 and json.loads(response.read()).get("health") == "true":
                        return None
                finally:
                    connection.close()
            except (OSError, ValueError, http.client.HTTPException):
                pass
            return ""

        self._wait_until(process, healthy, what="not healthy", interval=0.05)

    def _apiserver_argv(self) -> list[str]:
        p = self.pki
        admission = "MutatingAdmissionWebhook,ValidatingAdmissionWebhook,ValidatingAdmissionPolicy"
        return [
            str(self.binaries["kube-apiserver"]),
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd-client']}",
            "--advertise-address=127.0.0.1",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports['apiserver']}",
            f"--cert-dir={self.state_dir / 'apiserver'}",
            f"--tls-cert-file={p.serving_cert}",
            f"--tls-private-key-file={p.serving_key}",
            f"--client-ca-file={p.ca_cert}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-key-file={p.service_account_public_key}",
            f"--service-account-signing-key-file={p.service_account_key}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            f"--enable-admission-plugins={admission}",
            f"--audit-policy-file={self.state_dir / 'audit-policy.yaml'}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            "--audit-log-maxsize=200",
            "--audit-log-maxbackup=1",
            "--endpoint-reconciler-type=none",  # 127.0.0.1 is not a valid Endpoints address
            "--allow-privileged=true",
            "--profiling=false",
            "--v=1",
            *(self._real_node_flags() if self.real_node else []),
        ]

    def _real_node_flags(self) -> list[str]:
        return [
            # `kubectl logs` and `exec` reach the kubelet at the node's InternalIP (no DNS here).
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={self.pki.admin_cert}",
            f"--kubelet-client-key={self.pki.admin_key}",
            # No kube-proxy: a webhook or aggregated API behind a Service is called at its endpoints.
            "--enable-aggregator-routing=true",
        ]

    def _start_apiserver(self) -> None:
        process = self._spawn("kube-apiserver", self._apiserver_argv())

        def ready() -> str | None:
            try:
                status, payload = self._raw_request("GET", "/readyz", None, "", "text/plain", 5.0)
            except (OSError, http.client.HTTPException) as exc:
                return f"last /readyz: {exc}"
            return None if status == 200 else f"last /readyz: HTTP {status}: {str(payload)[-300:]}"

        self._wait_until(process, ready, what="not ready", interval=0.1)

    def _wait_healthz(self, process: _Process, port: int) -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # the component's self-signed serving certificate

        def healthy() -> str | None:
            try:
                connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=2)
                try:
                    connection.request("GET", "/healthz")
                    if connection.getresponse().status == 200:
                        return None
                finally:
                    connection.close()
            except (OSError, http.client.HTTPException):
                pass
            return ""

        self._wait_until(process, healthy, what="not healthy", interval=0.1)

    def _wait_until(
        self, process: _Process, probe: Callable[[], str | None], *, what: str, interval: float
    ) -> None:
        """Poll ``probe`` (None: up; else what it last saw) until the process is up; raise if it
        exits first or is still not up after the ready timeout."""
        deadline = time.monotonic() + self._ready_timeout
        while True:
            last = probe()
            if last is None:
                return
            if not process.running():
                raise process.failure("exited at start")
            if time.monotonic() > deadline:
                detail = f" ({last})" if last else ""
                raise process.failure(f"{what} after {self._ready_timeout:.0f} s{detail}")
            time.sleep(interval)

    def _write_audit_policy(self) -> None:
        (self.state_dir / "audit-policy.yaml").write_text(yaml.safe_dump(_AUDIT_POLICY, sort_keys=False))

    def _write_kubeconfig(self) -> None:
        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "gpualloc-dev",
                    "cluster": {"server": self.server, "certificate-authority-data": b64(self.pki.ca_cert)},
                }
            ],
            "users": [
                {
                    "name": pki_mod.ADMIN_USER,
                    "user": {
                        "client-certificate-data": b64(self.pki.admin_cert),
                        "client-key-data": b64(self.pki.admin_key),
                    },
                }
            ],
            "contexts": [
                {"name": "gpualloc-dev", "context": {"cluster": "gpualloc-dev", "user": pki_mod.ADMIN_USER}}
            ],
            "current-context": "gpualloc-dev",
        }
        temporary = self.kubeconfig.with_name("kubeconfig.tmp")
        temporary.write_text(yaml.safe_dump(config, sort_keys=False))
        temporary.chmod(0o600)
        temporary.replace(self.kubeconfig)

    # ------------------------------------------------------------ state file

    def _load_state(self) -> dict[str, Any]:
        return load_state(self.state_dir)

    def _save_state(self) -> None:
        state = {
            "owner": os.getpid(),
            "server": self.server,
            "ports": self.ports,
            "processes": {
                name: {"pid": process.pid, "executable": process.argv[0]}
                for name, process in self._processes.items()
                if process.pid is not None
            },
        }
        if not self.state_dir.exists():
            return
        path = self.state_dir / STATE_FILE
        temporary = path.with_name(STATE_FILE + ".tmp")
        temporary.write_text(json.dumps(state, indent=2) + "\n")
        temporary.replace(path)

    def _stop_leftovers(self) -> None:
        """Refuse a state directory another live process uses; stop what a killed run left behind."""
        state = self._load_state()
        owner = state.get("owner")
        if isinstance(owner, int) and owner != os.getpid() and alive(owner) and recorded_alive(state):
            raise ControlPlaneError(
                f"{self.state_dir} is in use by process {owner}; "
                "stop it first (gpualloc dev down --state-dir ...)"
            )
        stopped = stop_recorded(state, exclude=set(self.running().values()))
        for name in stopped:
            self._progress(f"stopped {name} left over from an earlier run in {self.state_dir}")


def load_state(state_dir: Path) -> dict[str, Any]:
    """The contents of ``cluster.json`` in ``state_dir`` ({} if there is none)."""
    try:
        data = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _recorded(state: Mapping[str, Any]) -> Iterator[tuple[str, int, str]]:
    """(name, pid, executable) of each well-formed process entry in a cluster.json."""
    for name, entry in (state.get("processes") or {}).items():
        if isinstance(entry, dict):
            pid, executable = entry.get("pid"), entry.get("executable")
            if isinstance(pid, int) and isinstance(executable, str):
                yield name, pid, executable


def recorded_alive(state: Mapping[str, Any]) -> dict[str, int]:
    """name -> pid of the processes recorded in a cluster.json that still run."""
    return {name: pid for name, pid, executable in _recorded(state) if process_matches(pid, executable)}


def stop_recorded(
    state: Mapping[str, Any], *, exclude: Iterable[int] = (), timeout: float = 10.0
) -> list[str]:
    """Stop the processes recorded in a cluster.json (``load_state``'s result) that still run; their names."""
    excluded = set(exclude)
    recorded = {name: (pid, executable) for name, pid, executable in _recorded(state)}
    stopped: list[str] = []
    for name in _STOP_ORDER:
        if name not in recorded:
            continue
        pid, executable = recorded[name]
        if pid in excluded or not process_matches(pid, executable):
            continue
        terminate_group(pid, timeout=timeout, is_alive=functools.partial(alive, pid))
        stopped.append(name)
    return stopped


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped by its parent) counts as gone.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"
