"""Preemption attacked with a tenant's own token, as the chart installs gpualloc (issue 37, item 2).

The release, the tenant (a ServiceAccount bound to ``edit``, with a TokenRequest token) and the
chart's policies (the quota-priority ValidatingAdmissionPolicy among them) come from
the e2e fixtures (``tests/e2e/conftest.py``, ``tests/e2e/tenants.py``). The controller runs with
``--preemption-scope Cluster``, so a tenant's claim may preempt lower-priority claims of any
namespace; the tenant's GpuQuota allows no H100 (``*H100*: 0``).

The attack: the tenant creates a high-priority claim for H100s, which its quota will never admit,
on a node that other namespaces' claims fill. Before issue 37 those claims were Preempted and lost
their GPUs, and the tenant's claim then waited over its quota; now the quota is checked on the plan
before any victim is chosen, and nobody is touched.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gpualloc.api import constants
from gpualloc.kube import resources
from tests.e2e import tenants
from tests.integration import controller_support as support


def no_h100(max_priority: int) -> dict[str, Any]:
    return {
        "apiVersion": constants.API_VERSION,
        "kind": "GpuQuota",
        "metadata": {"name": "no-h100"},
        "spec": {"gpus": 16, "maxPriority": max_priority, "products": [{"pattern": "*H100*", "gpus": 0}]},
    }


async def test_a_tenants_claim_its_quota_refuses_preempts_no_claim_of_another_namespace(
    setup: tenants.Setup,
) -> None:
    ns = setup.tenant_ns
    run, node, victims_ns = await tenants.start_run(setup, "iso-h100", "victims")
    await tenants.call(setup.admin, "POST", tenants.quotas_path(ns), body=no_h100(max_priority=10))
    tenant_claims = resources.CustomResources(setup.tenant)
    admin_claims = resources.CustomResources(setup.admin)
    argv = support.controller_argv(setup.system, "--preemption-scope", "Cluster", run=run)
    try:
        async with support.running_controller(str(setup.control_plane.kubeconfig), argv):
            for name in ("victim-1", "victim-2"):
                await admin_claims.create_claim(victims_ns, support.claim_body(name, 4, run=run, priority=0))
            before = {
                n: await support.wait_phase(setup.admin, victims_ns, n, "Allocated", within=60)
                for n in ("victim-1", "victim-2")
            }

            async def leases_of(claim: dict[str, Any]) -> set[str]:
                selector = f"{constants.LABEL_CLAIM_UID}={claim['metadata']['uid']}"
                held = await support.device_leases(setup.admin, setup.system, selector)
                return {lease["metadata"]["name"] for lease in held}

            leases_before = {n: await leases_of(c) for n, c in before.items()}
            assert all(len(held) == 4 for held in leases_before.values()), leases_before

            # The quota-priority policy is in force for this quota: the tenant cannot out-rank by a
            # big number (dry run), and asks the most its quota allows.
            loud = support.claim_body("loud", 4, run=run, priority=1000)
            message = await tenants.eventually(
                "the quota-priority policy to see the GpuQuota",
                lambda: tenants.refusal(
                    tenants.call(
                        setup.tenant, "POST", tenants.claims_path(ns), body=loud, query=[("dryRun", "All")]
                    )
                ),
            )
            assert (
                f"spec.priority 1000 is above 10, the maximum of namespace {ns} (quota {ns}/no-h100)"
                in message
            )

            wanted = support.claim_body("wants-h100", 4, run=run, priority=10)
            wanted["spec"]["devices"]["product"] = "*H100*"
            await tenant_claims.create_claim(ns, wanted)

            got = await support.wait_condition(
                setup.tenant,
                ns,
                "wants-h100",
                constants.CONDITION_ALLOCATED,
                reason="QuotaExceeded",
                within=60,
            )
            assert got["status"]["phase"] == "Pending"
            assert (
                got["status"]["message"]
                == f"namespace {ns} would use 4 of 0 *H100* GPUs (quota {ns}/no-h100)"
            )
            await asyncio.sleep(4)  # several retries (backoff 1 s): still nobody preempted
            for name, claim in before.items():
                now = await support.get_claim(setup.admin, victims_ns, name)
                assert now is not None and now["status"]["phase"] == "Allocated", (
                    now["status"] if now else None
                )
                assert not now["status"].get("preemptedBy")
                assert set(support.status_uuids(now)) == set(support.status_uuids(claim))
                assert await leases_of(now) == leases_before[name]
            still = await support.get_claim(setup.tenant, ns, "wants-h100")
            assert (
                still is not None
                and support.condition(still, constants.CONDITION_ALLOCATED)["reason"] == "QuotaExceeded"
            )
    finally:
        await tenants.purge_claim(setup.admin, ns, "wants-h100")
        for name in ("victim-1", "victim-2"):
            await tenants.purge_claim(setup.admin, victims_ns, name)
        await tenants.call(setup.admin, "DELETE", f"{tenants.quotas_path(ns)}/no-h100")
        await support.delete_gpu_node(setup.admin, node)
        await tenants.call(setup.admin, "DELETE", f"/api/v1/namespaces/{victims_ns}")
