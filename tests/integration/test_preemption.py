"""Preemption on the real API server, kube-controller-manager running (the disruption controller
computes PodDisruptionBudgets): a claim of higher priority that fits nowhere preempts exactly the
minimal set of lower-priority claims, their pods are evicted through the Eviction API (a PDB holds
it back until it goes), and no GPU is ever held twice during the handover: the race test's
watch-based checker (``chaos_support.Mirror``) checks the invariants after every claim and Lease
event throughout (issue 21)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration.chaos_support import Mirror, Timeline
from tests.integration.controller_support import (
    RUN_LABEL,
    claim_body,
    controller_argv,
    get_claim,
    running_controller,
    status_uuids,
    wait_for,
    wait_phase,
)


def pod(name: str, claim: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"app": name},
            "annotations": {constants.ANNOTATION_CLAIM: claim},
        },
        "spec": {"containers": [{"name": "train", "image": "cuda"}]},
    }


async def test_a_higher_priority_claim_preempts_the_minimal_set_through_evictions_a_pdb_holds_back(
    api: Api, kubeconfig: str, namespace: str, kcm_node: tuple[str, str]
) -> None:
    _, run = kcm_node
    crs = resources.CustomResources(api)
    pods = f"/api/v1/namespaces/{namespace}/pods"
    pdbs = f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets"
    mirror = Mirror(api, namespace, label=RUN_LABEL, value=run, timeline=Timeline())
    watching = asyncio.create_task(mirror.run())
    await asyncio.wait_for(mirror.synced.wait(), 30)
    async with running_controller(kubeconfig, controller_argv(namespace, run=run)):
        for name, count, priority in (("low-a", 4, 1), ("low-b", 2, 2), ("low-c", 2, 1)):
            await crs.create_claim(namespace, claim_body(name, count, run=run, priority=priority))
            await wait_phase(api, namespace, name, "Allocated")
        before = {n: await get_claim(api, namespace, n) for n in ("low-a", "low-b", "low-c")}
        await transport.request(api, "POST", pods, body=pod("worker-a", "low-a"))
        # Running, as its kubelet would say (there is none): the Eviction API ignores budgets for
        # pods that are still Pending.
        await transport.request(
            api,
            "PATCH",
            f"{pods}/worker-a/status",
            body={"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
            content_type=transport.MERGE_PATCH,
        )
        await transport.request(
            api,
            "POST",
            pdbs,
            body={
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "keep-a"},
                "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "worker-a"}}},
            },
        )

        try:
            polite = claim_body("polite", 2, run=run, priority=9)
            polite["spec"]["preemptionPolicy"] = "Never"
            await crs.create_claim(namespace, polite)
            await asyncio.sleep(3)
            assert (await get_claim(api, namespace, "polite") or {})["status"]["phase"] == "Pending"
            for name in before:
                assert (await get_claim(api, namespace, name) or {})["status"]["phase"] == "Allocated"
            await crs.delete_claim(namespace, "polite")

            await crs.create_claim(namespace, claim_body("high", 4, run=run, priority=5))
            preempted = await wait_phase(api, namespace, "low-a", "Preempted")
            assert preempted["status"]["preemptedBy"] == f"{namespace}/high"
            # The minimal set: 4 GPUs either way, and low-a's top priority (1) is below b+c's (2).
            for other in ("low-b", "low-c"):
                assert (await get_claim(api, namespace, other) or {})["status"]["phase"] == "Allocated"

            async def preempting() -> dict[str, Any] | None:
                got = await get_claim(api, namespace, "high")
                return got if "preempting" in (got or {}).get("status", {}).get("message", "") else None

            high = await wait_for(preempting, within=20, what="the preemptor to say whom it preempts")
            assert f"{namespace}/low-a (4 GPUs, priority 1)" in high["status"]["message"]
            # The PDB holds the eviction back: the pod stays, and so do low-a's GPUs.
            await asyncio.sleep(4)
            listing = await transport.request(api, "GET", pods)
            assert "worker-a" in {p["metadata"]["name"] for p in listing["items"]}
            held = await get_claim(api, namespace, "low-a")
            assert held is not None and set(status_uuids(held)) == set(status_uuids(before["low-a"]))
            assert (await get_claim(api, namespace, "high") or {})["status"]["phase"] == "Pending"

            await transport.request(api, "DELETE", f"{pdbs}/keep-a")
            allocated = await wait_phase(api, namespace, "high", "Allocated", within=40)
            assert set(status_uuids(allocated)) == set(status_uuids(before["low-a"]))
            listing = await transport.request(api, "GET", pods)
            assert "worker-a" not in {p["metadata"]["name"] for p in listing["items"]}
            done = await get_claim(api, namespace, "low-a")
            assert done is not None and done["status"]["phase"] == "Preempted"
            assert not done["status"].get("allocations")
            for other in ("low-b", "low-c"):  # nobody else was preempted on the way
                got = await get_claim(api, namespace, other)
                assert got is not None and got["status"]["phase"] == "Allocated"
                assert set(status_uuids(got)) == set(status_uuids(before[other]))
            await asyncio.sleep(1)  # the watch delivers the last events
            assert not mirror.check_now()
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
    assert mirror.stats["checks"] > 20, mirror.stats  # it did watch the handover
    assert not mirror.violations, mirror.violations[:5]
