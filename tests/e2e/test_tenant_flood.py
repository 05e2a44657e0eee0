"""A flood of claims, made with a tenant's own token, as the chart installs gpualloc (issue 37, item 3).

The release, the tenant (a ServiceAccount bound to ``edit``, with a TokenRequest token) and the
chart's policies come from the e2e fixtures (``tests/e2e/conftest.py``, ``tests/e2e/tenants.py``).

The attack: the tenant creates many claims of 64 GPUs at priority 1, which fit on no node, to hold
up every other namespace. Before issue 37 another namespace's 1-GPU claim waited for minutes behind
them; now it is Allocated at once, and an operator's ``GpuQuota.spec.maxClaims`` keeps the
controller's work for the tenant's claims past the limit at nothing. ``bench/claim_flood.py``
measures the same at 3,000 claims and 1,000 nodes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import resources
from tests.e2e import tenants
from tests.integration import controller_support as support

FLOOD = 200
MAX_CLAIMS = 150


async def test_a_tenants_flood_of_claims_holds_up_no_other_namespace_and_stops_at_max_claims(
    setup: tenants.Setup,
) -> None:
    ns = setup.tenant_ns
    run, node, other = await tenants.start_run(setup, "flood", "other")
    quota = {
        "apiVersion": constants.API_VERSION,
        "kind": "GpuQuota",
        "metadata": {"name": "count"},
        "spec": {"gpus": 100_000, "maxClaims": MAX_CLAIMS},
    }
    await tenants.call(setup.admin, "POST", tenants.quotas_path(ns), body=quota)
    tenant_claims = resources.CustomResources(setup.tenant)
    admin_claims = resources.CustomResources(setup.admin)
    argv = support.controller_argv(setup.system, run=run)
    try:
        async with support.running_controller(str(setup.control_plane.kubeconfig), argv):
            semaphore = asyncio.Semaphore(16)

            async def flood(i: int) -> None:
                async with semaphore:
                    body = support.claim_body(f"flood-{i:04d}", 64, run=run, priority=1)
                    await tenant_claims.create_claim(ns, body)

            await asyncio.gather(*(flood(i) for i in range(FLOOD)))
            # Every claim has been looked at once: Pending, with the reason it waits.
            await support.wait_for(
                lambda: _all_tried(setup, ns, run), within=120, what=f"the {FLOOD} claims to be tried"
            )
            for attempt in range(3):
                name = f"small-{attempt}"
                started = time.monotonic()
                await admin_claims.create_claim(other, support.claim_body(name, 1, run=run))
                await support.wait_phase(setup.admin, other, name, "Allocated", within=10)
                took = time.monotonic() - started
                assert took < 1.0, f"another namespace's claim took {took:.2f} s behind the flood"
                await admin_claims.delete_claim(other, name)

            # The oldest MAX_CLAIMS are considered, the rest wait with the quota named.
            reasons = await _reasons(setup, ns, run)
            too_many = [n for n, why in reasons.items() if why == "TooManyClaims"]
            assert len(too_many) == FLOOD - MAX_CLAIMS, sorted(set(reasons.values()))
            assert min(too_many) == f"flood-{MAX_CLAIMS:04d}", "the newest claims are the ones held"
    finally:
        await tenants.call(setup.admin, "DELETE", tenants.quotas_path(ns) + "/count")
        await support.delete_gpu_node(setup.admin, node)
        for namespace in (ns, other):
            await tenants.call(setup.admin, "DELETE", tenants.claims_path(namespace))
        setup.control_plane.request("DELETE", f"/api/v1/namespaces/{other}")


async def _listed(setup: tenants.Setup, ns: str, run: str) -> list[dict[str, Any]]:
    listed = await tenants.call(
        setup.admin, "GET", tenants.claims_path(ns), query=[("labelSelector", f"{support.RUN_LABEL}={run}")]
    )
    items: list[dict[str, Any]] = listed.get("items") or []
    return items


async def _reasons(setup: tenants.Setup, ns: str, run: str) -> dict[str, str]:
    return {
        c["metadata"]["name"]: support.condition(c, constants.CONDITION_ALLOCATED).get("reason", "")
        for c in await _listed(setup, ns, run)
    }


async def _all_tried(setup: tenants.Setup, ns: str, run: str) -> bool:
    reasons = await _reasons(setup, ns, run)
    return len(reasons) == FLOOD and all(reasons.values())
