# Two commands set everything up on a fresh machine:
#   make run   - serve the embedded demo model with the `file` L3 backend under ./.hicache/
#   make test  - run the whole test suite
# GPU users: make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= test,redis,mooncake,lmcache
PYTEST_ARGS ?=
HOST       ?= 127.0.0.1
PORT       ?= 30000

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup sysdeps run test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	touch $(STAMP)

setup: $(STAMP)

sysdeps:
	bash scripts/install_system_deps.sh

run: setup
	LMCACHE_TRACK_USAGE=false $(BIN)/hicache-engine --host $(HOST) --port $(PORT) \
	  --enable-hierarchical-cache --hicache-storage-backend file \
	  --hicache-storage-backend-extra-config '{"path": ".hicache/pages"}' --enable-metrics

# The suite runs in a loopback-only network namespace when one can be made (see the script).
test: setup sysdeps
	LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1 scripts/in_netns.sh $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check hicache storage_backends engine tools tests benchmarks
	$(BIN)/mypy

# Benchmarks run in the loopback-only namespace too (Mooncake binds every interface).
bench: setup sysdeps
	LMCACHE_TRACK_USAGE=false scripts/in_netns.sh $(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
