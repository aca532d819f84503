# kvbudget developer targets. Everything runs inside the project's own .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m

.PHONY: install fetch test demo lint peer peer-same-transformers

# The stamp is rebuilt only when pyproject.toml changes, so `make install` is quick on rerun.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,ray]'
	touch $@

# Downloads, verifies and converts the default model once, and every evaluation data artifact
# (idempotent: quick when already fetched).
fetch: install
	$(BIN)/kvbudget fetch model $(MODEL)
	$(BIN)/kvbudget fetch data

test: fetch
	$(BIN)/python -m pytest -q

# The demo runs on the 0.5B model in bf16, where methods separate (kvbudget.demo.DEMO_MODEL).
DEMO_MODEL := qwen2.5-coder-0.5b

demo: fetch
	$(BIN)/kvbudget fetch model $(DEMO_MODEL)
	$(BIN)/python -m kvbudget.demo

lint: install
	$(BIN)/ruff check src tests

# A separate environment with NVIDIA's kvpress for the side-by-side benchmark
# (`kvbudget bench peer`). kvpress 0.5.5 needs transformers < 5.3, so it never shares the main
# .venv; torch is pinned to the same CPU build (any other spec may pull a multi-GB CUDA build).
PEER_VENV := .venv-peer
PEER_REQUIREMENTS := torch==2.13.0 "transformers>=4.56,<5.3" kvpress==0.5.5

peer: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed: Makefile
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PEER_VENV)/bin/python -m pip install --quiet $(PEER_REQUIREMENTS)
	$(PEER_VENV)/bin/python -c "import kvpress, transformers, torch; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__, 'torch', torch.__version__)"
	touch $@

# The same kvpress with the main environment's transformers forced in (pip reports the conflict):
# only `bench peer --methods full --peer-python .venv-peer-same/bin/python` runs there (the
# presses need transformers < 5.3). It separates a transformers-version effect from ours.
SAME_VENV := .venv-peer-same
MAIN_TRANSFORMERS := $(shell grep -o 'transformers==[0-9.]*' pyproject.toml)

peer-same-transformers: $(SAME_VENV)/.installed

$(SAME_VENV)/.installed: Makefile pyproject.toml
	test -x $(SAME_VENV)/bin/python || $(PYTHON) -m venv $(SAME_VENV)
	$(SAME_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SAME_VENV)/bin/python -m pip install --quiet $(PEER_REQUIREMENTS)
	$(SAME_VENV)/bin/python -m pip install --quiet "$(MAIN_TRANSFORMERS)"
	$(SAME_VENV)/bin/python -c "import kvpress, transformers; print('kvpress with transformers', transformers.__version__); assert 'transformers==' + transformers.__version__ == '$(MAIN_TRANSFORMERS)'"
	touch $@
