# One command sets up and runs each main job on a fresh machine:
#   make serve   -> venv + install + default model + OpenAI-compatible server on 127.0.0.1:8000
#   make test    -> venv + install + the test suite (CPU)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup serve test test-fast model lm-eval clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU machines carry a local torch 2.13.0 wheel; a bare `torch` would pull a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0 || $(BIN)/python -m pip install -q "torch>=2.11"
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(BIN)/minivllm download-default-model

serve: model
	$(BIN)/minivllm serve $(ARGS)

# One pytest worker per core (pytest-xdist), each single-threaded: 510-550 s for the whole
# suite (981 tests) on the 2-core development machine (docs/decisions.md, "Tests run on every core").
# TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= auto

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow" $(ARGS)

# lm-eval's local-completions against minivllm serve (bench/lm_eval_check.py); lm-eval gets a
# venv of its own, with torch pinned to the same CPU wheel.
LMEVAL := $(VENV)/lm-eval
lm-eval: model
	test -x $(LMEVAL)/bin/lm_eval || ($(PYTHON) -m venv $(LMEVAL) && \
	  $(LMEVAL)/bin/python -m pip install -q torch==2.13.0 "lm-eval[api]==0.4.13")
	$(BIN)/python -m bench.lm_eval_check --lm-eval $(LMEVAL)/bin/lm_eval $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
