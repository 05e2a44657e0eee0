"""``helm upgrade`` from the previous release to the working tree, and ``helm rollback``, keep every
allocation (issue 40, item 4).

A control plane of its own (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and
two kwok GPU nodes) starts with no gpualloc CRD, so that ``helm install`` of the previous release
(``v0.1.0``, a git worktree) installs that release's CRDs, as on a real cluster.

kwok runs no container: the chart's pods are scheduled and reported Running, and each component
that matters runs beside them as a host process (``upgrade_support.StandIn``), from the source
tree of the release being stood in for (the worktree before the upgrade and after the rollback,
the working tree in between), with the args of the release's live Deployment or DaemonSet and the
token of its ServiceAccount (the agent's bound to its pod). A component is replaced as a rolling
update replaces it: the new one starts, the old one gets SIGTERM. The API server cannot reach the
webhook's Service here, so its MutatingWebhookConfiguration points at the webhook stand-in; the
chart's clientConfig is put back before each helm command (a three-way merge with the url left
in place would give the object both a url and a service).

What is checked, after the upgrade and again after the rollback: each claim keeps its node and
GPU uuids; each device Lease keeps its uid and creation time and is never deleted (the audit log
has no delete of a Lease); each pod keeps its uid, is still Running with no deletionTimestamp, and
was never deleted or evicted (audit log). The new controller takes over within its Lease duration;
the time from the old leader's SIGTERM to the new one holding the election Lease, and to its
"starting to reconcile", is printed. The CRD step is the one the chart's README gives (a
server-side apply of crds/ by the field manager kubectl uses, without forcing conflicts); the
GpuClaim fields it adds are found by comparing the two releases' CRDs: claims of the old release
still validate and read back (with the new fields' defaults), and a claim that sets every new field
is accepted, kept as written, allocated, and keeps its GPUs through the rollback too.
"""

from __future__ import annotations

import base64
import json
import signal
import ssl
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc.api import constants
from gpualloc.devcluster import binaries, cluster
from tests.conftest import completed_requests, progress_printer, wait_until
from tests.e2e import tenants
from tests.e2e import upgrade_support as support
from tests.integration.tls_support import http_status, write_serving_pair

PREVIOUS_TAG, PREVIOUS_COMMIT = "v0.1.0", "be7002e"
NEW_CHART = support.REPO_ROOT / support.CHART_SUBDIR
GPU_NODES = ("up-gpu-1", "up-gpu-2")
SYSTEM = "gpualloc-system"
RELEASE = "up"  # full name up-gpualloc (a release named gpualloc would be gpualloc)
FULLNAME = f"{RELEASE}-gpualloc"
VALUES = (
    "--set", "certManager.enabled=false", "--set", "agent.source=simulated",
    "--set", "agent.profile=h100-sxm-8",
)  # fmt: skip
CLAIMS_CRD = f"{constants.CLAIM_PLURAL}.{constants.GROUP}"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{SYSTEM}/leases"
ELECTION_LEASE = f"{LEASES}/gpualloc-controller"  # the controller's --leader-election-id default
# The controller's --leader-election-lease-duration and --leader-election-retry-period defaults
# (the chart sets neither).
LEASE_DURATION_S, RETRY_PERIOD_S = 15.0, 2.0
PAUSE = "registry.k8s.io/pause:3.10"
# New fields the generic example value cannot stand for in step (b)'s claim: the value that the
# test's nodes can allocate, or the reason the field is left out of a claim the old release must
# read back after the rollback.
EXAMPLES: dict[tuple[str, ...], Any] = {("devices", "products"): ["*"]}  # any product: the simulated GPUs
LEFT_OUT = {
    ("devices", "sharing", "milli"): "a fractional share: the old release's controller cannot read a "
    "GPU's share ledger, so roll back only with no sharing.milli claim left (docs/operations.md)",
}
# The step before each upgrade, as the chart's README and docs/operations.md give it.
CRD_STEP = "kubectl apply --server-side --force-conflicts -f crds/"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("upgrade")


@pytest.fixture(scope="module")
def previous(workdir: Path) -> Iterator[Path]:
    """The previous release's source tree (a git worktree)."""
    yield from support.previous_release_tree(PREVIOUS_TAG, PREVIOUS_COMMIT, workdir / PREVIOUS_TAG)


@pytest.fixture(scope="module")
def plane(request: pytest.FixtureRequest, workdir: Path) -> Iterator[cluster.ControlPlane]:
    """A control plane of this module's own, with no gpualloc CRD, and two kwok GPU nodes."""
    say = progress_printer(request.config)
    paths = binaries.ensure(
        ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"], progress=say
    )
    made = cluster.ControlPlane(workdir / "controlplane", binaries=paths, progress=say)
    made.start()
    try:
        made.ensure_controller_manager()
        made.ensure_scheduler()
        for node in GPU_NODES:
            made.add_kwok_node(node, {"nvidia.com/gpu.present": "true"})
        yield made
    finally:
        made.stop()


# ----------------------------------------------------------------------------- the release


@dataclass
class Snapshot:
    """What must not change: claims' allocations, device Leases' identity, pods' identity."""

    allocations: dict[str, list[tuple[int, str, tuple[str, ...]]]]  # claim -> (replica, node, uuids)
    leases: dict[str, tuple[str, str, str]]  # Lease name -> (uid, creationTimestamp, holder)
    pods: dict[str, str]  # pod name -> uid


@dataclass
class Takeover:
    holder_s: float  # the old leader's SIGTERM or SIGKILL -> the new one holds the election Lease
    reconcile_s: float  # the same -> the new one logs "starting to reconcile"


class Release:
    """The release on ``plane``, the stand-ins of its components, and the test's workload."""

    def __init__(self, plane: cluster.ControlPlane, workdir: Path) -> None:
        self.plane = plane
        self.workdir = workdir
        self.helm_home = workdir / "helm"
        self.webhook_tls = write_serving_pair(workdir)  # ca.crt, tls.crt, tls.key for 127.0.0.1
        self.running: dict[str, support.StandIn] = {}
        self.stopped: list[support.StandIn] = []
        self.workload = f"work-{uuid.uuid4().hex[:6]}"
        self.revision = 0

    # -- helm and the webhook configuration

    def helm(self, *args: str) -> str:
        return tenants.helm(self.plane.kubeconfig, self.helm_home, *args)

    def helm_op(self, *args: str) -> None:
        """A helm command on the release, with the chart's webhook clientConfig in place."""
        manifest = yaml.safe_load_all(self.helm("get", "manifest", RELEASE, "--namespace", SYSTEM))
        (mwc,) = [d for d in manifest if d and d["kind"] == "MutatingWebhookConfiguration"]
        self.point_webhook(mwc["webhooks"][0]["clientConfig"])
        self.helm(*args)
        self.revision = int(
            json.loads(self.helm("status", RELEASE, "--namespace", SYSTEM, "-o", "json"))["version"]
        )

    def point_webhook(self, client_config: dict[str, Any]) -> None:
        self.plane.request(
            "PATCH",
            f"{tenants.ADMISSION}/mutatingwebhookconfigurations/{FULLNAME}",
            [{"op": "replace", "path": "/webhooks/0/clientConfig", "value": client_config}],
            content_type=tenants.JSON_PATCH,
        )

    # -- tokens

    def token(self, account: str, pod: dict[str, Any] | None = None) -> Path:
        spec: dict[str, Any] = {"audiences": [], "expirationSeconds": 3600}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", **{
                k: pod["metadata"][k] for k in ("name", "uid")}}  # fmt: skip
        review = self.plane.request(
            "POST",
            f"/api/v1/namespaces/{SYSTEM}/serviceaccounts/{account}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        name = f"{account}-{pod['metadata']['name'] if pod else 'sa'}-{uuid.uuid4().hex[:4]}.kubeconfig"
        return tenants.token_kubeconfig(self.plane, review["status"]["token"], self.workdir / name)

    # -- stand-ins

    def workload_object(self, kind: str, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.plane.request("GET", f"/apis/apps/v1/namespaces/{SYSTEM}/{kind}/{name}")
        return found

    def agent_pod(self, node: str) -> dict[str, Any]:
        """The agent DaemonSet's pod on ``node`` once its rollout is done: the DaemonSet has seen its
        spec and updated every node, and one pod, Running, is left on ``node``."""

        def current() -> dict[str, Any] | None:
            ds = self.workload_object("daemonsets", f"{FULLNAME}-agent")
            status = ds.get("status") or {}
            if status.get("observedGeneration") != ds["metadata"]["generation"] or status.get(
                "updatedNumberScheduled"
            ) != status.get("desiredNumberScheduled"):
                return None
            selector = "app.kubernetes.io/component%3Dagent"
            listing = self.plane.request("GET", f"/api/v1/namespaces/{SYSTEM}/pods?labelSelector={selector}")
            here = [p for p in listing["items"] if p["spec"].get("nodeName") == node]
            if len(here) == 1 and not here[0]["metadata"].get("deletionTimestamp"):
                return dict(here[0]) if here[0]["status"].get("phase") == "Running" else None
            return None

        found: dict[str, Any] = wait_until(f"the agent pod on {node}", current, within=60)
        return found

    def start(self, component: str, source: Path) -> support.StandIn:
        """Start ``component`` (controller, webhook, agent:<node>) of the live release from ``source``."""
        role, _, node = component.partition(":")
        kind = "daemonsets" if role == "agent" else "deployments"
        template = self.workload_object(kind, f"{FULLNAME}-{role}")["spec"]["template"]
        (container,) = template["spec"]["containers"]
        account = template["spec"]["serviceAccountName"]
        downward = {
            "POD_NAMESPACE": SYSTEM,
            "POD_NAME": f"{FULLNAME}-{role}-r{self.revision}",
            "NODE_NAME": node,
        }
        if role == "agent":
            pod = self.agent_pod(node)
            downward["POD_NAME"] = pod["metadata"]["name"]
            kubeconfig = self.token(account, pod)
        else:
            kubeconfig = self.token(account)
        (port,) = cluster.free_ports(1)
        if role == "webhook":
            _, cert, key = self.webhook_tls
            local = [f"--port={port}", "--metrics-port=0", "--health-port=0",
                     f"--tls-cert-file={cert}", f"--tls-key-file={key}"]  # fmt: skip
        else:
            local = ["--metrics-port=0", f"--health-port={port}"]
        if "--kubelet-plugin" in container["args"]:  # DRA on: the kubelet plugin's paths, not the host's
            local += [
                f"--kubelet-root={self.workdir / node / 'kubelet'}",
                f"--cdi-dir={self.workdir / node / 'cdi'}",
            ]
        args = support.stand_in_args(container, downward, local, kubeconfig)
        name = f"{component.replace(':', '-')}-r{self.revision}"
        return support.StandIn(name, source, args, downward, self.workdir, port=port)

    def wait_ready(self, standin: support.StandIn) -> None:
        """Until ``standin`` answers /readyz with 200 (the webhook over TLS on its serving port)."""
        tls = (
            ssl.create_default_context(cafile=str(self.webhook_tls[0])) if "webhook" in standin.name else None
        )

        def ready() -> bool:
            standin.alive()
            return (
                http_status(standin.port, "/readyz", tls=tls, server_name="127.0.0.1" if tls else "") == 200
            )

        wait_until(f"{standin.name} /readyz", ready, within=60, logs=standin.tail)

    def roll(self, source: Path, *, kill_leader: bool = False) -> Takeover | None:
        """Replace every component by one run from ``source``, as rolling updates do: the webhook
        (then the configuration points at the new one), the controller (the new one a ready standby
        before the old leader gets SIGTERM, or SIGKILL with ``kill_leader``), the agents node by
        node."""
        webhook = self.start("webhook", source)
        self.wait_ready(webhook)
        ca, _, _ = self.webhook_tls
        self.point_webhook(
            {
                "url": f"https://127.0.0.1:{webhook.port}/mutate",
                "caBundle": base64.b64encode(ca.read_bytes()).decode(),
            }
        )
        self.replace("webhook", webhook)

        controller = self.start("controller", source)
        takeover = None
        if "controller" in self.running:
            self.wait_ready(controller)  # a standby: caches synced, not leading
            takeover = self.hand_over(self.running["controller"], controller, kill=kill_leader)
        self.replace("controller", controller, code=-signal.SIGKILL if kill_leader else 0)
        wait_until(
            "the controller to lead",
            lambda: self.holder() == controller.identity,
            within=LEASE_DURATION_S * 2,
        )

        for node in GPU_NODES:
            if f"agent:{node}" in self.running:
                self.running[f"agent:{node}"].stop()
            agent = self.start(f"agent:{node}", source)
            self.wait_ready(agent)
            self.replace(f"agent:{node}", agent)
        return takeover

    def replace(self, component: str, new: support.StandIn, *, code: int = 0) -> None:
        old = self.running.get(component)
        if old is not None:
            exited = old.stop()
            self.stopped.append(old)
            assert exited == code, f"{old.name} exited {exited}:\n{old.tail()}"
        self.running[component] = new

    def holder(self) -> str:
        try:
            return str(self.plane.request("GET", ELECTION_LEASE)["spec"].get("holderIdentity") or "")
        except cluster.RequestError:
            return ""

    def hand_over(self, old: support.StandIn, new: support.StandIn, *, kill: bool) -> Takeover:
        """Stop the leading ``old`` (SIGTERM: it gives the election Lease up; SIGKILL: it cannot, and
        the Lease must expire) and time the ready standby ``new`` taking over."""
        wait_until(
            "the old controller to lead", lambda: self.holder() == old.identity, within=LEASE_DURATION_S * 2
        )
        assert "starting to reconcile" not in new.text(), (
            "the standby reconciled while the old controller led"
        )
        sent = time.monotonic()
        if kill:
            old.process.kill()
        else:
            old.terminate()
        # A Lease given up is taken at the standby's next try; one left to expire, at most the
        # Lease duration after its last renewal (at most a retry period before the kill) plus a try.
        bound = LEASE_DURATION_S + 2 * RETRY_PERIOD_S if kill else LEASE_DURATION_S
        holder_at = reconcile_at = 0.0
        while not (holder_at and reconcile_at):
            now = time.monotonic() - sent
            assert now < bound, (
                f"the new controller did not take over within {bound:.0f} s"
                f" (Lease duration {LEASE_DURATION_S:.0f} s):"
                f" holder {self.holder()!r}\n--- old\n{old.tail()}\n--- new\n{new.tail()}"
            )
            if not holder_at and self.holder() == new.identity:
                holder_at = now
            if not reconcile_at and "starting to reconcile" in new.text():
                reconcile_at = now
            time.sleep(0.05)
        return Takeover(holder_at, reconcile_at)

    def stop_all(self) -> dict[str, int]:
        codes = {s.name: s.stop() for s in self.running.values()}
        self.running.clear()
        return codes

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.tail()}" for s in [*self.stopped, *self.running.values()])

    # -- the workload

    def claims(self) -> str:
        return tenants.claims_path(self.workload)

    def wait_claims_served(self) -> None:
        """The API server serves a new CRD's kind a moment after helm installs it (a POST meanwhile
        gets 503, "There can be a delay between when CustomResourceDefinitions are created and
        when they are available", seen under load; or 429, "storage is (re)initializing"): wait
        until the claims list answers."""

        def served() -> bool:
            try:
                self.plane.request("GET", self.claims())
            except cluster.RequestError as exc:
                if exc.status in (404, 429, 503):
                    return False
                raise
            return True

        wait_until("the GpuClaim kind served", served)

    def create_claim(self, name: str, count: int, replicas: int = 1, **extra: Any) -> dict[str, Any]:
        body = {
            "apiVersion": constants.API_VERSION,
            "kind": constants.CLAIM_KIND,
            "metadata": {"name": name},
            "spec": {"devices": {"count": count}, "replicas": replicas, **extra},
        }
        created: dict[str, Any] = self.plane.request("POST", self.claims(), body)
        return created

    def claim(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.plane.request("GET", f"{self.claims()}/{name}")
        return found

    def wait_allocated(self, name: str) -> dict[str, Any]:
        def allocated() -> dict[str, Any] | None:
            got = self.claim(name)
            return got if (got.get("status") or {}).get("phase") == "Allocated" else None

        found: dict[str, Any] = wait_until(f"claim {name} Allocated", allocated, within=60, logs=self.logs)
        return found

    def create_pod(self, claim: str, replica: int) -> None:
        annotations = {constants.ANNOTATION_CLAIM: claim, constants.ANNOTATION_REPLICA: str(replica)}
        body = tenants.pod(
            f"{claim}-{replica}", [tenants.container("main", image=PAUSE)], annotations=annotations
        )
        self.plane.request("POST", f"/api/v1/namespaces/{self.workload}/pods", body)

    def pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.plane.request("GET", f"/api/v1/namespaces/{self.workload}/pods")[
            "items"
        ]
        return items

    def wait_running(self, count: int) -> None:
        def running() -> bool:
            pods = self.pods()
            return len(pods) == count and all(p["status"].get("phase") == "Running" for p in pods)

        wait_until(f"{count} pods Running", running, within=60, logs=self.logs)

    def snapshot(self, names: list[str]) -> Snapshot:
        allocations = {}
        for name in names:
            claim = self.claim(name)
            assert claim["status"]["phase"] == "Allocated", (name, claim["status"])
            allocations[name] = sorted(
                (a["replica"], a["nodeName"], tuple(sorted(d["uuid"] for d in a["devices"])))
                for a in claim["status"]["allocations"]
            )
        selector = f"{constants.LABEL_MANAGED_BY}%3D{constants.MANAGED_BY}"
        leases = {
            lease["metadata"]["name"]: (
                lease["metadata"]["uid"],
                lease["metadata"]["creationTimestamp"],
                lease["spec"].get("holderIdentity", ""),
            )
            for lease in self.plane.request("GET", f"{LEASES}?labelSelector={selector}")["items"]
        }
        pods = {}
        for pod in self.pods():
            assert pod["status"].get("phase") == "Running", (pod["metadata"]["name"], pod["status"])
            assert not pod["metadata"].get("deletionTimestamp"), pod["metadata"]
            pods[pod["metadata"]["name"]] = pod["metadata"]["uid"]
        return Snapshot(allocations, leases, pods)

    def writes(self, snap: Snapshot) -> dict[str, list[str]]:
        """The completed writes (verb and subresource; dry runs left out) to each device Lease and
        each pod of ``snap``, from the audit log; evictions are creates of pods/eviction."""
        objects = [("leases", name, SYSTEM) for name in snap.leases]
        objects += [("pods", name, self.workload) for name in snap.pods]
        out: dict[str, list[str]] = {}
        for resource, name, namespace in objects:
            events = completed_requests(
                self.plane.audit_log, resource=resource, name=name, namespace=namespace
            )
            out[f"{resource}/{name}"] = [
                "/".join(filter(None, (e["verb"], (e.get("objectRef") or {}).get("subresource"))))
                for e in events
                if e["verb"] not in ("get", "list", "watch")
                and e["responseStatus"].get("code", 0) < 300
                and "dryRun" not in e.get("requestURI", "")
            ]
        return out


def server_side_apply_crds(plane: cluster.ControlPlane, chart: Path) -> list[str]:
    """``kubectl apply --server-side --force-conflicts -f crds/`` (the README's step: field manager
    kubectl, conflicts forced), then wait until each CRD is Established.

    Helm creates the CRDs on the first install and so owns ``.spec.versions`` (an atomic list):
    without --force-conflicts the apply is refused (409, conflict with "helm")."""
    names = []
    for crd in support.crd_documents(chart):
        name = crd["metadata"]["name"]
        try:
            plane.request(
                "PATCH",
                f"{CRD_PATH}/{name}?fieldManager=kubectl&force=true",
                crd,
                content_type="application/apply-patch+yaml",
            )
        except cluster.RequestError as exc:
            raise AssertionError(
                f"`{CRD_STEP}` is refused for {name} ({exc.status}):"
                f" the README's upgrade step would fail\n{exc.body}"
            ) from exc
        names.append(name)

    def established() -> bool:
        for name in names:
            conditions = plane.request("GET", f"{CRD_PATH}/{name}").get("status", {}).get("conditions") or []
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return False
        return True

    wait_until("the CRDs Established", established)
    return names


# ----------------------------------------------------------------------------- the test


def test_helm_upgrade_from_the_previous_release_and_rollback_keep_claims_gpus_leases_and_pods(
    plane: cluster.ControlPlane, previous: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    began = time.monotonic()
    old_chart = previous / support.CHART_SUBDIR
    # The stand-ins really run each tree's code.
    for source in (previous, support.REPO_ROOT):
        where = support.imported_from(source)
        assert all(Path(f).is_relative_to(source) for f in where.values()), (source, where)

    old_crd = next(c for c in support.crd_documents(old_chart) if c["metadata"]["name"] == CLAIMS_CRD)
    new_crd = next(c for c in support.crd_documents(NEW_CHART) if c["metadata"]["name"] == CLAIMS_CRD)
    added = support.added_fields(
        support.spec_schema(old_crd, constants.VERSION), support.spec_schema(new_crd, constants.VERSION)
    )
    assert added, (
        f"the working tree's GpuClaim CRD adds no spec field to {PREVIOUS_TAG}'s: this upgrade test"
        " expects a change that adds one (issue 40: spec.onDeviceFailure)"
    )

    for doc in (NEW_CHART / "README.md", support.REPO_ROOT / "docs" / "operations.md"):
        assert CRD_STEP.replace("crds/", "") in doc.read_text(), (
            f"{doc} does not give the CRD step {CRD_STEP}"
        )

    r = Release(plane, workdir)
    plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": r.workload}})
    plane.ensure_service_account(r.workload)
    try:
        # 1. The previous release, as released: its chart (which installs its CRDs) and its code.
        r.helm("install", RELEASE, str(old_chart), "--namespace", SYSTEM, "--create-namespace", "--no-hooks",
               "--timeout", "120s", *VALUES)  # fmt: skip
        r.revision = 1
        r.wait_claims_served()
        live = plane.request("GET", f"{CRD_PATH}/{CLAIMS_CRD}")
        assert not set(added) & set(support.spec_fields(support.spec_schema(live, constants.VERSION)))
        assert r.roll(previous) is None  # nothing to take over from

        # 2. Claims with running pods: two single claims and a gang of two replicas, on two nodes.
        r.create_claim("solo", 2)
        r.create_claim("wide", 4)
        r.create_claim("gang", 2, replicas=2)
        names = ["solo", "wide", "gang"]
        for name in names:
            r.wait_allocated(name)
        for name, replicas in (("solo", 1), ("wide", 1), ("gang", 2)):
            for replica in range(replicas):
                r.create_pod(name, replica)
        r.wait_running(4)
        before = r.snapshot(names)
        assert len(before.leases) == 10, before.leases
        old_claims = {name: r.claim(name) for name in names}

        # 3. The documented CRD step, then helm upgrade to the working tree's chart and code.
        server_side_apply_crds(plane, NEW_CHART)
        live = plane.request("GET", f"{CRD_PATH}/{CLAIMS_CRD}")
        assert set(added) <= set(support.spec_fields(support.spec_schema(live, constants.VERSION)))
        for name, old in old_claims.items():
            # (a) A claim of the old release reads back, with the new fields' defaults...
            now = r.claim(name)
            assert now["metadata"]["uid"] == old["metadata"]["uid"]
            for path, schema in added.items():
                if "default" in schema:
                    assert support.get_path(now["spec"], path) == schema["default"], (name, path, now["spec"])
            # ...and its spec as the old release wrote it validates under the new schema.
            copy = {**old, "metadata": {"name": f"{name}-copy"}}
            del copy["status"]
            plane.request("POST", f"{r.claims()}?dryRun=All&fieldValidation=Strict", copy)
        r.helm_op("upgrade", RELEASE, str(NEW_CHART), "--namespace", SYSTEM, "--no-hooks", *VALUES)
        assert r.revision == 2
        upgrade = r.roll(support.REPO_ROOT)
        assert upgrade is not None
        after_upgrade = r.snapshot(names)

        # (b) A claim that sets every field the new CRD adds: accepted as written, and allocated.
        body: dict[str, Any] = {"devices": {"count": 1}}
        settable = {path: schema for path, schema in added.items() if path not in LEFT_OUT}
        for path, schema in settable.items():
            support.put_path(body, path, EXAMPLES.get(path, support.example_value(schema)))
        created = plane.request(
            "POST", f"{r.claims()}?fieldValidation=Strict", {
                "apiVersion": constants.API_VERSION, "kind": constants.CLAIM_KIND,
                "metadata": {"name": "new-fields"}, "spec": body},
        )  # fmt: skip
        for path in settable:
            assert support.get_path(created["spec"], path) == support.get_path(body, path), (
                path,
                created["spec"],
            )
        r.wait_allocated("new-fields")
        r.create_pod("new-fields", 0)  # through the new webhook
        r.wait_running(5)
        names.append("new-fields")
        with_new = r.snapshot(names)

        # 4. helm rollback to revision 1 (helm leaves the CRDs as they are) and the old code again.
        r.helm_op("rollback", RELEASE, "1", "--namespace", SYSTEM, "--no-hooks", "--timeout", "120s")
        assert r.revision == 3
        rollback = r.roll(previous, kill_leader=True)  # and the leader crashes rather than hand over
        assert rollback is not None
        after_rollback = r.snapshot(names)
        time.sleep(3)  # a few of the old controller's passes over the claims it did not write
        settled = r.snapshot(names)

        for label, snap in (("upgrade", after_upgrade), ("rollback", after_rollback), ("settled", settled)):
            reference = with_new if label != "upgrade" else before
            assert snap.allocations == reference.allocations, (label, reference.allocations, snap.allocations)
            assert snap.leases == reference.leases, (label, reference.leases, snap.leases)
            assert snap.pods == reference.pods, (label, reference.pods, snap.pods)
        kept = r.claim("new-fields")["spec"]  # the old controller writes status only
        assert all(support.get_path(kept, path) == support.get_path(body, path) for path in settable), kept
        writes = r.writes(settled)
        # The audit log is read right: it has every Lease's and every pod's create, once.
        assert all(w.count("create") == 1 for w in writes.values()), writes
        removed = {k: w for k, w in writes.items() if {"delete", "create/eviction"} & set(w)}
        assert removed == {}, removed
        for standin in [*r.stopped, *r.running.values()]:
            assert '"level": "ERROR"' not in standin.text() and "Traceback" not in standin.text(), (
                standin.name, standin.tail())  # fmt: skip
        with capsys.disabled():
            print(
                f"\n[upgrade] takeover old->new: Lease holder {upgrade.holder_s:.2f} s, reconciling"
                f" {upgrade.reconcile_s:.2f} s (old leader SIGTERM); rollback new->old (new leader SIGKILL):"
                f" Lease holder {rollback.holder_s:.2f} s,"
                f" reconciling {rollback.reconcile_s:.2f} s; {len(before.leases)} + 1 Leases and"
                f" {len(with_new.pods)} pods kept; added fields {sorted('.'.join(p) for p in added)};"
                f" test {time.monotonic() - began:.0f} s"
            )
    finally:
        codes = r.stop_all()
    assert all(code == 0 for code in codes.values()), (codes, r.logs())
