"""Run the image under podman as the chart runs it, against the local control plane.

    .venv/bin/python image/check.py [--archive ~/.cache/gpualloc/image/gpualloc-0.1.0.oci.tar]

(``make image-check``; needs root, podman, and the image from ``make image``.) Every
container gets the chart's security context: user 65532:65532, a read-only root file system
with an emptyDir-like tmpfs on /tmp, all capabilities dropped, no-new-privileges, podman's
default seccomp profile (the chart's RuntimeDefault); host network, the kubeconfig mounted
read-only. Checks, each printed PASS or FAIL:

- the image: user, entrypoint, labels, layers, size, Python version; no /bin/sh;
- ``gpualloc certs`` writes a CA and a serving pair into a mounted directory;
- ``gpualloc agent --source simulated`` publishes a GpuNodeStatus for a kwok node;
- ``gpualloc controller`` allocates a GpuClaim on it (device Leases in gpualloc-system);
- ``gpualloc webhook`` answers a real AdmissionReview over TLS, with the certificate from
  ``gpualloc certs``, with the claim's node selector and CUDA_VISIBLE_DEVICES;
- ``gpualloc agent --source nvml --fail-on-init-error`` without a GPU exits 1 (agent/main.py
  EXIT_INIT_FAILED) with NVML's error and no traceback; and with a file at the path where the
  NVIDIA container toolkit mounts ``libnvidia-ml.so.1``, the agent loads it from there.

Where a plain ``podman run`` cannot start a container on this machine, the check says why and
retries with the workarounds in SANDBOX_WORKAROUNDS (they change how the container is started,
not the security context above).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gpualloc.devcluster import binaries, cluster  # noqa: E402

NAMESPACE = "gpualloc-system"
NODE = "gpu-node-image"
USER = "65532:65532"
# The chart's securityContext (helm/gpualloc/values.yaml) in podman's words, and its emptyDir /tmp.
CHART_SECURITY = [
    f"--user={USER}",
    "--read-only",
    "--read-only-tmpfs=false",
    "--tmpfs=/tmp:rw,size=64m,mode=1777",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
    "--network=host",
]
# Why each is needed in the sandbox these checks were first run in (podman 4.3, cgroups v1
# hybrid, no CAP_SYS_RESOURCE): crun refuses hybrid cgroups; runc cannot raise RLIMIT_NOFILE
# and RLIMIT_NPROC to podman's defaults.
SANDBOX_WORKAROUNDS = ["--runtime=runc", "--ulimit=nofile=4096:4096", "--ulimit=nproc=4096:4096"]

results: list[tuple[bool, str]] = []


def say(message: str) -> None:
    print(f"[image-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def check(ok: bool, what: str, detail: str = "") -> bool:
    results.append((ok, what))
    say(f"{'PASS' if ok else 'FAIL'} {what}{': ' + detail if detail else ''}")
    return ok


def wait(what: str, probe: Callable[[], Any], limit_s: float, alive: Callable[[], None]) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        alive()
        try:
            value = probe()
        except Exception:  # the object is not there yet, the server not up yet
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError(f"{what}: not after {limit_s:.0f} s")


class Podman:
    def __init__(self, image: str, run_args: list[str]) -> None:
        self.image = image
        self.run_args = run_args
        self.started: list[str] = []

    def run(self, *args: str, extra: list[str] = (), timeout: float = 60) -> subprocess.CompletedProcess[str]:  # type: ignore[assignment]
        argv = ["podman", "run", "--rm", *self.run_args, *CHART_SECURITY, *extra, self.image, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)

    def start(self, name: str, *args: str, extra: list[str] = ()) -> None:  # type: ignore[assignment]
        subprocess.run(["podman", "rm", "-f", "--ignore", name], capture_output=True, check=False)
        argv = [
            "podman",
            "run",
            "-d",
            f"--name={name}",
            *self.run_args,
            *CHART_SECURITY,
            *extra,
            self.image,
            *args,
        ]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(argv)}\n{done.stderr}")
        self.started.append(name)

    def alive(self) -> None:
        for name in self.started:
            state = subprocess.run(
                ["podman", "inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", name],
                capture_output=True,
                text=True,
            ).stdout.split()
            if state and state[0] != "true":
                raise RuntimeError(f"container {name} exited ({state[1]}):\n{self.logs(name)}")

    def logs(self, name: str) -> str:
        done = subprocess.run(["podman", "logs", name], capture_output=True, text=True)
        return (done.stdout + done.stderr)[-3000:]

    def stop_all(self) -> None:
        for name in reversed(self.started):
            subprocess.run(["podman", "stop", "-t", "10", name], capture_output=True, check=False)
            subprocess.run(["podman", "rm", "-f", "--ignore", name], capture_output=True, check=False)


def load(archive: Path) -> str:
    done = subprocess.run(
        ["podman", "load", "-q", "-i", str(archive)], capture_output=True, text=True, check=True
    )
    image = done.stdout.strip().rsplit(" ", 1)[-1]  # "Loaded image: ghcr.io/gpualloc/gpualloc:0.1.0"
    say(f"loaded {image} from {archive}")
    return image


def choose_run_args(image: str) -> list[str]:
    plain = subprocess.run(
        ["podman", "run", "--rm", *CHART_SECURITY, image, "--help"], capture_output=True, text=True
    )
    if plain.returncode == 0:
        return []
    workarounds = " ".join(SANDBOX_WORKAROUNDS)
    say(f"plain `podman run` failed here ({plain.stderr.strip()}); retrying with {workarounds}")
    return SANDBOX_WORKAROUNDS


def check_image(pod: Podman) -> None:
    info = json.loads(
        subprocess.run(
            ["podman", "image", "inspect", pod.image], capture_output=True, text=True, check=True
        ).stdout
    )[0]
    config = info["Config"]
    layers = len(info["RootFS"]["Layers"])
    check(config.get("User") == USER, f"image user is {USER}", str(config.get("User")))
    check(
        config.get("Entrypoint") == ["gpualloc"],
        "image entrypoint is gpualloc",
        str(config.get("Entrypoint")),
    )
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    labels = config.get("Labels") or {}
    check(labels.get("org.opencontainers.image.version") == version, f"label version {version}")
    python = pod.run("-V", extra=["--entrypoint=python3"])
    shell = pod.run("-c", "true", extra=["--entrypoint=/bin/sh"])
    check(shell.returncode != 0, "no /bin/sh in the image", shell.stderr.strip().splitlines()[-1][:160])
    whoami = pod.run("-c", "import os; print(os.getuid(), os.getgid())", extra=["--entrypoint=python3"])
    check(whoami.stdout.split() == ["65532", "65532"], "runs as uid/gid 65532", whoami.stdout.strip())
    write = pod.run("-c", "open('/opt/gpualloc/x', 'w')", extra=["--entrypoint=python3"])
    check(
        "Read-only file system" in write.stderr or "Permission denied" in write.stderr,
        "the root file system cannot be written",
        write.stderr.strip().splitlines()[-1][:120],
    )
    say(f"image: {info['Size'] / 1e6:.1f} MB unpacked, {layers} layers, {python.stdout.strip()}")


def kubeconfig_for_containers(cp: cluster.ControlPlane, work: Path) -> Path:
    """The admin kubeconfig, readable by 65532 only, as a Secret volume would be."""
    kube = work / "kube"
    kube.mkdir()
    shutil.copy(cp.kubeconfig, kube / "kubeconfig")
    os.chown(kube / "kubeconfig", 65532, 65532)
    os.chmod(kube / "kubeconfig", 0o400)
    return kube


def check_components(pod: Podman, cp: cluster.ControlPlane, work: Path) -> None:
    kube = kubeconfig_for_containers(cp, work)
    mount = [f"--volume={kube}:/kube:ro"]
    kubeconfig = "--kubeconfig=/kube/kubeconfig"
    certs = work / "certs"
    certs.mkdir()
    os.chown(certs, 65532, 65532)

    done = pod.run(
        "certs",
        "--out-dir=/certs",
        "--ip-address=127.0.0.1",
        "--dns-name=localhost",
        extra=[f"--volume={certs}:/certs"],
    )
    made = sorted(p.name for p in certs.iterdir())
    check(
        done.returncode == 0 and made == ["ca.crt", "ca.key", "tls.crt", "tls.key"],
        "`gpualloc certs` wrote the CA and the serving pair",
        f"{made} {done.stderr[-300:]}",
    )

    metrics = cluster.free_ports(6)
    env = [f"--env=NODE_NAME={NODE}", f"--env=POD_NAMESPACE={NAMESPACE}"]
    # The chart's arguments (templates/*-deployment.yaml, agent-daemonset.yaml), $(VAR) expanded.
    pod.start(
        "gpualloc-check-agent",
        "agent",
        f"--node-name={NODE}",
        f"--lease-namespace={NAMESPACE}",
        "--source=simulated",
        "--profile=h100-sxm-8",
        "--heartbeat-interval=10",
        f"--metrics-port={metrics[0]}",
        f"--health-port={metrics[1]}",
        kubeconfig,
        extra=mount + env,
    )
    pod.start(
        "gpualloc-check-controller",
        "controller",
        f"--namespace={NAMESPACE}",
        "--leader-elect=true",
        f"--metrics-port={metrics[2]}",
        f"--health-port={metrics[3]}",
        kubeconfig,
        extra=mount + env,
    )
    webhook_port = cluster.free_port()
    pod.start(
        "gpualloc-check-webhook",
        "webhook",
        "--tls-cert-file=/tls/tls.crt",
        "--tls-key-file=/tls/tls.key",
        f"--port={webhook_port}",
        "--host=127.0.0.1",
        f"--metrics-port={metrics[4]}",
        f"--health-port={metrics[5]}",
        kubeconfig,
        extra=[*mount, *env, f"--volume={certs}:/tls:ro"],
    )

    group = "/apis/gpu.scheduling/v1"
    status = wait(
        "GpuNodeStatus", lambda: cp.request("GET", f"{group}/gpunodestatuses/{NODE}"), 60, pod.alive
    )
    devices = status.get("status", {}).get("devices") or []
    check(len(devices) == 8, f"agent (simulated) published GpuNodeStatus {NODE}", f"{len(devices)} devices")

    claim = {
        "apiVersion": "gpu.scheduling/v1",
        "kind": "GpuClaim",
        "metadata": {"name": "image-check", "namespace": "default"},
        "spec": {"devices": {"count": 2}},
    }
    cp.request("POST", f"{group}/namespaces/default/gpuclaims", claim)

    def allocated() -> dict[str, Any] | None:
        got: dict[str, Any] = cp.request("GET", f"{group}/namespaces/default/gpuclaims/image-check")
        return got if (got.get("status") or {}).get("phase") == "Allocated" else None

    got = wait("claim Allocated", allocated, 60, pod.alive)
    leases = cp.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases")["items"]
    device_leases = [
        lease["metadata"]["name"] for lease in leases if lease["metadata"]["name"].startswith("gpu-")
    ]
    allocation = json.dumps(got["status"].get("allocations"))[:160]
    check(
        len(device_leases) == 2,
        "controller allocated the GpuClaim and locked its devices",
        f"{allocation}; device Leases {device_leases}",
    )

    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    base = f"https://127.0.0.1:{webhook_port}"

    def ready() -> bool:
        with urllib.request.urlopen(f"{base}/readyz", context=context, timeout=5) as resp:
            return bool(resp.status == 200)

    wait("webhook /readyz over TLS", ready, 60, pod.alive)
    uid = str(uuid.uuid4())
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "default",
            "operation": "CREATE",
            "userInfo": {"username": "image-check"},
            "object": {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "trainer",
                    "namespace": "default",
                    "annotations": {"gpu.scheduling/claim": "image-check"},
                },
                "spec": {"containers": [{"name": "main", "image": "busybox"}]},
            },
            "dryRun": False,
        },
    }

    def answer() -> dict[str, Any] | None:
        request = urllib.request.Request(
            f"{base}/mutate", data=json.dumps(review).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, context=context, timeout=10) as resp:
            response: dict[str, Any] = json.load(resp)["response"]
        # The webhook's claim cache may not have the Allocated status yet: ask again.
        return response if response.get("patch") else None

    response = wait("a mutating answer", answer, 30, pod.alive)
    patch = base64.b64decode(response["patch"]).decode()
    check(
        response["uid"] == uid and response["allowed"] and "CUDA_VISIBLE_DEVICES" in patch and NODE in patch,
        "webhook answered the AdmissionReview over TLS (cert from `gpualloc certs`)",
        f"allowed={response['allowed']}, patch {patch[:240]}",
    )


def check_nvml(pod: Podman, work: Path) -> None:
    args = (
        "agent",
        "--source=nvml",
        "--fail-on-init-error",
        f"--node-name={NODE}",
        "--kubeconfig=/nonexistent",
    )
    done = pod.run(*args, timeout=60)
    output = done.stdout + done.stderr
    check(
        done.returncode == 1 and "NVML" in output and "Traceback" not in output,
        "agent --source nvml without a GPU: exit 1 (EXIT_INIT_FAILED), NVML's error, no traceback",
        f"exit {done.returncode}: {output.strip().splitlines()[-1][:300] if output.strip() else ''}",
    )
    # Where the NVIDIA container toolkit mounts it: the dynamic loader must find it there. A library
    # that is not NVML (libz) turns "library not found" into a missing-function error.
    stub = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    libz = Path("/usr/lib/x86_64-linux-gnu/libz.so.1").resolve()
    done = pod.run(*args, extra=[f"--volume={libz}:{stub}:ro"], timeout=60)
    output = done.stdout + done.stderr
    check(
        done.returncode == 1 and "Function Not Found" in output and "Traceback" not in output,
        f"agent loads libnvidia-ml.so.1 from {stub} (a stub: NVML's function-not-found error)",
        output.strip().splitlines()[-1][:300] if output.strip() else "",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    parser.add_argument(
        "--archive", type=Path, default=Path.home() / f".cache/gpualloc/image/gpualloc-{version}.oci.tar"
    )
    args = parser.parse_args(argv)
    if not shutil.which("podman"):
        sys.exit("podman is missing (Debian: apt-get install podman runc)")
    if not args.archive.exists():
        sys.exit(f"{args.archive} is missing: make image")
    started = time.monotonic()
    image = load(args.archive)
    pod = Podman(image, [])
    pod.run_args = choose_run_args(image)
    check_image(pod)
    check_nvml(pod, Path())
    work = Path(tempfile.mkdtemp(prefix="gpualloc-image-check-"))
    os.chmod(work, 0o755)
    bins = binaries.ensure(["etcd", "kube-apiserver", "kwok"], progress=say)
    cp = cluster.ControlPlane(state_dir=work / "cluster", binaries=bins, progress=say)
    try:
        cp.start()
        cp.apply_crds()
        cp.add_kwok_node(NODE)
        cp.request("POST", "/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        check_components(pod, cp, work)
    except (RuntimeError, TimeoutError, cluster.ControlPlaneError) as exc:
        check(False, "components", str(exc)[-2000:])
        for name in pod.started:
            say(f"--- {name} logs\n{pod.logs(name)}")
    finally:
        pod.stop_all()
        cp.stop()
        shutil.rmtree(work, ignore_errors=True)
    failed = [what for ok, what in results if not ok]
    say(
        f"{len(results) - len(failed)}/{len(results)} checks passed in {time.monotonic() - started:.0f} s"
        + (f" with {' '.join(pod.run_args)}" if pod.run_args else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
