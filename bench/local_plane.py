"""A throwaway local control plane for a bench, and where its figures go (the benches' one copy)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpualloc.devcluster import binaries, cluster


@contextlib.contextmanager
def temporary(
    prefix: str, *, crds: bool = True, state_dir: Path | None = None
) -> Iterator[tuple[cluster.ControlPlane, Path]]:
    """etcd and kube-apiserver (built or cached) in a temporary directory, with gpualloc's CRDs
    unless ``crds`` is false; the plane and a scratch directory for logs. Stopped, and the
    directory removed, on the way out."""
    paths = binaries.ensure(["kube-apiserver", "etcd"])
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        workdir = Path(tmp)
        with cluster.ControlPlane(state_dir or workdir / "plane", binaries=paths) as plane:
            if crds:
                plane.apply_crds()
            yield plane, workdir


def write(path: Path, result: dict[str, Any]) -> None:
    """The bench's figures as JSON at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
