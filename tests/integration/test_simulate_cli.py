"""`kubectl gpualloc simulate` against the real API server: where a claim would land, how many such
claims fit, whom it would preempt and which quota holds it back, read with get and list alone.

The cluster is set up as the controller leaves it: two GPU nodes of 8 GPUs labelled with this
test's run, claims whose status holds GPUs on them. The command runs as its console script
(``kubectl-gpualloc``, the same entry point as ``gpualloc``), as a ServiceAccount whose only
rights are get and list; the API server's audit log shows every request it made.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from gpualloc.kube.client import Api
from tests.integration.controller_support import (
    RUN_LABEL,
    claim_body,
    create_gpu_node,
    delete_gpu_node,
    gpu_uuid,
)

KUBECTL_GPUALLOC = str(Path(sys.executable).parent / "kubectl-gpualloc")
RBAC = "/apis/rbac.authorization.k8s.io/v1"
READ_ONLY_RULES = [
    {"apiGroups": [constants.GROUP], "resources": ["gpuclaims", "gpuquotas", "gpunodestatuses"]},
    {"apiGroups": [""], "resources": ["nodes", "pods"]},
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]},
]


@dataclass
class Cluster:
    run: str
    namespace: str
    node_a: str
    node_b: str


async def hold(api: Api, namespace: str, body: dict[str, Any], node: str, indices: range) -> dict[str, Any]:
    """Create the claim and write its status as the controller does once it holds these GPUs."""
    crs = resources.CustomResources(api)
    await crs.create_claim(namespace, body)
    devices = [{"index": i, "minor": i, "uuid": gpu_uuid(node, i)} for i in indices]
    status = {"phase": "Allocated", "allocations": [{"replica": 0, "nodeName": node, "devices": devices}]}
    return await crs.patch_claim_status(namespace, body["metadata"]["name"], {"status": status})


def simulate(
    kubeconfig: str | Path, claim: dict[str, Any], tmp_path: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    """``kubectl-gpualloc simulate -f`` the claim, as the kubeconfig's user."""
    path = tmp_path / f"claim-{uuid.uuid4().hex[:6]}.yaml"
    path.write_text(yaml.safe_dump(claim))
    argv = [KUBECTL_GPUALLOC, "simulate", "-f", str(path), "--kubeconfig", str(kubeconfig), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)


def token_kubeconfig(control_plane: Any, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig whose user is the ServiceAccount, with a token from the TokenRequest API."""
    answer = control_plane.request(
        "POST",
        f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 3600},
        },
    )
    admin = yaml.safe_load(Path(control_plane.kubeconfig).read_text())
    cluster = {**admin["clusters"][0]["cluster"], "server": control_plane.server}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": cluster}],
        "users": [{"name": account, "user": {"token": answer["status"]["token"]}}],
        "contexts": [{"name": account, "context": {"cluster": "local", "user": account}}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def requests_by(audit_log: Path, username: str) -> list[dict[str, Any]]:
    """The API server's audit events (ResponseComplete) of the requests this user made."""
    events = []
    for line in audit_log.read_text().splitlines():
        if username not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("stage") == "ResponseComplete" and (event.get("user") or {}).get("username") == username:
            events.append(event)
    return events


@pytest.fixture
async def cluster(api: Api, namespace: str) -> AsyncIterator[Cluster]:
    """Nodes A and B (8 GPUs each, NVSwitch); claim ``held`` has A's GPUs 0-5, claim ``low``
    (priority 1) B's GPUs 0-3: free are A's 6 and 7 and B's 4 to 7."""
    run = uuid.uuid4().hex[:8]
    a, b = f"sim-a-{run}", f"sim-b-{run}"
    for node in (a, b):
        await create_gpu_node(api, node, labels={RUN_LABEL: run})
    try:
        await hold(api, namespace, claim_body("held", 6, run=run), a, range(6))
        await hold(api, namespace, claim_body("low", 4, run=run, priority=1), b, range(4))
        yield Cluster(run=run, namespace=namespace, node_a=a, node_b=b)
    finally:
        for node in (a, b):
            await delete_gpu_node(api, node)


@pytest.fixture
def reader(control_plane: Any, namespace: str, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A kubeconfig whose ServiceAccount may get and list what simulate reads, and nothing else."""
    account, role = "simulator", f"simulate-read-{uuid.uuid4().hex[:6]}"
    control_plane.ensure_service_account(namespace, account)
    rules = [{**r, "verbs": ["get", "list"]} for r in READ_ONLY_RULES]
    control_plane.request("POST", f"{RBAC}/clusterroles", {"metadata": {"name": role}, "rules": rules})
    binding = {
        "metadata": {"name": role},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
    }
    control_plane.request("POST", f"{RBAC}/clusterrolebindings", binding)
    try:
        path = token_kubeconfig(control_plane, namespace, account, tmp_path / "reader.kubeconfig")
        yield path, f"system:serviceaccount:{namespace}:{account}"
    finally:
        control_plane.request("DELETE", f"{RBAC}/clusterrolebindings/{role}")
        control_plane.request("DELETE", f"{RBAC}/clusterroles/{role}")


async def _versions(api: Api, namespace: str, nodes: tuple[str, str]) -> dict[str, str]:
    """The resourceVersion of every object simulate reads in this test's corner of the cluster."""
    listed = await transport.request(
        api, "GET", f"/apis/{constants.API_VERSION}/namespaces/{namespace}/gpuclaims"
    )
    quotas = await transport.request(
        api, "GET", f"/apis/{constants.API_VERSION}/namespaces/{namespace}/gpuquotas"
    )
    leases = await transport.request(
        api, "GET", f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    )
    versions = {
        f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["resourceVersion"] for o in listed["items"]
    }
    versions |= {f"quota/{o['metadata']['name']}": o["metadata"]["resourceVersion"] for o in quotas["items"]}
    versions |= {f"lease/{o['metadata']['name']}": o["metadata"]["resourceVersion"] for o in leases["items"]}
    for node in nodes:
        status = await resources.CustomResources(api).get_node_status(node)
        versions[f"gns/{node}"] = status["metadata"]["resourceVersion"]
    return versions


async def test_simulate_places_count_claims_on_free_gpus_with_get_and_list_rights_alone_and_writes_nothing(
    api: Api, cluster: Cluster, reader: tuple[Path, str], control_plane: Any, tmp_path: Path
) -> None:
    kubeconfig, username = reader
    before = await _versions(api, cluster.namespace, (cluster.node_a, cluster.node_b))
    claim = claim_body("what-if", 2, run=cluster.run)
    counted = await asyncio.to_thread(
        simulate, kubeconfig, claim, tmp_path, "-n", cluster.namespace, "--count", "5", "-o", "json"
    )
    assert counted.returncode == 0, counted.stderr
    report = json.loads(counted.stdout)
    assert report["fits"] == 3 and report["asked"] == 5, report
    held = {gpu_uuid(cluster.node_a, i) for i in range(6)} | {gpu_uuid(cluster.node_b, i) for i in range(4)}
    placed = [d["uuid"] for copy in report["landed"] for alloc in copy for d in alloc["devices"]]
    assert len(placed) == len(set(placed)) == 6 and not held & set(placed)
    assert "fewer than 2 free healthy GPUs" in report["reason"]
    assert report["notCounted"] == []

    one = await asyncio.to_thread(simulate, kubeconfig, claim, tmp_path, "-n", cluster.namespace)
    assert one.returncode == 0, one.stderr
    assert f"Claim {cluster.namespace}/what-if (simulated: nothing was written)" in one.stdout
    assert f"replica 0: would land on {cluster.node_a} [gpu-6/" in one.stdout  # binpack: the fuller node

    made = requests_by(control_plane.audit_log, username)
    assert made, "the audit log shows the simulator's requests"
    assert {e["verb"] for e in made} <= {"get", "list"}, sorted({e["verb"] for e in made})
    assert {e["objectRef"]["resource"] for e in made} >= {
        "gpuclaims",
        "gpunodestatuses",
        "nodes",
        "gpuquotas",
    }
    assert all(e["responseStatus"]["code"] == 200 for e in made), [e["responseStatus"] for e in made]
    assert await _versions(api, cluster.namespace, (cluster.node_a, cluster.node_b)) == before


async def test_simulate_names_whom_it_would_preempt_and_the_quota_that_holds_it_back_and_exits_1(
    api: Api, cluster: Cluster, kubeconfig: str, tmp_path: Path
) -> None:
    big = claim_body("big", 8, run=cluster.run, priority=5)
    preempting = await asyncio.to_thread(simulate, kubeconfig, big, tmp_path, "-n", cluster.namespace)
    assert preempting.returncode == 1, preempting.stdout + preempting.stderr
    assert "not:     it does not land: " in preempting.stdout
    assert f"preempt: would land preempting {cluster.namespace}/low (4 GPUs, priority 1)" in preempting.stdout
    assert "(--preemption-scope Namespace)" in preempting.stdout
    assert cluster.node_a in preempting.stdout and cluster.node_b in preempting.stdout  # the NODE rows

    quota = {"apiVersion": constants.API_VERSION, "kind": constants.QUOTA_KIND, "metadata": {"name": "team"}}
    path = f"/apis/{constants.API_VERSION}/namespaces/{cluster.namespace}/gpuquotas"
    await transport.request(api, "POST", path, body={**quota, "spec": {"gpus": 3}})
    small = claim_body("small", 4, run=cluster.run)
    held_back = await asyncio.to_thread(
        simulate, kubeconfig, small, tmp_path, "-n", cluster.namespace, "-o", "json"
    )
    assert held_back.returncode == 1, held_back.stderr
    report = json.loads(held_back.stdout)
    assert report["fits"] == 0
    assert (
        report["quota"]
        == f"namespace {cluster.namespace} would use 4 of 3 GPUs (quota {cluster.namespace}/team)"
    )


async def test_simulate_exits_2_on_a_claim_the_controller_would_refuse(
    kubeconfig: str, tmp_path: Path
) -> None:
    bad = claim_body("bad", 2, run="x", replicas=0)
    refused = await asyncio.to_thread(simulate, kubeconfig, bad, tmp_path)
    assert refused.returncode == 2
    assert "replicas must be at least 1" in refused.stderr
