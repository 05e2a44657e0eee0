"""The sweep and allocated claims: orphaned Leases, unhealthy devices, metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import prometheus_client

from controller import cluster, running, settings
from controller import metrics as controller_metrics
from gpualloc.api import constants
from gpualloc.kube import errors, leases, resources, transport
from gpualloc.kube.client import Api
from tests.integration import controller_support as support


@contextlib.asynccontextmanager
async def controller_in_process(api: Api, namespace: str, run: str) -> AsyncIterator[running.Controller]:
    chosen = settings.Settings(
        namespace=namespace, sweep_interval=1.0, claim_selector=f"{support.RUN_LABEL}={run}"
    )
    ctl = running.Controller(cluster.KubeCluster(api, chosen.namespace), chosen, controller_metrics.Metrics())
    caches = asyncio.create_task(ctl.run_caches())
    active = asyncio.create_task(ctl.run_active())
    try:
        yield ctl
    finally:
        for task in (active, caches):
            task.cancel()
        for task in (active, caches):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def sample(ctl: running.Controller, name: str, labels: dict[str, str] | None = None) -> float | None:
    value = ctl.metrics.registry.get_sample_value(name, labels or {})
    return None if value is None else float(value)


async def test_the_sweep_deletes_leases_whose_claim_is_gone_and_keeps_those_of_live_claims(
    api: Api, namespace: str, gpu_node: tuple[str, str]
) -> None:
    node, run = gpu_node
    crs = resources.CustomResources(api)
    live = await crs.create_claim(namespace, support.claim_body("live", 1, run=run))
    labels = {
        constants.LABEL_NODE: node,
        constants.LABEL_CLAIM_NAMESPACE: namespace,
        constants.LABEL_MANAGED_BY: constants.MANAGED_BY,
    }
    # A Lease left by a claim that no longer exists (a crash between its deletion and the release).
    await leases.create_lease(
        api,
        namespace,
        "gpu-orphan",
        holder="uid-of-a-deleted-claim",
        labels={
            **labels,
            constants.LABEL_CLAIM_NAME: "deleted",
            constants.LABEL_CLAIM_UID: "uid-of-a-deleted-claim",
        },
    )
    async with controller_in_process(api, namespace, run) as ctl:
        got = await support.wait_phase(api, namespace, "live", constants.PHASE_ALLOCATED, within=30)

        async def orphan_gone() -> bool:
            names = {lease["metadata"]["name"] for lease in await support.device_leases(api, namespace)}
            return "gpu-orphan" not in names

        await support.wait_for(orphan_gone, within=15, what="the orphaned lease to be swept")
        held = await support.device_leases(api, namespace)
        assert [lease["spec"]["holderIdentity"] for lease in held] == [live["metadata"]["uid"]]
        assert [lease["metadata"]["name"] for lease in held] == [
            constants.lease_name(u) for u in support.status_uuids(got)
        ]
        assert ctl.sweeps >= 1


async def test_an_unhealthy_device_marks_the_claim_devices_unhealthy_without_reallocating_and_metrics_follow(
    api: Api, namespace: str, gpu_node: tuple[str, str]
) -> None:
    node, run = gpu_node
    crs = resources.CustomResources(api)
    try:
        async with controller_in_process(api, namespace, run) as ctl:
            await crs.create_claim(namespace, support.claim_body("job", 2, run=run))
            before = await support.wait_phase(api, namespace, "job", constants.PHASE_ALLOCATED, within=30)
            # The counters go up once the controller has read its status write's answer, which
            # may be just after this test's own read saw the status.
            await support.wait_for(
                _async(
                    lambda: (
                        sample(ctl, "gpualloc_claims_allocated_total", {"strategy": "binpack"}) == 1.0
                        and sample(ctl, "gpualloc_time_to_allocated_seconds_count") == 1.0
                    )
                ),
                within=10,
                what="one allocation counted",
            )
            await support.wait_for(
                _async(lambda: sample(ctl, "gpualloc_devices", {"node": node, "state": "allocated"}) == 2.0),
                within=10,
                what="device gauge to count 2 allocated",
            )
            assert sample(ctl, "gpualloc_devices", {"node": node, "state": "free"}) == 6.0

            # The agent reports one of the claim's GPUs Unhealthy (XID 79).
            bad = before["status"]["allocations"][0]["devices"][0]
            current = await crs.get_node_status(node)
            devices = current["status"]["devices"]
            for device in devices:
                if device["uuid"] == bad["uuid"]:
                    device["health"], device["healthReason"] = "Unhealthy", "XID 79"
            await crs.patch_node_status_status(node, {"status": {"devices": devices, "healthy": 7}})

            async def lost() -> dict[str, Any] | None:
                claim = await crs.get_claim(namespace, "job")
                conditions = {c["type"]: c for c in claim["status"].get("conditions") or []}
                cond = conditions.get("DevicesUnhealthy")
                return claim if cond and cond["status"] == "True" else None

            after = await support.wait_for(lost, within=20, what="DevicesUnhealthy condition")
            conditions = {c["type"]: c for c in after["status"]["conditions"]}
            cond = conditions["DevicesUnhealthy"]
            assert cond["reason"] == "DeviceUnhealthy" and "XID 79" in cond["message"]
            assert "onDeviceFailure: Keep" in cond["message"]
            assert "DevicesLost" not in conditions, "an unhealthy GPU is not a lost one"
            assert after["status"]["phase"] == "Allocated"
            assert support.status_uuids(after) == support.status_uuids(before), (
                "a running claim is never moved"
            )
            assert len(await support.device_leases(api, namespace)) == 2

            async def warned() -> bool:
                listing = await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events")
                return any(e["reason"] == "DeviceUnhealthy" for e in listing["items"])

            await support.wait_for(warned, within=10, what="a DeviceUnhealthy event")

            async def node_warned() -> bool:
                listing = await transport.request(api, "GET", "/api/v1/namespaces/default/events")
                return any(
                    e["reason"] == "DeviceUnhealthy"
                    and e["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
                    and f"held by claim {namespace}/job" in e["message"]
                    for e in listing["items"]
                )

            await support.wait_for(node_warned, within=10, what="a DeviceUnhealthy event on the Node")
            reasons = {
                e["reason"]
                for e in (await transport.request(api, "GET", f"/api/v1/namespaces/{namespace}/events"))[
                    "items"
                ]
            }
            # An allocation is told by the status (condition Allocated), not by an Event.
            assert "Allocated" not in reasons

            # Healed: the condition turns False; the claim keeps its devices.
            for device in devices:
                device["health"], device["healthReason"] = "Healthy", ""
            await crs.patch_node_status_status(node, {"status": {"devices": devices, "healthy": 8}})

            async def healed() -> bool:
                claim = await crs.get_claim(namespace, "job")
                conditions = {c["type"]: c for c in claim["status"].get("conditions") or []}
                return bool(conditions["DevicesUnhealthy"]["status"] == "False")

            await support.wait_for(healed, within=20, what="DevicesUnhealthy to turn False")
            text = prometheus_client.generate_latest(ctl.metrics.registry).decode()
            for name in (
                "gpualloc_allocation_failures_total",
                "gpualloc_allocation_retries_total",
                "gpualloc_reconcile_duration_seconds_bucket",
                "gpualloc_pending_claims",
            ):
                assert name in text, name
    finally:
        with contextlib.suppress(errors.NotFound):
            await crs.delete_claim(namespace, "job")


def _async(check: Any) -> Any:
    async def probe() -> bool:
        return bool(check())

    return probe
