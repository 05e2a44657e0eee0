"""The agent as gpualloc's DRA kubelet plugin (``--kubelet-plugin``).

Two gRPC services on unix sockets, served by grpcio in its own threads:

* plugin registration (``pluginregistration.Registration``, k8s.io/kubelet's pluginregistration
  v1) on ``<kubelet root>/plugins_registry/gpu.gpualloc.dev-reg.sock``, which the kubelet finds by
  watching that directory: ``GetInfo`` says this is the DRA driver ``gpu.gpualloc.dev``, serving
  ``v1.DRAPlugin`` at the DRA socket; ``NotifyRegistrationStatus`` is logged;
* DRA (``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``) on
  ``<kubelet root>/plugins/gpu.gpualloc.dev/dra.sock``: ``NodePrepareResources`` reads each claim
  (namespace, name) from the API server, checks its uid and answers the CDI device IDs of the
  devices its allocation gives this node (``agent.dra.prepare``); ``NodeUnprepareResources`` has
  nothing to undo (nothing is set up on the node per claim) and answers each claim;
* DRA resource health (``v1alpha1.DRAResourceHealth``, on the DRA socket too): the kubelet keeps
  ``NodeWatchResources`` open, and is sent every device's health (each GPU, MIG instance and slot,
  as its GPU is) when it changes and every ``HEALTH_RESEND`` seconds (the kubelet takes a device
  it has not heard of for ``HEALTH_TIMEOUT`` as Unknown).

A failure is told per claim in the answer; nothing raised in a handler ends the agent. The
handlers run in grpcio's threads and hand the API calls to the agent's event loop.

In ``--cdi-mode gpualloc`` the plugin also writes the node's CDI spec (``gpualloc.cdi``) into
``--cdi-dir`` whenever the GPUs change; in ``--cdi-mode nvidia`` NVIDIA's own spec
(``nvidia-ctk cdi generate``) is used and nothing is written.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from agent import dra
from agent.kubeletapi import dra_v1_pb2 as drapb
from agent.kubeletapi import drahealth_v1alpha1_pb2 as healthpb
from agent.kubeletapi import pluginregistration_v1_pb2 as regpb
from gpualloc import cdi
from gpualloc.api import constants
from gpualloc.kube import errors, transport

log = logging.getLogger(__name__)

REGISTRATION_SERVICE = "pluginregistration.Registration"
DRA_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
HEALTH_RESEND = 20.0  # seconds between two health messages when nothing changes
HEALTH_TIMEOUT = 60  # seconds the kubelet waits for news of a device before it is Unknown
DRA_SUPPORTED_VERSION = "v1.DRAPlugin"  # k8s.io/kubelet/pkg/apis/dra/v1.DRAPluginService
PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1.DRAPlugin
CALL_TIMEOUT = 30.0  # seconds a handler waits for the API server's answers

ReadClaim = Callable[[str, str], Awaitable[Mapping[str, Any]]]


def registration_socket(kubelet_root: str) -> Path:
    return Path(kubelet_root) / "plugins_registry" / f"{constants.DRA_DRIVER}-reg.sock"


def dra_socket(kubelet_root: str) -> Path:
    return Path(kubelet_root) / "plugins" / constants.DRA_DRIVER / "dra.sock"


UNIX_PATH_MAX = 107  # bytes of a unix socket's path (sun_path, less its terminating NUL)


def socket_problem(kubelet_root: str) -> str:
    """Why the plugin's sockets cannot be made under ``kubelet_root`` ("" when they can)."""
    for path in (registration_socket(kubelet_root), dra_socket(kubelet_root)):
        size = len(str(path).encode())
        if size > UNIX_PATH_MAX:
            return f"the socket path {path} is {size} bytes; a unix socket's path is at most {UNIX_PATH_MAX}"
    return ""


def claim_reader(api: Any) -> ReadClaim:
    """Reads a ResourceClaim (resource.k8s.io/v1) with the agent's API client."""

    async def read(namespace: str, name: str) -> Mapping[str, Any]:
        path = transport.collection_path("resource.k8s.io", "v1", "resourceclaims", namespace, name)
        found = await transport.request(api, "GET", path)
        return found if isinstance(found, dict) else {}

    return read


def present_control_devices(device_dir: str) -> tuple[str, ...]:
    """The control devices (``cdi.CONTROL_DEVICES``) there are files for; ``nvidiactl`` at least."""
    found = tuple(name for name in cdi.CONTROL_DEVICES if os.path.exists(os.path.join(device_dir, name)))
    return found or (cdi.CONTROL_DEVICE,)


def write_spec(cdi_dir: str, gpus: Sequence[cdi.Gpu], device_dir: str) -> tuple[Path, bool]:
    """Write the node's CDI spec unless the file already holds it: a hidden temporary file in the
    same directory, then a rename (the runtime's CDI cache sees one Create of a whole spec). Its
    path, and whether it was written."""
    host_dir = None if os.path.normpath(device_dir) == "/dev" else device_dir
    spec = cdi.build_spec(gpus, host_dir, present_control_devices(device_dir))
    text = json.dumps(spec, indent=2) + "\n"
    path = Path(cdi_dir) / cdi.SPEC_NAME
    with contextlib.suppress(OSError, ValueError):
        if path.read_text() == text:
            return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{cdi.SPEC_NAME}.tmp")
    temporary.write_text(text)
    temporary.replace(path)
    return path, True


def _unary(
    fn: Callable[[Any, grpc.ServicerContext], Any], request: Any, response: Any
) -> grpc.RpcMethodHandler[Any, Any]:
    return grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=request.FromString, response_serializer=response.SerializeToString
    )


class KubeletPlugin:
    """The registration and DRA services of one node; ``update`` gives it the node's GPUs."""

    def __init__(
        self,
        *,
        node: str,
        kubelet_root: str,
        read_claim: ReadClaim,
        loop: asyncio.AbstractEventLoop,
        mode: str = "gpualloc",
        cdi_dir: str = cdi.SPEC_DIR,
        device_dir: str = "/dev",
    ) -> None:
        self.node = node
        self.kubelet_root = kubelet_root
        self.mode = mode
        self.cdi_dir = cdi_dir
        self.device_dir = device_dir
        self.registered: bool | None = None  # as the kubelet last said; None before it said
        self.registration_error = ""
        self._read_claim = read_claim
        self._loop = loop
        self._gpus: tuple[cdi.Gpu, ...] | None = None
        self._index: dict[str, str] = {}
        self._servers: list[grpc.Server] = []
        self._health: dict[str, tuple[bool, str]] = {}  # DRA device name -> (healthy, reason)
        self._health_version = 0
        self._stopping = False
        self._changed = threading.Condition()  # guards the three above; wakes the health streams
        self._spec_lock = threading.Lock()  # one writer of the CDI spec's temporary file at a time

    @property
    def registration_path(self) -> Path:
        return registration_socket(self.kubelet_root)

    @property
    def dra_path(self) -> Path:
        return dra_socket(self.kubelet_root)

    # -- the node's devices ---------------------------------------------------

    def update(self, gpus: Sequence[cdi.Gpu]) -> None:
        """The node's GPUs now: the device index, and the CDI spec in ``gpualloc`` mode. Called
        after every scan: the spec is checked on disk each time and written again when it is
        missing or not ours (removed, replaced, or an earlier write failed), not only when the
        GPUs change."""
        current = tuple(sorted(gpus, key=lambda g: g.minor))
        changed = current != self._gpus
        if changed:
            self._gpus = current
            self._index = dra.device_index(current, self.mode)
        if self.mode != "gpualloc":
            return
        if not self.ensure_spec() or not changed:
            return
        blind = [f"gpu-{g.minor}/{m.uuid}" for g in current for m in g.migs if m.caps is None]
        if blind:
            log.warning(
                "MIG instances without their nvidia-caps nodes in the CDI spec (their capability "
                "minors could not be read): a container given one cannot use it",
                extra={"node": self.node, "instances": ",".join(blind)},
            )

    def ensure_spec(self) -> bool:
        """The CDI spec of the GPUs last given is on disk (``gpualloc`` mode; written when missing or
        different); False, logged, when it cannot be written."""
        if self.mode != "gpualloc" or self._gpus is None:
            return True
        with self._spec_lock:  # the scan loop and NodePrepareResources' threads
            try:
                path, written = write_spec(self.cdi_dir, self._gpus, self.device_dir)
            except OSError as exc:
                log.error("cannot write the CDI spec", extra={"node": self.node, "error": str(exc)})
                return False
        if written:
            extra = {"node": self.node, "path": str(path), "gpus": len(self._gpus)}
            log.info("CDI spec written", extra=extra)
        return True

    def set_health(self, devices: Mapping[str, tuple[bool, str]]) -> None:
        """Every device's health now (``dra.health``); the health streams are told when it changed."""
        with self._changed:
            if dict(devices) == self._health:
                return
            self._health = dict(devices)
            self._health_version += 1
            self._changed.notify_all()

    # -- gRPC handlers (grpcio's threads) --------------------------------------

    def get_info(self, request: regpb.InfoRequest, context: grpc.ServicerContext) -> regpb.PluginInfo:
        return regpb.PluginInfo(
            type=PLUGIN_TYPE,
            name=constants.DRA_DRIVER,
            endpoint=str(self.dra_path),
            supported_versions=[DRA_SUPPORTED_VERSION],
        )

    def notify_registration_status(
        self, request: regpb.RegistrationStatus, context: grpc.ServicerContext
    ) -> regpb.RegistrationStatusResponse:
        self.registered, self.registration_error = request.plugin_registered, request.error
        if request.plugin_registered:
            log.info("registered with the kubelet", extra={"node": self.node, "driver": constants.DRA_DRIVER})
        else:
            log.error("the kubelet refused the plugin", extra={"node": self.node, "error": request.error})
        return regpb.RegistrationStatusResponse()

    def node_prepare_resources(
        self, request: drapb.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> drapb.NodePrepareResourcesResponse:
        claims = list(request.claims)
        if not self.ensure_spec():  # the runtime resolves the IDs answered from this file
            path = Path(self.cdi_dir) / cdi.SPEC_NAME
            response = drapb.NodePrepareResourcesResponse()
            for claim in claims:
                response.claims[claim.uid].error = f"the node's CDI spec {path} cannot be written"
            return response
        future = asyncio.run_coroutine_threadsafe(self.prepare_all(claims), self._loop)
        try:
            answers = future.result(CALL_TIMEOUT)
        except (concurrent.futures.TimeoutError, TimeoutError):
            future.cancel()
            answers = {c.uid: dra.Prepared(error="timed out reading the ResourceClaim") for c in claims}
        response = drapb.NodePrepareResourcesResponse()
        for uid, prepared in answers.items():
            entry = response.claims[uid]
            entry.error = prepared.error
            for device in prepared.devices:
                entry.devices.add(
                    request_names=[device.request] if device.request else [],
                    pool_name=device.pool,
                    device_name=device.device,
                    cdi_device_ids=list(device.cdi_ids),
                )
        return response

    def node_unprepare_resources(
        self, request: drapb.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> drapb.NodeUnprepareResourcesResponse:
        response = drapb.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            response.claims[claim.uid].CopyFrom(drapb.NodeUnprepareResourceResponse())
        log.info("claims unprepared", extra={"node": self.node, "claims": len(request.claims)})
        return response

    def node_watch_resources(
        self, request: healthpb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[healthpb.NodeWatchResourcesResponse]:
        version = -1
        while context.is_active():
            with self._changed:
                self._changed.wait_for(functools.partial(self._news, version), timeout=HEALTH_RESEND)
                if self._stopping:
                    return
                version, current = self._health_version, dict(self._health)
            yield self.health_message(current)

    def _news(self, version: int) -> bool:
        return self._stopping or self._health_version != version

    def health_message(self, devices: Mapping[str, tuple[bool, str]]) -> healthpb.NodeWatchResourcesResponse:
        now = int(time.time())
        response = healthpb.NodeWatchResourcesResponse()
        for name, (healthy, reason) in sorted(devices.items()):
            response.devices.add(
                device=healthpb.DeviceIdentifier(pool_name=self.node, device_name=name),
                health=healthpb.HEALTHY if healthy else healthpb.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=HEALTH_TIMEOUT,
                message=reason[:1024],
            )
        return response

    # -- the answers (the agent's event loop) ----------------------------------

    async def prepare_all(self, claims: Sequence[drapb.Claim]) -> dict[str, dra.Prepared]:
        answers = await asyncio.gather(*(self.prepare_one(c.namespace, c.name, c.uid) for c in claims))
        return {c.uid: answer for c, answer in zip(claims, answers, strict=True)}

    async def prepare_one(self, namespace: str, name: str, uid: str) -> dra.Prepared:
        try:
            claim = await self._read_claim(namespace, name)
            prepared = dra.prepare(claim, uid, self.node, self._index)
        except errors.KubeError as exc:
            prepared = dra.Prepared(error=f"cannot read ResourceClaim {namespace}/{name}: {exc}")
        except Exception as exc:  # an answer per claim, whatever happens
            log.exception("preparing a claim failed", extra={"claim": f"{namespace}/{name}"})
            prepared = dra.Prepared(error=f"preparing ResourceClaim {namespace}/{name} failed: {exc!r}")
        extra = {"node": self.node, "claim": f"{namespace}/{name}", "uid": uid}
        if prepared.error:
            log.warning("claim not prepared", extra={**extra, "error": prepared.error})
        else:
            ids = ",".join(i for d in prepared.devices for i in d.cdi_ids)
            log.info("claim prepared", extra={**extra, "cdiDevices": ids})
        return prepared

    # -- serving --------------------------------------------------------------

    def _serve(self, path: Path, *handlers: grpc.GenericRpcHandler) -> grpc.Server:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a socket left by an earlier run
        # The kubelet holds one health stream (a worker) open on the DRA socket; the rest answer calls.
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=6))
        server.add_generic_rpc_handlers(handlers)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        self._servers.append(server)
        return server

    def start(self) -> None:
        """Serve DRA, then registration (the kubelet calls the DRA socket as soon as it registers)."""
        dra_handler = grpc.method_handlers_generic_handler(
            DRA_SERVICE,
            {
                "NodePrepareResources": _unary(
                    self.node_prepare_resources,
                    drapb.NodePrepareResourcesRequest,
                    drapb.NodePrepareResourcesResponse,
                ),
                "NodeUnprepareResources": _unary(
                    self.node_unprepare_resources,
                    drapb.NodeUnprepareResourcesRequest,
                    drapb.NodeUnprepareResourcesResponse,
                ),
            },
        )
        registration = grpc.method_handlers_generic_handler(
            REGISTRATION_SERVICE,
            {
                "GetInfo": _unary(self.get_info, regpb.InfoRequest, regpb.PluginInfo),
                "NotifyRegistrationStatus": _unary(
                    self.notify_registration_status,
                    regpb.RegistrationStatus,
                    regpb.RegistrationStatusResponse,
                ),
            },
        )
        health = grpc.method_handlers_generic_handler(
            HEALTH_SERVICE,
            {
                "NodeWatchResources": grpc.unary_stream_rpc_method_handler(
                    self.node_watch_resources,
                    request_deserializer=healthpb.NodeWatchResourcesRequest.FromString,
                    response_serializer=healthpb.NodeWatchResourcesResponse.SerializeToString,
                )
            },
        )
        self._serve(self.dra_path, dra_handler, health)
        self._serve(self.registration_path, registration)
        log.info(
            "kubelet plugin serving",
            extra={"node": self.node, "registration": str(self.registration_path), "dra": str(self.dra_path)},
        )

    def stop(self, grace: float = 2.0) -> None:
        """Stop serving and remove the sockets (the kubelet then forgets the plugin)."""
        with self._changed:
            self._stopping = True  # ends the health streams
            self._changed.notify_all()
        for server in reversed(self._servers):
            server.stop(grace).wait(grace + 1.0)
        self._servers.clear()
        for path in (self.registration_path, self.dra_path):
            path.unlink(missing_ok=True)
