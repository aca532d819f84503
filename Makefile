# kvbudget developer targets. Everything runs inside the project's own .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m

.PHONY: install fetch test demo lint

# The stamp is rebuilt only when pyproject.toml changes, so `make install` is quick on rerun.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# Downloads, verifies and converts the default model once, and every evaluation data artifact
# (idempotent: quick when already fetched).
fetch: install
	$(BIN)/kvbudget fetch model $(MODEL)
	$(BIN)/kvbudget fetch data

test: fetch
	$(BIN)/python -m pytest -q

demo: fetch
	$(BIN)/python -m kvbudget.demo

lint: install
	$(BIN)/ruff check src tests
