"""``gpualloc dev``: build, start and stop the local control plane.

    gpualloc dev build                      build the binaries that are not cached yet
    gpualloc dev up --state-dir DIR         etcd + kube-apiserver with the CRDs applied,
        [--with-nodes N]                    plus kube-scheduler, kwok and N fake nodes
        [--with-controller-manager]         plus kube-controller-manager
        [--real-node [--gpu-profile P]]     plus kube-scheduler, kube-controller-manager, a
                                            real node (containerd + kubelet, gpualloc-node-0)
                                            whose simulated GPUs are CDI devices (root only),
                                            its agent the kubelet's DRA plugin, and gpualloc's
                                            controller and webhook with --dra
        [--real-node --no-gpualloc]         the real node without gpualloc, for installing the
                                            chart on it (docs/real-node.md)
    gpualloc dev down --state-dir DIR       stop a cluster started by `dev up` elsewhere, and
                                            undo what its real node changed on the machine
    gpualloc dev image import ARCHIVE --state-dir DIR
                                            import an OCI archive into the real node

``dev up`` prints its progress, then one line saying it is ready, and runs until
SIGINT or SIGTERM, when it stops every process it started.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import types
from collections.abc import Sequence
from pathlib import Path

from gpualloc.devcluster import binaries, cluster, components, debs, images, node
from gpualloc.runtime import options

PID_FILE = "gpualloc-dev.pid"


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""


def _say(message: str) -> None:
    print(message, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpualloc dev", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", metavar="{build,up,down,image}")

    build = commands.add_parser("build", help="build kube-apiserver, etcd, kwok, helm ... into the cache")
    build.add_argument("--only", action="append", choices=binaries.NAMES, help="build only this binary")

    up = commands.add_parser("up", help="start a local control plane; Ctrl-C stops it")
    up.add_argument("--state-dir", type=Path, help="directory for certificates, data, logs, kubeconfig")
    up.add_argument("--with-nodes", type=int, default=0, help="start kube-scheduler and kwok with N nodes")
    up.add_argument(
        "--with-controller-manager",
        action="store_true",
        default=False,
        help="also start kube-controller-manager (namespaces, garbage collection, service accounts)",
    )
    up.add_argument("--crds", type=Path, default=cluster.CRD_DIR, help="directory of CRDs to apply")
    up.add_argument("--node-prefix", default="kwok-node-", help="name prefix of the fake nodes")
    up.add_argument(
        "--real-node",
        action="store_true",
        default=False,
        help=f"also start a real node, {node.NODE_NAME}: containerd and a kubelet (needs root)",
    )
    up.add_argument(
        "--gpu-profile",
        default="h100-sxm-8",
        help="the real node's simulated GPUs (an agent profile; '' for none), exposed as CDI devices",
    )
    up.add_argument(
        "--no-gpualloc",
        action="store_true",
        default=False,
        help="the real node without gpualloc's agent, controller and webhook, for installing the chart "
        "on it: labelled nvidia.com/gpu.present=true, its nvidia<minor> files following the GPUs its "
        "GpuNodeStatus lists",
    )

    down = commands.add_parser("down", help="stop the control plane `dev up` started in --state-dir")
    down.add_argument("--state-dir", type=Path, help="the directory given to `dev up`")
    down.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for it to stop")

    image = commands.add_parser("image", help="images of the real node")
    image_commands = image.add_subparsers(dest="image_command", metavar="{import}")
    image_import = image_commands.add_parser(
        "import", help="import an OCI archive (make image's) into the node"
    )
    image_import.add_argument("archive", type=Path, help="an OCI image archive (oci-archive tar)")
    image_import.add_argument("--state-dir", type=Path, help="the directory given to `dev up --real-node`")

    for sub in (build, up, down, image_import):
        options.env_defaults(sub)
    return parser


def main(argv: Sequence[str]) -> int:
    parser = _parser()
    args = parser.parse_args(list(argv))
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "image" and args.image_command is None:
        parser.parse_args(["image", "--help"])
    if args.command in ("up", "down", "image") and args.state_dir is None:
        parser.error(f"dev {args.command}: --state-dir (or GPUALLOC_STATE_DIR) is required")
    if args.command == "build":
        return _build(args)
    if args.command == "up":
        return _up(args)
    if args.command == "image":
        return _import_image(args)
    return _down(args)


def _build(args: argparse.Namespace) -> int:
    try:
        paths = binaries.ensure(args.only, progress=_say)
    except binaries.BuildError as exc:
        print(f"gpualloc dev build: {exc}", file=sys.stderr)
        return 1
    for name, path in paths.items():
        _say(f"  {name}: {path}")
    return 0


def _raise_interrupted(signum: int, frame: types.FrameType | None) -> None:
    raise _Interrupted(signal.Signals(signum).name)


def _up(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir.expanduser().resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    pid_file = state_dir / PID_FILE
    other = _owner(pid_file)
    if other is not None:
        print(
            f"gpualloc dev up: {state_dir} is in use by pid {other}; run `gpualloc dev down`", file=sys.stderr
        )
        return 1
    previous = {
        signum: signal.signal(signum, _raise_interrupted) for signum in (signal.SIGINT, signal.SIGTERM)
    }
    plane: cluster.ControlPlane | None = None
    real: node.RealNode | None = None
    code = 0
    try:
        pid_file.write_text(f"{os.getpid()}\n")
        if args.no_gpualloc and not args.real_node:
            raise node.NodeError("--no-gpualloc is an option of the real node: add --real-node")
        if args.real_node and (reason := node.unable_reason()) is not None:
            raise node.NodeError(reason)
        wanted = [name for name in binaries.NAMES if args.real_node or name not in binaries.NODE_NAMES]
        paths = binaries.ensure(wanted, progress=_say)
        plane = cluster.ControlPlane(state_dir, binaries=paths, progress=_say, real_node=args.real_node)
        plane.start()
        names = plane.apply_crds(args.crds)
        _say(f"applied CRDs: {', '.join(names)}")
        if args.with_controller_manager:
            plane.ensure_controller_manager()
            _say("kube-controller-manager running")
        if args.with_nodes > 0:
            plane.ensure_scheduler()
            _say("kube-scheduler running")
            for index in range(args.with_nodes):
                name = f"{args.node_prefix}{index}"
                plane.add_kwok_node(name)
                _say(f"node {name} Ready (kwok)")
        if args.real_node:
            plane.ensure_scheduler()
            plane.ensure_controller_manager()
            plane.ensure_service_account("default")  # kube-controller-manager makes it, a moment later
            _say("kube-scheduler and kube-controller-manager running")
            programs = node.ensure_programs(_say)
            bare = bool(args.no_gpualloc)
            profile = None if bare else args.gpu_profile or None
            real = node.RealNode(plane, programs, progress=_say, gpu_profile=profile, external_agent=bare)
            real.start()
            gpus = f"{len(real.gpus)} GPUs as CDI devices ({real.cdi_spec})" if real.gpus else "no GPUs"
            _say(
                f"node {node.NODE_NAME} Ready at {node.NODE_IP}: {gpus}; images {images.TOOLBOX_IMAGE} "
                f"and {images.PAUSE_IMAGE} (`gpualloc dev image import ARCHIVE` adds one)"
            )
            if bare:
                _say(f"no gpualloc on the node: {_chart_hint(real)}")
            if real.gpus:
                port = components.start(plane, dra=True)
                _say(
                    f"gpualloc controller and webhook (127.0.0.1:{port}) running with --dra; the agent is "
                    f"the kubelet's DRA plugin: a claim pod's containers get exactly its GPUs"
                )
        version = plane.version().get("gitVersion", "?")
        _say(
            f"ready: kubeconfig {plane.kubeconfig} (server {plane.server}, version {version}); "
            "Ctrl-C or `gpualloc dev down` stops it"
        )
        while True:
            time.sleep(1.0)
            plane.check_alive()
            if real is not None:
                real.check_alive()
                if real.external_agent:
                    with contextlib.suppress(cluster.ControlPlaneError, OSError):  # tried again in 1 s
                        real.follow_published_gpus()
    except _Interrupted as exc:
        _say(f"{exc}: stopping")
    except (
        binaries.BuildError,
        cluster.ControlPlaneError,
        node.NodeError,
        debs.PackageError,
        OSError,
    ) as exc:
        print(f"gpualloc dev up: {exc}", file=sys.stderr)
        code = 1
    finally:
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)  # finish stopping even on a second Ctrl-C
        try:
            if plane is not None and real is not None:
                components.stop(plane)
            if real is not None:
                left = real.stop()
                if left:
                    print(f"gpualloc dev up: the real node left: {'; '.join(left)}", file=sys.stderr)
                    code = code or 1
            if plane is not None:
                plane.stop()
                _say(f"stopped; state kept in {state_dir}")
            with contextlib.suppress(FileNotFoundError):
                pid_file.unlink()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return code


def _chart_hint(real: node.RealNode) -> str:
    """The chart's values for an agent on ``real`` (its DaemonSet, the simulated source)."""
    values = {
        "certManager.enabled": "false",
        "image.pullPolicy": "Never",
        "agent.source": "simulated",
        "agent.deviceDir": str(real.device_dir),
        "dra.kubeletRoot": str(real.kubelet_root),
    }
    return "helm install gpualloc helm/gpualloc -n gpualloc-system --create-namespace " + " ".join(
        f"--set {key}={value}" for key, value in values.items()
    )


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _owner(pid_file: Path) -> int | None:
    """The pid of the live `gpualloc dev up` recorded in ``pid_file``, if any."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and "gpualloc" in _cmdline(pid) else None


def _down(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir.expanduser().resolve()
    pid_file = state_dir / PID_FILE
    stopped_owner = False
    pid = _owner(pid_file)
    if pid is not None:
        _say(f"stopping gpualloc dev up (pid {pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + args.timeout
        while _cmdline(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _cmdline(pid):
            print(f"gpualloc dev down: pid {pid} still runs after {args.timeout:.0f} s", file=sys.stderr)
        else:
            stopped_owner = True
    # Whatever the owner left behind (it may have been killed with SIGKILL): the real node first.
    node_dir = state_dir / "node"
    if node.load_state(node_dir):
        left = node.teardown(node_dir, progress=_say)
        if left:
            print(f"gpualloc dev down: the real node left: {'; '.join(left)}", file=sys.stderr)
            return 1
    state = cluster.load_state(state_dir)
    leftovers = cluster.stop_recorded(state, timeout=min(args.timeout, 10.0))
    for name in leftovers:
        _say(f"stopped {name}")
    remaining = cluster.recorded_alive(state)
    if not remaining:
        with contextlib.suppress(FileNotFoundError):
            pid_file.unlink()
    if not stopped_owner and not leftovers:
        _say(f"nothing was running in {state_dir}")
    if remaining:
        print(f"gpualloc dev down: still running: {remaining}", file=sys.stderr)
        return 1
    return 0


def _import_image(args: argparse.Namespace) -> int:
    state_dir: Path = args.state_dir.expanduser().resolve()
    try:
        names = node.import_image(state_dir / "node", args.archive)
    except node.NodeError as exc:
        print(f"gpualloc dev image import: {exc}", file=sys.stderr)
        return 1
    _say(f"imported into {node.NODE_NAME}: {', '.join(names) or '(images already present)'}")
    return 0
