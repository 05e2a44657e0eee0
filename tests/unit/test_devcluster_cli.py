"""`gpualloc dev` argument handling and `dev down`'s process bookkeeping (no cluster is started)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from gpualloc.devcluster import cli, cluster, node


@contextlib.contextmanager
def _running(argv: list[str], started: Callable[[int], bool]) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` in a session of its own, once ``started(pid)`` (or after 10 s); killed afterwards."""
    process = subprocess.Popen(argv, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not started(process.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # /proc/<pid>/cmdline is empty until exec has finished
        yield process
    finally:
        process.kill()
        process.wait()


def _sleeper() -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    sleep = shutil.which("sleep")
    assert sleep is not None
    return _running([sleep, "60"], lambda pid: cluster.process_matches(pid, sleep))


def _fake_dev_up() -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    """A process whose command line looks like `gpualloc dev up`."""
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "gpualloc", "dev", "up"]
    return _running(argv, lambda pid: "gpualloc" in cli._cmdline(pid))


def _record(state_dir: Path, processes: dict[str, dict[str, object]]) -> None:
    (state_dir / cluster.STATE_FILE).write_text(json.dumps({"owner": 1, "processes": processes}))


def test_no_subcommand_prints_help_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "build" in capsys.readouterr().out


def test_up_without_a_state_dir_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUALLOC_STATE_DIR", raising=False)

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["up"])

    assert exit_info.value.code == 2


def test_down_with_nothing_running_says_so_and_succeeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["down", "--state-dir", str(tmp_path)]) == 0
    assert "nothing was running" in capsys.readouterr().out


def test_down_reads_the_state_dir_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUALLOC_STATE_DIR", str(tmp_path))

    assert cli.main(["down"]) == 0
    assert str(tmp_path) in capsys.readouterr().out


def test_down_stops_the_recorded_processes_that_still_run(tmp_path: Path) -> None:
    with _sleeper() as process:
        _record(tmp_path, {"etcd": {"pid": process.pid, "executable": process.args[0]}})  # type: ignore[index]

        assert cli.main(["down", "--state-dir", str(tmp_path), "--timeout", "5"]) == 0

        assert process.wait(timeout=5) is not None


def test_down_leaves_alone_a_pid_now_running_something_else(tmp_path: Path) -> None:
    with _sleeper() as process:
        _record(tmp_path, {"etcd": {"pid": process.pid, "executable": "/nonexistent/etcd"}})

        cli.main(["down", "--state-dir", str(tmp_path), "--timeout", "1"])

        assert process.poll() is None  # a reused pid is not ours to kill


def test_down_sends_sigterm_to_the_dev_up_process_in_the_pid_file(tmp_path: Path) -> None:
    with _fake_dev_up() as owner:
        (tmp_path / cli.PID_FILE).write_text(f"{owner.pid}\n")

        assert cli.main(["down", "--state-dir", str(tmp_path), "--timeout", "5"]) == 0

        assert owner.wait(timeout=5) == -15
        assert not (tmp_path / cli.PID_FILE).exists()


def test_up_refuses_a_state_dir_another_dev_up_is_using(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with _fake_dev_up() as owner:
        (tmp_path / cli.PID_FILE).write_text(f"{owner.pid}\n")

        assert cli.main(["up", "--state-dir", str(tmp_path)]) == 1

        assert "in use" in capsys.readouterr().err
        assert (tmp_path / cli.PID_FILE).read_text().strip() == str(owner.pid)


def test_kwok_stages_make_nodes_ready_and_pods_run() -> None:
    stages = list(yaml.safe_load_all(cluster.KWOK_STAGES.read_text()))
    by_name = {stage["metadata"]["name"]: stage["spec"]["resourceRef"]["kind"] for stage in stages}

    assert by_name["node-initialize"] == "Node"
    assert by_name["node-heartbeat-with-lease"] == "Node"
    assert by_name["pod-ready"] == "Pod"
    assert by_name["pod-delete"] == "Pod"


def test_free_port_is_a_loopback_port_nothing_listens_on() -> None:
    port = cluster.free_port()

    assert 1024 <= port <= 65535
    assert cluster._port_is_free(port)


def test_free_ports_are_all_different_and_free() -> None:
    # 200 ports taken one by one, each released before the next, repeat in most runs (the kernel
    # picks them at random among about 14,000); taken together they cannot.
    ports = cluster.free_ports(200)
    assert len(set(ports)) == 200
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_image_import_without_a_real_node_in_the_state_dir_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = tmp_path / "image.oci.tar"
    archive.write_bytes(b"")

    assert cli.main(["image", "import", str(archive), "--state-dir", str(tmp_path)]) == 1
    assert "dev up --real-node" in capsys.readouterr().err


def test_up_real_node_where_no_node_can_run_fails_with_the_reason_before_building_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(node, "unable_reason", lambda: "a real node needs root (test)")
    monkeypatch.setattr(cli.binaries, "ensure", lambda *a, **k: pytest.fail("built"))

    assert cli.main(["up", "--state-dir", str(tmp_path), "--real-node"]) == 1
    assert "a real node needs root (test)" in capsys.readouterr().err
