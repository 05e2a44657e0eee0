"""``nvidia-smi``, the reference the GPU tests compare gpualloc's readings with."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

_ESCAPES = re.compile(r"\x1b\[[0-9;]*m")  # topo -m underlines its header


def run(*args: str) -> str:
    """nvidia-smi's stdout without terminal escapes; skips the test where nvidia-smi is missing or fails."""
    path = shutil.which("nvidia-smi")
    if path is None:
        pytest.skip("nvidia-smi is not on PATH: no NVIDIA driver on this machine")
    done = subprocess.run([path, *args], capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        pytest.skip(f"nvidia-smi {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[:300]}")
    return _ESCAPES.sub("", done.stdout)


def mib(text: str) -> int:
    """``81559 MiB`` -> 81559."""
    return int(text.split()[0])
