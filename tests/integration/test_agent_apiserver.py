"""The agent against the real local kube-apiserver: it runs in-process as a task.

What the API server proves here: the published GpuNodeStatus passes the CRD's
schema (a write that did not would be refused with 422) and survives pruning
(what is read back equals what was derived); the ownerReference points at the
Node; with nothing changing only heartbeats are written, the heartbeat Lease's
renewals and a status refresh every tenth (counted in the API server's own audit
log); an injected XID reaches the API within 2 s; an API server restart does not
stop publishing; NVML init failure is published as NvmlReady=False and recovery
follows; an injected stray GPU process is published in ``unexpectedProcesses``
within one heartbeat, with a Warning Event on the Node; a GPU's ``idleSince`` is
absent while an injected process runs and set when it goes, and ``gpualloc get
usage --idle-after`` names the allocated GPUs without a process from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agent import inventory, main, nvml, publishing
from gpualloc import usage_view
from gpualloc.api import codecs, constants, timestamps
from gpualloc.api import leases as lease_format
from gpualloc.devcluster import cluster
from gpualloc.kube import leases, resources

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tests.conftest import completed_requests
from tests.unit import fake_pynvml as fake

GNS = "/apis/gpu.scheduling/v1/gpunodestatuses"


def _node_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


async def _get(control_plane: Any, node: str) -> dict[str, Any] | None:
    try:
        obj: dict[str, Any] = await asyncio.to_thread(control_plane.request, "GET", f"{GNS}/{node}")
        return obj
    except cluster.RequestError as exc:
        if exc.status == 404:
            return None
        raise
    except (OSError, cluster.ControlPlaneError):  # the API server is restarting
        return None


async def _until(
    control_plane: Any, node: str, check: Callable[[dict[str, Any]], bool], seconds: float
) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    last: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        last = await _get(control_plane, node)
        if last is not None and check(last):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"condition not met in {seconds} s; last object: {json.dumps(last)[:2000]}")


def _device(obj: dict[str, Any], index: int) -> dict[str, Any]:
    devices: list[dict[str, Any]] = obj.get("status", {}).get("devices", [])
    return next(d for d in devices if d["index"] == index)


@contextlib.asynccontextmanager
async def running_agent(
    control_plane: Any,
    kubeconfig: str,
    node: str,
    *flags: str,
    source: inventory.Source | None = None,
    delete_after: bool = True,
) -> AsyncIterator[main.Agent]:
    """An agent for ``node`` in this process; its Node and GpuNodeStatus deleted after it stops
    unless ``delete_after`` is False (a restart)."""
    args = main.parse_args(
        [
            "--node-name",
            node,
            "--kubeconfig",
            kubeconfig,
            "--health-port",
            "0",
            "--metrics-port",
            "0",
            *flags,
        ]
    )
    agent = main.Agent(args, source=source)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop), name=f"agent-{node}")
    try:
        yield agent
        assert not task.done(), f"the agent ended early: {task}"
    finally:
        stop.set()
        rc = await asyncio.wait_for(task, 20)
        assert rc == main.EXIT_OK
        for path in (f"{GNS}/{node}", f"/api/v1/nodes/{node}") if delete_after else ():
            with contextlib.suppress(cluster.RequestError):
                await asyncio.to_thread(control_plane.request, "DELETE", path)


def _create_node(control_plane: Any, node: str) -> dict[str, Any]:
    obj: dict[str, Any] = control_plane.request(
        "POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    )
    return obj


def _published(total: int) -> Callable[[dict[str, Any]], bool]:
    return lambda obj: obj.get("status", {}).get("total") == total


async def test_agent_publishes_a_schema_valid_status_owned_by_its_node(
    control_plane: Any, kubeconfig: str, api: Any, namespace: str
) -> None:
    node = _node_name("agent-owned")
    node_obj = _create_node(control_plane, node)
    flags = [
        "--source",
        "simulated",
        "--profile",
        "h100-sxm-8",
        "--lease-namespace",
        namespace,
        "--heartbeat-namespace",
        namespace,
        "--node-labels",
    ]
    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        obj = await _until(control_plane, node, _published(8), 15)
        assert obj["spec"] == {"nodeName": node}
        assert obj["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_obj["metadata"]["uid"]}
        ]
        parsed = codecs.parse_node_status(obj)
        # Nothing was pruned or rejected: what the server holds is what the agent derived.
        assert publishing.comparable(parsed.status) == publishing.comparable(agent.desired())
        status = parsed.status
        assert status.source == "simulated" and status.product == "8x NVIDIA H100 80GB HBM3"
        assert {(ln.type, ln.bandwidth_gbps) for ln in status.links} == {("NV18", 900)}
        assert len(status.links) == 28 and status.islands == ((0, 1, 2, 3, 4, 5, 6, 7),)
        assert status.last_heartbeat_time
        ready = {c.type: c for c in status.conditions}[constants.CONDITION_READY]
        assert (ready.status, ready.reason) == ("True", "Publishing")

        # A device Lease for one GPU of this node (as the controller writes it) shows in status.allocated.
        gpu = status.devices[5]
        await leases.create_lease(
            api,
            namespace,
            constants.lease_name(gpu.uuid),
            holder="claim-uid-1",
            labels={
                constants.LABEL_NODE: node,
                constants.LABEL_CLAIM_NAMESPACE: namespace,
                constants.LABEL_CLAIM_NAME: "train",
                constants.LABEL_CLAIM_UID: "claim-uid-1",
            },
        )
        obj = await _until(control_plane, node, lambda o: o["status"].get("allocated") == 1, 10)
        assert obj["status"]["total"] == 8

        labels = (await asyncio.to_thread(control_plane.request, "GET", f"/api/v1/nodes/{node}"))["metadata"][
            "labels"
        ]
        assert labels["gpu.scheduling/gpu.count"] == "8"
        assert labels["gpu.scheduling/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["gpu.scheduling/gpu.memory"] == "81559"


async def test_agent_without_a_node_object_creates_the_status_without_owner(
    control_plane: Any, kubeconfig: str
) -> None:
    node = _node_name("agent-orphan")
    flags = ["--source", "simulated", "--profile", "consumer-8"]
    async with running_agent(control_plane, kubeconfig, node, *flags):
        obj = await _until(control_plane, node, _published(8), 15)
        assert "ownerReferences" not in obj["metadata"]
        assert {ln["type"] for ln in obj["status"]["links"]} == {"PIX", "NODE", "SYS"}


def _audit_writes(
    audit_log: Path, node: str, resource: str = constants.NODE_STATUS_PLURAL
) -> list[dt.datetime]:
    """Times of create/update/patch requests on this node's ``resource`` (its GpuNodeStatus, or
    ``leases``: its heartbeat Lease), from the audit log."""
    return [
        dt.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00"))
        for event in completed_requests(audit_log, resource=resource, name=node)
        if event.get("verb") in ("create", "update", "patch")
    ]


async def test_two_minutes_without_change_renew_only_the_heartbeat_lease_and_refresh_the_status_once(
    control_plane: Any, kubeconfig: str, namespace: str
) -> None:
    node = _node_name("agent-quiet")
    node_obj = _create_node(control_plane, node)
    interval, window = 10.0, 120.0
    flags = ["--source", "simulated", "--profile", "a100-sxm-8", "--heartbeat-interval", str(interval)]
    flags += ["--heartbeat-namespace", namespace]
    flags += ["--scan-interval", "2"]  # scans wake the publisher often; none of them may write
    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        await _until(control_plane, node, _published(8), 15)
        start = dt.datetime.now(dt.UTC)
        await asyncio.sleep(window)
        end = dt.datetime.now(dt.UTC)
        assert agent.publisher is not None
        writes = dict(agent.publisher.writes)
        lease = control_plane.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{node}"
        )
    statuses = [t for t in _audit_writes(control_plane.audit_log, node) if start <= t < end]
    renewals = [t for t in _audit_writes(control_plane.audit_log, node, "leases") if start <= t < end]
    expected = window / interval
    print(
        f"in {window:.0f} s: {len(renewals)} heartbeat Lease writes, {len(statuses)} GpuNodeStatus writes"
        f" (expected {expected:.0f}, one in {publishing.STATUS_REFRESH_INTERVALS} a status refresh)"
    )
    assert abs(len(renewals) + len(statuses) - expected) <= 1, (renewals, statuses)
    assert 1 <= len(statuses) <= 2, statuses  # the status's own heartbeat, every tenth interval
    # The agent's own tally: one create and one full status write at start, then heartbeats.
    assert (writes["create"], writes["status"]) == (1, 1)
    assert writes["heartbeat"] >= expected - 3 and writes["refresh"] >= 1, writes
    assert lease["spec"]["holderIdentity"] == node
    # Owned by the Node, as the kubelet's node Lease: the garbage collector deletes it with the Node.
    assert lease["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_obj["metadata"]["uid"]}
    ]
    assert agent.scans >= 50


async def test_injected_xid_turns_the_device_unhealthy_in_the_api_within_2_s(
    control_plane: Any, kubeconfig: str, tmp_path: Path
) -> None:
    node = _node_name("agent-xid")
    inject = tmp_path / "xids"
    flags = ["--source", "simulated", "--profile", "h100-sxm-8", "--xid-inject-file", str(inject)]
    async with running_agent(control_plane, kubeconfig, node, *flags):
        await _until(control_plane, node, _published(8), 15)
        started = time.monotonic()
        inject.write_text("3 79\n5 13\n")  # 13 is an application XID: ignored
        obj = await _until(control_plane, node, lambda o: _device(o, 3)["health"] == "Unhealthy", 5)
        elapsed = time.monotonic() - started
        assert elapsed < 2.0, elapsed
        assert _device(obj, 3)["healthReason"] == "XID 79"
        assert _device(obj, 5)["health"] == "Healthy"
        assert (obj["status"]["healthy"], obj["status"]["total"]) == (7, 8)


async def test_publishing_continues_after_an_apiserver_restart(
    control_plane: Any, kubeconfig: str, tmp_path: Path
) -> None:
    node = _node_name("agent-restart")
    inject = tmp_path / "xids"
    flags = ["--source", "simulated", "--profile", "a100-pcie-4-nvlink", "--xid-inject-file", str(inject)]
    flags += ["--heartbeat-interval", "5"]
    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        await _until(control_plane, node, _published(4), 15)
        await asyncio.to_thread(control_plane.restart_apiserver)
        inject.write_text("2 ecc\n")  # a change made after the restart
        obj = await _until(control_plane, node, lambda o: _device(o, 2)["health"] == "Unhealthy", 30)
        assert _device(obj, 2)["healthReason"] == "double-bit ECC error"
        before = obj["status"]["lastHeartbeatTime"]
        obj = await _until(control_plane, node, lambda o: o["status"]["lastHeartbeatTime"] != before, 15)
        assert agent.ready()


async def test_nvml_init_failure_is_published_as_nvml_ready_false_then_recovers(
    control_plane: Any, kubeconfig: str
) -> None:
    node = _node_name("agent-nvml")
    machine = fake.h100_nvswitch_box()
    machine.init_error = fake.NVML_ERROR_LIBRARY_NOT_FOUND
    source = nvml.NvmlSource(nvml_module=fake.FakeNvml(machine), sysfs_root="/nonexistent")

    def nvml_ready(status: str) -> Callable[[dict[str, Any]], bool]:
        def check(obj: dict[str, Any]) -> bool:
            conds = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
            return conds.get(constants.CONDITION_NVML_READY, {}).get("status") == status

        return check

    async with running_agent(control_plane, kubeconfig, node, "--source", "nvml", source=source):
        obj = await _until(control_plane, node, nvml_ready("False"), 15)
        conds = {c["type"]: c for c in obj["status"]["conditions"]}
        assert "NVML Shared Library Not Found" in conds[constants.CONDITION_NVML_READY]["message"]
        assert conds[constants.CONDITION_READY]["status"] == "False"
        assert (obj["status"]["source"], obj["status"]["total"]) == ("nvml", 0)
        machine.init_error = None  # the driver comes back; the agent's retry picks it up
        obj = await _until(control_plane, node, nvml_ready("True"), 15)
        assert obj["status"]["total"] == 8
        assert {ln["type"] for ln in obj["status"]["links"]} == {"NV18"}
        assert obj["status"]["cudaVersion"] == "13.0"


@pytest.fixture(autouse=True)
def _control_plane_alive(control_plane: Any) -> None:
    control_plane.check_alive()


async def test_mig_instances_are_stored_with_placement_and_slices_nothing_pruned(
    control_plane: Any, kubeconfig: str
) -> None:
    node = _node_name("agent-mig")
    _create_node(control_plane, node)
    flags = ["--source", "simulated", "--profile", "a100-mig"]
    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        obj = await _until(control_plane, node, _published(2), 15)
        # Unknown fields would be pruned by the CRD's structural schema: compare with what was derived.
        parsed = codecs.parse_node_status(obj)
        assert publishing.comparable(parsed.status) == publishing.comparable(agent.desired())
        stored = _device(obj, 0)["mig"]["devices"]
        assert [
            (m["profile"], m["placementStart"], m["memorySlices"], m["computeSlices"]) for m in stored
        ] == [
            ("3g.20gb", 0, 4, 3),
            ("2g.10gb", 4, 2, 2),
            ("1g.5gb", 6, 1, 1),
            ("1g.5gb", 7, 1, 1),
        ]


def _pod(control_plane: Any, namespace: str, name: str, node: str, claim: str | None) -> str:
    """A pod bound to ``node`` (no kubelet runs it), with ``claim``'s annotation; its UID."""
    metadata: dict[str, Any] = {"name": name}
    if claim:
        metadata["annotations"] = {constants.ANNOTATION_CLAIM: claim}
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {"nodeName": node, "containers": [{"name": "main", "image": "cuda"}]},
    }
    created = control_plane.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
    return str(created["metadata"]["uid"])


async def test_an_injected_stray_process_is_reported_within_one_heartbeat_with_a_node_event(
    control_plane: Any, kubeconfig: str, namespace: str, tmp_path: Path
) -> None:
    node = _node_name("agent-audit")
    _create_node(control_plane, node)
    inject = tmp_path / "processes"
    heartbeat = 5.0
    flags = [
        "--source",
        "simulated",
        "--profile",
        "a100-pcie-4-nvlink",
        "--xid-inject-file",
        str(inject),
        "--lease-namespace",
        namespace,
        "--heartbeat-namespace",
        namespace,
        "--heartbeat-interval",
        str(heartbeat),
    ]
    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        published = await _until(control_plane, node, _published(4), 15)
        gpu0, gpu2 = (published["status"]["devices"][i]["uuid"] for i in (0, 2))
        # Claim team/train holds GPU 0; its pod and another pod run on the node.
        lease = lease_format.device_lease(
            namespace,
            lock_id=gpu0,
            node=node,
            claim_namespace=namespace,
            claim_name="train",
            claim_uid="uid-train",
            claim_resource_version="1",
            now=dt.datetime.now(dt.UTC),
        )
        control_plane.request("POST", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases", lease)
        mine = _pod(control_plane, namespace, "train-0", node, "train")
        other = _pod(control_plane, namespace, "sneaky", node, None)
        await _until(control_plane, node, lambda o: o["status"].get("allocated") == 1, 10)
        for _ in range(50):  # the agent's pod cache has both pods
            if agent.pods is not None and len(agent.pods.cache) == 2:
                break
            await asyncio.sleep(0.1)

        started = time.monotonic()
        inject.write_text(f"0 process 10 {mine}\n0 process 11 {other}\n2 process 4242\n")
        obj = await _until(
            control_plane, node, lambda o: len(o["status"].get("unexpectedProcesses") or []) == 2, heartbeat
        )
        assert time.monotonic() - started < heartbeat
        found = {p["pid"]: p for p in obj["status"]["unexpectedProcesses"]}
        assert found[4242] == {
            "index": 2,
            "uuid": gpu2,
            "pid": 4242,
            "podUID": "",  # not in a pod the injection named
            "pod": "",
            "reason": "no claim holds GPU 2",
        }
        assert found[11] == {
            "index": 0,
            "uuid": gpu0,
            "pid": 11,
            "podUID": other,
            "pod": f"{namespace}/sneaky",
            "reason": f"its pod {namespace}/sneaky has no claim; GPU 0 is held by {namespace}/train",
        }
        path = f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name={node}"
        events = await asyncio.to_thread(control_plane.request, "GET", path)
        warnings = [e for e in events["items"] if e["reason"] == main.REASON_UNEXPECTED_PROCESS]
        assert sorted(e["message"].split()[1] for e in warnings) == ["11", "4242"]
        assert all(e["type"] == "Warning" and e["involvedObject"]["kind"] == "Node" for e in warnings)

        inject.write_text(f"0 process 10 {mine}\n")  # the strays have exited
        await _until(control_plane, node, lambda o: not o["status"].get("unexpectedProcesses"), heartbeat)


async def _allocated_claim(api: Any, namespace: str, name: str, node: str, device: dict[str, Any]) -> None:
    """An Allocated claim holding ``device`` (as the GpuNodeStatus lists it) on ``node``, allocated
    a minute ago; no controller runs, so its status is written here."""
    crs = resources.CustomResources(api)
    body = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name},
        "spec": {"devices": {"count": 1}},
    }
    await crs.create_claim(namespace, body)
    ref = {"index": device["index"], "minor": device["minor"], "uuid": device["uuid"]}
    allocated = {
        "phase": constants.PHASE_ALLOCATED,
        "allocations": [{"replica": 0, "nodeName": node, "devices": [ref]}],
        "lastScheduleTime": timestamps.format_time(dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)),
    }
    await crs.patch_claim_status(namespace, name, {"status": allocated})


async def _idle_gpus(
    kubeconfig: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> list[tuple[str, int]]:
    """``gpualloc get usage -A --idle-after 1s -o json``, in this process: this namespace's idle
    GPUs, (claim, GPU index)."""
    capsys.readouterr()
    argv = ["--kubeconfig", kubeconfig, "-A", "--idle-after", "1s", "-o", "json"]
    assert await asyncio.to_thread(usage_view.main, argv) == 0
    found = json.loads(capsys.readouterr().out)["idleGpus"]
    return [(g["claim"], g["index"]) for g in found if g["namespace"] == namespace]


async def test_idle_since_follows_the_gpus_processes_and_get_usage_names_the_idle_allocated_gpu(
    control_plane: Any,
    kubeconfig: str,
    api: Any,
    namespace: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    node = _node_name("agent-idle")
    _create_node(control_plane, node)
    inject = tmp_path / "processes"
    inject.write_text("3 process 4242\n")  # running before the agent starts
    flags = ["--source", "simulated", "--profile", "a100-pcie-4-nvlink", "--xid-inject-file", str(inject)]

    def busy(index: int) -> Callable[[dict[str, Any]], bool]:
        return lambda o: _published(4)(o) and "idleSince" not in _device(o, index)

    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        obj = await _until(control_plane, node, busy(3), 15)
        idle_since = _device(obj, 0)["idleSince"]  # never had a process: idle since the agent saw it
        assert {_device(obj, i)["idleSince"] for i in (0, 1, 2)} == {idle_since}
        assert publishing.comparable(codecs.parse_node_status(obj).status) == publishing.comparable(
            agent.desired()
        )  # stored as derived: the schema keeps idleSince
        await _allocated_claim(api, namespace, "notebook", node, _device(obj, 0))
        await _allocated_claim(api, namespace, "train", node, _device(obj, 3))
        await asyncio.sleep(1.1)  # GPU 0 idle for more than --idle-after 1s
        assert await _idle_gpus(kubeconfig, namespace, capsys) == [("notebook", 0)]

        went = dt.datetime.now(dt.UTC).replace(microsecond=0)
        inject.write_text("")  # the process on GPU 3 exits
        obj = await _until(control_plane, node, lambda o: "idleSince" in _device(o, 3), 5)
        since = timestamps.parse_time(_device(obj, 3)["idleSince"])
        assert since is not None and went <= since <= went + dt.timedelta(seconds=3)
        assert _device(obj, 0)["idleSince"] == idle_since  # GPU 0's value did not move
        await asyncio.sleep(1.1)
        assert await _idle_gpus(kubeconfig, namespace, capsys) == [("notebook", 0), ("train", 3)]

        inject.write_text("3 process 4343\n")  # a new one: GPU 3 busy again
        await _until(control_plane, node, busy(3), 5)
        assert await _idle_gpus(kubeconfig, namespace, capsys) == [("notebook", 0)]


async def test_a_restarted_agent_keeps_the_idle_since_of_gpus_still_idle_and_writes_no_status(
    control_plane: Any, kubeconfig: str
) -> None:
    node = _node_name("agent-idle-restart")
    _create_node(control_plane, node)
    flags = ["--source", "simulated", "--profile", "a100-pcie-4-nvlink"]
    async with running_agent(control_plane, kubeconfig, node, *flags, delete_after=False):
        before = await _until(control_plane, node, _published(4), 15)
    await asyncio.sleep(1.1)  # the new agent's own first scan is a later second
    async with running_agent(control_plane, kubeconfig, node, *flags) as agent:
        await _until(
            control_plane, node, lambda o: agent.publisher is not None and agent.publisher.ready(), 15
        )
        after = await _get(control_plane, node)
        assert after is not None
        assert [d["idleSince"] for d in after["status"]["devices"]] == [
            d["idleSince"] for d in before["status"]["devices"]
        ]
        assert agent.publisher is not None and agent.publisher.writes["status"] == 0  # nothing changed
