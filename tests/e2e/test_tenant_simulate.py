"""`kubectl gpualloc simulate` run by a tenant, with the tenant's own token (issue 40, part 3).

The release, the tenant (a ServiceAccount bound to ``edit``, which the chart's tenant roles are
aggregated into, with a TokenRequest token) come from the e2e fixtures (``tests/e2e/conftest.py``).
``edit`` lets a tenant list its namespace's GpuClaims and GpuQuotas; GpuNodeStatuses and Nodes are
cluster-scoped, which a namespace's role cannot grant. So with ``edit`` alone simulate says it
cannot see the GPUs; once a cluster admin lets the tenant read GpuNodeStatuses (as
docs/operations.md says), it answers, counting its own namespace's claims and saying that other
namespaces' claims were not counted.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.conftest import delete_if_present
from tests.e2e import tenants
from tests.integration import controller_support as support
from tests.integration.test_simulate_cli import RBAC, hold, requests_by, simulate


async def test_a_tenant_simulates_with_its_own_rights_and_is_told_what_it_could_not_see(
    setup: tenants.Setup, tmp_path: Path
) -> None:
    ns = setup.tenant_ns
    run, node, others = await tenants.start_run(setup, "iso-sim", "others")
    role = f"simulate-nodes-{run}"
    kubeconfig = setup.kubeconfigs / "tenant.kubeconfig"
    username = f"system:serviceaccount:{ns}:tenant"
    plane = setup.control_plane
    try:
        # Another namespace's claim holds GPUs 0-5, the tenant's own claim GPUs 6 and 7.
        await hold(setup.admin, others, support.claim_body("theirs", 6, run=run), node, range(6))
        await hold(setup.admin, ns, support.claim_body("mine", 2, run=run), node, range(6, 8))
        what_if = support.claim_body("what-if", 4, run=run)
        earlier = {e["auditID"] for e in requests_by(plane.audit_log, username)}

        blind = await asyncio.to_thread(simulate, kubeconfig, what_if, tmp_path, "-n", ns)
        assert blind.returncode == 1, blind.stdout + blind.stderr
        assert "you may not list GpuNodeStatuses (cluster-scoped)" in blind.stderr

        # What a cluster admin grants so that tenants can simulate: read access to GpuNodeStatuses.
        rule = {"apiGroups": ["gpu.scheduling"], "resources": ["gpunodestatuses"], "verbs": ["get", "list"]}
        plane.request("POST", f"{RBAC}/clusterroles", {"metadata": {"name": role}, "rules": [rule]})
        binding = {
            "metadata": {"name": role},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}],
        }
        plane.request("POST", f"{RBAC}/clusterrolebindings", binding)

        async def answered() -> dict[str, object] | None:
            done = await asyncio.to_thread(simulate, kubeconfig, what_if, tmp_path, "-n", ns, "-o", "json")
            if "you may not list GpuNodeStatuses" in done.stderr:
                return None  # the binding is not in force yet
            assert done.returncode == 0, done.stdout + done.stderr
            report: dict[str, object] = json.loads(done.stdout)
            return report

        report = await support.wait_for(answered, what="the tenant's simulate to see the GPU nodes")
        assert report["fits"] == 1
        landed = report["landed"]
        assert isinstance(landed, list)
        placed = {d["index"] for alloc in landed[0] for d in alloc["devices"]}
        assert len(placed) == 4 and not placed & {6, 7}, "its own namespace's claim is counted"
        unseen = report["notCounted"]
        assert isinstance(unseen, list)
        assert any(f"GpuClaims outside namespace {ns}" in u and "counted as free" in u for u in unseen), (
            unseen
        )
        assert any(u.startswith("Nodes (you may not list them)") for u in unseen), unseen

        # The admin, who sees the other namespace's claim, is told that it does not fit.
        admin = await asyncio.to_thread(simulate, plane.kubeconfig, what_if, tmp_path, "-n", ns, "-o", "json")
        assert admin.returncode == 1, admin.stdout + admin.stderr
        assert json.loads(admin.stdout)["notCounted"] == []

        made = [e for e in requests_by(plane.audit_log, username) if e["auditID"] not in earlier]
        assert made and {e["verb"] for e in made} <= {"get", "list"}, sorted({e["verb"] for e in made})
        # Refused, and left out: every namespace's claims and pods, the Nodes, the GPU nodes before the
        # binding, and the agents' heartbeat Leases (the GpuNodeStatus's own heartbeat stands in).
        refused = {e["objectRef"]["resource"] for e in made if e["responseStatus"]["code"] == 403}
        assert refused == {"gpunodestatuses", "gpuclaims", "nodes", "pods", "leases"}, refused
    finally:
        delete_if_present(plane, f"{RBAC}/clusterrolebindings/{role}")
        delete_if_present(plane, f"{RBAC}/clusterroles/{role}")
        delete_if_present(plane, f"/apis/gpu.scheduling/v1/namespaces/{others}/gpuclaims")
        delete_if_present(plane, f"/api/v1/namespaces/{others}")
        await support.delete_gpu_node(setup.admin, node)
