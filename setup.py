"""Generates the kubelet API's protobuf modules before the packages are built.

The metadata is in pyproject.toml; this file only adds a step to ``build_py``: protoc (from
grpcio-tools, a build requirement) turns the vendored ``agent/kubeletapi/*.proto`` into
``*_pb2.py`` and ``*_pb2.pyi`` beside them. They are build outputs, not committed (.gitignore):
protobuf's generated code carries a check against the runtime's version ("NO CHECKED-IN
PROTOBUF GENCODE"), so it is made with the protobuf that is installed with it. Every install
runs it: ``pip install -e`` (``make setup``, ``.ci/run``), ``pip wheel`` (``make image``, the
Dockerfile). Only the messages are generated; the gRPC services are ``agent/kubelet_plugin.py``'s
own, on grpcio's generic handlers.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = sorted((ROOT / "agent" / "kubeletapi").glob("*.proto"))


def generate_kubeletapi() -> None:
    from grpc_tools import protoc  # a build requirement (pyproject.toml [build-system])

    for proto in PROTOS:
        argv = ["protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}", str(proto)]
        if protoc.main(argv) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


class BuildPy(build_py):
    def run(self) -> None:
        generate_kubeletapi()
        super().run()


setup(cmdclass={"build_py": BuildPy})
