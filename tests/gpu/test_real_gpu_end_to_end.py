"""A real GPU from NVML to a CUDA process, through the real API server.

The agent (real NvmlSource) publishes this machine's GPUs; the published
GpuNodeStatus is compared with ``nvidia-smi -q -x``. The controller allocates
a one-GPU claim from it; a claim pod created through the API server gets its
env from the webhook; a CUDA program run with that env (and with index-mode
env) sees exactly the allocated GPU. A UUID that is not on this machine makes
CUDA see none. All run in this process except the CUDA program, which needs a
fresh process because CUDA reads ``CUDA_VISIBLE_DEVICES`` once, at ``cuInit``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from typing import Any

import jsonpatch
import pytest

from agent import inventory, publishing
from gpualloc.api import codecs, constants
from gpualloc.kube import errors, resources, transport
from gpualloc.kube.client import Api
from tests import admitting, reviews
from tests.gpu import smi
from tests.integration.controller_support import (
    RUN_LABEL,
    claim_body,
    controller_argv,
    create_ready_node,
    running_controller,
    wait_for,
    wait_phase,
)
from tests.integration.test_agent_apiserver import running_agent
from tests.integration.test_webhook_cluster import (  # noqa: F401 - webhook, webhook_options: fixtures
    RunningWebhook,
    create_pod,
    env,
    pod,
    wait_cached,
    webhook,
    webhook_options,
)
from webhook import admission

# Lists the GPUs CUDA sees, as nvidia-smi writes UUIDs. ctypes on libcuda, so no
# CUDA toolkit or framework is needed, only the driver.
CUDA_PROBE = r"""
import ctypes, json
cuda = ctypes.CDLL("libcuda.so.1")
rc = cuda.cuInit(0)
found = []
if rc == 0:
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
    for i in range(count.value):
        dev = ctypes.c_int()
        assert cuda.cuDeviceGet(ctypes.byref(dev), i) == 0
        raw = (ctypes.c_ubyte * 16)()
        assert get_uuid(raw, dev) == 0
        h = bytes(raw).hex()
        found.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
print(json.dumps({"cuInit": rc, "uuids": found}))
"""


def cuda_sees(env_vars: dict[str, str]) -> dict[str, Any]:
    """What a fresh CUDA process sees under these env vars: cuInit's code and device UUIDs."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NVIDIA_"))}
    done = subprocess.run(
        [sys.executable, "-c", CUDA_PROBE],
        env={**environ, **env_vars},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture
async def gpu_node(
    control_plane: Any, api: Api, kubeconfig: str, namespace: str
) -> AsyncIterator[tuple[str, str]]:
    """(node name, run id): a Node labelled for this test, with the real NVML agent publishing for it."""
    run = uuid.uuid4().hex[:8]
    node = f"real-gpu-{run}"
    labels = {constants.HOSTNAME_LABEL: node, RUN_LABEL: run}
    await create_ready_node(api, node, labels)
    flags = [
        "--source",
        "nvml",
        "--lease-namespace",
        namespace,
        "--heartbeat-namespace",
        namespace,
        "--node-labels",
    ]
    async with running_agent(control_plane, kubeconfig, node, *flags):  # deletes the Node afterwards
        yield node, run


async def _published(api: Api, node: str) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        got = None
        with contextlib.suppress(errors.NotFound):
            got = await resources.CustomResources(api).get_node_status(node)
        status = (got or {}).get("status") or {}
        ready = {c["type"]: c["status"] for c in status.get("conditions") or []}
        return got if status.get("devices") and ready.get(constants.CONDITION_NVML_READY) == "True" else None

    return await wait_for(probe, within=60, what=f"GpuNodeStatus {node} with NvmlReady=True")


async def test_agent_publishes_what_nvidia_smi_reports(
    api: Api, gpu_node: tuple[str, str], smi_xml: ET.Element
) -> None:
    node, _ = gpu_node
    obj = await _published(api, node)
    status = codecs.parse_node_status(obj).status
    assert status.source == "nvml"
    assert status.driver_version == smi_xml.findtext("driver_version")
    gpus = {g.findtext("uuid"): g for g in smi_xml.findall("gpu")}
    assert {d.uuid for d in status.devices} == set(gpus)
    assert status.total == len(gpus) == status.healthy
    for device in status.devices:
        gpu = gpus[device.uuid]
        assert device.product == gpu.findtext("product_name")
        assert device.pci_bus_id == inventory.normalize_bus_id(gpu.findtext("pci/pci_bus_id") or "")
        assert device.health == constants.HEALTHY
        total = smi.mib(gpu.findtext("fb_memory_usage/total") or "0")
        assert abs(device.memory_mib - total) <= max(1, total // 100)
    labels = (await transport.request(api, "GET", f"/api/v1/nodes/{node}"))["metadata"]["labels"]
    first = min(status.devices, key=lambda d: d.index)
    assert labels[publishing.LABEL_GPU_COUNT] == str(len(gpus))
    assert labels[publishing.LABEL_GPU_PRODUCT] == publishing.sanitize_label_value(first.product)
    assert labels[publishing.LABEL_GPU_MEMORY] == str(first.memory_mib)


async def test_allocated_gpu_is_the_one_cuda_sees_in_the_claim_pod(
    api: Api,
    kubeconfig: str,
    namespace: str,
    gpu_node: tuple[str, str],
    webhook: RunningWebhook,  # noqa: F811 - the fixture imported above
) -> None:
    node, run = gpu_node
    await _published(api, node)
    crs = resources.CustomResources(api)
    async with running_controller(kubeconfig, controller_argv(namespace, run=run)):
        await crs.create_claim(namespace, claim_body("real", 1, run=run))
        claim = await wait_phase(api, namespace, "real", constants.PHASE_ALLOCATED, within=60)
    allocation = claim["status"]["allocations"][0]
    assert allocation["nodeName"] == node
    [device] = allocation["devices"]

    await wait_cached(webhook, f"{namespace}/real", constants.PHASE_ALLOCATED)  # its watch may lag
    stored = await create_pod(api, namespace, pod("cuda", "real"))
    assert stored["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: node}
    containers = stored["spec"]["initContainers"] + stored["spec"]["containers"]
    for container in containers:
        assert env(container)["CUDA_VISIBLE_DEVICES"] == device["uuid"], container["name"]
        seen = cuda_sees(env(container))
        assert seen == {"cuInit": 0, "uuids": [device["uuid"]]}, container["name"]

    # --device-ids index: the host index with CUDA_DEVICE_ORDER=PCI_BUS_ID names the same GPU.
    review = reviews.pod_review(pod("cuda-index", "real", init=False), namespace=namespace, uid="index-mode")
    answer = admitting.admit(
        review,
        admitting.lookup_from({f"{namespace}/real": codecs.parse_claim(claim)}),
        admission.Options(device_ids="index"),
    )["response"]
    assert answer["allowed"] is True and answer["patchType"] == "JSONPatch", answer
    patch = json.loads(base64.b64decode(answer["patch"]))
    mutated = jsonpatch.apply_patch(review["request"]["object"], patch)
    index_env = env(mutated["spec"]["containers"][0])
    assert index_env["CUDA_VISIBLE_DEVICES"] == str(device["index"])
    assert index_env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert cuda_sees(index_env) == {"cuInit": 0, "uuids": [device["uuid"]]}

    # A GPU that is not on this machine: CUDA sees no device at all, it does not fall back.
    absent = "GPU-00000000-0000-0000-0000-000000000000"
    seen = cuda_sees({"CUDA_VISIBLE_DEVICES": absent, "NVIDIA_VISIBLE_DEVICES": absent})
    assert seen["uuids"] == [] and seen["cuInit"] != 0
