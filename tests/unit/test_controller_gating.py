"""PodGate lifts a pod's gate on the claim the API server holds now, not on the controller's cache."""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Iterator
from typing import Any

from controller.gating import PodGate
from controller.writer import Writer
from gpualloc.api import codecs, constants, models
from gpualloc.kube import errors

NS = "ml"
OLD = "GPU-00000000-0000-0000-0000-00000000000a"
NEW = "GPU-00000000-0000-0000-0000-00000000000b"


def raw_claim(uid: str, uuid: str, *, releasing: bool = False) -> dict[str, Any]:
    body = codecs.claim_body("train", models.GpuClaimSpec(devices=models.DeviceRequest(count=1)), NS)
    body["metadata"].update(uid=uid, resourceVersion="7")
    body["status"] = {
        "phase": constants.PHASE_ALLOCATED,
        "allocations": [
            {"replica": 0, "nodeName": "n1", "devices": [{"index": 0, "minor": 0, "uuid": uuid}]}
        ],
        "conditions": [
            {
                "type": constants.CONDITION_RELEASING,
                "status": "True" if releasing else "False",
                "reason": "PodsCompleted",
                "message": "",
                "lastTransitionTime": "2026-11-26T00:00:00Z",
            }
        ],
    }
    return body


def gated_pod(name: str, devices: str | None) -> dict[str, Any]:
    annotations = {constants.ANNOTATION_CLAIM: "train"}
    if devices is not None:  # admitted for an Allocated claim: the webhook wrote the devices
        annotations[constants.ANNOTATION_DEVICES] = devices
    return {
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "spec": {"schedulingGates": [{"name": constants.SCHEDULING_GATE}]},
    }


class FakeCluster:
    def __init__(self, claim: dict[str, Any] | None) -> None:
        self.claim = claim
        self.patched: list[str] = []

    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        if self.claim is None:
            raise errors.NotFound(404, "NotFound", f'gpuclaims "{name}" not found')
        return copy.deepcopy(self.claim)

    async def patch_pod(self, namespace: str, name: str, operations: list[dict[str, Any]]) -> dict[str, Any]:
        self.patched.append(name)
        return {}


class FakeState:
    def __init__(self, *pods: dict[str, Any]) -> None:
        self.pods = {f"{NS}/{p['metadata']['name']}": p for p in pods}

    def gated_pods(self, claim_key: str) -> Iterator[tuple[str, dict[str, Any]]]:
        yield from self.pods.items()


def ungate(
    cached: dict[str, Any], current: dict[str, Any] | None, *pods: dict[str, Any]
) -> tuple[FakeCluster, list[tuple[str, str]], list[str]]:
    """Run one un-gating pass with ``cached`` in the controller's cache and ``current`` in the API
    server; the cluster, the (pod, message) warnings and the claim keys requeued."""
    cluster = FakeCluster(current)
    warnings: list[tuple[str, str]] = []
    requeued: list[str] = []
    state = FakeState(*pods)
    writer = Writer(
        cluster,  # type: ignore[arg-type]
        state,  # type: ignore[arg-type]
        emit=lambda pod, reason, message, type_: warnings.append((pod["metadata"]["name"], message)),
        requeue=lambda key, delay: requeued.append(key),
        rng=random.Random(0),
    )
    gate = PodGate(
        cluster,  # type: ignore[arg-type]
        state,  # type: ignore[arg-type]
        writer,
        requeue=lambda key, delay: requeued.append(key),
        event_interval=60.0,
    )
    asyncio.run(gate.ungate(codecs.parse_claim(cached)))
    return cluster, warnings, requeued


def test_devices_are_checked_against_the_api_servers_claim_not_the_cache() -> None:
    # The cache still shows the claim on OLD; the API server has it on NEW (moved off a lost
    # node, say). A pod admitted with OLD stays gated; a pod admitted before allocation gets NEW.
    cluster, warnings, _ = ungate(
        raw_claim("uid-1", OLD), raw_claim("uid-1", NEW), gated_pod("stale", OLD), gated_pod("waiting", None)
    )
    assert cluster.patched == ["waiting"]
    ((pod, message),) = warnings
    assert pod == "stale" and "out-of-date view" in message and NEW in message


def test_a_claim_the_api_server_shows_releasing_deleted_or_replaced_releases_no_pod() -> None:
    cached = raw_claim("uid-1", OLD)
    for current in (raw_claim("uid-1", OLD, releasing=True), raw_claim("uid-2", OLD), None):
        cluster, warnings, requeued = ungate(cached, current, gated_pod("p", OLD))
        assert cluster.patched == [] and warnings == []
        assert requeued == ([] if current is None else [f"{NS}/train"])


def test_the_same_claim_with_the_same_devices_releases_the_pod() -> None:
    cluster, warnings, _ = ungate(raw_claim("uid-1", OLD), raw_claim("uid-1", OLD), gated_pod("p", OLD))
    assert cluster.patched == ["p"] and warnings == []
