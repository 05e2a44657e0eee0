"""The agent's command line, NVML init failure handling, leases and metrics (no API server)."""

from __future__ import annotations

import asyncio
import datetime
import types
from typing import Any

import prometheus_client
import pytest

from agent import health, inventory, main, nvml, simulated
from gpualloc.api import constants, models
from gpualloc.api import leases as lease_format
from tests.unit import fake_pynvml as fake


def test_flags_read_the_environment_and_the_downward_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")
    monkeypatch.setenv("POD_NAMESPACE", "gpualloc-system")
    monkeypatch.setenv("GPUALLOC_HEARTBEAT_INTERVAL", "12")
    monkeypatch.setenv("GPUALLOC_SOURCE", "simulated")
    monkeypatch.setenv("GPUALLOC_IGNORED_XIDS", "13,43")
    args = main.parse_args([])
    assert (args.node_name, args.lease_namespace, args.heartbeat_interval) == (
        "gpu-node-7",
        "gpualloc-system",
        12.0,
    )
    assert args.source == "simulated"
    assert args.ignored_xids == frozenset({13, 43})
    args = main.parse_args(["--heartbeat-interval", "5", "--node-name", "other"])
    assert (args.heartbeat_interval, args.node_name) == (5.0, "other")  # the flag wins


def test_defaults_match_the_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("NODE_NAME", "POD_NAMESPACE"):
        monkeypatch.delenv(name, raising=False)
    args = main.parse_args(["--node-name", "n"])
    assert args.heartbeat_interval == 30.0
    assert args.ignored_xids == frozenset({13, 31, 43, 45, 68, 109})
    assert (args.source, args.fail_on_init_error, args.node_labels) == ("nvml", False, False)
    assert args.lease_namespace is None


def test_node_name_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(SystemExit) as info:
        main.parse_args([])
    assert info.value.code == 2


def test_a_kubelet_root_too_long_for_the_plugin_sockets_is_a_usage_error_that_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = "/var/lib/" + "k" * 100
    with pytest.raises(SystemExit) as info:
        main.parse_args(["--node-name", "n", "--kubelet-plugin", "--kubelet-root", root])
    assert info.value.code == 2
    assert "a unix socket's path is at most 107" in capsys.readouterr().err
    assert main.parse_args(["--node-name", "n", "--kubelet-root", root]).kubelet_root == root  # no plugin


def test_bad_profile_exits_with_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main.runtime_logging, "setup", lambda *args, **kwargs: None)  # keep pytest's logging
    rc = main.main(
        ["--node-name", "n", "--source", "simulated", "--profile", "no-such", "--health-port", "0"]
    )
    assert rc == main.EXIT_USAGE


@pytest.mark.parametrize(
    "flags, namespace",
    [
        (["--lease-namespace", "gpualloc-system"], "gpualloc-system-heartbeats"),  # the chart's default
        (["--lease-namespace", "gpualloc-system", "--heartbeat-namespace", "beats"], "beats"),
        (
            ["--lease-namespace", "gpualloc-system", "--heartbeat-namespace", ""],
            "",
        ),  # the status carries them
        (["--lease-namespace", ""], ""),
    ],
)
def test_the_heartbeat_lease_namespace_follows_the_lease_namespace_unless_given(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], namespace: str
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    args = main.parse_args(["--node-name", "n1", "--source", "simulated", *flags])
    assert main.Agent(args).heartbeat_namespace() == namespace


def _nvml_agent(machine: fake.FakeMachine, *extra: str) -> tuple[main.Agent, fake.FakeNvml]:
    lib = fake.FakeNvml(machine)
    args = main.parse_args(["--node-name", "n1", "--health-port", "0", "--metrics-port", "0", *extra])
    return main.Agent(args, source=nvml.NvmlSource(nvml_module=lib, sysfs_root="/nonexistent")), lib


async def test_fail_on_init_error_exits_non_zero_when_nvml_is_missing() -> None:
    machine = fake.h100_nvswitch_box()
    machine.init_error = fake.NVML_ERROR_LIBRARY_NOT_FOUND
    agent, _ = _nvml_agent(machine, "--fail-on-init-error")
    rc = await asyncio.wait_for(agent.run(asyncio.Event()), 10)
    assert rc == main.EXIT_INIT_FAILED == 1


async def test_nvml_init_failure_publishes_nvml_ready_false_and_recovers_on_retry() -> None:
    machine = fake.h100_nvswitch_box()
    machine.init_error = fake.NVML_ERROR_LIBRARY_NOT_FOUND
    agent, lib = _nvml_agent(machine)
    assert not await agent.scan_once()
    inv = agent.desired()
    conds = {c.type: c for c in inv.conditions}
    assert conds[constants.CONDITION_NVML_READY].status == "False"
    assert "NVML Shared Library Not Found" in conds[constants.CONDITION_NVML_READY].message
    assert conds[constants.CONDITION_READY].status == "False"
    assert inv.devices == () and inv.source == "nvml"
    machine.init_error = None
    assert await agent.scan_once()
    conds = {c.type: c for c in agent.desired().conditions}
    assert conds[constants.CONDITION_NVML_READY].status == "True"
    assert len(agent.desired().devices) == 8
    assert agent._event_thread is not None and agent._event_thread.alive  # health events watched
    await agent._stop_event_thread()
    assert lib.init_calls == 2


async def test_nvml_events_reach_the_published_status() -> None:
    machine = fake.h100_nvswitch_box()
    agent, lib = _nvml_agent(machine)
    assert await agent.scan_once()
    try:
        lib.inject_xid(6, 79)
        lib.inject_xid(5, 31)  # application XID
        for _ in range(100):
            if agent.desired().healthy == 7:
                break
            await asyncio.sleep(0.02)
        devices = agent.desired().devices
        assert (devices[6].health, devices[6].health_reason) == ("Unhealthy", "XID 79")
        assert devices[5].health == "Healthy"
        assert agent.wake.is_set()
    finally:
        await agent._stop_event_thread()


def _sim_agent(*extra: str) -> main.Agent:
    args = main.parse_args(
        [
            "--node-name",
            "sim-1",
            "--source",
            "simulated",
            "--profile",
            "a100-pcie-4-nvlink",
            "--health-port",
            "0",
            *extra,
        ]
    )
    return main.Agent(args)


async def test_leases_of_this_nodes_devices_set_allocated_and_the_lease_gauges() -> None:
    agent = _sim_agent()
    await agent.scan_once()
    uuids = [d.uuid for d in agent.desired().devices]
    lease = {
        "metadata": {
            "name": constants.lease_name(uuids[1]),
            "labels": {
                constants.LABEL_NODE: "sim-1",
                constants.LABEL_CLAIM_NAMESPACE: "team-a",
                constants.LABEL_CLAIM_NAME: "train",
                constants.LABEL_CLAIM_UID: "uid-1",
            },
        },
        "spec": {"holderIdentity": "uid-1"},
    }
    stranger = {"metadata": {"name": "gpu-not-ours"}, "spec": {}}
    agent.leases = types.SimpleNamespace(cache={"ns/a": lease, "ns/b": stranger})  # type: ignore[assignment]
    agent.wake.clear()
    agent._on_lease("ADDED", lease)
    assert agent.wake.is_set()
    inv = agent.desired()
    assert inv.allocated == 1
    text = prometheus_client.generate_latest(agent.metrics.registry).decode()
    assert (
        f'gpualloc_gpu_lease_info{{claim_name="train",claim_namespace="team-a",claim_uid="uid-1",gpu="1",'
        f'node="sim-1",product="NVIDIA A100 80GB PCIe",uuid="{uuids[1]}"}} 1.0'
    ) in text
    assert (
        f'gpualloc_gpu_allocated{{gpu="0",node="sim-1",product="NVIDIA A100 80GB PCIe",'
        f'uuid="{uuids[0]}"}} 0.0' in text
    )


def _slot_lease(uuid: str, slot: int, claim: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": constants.lease_name(constants.slot_id(uuid, slot)),
            "labels": {constants.LABEL_NODE: "sim-1", constants.LABEL_CLAIM_NAME: claim},
        },
        "spec": {"holderIdentity": f"uid-{claim}"},
    }


async def test_slot_leases_of_a_shared_gpu_are_counted_in_use_and_the_gpu_allocated() -> None:
    agent = _sim_agent("--sharing", "MPS:4")
    await agent.scan_once()
    gpu = agent.desired().devices[2]
    assert gpu.sharing == models.DeviceSharing(strategy="MPS", replicas=4)
    held = {f"ns/{k}": _slot_lease(gpu.uuid, k, f"c{k}") for k in (0, 3)}
    agent.leases = types.SimpleNamespace(cache=held)  # type: ignore[assignment]
    agent._on_lease("ADDED", held["ns/0"])
    inv = agent.desired()
    assert inv.devices[2].sharing == models.DeviceSharing(strategy="MPS", replicas=4, in_use=2)
    assert inv.allocated == 1


@pytest.mark.parametrize(
    ("label", "flag", "want"),
    [
        ("TimeSlicing-2", "MPS:4", models.DeviceSharing(strategy="TimeSlicing", replicas=2)),
        ("None", "MPS:4", None),
        ("Fair-2", "MPS:4", models.DeviceSharing(strategy="MPS", replicas=4)),  # wrong: the flag stays
        (None, "MPS:4", models.DeviceSharing(strategy="MPS", replicas=4)),
    ],
)
async def test_the_nodes_sharing_label_overrides_the_flag(
    label: str | None, flag: str, want: models.DeviceSharing | None
) -> None:
    agent = _sim_agent("--sharing", flag)
    labels = {constants.LABEL_SHARING: label} if label is not None else {}

    async def node(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": labels}}

    agent.lookup_node = node  # type: ignore[method-assign]
    await agent.read_sharing_label()
    assert agent.sharing == want


async def test_metrics_expose_dcgm_like_per_gpu_gauges_health_and_scan_histogram() -> None:
    agent = _sim_agent()
    await agent.scan_once()
    agent.on_health_event(
        health.HealthEvent(uuid=agent.desired().devices[2].uuid, kind=health.KIND_XID, xid=79)
    )
    agent.desired()
    text = prometheus_client.generate_latest(agent.metrics.registry).decode()
    for name in (
        "gpualloc_gpu_utilization_percent",
        "gpualloc_gpu_memory_used_bytes",
        "gpualloc_gpu_memory_total_bytes",
        "gpualloc_gpu_temperature_celsius",
        "gpualloc_gpu_power_watts",
    ):
        assert sum(1 for line in text.splitlines() if line.startswith(name + "{")) == 4, name
    health_lines = [line for line in text.splitlines() if line.startswith("gpualloc_gpu_health{")]
    assert sorted(line.rsplit(" ", 1)[1] for line in health_lines) == ["0.0", "1.0", "1.0", "1.0"]
    assert 'gpu="2"' in next(line for line in health_lines if line.endswith(" 0.0"))
    assert "gpualloc_agent_scan_duration_seconds_count 1.0" in text
    assert "gpualloc_agent_publish_errors_total 0.0" in text
    assert 'gpualloc_agent_nvml_ready{node="sim-1"} 1.0' in text


async def test_simulated_agent_lost_injection_is_rescanned_and_published_lost(tmp_path: Any) -> None:
    agent = _sim_agent()
    await agent.scan_once()
    assert isinstance(agent.source, simulated.SimulatedSource)
    agent.source.lose(3)
    await agent.scan_once()
    device = agent.desired().devices[3]
    assert (device.health, device.health_reason) == ("Unhealthy", "lost: missing from re-scan")
    conds = {c.type: c for c in agent.desired().conditions}
    assert conds[constants.CONDITION_DEVICES_LOST].status == "True"


async def test_an_unexpected_scan_error_is_published_not_fatal() -> None:
    agent = _sim_agent()

    def broken() -> Any:
        raise RuntimeError("driver returned garbage")

    agent.source.scan = broken  # type: ignore[method-assign]
    assert not await agent.scan_once()
    ready = {c.type: c for c in agent.desired().conditions}[constants.CONDITION_READY]
    assert ready.status == "False"
    assert "driver returned garbage" in ready.message


async def test_a_scan_audits_the_gpu_processes_into_the_status_and_the_metric() -> None:
    agent = _sim_agent()
    await agent.scan_once()
    uuids = [d.uuid for d in agent.desired().devices]
    listed = asyncio.Event()
    agent.leases = types.SimpleNamespace(cache={"ns/a": _whole_lease(uuids[0])}, synced=listed)  # type: ignore[assignment]
    agent._recount_leases()
    assert isinstance(agent.source, simulated.SimulatedSource)
    agent.source.set_processes({0: [inventory.GpuProcess(pid=5)], 3: [inventory.GpuProcess(pid=4242)]})
    await agent.scan_once()
    assert agent.desired().unexpected_processes == ()  # the Leases are not listed yet: no false alarm
    listed.set()
    await agent.scan_once()
    # GPU 0 is held (its pod cannot be told: not judged); nobody holds GPU 3.
    assert agent.desired().unexpected_processes == (
        models.UnexpectedProcess(index=3, uuid=uuids[3], pid=4242, reason="no claim holds GPU 3"),
    )
    text = prometheus_client.generate_latest(agent.metrics.registry).decode()
    assert (
        'gpualloc_gpu_unexpected_processes{gpu="3",node="sim-1",product="NVIDIA A100 80GB PCIe",'
        f'uuid="{uuids[3]}"}} 1.0' in text
    )
    agent.source.set_processes({})
    await agent.scan_once()
    assert agent.desired().unexpected_processes == ()


def _whole_lease(uuid: str) -> dict[str, Any]:
    """A whole-GPU Lease of ``uuid`` held by team/train."""
    return {
        "metadata": {
            "name": constants.lease_name(uuid),
            "labels": {constants.LABEL_NODE: "sim-1", constants.LABEL_CLAIM_NAME: "train"},
        },
        "spec": {"holderIdentity": "uid-train"},
    }


async def test_a_share_ledger_marks_its_gpu_allocated_and_names_every_sharer() -> None:
    agent = _sim_agent()
    await agent.scan_once()
    uuid = agent.desired().devices[1].uuid
    entries = {
        f"uid-{name}": lease_format.share_entry(
            milli=milli, claim_namespace="team-a", claim_name=name, claim_resource_version="1"
        )
        for name, milli in (("infer", 300), ("train", 600))
    }
    ledger = lease_format.share_lease(
        "ns", uuid=uuid, node="sim-1", entries=entries, now=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    )
    agent.leases = types.SimpleNamespace(cache={"ns/a": ledger})  # type: ignore[assignment]
    agent._on_lease("ADDED", ledger)
    assert agent.desired().allocated == 1
    assert [h.claim_name for h in agent.metrics.shares[uuid]] == ["infer", "train"]
    text = prometheus_client.generate_latest(agent.metrics.registry).decode()
    for name in ("infer", "train"):
        assert (
            f'gpualloc_gpu_lease_info{{claim_name="{name}",claim_namespace="team-a",claim_uid="uid-{name}"'
            in text
        )
