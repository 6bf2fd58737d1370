"""CUDA graphs for `--mode fast` forwards: the fast policy of the shared mechanism `h3lab.cuda_graph` (capture on a
signature's second call, replay after, outputs cloned, an LRU of graphs; see that module's contract).

Fast's rules on top of it:
- Its own switch, `use_graphs(enabled)` (default on), and `last_path()`: how the last fast forward in this context
  ran ({"cuda_graph": "eager" | "captured" | "replay", ...}).
- Captured up to `MAX_ROWS` packed rows (37,853 = 1344x768x124f and below). Past it the forward runs eager: at
  109,205 rows (1344x768x362f) a 3-block forward is 2.3 s of GPU work, and the graph's memory pool held 22 GiB of
  its activations after the call, enough to run the H200 out of memory beside the next forward.
- `fast.use_emulation()` (the CPU dry runs) is never captured; fast's switches (`fast.graph_key()`: fused producers,
  emulation, FP8 attention) are part of the signature.
- Not strict and promises no bytes; on the H200 a replay's output bytes are compared with the eager fast forward's in
  benchmarks/benchmark_every_length.py (section `table`, `bytes_equal_fast_eager`).
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import torch

from . import cuda_graph, fast

CudaBackend = cuda_graph.CudaBackend
MAX_GRAPHS = cuda_graph.MAX_GRAPHS
_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("h3lab_fast_graphs", default=True)

MAX_ROWS = 65536


def _refuse(args: tuple) -> str:
    if fast.emulated():
        return "fast emulation (CPU dry run)"
    return cuda_graph.refuse_rows(args, MAX_ROWS, "fast_graph.MAX_ROWS")


POLICY = cuda_graph.Policy(mode="fast", enabled=_enabled, switch_name="fast_graph.use_graphs", refuse=_refuse,
                           key=fast.graph_key)


def use_graphs(enabled: bool):
    """Enable or disable CUDA graphs for the enclosed fast forwards (benchmarks compare both)."""
    return fast.switch(_enabled, enabled, "use_graphs")


def last_path() -> dict:
    """How the last fast forward in this context ran: {"cuda_graph": "eager" | "captured" | "replay", ...}."""
    return dict(POLICY.last_path.get())


class GraphCache(cuda_graph.GraphCache):
    """A graph cache of fast forwards (`cuda_graph.GraphCache` with the fast policy)."""

    def __init__(self, backend: Any = None, max_graphs: int = MAX_GRAPHS):
        super().__init__(POLICY, backend, max_graphs)


GRAPHS = GraphCache()


def run(model: torch.nn.Module, args: tuple, body: Callable[..., tuple]) -> tuple:
    """The fast forward of `args` through the process's graph cache (see `h3lab.cuda_graph`)."""
    return GRAPHS.run(model, args, body)
