"""`make demo`: gpualloc end to end on a laptop, with simulated GPUs.

Starts the local control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager, kwok), three fake GPU nodes, one simulated agent per
node with a different hardware profile, the controller, and the webhook with a
certificate from `gpualloc certs`; applies `examples/`, waits for the pods to
land, prints what a user wants to see, then waits for Ctrl-C and tears it all
down (or exits at once with `--exit`).

With `--real-node` (root; `make demo DEMO_ARGS=--real-node`) the pods really run: the control plane
and a real node (containerd and a kubelet, `gpualloc dev up --real-node`'s) whose agent is the
kubelet's DRA plugin, the controller and the webhook with `--dra`; two claims each get a busybox pod,
and a pod without a claim asks for every GPU; each container lists its /dev and the demo prints what
each saw: exactly its claim's GPUs, and none without a claim.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from gpualloc import views
from gpualloc.api import codecs, constants, leases, models
from gpualloc.devcluster import cluster, components

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
NAMESPACE = constants.DEFAULT_NAMESPACE
DEMO_NAMESPACE = "default"
CLIQUE = {"nvidia.com/gpu.clique": "demo-clique-1"}  # the NVLink domain of examples/05-clique-gang.yaml
NODES = (
    ("gpu-node-a", "h100-sxm-8", {constants.LABEL_COST_TIER: "high", **CLIQUE}),
    ("gpu-node-b", "a100-pcie-4-nvlink", {constants.LABEL_COST_TIER: "medium"}),
    ("gpu-node-c", "consumer-8", {constants.LABEL_COST_TIER: "low", **CLIQUE}),
)
WEBHOOK_CONFIG = "gpualloc-demo"


def say(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Processes:
    """The component processes the demo starts; all stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: Sequence[str]) -> None:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - kept open for the child
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpualloc.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append((name, proc))

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{tail}")

    def stop(self) -> None:
        """SIGTERM every process group at once (they shut down in parallel), then wait for each,
        SIGKILLing any still alive after 10 s."""
        for _, proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10  # one deadline for all: they stop in parallel
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def wait_for(what: str, check: Any, limit_s: float, procs: Processes) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        procs.check()
        if await check():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.5)


async def list_claims(api: Any) -> list[Any]:
    from gpualloc.kube import resources

    raw = await resources.CustomResources(api).list_claims(DEMO_NAMESPACE)
    return [codecs.parse_claim(item) for item in raw["items"]]


async def list_pods(api: Any) -> list[dict[str, Any]]:
    from gpualloc.kube import transport

    pods = await transport.request(api, "GET", transport.collection_path("", "v1", "pods", DEMO_NAMESPACE))
    return list(pods["items"])


def pod_rows(pods: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        claim = pod["metadata"].get("annotations", {}).get(constants.ANNOTATION_CLAIM, "-")
        spec = pod["spec"]
        selector = (spec.get("nodeSelector") or {}).get(constants.HOSTNAME_LABEL, "-")
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
            rows.append(
                [
                    pod["metadata"]["name"],
                    container["name"],
                    claim,
                    selector,
                    spec.get("nodeName") or "-",
                    pod.get("status", {}).get("phase", "-"),
                    env.get("CUDA_VISIBLE_DEVICES", "-"),
                ]
            )
    return rows


async def summary(api: Any, kubeconfig: Path) -> bool:
    """Print pods, claims and nodes; True when every pod sits where its claim says."""
    from gpualloc.kube import leases as lease_api
    from gpualloc.kube import resources

    now = dt.datetime.now(dt.UTC)
    claims = await list_claims(api)
    by_name = {c.metadata.name: c for c in claims}
    pods = await list_pods(api)
    print("\n=== Pods: where they landed and which GPUs they see")
    print(
        views.table(
            ["POD", "CONTAINER", "CLAIM", "NODESELECTOR", "NODE", "PHASE", "CUDA_VISIBLE_DEVICES"],
            pod_rows(pods),
        )
    )
    ok = True
    for pod in pods:
        name = pod["metadata"].get("annotations", {}).get(constants.ANNOTATION_CLAIM)
        claim = by_name.get(name or "")
        if claim is None or not claim.status.allocations:
            continue
        devices = pod["metadata"]["annotations"].get(constants.ANNOTATION_DEVICES, "")
        allocation = next(
            (a for a in claim.status.allocations if ",".join(d.uuid for d in a.devices) == devices), None
        )
        if allocation is None or pod["spec"].get("nodeName") != allocation.node_name:
            ok = False
            continue
        # The devices every container will see, as stored in the pod's spec.
        for container in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
            env = {e["name"]: e.get("value") for e in container.get("env", [])}
            if env.get("CUDA_VISIBLE_DEVICES") != devices or env.get("NVIDIA_VISIBLE_DEVICES") != devices:
                ok = False
    print("\n=== Claims")
    print(views.format_claims(claims, now, all_namespaces=False))
    raw_nodes = (await resources.CustomResources(api).list_node_statuses())["items"]
    nodes = [codecs.parse_node_status(n) for n in raw_nodes]
    beats = (await lease_api.list_leases(api, leases.heartbeat_namespace(NAMESPACE)))["items"]
    print("\n=== GPU nodes")
    print(
        views.format_nodes(
            nodes,
            views.allocated_uuids(claims),
            now,
            views.latest_heartbeats(nodes, beats),
            views.allocated_milli(claims),
        )
    )
    print("\n=== Topology of gpu-node-b (gpualloc topo gpu-node-b)")
    node_b = next(n for n in nodes if n.metadata.name == "gpu-node-b")
    print("\n".join(views.format_topology(node_b).splitlines()[:6]))
    print("\n=== Why is a100-quad pending? (gpualloc explain claim a100-quad)")
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "gpualloc.cli",
            "explain",
            "claim",
            "a100-quad",
            "--kubeconfig",
            str(kubeconfig),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    print(out.stdout.rstrip() or out.stderr.rstrip())
    print()
    return ok


def start_components(procs: Processes, kubeconfig: str, certs_dir: Path) -> int:
    """One simulated agent per node, the controller, and the webhook with fresh certificates.

    Returns the webhook's port.
    """
    spare = cluster.free_ports(2 * (len(NODES) + 1) + 1)  # chosen together: all different
    webhook_port = spare.pop()

    def ports() -> list[str]:
        return ["--metrics-port", str(spare.pop()), "--health-port", str(spare.pop())]

    for name, profile, _ in NODES:
        agent = ["agent", "--source", "simulated", "--profile", profile, "--node-name", name]
        agent += ["--kubeconfig", kubeconfig, "--lease-namespace", NAMESPACE, "--heartbeat-interval", "10"]
        procs.start(f"agent-{name}", agent + ports())
    controller = ["controller", "--kubeconfig", kubeconfig, "--namespace", NAMESPACE, "--leader-elect=false"]
    controller += ["--sweep-interval", "5"]  # finished pods are noticed by the sweep: OnPodsCompleted
    procs.start("controller", controller + ports())
    certs = ["certs", "--out-dir", str(certs_dir), "--ip-address", "127.0.0.1", "--dns-name", "localhost"]
    subprocess.run([sys.executable, "-m", "gpualloc.cli", *certs], check=True, stdout=subprocess.DEVNULL)
    say(f"  webhook certificate from `gpualloc certs` in {certs_dir}")
    webhook = ["webhook", "--kubeconfig", kubeconfig, "--host", "127.0.0.1", "--port", str(webhook_port)]
    webhook += ["--tls-cert-file", str(certs_dir / "tls.crt"), "--tls-key-file", str(certs_dir / "tls.key")]
    procs.start("webhook", webhook)
    return webhook_port


async def drive(
    cp: Any, procs: Processes, webhook_port: int, ca_bundle: bytes, docs: list[dict[str, Any]], stay: bool
) -> int:
    """Apply the examples, wait, print the summary; then wait for Ctrl-C if asked."""
    from gpualloc.kube import client

    api = await client.connect(str(cp.kubeconfig))
    try:
        await register_webhook(api, webhook_port, ca_bundle)
        await wait_for_nodes(api, procs)
        await wait_for_webhook(webhook_port, procs)
        # One claim at a time, each decided before the next: where a claim lands depends on what
        # the claims before it took, and the walkthrough should come out the same on every run.
        say("applying the claims in examples/, one at a time")
        for doc in docs:
            if doc["kind"] == constants.CLAIM_KIND:
                await apply_claim_doc(api, doc, procs)
        say("applying the pods and the Indexed Job that use them")
        for doc in docs:
            if doc["kind"] != constants.CLAIM_KIND:
                await apply_workload_doc(api, doc)
        await wait_for("the pods to be scheduled and started", lambda: pods_running(api, 4), 120, procs)
        if not await summary(api, cp.kubeconfig):
            say("ERROR: a pod is not on the node or devices its claim names")
            return 1
        await show_release(api, procs)
        say(f"try: gpualloc get nodes --kubeconfig {cp.kubeconfig}")
        if not stay:
            return 0
        say("running; press Ctrl-C to tear everything down")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set():
            procs.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 2)
        return 0
    finally:
        await api.close()


async def show_release(api: Any, procs: Processes) -> None:
    """The ddp Job's pods complete (kwok finishes Job pods): its OnPodsCompleted claim turns Released."""
    from gpualloc.kube import resources

    print("=== Release when the work is done: ddp has release: OnPodsCompleted")
    released: list[models.GpuClaim] = []

    async def is_released() -> bool:
        claim = codecs.parse_claim(await resources.CustomResources(api).get_claim(DEMO_NAMESPACE, "ddp"))
        if claim.status.phase == constants.PHASE_RELEASED:
            released.append(claim)
        return bool(released)

    await wait_for("GpuClaim ddp to be Released once its Job's pods completed", is_released, 90, procs)
    status = released[-1].status
    say(f"  GpuClaim ddp: Released at {status.released_time}: {status.message}")


async def apply_claim_doc(api: Any, doc: dict[str, Any], procs: Processes) -> None:
    """Create the claim, wait until the controller has decided it, and say where it landed."""
    from gpualloc.kube import resources

    name = doc["metadata"]["name"]
    await resources.CustomResources(api).create_claim(DEMO_NAMESPACE, doc)
    decided: list[Any] = []

    async def is_decided() -> bool:
        claim = codecs.parse_claim(await resources.CustomResources(api).get_claim(DEMO_NAMESPACE, name))
        if claim.status.phase == constants.PHASE_ALLOCATED or claim.status.message:
            decided.append(claim)
        return bool(decided)

    await wait_for(f"GpuClaim {name} to be decided", is_decided, 60, procs)
    claim = decided[-1]
    if claim.status.phase == constants.PHASE_ALLOCATED:
        where = ", ".join(
            f"{a.node_name} GPUs {','.join(str(d.index) for d in a.devices)}"
            for a in claim.status.allocations
        )
        say(f"  GpuClaim {name}: Allocated on {where}")
    else:
        say(f"  GpuClaim {name}: {claim.status.phase}: {claim.status.message}")


async def apply_workload_doc(api: Any, doc: dict[str, Any]) -> None:
    from gpualloc.kube import transport

    kinds = {"Pod": ("", "v1", "pods"), "Job": ("batch", "v1", "jobs")}
    if doc["kind"] not in kinds:
        raise ValueError(f"the demo does not apply {doc['kind']}")
    path = transport.collection_path(*kinds[doc["kind"]], DEMO_NAMESPACE)
    await transport.request(api, "POST", path, body=doc)
    say(f"  {doc['kind']} {doc['metadata']['name']}")


async def pods_running(api: Any, expected: int) -> bool:
    pods = await list_pods(api)
    # kwok completes pods owned by a Job (its pod-complete stage), so Succeeded counts as landed.
    landed = ("Running", "Succeeded")
    return len(pods) >= expected and all(p.get("status", {}).get("phase") in landed for p in pods)


async def wait_for_nodes(api: Any, procs: Processes) -> None:
    from gpualloc.kube import resources

    async def published() -> bool:
        items = (await resources.CustomResources(api).list_node_statuses())["items"]
        return len(items) == len(NODES) and all((i.get("status") or {}).get("total") for i in items)

    await wait_for("the agents to publish their GpuNodeStatus", published, 60, procs)
    say("  3 GpuNodeStatus published")


async def wait_for_webhook(port: int, procs: Processes) -> None:
    import ssl

    import aiohttp

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE

    async def ready() -> bool:
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.get(
                    f"https://127.0.0.1:{port}/readyz", ssl=context, timeout=aiohttp.ClientTimeout(total=2)
                ) as resp,
            ):
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    await wait_for("the webhook to be ready", ready, 60, procs)
    say("  webhook ready")


async def register_webhook(api: Any, port: int, ca_bundle: bytes) -> None:
    """The MutatingWebhookConfiguration the chart installs, pointed at 127.0.0.1."""
    from gpualloc.kube import transport

    body = components.webhook_configuration(WEBHOOK_CONFIG, f"https://127.0.0.1:{port}/mutate", ca_bundle)
    path = transport.collection_path("admissionregistration.k8s.io", "v1", "mutatingwebhookconfigurations")
    await transport.request(api, "POST", path, body=body)


# --real-node: claims of the real node's 8 simulated GPUs, each with a busybox pod that lists /dev.
REAL_NODE_PROFILE = "h100-sxm-8"
REAL_NODE_CLAIMS = (("train", 2), ("notebook", 1))
REAL_NODE_PLAIN_POD = "no-claim"
LISTED = "end-of-listing"


def _real_node_pod(name: str, claim: str | None) -> dict[str, Any]:
    """A busybox pod that prints its /dev and CUDA_VISIBLE_DEVICES, then sleeps; one without a claim
    asks for every GPU the NVIDIA way (NVIDIA_VISIBLE_DEVICES=all)."""
    from gpualloc.devcluster import images

    command = f"ls /dev; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; echo {LISTED}; sleep 3600"
    container: dict[str, Any] = {
        "name": "main",
        "image": images.TOOLBOX_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", command],
    }
    metadata: dict[str, Any] = {"name": name}
    if claim is None:
        container["env"] = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    else:
        metadata["annotations"] = {constants.ANNOTATION_CLAIM: claim}
    spec = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _poll(what: str, check: Any, limit_s: float, alive: Any) -> Any:
    deadline = time.monotonic() + limit_s
    while True:
        alive()
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {limit_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def drive_real_node(cp: cluster.ControlPlane, alive: Any) -> bool:
    """Claims and busybox pods on the real node; print what each container saw. True when each
    claim pod saw exactly its claim's GPUs and the pod without a claim saw none."""
    claims_path = f"/apis/{constants.API_VERSION}/namespaces/{DEMO_NAMESPACE}/{constants.CLAIM_PLURAL}"
    pods_path = f"/api/v1/namespaces/{DEMO_NAMESPACE}/pods"
    expected: dict[str, tuple[str, list[str]]] = {}  # pod -> (claim, the nvidia files it should see)
    for name, count in REAL_NODE_CLAIMS:
        body = {"apiVersion": constants.API_VERSION, "kind": constants.CLAIM_KIND, "metadata": {"name": name}}
        cp.request("POST", claims_path, {**body, "spec": {"devices": {"count": count}}})

        def allocated(name: str = name) -> Any:
            claim = cp.request("GET", f"{claims_path}/{name}")
            return claim if (claim.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED else None

        claim = _poll(f"GpuClaim {name} to be Allocated", allocated, 60, alive)
        devices = [d for a in claim["status"]["allocations"] for d in a["devices"]]
        files = sorted(["nvidiactl", *(f"nvidia{d['minor']}" for d in devices)])
        expected[f"{name}-pod"] = (name, files)
        say(f"  GpuClaim {name}: Allocated, GPUs {','.join(str(d['index']) for d in devices)}")
    expected[REAL_NODE_PLAIN_POD] = ("-", [])
    for pod, (claim_name, _) in expected.items():
        cp.request("POST", pods_path, _real_node_pod(pod, None if claim_name == "-" else claim_name))
        say(f"  Pod {pod}" + ("" if claim_name == "-" else f" (claim {claim_name})"))
    rows, ok = [], True
    for pod, (claim_name, files) in expected.items():

        def listed(pod: str = pod) -> Any:
            try:
                text = cp.request("GET", f"{pods_path}/{pod}/log", accept="*/*")
            except cluster.RequestError as exc:
                if exc.status == 400:  # its container is not started yet
                    return None
                raise
            return text if isinstance(text, str) and LISTED in text else None

        words = _poll(f"pod {pod} to list /dev", listed, 120, alive).split()
        seen = sorted(w for w in words if w.startswith("nvidia"))
        cuda = next((w.split("=", 1)[1] for w in words if w.startswith("CUDA_VISIBLE_DEVICES=")), "")
        node = cp.request("GET", f"{pods_path}/{pod}")["spec"].get("nodeName", "-")
        good = seen == files
        ok = ok and good
        rows.append([pod, claim_name, node, " ".join(seen) or "(none)", cuda or "-", "yes" if good else "NO"])
    print("\n=== What each container saw on the real node (ls /dev, from its log)")
    print(
        views.table(
            ["POD", "CLAIM", "NODE", "/dev/nvidia*", "CUDA_VISIBLE_DEVICES", "EXACTLY ITS GPUS"], rows
        )
    )
    print()
    return ok


def real_node_main(state: Path, stay: bool) -> int:
    """``--real-node``: the control plane, the real node (its agent the kubelet's DRA plugin), the
    controller and the webhook with --dra; claims and pods whose containers really run."""
    from gpualloc.devcluster import binaries, node

    reason = node.unable_reason()
    if reason is not None:
        print(f"demo failed: --real-node: {reason}", file=sys.stderr)
        return 2
    say("building what is missing (cached in ~/.cache/gpualloc after the first run)")
    bins = binaries.ensure(progress=lambda line: say("  " + line))
    state.mkdir(parents=True, exist_ok=True)
    say(f"starting the local control plane and the real node {node.NODE_NAME} in {state}")
    cp = cluster.ControlPlane(state_dir=state, binaries=bins, real_node=True)
    real: node.RealNode | None = None
    try:
        cp.start()
        cp.apply_crds()
        cp.ensure_scheduler()
        cp.ensure_controller_manager()
        cp.ensure_service_account(DEMO_NAMESPACE)
        real = node.RealNode(
            cp,
            node.ensure_programs(say),
            progress=lambda line: say("  " + line),
            gpu_profile=REAL_NODE_PROFILE,
        )
        real.start()
        port = components.start(cp, dra=True)
        say(f"  controller and webhook (127.0.0.1:{port}) running with --dra")

        def alive() -> None:
            cp.check_alive()
            if real is not None:
                real.check_alive()

        if not drive_real_node(cp, alive):
            say("ERROR: a container did not see exactly its claim's GPUs")
            return 1
        if stay:
            say(
                f"running; try: kubectl --kubeconfig {cp.kubeconfig} get pods,gpuclaims; Ctrl-C tears it down"
            )
            while True:
                time.sleep(1)
                alive()
        return 0
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        say("tearing down")
        components.stop(cp)
        left = real.stop() if real is not None else []
        cp.stop()
        say(
            "stopped every process the demo started" + (f"; the node left: {'; '.join(left)}" if left else "")
        )


def main(argv: Sequence[str] | None = None) -> int:
    from gpualloc.devcluster import binaries

    parser = argparse.ArgumentParser(prog="gpualloc-demo", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--state-dir", help="where the control plane keeps its files (default: a temp dir)")
    parser.add_argument("--exit", action="store_true", help="tear down right after the summary")
    parser.add_argument(
        "--real-node",
        action="store_true",
        help="run the pods for real: a kubelet and containerd node whose containers get exactly their "
        "claim's GPUs (DRA and CDI; root)",
    )
    args = parser.parse_args(argv)
    docs = [d for path in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d]

    state = Path(args.state_dir or tempfile.mkdtemp(prefix="gpualloc-demo-"))
    if state.is_dir() and any(state.iterdir()):
        # A used one holds the last run's etcd data: the demo would meet its own objects again.
        print(
            f"demo failed: --state-dir {state} is not empty; give a new or empty directory", file=sys.stderr
        )
        return 2
    if args.real_node:
        return real_node_main(state, stay=not args.exit)
    say("building what is missing (cached in ~/.cache/gpualloc after the first run)")
    bins = binaries.ensure(progress=lambda line: say("  " + line))
    state.mkdir(parents=True, exist_ok=True)
    say(f"starting the local control plane in {state}")
    cp = cluster.ControlPlane(state_dir=state, binaries=bins)
    procs = Processes(state)
    try:
        cp.start()
        cp.apply_crds()
        say("  CRDs applied from helm/gpualloc/crds/")
        cp.ensure_scheduler()
        cp.ensure_controller_manager()
        cp.ensure_kwok()
        for name, profile, labels in NODES:
            cp.add_kwok_node(name, {**labels, "gpualloc.dev/profile": profile})
            say(f"  node {name}: a kwok node with a simulated {profile}")
        for namespace in (NAMESPACE, leases.heartbeat_namespace(NAMESPACE)):  # device Leases; heartbeats
            cp.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
        cp.ensure_service_account(DEMO_NAMESPACE)  # pods come before kube-controller-manager makes it
        say(f"starting 3 agents, the controller (device Leases in {NAMESPACE}) and the webhook")
        certs_dir = state / "webhook-certs"
        port = start_components(procs, str(cp.kubeconfig), certs_dir)
        ca_bundle = (certs_dir / "ca.crt").read_bytes()
        return asyncio.run(drive(cp, procs, port, ca_bundle, docs, stay=not args.exit))
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        say("tearing down")
        procs.stop()
        cp.stop()
        say("stopped every process the demo started")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
