# Two commands do all set-up on a fresh machine:
#   make run   - install into .venv, pull the default model, serve it (OpenAI API on http://127.0.0.1:8000)
#   make test  - install into .venv, pull the test models, run the test suite
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run demo test test-fast lint bench-latency bench-throughput bench-docs models

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: here it resolves to the local CPU wheel, never the multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# HF transformers loads GPTQ / AWQ checkpoints through gptqmodel (the round-trip tests). Without its
	# dependencies: its requirements pin torch >= 2.14.1, which resolves to the CUDA build; the CPU kernels
	# HF uses run on this torch, and everything else it imports is listed here.
	$(PY) -m pip install -q --no-deps gptqmodel==7.7.0 optimum==2.3.0 device-smi==0.5.7 logbar==0.4.15 \
		tokenicer==0.0.14 pypcre==0.6.4 defuser==0.0.28 threadpoolctl==3.8.0
	# ridge's C++ CPU kernels, compiled here once rather than by the first engine (kernels/cpu_ops.py);
	# without a compiler ridge warns and keeps its torch paths
	$(PY) -c "from ridge.kernels import cpu_ops; cpu_ops.load()"
	touch $(STAMP)

models: $(STAMP)
	$(VENV)/bin/ridge pull smollm2 qwen2.5-coder-0.5b qwen2.5-coder-1.5b gemma3-270m

run: $(STAMP)
	$(VENV)/bin/ridge pull smollm2
	$(VENV)/bin/ridge serve

demo: $(STAMP)
	$(VENV)/bin/ridge pull smollm2
	$(VENV)/bin/ridge demo

# two workers of one thread each (whole files per worker): the engine's Python between kernels keeps one core
# busy for most of a test, so two tests at once use both cores; the kernels' own tests still run on every core
# (tests/conftest.py). OpenMP threads wait passively: two workers' kernel tests at once put four threads on two
# cores, where a spinning thread waits on a descheduled sibling (docs/notes/test-suite.md)
test: models
	OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# the tests that need no model file and take under a few seconds each (tests/conftest.py marks them): a minute
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "unit and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

bench-latency: $(STAMP)
	$(VENV)/bin/ridge bench latency --all-peers

bench-throughput: $(STAMP)
	$(VENV)/bin/ridge bench throughput --all-peers

# docs/benchmarks.md's marked tables measured again on this machine (with every peer installed), and rendered
bench-docs: $(STAMP)
	$(VENV)/bin/ridge bench report --run
