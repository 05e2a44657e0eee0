"""gpualloc.cdi: the node's CDI spec on a real GPU node (the dev node's is in test_devcluster_images)."""

from __future__ import annotations

from gpualloc import cdi
from gpualloc.devcluster import cdi as devcluster_cdi


def test_on_a_gpu_node_the_spec_names_the_hosts_dev_files_without_host_paths() -> None:
    spec = cdi.build_spec(
        [cdi.Gpu(minor=1, uuid="GPU-b")], None, ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
    )

    assert spec["devices"] == [
        {"name": "GPU-b", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}}
    ]
    assert spec["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidiactl"},
        {"path": "/dev/nvidia-uvm"},
        {"path": "/dev/nvidia-uvm-tools"},
    ]


def test_a_mig_instance_is_a_device_of_its_own_named_by_its_uuid_with_its_gpus_device_node() -> None:
    gpu = cdi.Gpu(minor=2, uuid="GPU-a", mig_uuids=("MIG-1", "MIG-2"))

    spec = cdi.build_spec([gpu], None)

    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert by_name == {
        "GPU-a": [{"path": "/dev/nvidia2"}],
        "MIG-1": [{"path": "/dev/nvidia2"}],
        "MIG-2": [{"path": "/dev/nvidia2"}],
    }


def test_qualified_names_are_kind_equals_uuid_for_gpualloc_and_nvidia_specs() -> None:
    assert cdi.qualified_name("GPU-a") == "gpualloc.dev/gpu=GPU-a"
    assert cdi.qualified_name("MIG-1", cdi.NVIDIA_KIND) == "nvidia.com/gpu=MIG-1"


def test_the_dev_cluster_uses_the_shared_builder_not_a_copy() -> None:
    assert devcluster_cdi.build_spec is cdi.build_spec
    assert devcluster_cdi.Gpu is cdi.Gpu
