# The two commands a newcomer needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.setup-stamp

.PHONY: setup demo test lint protos clean

# Idempotent: the venv, the project (editable) and the default model are made once;
# the stubs are regenerated whenever a .proto is newer.
setup: $(STAMP) protos
	@$(BIN)/infermesh model pull default

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q grpcio-tools
	$(BIN)/python proto/generate.py
	$(BIN)/pip install -q --config-settings editable_mode=compat -e '.[test,bench]'
	touch $(STAMP)

protos: $(STAMP) meshpb/v1/.stamp

meshpb/v1/.stamp: $(wildcard proto/meshpb/v1/*.proto) proto/generate.py
	$(BIN)/python proto/generate.py
	touch $@

demo: setup
	$(BIN)/python -m mesh.demo

test: setup
	$(BIN)/ruff check mesh services kernels tests bench proto
	$(BIN)/mypy mesh services kernels
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint:
	$(BIN)/ruff check mesh services kernels tests bench proto
	$(BIN)/mypy mesh services kernels

clean:
	rm -rf $(VENV) meshpb build *.egg-info
