"""Fixtures of the integration tests that need more than the shared control plane."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gpualloc.kube.client import Api
from tests.integration.controller_support import KwokGpuNodes, fresh_gpu_node


@pytest.fixture
async def gpu_node(api: Api) -> AsyncIterator[tuple[str, str]]:
    """One 8-GPU node labelled with a fresh run tag, deleted after the test; (node name, run tag)."""
    async with fresh_gpu_node(api, "gpu-{run}-a") as node:
        yield node


@pytest.fixture
async def kcm_node(api: Api, control_plane: Any) -> AsyncIterator[tuple[str, str]]:
    """A GPU node labelled with a fresh run tag, kube-controller-manager running (Jobs, the
    garbage collector, the disruption controller); (node name, run tag)."""
    control_plane.ensure_controller_manager()
    async with fresh_gpu_node(api, "kcm-{run}") as node:
        yield node


@pytest.fixture
async def kwok_gpu_nodes(api: Api, control_plane: Any) -> AsyncIterator[KwokGpuNodes]:
    """kube-scheduler, kube-controller-manager (Jobs) and kwok running, and a maker of this test's
    kwok GPU nodes (allocatable chosen, tainted for this test's run), deleted after the test."""
    for start in (
        control_plane.ensure_controller_manager,
        control_plane.ensure_scheduler,
        control_plane.ensure_kwok,
    ):
        await asyncio.to_thread(start)
    nodes = KwokGpuNodes(control_plane, api, uuid.uuid4().hex[:8])
    try:
        yield nodes
    finally:
        await nodes.delete_all()
