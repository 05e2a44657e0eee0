"""The real node's GPUs as CDI devices: the spec builder is the agent's, ``gpualloc.cdi``.

The node makes the simulated GPUs' device files (``/dev/null``'s numbers) in a directory the run
owns and writes the spec with ``hostPath`` pointing there (``gpualloc.cdi``'s docstring).
"""

from __future__ import annotations

from gpualloc.cdi import (
    CONTROL_DEVICE,
    KIND,
    SPEC_DIR,
    SPEC_NAME,
    Gpu,
    Mig,
    build_spec,
    cap_file,
    device_file,
    device_name,
    host_files,
)

__all__ = [
    "CONTROL_DEVICE",
    "KIND",
    "SPEC_DIR",
    "SPEC_NAME",
    "Gpu",
    "Mig",
    "build_spec",
    "cap_file",
    "device_file",
    "device_name",
    "host_files",
]
