"""Shared test setup: strict kernels run on CPU through Triton's interpreter, so the variable is set before any
test module imports triton. `tiny_snapshot` is the seeded tiny snapshot every test that needs weights uses. Child processes get
`OMP_NUM_THREADS=1` (unless set), as this process runs torch on one thread. Test modules are collected heaviest first
(tests/module_seconds.json, written by scripts/module_seconds.py) so the two xdist workers end together."""

import json
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every process a test starts (notebook kernels, CLI and torchrun subprocesses, the forkserver) inherits one OpenMP
# thread: on the 2-core CI machine two busy xdist workers leave no core for a second thread, and a spinning OpenMP
# team made a tiny bf16 linear ~6x and a float32 one ~800x slower (1.5 -> 9.4 ms, 0.05 -> 41 ms, measured).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models: one thread is faster than two (thread start-up dominates) and keeps timings stable.
torch.set_num_threads(1)

# Gloo ranks (`h3lab.distributed.launch.spawn`) fork from one forkserver per test process: it also preloads what
# ranks otherwise import lazily, each on its own: torch._dynamo (+ sympy), which building and parallelizing a model
# pulls in (1.7 s -> 0.07 s a rank, measured), and peft (+ transformers), which every LoRA rank imports on its first
# `add_lora` (4.5 s -> 0.1 s a rank). h3lab itself stays peft-free.
from h3lab.distributed import launch  # noqa: E402

launch.PRELOAD.extend(["torch._dynamo", "peft"])


@pytest.fixture(scope="session")
def tiny_snapshot(tmp_path_factory):
    """Path of a freshly generated tiny snapshot (seed 0), shared by the whole test session."""
    from h3lab.checkpoint.tiny import make_tiny_snapshot

    return make_tiny_snapshot(tmp_path_factory.mktemp("snapshot") / "h3-tiny", seed=0)


@pytest.fixture(scope="session")
def deep_snapshot(tiny_snapshot, tmp_path_factory):
    """The tiny snapshot with a 6-block `transformer/` (the same widths, its own seeded weights): layer thinning can
    drop a block and token reduction (from block 4 on) has blocks to reduce."""
    import shutil

    from h3lab.checkpoint import tiny
    from h3lab.config import H3Config

    root = tmp_path_factory.mktemp("deep") / "h3-tiny-deep"
    shutil.copytree(tiny_snapshot, root)
    cfg = json.loads((root / "transformer" / "config.json").read_text())
    shutil.rmtree(root / "transformer")
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    tiny._save_transformer(root / "transformer", 0, "transformer", H3Config.from_dict({**cfg, "num_layers": 6}))
    return root


@pytest.fixture
def benchmark_main(tmp_path, monkeypatch):
    """run(script_stem, *args) -> the JSON a benchmarks/ script wrote: imports the script from benchmarks/ (as the
    scripts import `_common`) and calls its `main([*args, "--out", tmp_path / "<stem>.json"])`."""
    import importlib

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))

    def run(stem: str, *args: str) -> dict:
        monkeypatch.setattr("sys.argv", [f"{stem}.py"])
        out = tmp_path / f"{stem}.json"
        importlib.import_module(stem).main([*args, "--out", str(out)])
        return json.loads(out.read_text())

    return run


_MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")  # scripts/module_seconds.py writes it


def pytest_collection_modifyitems(session, config, items):
    """The heaviest test modules first, the order within a module kept: `make test` runs `--dist loadscope` (each
    module on one xdist worker, handed out in collection order), so longest-first leaves no worker alone with a long
    module at the end. Weights are the seconds of tests/module_seconds.json; a module not in it counts as light."""
    try:
        weights = json.loads(_MODULE_SECONDS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    items.sort(key=lambda item: -float(weights.get(item.nodeid.split("::", 1)[0], 0.0)))  # stable: ties keep order
