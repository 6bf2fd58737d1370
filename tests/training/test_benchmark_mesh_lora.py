"""The GPU mesh-LoRA benchmark's topology names (its GPU run and CPU dry run: `benchmarks/benchmark_mesh_lora.py`):
each `TOPOLOGIES` key alone or with `+sp`, anything else refused in one line before a process group starts."""

import re
from pathlib import Path

import pytest


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import benchmark_mesh_lora

    return benchmark_mesh_lora


def test_topology_names_with_and_without_sp(bench):
    assert bench._topology("tp2") == (2, 1, False) and bench._topology("cp2") == (1, 2, False)
    assert bench._topology("tp2+sp") == (2, 1, True) and bench._topology("tp2xcp2+sp") == (2, 2, True)
    assert bench._topology("tp4+sp") == (4, 1, True)
    for bad in ("tp3", "tp2+cp", "tp2+sp+sp", "+sp"):
        with pytest.raises(SystemExit, match=rf"^--topologies '{re.escape(bad)}': must be one of cp2, tp2, tp2xcp2, cp4, tp4, "
                                             r"each optionally \+sp$"):
            bench._topology(bad)
