"""A GPU that fails under an Allocated gang, against the real API server: the simulated agent's
XID injection (``--xid-inject-file``) marks the GPU Unhealthy, and with ``onDeviceFailure:
Reallocate`` only the replica holding it moves.

Two simulated 8-GPU agents publish two nodes of one NVLink clique; a controller runs in this
process. A 4-replica gang of 2 GPUs each lands on one node (binpack); XID 79 on one of its GPUs
must give the claim ``DevicesUnhealthy`` and, past the grace period, evict that replica's pod
(the Eviction API), lock other GPUs in the same clique and record them, while the other three
replicas keep their devices, their Leases (same uid, same resourceVersion: never rewritten) and
their pods. The time from the XID to the replica's new allocation is printed (``bench/
device_failover.py`` measures it the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import errors, resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration.test_agent_apiserver import running_agent

CLIQUE = "example.com/clique"
REPLICAS = 4


def gang(run: str, *, grace: int = 0) -> dict[str, Any]:
    body = support.claim_body("gang", 2, run=run, replicas=REPLICAS)
    body["spec"]["onDeviceFailure"] = constants.DEVICE_FAILURE_REALLOCATE
    body["spec"]["deviceFailureGracePeriodSeconds"] = grace
    body["spec"]["topology"] = {"sameNodeLabel": CLIQUE}
    return body


def replica_pod(run: str, replica: int) -> dict[str, Any]:
    """A pod of the gang's replica (never scheduled here: a pod that names the claim uses it)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"gang-{replica}",
            "labels": {support.RUN_LABEL: run},
            "annotations": {constants.ANNOTATION_CLAIM: "gang", constants.ANNOTATION_REPLICA: str(replica)},
        },
        "spec": {"containers": [{"name": "main", "image": support.PAUSE_IMAGE}]},
    }


@contextlib.asynccontextmanager
async def clique_of_two(
    api: Api, control_plane: Any, kubeconfig: str, tmp_path: Path
) -> AsyncIterator[tuple[str, list[str], dict[str, Path]]]:
    """Two ready Nodes of one clique, each published by a simulated agent that reads its own XID
    injection file; (run tag, node names, node -> injection file)."""
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
        yield run, nodes, files


async def leases_by_name(api: Api, namespace: str) -> dict[str, dict[str, Any]]:
    return {lease["metadata"]["name"]: lease for lease in await support.device_leases(api, namespace)}


def by_replica(claim: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {a["replica"]: a for a in claim["status"]["allocations"]}


async def test_xid_79_moves_only_the_failed_replica_of_a_gang_and_the_others_keep_their_leases(
    api: Api, control_plane: Any, kubeconfig: str, namespace: str, tmp_path: Path
) -> None:
    crs = resources.CustomResources(api)
    async with clique_of_two(api, control_plane, kubeconfig, tmp_path) as (run, nodes, files):
        argv = support.controller_argv(namespace, run=run)
        async with support.running_controller(kubeconfig, argv):
            await support.retry_unavailable(lambda: crs.create_claim(namespace, gang(run)))
            before = await support.wait_phase(api, namespace, "gang", constants.PHASE_ALLOCATED, within=60)
            pods = {r: await support.create_pod(api, namespace, replica_pod(run, r)) for r in range(REPLICAS)}
            held = await leases_by_name(api, namespace)
            assert len(held) == 2 * REPLICAS

            # XID 79 (fallen off the bus) on the first GPU of replica 2.
            failed_replica = 2
            victim = by_replica(before)[failed_replica]
            bad = victim["devices"][0]
            started = time.monotonic()
            files[victim["nodeName"]].write_text(f"{bad['index']} 79\n")

            async def moved() -> dict[str, Any] | None:
                claim = await support.get_claim(api, namespace, "gang")
                if claim is None:
                    return None
                mine = by_replica(claim).get(failed_replica, {})
                uuids = {d["uuid"] for d in mine.get("devices", [])}
                return claim if uuids and bad["uuid"] not in uuids else None

            after = await support.wait_for(moved, within=60, interval=0.1, what="replica 2 on other GPUs")
            elapsed = time.monotonic() - started
            print(f"\nXID 79 to replica {failed_replica} allocated elsewhere: {elapsed:.2f} s")

            # Only replica 2 moved, into the clique (the other node: this one has no 2 free GPUs
            # that are not the failed replica's), and the claim stayed Allocated throughout.
            assert after["status"]["phase"] == constants.PHASE_ALLOCATED
            for r in range(REPLICAS):
                if r != failed_replica:
                    assert by_replica(after)[r] == by_replica(before)[r]
            new = by_replica(after)[failed_replica]
            assert new["nodeName"] in nodes
            conditions = {c["type"]: c for c in after["status"]["conditions"]}
            assert conditions["DevicesUnhealthy"]["status"] == "False"
            assert conditions["DevicesUnhealthy"]["reason"] == "Reallocated"
            assert "XID 79" in conditions["DevicesUnhealthy"]["message"]
            assert conditions["Releasing"]["status"] == "False"

            # The other replicas' Leases were never rewritten; the moved replica's old ones go,
            # its new ones are the claim's.
            kept_names = {
                constants.lease_name(d["uuid"])
                for r, a in by_replica(before).items()
                if r != failed_replica
                for d in a["devices"]
            }
            old_names = {constants.lease_name(d["uuid"]) for d in victim["devices"]}
            new_names = {constants.lease_name(d["uuid"]) for d in new["devices"]}

            async def settled() -> dict[str, dict[str, Any]] | None:
                now = await leases_by_name(api, namespace)
                return now if not (old_names & now.keys()) and new_names <= now.keys() else None

            now = await support.wait_for(
                settled, within=20, what="the old Leases released, the new ones held"
            )
            for name in kept_names:
                assert now[name]["metadata"]["uid"] == held[name]["metadata"]["uid"]
                assert now[name]["metadata"]["resourceVersion"] == held[name]["metadata"]["resourceVersion"]
            uid = after["metadata"]["uid"]
            for name in new_names:
                assert now[name]["spec"]["holderIdentity"] == uid

            # The failed replica's pod was evicted; the others are untouched.
            for r, pod in pods.items():
                path = f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}"
                if r == failed_replica:
                    with contextlib.suppress(errors.NotFound):
                        got = await transport.request(api, "GET", path)
                        assert got["metadata"].get("deletionTimestamp"), "the failed replica's pod is evicted"
                    continue
                got = await transport.request(api, "GET", path)
                assert got["metadata"]["uid"] == pod["metadata"]["uid"]
                assert not got["metadata"].get("deletionTimestamp")

            listing = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events")
            reasons = [e["reason"] for e in listing["items"]]
            assert "DeviceUnhealthy" in reasons and "Reallocated" in reasons


async def test_a_failed_replica_with_nowhere_to_go_keeps_its_pods_and_gpus(
    api: Api, control_plane: Any, kubeconfig: str, namespace: str, tmp_path: Path
) -> None:
    """Two gangs fill both nodes: XID 79 under one of them finds no free GPU, so nothing is evicted
    and nothing moves; the condition stays True."""
    crs = resources.CustomResources(api)
    async with (
        clique_of_two(api, control_plane, kubeconfig, tmp_path) as (run, _, files),
        support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)),
    ):
        await support.retry_unavailable(lambda: crs.create_claim(namespace, gang(run)))
        other = gang(run)
        other["metadata"]["name"] = "filler"
        await crs.create_claim(namespace, other)
        before = await support.wait_phase(api, namespace, "gang", constants.PHASE_ALLOCATED, within=60)
        await support.wait_phase(api, namespace, "filler", constants.PHASE_ALLOCATED, within=60)
        pod = await support.create_pod(api, namespace, replica_pod(run, 1))
        victim = by_replica(before)[1]
        files[victim["nodeName"]].write_text(f"{victim['devices'][0]['index']} 79\n")
        await support.wait_condition(api, namespace, "gang", "DevicesUnhealthy", status="True", within=30)
        await asyncio.sleep(3)  # past the grace period (0 s) and a few looks
        after = await support.get_claim(api, namespace, "gang")
        assert after is not None and by_replica(after) == by_replica(before)
        path = f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}"
        got = await transport.request(api, "GET", path)
        assert got["metadata"]["uid"] == pod["metadata"]["uid"] and not got["metadata"].get(
            "deletionTimestamp"
        )
        conditions = {c["type"]: c for c in after["status"]["conditions"]}
        assert conditions.get("Releasing", {}).get("status") != "True"


async def test_a_failed_gpu_stays_unhealthy_across_an_agent_restart_for_the_recovery_time(
    api: Api, control_plane: Any, kubeconfig: str, tmp_path: Path
) -> None:
    """XID 79, then the agent restarts (the GPU was reset, the node rebooted): the GPU is published
    Unhealthy again at once, with the old reason, and Healthy only ``--recovery-seconds`` later."""
    crs = resources.CustomResources(api)
    node = f"recover-{uuid.uuid4().hex[:8]}"
    await support.create_ready_node(api, node, {constants.HOSTNAME_LABEL: node})
    inject = tmp_path / "xids"
    flags = ["--source", "simulated", "--profile", "h100-sxm-8", "--xid-inject-file", str(inject)]

    async def health_of(index: int) -> tuple[str, str]:
        obj = await crs.get_node_status(node)
        device = next(d for d in obj["status"]["devices"] if d["index"] == index)
        return device["health"], device.get("healthReason", "")

    async def unhealthy_3() -> tuple[str, str] | None:
        with contextlib.suppress(errors.NotFound, KeyError, StopIteration):
            got = await health_of(3)
            return got if got[0] == constants.UNHEALTHY else None
        return None

    async with running_agent(control_plane, kubeconfig, node, *flags, delete_after=False):
        inject.write_text("3 79\n")
        await support.wait_for(unhealthy_3, within=10, what="GPU 3 Unhealthy")
    inject.write_text("")  # the new agent sees no error
    async with running_agent(control_plane, kubeconfig, node, *flags, "--recovery-seconds", "3"):
        restarted = time.monotonic()
        await asyncio.sleep(1)
        assert await health_of(3) == (
            constants.UNHEALTHY,
            "XID 79 (before the agent restarted; held 3 s)",
        ), "a failed GPU is not handed out the moment its agent restarts"

        async def healthy_3() -> bool:
            return (await health_of(3))[0] == constants.HEALTHY

        await support.wait_for(healthy_3, within=15, what="GPU 3 Healthy after the recovery time")
        assert time.monotonic() - restarted >= 3
