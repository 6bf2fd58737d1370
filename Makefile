# The two quick-start commands (README): `make demo` and `make test`. Both set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-strict info test

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
	$(BIN)/h3lab --profile --width 64 --height 64 -p "a blue square moves right, a middle tone" -o outputs/demo.mp4

# Strict on the CPU: every transformer op through a Triton kernel in Triton's interpreter (exact, slow), on a small
# canvas with few passes so it ends within a minute (measured: docs/strict-and-drift.md, "Strict on a CPU").
demo-strict: $(STAMP)
	mkdir -p outputs
	TRITON_INTERPRET=1 $(BIN)/h3lab --profile --mode strict --width 64 --height 64 --frames 22 --steps 3 \
		-p "a blue square moves right, a middle tone" -o outputs/demo-strict.mp4

info: $(STAMP)
	$(BIN)/h3lab --info

# The notebook browser test needs Debian's chromium; browser_setup.sh installs it once (quick when present).
# Two pytest-xdist workers (this project's CI and dev machines have 2 cores), each test module on one worker so its
# module fixtures are built once, the heaviest modules first (tests/module_seconds.json, from
# scripts/module_seconds.py over a --durations=0 log); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	bash scripts/browser_setup.sh $(BIN)/python
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope
