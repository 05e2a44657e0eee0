"""What ``/proc`` says of a process: its CPU seconds and its memory; and what a result file says of
the run's machine (the benches' one copy of each)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any


def run_stamp() -> dict[str, Any]:
    """The ``when`` and ``machine`` fields a bench's result file opens with."""
    return {
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_kib(pid: int) -> dict[str, int]:
    """``VmRSS`` (resident now) and ``VmHWM`` (peak resident) of ``pid`` in KiB; {} when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def rss_kib(pid: int) -> int | None:
    """VmRSS of ``pid`` in KiB (None when it is gone)."""
    return memory_kib(pid).get("VmRSS")
