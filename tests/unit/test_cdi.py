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


def test_a_mig_instance_gets_its_gpus_node_then_its_gpu_and_compute_instance_caps() -> None:
    gpu = cdi.Gpu(
        minor=2,
        uuid="GPU-a",
        migs=(cdi.Mig(uuid="MIG-1", caps=(291, 292)), cdi.Mig(uuid="MIG-2", caps=(300, 301))),
    )

    spec = cdi.build_spec([gpu], None)

    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    # NVIDIA's spec orders a MIG device's nodes so: parent, GPU instance cap, compute instance cap.
    assert by_name == {
        "GPU-a": [{"path": "/dev/nvidia2"}],
        "MIG-1": [
            {"path": "/dev/nvidia2"},
            {"path": "/dev/nvidia-caps/nvidia-cap291"},
            {"path": "/dev/nvidia-caps/nvidia-cap292"},
        ],
        "MIG-2": [
            {"path": "/dev/nvidia2"},
            {"path": "/dev/nvidia-caps/nvidia-cap300"},
            {"path": "/dev/nvidia-caps/nvidia-cap301"},
        ],
    }


def test_a_mig_instance_whose_caps_are_not_known_gets_its_gpus_node_only() -> None:
    spec = cdi.build_spec([cdi.Gpu(minor=0, uuid="GPU-a", migs=(cdi.Mig(uuid="MIG-1"),))], None)

    assert spec["devices"][1] == {
        "name": "MIG-1",
        "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]},
    }


def test_with_a_host_dir_the_caps_are_read_from_its_nvidia_caps_folder() -> None:
    gpu = cdi.Gpu(minor=1, uuid="GPU-a", migs=(cdi.Mig(uuid="MIG-1", caps=(12, 13)),))

    spec = cdi.build_spec([gpu], "/run/node/dev/")

    assert spec["devices"][1]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia1", "hostPath": "/run/node/dev/nvidia1"},
        {"path": "/dev/nvidia-caps/nvidia-cap12", "hostPath": "/run/node/dev/nvidia-caps/nvidia-cap12"},
        {"path": "/dev/nvidia-caps/nvidia-cap13", "hostPath": "/run/node/dev/nvidia-caps/nvidia-cap13"},
    ]


def test_host_files_lists_each_file_under_the_host_dir_once_and_nothing_outside_it() -> None:
    gpus = [
        cdi.Gpu(minor=0, uuid="GPU-a", migs=(cdi.Mig(uuid="MIG-1", caps=(12, 13)),)),
        cdi.Gpu(minor=1, uuid="GPU-b"),
    ]
    spec = cdi.build_spec(gpus, "/run/node/dev")
    spec["devices"].append(
        {"name": "odd", "containerEdits": {"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/x"}]}}
    )
    spec["devices"].append(
        {
            "name": "escape",
            "containerEdits": {"deviceNodes": [{"path": "/dev/y", "hostPath": "/run/node/dev/../../etc/y"}]},
        }
    )

    assert cdi.host_files(spec, "/run/node/dev") == [
        "nvidiactl",
        "nvidia0",
        "nvidia-caps/nvidia-cap12",
        "nvidia-caps/nvidia-cap13",
        "nvidia1",
    ]


def test_qualified_names_are_kind_equals_uuid_for_gpualloc_and_nvidia_specs() -> None:
    assert cdi.qualified_name("GPU-a") == "gpualloc.dev/gpu=GPU-a"
    assert cdi.qualified_name("MIG-1", cdi.NVIDIA_KIND) == "nvidia.com/gpu=MIG-1"


def test_the_dev_cluster_uses_the_shared_builder_not_a_copy() -> None:
    assert devcluster_cdi.build_spec is cdi.build_spec
    assert devcluster_cdi.Gpu is cdi.Gpu
