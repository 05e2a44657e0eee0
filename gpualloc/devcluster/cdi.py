"""The real node's GPUs as CDI devices (Container Device Interface), built as data.

The simulated GPUs have no device files, so the node makes real ones: character devices
with ``/dev/null``'s numbers (opening one is harmless), one per GPU and one for
``nvidiactl``, in a directory the run owns. The spec maps each to the path NVIDIA's own
CDI specs give it inside the container (``/dev/nvidia<minor>``, ``/dev/nvidiactl``) through
``hostPath``, so nothing is created under the host's ``/dev`` (where a machine with real
GPUs keeps its own) and a container sees exactly the names a real GPU node gives it.

Devices are named by UUID (gpualloc's identity of a GPU): ``gpualloc.dev/gpu=GPU-...``.
``nvidiactl`` is in the spec's common edits, so every container given a GPU also gets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

CDI_VERSION = "0.6.0"
VENDOR = "gpualloc.dev"
CLASS = "gpu"
KIND = f"{VENDOR}/{CLASS}"
SPEC_DIR = "/var/run/cdi"
SPEC_NAME = f"{VENDOR}-{CLASS}.json"  # CDI's <vendor>-<class> file name convention
CONTROL_DEVICE = "nvidiactl"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """What the spec needs of one GPU."""

    minor: int
    uuid: str


def device_file(minor: int) -> str:
    """The name NVIDIA's driver and CDI specs give GPU ``minor``'s device node."""
    return f"nvidia{minor}"


def device_name(gpu: Gpu) -> str:
    """The fully qualified CDI name a runtime is asked for: ``gpualloc.dev/gpu=GPU-...``."""
    return f"{KIND}={gpu.uuid}"


def build_spec(gpus: Sequence[Gpu], host_dir: str) -> dict[str, Any]:
    """The CDI spec: one device per GPU (its ``/dev/nvidia<minor>``), ``/dev/nvidiactl`` for all;
    the device files themselves live in ``host_dir``."""
    host = host_dir.rstrip("/")

    def node(name: str) -> dict[str, Any]:
        return {"path": f"/dev/{name}", "hostPath": f"{host}/{name}"}

    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": [
            {"name": gpu.uuid, "containerEdits": {"deviceNodes": [node(device_file(gpu.minor))]}}
            for gpu in sorted(gpus, key=lambda g: g.minor)
        ],
        "containerEdits": {"deviceNodes": [node(CONTROL_DEVICE)]},
    }
