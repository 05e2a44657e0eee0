"""gpualloc.devcluster.images: OCI archives for the real node, and cdi: its GPUs' CDI spec."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile

from gpualloc.devcluster import cdi, images


def _members(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        return {
            m.name: (archive.extractfile(m).read() if m.isfile() else b"")  # type: ignore[union-attr]
            for m in archive.getmembers()
        }


def _blob(members: dict[str, bytes], digest: str) -> bytes:
    return members["blobs/sha256/" + digest.removeprefix("sha256:")]


def test_an_archive_is_an_oci_layout_whose_blobs_match_their_digests_and_whose_index_names_the_image() -> (
    None
):
    members = _members(images.build_archive(images.pause_image(b"\x7fELF pause")))
    index = json.loads(members["index.json"])
    (entry,) = index["manifests"]
    manifest = json.loads(_blob(members, entry["digest"]))
    config = json.loads(_blob(members, manifest["config"]["digest"]))
    layer = _blob(members, manifest["layers"][0]["digest"])

    assert json.loads(members["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    for name, data in members.items():
        if name.startswith("blobs/sha256/") and data:
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    assert entry["annotations"][images.ANNOTATION_CONTAINERD_NAME] == "gpualloc.dev/pause:v1"
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(gzip.decompress(layer)).hexdigest()]
    assert config["config"]["Entrypoint"] == ["/pause"]
    assert _members(gzip.decompress(layer))["pause"] == b"\x7fELF pause"


def test_the_same_inputs_give_the_same_archive_byte_for_byte() -> None:
    image = images.toolbox_image(b"busybox", ["bin/sh", "usr/bin/env"])

    assert images.build_archive(image) == images.build_archive(image)


def test_the_toolbox_links_each_applet_to_busybox_and_has_a_world_writable_tmp() -> None:
    image = images.toolbox_image(b"busybox", ["bin/sh", "/usr/bin/env", "bin/busybox", ""])
    by_path = {entry.path: entry for entry in image.entries}

    assert by_path["bin/busybox"].data == b"busybox"
    assert by_path["bin/sh"].link == "/bin/busybox" and by_path["usr/bin/env"].link == "/bin/busybox"
    assert by_path["tmp"].mode == 0o1777
    assert image.cmd == ("sh",) and image.name == "gpualloc/toolbox:dev"


def test_names_are_normalised_as_containerd_stores_them() -> None:
    assert images.full_name("gpualloc/toolbox:dev") == "docker.io/gpualloc/toolbox:dev"
    assert images.full_name("busybox:1") == "docker.io/library/busybox:1"
    assert images.full_name("ghcr.io/gpualloc/gpualloc:0.1") == "ghcr.io/gpualloc/gpualloc:0.1"
    assert images.full_name("localhost/x:1") == "localhost/x:1"


def test_the_cdi_spec_gives_each_gpu_its_dev_nvidia_minor_from_the_runs_directory_and_nvidiactl_to_all() -> (
    None
):
    gpus = [cdi.Gpu(minor=3, uuid="GPU-b"), cdi.Gpu(minor=0, uuid="GPU-a")]
    spec = cdi.build_spec(gpus, "/state/node/dev/")

    assert spec["kind"] == "gpualloc.dev/gpu"
    assert spec["devices"] == [
        {
            "name": "GPU-a",
            "containerEdits": {
                "deviceNodes": [{"path": "/dev/nvidia0", "hostPath": "/state/node/dev/nvidia0"}]
            },
        },
        {
            "name": "GPU-b",
            "containerEdits": {
                "deviceNodes": [{"path": "/dev/nvidia3", "hostPath": "/state/node/dev/nvidia3"}]
            },
        },
    ]
    assert spec["containerEdits"] == {
        "deviceNodes": [{"path": "/dev/nvidiactl", "hostPath": "/state/node/dev/nvidiactl"}]
    }
    assert cdi.device_name(gpus[0]) == "gpualloc.dev/gpu=GPU-b"
