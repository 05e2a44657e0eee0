# gpualloc — the two commands a newcomer needs are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: help setup build test test-unit test-integration test-node test-gpu lint demo bench clean

help:
	@echo "make demo   - build what is missing, start a local cluster with 3 simulated GPU nodes, show allocation"
	@echo "              (DEMO_ARGS=--real-node: the pods really run on a kubelet node; prints what each container saw; root)"
	@echo "make test   - unit, property, integration and e2e tests against a real local kube-apiserver"
	@echo "make test-node - the real-node tier alone (kubelet + containerd; root; part of make test)"
	@echo "make test-gpu - on a machine with an NVIDIA GPU: NVML and CUDA against nvidia-smi (see docs/operations.md)"
	@echo "make lint   - ruff, mypy --strict, import-linter"
	@echo "make bench  - benchmarks; results in bench/results/, summary in BENCHMARKS.md"

# setup.py generates agent/kubeletapi/*_pb2.py from the vendored .proto files at install time.
$(BIN)/gpualloc: pyproject.toml setup.py $(wildcard agent/kubeletapi/*.proto)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	@touch $@

setup: $(BIN)/gpualloc

# Builds kube-apiserver, kube-scheduler, kube-controller-manager, etcd, kwok, helm, toxiproxy-server and vegeta,
# and the real node's kubelet, containerd (+ shim, ctr), CNI plugins and pause program (docs/real-node.md),
# from pinned Go modules into ~/.cache/gpualloc (once per machine; prints progress).
build: setup
	$(BIN)/gpualloc dev build

test: build
	$(BIN)/pytest $(PYTEST_ARGS) tests

test-unit: setup
	$(BIN)/pytest -q tests/unit tests/property

test-integration: build
	$(BIN)/pytest -q tests/integration tests/e2e

# The real-node tier (kubelet, containerd; root, overlayfs): skipped with the reason elsewhere.
test-node: build
	$(BIN)/pytest -q -rs tests/node

# On a GPU machine: needs only etcd and kube-apiserver (built here, or copied into the cache).
test-gpu: setup
	$(BIN)/gpualloc dev build --only etcd --only kube-apiserver
	$(BIN)/pytest -v -rs tests/gpu

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

demo: build
	$(BIN)/python -m gpualloc.demo $(DEMO_ARGS)

bench: build
	$(BIN)/python bench/allocator_decision.py
	$(BIN)/python bench/quality_study.py
	$(BIN)/python bench/webhook_vegeta.py
	$(BIN)/python bench/controller_throughput.py
	$(BIN)/python bench/agent_scan.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis

# The deterministic simulation (tests/simulation): several controllers and simulated users
# interleaved at every await against an in-memory API server; invariants checked after every step.
# `make sim SIM_ARGS="--seed 1234 --trace"` replays one schedule.
.PHONY: sim sim-long
SIM_ARGS ?= --schedules 10000 --workers 2
sim: setup
	$(BIN)/python -m tests.simulation $(SIM_ARGS)

sim-long: setup
	$(BIN)/python -m tests.simulation --long

# The image without a container registry (image/build.py): Debian packages (mmdebstrap), the wheel
# of HEAD, user/entrypoint/labels from the Dockerfile; an OCI archive in ~/.cache/gpualloc/image/.
# Needs root and `apt-get install mmdebstrap umoci skopeo`.
# image-check runs it under podman (`apt-get install podman runc`) as the chart does, against the
# local control plane (image/check.py). Neither is part of `make test`.
.PHONY: image image-check
IMAGE_ARGS ?=
IMAGE_CHECK_ARGS ?=
image: setup
	$(BIN)/python image/build.py --python $(BIN)/python $(IMAGE_ARGS)

image-check: setup
	$(BIN)/python image/check.py $(IMAGE_CHECK_ARGS)
