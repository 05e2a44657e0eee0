"""A GPU that fails under an Allocated gang, against the real API server: the simulated agent's
XID injection (``--xid-inject-file``) marks the GPU Unhealthy, and with ``onDeviceFailure:
Reallocate`` only the replica holding it moves (the scenario: ``failure_support``).

XID 79 under one replica of a 4-replica gang must give the claim ``DevicesUnhealthy`` and, past
the grace period, evict that replica's pod (the Eviction API), lock other GPUs in the same clique
and record them, while the other three replicas keep their devices, their Leases (same uid, same
resourceVersion: never rewritten) and their pods. ``bench/device_failover.py`` times the same
scenario.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import errors, resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support
from tests.integration import failure_support as failure
from tests.integration.test_agent_apiserver import running_agent


async def test_xid_79_moves_only_the_failed_replica_of_a_gang_and_the_others_keep_their_leases(
    api: Api, control_plane: Any, kubeconfig: str, namespace: str, tmp_path: Path
) -> None:
    async with failure.clique_of_two(api, control_plane, kubeconfig, tmp_path) as clique:
        argv = support.controller_argv(namespace, run=clique.run)
        async with support.running_controller(kubeconfig, argv):  # on till the last check
            got = await failure.failover(api, namespace, clique)
            print(f"\nXID 79 to replica {failure.FAILED_REPLICA} allocated elsewhere: {got.seconds:.2f} s")
            before, after = failure.by_replica(got.before), failure.by_replica(got.after)

            # Only replica 2 moved, inside the clique, and the claim stayed Allocated throughout.
            assert got.after["status"]["phase"] == constants.PHASE_ALLOCATED
            kept = [r for r in range(failure.REPLICAS) if r != failure.FAILED_REPLICA]
            for r in kept:
                assert after[r] == before[r]
            victim, new = before[failure.FAILED_REPLICA], after[failure.FAILED_REPLICA]
            assert new["nodeName"] in clique.nodes
            conditions = {c["type"]: c for c in got.after["status"]["conditions"]}
            assert conditions["DevicesUnhealthy"]["status"] == "False"
            assert conditions["DevicesUnhealthy"]["reason"] == "Reallocated"
            assert "XID 79" in conditions["DevicesUnhealthy"]["message"]
            assert conditions["Releasing"]["status"] == "False"

            # The other replicas' Leases were never rewritten; the moved replica's old ones go, its new
            # ones are the claim's.
            kept_names = {constants.lease_name(d["uuid"]) for r in kept for d in before[r]["devices"]}
            old_names = {constants.lease_name(d["uuid"]) for d in victim["devices"]}
            new_names = {constants.lease_name(d["uuid"]) for d in new["devices"]}

            async def settled() -> dict[str, dict[str, Any]] | None:
                now = await failure.leases_by_name(api, namespace)
                return now if not (old_names & now.keys()) and new_names <= now.keys() else None

            now = await support.wait_for(
                settled, within=20, what="the old Leases released, the new ones held"
            )
            for name in kept_names:
                assert now[name]["metadata"]["uid"] == got.leases[name]["metadata"]["uid"]
                assert (
                    now[name]["metadata"]["resourceVersion"]
                    == got.leases[name]["metadata"]["resourceVersion"]
                )
            for name in new_names:
                assert now[name]["spec"]["holderIdentity"] == got.after["metadata"]["uid"]

            # The failed replica's pod was evicted; the others are untouched.
            for r, pod in got.pods.items():
                path = f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}"
                if r == failure.FAILED_REPLICA:
                    with contextlib.suppress(errors.NotFound):
                        gone = await transport.request(api, "GET", path)
                        assert gone["metadata"].get("deletionTimestamp"), (
                            "the failed replica's pod is evicted"
                        )
                    continue
                same = await transport.request(api, "GET", path)
                assert same["metadata"]["uid"] == pod["metadata"]["uid"]
                assert not same["metadata"].get("deletionTimestamp")

            async def told() -> bool:  # Events are written in the background, after the status
                listing = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events")
                reasons = {e["reason"] for e in listing["items"]}
                return {"DeviceUnhealthy", "Reallocated"} <= reasons

            await support.wait_for(
                told, within=10, what="DeviceUnhealthy and Reallocated events on the claim"
            )


async def test_a_failed_replica_with_nowhere_to_go_keeps_its_pods_and_gpus(
    api: Api, control_plane: Any, kubeconfig: str, namespace: str, tmp_path: Path
) -> None:
    """Two gangs fill both nodes: XID 79 under one of them finds no free GPU, so nothing is evicted
    and nothing moves; the condition stays True."""
    crs = resources.CustomResources(api)
    async with failure.clique_of_two(api, control_plane, kubeconfig, tmp_path) as clique:
        argv = support.controller_argv(namespace, run=clique.run)
        async with support.running_controller(kubeconfig, argv):
            await support.retry_unavailable(lambda: crs.create_claim(namespace, failure.gang(clique.run)))
            await crs.create_claim(namespace, failure.gang(clique.run, "filler"))
            before = await support.wait_phase(api, namespace, "gang", constants.PHASE_ALLOCATED, within=60)
            await support.wait_phase(api, namespace, "filler", constants.PHASE_ALLOCATED, within=60)
            pod = await support.create_pod(api, namespace, failure.replica_pod(clique.run, 1))
            await failure.fail(clique, before, 1)
            await support.wait_condition(api, namespace, "gang", "DevicesUnhealthy", status="True", within=30)
            await asyncio.sleep(3)  # past the grace period (0 s) and a few looks
            after = await support.get_claim(api, namespace, "gang")
            assert after is not None and failure.by_replica(after) == failure.by_replica(before)
            path = f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}"
            got = await transport.request(api, "GET", path)
            assert got["metadata"]["uid"] == pod["metadata"]["uid"]
            assert not got["metadata"].get("deletionTimestamp")
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


async def test_a_pod_disruption_budget_holds_the_failed_replica_back_until_it_allows_the_eviction(
    api: Api, control_plane: Any, kubeconfig: str, namespace: str, tmp_path: Path
) -> None:
    """The move evicts through the Eviction API: a budget that allows no disruption of replica 2's
    (Running) pod keeps it and the replica's GPUs, fenced; once the budget goes, the replica moves."""
    await asyncio.to_thread(control_plane.ensure_controller_manager)  # computes the budget
    crs = resources.CustomResources(api)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    pdbs = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
    async with failure.clique_of_two(api, control_plane, kubeconfig, tmp_path) as clique:
        argv = support.controller_argv(namespace, run=clique.run)
        async with support.running_controller(kubeconfig, argv):
            await support.retry_unavailable(lambda: crs.create_claim(namespace, failure.gang(clique.run)))
            before = await support.wait_phase(api, namespace, "gang", constants.PHASE_ALLOCATED, within=60)
            pod = await support.create_pod(api, namespace, failure.replica_pod(clique.run, 2))
            # Running, as its kubelet would say: the Eviction API ignores budgets for Pending pods.
            running = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
            name = pod["metadata"]["name"]
            await transport.request(
                api, "PATCH", f"{pods}/{name}/status", body=running, content_type=transport.MERGE_PATCH
            )
            budget = {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "keep-replica-2"},
                "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"replica": "2"}}},
            }
            await transport.request(api, "POST", pdbs, body=budget)
            bad = await failure.fail(clique, before, 2)
            fenced = await support.wait_condition(
                api, namespace, "gang", "Releasing", status="True", within=30
            )
            assert support.condition(fenced, "Releasing")["reason"] == "DeviceFailed"
            await asyncio.sleep(4)  # several looks, each eviction refused (429)
            held = await support.get_claim(api, namespace, "gang")
            assert held is not None and failure.by_replica(held) == failure.by_replica(before)
            kept = await transport.request(api, "GET", f"{pods}/{name}")
            assert kept["metadata"]["uid"] == pod["metadata"]["uid"] and not kept["metadata"].get(
                "deletionTimestamp"
            )

            await transport.request(api, "DELETE", f"{pdbs}/keep-replica-2")

            after = await support.wait_for(
                lambda: failure.moved_off(api, namespace, 2, bad["uuid"]),
                within=30,
                what="replica 2 moved once the budget is gone",
            )
            assert support.condition(after, "Releasing")["status"] == "False"
