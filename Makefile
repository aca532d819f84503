# kvbudget developer targets. Everything runs inside the project's own .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m

.PHONY: install fetch test demo lint peer

# The stamp is rebuilt only when pyproject.toml changes, so `make install` is quick on rerun.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,eval,ray,serve]'
	touch $@

# Downloads, verifies and converts the default model once, and every evaluation data artifact
# (idempotent: quick when already fetched).
fetch: install
	$(BIN)/kvbudget fetch model $(MODEL)
	$(BIN)/kvbudget fetch data

# The suite includes the kvpress oracle tests (kvbudget's presses against kvpress's own), so the
# test set-up builds .venv-peer too: without it those tests would skip and check nothing.
test: fetch peer
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
