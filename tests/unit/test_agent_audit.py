"""The usage audit (agent.audit) and how a process's pod is told from its cgroup."""

from __future__ import annotations

import pytest

from agent import audit, inventory, simulated
from agent.metrics import LeaseHolder
from gpualloc.api import constants, models

POD_A = "0c4b7a8e-1111-4222-8333-944455556666"
POD_B = "7f1e2d3c-aaaa-4bbb-8ccc-dddd0000eeee"


def gpus(sharing: models.DeviceSharing | None = None) -> tuple[models.Device, ...]:
    source = simulated.SimulatedSource(simulated.load_profile("a100-pcie-4-nvlink"), "n1")
    return inventory.derive(source.scan(), sharing=sharing).devices


def sample(device: models.Device, *processes: inventory.GpuProcess) -> inventory.DeviceSample:
    return inventory.DeviceSample(index=device.index, uuid=device.uuid, processes=processes)


def holder(name: str) -> LeaseHolder:
    return LeaseHolder(claim_namespace="team", claim_name=name, claim_uid=f"uid-{name}")


PODS = {
    POD_A: audit.PodRef(namespace="team", name="train-0", claim="train"),
    POD_B: audit.PodRef(namespace="team", name="sneaky", claim=""),
}


def test_a_process_on_a_gpu_no_claim_holds_is_unexpected_whatever_it_is() -> None:
    devices = gpus()
    found = audit.unexpected(
        devices,
        [sample(devices[2], inventory.GpuProcess(pid=4242))],
        {devices[0].uuid: holder("train")},
        PODS,
    )
    assert found == [
        models.UnexpectedProcess(index=2, uuid=devices[2].uuid, pid=4242, reason="no claim holds GPU 2")
    ]
    assert audit.describe(found[0]) == f"process 4242 on GPU 2 ({devices[2].uuid}): no claim holds GPU 2"


def test_the_holding_claims_pod_is_expected_and_another_pod_is_not() -> None:
    devices = gpus()
    held = {devices[0].uuid: holder("train")}
    mine = inventory.GpuProcess(pid=10, pod_uid=POD_A)
    theirs = inventory.GpuProcess(pid=11, pod_uid=POD_B)
    stranger = inventory.GpuProcess(pid=12, pod_uid="99999999-9999-4999-8999-999999999999")
    unknown = inventory.GpuProcess(pid=13)  # no pod known (no hostPID, or the MPS server)
    found = audit.unexpected(devices, [sample(devices[0], mine, theirs, stranger, unknown)], held, PODS)
    assert [(p.pid, p.pod, p.reason) for p in found] == [
        (11, "team/sneaky", "its pod team/sneaky has no claim; GPU 0 is held by team/train"),
        (
            12,
            "",
            "its pod (uid 99999999-9999-4999-8999-999999999999) is not a pod on this node; "
            "GPU 0 is held by team/train",
        ),
    ]
    # Without the pods (not tracked), only a GPU no claim holds can be judged.
    assert audit.unexpected(devices, [sample(devices[0], theirs)], held, None) == []


def test_a_shared_gpus_slots_count_as_holding_it_for_each_of_their_claims() -> None:
    devices = gpus(models.DeviceSharing(strategy="MPS", replicas=2))
    gpu = devices[1]
    held = {constants.slot_id(gpu.uuid, 0): holder("infer"), constants.slot_id(gpu.uuid, 1): holder("train")}
    ok = inventory.GpuProcess(pid=20, pod_uid=POD_A)  # a pod of team/train, one of the two sharers
    assert audit.unexpected(devices, [sample(gpu, ok)], held, PODS) == []
    (found,) = audit.unexpected(
        devices, [sample(gpu, inventory.GpuProcess(pid=21, pod_uid=POD_B))], held, PODS
    )
    assert found.reason == "its pod team/sneaky has no claim; GPU 1 is held by team/infer, team/train"


@pytest.mark.parametrize(
    ("cgroup", "uid"),
    [
        # cgroup v2, systemd driver: the UID's dashes are underscores
        (
            "0::/kubepods.slice/kubepods-burstable.slice/"
            f"kubepods-burstable-pod{POD_A.replace('-', '_')}.slice/cri-containerd-abc.scope\n",
            POD_A,
        ),
        # cgroup v1, cgroupfs driver
        (
            f"12:memory:/kubepods/besteffort/pod{POD_B}/0123abcd\n11:cpu:/kubepods/besteffort/pod{POD_B}/0123\n",
            POD_B,
        ),
        ("0::/system.slice/nvidia-persistenced.service\n", ""),  # not in a pod
        ("", ""),
    ],
)
def test_a_processs_pod_is_told_from_its_cgroup(cgroup: str, uid: str) -> None:
    assert inventory.pod_uid_of_cgroup(cgroup) == uid


def test_injected_processes_are_the_ones_the_file_lists_now() -> None:
    source = simulated.SimulatedSource(simulated.load_profile("a100-pcie-4-nvlink"), "n1")
    rescans: list[str] = []
    watcher = simulated.InjectionWatcher(
        "/nonexistent", source, on_event=lambda e: None, on_rescan=lambda: rescans.append("x")
    )
    lines = simulated.parse_injections(f"2 process 4242 {POD_A.upper()}\n1 process 7\n1 process x # bad\n")
    assert [(i.index, i.process) for i in lines] == [
        (2, inventory.GpuProcess(pid=4242, pod_uid=POD_A)),
        (1, inventory.GpuProcess(pid=7)),
    ]
    watcher.apply(lines)
    by_index = {s.index: s.processes for s in source.samples()}
    assert by_index[2] == (inventory.GpuProcess(pid=4242, pod_uid=POD_A),) and by_index[0] == ()
    assert rescans == ["x"]
    watcher.apply(lines)  # the same again: nothing changed, no rescan
    assert rescans == ["x"]
    watcher.apply(simulated.parse_injections("1 process 7\n"))  # 4242 has exited
    assert {s.index: s.processes for s in source.samples()}[2] == ()


def test_every_claim_with_a_milli_share_of_a_gpu_holds_it_for_the_audit() -> None:
    devices = gpus()
    gpu = devices[0]
    held = {gpu.uuid: holder("infer")}  # the ledger's first share, as the agent keeps it
    shares = {gpu.uuid: (holder("infer"), holder("train"))}
    ok = inventory.GpuProcess(pid=30, pod_uid=POD_A)  # a pod of team/train, the second sharer
    assert audit.unexpected(devices, [sample(gpu, ok)], held, PODS, shares) == []
    (found,) = audit.unexpected(devices, [sample(gpu, ok)], held, PODS)  # without the ledger's shares
    assert found.reason == "its pod team/train-0 has claim team/train; GPU 0 is held by team/infer"
