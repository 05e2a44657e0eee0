"""agent.kubelet_plugin: the kubelet's registration and DRA services, called as the kubelet calls
them (a grpc client over the plugin's real unix sockets), and the CDI spec it writes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent import kubelet_plugin
from agent.kubeletapi import dra_v1_pb2 as drapb
from agent.kubeletapi import drahealth_v1alpha1_pb2 as healthpb
from agent.kubeletapi import pluginregistration_v1_pb2 as regpb
from gpualloc import cdi
from gpualloc.api import constants
from gpualloc.kube import errors

NODE = "gpu-node-1"
GPU = "GPU-AAAA1111-0000-0000-0000-000000000001"


def allocated(name: str, uid: str, lock_id: str) -> dict[str, Any]:
    device = {"request": "gpus", "driver": constants.DRA_DRIVER, "pool": NODE, "device": lock_id.lower()}
    return {
        "metadata": {"namespace": "team", "name": name, "uid": uid},
        "status": {"allocation": {"devices": {"results": [device]}}},
    }


class Claims:
    """What the plugin reads instead of the API server (the integration test reads the real one)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.broken: set[str] = set()

    async def read(self, namespace: str, name: str) -> Mapping[str, Any]:
        if name in self.broken:
            raise RuntimeError("the reader broke")
        try:
            return self.objects[(namespace, name)]
        except KeyError:
            raise errors.NotFound(message=f"resourceclaims {name!r} not found") from None


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kp", dir="/tmp"))  # a unix socket's path fits 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def plugin(root: Path) -> AsyncIterator[tuple[kubelet_plugin.KubeletPlugin, Claims]]:
    claims = Claims()
    served = kubelet_plugin.KubeletPlugin(
        node=NODE,
        kubelet_root=str(root),
        read_claim=claims.read,
        loop=asyncio.get_running_loop(),
        cdi_dir=str(root / "cdi"),
        device_dir=str(root / "dev"),
    )
    served.update([cdi.Gpu(minor=0, uuid=GPU)])
    await asyncio.to_thread(served.start)
    yield served, claims
    await asyncio.to_thread(served.stop)


def call(socket: Path, service: str, method: str, request: Any, response: Any) -> Any:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = channel.unary_unary(
            f"/{service}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response.FromString,
        )
        return stub(request, timeout=10)


async def prepare(served: kubelet_plugin.KubeletPlugin, *claims: drapb.Claim) -> Any:
    request = drapb.NodePrepareResourcesRequest(claims=list(claims))
    return await asyncio.to_thread(
        call,
        served.dra_path,
        kubelet_plugin.DRA_SERVICE,
        "NodePrepareResources",
        request,
        drapb.NodePrepareResourcesResponse,
    )


async def test_get_info_tells_the_kubelet_a_dra_plugin_of_gpu_gpualloc_dev_serving_v1_at_its_dra_socket(
    plugin: tuple[kubelet_plugin.KubeletPlugin, Claims], root: Path
) -> None:
    served, _ = plugin
    socket = root / "plugins_registry" / "gpu.gpualloc.dev-reg.sock"
    assert stat.S_ISSOCK(os.stat(socket).st_mode)

    info = await asyncio.to_thread(
        call, socket, "pluginregistration.Registration", "GetInfo", regpb.InfoRequest(), regpb.PluginInfo
    )

    assert (info.type, info.name) == ("DRAPlugin", "gpu.gpualloc.dev")
    assert info.endpoint == str(root / "plugins" / "gpu.gpualloc.dev" / "dra.sock")
    assert list(info.supported_versions) == ["v1.DRAPlugin"]
    status = regpb.RegistrationStatus(plugin_registered=False, error="no")
    await asyncio.to_thread(
        call, socket, kubelet_plugin.REGISTRATION_SERVICE, "NotifyRegistrationStatus", status,
        regpb.RegistrationStatusResponse,
    )  # fmt: skip
    assert (served.registered, served.registration_error) == (False, "no")


async def test_prepare_answers_each_claim_its_cdi_devices_or_its_own_error(
    plugin: tuple[kubelet_plugin.KubeletPlugin, Claims],
) -> None:
    served, claims = plugin
    claims.objects[("team", "good")] = allocated("good", "uid-good", GPU)
    claims.objects[("team", "stale")] = allocated("stale", "uid-new", GPU)
    claims.broken.add("broken")

    answer = await prepare(
        served,
        drapb.Claim(namespace="team", name="good", uid="uid-good"),
        drapb.Claim(namespace="team", name="stale", uid="uid-old"),
        drapb.Claim(namespace="team", name="missing", uid="uid-missing"),
        drapb.Claim(namespace="team", name="broken", uid="uid-broken"),
    )

    assert sorted(answer.claims) == ["uid-broken", "uid-good", "uid-missing", "uid-old"]
    good = answer.claims["uid-good"]
    assert good.error == ""
    assert [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in good.devices
    ] == [(["gpus"], NODE, GPU.lower(), [f"gpualloc.dev/gpu={GPU}"])]
    assert "not 'uid-old'" in answer.claims["uid-old"].error
    assert "cannot read ResourceClaim team/missing: 404 NotFound" in answer.claims["uid-missing"].error
    assert "the reader broke" in answer.claims["uid-broken"].error
    assert all(not answer.claims[uid].devices for uid in ("uid-old", "uid-missing", "uid-broken"))
    again = await prepare(served, drapb.Claim(namespace="team", name="good", uid="uid-good"))
    assert list(again.claims["uid-good"].devices[0].cdi_device_ids) == [f"gpualloc.dev/gpu={GPU}"]


async def test_a_spec_removed_or_replaced_is_written_again_by_the_next_scan_and_before_a_prepare(
    plugin: tuple[kubelet_plugin.KubeletPlugin, Claims], root: Path
) -> None:
    served, claims = plugin
    spec = root / "cdi" / cdi.SPEC_NAME
    ours = spec.read_text()

    spec.unlink()
    served.update([cdi.Gpu(minor=0, uuid=GPU)])  # the same GPUs: a scan
    assert spec.read_text() == ours
    spec.write_text('{"kind": "gpualloc.dev/gpu", "devices": []}')  # another writer's
    served.update([cdi.Gpu(minor=0, uuid=GPU)])
    assert spec.read_text() == ours

    spec.unlink()
    claims.objects[("team", "good")] = allocated("good", "uid-good", GPU)
    answer = await prepare(served, drapb.Claim(namespace="team", name="good", uid="uid-good"))
    assert answer.claims["uid-good"].error == ""
    assert spec.read_text() == ours  # on disk before the runtime resolves the IDs answered


async def test_a_spec_that_cannot_be_written_fails_each_claims_prepare_so_the_kubelet_retries(
    plugin: tuple[kubelet_plugin.KubeletPlugin, Claims], root: Path
) -> None:
    served, claims = plugin
    claims.objects[("team", "good")] = allocated("good", "uid-good", GPU)
    shutil.rmtree(root / "cdi")
    (root / "cdi").write_text("a file where the spec directory should be")

    answer = await prepare(served, drapb.Claim(namespace="team", name="good", uid="uid-good"))

    refused = answer.claims["uid-good"]
    assert "CDI spec" in refused.error and "cannot be written" in refused.error
    assert not refused.devices


async def test_unprepare_answers_every_claim_without_error(
    plugin: tuple[kubelet_plugin.KubeletPlugin, Claims],
) -> None:
    served, _ = plugin
    request = drapb.NodeUnprepareResourcesRequest(
        claims=[
            drapb.Claim(namespace="team", name="a", uid="uid-a"),
            drapb.Claim(namespace="x", name="b", uid="uid-b"),
        ]
    )

    answer = await asyncio.to_thread(
        call, served.dra_path, kubelet_plugin.DRA_SERVICE, "NodeUnprepareResources", request,
        drapb.NodeUnprepareResourcesResponse,
    )  # fmt: skip

    assert sorted(answer.claims) == ["uid-a", "uid-b"]
    assert [answer.claims[uid].error for uid in ("uid-a", "uid-b")] == ["", ""]


async def test_the_health_stream_sends_every_devices_health_then_each_change_and_ends_when_the_plugin_stops(
    root: Path,
) -> None:
    claims = Claims()
    served = kubelet_plugin.KubeletPlugin(
        node=NODE, kubelet_root=str(root), read_claim=claims.read, loop=asyncio.get_running_loop()
    )
    served.set_health({GPU.lower(): (True, "")})
    await asyncio.to_thread(served.start)
    seen: list[list[tuple[str, str, int, str]]] = []

    def watch() -> None:
        with grpc.insecure_channel(f"unix://{served.dra_path}") as channel:
            stream = channel.unary_stream(
                f"/{kubelet_plugin.HEALTH_SERVICE}/NodeWatchResources",
                request_serializer=healthpb.NodeWatchResourcesRequest.SerializeToString,
                response_deserializer=healthpb.NodeWatchResourcesResponse.FromString,
            )
            for message in stream(healthpb.NodeWatchResourcesRequest(), timeout=20):
                seen.append(
                    [(d.device.pool_name, d.device.device_name, d.health, d.message) for d in message.devices]
                )

    watcher = asyncio.create_task(asyncio.to_thread(watch))
    try:
        await _until(lambda: len(seen) == 1)
        served.set_health({GPU.lower(): (False, "XID 79")})
        await _until(lambda: len(seen) == 2)
    finally:
        await asyncio.to_thread(served.stop)
    await asyncio.wait_for(watcher, 10)  # the stream ended with the plugin, without an error

    assert seen == [
        [(NODE, GPU.lower(), healthpb.HEALTHY, "")],
        [(NODE, GPU.lower(), healthpb.UNHEALTHY, "XID 79")],
    ]


async def _until(check: Any, within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_stop_removes_both_sockets(root: Path) -> None:
    claims = Claims()
    served = kubelet_plugin.KubeletPlugin(
        node=NODE,
        kubelet_root=str(root),
        read_claim=claims.read,
        loop=asyncio.get_running_loop(),
        mode="nvidia",
    )
    await asyncio.to_thread(served.start)
    assert served.registration_path.exists() and served.dra_path.exists()

    await asyncio.to_thread(served.stop)

    assert not served.registration_path.exists() and not served.dra_path.exists()


def test_the_spec_points_at_the_device_directory_and_gives_only_the_control_devices_found_there(
    root: Path,
) -> None:
    devices = root / "dev"
    devices.mkdir()
    (devices / "nvidiactl").touch()
    (devices / "nvidia-uvm").touch()

    path, _ = kubelet_plugin.write_spec(str(root / "cdi"), [cdi.Gpu(minor=4, uuid=GPU)], str(devices))

    spec = json.loads(path.read_text())
    assert path == root / "cdi" / "gpualloc.dev-gpu.json"
    assert spec["devices"] == [
        {
            "name": GPU,
            "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia4", "hostPath": f"{devices}/nvidia4"}]},
        }
    ]
    assert [n["path"] for n in spec["containerEdits"]["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm"]


def test_on_a_gpu_node_the_spec_names_dev_without_host_paths(root: Path) -> None:
    path, _ = kubelet_plugin.write_spec(str(root), [cdi.Gpu(minor=0, uuid=GPU)], "/dev")

    spec = json.loads(path.read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert all("hostPath" not in n for n in spec["containerEdits"]["deviceNodes"])


def test_update_writes_mig_caps_into_the_spec_and_logs_the_instances_it_could_not_give_them(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loop = asyncio.new_event_loop()  # not run: update writes the spec without the API server
    served = kubelet_plugin.KubeletPlugin(
        node=NODE,
        kubelet_root=str(root),
        read_claim=Claims().read,
        loop=loop,
        cdi_dir=str(root / "cdi"),
        device_dir=str(root / "dev"),
    )
    known, blind = cdi.Mig(uuid="MIG-1", caps=(12, 13)), cdi.Mig(uuid="MIG-2")

    with caplog.at_level("WARNING", logger=kubelet_plugin.__name__):
        served.update([cdi.Gpu(minor=0, uuid=GPU, migs=(known, blind))])
    loop.close()

    spec = json.loads((root / "cdi" / cdi.SPEC_NAME).read_text())
    nodes = {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}
    assert nodes["MIG-1"] == [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap12",
        "/dev/nvidia-caps/nvidia-cap13",
    ]
    assert nodes["MIG-2"] == ["/dev/nvidia0"]
    warned = [r for r in caplog.records if "nvidia-caps" in r.getMessage()]
    assert [getattr(r, "instances", "") for r in warned] == ["gpu-0/MIG-2"]


def test_the_agent_is_no_kubelet_plugin_unless_asked_and_defaults_to_the_kubelets_and_cdis_paths() -> None:
    from agent import main

    default = main.parse_args(["--node-name", NODE])
    asked = main.parse_args(
        ["--node-name", NODE, "--kubelet-plugin", "--kubelet-root", "/k", "--cdi-mode", "nvidia"]
    )

    assert (default.kubelet_plugin, default.kubelet_root, default.cdi_dir) == (
        False,
        "/var/lib/kubelet",
        "/var/run/cdi",
    )
    assert (default.cdi_mode, default.device_dir) == ("gpualloc", "/dev")
    assert (asked.kubelet_plugin, asked.kubelet_root, asked.cdi_mode) == (True, "/k", "nvidia")
