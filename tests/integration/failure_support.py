"""A GPU failing under an Allocated gang, against the real API server: the scenario that
tests/integration/test_device_failure.py checks and bench/device_failover.py times.

Two simulated 8-GPU agents (in this process, ``--xid-inject-file``) publish two Nodes of one
NVLink clique; a controller runs in this process. A 4-replica gang of 2 GPUs each, with
``onDeviceFailure: Reallocate`` and a grace of 0 s, lands on one node (binpack), one pod per
replica; then XID 79 is injected under replica 2's first GPU, and ``failover`` waits until the
claim lists other GPUs for that replica.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import resources
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.test_agent_apiserver import running_agent

CLIQUE = "example.com/clique"
REPLICAS = 4
FAILED_REPLICA = 2

Obj = dict[str, Any]


def gang(run: str, name: str = "gang", *, grace: int = 0) -> Obj:
    body = support.claim_body(name, 2, run=run, replicas=REPLICAS)
    body["spec"]["onDeviceFailure"] = constants.DEVICE_FAILURE_REALLOCATE
    body["spec"]["deviceFailureGracePeriodSeconds"] = grace
    body["spec"]["topology"] = {"sameNodeLabel": CLIQUE}
    return body


def replica_pod(run: str, replica: int) -> Obj:
    """A pod of the gang's replica (never scheduled here: a pod that names the claim uses it)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"gang-{replica}",
            "labels": {support.RUN_LABEL: run, "replica": str(replica)},
            "annotations": {constants.ANNOTATION_CLAIM: "gang", constants.ANNOTATION_REPLICA: str(replica)},
        },
        "spec": {"containers": [{"name": "main", "image": support.PAUSE_IMAGE}]},
    }


def by_replica(claim: Obj) -> dict[int, Obj]:
    return {a["replica"]: a for a in claim["status"]["allocations"]}


async def moved_off(api: Api, namespace: str, replica: int, uuid_: str) -> Obj | None:
    """The gang once its ``replica`` lists GPUs and ``uuid_`` is not one of them, else None."""
    claim = await support.get_claim(api, namespace, "gang")
    devices = by_replica(claim).get(replica, {}).get("devices", []) if claim else []
    uuids = {d["uuid"] for d in devices}
    return claim if uuids and uuid_ not in uuids else None


async def leases_by_name(api: Api, namespace: str) -> dict[str, Obj]:
    return {lease["metadata"]["name"]: lease for lease in await support.device_leases(api, namespace)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Clique:
    run: str
    nodes: list[str]
    xid_files: dict[str, Path]  # node -> its agent's injection file


@contextlib.asynccontextmanager
async def clique_of_two(
    api: Api, control_plane: Any, kubeconfig: str, tmp_path: Path
) -> AsyncIterator[Clique]:
    """Two ready Nodes of one clique, each published by a simulated agent that reads its own XID
    injection file."""
    run = uuid.uuid4().hex[:8]
    nodes = [f"fail-{run}-{i}" for i in range(2)]
    files = {node: tmp_path / f"xids-{node}" for node in nodes}
    async with contextlib.AsyncExitStack() as stack:
        for node in nodes:
            labels = {constants.HOSTNAME_LABEL: node, support.RUN_LABEL: run, CLIQUE: "a"}
            await support.create_ready_node(api, node, labels)
            flags = [
                "--source",
                "simulated",
                "--profile",
                "h100-sxm-8",
                "--xid-inject-file",
                str(files[node]),
            ]
            await stack.enter_async_context(running_agent(control_plane, kubeconfig, node, *flags))
        yield Clique(run=run, nodes=nodes, xid_files=files)


async def fail(clique: Clique, claim: Obj, replica: int) -> Obj:
    """Inject XID 79 under the first GPU of the claim's ``replica``; that GPU (a device entry)."""
    victim = by_replica(claim)[replica]
    bad: Obj = victim["devices"][0]
    clique.xid_files[victim["nodeName"]].write_text(f"{bad['index']} 79\n")
    return bad


@dataclasses.dataclass(frozen=True, kw_only=True)
class Failover:
    before: Obj  # the claim before the XID
    after: Obj  # the claim once the failed replica lists other GPUs
    leases: dict[str, Obj]  # the device Leases before the XID, by name
    pods: dict[int, Obj]  # replica -> its pod as created
    seconds: float  # from writing the XID to reading the new allocation


async def failover(api: Api, namespace: str, clique: Clique) -> Failover:
    """Allocate the gang with its pods, fail replica 2's GPU, wait for the move. The caller runs
    the controller (``support.running_controller``), and keeps it running for what it checks
    after: the old Leases are released just after the status write this waits for."""
    crs = resources.CustomResources(api)
    await support.retry_unavailable(lambda: crs.create_claim(namespace, gang(clique.run)))
    before = await support.wait_phase(api, namespace, "gang", constants.PHASE_ALLOCATED, within=60)
    pods = {r: await support.create_pod(api, namespace, replica_pod(clique.run, r)) for r in range(REPLICAS)}
    held = await leases_by_name(api, namespace)
    started = time.monotonic()
    bad = await fail(clique, before, FAILED_REPLICA)

    after = await support.wait_for(
        lambda: moved_off(api, namespace, FAILED_REPLICA, bad["uuid"]),
        within=20,
        interval=0.05,
        what="replica 2 on other GPUs",
    )
    return Failover(before=before, after=after, leases=held, pods=pods, seconds=time.monotonic() - started)
