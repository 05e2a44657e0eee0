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

A MIG instance gets, as in NVIDIA's spec (``nvidia-ctk cdi generate``) and in the same order, its
parent GPU's ``/dev/nvidia<minor>``, then ``/dev/nvidia-caps/nvidia-cap<N>`` of its GPU instance and
of its compute instance: N is the capability's minor, which the agent reads from
``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<g>/access`` and ``.../gi<g>/ci<c>/access``
(``DeviceFileMinor``), else from ``/proc/driver/nvidia-caps/mig-minors``, with the instance's ids
from NVML (``agent.nvml.read_mig_caps``). Without those nodes a process in the container sees no
MIG device. Where the agent could not read an instance's minors (``Mig.caps`` is None), the
instance gets its parent's node only, and the agent logs it: a container then cannot use that
instance until they can be read (NVIDIA's own spec, the agent's ``--cdi-mode nvidia``, has them
where ``nvidia-ctk cdi generate`` could read them). The local real node's simulated instances
get files of their own in its directory (``nvidia-caps/nvidia-cap<N>``), as its GPUs do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
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
CAPS_DIR = "nvidia-caps"  # the driver's capability nodes, /dev/nvidia-caps/nvidia-cap<N>


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Mig:
    """What the spec needs of one MIG instance: its UUID and the minors of its GPU instance's and
    compute instance's ``nvidia-cap`` nodes, in that order (None: not known)."""

    uuid: str
    caps: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Gpu:
    """What the spec needs of one GPU: its minor number, its UUID and its MIG instances."""

    minor: int
    uuid: str
    migs: tuple[Mig, ...] = ()


def device_file(minor: int) -> str:
    """The name NVIDIA's driver and CDI specs give GPU ``minor``'s device node."""
    return f"nvidia{minor}"


def cap_file(minor: int) -> str:
    """The name, under ``/dev``, of the MIG capability node of minor ``minor``."""
    return f"{CAPS_DIR}/nvidia-cap{minor}"


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
    GPU's, then its two capability nodes where known), the ``control`` devices for all. With
    ``host_dir`` the device files are read from there (``hostPath``); without, from the host's
    ``/dev``."""

    def node(name: str) -> dict[str, Any]:
        edit = {"path": f"/dev/{name}"}
        if host_dir is not None:
            edit["hostPath"] = f"{host_dir.rstrip('/')}/{name}"
        return edit

    devices: list[dict[str, Any]] = []
    for gpu in sorted(gpus, key=lambda g: g.minor):
        parent = device_file(gpu.minor)
        devices.append({"name": gpu.uuid, "containerEdits": {"deviceNodes": [node(parent)]}})
        for mig in gpu.migs:
            names = [parent, *(cap_file(minor) for minor in mig.caps or ())]
            devices.append({"name": mig.uuid, "containerEdits": {"deviceNodes": [node(n) for n in names]}})
    return {
        "cdiVersion": CDI_VERSION,
        "kind": KIND,
        "devices": devices,
        "containerEdits": {"deviceNodes": [node(name) for name in control]},
    }


def host_files(spec: Mapping[str, Any], host_dir: str) -> list[str]:
    """The device files under ``host_dir`` that ``spec`` names (``hostPath``), relative to it, in
    the order named and each once: what the local real node makes for a spec it did not write."""
    prefix = host_dir.rstrip("/") + "/"
    edits = [spec.get("containerEdits") or {}]
    edits += [device.get("containerEdits") or {} for device in spec.get("devices") or []]
    found: dict[str, None] = {}
    for edit in edits:
        for device_node in edit.get("deviceNodes") or []:
            path = str(device_node.get("hostPath") or "")
            if path.startswith(prefix) and ".." not in path.split("/"):
                found.setdefault(path[len(prefix) :], None)
    return list(found)
