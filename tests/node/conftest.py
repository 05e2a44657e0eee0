"""The real-node tier: tests that run a kubelet and containerd (``gpualloc.devcluster.node``).

Every test here is skipped, with the reason, where a node cannot run on this machine (not root,
no overlayfs: ``node.unable_reason()``); with ``GPUALLOC_REQUIRE_INTEGRATION=1`` (.ci/run) a skip
fails the session, as a skipped integration test does (tests/conftest.py). One real node runs per
machine at a time (a lock), so these modules run one after another.
"""

from __future__ import annotations

import pytest

from gpualloc.devcluster import node


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = node.unable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no real node on this machine: {reason}")
    for item in items:
        if item.get_closest_marker("node") is not None:
            item.add_marker(skip)
