"""agent.dra: from a ResourceClaim's allocation to the CDI device IDs the kubelet is answered (pure)."""

from __future__ import annotations

from typing import Any

from agent import dra, inventory
from gpualloc import cdi
from gpualloc.api import constants, models

NODE = "gpu-node-1"
GPU_A = "GPU-AAAA1111-0000-0000-0000-000000000001"
GPU_B = "GPU-BBBB2222-0000-0000-0000-000000000002"
MIG_1 = "MIG-CCCC3333-0000-0000-0000-000000000003"
GPUS = [cdi.Gpu(minor=0, uuid=GPU_A), cdi.Gpu(minor=1, uuid=GPU_B, migs=(cdi.Mig(uuid=MIG_1),))]


def result(lock_id: str, *, driver: str = constants.DRA_DRIVER, pool: str = NODE) -> dict[str, str]:
    return {
        "request": constants.DRA_REQUEST,
        "driver": driver,
        "pool": pool,
        "device": constants.dra_device_name(lock_id),
    }


def claim(*results: dict[str, str], uid: str = "uid-1") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team", "name": "train-gpus-0", "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }


def ids(prepared: dra.Prepared) -> list[str]:
    return [i for d in prepared.devices for i in d.cdi_ids]


def test_a_whole_gpu_is_answered_with_its_own_cdi_device_named_by_its_uuid_as_the_spec_spells_it() -> None:
    prepared = dra.prepare(claim(result(GPU_A)), "uid-1", NODE, dra.device_index(GPUS))

    assert prepared.error == ""
    assert ids(prepared) == [f"gpualloc.dev/gpu={GPU_A}"]
    (device,) = prepared.devices
    assert (device.request, device.pool, device.device) == ("gpus", NODE, GPU_A.lower())


def test_a_mig_instance_gets_its_own_device_and_a_shared_gpus_slot_its_gpus() -> None:
    index = dra.device_index(GPUS)
    slot = constants.slot_id(GPU_A, 3)

    prepared = dra.prepare(claim(result(MIG_1), result(slot)), "uid-1", NODE, index)

    assert ids(prepared) == [f"gpualloc.dev/gpu={MIG_1}", f"gpualloc.dev/gpu={GPU_A}"]


def test_in_nvidia_mode_the_devices_are_named_as_nvidia_ctk_names_them() -> None:
    index = dra.device_index(GPUS, "nvidia")

    prepared = dra.prepare(claim(result(GPU_B), result(MIG_1)), "uid-1", NODE, index)

    assert ids(prepared) == [f"nvidia.com/gpu={GPU_B}", f"nvidia.com/gpu={MIG_1}"]


def test_only_the_results_of_this_driver_on_this_node_are_answered() -> None:
    allocation = claim(result(GPU_A), result(GPU_B, driver="other.example.com"), result(GPU_B, pool="node-2"))

    prepared = dra.prepare(allocation, "uid-1", NODE, dra.device_index(GPUS))

    assert ids(prepared) == [f"gpualloc.dev/gpu={GPU_A}"]


def test_a_claim_whose_uid_is_not_the_kubelets_fails() -> None:
    prepared = dra.prepare(claim(result(GPU_A), uid="uid-2"), "uid-1", NODE, dra.device_index(GPUS))

    assert prepared.devices == ()
    assert "uid 'uid-2', not 'uid-1'" in prepared.error


def test_a_claim_not_allocated_or_with_none_of_our_devices_here_fails() -> None:
    index = dra.device_index(GPUS)
    unallocated = {"metadata": {"namespace": "team", "name": "c", "uid": "uid-1"}, "status": {}}

    assert "is not allocated" in dra.prepare(unallocated, "uid-1", NODE, index).error
    elsewhere = dra.prepare(claim(result(GPU_A, pool="node-2")), "uid-1", NODE, index)
    assert "names no device of gpu.gpualloc.dev on node gpu-node-1" in elsewhere.error


def test_a_claim_naming_a_device_the_node_lacks_fails_whole_never_with_part_of_its_gpus() -> None:
    prepared = dra.prepare(
        claim(result(GPU_A), result("GPU-GONE"), result("MIG-GONE-s1")), "uid-1", NODE, dra.device_index(GPUS)
    )

    assert prepared.devices == ()
    assert prepared.error.endswith("does not have: gpu-gone, mig-gone-s1")


def test_the_nodes_gpus_leave_out_lost_ones_and_carry_mig_instances_only_in_mig_mode() -> None:
    mig = models.MigInfo(enabled=True, devices=(models.MigDevice(index=0, uuid=MIG_1, profile="1g.10gb"),))
    off = models.MigInfo(enabled=False, devices=(models.MigDevice(index=0, uuid="MIG-X", profile="1g.10gb"),))
    facts = inventory.NodeFacts(
        source="simulated",
        devices=(
            inventory.DeviceFacts(index=0, minor=0, uuid=GPU_A, mig=off),
            inventory.DeviceFacts(index=1, minor=1, uuid=GPU_B, mig=mig),
            inventory.DeviceFacts(index=2, minor=2, uuid="GPU-LOST", lost="lost: fell off the bus"),
        ),
    )

    assert dra.gpus(facts) == [
        cdi.Gpu(minor=0, uuid=GPU_A),
        cdi.Gpu(minor=1, uuid=GPU_B, migs=(cdi.Mig(uuid=MIG_1),)),
    ]


def test_a_mig_instance_carries_its_cap_minors_only_where_the_source_knows_both() -> None:
    mig = models.MigInfo(
        enabled=True,
        devices=tuple(models.MigDevice(index=j, uuid=f"MIG-{j}", profile="1g.10gb") for j in range(4)),
    )
    instances = (
        inventory.MigInstance(
            uuid="MIG-0", gpu_instance=1, compute_instance=0, gpu_instance_cap=147, compute_instance_cap=148
        ),
        inventory.MigInstance(uuid="MIG-1", gpu_instance=2, compute_instance=0, gpu_instance_cap=156),
        inventory.MigInstance(uuid="MIG-2", gpu_instance=3, compute_instance=0),
    )
    facts = inventory.NodeFacts(
        source="nvml",
        devices=(inventory.DeviceFacts(index=0, minor=1, uuid=GPU_A, mig=mig, mig_instances=instances),),
    )

    assert dra.gpus(facts)[0].migs == (
        cdi.Mig(uuid="MIG-0", caps=(147, 148)),
        cdi.Mig(uuid="MIG-1"),  # one of the two only
        cdi.Mig(uuid="MIG-2"),
        cdi.Mig(uuid="MIG-3"),  # no ids from NVML
    )


def test_health_gives_each_gpus_mig_instances_and_slots_the_health_of_their_gpu() -> None:
    mig = models.MigInfo(enabled=True, devices=(models.MigDevice(index=0, uuid=MIG_1, profile="1g.10gb"),))
    devices = [
        models.Device(
            index=0, minor=0, uuid=GPU_A, sharing=models.DeviceSharing(strategy="TimeSlicing", replicas=2)
        ),
        models.Device(
            index=1, minor=1, uuid=GPU_B, mig=mig, health=constants.UNHEALTHY, health_reason="XID 79"
        ),
    ]

    assert dra.health(devices) == {
        GPU_A.lower(): (True, ""),
        f"{GPU_A.lower()}-s0": (True, ""),
        f"{GPU_A.lower()}-s1": (True, ""),
        GPU_B.lower(): (False, "XID 79"),
        MIG_1.lower(): (False, "XID 79"),
    }
