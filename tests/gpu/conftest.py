"""Fixtures for the tests that need a real NVIDIA GPU.

``control_plane`` is overridden here for two reasons:

* a GPU machine usually has no Go toolchain, so only the two binaries the API
  server needs (etcd, kube-apiserver) are required; they can be built elsewhere
  and placed in ``$GPUALLOC_CACHE_DIR/bin/`` (see ``gpualloc dev build``);
* on a machine without a GPU these tests skip before any control plane starts.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import running_control_plane
from tests.gpu import smi


@pytest.fixture(scope="session")
def nvml_available() -> None:
    """Skip, naming NVML's error, where NVML cannot be initialised (no driver, no GPU)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as exc:
        pytest.skip(f"pynvml.nvmlInit() failed, so there is no usable NVIDIA GPU here: {exc}")


@pytest.fixture(scope="session")
def control_plane(
    nvml_available: None, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """etcd + kube-apiserver with the CRDs applied; the GPU tests need nothing else."""
    yield from running_control_plane(request, tmp_path_factory, ["etcd", "kube-apiserver"])


@pytest.fixture(scope="session")
def smi_xml(nvml_available: None) -> ET.Element:
    """``nvidia-smi -q -x``, parsed."""
    return ET.fromstring(smi.run("-q", "-x"))
