"""The steering labels (``--label-free-gpus``): which GPU nodes still have GPUs to give, and which
are already busy.

A loop of its own beside the reconciler (the leader's part), which it never touches. Every
``interval`` seconds it reads the allocator's view of the nodes (``State.node_index``: a GPU
is free when it is healthy, not in MIG mode, not shared and not taken, on a node whose agent is
ready; the node's allocatable and what its pods request) and the labels of the cached Nodes
(``State.facts``), and gives every GPU node (``nodes.steering_labels``):

* ``gpu.scheduling/free-gpus: "true"`` while it has at least one free GPU, ``"shares"`` while it
  has none but a GPU holding fractional shares (``sharing.milli``) has milli-GPU left,
  ``"false"`` otherwise;
* ``gpu.scheduling/busy: "true"`` once its pods request at least 75% of its allocatable CPU
  and memory (averaged), until they request less than 70%, ``"false"`` otherwise (``nodes.busy``;
  none where gpualloc does not know its pods).

Only the labels that differ are written: one JSON merge patch of those labels per node, written
through into the Node cache. A node costs a write each time a label changes value.

What it is for: the chart's ``packing.steerPodsWithoutClaim`` adds to every pod created without
GPUs three preferred node affinity terms: for nodes without ``"true"`` and for nodes with
neither ``"true"`` nor ``"shares"`` (CPU-only nodes, and GPU nodes with no GPU room at all, match
both), so that kube-scheduler does not spread CPU pods over the GPU nodes whose free GPUs, or
room for shares, their CPU and memory would strand; and, weaker, for nodes without ``"true"``
and not ``busy: "false"``, so that among the nodes with only shares' room left it packs them onto
the busy ones instead of spreading them over the emptiest, whose CPU and memory share claims will
need (docs/operations.md, "Steering pods without GPUs"). Writes are counted (``writes``), by
label and value.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from controller import nodes, settings
from controller.state import State
from gpualloc.api import constants, leases
from gpualloc.kube import errors

log = logging.getLogger(__name__)

Obj = dict[str, Any]

INTERVAL = settings.LABEL_INTERVAL


class NodeLabels(Protocol):
    """The call the labeller makes (``cluster.KubeCluster`` has it). Errors are ``gpualloc.kube.errors``."""

    async def patch_node_labels(self, name: str, labels: Mapping[str, str | None]) -> Obj: ...


class Labeller:
    """Keeps every GPU node's steering labels as ``nodes.steering_labels`` says."""

    def __init__(self, cluster: NodeLabels, state: State, *, interval: float = INTERVAL) -> None:
        self.cluster = cluster
        self.state = state
        self.interval = interval
        self.writes: collections.Counter[str] = collections.Counter()  # "free-gpus=true", ...

    def plan(self) -> dict[str, dict[str, str]]:
        """The nodes with a label that differs, and the labels each must get."""
        index = self.state.node_index()
        views = index.views()
        free = {view.name: index.free_gpus(view.name) if view.ready else 0 for view in views}
        room = {
            view.name
            for view in views
            if view.ready and any(u < leases.WHOLE_MILLI for u in view.milli_used.values())
        }
        requested = {v.name: p for v in views if (p := nodes.requested_percent(v)) is not None}
        labels = {name: facts.labels for name, facts in self.state.facts.items()}
        return nodes.steering_labels(free, labels, share_room=room, requested=requested)

    async def label(self) -> None:
        """One pass: write the labels that differ, one patch per node."""
        for name, changed in self.plan().items():
            try:
                answer = await self.cluster.patch_node_labels(name, changed)
            except errors.NotFound:  # deleted meanwhile: its DELETED event follows
                continue
            except errors.KubeError as exc:  # the next pass tries again
                log.warning("labelling a node failed", extra={"node": name, "error": str(exc)})
                continue
            for key, value in changed.items():
                self.writes[f"{key.removeprefix(constants.GROUP + '/')}={value}"] += 1
            self.state.remember("nodes", answer, reconciling="")
            log.debug("node labelled", extra={"node": name, "labels": changed})

    async def run(self) -> None:
        """Label until cancelled (the leader's part). The caches must be running."""
        await self.state.wait_synced()
        while True:
            try:
                await self.label()
            except Exception:  # a bug: logged, and the loop goes on (as the sweep's)
                log.exception("labelling pass failed")
            await asyncio.sleep(self.interval)
