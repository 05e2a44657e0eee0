"""The chart on the real node, as a user installs it (issue 42, part 3): the image from `make
image`, the agent a DaemonSet pod, the controller and the webhook Deployments, installed,
upgraded and uninstalled with helm.

`gpualloc dev up --real-node --no-gpualloc` runs as a process of its own: the control plane and
the node without gpualloc (no agent, controller or webhook of its own; the node labelled
``nvidia.com/gpu.present=true``, its ``nvidia<minor>`` files following the GPUs its GpuNodeStatus
lists). The archive `make image` wrote (``~/.cache/gpualloc/image/gpualloc-<appVersion>.oci.tar``;
built here by ``image/build.py`` when it is missing, or the module is skipped saying why it
cannot be) is imported with `gpualloc dev image import`. `helm install --wait` with the
certificates from the chart's `gpualloc certs` hook Job (``certManager.enabled=false``), DRA as
the API server decides (``dra.enabled: auto``; it serves ``resource.k8s.io/v1``), the simulated
source, ``agent.deviceDir`` and ``dra.kubeletRoot`` of the node, ``image.pullPolicy=Never``.
Then: a 1-GPU claim's busybox pod lists one ``/dev/nvidia<minor>``, its claim's, and a pod
without a claim none; `helm upgrade` (``logLevel=DEBUG``: every component rolls) leaves the
first pod running and a second claim's pod sees only its own GPU; `helm uninstall` removes the
release's pods and webhook configuration, the running claim pods keep running, and a pod naming
a claim afterwards gets no GPU (nothing mutates it). Then `dev up` is stopped with SIGINT and must
leave the machine as it was (it exits 1 otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpualloc import cdi
from gpualloc.api import constants
from gpualloc.devcluster import images, node
from tests.conftest import progress_printer, wait_until
from tests.e2e.test_helm_install import CHART, Helm
from tests.node import real_node_support

ROOT = Path(__file__).resolve().parents[2]
IMAGE_DIR = Path.home() / ".cache" / "gpualloc" / "image"
BUILD_TOOLS = ("mmdebstrap", "umoci", "skopeo", "chroot")
REVISION_LABEL = "org.opencontainers.image.revision"
# What the image holds of the repository (the wheel of HEAD) and how it is built; the components
# never run gpualloc.devcluster (this test's `dev up` runs from the checkout).
SHIPPED = (
    *("agent", "controller", "webhook", "certs", "gpualloc", ":(exclude)gpualloc/devcluster"),
    *("pyproject.toml", "setup.py", "Dockerfile", "image/build.py"),
)
RELEASE = "gpualloc"
RELEASE_NAMESPACE = "gpualloc-system"
NAMESPACE = "chart-e2e"
PROFILE = "h100-sxm-8"
GPUS = 8
LISTED = "end-of-listing"
LIST_DEVICES = f"ls /dev; echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; echo {LISTED}; sleep 3600"
RELEASE_PODS = (
    f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods?labelSelector=app.kubernetes.io/instance%3D{RELEASE}"
)
GPUALLOC = (sys.executable, "-m", "gpualloc.cli")
WEBHOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


@dataclasses.dataclass(kw_only=True)
class Seen:
    """What one pod's container listed, and the pod then."""

    nvidia: list[str]
    cuda_visible_devices: str
    pod: dict[str, Any]


@dataclasses.dataclass(kw_only=True)
class Run:
    image: str = ""
    image_commit: str = ""
    device_files: list[str] = dataclasses.field(default_factory=list)
    installed_pods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # name -> pod
    claims: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # Allocated
    seen: dict[str, Seen] = dataclasses.field(default_factory=dict)  # pod -> what it listed
    after_upgrade: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # pod -> pod
    upgraded_pods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    after_uninstall: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    release_pods_left: list[str] = dataclasses.field(default_factory=list)
    webhooks_left: list[str] = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    dev_up_exit: int | None = None
    dev_up_log: str = ""


# ----------------------------------------------------------------------------- the image


def _archive(say: Any) -> Path:
    """The archive `make image` writes for the chart's appVersion; built here when it is missing
    or was built from a commit whose shipped code differs from HEAD's."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    archive = IMAGE_DIR / f"gpualloc-{version}.oci.tar"
    why = "missing" if not archive.exists() else _stale(archive)
    if why is None:
        return archive
    missing = [tool for tool in BUILD_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(
            f"image archive {archive} {why}, and `make image` cannot run here: {', '.join(missing)} "
            "missing (Debian: apt-get install mmdebstrap umoci skopeo)"
        )
    say(f"{archive} {why}: building it (`make image`, minutes)")
    built = subprocess.run(
        [sys.executable, str(ROOT / "image" / "build.py"), "--python", sys.executable],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert built.returncode == 0, f"`make image` failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}"
    return archive


def _revision(archive: Path) -> str:
    """The commit the archive was built from (its OCI revision label, in make image's manifest)."""
    manifest = archive.with_name(archive.name.removesuffix(".oci.tar") + ".json")
    with contextlib.suppress(OSError, ValueError, KeyError):
        return str(json.loads(manifest.read_text())["labels"][REVISION_LABEL])
    return ""


def _stale(archive: Path) -> str | None:
    """Why the archive does not hold HEAD's code, or None when it does."""
    revision = _revision(archive)
    if not revision:
        return "has no recorded revision"
    changed = subprocess.run(
        ["git", "-C", str(ROOT), "diff", "--quiet", revision, "HEAD", "--", *SHIPPED],
        capture_output=True,
        check=False,
    )
    return None if changed.returncode == 0 else f"was built from {revision[:12]}, older than HEAD's code"


# ----------------------------------------------------------------------------- the cluster


class Cluster:
    """What the test does through the API server of a `dev up` in ``state_dir``."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def get(self, path: str) -> dict[str, Any]:
        found: dict[str, Any] = real_node_support.request(self.state_dir, "GET", path)
        return found

    def post(self, path: str, body: dict[str, Any]) -> None:
        real_node_support.request(self.state_dir, "POST", path, body)

    def pod(self, name: str) -> dict[str, Any]:
        return self.get(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")

    def create_claim(self, name: str) -> None:
        body = {
            "apiVersion": "gpu.scheduling/v1",
            "kind": "GpuClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"count": 1}},
        }
        self.post(f"/apis/gpu.scheduling/v1/namespaces/{NAMESPACE}/gpuclaims", body)

    def wait_allocated(self, name: str) -> dict[str, Any]:
        path = f"/apis/gpu.scheduling/v1/namespaces/{NAMESPACE}/gpuclaims/{name}"

        def allocated() -> dict[str, Any] | None:
            claim = self.get(path)
            return claim if (claim.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED else None

        found: dict[str, Any] = wait_until(f"GpuClaim {name} Allocated", allocated, within=90)
        resource_claim = (
            f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/"
            f"{constants.resource_claim_name(name, 0)}"
        )

        def mirrored() -> bool:
            try:
                return bool((self.get(resource_claim).get("status") or {}).get("allocation"))
            except AssertionError:  # 404 until the controller writes it
                return False

        wait_until(
            f"the ResourceClaim of {name} allocated", mirrored, within=60, logs=lambda: self.log("controller")
        )
        return found

    def log(self, component: str) -> str:
        """The last lines of a release pod's log (the Ready one), for a failure's message."""
        pod = _by_component(self.release_pods()).get(component)
        if pod is None:
            return f"no {component} pod"
        path = f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods/{pod['metadata']['name']}/log?tailLines=30"
        text = real_node_support.request(self.state_dir, "GET", path, accept="*/*")
        return f"{component} log: {text}"

    def create_pod(self, name: str, *, claim: str | None) -> None:
        container = {
            "name": "main",
            "image": images.TOOLBOX_IMAGE,
            "imagePullPolicy": "Never",
            "command": ["sh", "-c", LIST_DEVICES],
        }
        metadata: dict[str, Any] = {"name": name}
        if claim is not None:
            metadata["annotations"] = {constants.ANNOTATION_CLAIM: claim}
        spec = {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        }
        self.post(
            f"/api/v1/namespaces/{NAMESPACE}/pods",
            {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec},
        )

    def wait_running(self, name: str) -> dict[str, Any]:
        def running() -> dict[str, Any] | None:
            pod = self.pod(name)
            phase = (pod.get("status") or {}).get("phase")
            assert phase not in ("Failed", "Succeeded"), f"pod {name} ended: {pod.get('status')}"
            return pod if phase == "Running" else None

        found: dict[str, Any] = wait_until(
            f"pod {name} Running", running, within=120, every=0.05, logs=lambda: self.why(name)
        )
        return found

    def why(self, name: str) -> str:
        """The pod's status and the namespace's events, for a failure's message."""
        events = self.get(f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
        lines = [f"{e['involvedObject']['name']}: {e.get('reason')}: {e.get('message')}" for e in events]
        return f"status {json.dumps(self.pod(name).get('status'))}; events: " + "; ".join(lines[-15:])

    def seen(self, name: str) -> Seen:
        def listed() -> str | None:
            text = str(
                real_node_support.request(
                    self.state_dir, "GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/log", accept="*/*"
                )
            )
            return text if LISTED in text else None

        words = str(wait_until(f"pod {name} to list /dev", listed, within=60)).split()
        cuda = next((w.split("=", 1)[1] for w in words if w.startswith("CUDA_VISIBLE_DEVICES=")), "")
        return Seen(
            nvidia=sorted(w for w in words if w.startswith("nvidia")),
            cuda_visible_devices=cuda,
            pod=self.pod(name),
        )

    def release_pods(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.get(RELEASE_PODS)["items"]
        return found


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _component(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["labels"].get("app.kubernetes.io/component", ""))


def _by_component(pods: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One running pod per component (agent, controller, webhook): the Ready one, else any."""
    found: dict[str, dict[str, Any]] = {}
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp"):
            continue
        name = _component(pod)
        if name not in found or _ready(pod):
            found[name] = pod
    return found


def _device(claim: dict[str, Any]) -> dict[str, Any]:
    ((device,),) = [allocation["devices"] for allocation in claim["status"]["allocations"]]
    found: dict[str, Any] = device
    return found


@contextlib.contextmanager
def _dev_up(state_dir: Path, log: Path, say: Any) -> Iterator[subprocess.Popen[bytes]]:
    argv = [*GPUALLOC, "dev", "up", "--state-dir", str(state_dir)]
    argv += ["--real-node", "--no-gpualloc"]
    started = time.monotonic()
    with log.open("w") as out:
        up = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        while "ready: kubeconfig" not in log.read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() - started < 300, log.read_text()
            time.sleep(0.2)
        say(f"`gpualloc dev up --real-node --no-gpualloc` ready in {time.monotonic() - started:.1f} s")
        yield up
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
                subprocess.run(
                    [*GPUALLOC, "dev", "down", "--state-dir", str(state_dir)],
                    capture_output=True,
                    timeout=120,
                    check=False,
                )


def _install_values(state_dir: Path) -> list[str]:
    node_dir = state_dir / "node"
    values = {
        "certManager.enabled": "false",
        "image.pullPolicy": "Never",
        "agent.source": "simulated",
        "agent.profile": PROFILE,
        "agent.deviceDir": str(node_dir / "dev"),
        "dra.kubeletRoot": str(node_dir / "kubelet"),
    }
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def _scenario(run: Run, cluster: Cluster, helm: Helm, state_dir: Path, say: Any) -> None:
    chart = str(CHART)
    # 1. helm install, waiting for every Deployment and the DaemonSet to be ready.
    started = time.monotonic()
    helm.ok(
        "install", RELEASE, chart, "--namespace", RELEASE_NAMESPACE, "--create-namespace", "--wait",
        "--timeout", "300s", *_install_values(state_dir), timeout=360,
    )  # fmt: skip
    run.seconds["helm install --wait"] = time.monotonic() - started
    run.installed_pods = _by_component(cluster.release_pods())

    def files_made() -> list[str]:
        found = sorted(p.name for p in (state_dir / "node" / "dev").glob("nvidia*"))
        return found if len(found) == GPUS + 1 else []

    run.device_files = wait_until("the node's device files of the published GPUs", files_made, within=60)
    cluster.post("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
    wait_until(
        "the default ServiceAccount",
        lambda: any(
            sa["metadata"]["name"] == "default"
            for sa in cluster.get(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts")["items"]
        ),
        within=60,
    )

    # 2. A 1-GPU claim's pod, and a pod without a claim.
    started = time.monotonic()
    cluster.create_claim("one")
    run.claims["one"] = cluster.wait_allocated("one")
    cluster.create_pod("one", claim="one")
    cluster.wait_running("one")
    run.seconds["claim created to its pod Running (installed)"] = time.monotonic() - started
    started = time.monotonic()
    cluster.create_pod("plain", claim=None)
    cluster.wait_running("plain")
    run.seconds["pod without a claim created to Running"] = time.monotonic() - started
    for name in ("one", "plain"):
        run.seen[name] = cluster.seen(name)

    # 3. helm upgrade with a changed value: every component's pod template changes.
    before = {pod["metadata"]["uid"] for pod in cluster.release_pods()}
    started = time.monotonic()
    helm.ok(
        "upgrade", RELEASE, chart, "--namespace", RELEASE_NAMESPACE, "--reuse-values", "--set",
        "logLevel=DEBUG", "--wait", "--timeout", "300s", timeout=360,
    )  # fmt: skip

    def rolled() -> dict[str, dict[str, Any]] | None:
        pods = _by_component(cluster.release_pods())
        fresh = {
            name: pod for name, pod in pods.items() if pod["metadata"]["uid"] not in before and _ready(pod)
        }
        return fresh if len(fresh) == 3 else None

    run.upgraded_pods = wait_until("a new ready pod of each component", rolled, within=180)
    run.seconds["helm upgrade --wait, to a new ready pod of each"] = time.monotonic() - started
    run.after_upgrade["one"] = cluster.pod("one")
    started = time.monotonic()
    cluster.create_claim("two")
    run.claims["two"] = cluster.wait_allocated("two")
    cluster.create_pod("two", claim="two")
    cluster.wait_running("two")
    run.seconds["claim created to its pod Running (upgraded)"] = time.monotonic() - started
    run.seen["two"] = cluster.seen("two")

    # 4. helm uninstall.
    started = time.monotonic()
    helm.ok(
        "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", "--timeout", "300s", timeout=360
    )
    run.seconds["helm uninstall --wait"] = time.monotonic() - started
    wait_until("the release's pods gone", lambda: not cluster.release_pods(), within=120)
    run.release_pods_left = [pod["metadata"]["name"] for pod in cluster.release_pods()]
    run.webhooks_left = [
        w["metadata"]["name"]
        for w in cluster.get(WEBHOOKS)["items"]
        if w["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == RELEASE
    ]
    for name in ("one", "two"):
        run.after_uninstall[name] = cluster.pod(name)
    cluster.create_pod("after", claim="one")
    cluster.wait_running("after")
    run.seen["after"] = cluster.seen("after")


@pytest.fixture(scope="module")
def chart_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    say = progress_printer(request.config)
    archive = _archive(say)
    run = Run(image_commit=_revision(archive))
    # Short: the DRA plugin's socket under <state>/node/kubelet must fit a unix socket's 107 bytes.
    state_dir = Path(tempfile.mkdtemp(prefix="gpualloc-chart-", dir="/tmp"))
    log = tmp_path_factory.mktemp("chart") / "dev-up.log"
    helm = Helm(state_dir / "kubeconfig", tmp_path_factory.mktemp("helm"))
    cluster = Cluster(state_dir)
    try:
        with _dev_up(state_dir, log, say) as up:
            started = time.monotonic()
            imported = subprocess.run(
                [*GPUALLOC, "dev", "image", "import", str(archive), "--state-dir", str(state_dir)],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert imported.returncode == 0, imported.stderr
            run.image = imported.stdout.strip()
            run.seconds["dev image import"] = time.monotonic() - started
            _scenario(run, cluster, helm, state_dir, say)
        run.dev_up_exit = up.returncode
    finally:
        run.dev_up_log = log.read_text()
        kept = log.parent / "logs"
        shutil.copytree(state_dir / "logs", kept, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        say(f"the run's logs: {kept}")
        shutil.rmtree(state_dir, ignore_errors=True)
    say(
        f"the chart on the real node (image {run.image}, built from {run.image_commit[:12] or '?'}): "
        + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in run.seconds.items())
    )
    yield run


# ----------------------------------------------------------------------------- install


def test_helm_install_runs_the_agent_controller_and_webhook_from_the_imported_image_on_the_node(
    chart_run: Run,
) -> None:
    pods = chart_run.installed_pods
    assert sorted(pods) == ["agent", "controller", "webhook"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    for pod in pods.values():
        assert pod["spec"]["nodeName"] == node.NODE_NAME
        assert _ready(pod), pod["status"]
        (container,) = pod["spec"]["containers"]
        assert container["image"] == f"ghcr.io/gpualloc/gpualloc:{version}"
    assert f"ghcr.io/gpualloc/gpualloc:{version}" in chart_run.image


def test_the_agent_pod_is_the_kubelets_dra_plugin_with_the_nodes_device_directory(chart_run: Run) -> None:
    (container,) = chart_run.installed_pods["agent"]["spec"]["containers"]
    args = container["args"]
    assert "--kubelet-plugin" in args  # dra.enabled: auto, and the API server serves resource.k8s.io/v1
    assert "--source=simulated" in args
    assert any(arg.startswith("--device-dir=") and arg.endswith("/node/dev") for arg in args)


def test_the_node_made_a_device_file_for_each_gpu_the_charts_agent_published(chart_run: Run) -> None:
    assert chart_run.device_files == sorted(
        [cdi.CONTROL_DEVICE, *(cdi.device_file(minor) for minor in range(GPUS))]
    )


def test_a_one_gpu_claims_pod_sees_exactly_its_claims_device_file(chart_run: Run) -> None:
    seen = chart_run.seen["one"]
    device = _device(chart_run.claims["one"])
    assert seen.pod["spec"]["nodeName"] == node.NODE_NAME
    assert seen.nvidia == sorted([cdi.device_file(int(device["minor"])), cdi.CONTROL_DEVICE])
    assert seen.cuda_visible_devices == device["uuid"]
    (resource_claim,) = seen.pod["spec"]["resourceClaims"]
    assert resource_claim["resourceClaimName"] == constants.resource_claim_name("one", 0)


def test_a_pod_without_a_claim_sees_no_gpu(chart_run: Run) -> None:
    seen = chart_run.seen["plain"]
    assert seen.pod["spec"]["nodeName"] == node.NODE_NAME
    assert seen.nvidia == []
    assert "resourceClaims" not in seen.pod["spec"]


# ----------------------------------------------------------------------------- upgrade


def test_helm_upgrade_rolls_every_component_to_the_changed_value(chart_run: Run) -> None:
    assert sorted(chart_run.upgraded_pods) == ["agent", "controller", "webhook"]
    for pod in chart_run.upgraded_pods.values():
        (container,) = pod["spec"]["containers"]
        assert "--log-level=DEBUG" in container["args"]


def test_the_claim_pod_keeps_running_through_the_upgrade(chart_run: Run) -> None:
    before, after = chart_run.seen["one"].pod, chart_run.after_upgrade["one"]
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["status"]["phase"] == "Running"
    (status,) = after["status"]["containerStatuses"]
    assert status["restartCount"] == 0 and "running" in status["state"]


def test_after_the_upgrade_a_second_claims_pod_sees_only_its_own_gpu(chart_run: Run) -> None:
    first, second = _device(chart_run.claims["one"]), _device(chart_run.claims["two"])
    assert first["uuid"] != second["uuid"]
    seen = chart_run.seen["two"]
    assert seen.nvidia == sorted([cdi.device_file(int(second["minor"])), cdi.CONTROL_DEVICE])
    assert seen.cuda_visible_devices == second["uuid"]


# ----------------------------------------------------------------------------- uninstall


def test_helm_uninstall_removes_the_releases_pods_and_webhook_configuration(chart_run: Run) -> None:
    assert chart_run.release_pods_left == []
    assert chart_run.webhooks_left == []


def test_running_claim_pods_keep_running_after_the_uninstall(chart_run: Run) -> None:
    for name in ("one", "two"):
        pod = chart_run.after_uninstall[name]
        assert pod["metadata"]["uid"] == chart_run.seen[name].pod["metadata"]["uid"]
        assert pod["status"]["phase"] == "Running", pod["status"]


def test_after_the_uninstall_a_pod_naming_a_claim_is_not_mutated_and_sees_no_gpu(chart_run: Run) -> None:
    seen = chart_run.seen["after"]
    assert "resourceClaims" not in seen.pod["spec"]
    assert seen.nvidia == []
    assert seen.cuda_visible_devices == ""


def test_dev_up_stops_and_leaves_the_machine_as_it_was(chart_run: Run) -> None:
    assert chart_run.dev_up_exit == 0, chart_run.dev_up_log[-3000:]
    assert "the real node left" not in chart_run.dev_up_log
