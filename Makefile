# One command sets up and runs each main job on a fresh machine:
#   make serve   -> venv + install + default model + OpenAI-compatible server on 127.0.0.1:8000
#   make test    -> venv + install + the test suite (CPU)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup serve test test-fast model clean

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

test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q $(ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
