# The two commands a newcomer needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.setup-stamp
# pytest-xdist: a worker per core; the end-to-end modules in two groups, each on one worker (MeshGroups in
# tests/conftest.py).
# XDIST= runs everything in one process.
XDIST ?= -n auto

# torch comes from pip, so the machine's pip configuration (a local CPU wheel, constraints) chooses the build;
# the rest from uv where it installs and works (~10 s, pip takes ~60), pip otherwise.  Nothing is byte-compiled
# at install: each module compiles once, when a process first imports it (PYTHONDONTWRITEBYTECODE is lifted for
# what make runs), so only what runs is compiled; a venv compiled whole costs ~50 s of CPU more.
INSTALL = { [ -x $(BIN)/uv ] && $(BIN)/uv pip install -q --python $(BIN)/python $(1); } || \
	$(BIN)/pip install -q --no-compile $(1)
unexport PYTHONDONTWRITEBYTECODE
PROJECT := .[test,bench]

.PHONY: setup demo test test-fast lint protos clean compose-tool

# Idempotent: the venv, the project (editable) and the default model are made once;
# the stubs are regenerated whenever a .proto is newer; the fused CPU ops (meshkernels/cpu_ops.cpp) are
# compiled into ~/.cache/infermesh/kernels/ when their source or torch changed.
setup: $(STAMP) protos
	@$(BIN)/python -m meshkernels.cpu_ops || echo "fused CPU ops not built; the engine will use the torch ops"
	@$(BIN)/infermesh model pull default

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-compile torch==$(TORCH_VERSION)
	$(BIN)/pip install -q --no-compile uv || echo "uv not installed: pip installs the rest (about a minute slower)"
	$(call INSTALL,grpcio-tools)
	$(BIN)/python proto/generate.py
	$(call INSTALL,-C editable_mode=compat -e "$(PROJECT)")
	touch $(STAMP)

protos: $(STAMP) meshpb/v1/.stamp

meshpb/v1/.stamp: $(wildcard proto/meshpb/v1/*.proto) proto/generate.py
	$(BIN)/python proto/generate.py
	touch $@

demo: setup
	$(BIN)/python -m infermesh.demo

# Everything: unit, service, deployment files, GPU checks (skipped without CUDA), end-to-end meshes
# and the multi-host test (root only). What CI runs.
test: setup compose-tool lint
	$(BIN)/python -m pytest -q $(XDIST)

# Pure code (tests/unit) and in-process services (tests/service) but the `slow` ones: no meshes, no root, no
# lint (`make lint`). pytest's cache is on: `make test-fast` then `.venv/bin/python -m pytest --lf` reruns failures.
test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" tests/unit tests/service

# Debian's docker-compose (1.29) lets tests/compose/test_deploy_files.py parse compose/docker-compose.yml.
# Installed only when missing and only as root with apt-get; otherwise that one check is skipped.
compose-tool:
	@command -v docker-compose >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1 || \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null 2>&1 || \
	  { apt-get update -qq >/dev/null 2>&1 && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null 2>&1; } || true

# mypy's cache lives with the machine's other build caches, so a fresh clone checks only what differs (~2 s, not ~30).
MYPY_CACHE_DIR ?= $(HOME)/.cache/infermesh/mypy
lint:
	$(BIN)/ruff check infermesh mesh services meshkernels tests bench proto
	MYPY_CACHE_DIR=$(MYPY_CACHE_DIR) $(BIN)/mypy infermesh mesh services meshkernels

clean:
	rm -rf $(VENV) meshpb build *.egg-info
