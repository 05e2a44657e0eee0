"""A node's GPUs as CDI devices (Container Device Interface), built as data (pure).

One spec, kind ``gpualloc.dev/gpu``, one device per GPU named by its UUID (gpualloc's identity of
a GPU; ``gpualloc.dev/gpu=GPU-...``) whose device node is ``/dev/nvidia<minor>``, and one per MIG
instance named by the instance's UUID. The control devices (``/dev/nvidiactl``, and on a real GPU
node ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``, ``/dev/nvidia-modeset`` where they exist) are
in the spec's common edits, so every container given a GPU gets them: the names NVIDIA's own CDI
specs give.

Where the device files are:

* on a GPU node, in the host's ``/dev``: the spec names ``/dev/nvidia<minor>`` and the runtime
  reads the device's numbers from it (``host_dir=None``);
* on the local real node (``gpualloc.devcluster.node``), the simulated GPUs have no device files,
  so the node makes real ones (character devices with ``/dev/null``'s numbers, harmless to open)
  in a directory the run owns, and the spec maps each to the container's ``/dev/<name>`` through
  ``hostPath`` (``host_dir=<that directory>``): nothing is made under the host's ``/dev``.

A MIG instance gets its parent GPU's device node. NVIDIA's spec also gives it the
``/dev/nvidia-caps/nvidia-cap<N>`` nodes of its GPU and compute instances (N from
``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/ci<c>/access``); the agent does not know
the instances' GPU and compute instance ids yet, so those are missing here: with MIG, use NVIDIA's
own spec (the agent's ``--cdi-mode nvidia``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

CDI_VERSION = "0.6.0"
VENDOR = "gpualloc.dev"
CLASS = "gpu"
KIND = f"{VENDOR}/{CLASS}"
NVIDIA_KIND = "nvidia.com/gpu"  # ``nvidia-ctk cdi generate``'s: devices named by UUID (and by index)
SPEC_DIR = "/var/run/cdi"
SPEC_NAME = f"{VENDOR}-{CLASS}.json"  # CDI's <vendor>-<class> file name convention
CONTROL_DEVICE = "nvidiactl"
# What a CUDA program opens besides its GPUs, as the driver names them under /dev.
CONTROL_DEVICES = (CONTROL_DEVICE, "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """What the spec needs of one GPU: its minor number, its UUID and its MIG instances' UUIDs."""

    minor: int
    uuid: str
    mig_uuids: tuple[str, ...] = ()


def device_file(minor: int) -> str:
    """The name NVIDIA's driver and CDI specs give GPU ``minor``'s device node."""
    return f"nvidia{minor}"


def qualified_name(uuid: str, kind: str = KIND) -> str:
    """The fully qualified CDI name a runtime is asked for: ``<kind>=<uuid>``."""
    return f"{kind}={uuid}"


def device_name(gpu: Gpu) -> str:
    """GPU ``gpu``'s CDI name in gpualloc's spec: ``gpualloc.dev/gpu=GPU-...``."""
    return qualified_name(gpu.uuid)


def build_spec(
    gpus: Sequence[Gpu], host_dir: str | None, control: Sequence[str] = (CONTROL_DEVICE,)
) -> dict[str, Any]:
    """The CDI spec: one device per GPU (its ``/dev/nvidia<minor>``) and per MIG instance (its
    GPU's), the ``control`` devices for all. With ``host_dir`` the device files are read from
    there (``hostPath``); without, from the host's ``/dev``."""

    def node(name: str) -> dict[str, Any]:
        edit = {"path": f"/dev/{name}"}
        if host_dir is not None:
            edit["hostPath"] = f"{host_dir.rstrip('/')}/{name}"
        return edit

    devices: list[dict[str, Any]] = []
    for gpu in sorted(gpus, key=lambda g: g.minor):
        edits = {"deviceNodes": [node(device_file(gpu.minor))]}
        devices.append({"name": gpu.uuid, "containerEdits": edits})
        devices.extend({"name": mig, "containerEdits": edits} for mig in gpu.mig_uuids)
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": devices,
        "containerEdits": {"deviceNodes": [node(name) for name in control]},
    }
