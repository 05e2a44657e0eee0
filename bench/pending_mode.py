"""webhook.pendingMode deny vs gate, when a claim and its Job are created together (issue 41).

The question: should the chart's default be ``gate``? In deny mode the webhook refuses a claim pod
until its claim is Allocated, so the controller allocates without seeing the pods and cannot
count what they request; in gate mode the pod is admitted behind the scheduling gate first, and
its own requests count when the controller allocates, if it has seen the pod by then.

Starts a local control plane with kube-scheduler, kube-controller-manager (Jobs) and kwok, and the
controller and one webhook per mode as processes (the code of ``--tree``, by default a snapshot of
HEAD). Each variant has a cell of three kwok GPU nodes of 8 GPUs: node A has 4 of its GPUs held by
another claim (binpack's favourite, then) and all its 4 CPUs taken by a plain pod; B and C have 64
CPUs free. Each round runs one trial of every variant at once, each in its cell and in a namespace
of its own that only its mode's webhook serves: a 1-GPU binpack claim
(``unschedulableGracePeriodSeconds`` ``--grace``) and an Indexed Job of one pod asking 1 CPU.

* ``deny``, ``gate``: the claim (without ``spec.podResources``) and the Job created at the same
  instant (``asyncio.gather``), the webhook in that mode;
* ``gate-job-first``: gate mode, the Job first, the claim once the Job's pod waits at the gate;
* ``deny-podresources``: deny mode, created together, the claim stating ``podResources: {cpu: 1}``.

Watches record when the claim is first Allocated and where, when it let that node go, and when the
Job's pods appear and first run, and where; times are from the claim's create, and a trial ends
once a Job pod ran. The claim and the Job are then deleted and the claim's GPUs released before
the next round. From the API server's audit log, per trial: the pod creates the webhook refused
(the Job controller retries them with its backoff) and the successful writes of the submission, by
client (its namespace, and its cell's device Leases).

A claim is *misplaced* when its first allocation is on node A, where its pod cannot run: it moves
once kube-scheduler has reported the pod Unschedulable for the grace period, and the Job
re-creates the evicted pod after its own backoff.

Writes bench/results/pending_mode_<date>.json and prints a summary; 20 rounds take about 6
minutes.

    .venv/bin/python bench/pending_mode.py [--trials 20 --grace 5 --variants deny gate ...]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests.integration's webhook config
import local_plane
import procfs
import webhook_request
import webhook_vegeta
from controller_throughput import gpu_uuid, inventory, retrying

from gpualloc.api import constants
from gpualloc.devcluster import binaries, cluster
from gpualloc.kube import client, errors, resources, transport, watching
from gpualloc.kube.client import Api
from tests.integration import test_webhook_cluster as webhook_cluster

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"


class Variant(NamedTuple):
    mode: str  # the webhook's pendingMode
    job_first: bool  # the Job first, the claim once its pod waits at the gate
    pod_resources: bool  # the claim states spec.podResources (what its pod asks)
    queued: bool  # the claim waits for GPUs (``--queue-wait`` s) before it can be allocated


VARIANTS = {
    "deny": Variant("deny", False, False, False),
    "gate": Variant("gate", False, False, False),
    "gate-job-first": Variant("gate", True, False, False),
    "deny-podresources": Variant("deny", False, True, False),
    "deny-queued": Variant("deny", False, False, True),
    "gate-queued": Variant("gate", False, False, True),
}
BENCH_LABEL = "gpualloc.bench/pending-mode"  # namespaces: the webhook mode; nodes: the variant
LEASE_NS = "gpualloc-system"
SETUP_NS = "pm-setup"
IMAGE = "registry.k8s.io/pause:3.10"
MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
CPUS = {"a": "4", "b": "64", "c": "64"}  # node A's CPU is all taken by a plain pod


def node_name(variant: str, suffix: str) -> str:
    return f"pm-{variant}-{suffix}"


Obj = dict[str, Any]


# ----------------------------------------------------------------------------- what is recorded


class Recorder:
    """Every claim and pod state the cluster-wide watches reported, with the time it arrived."""

    def __init__(self) -> None:
        self.claims: dict[str, list[tuple[float, Obj]]] = collections.defaultdict(list)  # ns -> seen
        self.pods: dict[str, list[tuple[float, Obj]]] = collections.defaultdict(list)

    def on_claim(self, type_: str, obj: Obj) -> None:
        status = obj.get("status") or {}
        seen = {
            "phase": "Deleted" if type_ == "DELETED" else status.get("phase") or "",
            "nodes": [a.get("nodeName") for a in status.get("allocations") or []],
            "reasons": sorted({c.get("reason") or "" for c in status.get("conditions") or []}),
        }
        self.claims[obj["metadata"]["namespace"]].append((time.time(), seen))

    def on_pod(self, type_: str, obj: Obj) -> None:
        meta, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
        scheduled: Obj = next(
            (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
        )
        seen = {
            "name": meta["name"],
            "phase": "Deleted" if type_ == "DELETED" else status.get("phase") or "",
            "node": spec.get("nodeName") or "",
            "gated": any(
                g.get("name") == constants.SCHEDULING_GATE for g in spec.get("schedulingGates") or []
            ),
            "unschedulable": scheduled.get("reason") == "Unschedulable",
            "job": any(o.get("kind") == "Job" for o in meta.get("ownerReferences") or []),
        }
        self.pods[meta["namespace"]].append((time.time(), seen))

    def running_pod(self, namespace: str) -> tuple[float, Obj] | None:
        """The first Job pod seen Running in ``namespace``."""
        return next(
            ((t, p) for t, p in self.pods.get(namespace, []) if p["job"] and p["phase"] == "Running"), None
        )


def summarise_trial(rec: Recorder, namespace: str, variant: str, start: float) -> Obj:
    """One trial's figures from what the watches saw in ``namespace``, in seconds from ``start``."""
    claims = rec.claims.get(namespace, [])
    pods = [(t, p) for t, p in rec.pods.get(namespace, []) if p["job"]]
    allocated = [(t, c) for t, c in claims if c["phase"] == constants.PHASE_ALLOCATED]
    first_alloc = allocated[0] if allocated else None
    running = rec.running_pod(namespace)
    nodes_held: list[str] = []
    for _, c in allocated:
        for node in c["nodes"]:
            if not nodes_held or nodes_held[-1] != node:
                nodes_held.append(node)
    first_pod = min((t for t, _ in pods), default=None)
    # When the claim let its first node go (Unplaceable, or no longer Allocated), and when the Job's
    # second pod appeared: the grace period, then the Job controller's backoff.
    left = next(
        (
            t
            for t, c in claims
            if first_alloc
            and t > first_alloc[0]
            and (c["phase"] != constants.PHASE_ALLOCATED or "Unplaceable" in c["reasons"])
        ),
        None,
    )
    names = list(dict.fromkeys(p["name"] for _, p in pods))
    second_pod = next((t for t, p in pods if len(names) > 1 and p["name"] == names[1]), None)
    first_node = first_alloc[1]["nodes"][0] if first_alloc else ""
    return {
        "variant": variant,
        "namespace": namespace,
        "claim_allocated_s": round(first_alloc[0] - start, 3) if first_alloc else None,
        "first_node": first_node,
        "pod_running_s": round(running[0] - start, 3) if running else None,
        "pod_node": running[1]["node"] if running else "",
        "misplaced": first_node == node_name(variant, "a"),
        "moved": len(nodes_held) > 1 or any("Unplaceable" in c["reasons"] for _, c in claims),
        "nodes_held": nodes_held,
        "first_pod_seen_s": round(first_pod - start, 3) if first_pod is not None else None,
        "pod_gated_at_first_sight": bool(pods and pods[0][1]["gated"]),
        "claim_left_first_node_s": round(left - start, 3) if left is not None else None,
        "second_pod_seen_s": round(second_pod - start, 3) if second_pod is not None else None,
        "pods_seen": len({p["name"] for _, p in pods}),
        "pods_unschedulable": len({p["name"] for _, p in pods if p["unschedulable"]}),
        "pods_deleted": len({p["name"] for _, p in pods if p["phase"] == "Deleted"}),
    }


# ------------------------------------------------------------------------------------ processes


def snapshot_tree(workdir: Path) -> tuple[Path, str]:
    """HEAD's files (``git archive``) in ``workdir``: the code the controller and webhooks run, so
    that others' uncommitted work in this tree does not; the directory and the commit."""
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    tree = workdir / "tree"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", "HEAD"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree, commit


def python_env(tree: Path) -> dict[str, str]:
    """The processes' environment: ``tree``'s packages first on the path."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def start_controller(kubeconfig: Path, tree: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = [
        *(sys.executable, "-m", "gpualloc.cli", "controller"),
        *("--kubeconfig", str(kubeconfig), "--namespace", LEASE_NS, "--leader-elect=false"),
        *("--health-port", "0", "--metrics-port", "0", "--identity", "bench", "--log-level", "WARNING"),
        # Nothing renews the bench nodes' heartbeats: they must not go stale meanwhile.
        *("--node-stale-after", "86400"),
    ]
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=tree, env=python_env(tree), stdout=out, stderr=subprocess.STDOUT)


def start_webhook(
    kubeconfig: Path, tree: Path, workdir: Path, mode: str
) -> tuple[subprocess.Popen[bytes], int, bytes]:
    """``gpualloc webhook --pending <mode>``, ready; the process, its port and its CA."""
    ca, cert, key = webhook_request.make_certs(workdir / f"certs-{mode}")
    port = cluster.free_ports(1)[0]
    argv = [
        *(sys.executable, "-m", "gpualloc.cli"),
        *webhook_vegeta.webhook_args(cert, key, port, kubeconfig),
        *("--health-port=0", "--metrics-port=0", f"--pending={mode}"),
    ]
    with (workdir / f"webhook-{mode}.log").open("wb") as out:
        process = subprocess.Popen(argv, cwd=tree, env=python_env(tree), stdout=out, stderr=subprocess.STDOUT)
    webhook_vegeta.wait_ready(port, ca, "/readyz", process)
    return process, port, Path(ca).read_bytes()


def webhook_configuration(mode: str, port: int, ca_pem: bytes) -> Obj:
    """The integration tests' MutatingWebhookConfiguration (the chart's in substance), for the
    namespaces of ``mode`` only."""
    config: Obj = webhook_cluster.webhook_configuration(f"gpualloc-bench-{mode}", "", port, ca_pem)
    config["webhooks"][0]["namespaceSelector"] = {"matchLabels": {BENCH_LABEL: mode}}
    return config


# ---------------------------------------------------------------------------------------- objects


async def create_namespace(api: Api, plane: cluster.ControlPlane, name: str, labels: dict[str, str]) -> None:
    body = {"metadata": {"name": name, "labels": labels}}
    with contextlib.suppress(errors.AlreadyExists):
        await transport.request(api, "POST", "/api/v1/namespaces", body=body)
    await asyncio.to_thread(plane.ensure_service_account, name)


async def add_gpu_node(api: Api, plane: cluster.ControlPlane, name: str, variant: str, cpu: str) -> None:
    """A kwok Node of ``variant``'s cell with ``cpu`` allocatable and 8 GPUs published as the agent
    would."""
    await asyncio.to_thread(plane.add_kwok_node, name, {BENCH_LABEL: variant}, cpu=cpu)
    crs = resources.CustomResources(api)
    status = {
        "apiVersion": constants.API_VERSION,
        "kind": constants.NODE_STATUS_KIND,
        "metadata": {"name": name},
        "spec": {"nodeName": name},
    }
    await retrying(lambda: crs.create_node_status(status))
    await retrying(lambda: crs.patch_node_status_status(name, {"status": inventory(name, 8)}))


def claim(name: str, count: int, *, variant: str, grace: int, node: str = "") -> Obj:
    """A binpack claim on ``variant``'s nodes."""
    spec: Obj = {
        "devices": {"count": count},
        "selector": {"matchLabels": {BENCH_LABEL: variant}},
        "strategy": "binpack",
        "unschedulableGracePeriodSeconds": grace,
    }
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": constants.API_VERSION,
        "kind": constants.CLAIM_KIND,
        "metadata": {"name": name},
        "spec": spec,
    }


def pod_spec(cpu: str) -> Obj:
    return {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": IMAGE, "resources": {"requests": {"cpu": cpu}}}],
    }


def job(name: str, claim_name: str, cpu: str) -> Obj:
    """An Indexed Job of one pod of ``claim_name`` asking ``cpu``."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": 1,
            "parallelism": 1,
            "backoffLimit": 6,
            "template": {
                "metadata": {"annotations": {constants.ANNOTATION_CLAIM: claim_name}},
                "spec": pod_spec(cpu),
            },
        },
    }


async def wait_until(probe: Any, within: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + within
    while True:
        got = await probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {within:g} s")
        await asyncio.sleep(interval)


async def claim_phase(api: Api, namespace: str, name: str) -> str:
    try:
        got = await resources.CustomResources(api).get_claim(namespace, name)
    except errors.NotFound:
        return "Gone"
    return str((got.get("status") or {}).get("phase") or "")


# ------------------------------------------------------------------------------------ the trials


async def setup(api: Api, plane: cluster.ControlPlane, rec: Recorder, variant: str, grace: int) -> None:
    """``variant``'s cell: nodes A (4 CPU), B and C (64 CPU); another claim holds 4 of A's GPUs (binpack
    prefers A then), a plain pod all A's CPU."""
    for suffix, cpu in CPUS.items():
        await add_gpu_node(api, plane, node_name(variant, suffix), variant, cpu)
    node_a = node_name(variant, "a")
    crs = resources.CustomResources(api)
    body = claim(f"other-{variant}", 4, variant=variant, grace=grace, node=node_a)
    await retrying(lambda: crs.create_claim(SETUP_NS, body))
    await wait_until(
        lambda: _is(claim_phase(api, SETUP_NS, f"other-{variant}"), constants.PHASE_ALLOCATED),
        60,
        f"claim other-{variant}",
    )
    hog_name = f"hog-{variant}"
    hog = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": hog_name},
        "spec": {**pod_spec("4"), "nodeSelector": {constants.HOSTNAME_LABEL: node_a}},
    }
    await transport.request(api, "POST", f"/api/v1/namespaces/{SETUP_NS}/pods", body=hog)

    async def hog_running() -> bool:
        return any(p["name"] == hog_name and p["phase"] == "Running" for _, p in rec.pods.get(SETUP_NS, []))

    await wait_until(hog_running, 60, f"pod {hog_name} Running")


async def _is(phase: Any, want: str) -> bool:
    return bool(await phase == want)


async def block_cell(api: Api, variant: str, index: int, grace: int) -> dict[str, str]:
    """Claims that hold every free GPU of ``variant``'s cell (4 on A, 8 on B and C), Allocated; their
    names by node suffix."""
    crs = resources.CustomResources(api)
    names = {suffix: f"block-{variant}-{index:02d}-{suffix}" for suffix in CPUS}
    for suffix, name in names.items():
        count = 4 if suffix == "a" else 8
        body = claim(name, count, variant=variant, grace=grace, node=node_name(variant, suffix))
        await crs.create_claim(SETUP_NS, body)
    for name in names.values():
        await wait_until(
            lambda n=name: _is(claim_phase(api, SETUP_NS, n), constants.PHASE_ALLOCATED),
            60,
            f"{name} Allocated",
        )
    return names


async def lease_names(api: Api, claims: list[str]) -> set[str]:
    """The device Lease names of these claims of SETUP_NS."""
    crs = resources.CustomResources(api)
    names: set[str] = set()
    for name in claims:
        got = await crs.get_claim(SETUP_NS, name)
        for allocation in (got.get("status") or {}).get("allocations") or []:
            names.update(f"gpu-{d['uuid'].lower()}" for d in allocation["devices"])
    return names


async def _all_gone(api: Api, names: list[str]) -> bool:
    return all([await claim_phase(api, SETUP_NS, n) == "Gone" for n in names])


async def gone_at(api: Api, names: list[str]) -> float:
    """When these claims of SETUP_NS were all seen gone (their Leases released)."""
    await wait_until(lambda: _all_gone(api, names), 60, f"{names} gone", interval=0.05)
    return time.time()


async def _has_pod(rec: Recorder, namespace: str) -> bool:
    return any(p["job"] for _, p in rec.pods.get(namespace, []))


async def trial(
    api: Api, plane: cluster.ControlPlane, rec: Recorder, variant: str, index: int, args: argparse.Namespace
) -> Obj:
    mode, job_first, pod_resources, queued = VARIANTS[variant]
    blockers = await block_cell(api, variant, index, args.grace) if queued else {}
    namespace = f"pm-{variant}-{index:02d}"
    await create_namespace(api, plane, namespace, {BENCH_LABEL: mode})
    crs = resources.CustomResources(api)
    jobs = f"/apis/batch/v1/namespaces/{namespace}/jobs"
    body = claim("train", 1, variant=variant, grace=args.grace)
    if pod_resources:
        body["spec"]["podResources"] = {"cpu": "1"}
    create_claim = crs.create_claim(namespace, body)
    create_job = transport.request(api, "POST", jobs, body=job("train", "train", "1"))
    submitted = time.time()
    if job_first:  # the claim once the Job's pod waits at the gate; timed from the claim
        await create_job
        await wait_until(lambda: _has_pod(rec, namespace), 30, f"{namespace}: the Job's pod", interval=0.02)
        start = time.time()
        await create_claim
    else:
        start = time.time()
        await asyncio.gather(create_claim, create_job)
    released = None
    if queued:  # A's 4 free GPUs and B's 8 come free at once; C stays full
        await asyncio.sleep(args.queue_wait)
        released = time.time()
        blocker_leases = await lease_names(api, [blockers["a"], blockers["b"]])
        await asyncio.gather(*(crs.delete_claim(SETUP_NS, blockers[s]) for s in ("a", "b")))
        blockers_gone = asyncio.create_task(gone_at(api, [blockers["a"], blockers["b"]]))

    async def ran() -> bool:
        return rec.running_pod(namespace) is not None

    timed_out = False
    try:
        await wait_until(ran, args.trial_timeout, f"{namespace}: the Job's pod Running", interval=0.05)
    except TimeoutError:
        timed_out = True
    end = time.time()
    result = summarise_trial(rec, namespace, variant, start)
    result["timed_out"] = timed_out
    result["window"] = [submitted, end]
    if released is not None:
        # The blockers' own Lease releases are not the trial's writes (count_writes).
        result["blocker_leases"] = [sorted(blocker_leases), await blockers_gone]
        result["released_s"] = round(released - start, 3)
        if result["pod_running_s"] is not None:
            result["pod_running_after_release_s"] = round(result["pod_running_s"] - result["released_s"], 3)
    # Clean up: the Job (its pods with it), the claim (its GPUs released before it goes).
    await transport.request(
        api,
        "DELETE",
        f"/apis/batch/v1/namespaces/{namespace}/jobs/train",
        query=[("propagationPolicy", "Background")],
    )
    with contextlib.suppress(errors.NotFound):
        await crs.delete_claim(namespace, "train")
    await wait_until(lambda: _is(claim_phase(api, namespace, "train"), "Gone"), 60, f"{namespace}/train gone")
    for name in blockers.values():
        with contextlib.suppress(errors.NotFound):
            await crs.delete_claim(SETUP_NS, name)
        await wait_until(lambda n=name: _is(claim_phase(api, SETUP_NS, n), "Gone"), 60, f"{name} gone")
    await transport.request(api, "DELETE", f"/api/v1/namespaces/{namespace}")
    return result


# ------------------------------------------------------------------------------------- the audit


def audit_events(path: Path, offset: int) -> Iterator[Obj]:
    with path.open("rb") as f:
        f.seek(offset)
        for line in f:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("stage") == "ResponseComplete":
                    yield event


def stamp(event: Obj) -> float:
    when = event.get("requestReceivedTimestamp") or ""
    return datetime.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()


# The namespace's own set-up (its ServiceAccount, its CA ConfigMap): not the submission's writes.
NAMESPACE_SETUP = {"root-ca-cert-publisher", "service-account-controller", "gpualloc-devcluster"}


def client_of(event: Obj) -> str:
    user = (event.get("user") or {}).get("username") or ""
    if user.startswith("system:serviceaccount:kube-system:"):
        return user.rsplit(":", 1)[1]  # job-controller, ...
    agent = (event.get("userAgent") or "").split("/")[0]
    return {"gpualloc": "bench (the claim and the Job)"}.get(agent, agent or user)


def lease_variants(variants: list[str]) -> dict[str, str]:
    """Device Lease name -> the variant whose cell holds that GPU."""
    return {
        f"gpu-{gpu_uuid(node_name(v, suffix), i).lower()}": v
        for v in variants
        for suffix in CPUS
        for i in range(8)
    }


def count_writes(trials: list[Obj], path: Path, offset: int, variants: list[str]) -> None:
    """Per trial: the pod creates the webhook refused, and the successful writes of the trial, by
    client: in its namespace from the submission to the pod Running, and to its cell's device
    Leases meanwhile."""
    by_ns = {t["namespace"]: t for t in trials}
    lease_cells = lease_variants(variants)
    for t in trials:
        t["pod_creates_refused"] = 0
        t["writes"] = collections.Counter()
    for event in audit_events(path, offset):
        if event.get("verb") not in WRITE_VERBS:
            continue
        ref = event.get("objectRef") or {}
        ns = ref.get("namespace") or ""
        when = stamp(event)
        code = (event.get("responseStatus") or {}).get("code") or 0
        if ns in by_ns:
            owners = [by_ns[ns]]
        elif ns == LEASE_NS and ref.get("resource") == "leases" and ref.get("name") in lease_cells:
            owners = [t for t in trials if t["variant"] == lease_cells[ref["name"]]]
        else:
            continue
        for t in owners:
            if not t["window"][0] - 0.1 <= when <= t["window"][1]:
                continue
            blocked, gone = t.get("blocker_leases") or ([], 0.0)
            if ref.get("name") in blocked and event["verb"] != "create" and when <= gone:
                continue  # a blocker claim's release, not the trial's
            resource = ref.get("resource")
            if (
                resource == "pods"
                and event["verb"] == "create"
                and not ref.get("subresource")
                and code >= 400
            ):
                t["pod_creates_refused"] += 1
            elif code < 400 and client_of(event) not in NAMESPACE_SETUP:
                lease = " (device Leases)" if resource == "leases" else ""
                t["writes"][client_of(event) + lease] += 1
    for t in trials:
        t["writes"] = dict(sorted(t["writes"].items()))
        t["writes_total"] = sum(t["writes"].values())


# ----------------------------------------------------------------------------------------- figures


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def per_variant(trials: list[Obj], variant: str) -> Obj:
    mine = [t for t in trials if t["variant"] == variant]
    alloc = [t["claim_allocated_s"] for t in mine if t["claim_allocated_s"] is not None]
    run = [t["pod_running_s"] for t in mine if t["pod_running_s"] is not None]
    writes = [t["writes_total"] for t in mine]
    return {
        "trials": len(mine),
        "claim_allocated_s": {"median": percentile(alloc, 0.5), "p90": percentile(alloc, 0.9)},
        "pod_running_s": {
            "median": percentile(run, 0.5),
            "p90": percentile(run, 0.9),
            "max": max(run, default=None),
        },
        "misplaced": sum(t["misplaced"] for t in mine),
        "moved": sum(t["moved"] for t in mine),
        "timed_out": sum(t["timed_out"] for t in mine),
        "pod_on_first_node": sum(t["pod_node"] == t["first_node"] for t in mine),
        "pods_gated_at_first_sight": sum(t["pod_gated_at_first_sight"] for t in mine),
        "pod_before_allocation": sum(
            t["first_pod_seen_s"] is not None
            and t["claim_allocated_s"] is not None
            and t["first_pod_seen_s"] < t["claim_allocated_s"]
            for t in mine
        ),
        "claim_left_first_node_s_median": percentile(
            [t["claim_left_first_node_s"] for t in mine if t["claim_left_first_node_s"] is not None], 0.5
        ),
        "second_pod_seen_s_median": percentile(
            [t["second_pod_seen_s"] for t in mine if t["second_pod_seen_s"] is not None], 0.5
        ),
        "pod_running_after_release_s": {
            "median": percentile(
                [t["pod_running_after_release_s"] for t in mine if "pod_running_after_release_s" in t], 0.5
            ),
            "p90": percentile(
                [t["pod_running_after_release_s"] for t in mine if "pod_running_after_release_s" in t], 0.9
            ),
        },
        "pod_creates_refused": {
            "total": sum(t["pod_creates_refused"] for t in mine),
            "median": statistics.median([t["pod_creates_refused"] for t in mine]) if mine else None,
        },
        "pods_created": sum(t["pods_seen"] for t in mine),
        "writes_per_trial": {
            "median": statistics.median(writes) if writes else None,
            "max": max(writes, default=None),
        },
    }


async def run(args: argparse.Namespace, plane: cluster.ControlPlane, workdir: Path) -> Obj:
    api = await client.connect(str(plane.kubeconfig))
    rec = Recorder()
    processes: list[subprocess.Popen[bytes]] = []
    watchers: list[asyncio.Task[None]] = []
    try:
        for start in (plane.ensure_controller_manager, plane.ensure_scheduler, plane.ensure_kwok):
            await asyncio.to_thread(start)
        await create_namespace(api, plane, LEASE_NS, {})
        for kind, handler in ((watching.CLAIMS, rec.on_claim), (watching.PODS, rec.on_pod)):
            reflector = watching.Reflector(api, kind, on_event=handler)
            watchers.append(asyncio.create_task(reflector.run()))
            await asyncio.wait_for(reflector.synced.wait(), 30)
        if args.tree:
            tree, commit = args.tree, "working tree"
        else:
            tree, commit = snapshot_tree(workdir)
        print(f"controller and webhooks run {commit} from {tree}", flush=True)
        controller = start_controller(plane.kubeconfig, tree, workdir / "controller.log")
        processes.append(controller)
        pids = {"controller": controller.pid}
        variants = list(args.variants)
        for mode in sorted({VARIANTS[v].mode for v in variants}):
            process, port, ca = start_webhook(plane.kubeconfig, tree, workdir, mode)
            processes.append(process)
            pids[f"webhook-{mode}"] = process.pid
            await transport.request(api, "POST", MWC_PATH, body=webhook_configuration(mode, port, ca))
        await create_namespace(api, plane, SETUP_NS, {})
        await asyncio.gather(*(setup(api, plane, rec, v, args.grace) for v in variants))
        print(
            f"cells ready: {', '.join(variants)} (A: 4 CPU taken, 4 of 8 GPUs held; B, C: 64 CPU)", flush=True
        )
        await asyncio.sleep(2)  # the API server picks the webhook configurations up from a watch
        audit_offset = plane.audit_log.stat().st_size
        cpu_before = {name: procfs.cpu_seconds(pid) for name, pid in pids.items()}
        trials: list[Obj] = []
        began = time.monotonic()
        for index in range(args.trials):
            if controller.poll() is not None:
                raise RuntimeError(f"the controller exited; see {workdir / 'controller.log'}")
            # One trial of each variant at once, each in its own cell; who is submitted first turns.
            turn = variants[index % len(variants) :] + variants[: index % len(variants)]
            results = await asyncio.gather(*(trial(api, plane, rec, v, index, args) for v in turn))
            trials.extend(results)
            for result in results:
                print(
                    f"[{time.monotonic() - began:5.0f} s] #{index:02d} {result['variant']:14}: allocated "
                    f"{result['claim_allocated_s']} s on {result['first_node']}, pod Running "
                    f"{result['pod_running_s']} s on {result['pod_node']}"
                    f"{', MOVED' if result['moved'] else ''}{', TIMED OUT' if result['timed_out'] else ''}",
                    flush=True,
                )
        cpu = {name: round(procfs.cpu_seconds(pid) - cpu_before[name], 2) for name, pid in pids.items()}
        await asyncio.sleep(1)  # the audit log's last lines
        count_writes(trials, plane.audit_log, audit_offset, variants)
        return {
            **procfs.run_stamp(),
            "code": commit,
            "wall_s": round(time.monotonic() - began, 1),
            "setup": {
                "cells": "one per variant, trials of the variants run at once: node A 4 CPU, all taken "
                "by a plain pod, 4 of its 8 GPUs held by another claim (binpack's favourite); "
                "B and C 64 CPU, 8 GPUs free",
                "claim": f"1 GPU, binpack, no podResources, unschedulableGracePeriodSeconds {args.grace}",
                "job": "Indexed, 1 pod asking 1 CPU; created with the claim (asyncio.gather), or in "
                "gate-job-first once its pod waits at the gate, the claim then; times from the claim",
                "controller": "chart defaults but --node-stale-after 86400",
            },
            "summary": {v: per_variant(trials, v) for v in variants},
            "cpu_seconds": cpu,
            "trials": [{k: v for k, v in t.items() if k not in ("window", "blocker_leases")} for t in trials],
        }
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        for process in processes:
            process.terminate()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        await api.close()


def print_summary(result: Obj) -> None:
    print(
        "\nvariant  claim Allocated s (median / p90)  pod Running s (median / p90 / max)  misplaced  "
        "refused pod creates  writes per trial"
    )
    for variant, s in result["summary"].items():
        a, r = s["claim_allocated_s"], s["pod_running_s"]
        print(
            f"{variant:14} {a['median']} / {a['p90']}   {r['median']} / {r['p90']} / {r['max']}   "
            f"{s['misplaced']} of {s['trials']}   {s['pod_creates_refused']['total']}   "
            f"{s['writes_per_trial']['median']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="submissions per variant")
    parser.add_argument("--grace", type=int, default=5, help="the claims' unschedulableGracePeriodSeconds")
    parser.add_argument(
        "--queue-wait", type=float, default=6.0, help="seconds the queued variants' claims wait for GPUs"
    )
    parser.add_argument("--trial-timeout", type=float, default=120.0, help="seconds a trial may take")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument(
        "--tree", default="", help="run the controller and webhooks from this tree (default: HEAD)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.tree = Path(args.tree).resolve() if args.tree else None
    out = args.out or RESULTS / f"pending_mode_{datetime.date.today().isoformat()}.json"
    names = ["etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kwok"]
    paths = binaries.ensure(names)
    with tempfile.TemporaryDirectory(prefix="pending-mode-") as tmp:
        workdir = Path(tmp)
        with cluster.ControlPlane(workdir / "plane", binaries=paths) as plane:
            plane.apply_crds()
            result = asyncio.run(run(args, plane, workdir))
    local_plane.write(out, result)
    print_summary(result)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
