"""Preemption on the real API server, kube-controller-manager running (the disruption controller
computes PodDisruptionBudgets): a claim of higher priority that fits nowhere preempts exactly the
minimal set of lower-priority claims, their pods are evicted through the Eviction API (a PDB holds
it back until it goes), and no GPU is ever held twice during the handover: the race test's
watch-based checker (``chaos_support.Mirror``) checks the invariants after every claim and Lease
event throughout (issue 21)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.conftest import fresh_namespace
from tests.integration import controller_support as support
from tests.integration.chaos_support import Mirror, Timeline


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
    mirror = Mirror(api, namespace, label=support.RUN_LABEL, value=run, timeline=Timeline())
    watching = asyncio.create_task(mirror.run())
    await asyncio.wait_for(mirror.synced.wait(), 30)
    async with support.running_controller(kubeconfig, support.controller_argv(namespace, run=run)):
        for name, count, priority in (("low-a", 4, 1), ("low-b", 2, 2), ("low-c", 2, 1)):
            await crs.create_claim(namespace, support.claim_body(name, count, run=run, priority=priority))
            await support.wait_phase(api, namespace, name, "Allocated")
        before = {n: await support.get_claim(api, namespace, n) for n in ("low-a", "low-b", "low-c")}
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
            polite = support.claim_body("polite", 2, run=run, priority=9)
            polite["spec"]["preemptionPolicy"] = "Never"
            await crs.create_claim(namespace, polite)
            await asyncio.sleep(3)
            assert (await support.get_claim(api, namespace, "polite") or {})["status"]["phase"] == "Pending"
            for name in before:
                assert (await support.get_claim(api, namespace, name) or {})["status"]["phase"] == "Allocated"
            await crs.delete_claim(namespace, "polite")

            await crs.create_claim(namespace, support.claim_body("high", 4, run=run, priority=5))
            preempted = await support.wait_phase(api, namespace, "low-a", "Preempted")
            assert preempted["status"]["preemptedBy"] == f"{namespace}/high"
            # The minimal set: 4 GPUs either way, and low-a's top priority (1) is below b+c's (2).
            for other in ("low-b", "low-c"):
                assert (await support.get_claim(api, namespace, other) or {})["status"][
                    "phase"
                ] == "Allocated"

            async def preempting() -> dict[str, Any] | None:
                got = await support.get_claim(api, namespace, "high")
                return got if "preempting" in (got or {}).get("status", {}).get("message", "") else None

            high = await support.wait_for(preempting, within=20, what="the preemptor to say whom it preempts")
            assert f"{namespace}/low-a (4 GPUs, priority 1)" in high["status"]["message"]
            # The PDB holds the eviction back: the pod stays, and so do low-a's GPUs.
            await asyncio.sleep(4)
            listing = await transport.request(api, "GET", pods)
            assert "worker-a" in {p["metadata"]["name"] for p in listing["items"]}
            held = await support.get_claim(api, namespace, "low-a")
            assert held is not None and set(support.status_uuids(held)) == set(
                support.status_uuids(before["low-a"])
            )
            assert (await support.get_claim(api, namespace, "high") or {})["status"]["phase"] == "Pending"

            await transport.request(api, "DELETE", f"{pdbs}/keep-a")
            allocated = await support.wait_phase(api, namespace, "high", "Allocated", within=40)
            assert set(support.status_uuids(allocated)) == set(support.status_uuids(before["low-a"]))
            listing = await transport.request(api, "GET", pods)
            assert "worker-a" not in {p["metadata"]["name"] for p in listing["items"]}
            done = await support.get_claim(api, namespace, "low-a")
            assert done is not None and done["status"]["phase"] == "Preempted"
            assert not done["status"].get("allocations")
            for other in ("low-b", "low-c"):  # nobody else was preempted on the way
                got = await support.get_claim(api, namespace, other)
                assert got is not None and got["status"]["phase"] == "Allocated"
                assert set(support.status_uuids(got)) == set(support.status_uuids(before[other]))
            await asyncio.sleep(1)  # the watch delivers the last events
            assert not mirror.check_now()
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
    assert mirror.stats["checks"] > 20, mirror.stats  # it did watch the handover
    assert not mirror.violations, mirror.violations[:5]


# ----------------------------------------------------------------------------- admission first (issue 37)


@pytest.fixture
def other_namespace(control_plane: Any) -> Iterator[str]:
    """A second fresh namespace: the victims' (their claims deleted first, as ``namespace`` does)."""
    yield from fresh_namespace(control_plane, f"t-victims-{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def h100_and_a100(api: Api) -> AsyncIterator[tuple[str, str, str]]:
    """An 8-GPU H100 node and an 8-GPU A100 node (the simulated agent's profiles) of a fresh run:
    (H100 node, A100 node, run)."""
    run = uuid.uuid4().hex[:8]
    h100, a100 = f"h100-{run}", f"a100-{run}"
    await support.publish_simulated_node(api, h100, run, "h100-sxm-8")
    await support.publish_simulated_node(api, a100, run, "a100-sxm-8")
    yield h100, a100, run
    for name in (h100, a100):
        await support.delete_gpu_node(api, name)


QUOTAS = f"/apis/{constants.API_VERSION}/namespaces/{{namespace}}/{constants.QUOTA_PLURAL}"
NO_H100 = {"gpus": 16, "products": [{"pattern": "*H100*", "gpus": 0}]}


async def no_h100_quota(api: Api, namespace: str) -> None:
    body = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.QUOTA_KIND,
        "metadata": {"name": "no-h100"},
    }
    await transport.request(api, "POST", QUOTAS.format(namespace=namespace), body={**body, "spec": NO_H100})


def on(node: str, body: dict[str, Any]) -> dict[str, Any]:
    body["spec"]["nodeName"] = node
    return body


async def held_leases(api: Api, lease_namespace: str, claim: dict[str, Any]) -> set[str]:
    selector = f"{constants.LABEL_CLAIM_UID}={claim['metadata']['uid']}"
    return {
        lease["metadata"]["name"] for lease in await support.device_leases(api, lease_namespace, selector)
    }


async def test_a_claim_its_quota_refuses_on_every_plan_preempts_nobody_and_waits_with_the_quota_message(
    api: Api, kubeconfig: str, namespace: str, other_namespace: str, h100_and_a100: tuple[str, str, str]
) -> None:
    """Issue 37, item 2: ``*H100*: 0`` in the preemptor's namespace, ``--preemption-scope Cluster``,
    lower-priority H100 holders in another namespace. Before, they were Preempted and lost their
    GPUs, and the preemptor then stayed Pending over its quota; now nobody is touched."""
    h100, _, run = h100_and_a100
    crs = resources.CustomResources(api)
    await no_h100_quota(api, namespace)
    argv = support.controller_argv(namespace, "--preemption-scope", "Cluster", run=run)
    async with support.running_controller(kubeconfig, argv):
        for name in ("victim-1", "victim-2"):
            await crs.create_claim(
                other_namespace, on(h100, support.claim_body(name, 4, run=run, priority=0))
            )
        before = {
            n: await support.wait_phase(api, other_namespace, n, "Allocated")
            for n in ("victim-1", "victim-2")
        }
        leases_before = {n: await held_leases(api, namespace, c) for n, c in before.items()}
        assert all(len(held) == 4 for held in leases_before.values()), leases_before

        wanted = support.claim_body("wants-h100", 4, run=run, priority=5)
        wanted["spec"]["devices"]["product"] = "*H100*"
        await crs.create_claim(namespace, wanted)

        held_back = await support.wait_condition(
            api,
            namespace,
            "wants-h100",
            constants.CONDITION_ALLOCATED,
            reason="QuotaExceeded",
            what="the preemptor to be held back by its quota",
        )
        assert held_back["status"]["phase"] == "Pending"
        assert held_back["status"]["message"] == (
            f"namespace {namespace} would use 4 of 0 *H100* GPUs (quota {namespace}/no-h100)"
        )
        await asyncio.sleep(4)  # several retries (backoff 1 s): still nobody preempted
        got = await support.get_claim(api, namespace, "wants-h100")
        assert (
            got is not None
            and support.condition(got, constants.CONDITION_ALLOCATED)["reason"] == "QuotaExceeded"
        )
        for name, claim in before.items():
            now = await support.get_claim(api, other_namespace, name)
            assert now is not None and now["status"]["phase"] == "Allocated", now
            assert not now["status"].get("preemptedBy")
            assert set(support.status_uuids(now)) == set(support.status_uuids(claim))
            assert await held_leases(api, namespace, now) == leases_before[name]


async def test_with_an_admissible_a100_plan_the_a100_holder_is_preempted_instead_of_the_h100_ones(
    api: Api, kubeconfig: str, namespace: str, other_namespace: str, h100_and_a100: tuple[str, str, str]
) -> None:
    """The positive control: the 4-GPU H100 holders are the minimal plan by GPUs, but the quota
    refuses H100s, so the 8-GPU A100 holder goes, and the preemptor is Allocated on its GPUs."""
    h100, a100, run = h100_and_a100
    crs = resources.CustomResources(api)
    await no_h100_quota(api, namespace)
    argv = support.controller_argv(namespace, "--preemption-scope", "Cluster", run=run)
    async with support.running_controller(kubeconfig, argv):
        for name, node, count in (("h-1", h100, 4), ("h-2", h100, 4), ("a-all", a100, 8)):
            await crs.create_claim(
                other_namespace, on(node, support.claim_body(name, count, run=run, priority=0))
            )
        before = {
            n: await support.wait_phase(api, other_namespace, n, "Allocated") for n in ("h-1", "h-2", "a-all")
        }

        await crs.create_claim(namespace, support.claim_body("high", 4, run=run, priority=5))
        preempted = await support.wait_phase(api, other_namespace, "a-all", "Preempted")
        assert preempted["status"]["preemptedBy"] == f"{namespace}/high"
        allocated = await support.wait_phase(api, namespace, "high", "Allocated", within=40)
        assert allocated["status"]["allocations"][0]["nodeName"] == a100
        assert set(support.status_uuids(allocated)) <= set(support.status_uuids(before["a-all"]))
        for name in ("h-1", "h-2"):
            got = await support.get_claim(api, other_namespace, name)
            assert got is not None and got["status"]["phase"] == "Allocated"
            assert set(support.status_uuids(got)) == set(support.status_uuids(before[name]))
