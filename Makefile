# The two quick-start commands (README): `make demo` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo info test

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned to the CPU wheel: an unpinned request may pull a multi-GB CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Main job on the embedded tiny snapshot: a generation with sound, its sealed trajectory and phase timings.
demo: $(STAMP)
	mkdir -p outputs
	$(BIN)/h3lab --profile -p "A red fox walks through fresh snow." -o outputs/fox.mp4

info: $(STAMP)
	$(BIN)/h3lab --info

# The notebook browser test needs Debian's chromium; browser_setup.sh installs it once (quick when present).
test: $(STAMP)
	bash scripts/browser_setup.sh $(BIN)/python
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q
