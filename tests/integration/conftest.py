"""Fixtures of the integration tests that need more than the shared control plane."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpualloc.kube.client import Api
from tests.integration.controller_support import RUN_LABEL, create_gpu_node, delete_gpu_node


@pytest.fixture
async def gpu_node(api: Api) -> AsyncIterator[tuple[str, str]]:
    """One 8-GPU node labelled with a fresh run tag, deleted after the test; (node name, run tag)."""
    run = uuid.uuid4().hex[:8]
    name = f"gpu-{run}-a"
    await create_gpu_node(api, name, labels={RUN_LABEL: run})
    yield name, run
    await delete_gpu_node(api, name)


@pytest.fixture
async def kcm_node(api: Api, control_plane: Any) -> AsyncIterator[tuple[str, str]]:
    """A GPU node labelled with a fresh run tag, kube-controller-manager running (Jobs, the
    garbage collector, the disruption controller); (node name, run tag)."""
    control_plane.ensure_controller_manager()
    run = uuid.uuid4().hex[:8]
    name = f"kcm-{run}"
    await create_gpu_node(api, name, labels={RUN_LABEL: run})
    yield name, run
    await delete_gpu_node(api, name)
