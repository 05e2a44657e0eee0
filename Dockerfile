# syntax=docker/dockerfile:1
# One image for every component: gpualloc agent|controller|webhook|certs ...
#
#   docker build -t ghcr.io/gpualloc/gpualloc:0.1.0 .
#
# Stage 1 builds the wheel (pure Python); stage 2 installs it (and its dependencies from PyPI)
# into a virtual environment and runs as the non-root user 65532, the uid the Helm chart sets.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The build tools first (a layer that changes rarely), then the sources.
# grpcio-tools: setup.py generates the kubelet API's protobuf modules (agent/kubeletapi) with its protoc.
RUN python -m pip install "setuptools>=77" wheel "grpcio-tools~=1.85.0"
COPY pyproject.toml setup.py README.md LICENSE ./
COPY gpualloc/ gpualloc/
COPY agent/ agent/
COPY controller/ controller/
COPY webhook/ webhook/
COPY certs/ certs/
RUN python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .
# Fail the build if a component package is missing from the wheel.
RUN python -c "import pathlib, sys, zipfile; \
(w,) = pathlib.Path('/wheels').glob('gpualloc-*.whl'); names = zipfile.ZipFile(w).namelist(); \
missing = [p for p in ('gpualloc/cli.py', 'agent/', 'controller/', 'webhook/', 'certs/') \
           if not any(n.startswith(p) for n in names)]; \
sys.exit(f'missing from {w.name}: {missing}' if missing else 0)"

FROM ${PYTHON_IMAGE} AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gpualloc
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    /opt/gpualloc/bin/pip install /wheels/gpualloc-*.whl \
 && /opt/gpualloc/bin/pip uninstall -y pip \
 && /opt/gpualloc/bin/gpualloc --help >/dev/null
ENV PATH=/opt/gpualloc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The chart runs it with a read-only root filesystem and an emptyDir on /tmp.
USER 65532:65532
WORKDIR /tmp
LABEL org.opencontainers.image.title="gpualloc" \
      org.opencontainers.image.description="Topology-aware GPU allocation for Kubernetes" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENTRYPOINT ["gpualloc"]
CMD ["--help"]
