"""GpuQuota against the real API server: a claim over quota waits with the quota's message, the
ledger follows the claims, and controllers racing never admit past the limit (issue 19).

The deterministic simulation explores the interleavings (invariant 5 in
tests/simulation); these tests show that the ledger's conditional writes, the
status subresource and the CRD behave so on a real kube-apiserver.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration.controller_support import (
    RUN_LABEL,
    claim_body,
    condition,
    controller_argv,
    get_claim,
    running_controller,
    status_uuids,
    wait_for,
    wait_phase,
)

QUOTAS = f"/apis/{constants.API_VERSION}/namespaces/{{namespace}}/{constants.QUOTA_PLURAL}"


async def create_quota(api: Api, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": constants.API_VERSION, "kind": constants.QUOTA_KIND, "metadata": {"name": name}}
    created: dict[str, Any] = await transport.request(
        api, "POST", QUOTAS.format(namespace=namespace), body={**body, "spec": spec}
    )
    return created


async def get_quota(api: Api, namespace: str, name: str) -> dict[str, Any]:
    got: dict[str, Any] = await transport.request(api, "GET", f"{QUOTAS.format(namespace=namespace)}/{name}")
    return got


async def delete_quota(api: Api, namespace: str, name: str) -> None:
    await transport.request(api, "DELETE", f"{QUOTAS.format(namespace=namespace)}/{name}")


@contextlib.asynccontextmanager
async def quota(api: Api, namespace: str, spec: dict[str, Any]) -> AsyncIterator[str]:
    name = f"q-{uuid.uuid4().hex[:6]}"
    await create_quota(api, namespace, name, spec)
    try:
        yield name
    finally:
        await delete_quota(api, namespace, name)


async def over_quota(api: Api, namespace: str, name: str) -> dict[str, Any] | None:
    got = await get_claim(api, namespace, name)
    return got if condition(got, constants.CONDITION_ALLOCATED).get("reason") == "QuotaExceeded" else None


async def test_a_claim_over_its_namespace_quota_waits_with_the_quota_message_until_room_is_freed(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    crs = resources.CustomResources(api)
    async with (
        quota(api, namespace, {"gpus": 4}) as name,
        running_controller(kubeconfig, controller_argv(namespace, run=run)),
    ):
        first = await crs.create_claim(namespace, claim_body("first", 3, run=run))
        await wait_phase(api, namespace, "first", "Allocated")
        await crs.create_claim(namespace, claim_body("second", 2, run=run))
        second = await wait_for(
            lambda: over_quota(api, namespace, "second"), what="the second claim to be over quota"
        )
        assert second["status"]["phase"] == "Pending"
        assert second["status"]["message"] == (
            f"namespace {namespace} would use 5 of 4 GPUs (quota {namespace}/{name})"
        )
        ledger = (await get_quota(api, namespace, name))["status"]
        assert ledger["used"] == 3
        assert ledger["claims"] == {
            first["metadata"]["uid"]: {"name": "first", "gpus": 3, "product": PRODUCT}
        }

        await crs.delete_claim(namespace, "first")
        got = await wait_phase(api, namespace, "second", "Allocated", within=60)
        assert len(status_uuids(got)) == 2

        async def settled() -> dict[str, Any] | None:
            status = (await get_quota(api, namespace, name)).get("status") or {}
            return status if set(status.get("claims") or {}) == {got["metadata"]["uid"]} else None

        status = await wait_for(settled, what="the ledger to hold only the second claim")
        assert status["used"] == 2


async def test_a_product_limit_counts_only_claims_on_matching_gpus(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    crs = resources.CustomResources(api)
    spec = {"gpus": 8, "products": [{"pattern": "*A100*", "gpus": 0}, {"pattern": "*H100*", "gpus": 2}]}
    async with (
        quota(api, namespace, spec) as name,
        running_controller(kubeconfig, controller_argv(namespace, run=run)),
    ):
        await crs.create_claim(namespace, claim_body("small", 2, run=run))
        await wait_phase(api, namespace, "small", "Allocated")
        await crs.create_claim(namespace, claim_body("more", 1, run=run))
        more = await wait_for(lambda: over_quota(api, namespace, "more"), what="the H100 limit to hold")
        assert more["status"]["message"] == (
            f"namespace {namespace} would use 3 of 2 *H100* GPUs (quota {namespace}/{name})"
        )
        status = (await get_quota(api, namespace, name))["status"]
        assert status["usedByProduct"] == {"*A100*": 0, "*H100*": 2}


async def test_controllers_racing_never_admit_past_a_quota(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    _, run = gpu_node
    crs = resources.CustomResources(api)
    limit, claims = 3, 7
    seen: list[int] = []
    stop = asyncio.Event()

    async def watch_allocated() -> None:
        """Count the Allocated claims of this run every 20 ms while the controllers race."""
        while not stop.is_set():
            listing = await crs.list_claims(namespace, label_selector=f"{RUN_LABEL}={run}")
            items = listing.get("items") or []
            seen.append(
                sum(len(status_uuids(c)) for c in items if c.get("status", {}).get("phase") == "Allocated")
            )
            await asyncio.sleep(0.02)

    async with quota(api, namespace, {"gpus": limit}) as name, contextlib.AsyncExitStack() as stack:
        for _ in range(3):  # three controllers, each with caches of its own, no leader election
            await stack.enter_async_context(
                running_controller(kubeconfig, controller_argv(namespace, run=run))
            )
        watcher = asyncio.create_task(watch_allocated())
        await asyncio.gather(
            *(crs.create_claim(namespace, claim_body(f"c{i}", 1, run=run)) for i in range(claims))
        )

        async def explained() -> list[dict[str, Any]] | None:
            got = [await get_claim(api, namespace, f"c{i}") for i in range(claims)]
            done = [c for c in got if c and (c.get("status") or {}).get("message")]
            return got if len(done) == claims else None  # type: ignore[return-value]

        final = await wait_for(explained, within=60, what="every claim to be allocated or explained")
        await asyncio.sleep(2.0)  # let any straggling attempt land, while still watching
        stop.set()
        await watcher
        allocated = [c for c in final if c["status"]["phase"] == "Allocated"]
        waiting = [
            c for c in final if condition(c, constants.CONDITION_ALLOCATED).get("reason") == "QuotaExceeded"
        ]
        assert len(allocated) == limit and len(waiting) == claims - limit, [c["status"] for c in final]
        assert max(seen) == limit, f"Allocated GPUs seen over time: {sorted(set(seen))}"
        ledger = (await get_quota(api, namespace, name))["status"]
        assert set(ledger["claims"]) == {c["metadata"]["uid"] for c in allocated}
        assert ledger["used"] == limit


PRODUCT = "NVIDIA H100 80GB HBM3"


async def test_claims_beyond_max_claims_wait_with_too_many_claims_until_an_older_one_goes(
    api: Api, kubeconfig: str, namespace: str, gpu_node: tuple[str, str]
) -> None:
    """Issue 37: ``spec.maxClaims: 2``; the third claim (the newest) is not considered for
    allocation, says why once, and is allocated when an older claim is deleted."""
    _, run = gpu_node
    crs = resources.CustomResources(api)
    async with (
        quota(api, namespace, {"gpus": 8, "maxClaims": 2}) as name,
        running_controller(kubeconfig, controller_argv(namespace, run=run)),
    ):
        for claim in ("a", "b", "c"):  # created in name order: by creationTimestamp, then name
            await crs.create_claim(namespace, claim_body(claim, 1, run=run))
        await wait_phase(api, namespace, "a", "Allocated")
        await wait_phase(api, namespace, "b", "Allocated")

        async def too_many() -> dict[str, Any] | None:
            got = await get_claim(api, namespace, "c")
            return (
                got
                if condition(got, constants.CONDITION_ALLOCATED).get("reason") == "TooManyClaims"
                else None
            )

        waiting = await wait_for(too_many, what="the third claim to wait with TooManyClaims")
        assert waiting["status"]["phase"] == "Pending" and not waiting["status"].get("allocations")
        assert f"GpuQuota {name} allows 2 (spec.maxClaims)" in waiting["status"]["message"]
        assert waiting["status"].get("retryCount", 0) == 0, "not an allocation attempt"
        await asyncio.sleep(3)  # GPUs are free, yet it is not tried, and its status is written once
        again = await get_claim(api, namespace, "c")
        assert (
            again is not None
            and again["metadata"]["resourceVersion"] == waiting["metadata"]["resourceVersion"]
        )

        await crs.delete_claim(namespace, "a")
        await wait_phase(api, namespace, "c", "Allocated", within=30)
