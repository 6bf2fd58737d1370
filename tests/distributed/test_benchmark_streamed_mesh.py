"""The GPU streamed-mesh benchmark's own checks (`benchmarks/benchmark_streamed_mesh.py`; its run is the GPU form of
`test_streamed_mesh.py`): topology names and launch sizes refused in one line before a process group starts, the
digest sensitive to every byte, dtype and shape, and the streamer check that refuses a placement CUDA cannot stream
(host buffers not pinned, a unit missing)."""

import re
from pathlib import Path

import pytest
import torch
from dist_helpers import build_model

from h3lab.components import streaming


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import benchmark_streamed_mesh

    return benchmark_streamed_mesh


def test_topology_names_and_launch_sizes(bench):
    assert bench._topology("tp2", 2) == (2, False) and bench._topology("tp2+sp", 4) == (2, True)
    assert bench._topology("tp4+sp", 4) == (4, True)
    assert bench.default_topologies(2) == "tp2,tp2+sp" and bench.default_topologies(4) == "tp2,tp2+sp,tp4,tp4+sp"
    for bad in ("cp2", "tp2xcp2", "tp3", "tp2+cp", "tp2+sp+sp", "+sp"):
        with pytest.raises(SystemExit, match=rf"^--topologies '{re.escape(bad)}': must be one of tp2, tp4, each "
                                             r"optionally \+sp \(streaming refuses cp > 1\)$"):
            bench._topology(bad, 4)
    with pytest.raises(SystemExit, match=r"^--topologies 'tp4\+sp': tp 4 does not divide the launch's 2 ranks "
                                         r"\(launch a multiple of 4 with --nproc-per-node\)$"):
        bench._topology("tp4+sp", 2)


def test_digest_sees_every_byte_the_dtype_and_the_shape(bench):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    t = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    assert bench.digest(t) == bench.digest(t.clone())
    flipped = t.clone()
    flipped.view(torch.int16)[1, 2] ^= 1  # one bit of one element
    assert bench.digest(flipped) != bench.digest(t)
    assert bench.digest(t.reshape(5, 3)) != bench.digest(t)
    assert bench.digest(t.view(torch.int16)) != bench.digest(t)


def test_streamer_check_refuses_what_cuda_cannot_stream(bench):
    model = build_model(layers=1)
    streamer = streaming.stream_blocks(model, torch.device("cpu"))
    units = [u.name for u in streamer.streamed]
    assert bench.check_streamer(streamer, torch.device("cpu"), units, "rank 0 tp2") is False  # plain memory on CPU
    with pytest.raises(RuntimeError, match=r"^rank 1 tp2\+sp: the streamed units' host buffers are not pinned") as exc:
        bench.check_streamer(streamer, torch.device("cuda", 0), units, "rank 1 tp2+sp")
    assert "\n" not in str(exc.value)
    with pytest.raises(RuntimeError, match=r"^rank 0 tp2: streamed units \[.*\], expected every block unit"):
        bench.check_streamer(streamer, torch.device("cpu"), units + ["transformer_blocks.1"], "rank 0 tp2")
    with pytest.raises(RuntimeError, match=r"^rank 0 tp2: ExecutionPlan\(residency='streamed', mesh=\.\.\.\)\.place "
                                           r"left the model unstreamed$"):
        bench.check_streamer(None, torch.device("cpu"), units, "rank 0 tp2")
