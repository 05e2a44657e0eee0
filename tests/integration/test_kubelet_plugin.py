"""The agent's DRA kubelet plugin against the real local kube-apiserver (issue 42, part 2).

The agent runs in-process with ``--kubelet-plugin`` (simulated a100-mig profile: GPU 0 in MIG
mode, GPU 1 shared by two); ResourceClaims (resource.k8s.io/v1, served by the local
kube-apiserver 1.36.3) get their ``status.allocation`` written as the controller writes it
(``controller.resourceclaims.allocation_json``); NodePrepareResources is then called over the
plugin's unix socket, as the kubelet calls it, and answers each claim's CDI device IDs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.kubeletapi import dra_v1_pb2 as drapb
from agent.kubeletapi import pluginregistration_v1_pb2 as regpb
from controller import resourceclaims
from gpualloc.api import constants
from tests.conftest import wait_until
from tests.integration.test_agent_apiserver import _create_node, _published, _until, running_agent

pytestmark = pytest.mark.integration

GROUP_VERSION = "/apis/resource.k8s.io/v1"


@pytest.fixture
def kubelet_root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kr", dir="/tmp"))  # a unix socket's path fits 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def create_resource_claim(
    control_plane: Any, namespace: str, name: str, node: str, lock_ids: list[str]
) -> str:
    """A ResourceClaim allocated on ``node`` as the controller allocates it; its uid."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": constants.DRA_REQUEST,
                        "exactly": {"deviceClassName": constants.DRA_DRIVER, "count": len(lock_ids)},
                    }
                ]
            }
        },
    }
    path = f"{GROUP_VERSION}/namespaces/{namespace}/resourceclaims"
    created = control_plane.request("POST", path, body)
    allocated = resourceclaims.Allocated(
        node=node,
        results=tuple(
            resourceclaims.Result(pool=node, device=constants.dra_device_name(i)) for i in lock_ids
        ),
    )
    status = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "resourceVersion": created["metadata"]["resourceVersion"],
        },
        "status": {"allocation": resourceclaims.allocation_json(allocated)},
    }
    control_plane.request("PUT", f"{path}/{name}/status", status)
    return str(created["metadata"]["uid"])


def call(socket: Path, service: str, method: str, request: Any, response: Any) -> Any:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = channel.unary_unary(
            f"/{service}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response.FromString,
        )
        return stub(request, timeout=20)


async def test_node_prepare_resources_answers_the_cdi_devices_of_resource_claims_read_from_the_api_server(
    control_plane: Any, kubeconfig: str, namespace: str, kubelet_root: Path
) -> None:
    assert "resource.k8s.io/v1" in json.dumps(control_plane.request("GET", "/apis/resource.k8s.io"))
    node = f"dra-{uuid.uuid4().hex[:6]}"
    _create_node(control_plane, node)
    cdi_dir = kubelet_root / "cdi"
    flags = [
        "--source",
        "simulated",
        "--profile",
        "a100-mig",
        "--sharing",
        "TimeSlicing:2",
        "--kubelet-plugin",
    ]
    flags += ["--kubelet-root", str(kubelet_root), "--cdi-dir", str(cdi_dir)]
    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        status = await _until(control_plane, node, _published(2), 15)
        mig_gpu, shared_gpu = sorted(status["status"]["devices"], key=lambda d: d["index"])
        mig_uuid = mig_gpu["mig"]["devices"][1]["uuid"]
        slot = constants.slot_id(shared_gpu["uuid"], 1)
        assert agent.plugin is not None
        wait_until("the plugin's sockets", lambda: agent.plugin.dra_path.exists(), within=10)  # type: ignore[union-attr]

        whole = create_resource_claim(control_plane, namespace, "whole-gpus-0", node, [shared_gpu["uuid"]])
        parts = create_resource_claim(control_plane, namespace, "parts-gpus-0", node, [mig_uuid, slot])
        elsewhere = create_resource_claim(
            control_plane, namespace, "other-gpus-0", "node-x", [shared_gpu["uuid"]]
        )
        request = drapb.NodePrepareResourcesRequest(
            claims=[
                drapb.Claim(namespace=namespace, name="whole-gpus-0", uid=whole),
                drapb.Claim(namespace=namespace, name="parts-gpus-0", uid=parts),
                drapb.Claim(namespace=namespace, name="other-gpus-0", uid=elsewhere),
                drapb.Claim(namespace=namespace, name="whole-gpus-0", uid="not-its-uid"),
                drapb.Claim(namespace=namespace, name="absent-gpus-0", uid="absent-uid"),
            ]
        )
        info = await asyncio.to_thread(
            call, agent.plugin.registration_path, "pluginregistration.Registration", "GetInfo",
            regpb.InfoRequest(), regpb.PluginInfo,
        )  # fmt: skip
        answer = await asyncio.to_thread(
            call, Path(info.endpoint), "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", "NodePrepareResources",
            request, drapb.NodePrepareResourcesResponse,
        )  # fmt: skip

        def cdi_ids(uid: str) -> list[str]:
            assert answer.claims[uid].error == ""
            return [i for d in answer.claims[uid].devices for i in d.cdi_device_ids]

        assert sorted(answer.claims) == sorted([whole, parts, elsewhere, "not-its-uid", "absent-uid"])
        assert cdi_ids(whole) == [f"gpualloc.dev/gpu={shared_gpu['uuid']}"]
        assert cdi_ids(parts) == [f"gpualloc.dev/gpu={mig_uuid}", f"gpualloc.dev/gpu={shared_gpu['uuid']}"]
        assert "names no device of gpu.gpualloc.dev on node" in answer.claims[elsewhere].error
        assert "not 'not-its-uid'" in answer.claims["not-its-uid"].error
        assert "404" in answer.claims["absent-uid"].error

        spec = json.loads((cdi_dir / "gpualloc.dev-gpu.json").read_text())
        named = {d["name"] for d in spec["devices"]}
        assert {mig_gpu["uuid"], mig_uuid, shared_gpu["uuid"]} <= named
    assert not agent.plugin.registration_path.exists() and not agent.plugin.dra_path.exists()
