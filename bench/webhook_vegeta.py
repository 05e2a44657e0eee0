"""The admission webhook under vegeta, against a plain Go ``net/http`` webhook doing the same work.

    .venv/bin/python bench/webhook_vegeta.py [--rate 500] [--duration 10] [--rounds 3]
        [--go-prebuilt DIR]   # DIR: gowebhook and gowebhook-jsonv2 built elsewhere (no Go here)

What runs, all on 127.0.0.1:

* ``gpualloc``: ``gpualloc webhook`` from the source checkout, against a real
  local kube-apiserver + etcd that holds the claim: the webhook's watch cache
  has it, as in the steady state of a cluster;
* ``go``: ``bench/gowebhook``, a plain Go ``net/http`` TLS webhook built with
  the Go on PATH, the claim in memory, answering the benchmark's review with the
  same JSON Patch and warning (checked before measuring: every answer's patch
  must be equal as JSON). It decodes as Go webhooks usually do: the review into
  ``k8s.io/api``'s typed ``AdmissionReview`` and its object into a typed
  ``Pod``. The goal is judged against this one;
* ``go-fields``: the same program with ``-decode=fields``: ``encoding/json``
  into small structs of only the fields the decision reads (a trimmed decode,
  for reference);
* ``go-fields-jsonv2``: that, built with ``GOEXPERIMENT=jsonv2`` (Go's newer
  JSON implementation behind the same API, not Go 1.26's default), for reference;
* the load generator: vegeta v12 (``gpualloc dev build --only vegeta`` caches it
  in ``~/.cache/gpualloc/bin``), HTTP/1.1 with keep-alive over TLS 1.3, the same
  certificate for every server (``gpualloc certs``).

Every server is pinned to the same single CPU (``taskset -c 0``; the Go
runtime then runs with GOMAXPROCS=1), vegeta to another (``taskset -c 1``) and
the API server and etcd, idle while measuring, to that other one too.

The request is ``bench/webhook_request.py``'s: an 11.8 KB AdmissionReview
for a Job's pod with 3 containers and 1 init container, shaped as the API server
sends it (``tests/integration/test_bench_review.py``), whose claim is Allocated
with 4 GPUs; the answer is a 12-operation JSON Patch (the last two hold the pod at the scheduling gate)
and a warning.

Per round and server (the order alternates between rounds):

* open loop: ``vegeta attack -rate=<rate>/s -duration=<duration>s``: p50, p99 and
  max latency (vegeta counts from each request's scheduled send time);
* saturation: ``vegeta attack -rate=0 -max-workers=N -workers=N`` for N in
  ``--workers`` (a closed loop of N connections sending back to back), each for
  ``--sweep-duration`` seconds; the saturation figure is the largest
  throughput of a step with no errors. Each step records the server's and
  vegeta's CPU (``/proc/<pid>/stat`` of the server, ``getrusage`` of the
  vegeta child), so one can see which side was the limit.

CPU per request is the server's user + system CPU time during a step divided
by the requests it answered. With the server pinned to one CPU, 1 s / (CPU per
request) is the most that CPU can answer, whatever the client does: it is
printed beside the measured saturation as a cross-check.

Writes bench/results/webhook_vegeta.json and prints a summary.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import procfs  # noqa: E402
import webhook_request as request_shape  # noqa: E402

from gpualloc.api import constants  # noqa: E402
from gpualloc.devcluster import binaries, cluster  # noqa: E402

RESULT = ROOT / "bench" / "results" / "webhook_vegeta.json"
GO_SOURCE = ROOT / "bench" / "gowebhook"
# Go servers: name -> (-decode, GOEXPERIMENT of the build).
GO_SERVERS = {"go": ("k8s", ""), "go-fields": ("fields", ""), "go-fields-jsonv2": ("fields", "jsonv2")}
SERVERS = ("gpualloc", *GO_SERVERS)
SERVER_CPU = 0
LOAD_CPU = 1
TARGET_P99_MS = 2.0
TARGET_RATIO = 2.0


# ------------------------------------------------------------------ processes


def pin_all_threads(pid: int, cpu: int) -> None:
    """Pin every thread of ``pid`` (a Go program has several) to ``cpu``."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, stdout=subprocess.DEVNULL)


def build_go_webhook(out: Path, experiment: str = "", prebuilt: Path | None = None) -> Path:
    """Build bench/gowebhook into ``out``, or take the binary of that name from ``prebuilt``
    (for a machine without Go: build them elsewhere with the same command)."""
    binary = out / f"gowebhook{'-' + experiment if experiment else ''}"
    if prebuilt is not None:
        binary = prebuilt / binary.name
        if not binary.is_file():
            raise SystemExit(f"--go-prebuilt: {binary} is missing")
        return binary
    subprocess.run(
        ["go", "build", "-trimpath", "-o", str(binary), "."],
        cwd=GO_SOURCE,
        check=True,
        env={**os.environ, "CGO_ENABLED": "0", "GOEXPERIMENT": experiment},
    )
    return binary


def webhook_args(cert: str, key: str, port: int, kubeconfig: Path) -> list[str]:
    """``gpualloc webhook`` and the flags every benchmark starts it with: TLS on 127.0.0.1:``port``
    against the API server of ``kubeconfig``, warnings only."""
    return [
        "webhook",
        f"--tls-cert-file={cert}",
        f"--tls-key-file={key}",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--kubeconfig={kubeconfig}",
        "--log-level=WARNING",
    ]


def wait_ready(port: int, ca: str, path: str, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    context = ssl.create_default_context(cafile=ca)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {process.returncode}")
        url = f"https://127.0.0.1:{port}{path}"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, context=context, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the server on port {port} was not ready in {timeout:g} s")


def post_review(port: int, ca: str, body: bytes) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=ca)
    request = urllib.request.Request(
        f"https://127.0.0.1:{port}/mutate?timeout=5s",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, context=context, timeout=10) as r:
        answer: dict[str, Any] = json.loads(r.read())["response"]
    return answer


def answer_shape(answer: dict[str, Any]) -> dict[str, Any]:
    """What must be equal between the two servers: allowed, the patch as JSON, the warnings."""
    patch = json.loads(base64.b64decode(answer["patch"])) if "patch" in answer else None
    return {"allowed": answer.get("allowed"), "patch": patch, "warnings": answer.get("warnings")}


def start_cluster(state: Path, bins: dict[str, Path]) -> cluster.ControlPlane:
    """etcd + kube-apiserver with the CRDs, and the benchmark's claim, Allocated."""
    plane = cluster.ControlPlane(state, binaries=bins, progress=lambda m: print(f"  {m}", file=sys.stderr))
    plane.start()
    plane.apply_crds()
    claim = request_shape.raw_claim()
    namespace = claim["metadata"]["namespace"]
    plane.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace}})
    created = plane.request(
        "POST",
        f"/apis/gpu.scheduling/v1/namespaces/{namespace}/gpuclaims",
        {k: v for k, v in claim.items() if k != "status"}
        | {"metadata": {"name": claim["metadata"]["name"], "namespace": namespace}},
    )
    created["status"] = claim["status"]
    plane.request(
        "PUT",
        f"/apis/gpu.scheduling/v1/namespaces/{namespace}/gpuclaims/{claim['metadata']['name']}/status",
        created,
    )
    for process in plane.running().values():
        pin_all_threads(process, LOAD_CPU)
    return plane


# ------------------------------------------------------------------ vegeta


def attack(
    vegeta: Path,
    targets: Path,
    ca: str,
    server_pid: int,
    out_dir: Path,
    name: str,
    *,
    duration: float,
    rate: float | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """One vegeta attack, pinned to LOAD_CPU; its report with the server's and vegeta's CPU."""
    results = out_dir / f"{name}.bin"
    argv = [
        "taskset",
        "-c",
        str(LOAD_CPU),
        str(vegeta),
        "attack",
        f"-targets={targets}",
        f"-root-certs={ca}",
        "-http2=false",
        f"-duration={duration}s",
        "-timeout=5s",
        f"-output={results}",
    ]
    if rate is not None:
        argv.append(f"-rate={rate:g}/s")
    else:
        assert workers is not None
        argv += ["-rate=0", f"-workers={workers}", f"-max-workers={workers}"]
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0, t0 = procfs.cpu_seconds(server_pid), time.monotonic()
    subprocess.run(argv, check=True)
    elapsed = time.monotonic() - t0
    server_cpu = procfs.cpu_seconds(server_pid) - cpu0
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    report = json.loads(
        subprocess.run(
            [str(vegeta), "report", "-type=json", str(results)], check=True, capture_output=True
        ).stdout
    )
    results.unlink()
    latencies = report["latencies"]
    requests = report["requests"]
    ok = round(report["success"] * requests)
    return {
        "rate": rate,
        "workers": workers,
        "requests": requests,
        "throughput_rps": round(report["throughput"], 1),
        "success_ratio": report["success"],
        "errors": requests - ok,
        "status_codes": report["status_codes"],
        "error_samples": report.get("errors", [])[:3],
        "p50_ms": round(latencies["50th"] / 1e6, 3),
        "p90_ms": round(latencies["90th"] / 1e6, 3),
        "p99_ms": round(latencies["99th"] / 1e6, 3),
        "max_ms": round(latencies["max"] / 1e6, 3),
        "mean_ms": round(latencies["mean"] / 1e6, 3),
        "server_cpu_pct": round(100 * server_cpu / elapsed, 1),
        "server_cpu_us_per_request": round(1e6 * server_cpu / max(1, requests), 1),
        "vegeta_cpu_pct": round(100 * client_cpu / elapsed, 1),
        "vegeta_cpu_us_per_request": round(1e6 * client_cpu / max(1, requests), 1),
    }


def measure(
    server: str, pid: int, vegeta: Path, targets: Path, ca: str, tmp: Path, args: argparse.Namespace
) -> dict[str, Any]:
    print(f"  {server}: warm-up", file=sys.stderr, flush=True)
    attack(vegeta, targets, ca, pid, tmp, "warm", duration=3, rate=args.rate)
    print(f"  {server}: open loop at {args.rate:g}/s for {args.duration:g} s", file=sys.stderr, flush=True)
    open_loop = attack(vegeta, targets, ca, pid, tmp, "open", duration=args.duration, rate=args.rate)
    print(
        f"  {server}: open loop: p50 {open_loop['p50_ms']:.2f} ms, p99 {open_loop['p99_ms']:.2f} ms, "
        f"max {open_loop['max_ms']:.2f} ms, errors {open_loop['errors']}",
        file=sys.stderr,
        flush=True,
    )
    sweep = []
    for n in args.workers:
        step = attack(vegeta, targets, ca, pid, tmp, f"w{n}", duration=args.sweep_duration, workers=n)
        print(
            f"  {server}: {n:3d} workers: {step['throughput_rps']:8.0f} req/s, p99 {step['p99_ms']:7.2f} ms, "
            f"errors {step['errors']}, server CPU {step['server_cpu_pct']:.0f}% "
            f"({step['server_cpu_us_per_request']:.1f} us/req), vegeta CPU {step['vegeta_cpu_pct']:.0f}%",
            file=sys.stderr,
            flush=True,
        )
        sweep.append(step)
    clean = [s for s in sweep if s["errors"] == 0] or sweep
    best = max(clean, key=lambda s: s["throughput_rps"])
    return {"open_loop": open_loop, "sweep": sweep, "saturation": best}


# ------------------------------------------------------------------ orchestration


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every process, then wait for each; one still running after 15 s is killed."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 CPUs: one for the servers, one for vegeta")
    bins = binaries.ensure(["etcd", "kube-apiserver", "vegeta"], progress=lambda m: print(m, file=sys.stderr))
    vegeta = bins["vegeta"]
    before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in SERVERS}
    processes: list[subprocess.Popen[bytes]] = []
    plane: cluster.ControlPlane | None = None
    with tempfile.TemporaryDirectory(prefix="webhook-vegeta-") as tmp_name:
        tmp = Path(tmp_name)
        builds = {
            experiment: build_go_webhook(tmp, experiment, args.go_prebuilt)
            for _, experiment in GO_SERVERS.values()
        }
        ca, cert, key = request_shape.make_certs(tmp / "certs")
        body = request_shape.review_body()
        (tmp / "review.json").write_bytes(body)
        claim = request_shape.raw_claim()
        allocation = claim["status"]["allocations"][0]
        claim_key = f"{claim['metadata']['namespace']}/{claim['metadata']['name']}"
        uuids = [d["uuid"] for d in allocation["devices"]]
        served = {"node": allocation["nodeName"], "uuids": uuids}
        if args.dra:
            served["resourceClaim"] = constants.resource_claim_name(claim["metadata"]["name"], 0)
        (tmp / "claims.json").write_text(json.dumps({claim_key: served}))
        try:
            print("starting etcd and kube-apiserver with the benchmark's claim", file=sys.stderr)
            plane = start_cluster(tmp / "cluster", bins)
            gpualloc_port, *go_ports = cluster.free_ports(1 + len(GO_SERVERS))
            pin = ["taskset", "-c", str(SERVER_CPU)]
            script = Path(sys.executable).with_name("gpualloc")  # the command a source checkout installs
            command = [str(script)] if script.exists() else [sys.executable, "-m", "gpualloc.cli"]
            gpualloc = subprocess.Popen(
                [
                    *pin,
                    *command,
                    *webhook_args(cert, key, gpualloc_port, plane.kubeconfig),
                    *(["--dra"] if args.dra else []),
                ],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
            )
            processes.append(gpualloc)
            servers = {"gpualloc": (gpualloc, gpualloc_port)}
            for (name, (decode, experiment)), port in zip(GO_SERVERS.items(), go_ports, strict=True):
                go = subprocess.Popen(
                    [
                        *pin,
                        str(builds[experiment]),
                        f"-decode={decode}",
                        f"-addr=127.0.0.1:{port}",
                        f"-cert={cert}",
                        f"-key={key}",
                        f"-claims={tmp / 'claims.json'}",
                    ],
                    stdout=subprocess.DEVNULL,
                )
                processes.append(go)
                servers[name] = (go, port)
            for name, (process, port) in servers.items():
                wait_ready(port, ca, "/readyz" if name == "gpualloc" else "/healthz", process)
            answers = {name: post_review(port, ca, body) for name, (_, port) in servers.items()}
            shapes = {name: answer_shape(a) for name, a in answers.items()}
            if any(shape != shapes["gpualloc"] for shape in shapes.values()) or not shapes["go"]["patch"]:
                raise SystemExit(f"the webhooks answer differently:\n{json.dumps(shapes, indent=1)}")
            for i in range(args.rounds):
                for name in SERVERS if i % 2 == 0 else tuple(reversed(SERVERS)):
                    process, port = servers[name]
                    targets = tmp / f"targets-{name}.txt"
                    targets.write_text(
                        f"POST https://127.0.0.1:{port}/mutate?timeout=5s\n"
                        f"Content-Type: application/json\n@{tmp / 'review.json'}\n"
                    )
                    print(f"round {i + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                    result = measure(name, process.pid, vegeta, targets, ca, tmp, args)
                    result["loadavg_1m_before"] = round(os.getloadavg()[0], 2)
                    rounds[name].append(result)
        finally:
            stop_all(processes)
            if plane is not None:
                plane.stop()
    after = os.getloadavg()
    return summarise(args, rounds, before, after, answers["gpualloc"], shapes["gpualloc"], vegeta)


def median_by(runs: list[dict[str, Any]], pick: Any) -> dict[str, Any]:
    ordered = sorted(runs, key=pick)
    return dict(ordered[len(ordered) // 2])


def summarise(
    args: argparse.Namespace,
    rounds: dict[str, list[dict[str, Any]]],
    before: tuple[float, float, float],
    after: tuple[float, float, float],
    answer: dict[str, Any],
    shape: dict[str, Any],
    vegeta: Path,
) -> dict[str, Any]:
    servers: dict[str, Any] = {}
    for name, runs in rounds.items():
        servers[name] = {
            "open_loop": median_by([r["open_loop"] for r in runs], lambda o: o["p99_ms"]),
            "saturation": median_by([r["saturation"] for r in runs], lambda s: s["throughput_rps"]),
            "rounds": runs,
        }

    def by_round(go: str) -> list[float]:
        return [
            round(ours["saturation"]["throughput_rps"] / theirs["saturation"]["throughput_rps"], 3)
            for ours, theirs in zip(rounds["gpualloc"], rounds[go], strict=True)
        ]

    ratios = by_round("go")
    per_request = "server_cpu_us_per_request"
    cpu_ratios = [
        round(theirs["saturation"][per_request] / ours["saturation"][per_request], 3)
        for ours, theirs in zip(rounds["gpualloc"], rounds["go"], strict=True)
    ]
    ratio = round(statistics.median(ratios), 3)
    p99 = servers["gpualloc"]["open_loop"]["p99_ms"]
    version = subprocess.run([str(vegeta), "-version"], capture_output=True, text=True).stdout.split("\n")[0]
    go = shutil.which("go")  # absent where the Go servers were built elsewhere (--go-prebuilt)
    go_version = subprocess.run([go, "version"], capture_output=True, text=True).stdout.strip() if go else ""
    races = subprocess.run(["pgrep", "-f", "test_race_crash"], capture_output=True, text=True).stdout.split()
    return {
        "generated": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["bench/webhook_vegeta.py", *sys.argv[1:]]),
        "note": "every server pinned to CPU 0 (taskset), vegeta and the idle API server to CPU 1; "
        "HTTP/1.1 keep-alive over TLS on 127.0.0.1; gpualloc runs interpreted from the checkout "
        "against a real kube-apiserver (claim from its watch cache); figures are the median round "
        "(open loop by p99, saturation by throughput); saturation = the largest throughput of a "
        "closed-loop step (vegeta -rate=0 -max-workers=N) without errors",
        "host": {
            "cpus": os.cpu_count(),
            "cpu_model": request_shape.cpu_model(),
            "loadavg_before": [round(x, 2) for x in before],
            "loadavg_after": [round(x, 2) for x in after],
            "race_test_running_at_end": bool(races),
            "python": platform.python_version(),
            "go": go_version,
            "vegeta": version,
            "openssl": ssl.OPENSSL_VERSION,
        },
        "request": {"bytes": len(request_shape.review_body()), "containers": 3, "init_containers": 1},
        "answer": {
            "bytes": len(json.dumps({"response": answer}, separators=(",", ":"))),
            "patch_operations": len(shape["patch"]),
            "warnings": shape["warnings"],
            "same_patch_from_all": True,
        },
        "settings": {
            "rate": args.rate,
            "duration_s": args.duration,
            "sweep_duration_s": args.sweep_duration,
            "workers": args.workers,
            "rounds": args.rounds,
            "dra": args.dra,
        },
        "gpualloc": servers["gpualloc"],
        **{name: servers[name] for name in GO_SERVERS},
        "saturation_ratio": ratio,
        "saturation_ratio_by_round": ratios,
        "saturation_ratio_vs": {
            name: {"median": round(statistics.median(by_round(name)), 3), "by_round": by_round(name)}
            for name in GO_SERVERS
        },
        "cpu_per_request_ratio_by_round": cpu_ratios,
        "targets": {
            "p99_ms_at_rate": {"limit": TARGET_P99_MS, "measured": p99, "met": p99 <= TARGET_P99_MS},
            "saturation_vs_go": {"limit": TARGET_RATIO, "measured": ratio, "met": ratio >= TARGET_RATIO},
        },
    }


def print_summary(report: dict[str, Any], out: Path) -> None:
    host, settings = report["host"], report["settings"]
    print(
        f"webhook under vegeta ({report['request']['bytes']} B AdmissionReview; {settings['rounds']} rounds; "
        f"servers on CPU 0, vegeta on CPU 1; load average {host['loadavg_before'][0]} -> "
        f"{host['loadavg_after'][0]}; {host['vegeta']}, {host['go']})"
    )
    rate = f"@ {settings['rate']:g}/s"
    print(
        f"{'':9} {rate:>9} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}   {'saturation':>10} {'workers':>7} "
        f"{'p99 ms':>7} {'srv cpu':>7} {'us/req':>7} {'1/cpu':>7} {'vegeta':>7}"
    )
    for name in SERVERS:
        o, s = report[name]["open_loop"], report[name]["saturation"]
        capacity = 1e6 / s["server_cpu_us_per_request"]
        print(
            f"{name:10}{'':>9} {o['p50_ms']:7.2f} {o['p99_ms']:7.2f} {o['max_ms']:7.2f}   "
            f"{s['throughput_rps']:10.0f} {s['workers']:7d} {s['p99_ms']:7.2f} {s['server_cpu_pct']:6.0f}% "
            f"{s['server_cpu_us_per_request']:7.1f} {capacity:7.0f} {s['vegeta_cpu_pct']:6.0f}%"
        )
    for name, vs in report["saturation_ratio_vs"].items():
        rounds = ", ".join(f"{r:.2f}x" for r in vs["by_round"])
        print(f"saturation, gpualloc / {name}: {vs['median']:.2f}x ({rounds})")
    targets = report["targets"]
    p99, ratio = targets["p99_ms_at_rate"], targets["saturation_vs_go"]
    print(
        f"gpualloc p99 at {settings['rate']:g}/s: "
        f"{p99['measured']:.2f} ms (goal <= {p99['limit']:g} ms): {'met' if p99['met'] else 'NOT met'}"
    )
    by_round = ", ".join(f"{r:.2f}x" for r in report["saturation_ratio_by_round"])
    cpu = ", ".join(f"{r:.2f}x" for r in report["cpu_per_request_ratio_by_round"])
    print(
        f"saturation, gpualloc / go: {ratio['measured']:.2f}x, median of rounds ({by_round}) "
        f"(goal >= {ratio['limit']:g}x): {'met' if ratio['met'] else 'NOT met'}; "
        f"server CPU per request, go / gpualloc: {cpu}"
    )
    print(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=500.0, help="open-loop rate, requests per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of the open-loop run")
    parser.add_argument("--sweep-duration", type=float, default=5.0, help="seconds of each saturation step")
    parser.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 2, 4, 8, 16, 32],
        help="closed-loop connection counts of the saturation sweep (comma-separated)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="runs of each server, alternating")
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument(
        "--dra",
        action="store_true",
        help="DRA on (issue 42): every server also gives the pod its replica's ResourceClaim"
        " (spec.resourceClaims gpualloc-gpus and resources.claims in each container: 5 more operations)",
    )
    parser.add_argument(
        "--go-prebuilt",
        type=Path,
        default=None,
        help="a folder with gowebhook and gowebhook-jsonv2 built elsewhere, instead of building them here",
    )
    args = parser.parse_args()
    if shutil.which("taskset") is None or (shutil.which("go") is None and args.go_prebuilt is None):
        raise SystemExit("needs taskset, and go on PATH unless --go-prebuilt is given")
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_summary(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
