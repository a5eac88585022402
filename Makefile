# `make bench` and `make test` do all set-up themselves: a .venv, Mooncake's system library, CPU torch.
# Re-running is quick: the install step re-runs only when pyproject.toml or this file changed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# On these machines torch==2.13.0 resolves to a local CPU wheel; a bare `torch` pulls a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.stamp-install
BENCH_ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup bench test clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@./scripts/ensure-system-deps.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[mooncake,test,bench]"
	@touch $@

bench: $(STAMP)
	$(BIN)/aiolayer bench $(BENCH_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) bench/results .pytest_cache .hypothesis
