"""CUDA graphs for strict forwards: the strict policy of the shared mechanism `h3lab.cuda_graph` (see its contract).

Why: a strict forward is ~2,000 Triton launches (50 blocks); at 2,066 rows the host's launch path, not the GPU, set
its time (1.064x Diffusers on the H200 without graphs). A replayed graph launches the same kernels on the same buffers
without the host.

Switch and default: on by default for strict forwards on CUDA up to `MAX_ROWS` packed rows (no grad, no hooks,
overrides or placement, outside `torch.inference_mode()`); `use_graphs(False)` turns them off for the enclosed forwards (the eager strict forward, as
before; benchmarks compare both). On the CPU nothing changes: the forward runs eager (Triton's interpreter) and its
trace says why (`graph = {"cuda_graph": "eager", "reason": "inputs not on a CUDA device"}`).

The strict contract holds through a graph:
- The bytes: a replay runs the kernels the eager forward ran (same machine code, same tiles, same launch order,
  fixed reduction orders) on buffers with the caller's shapes, dtypes and strides, so its outputs equal the eager
  strict forward's byte for byte; benchmarks/benchmark_strict_graph.py asserts it on the H200 at 2,066 and 7,272
  rows. The first call of a signature is the eager forward itself.
- Host-side decisions are resolved before capture, never during it: the input checks (`check_inputs`,
  `check_key_order`) run eagerly on every call's own arguments; the strict kernels' index validation and the index
  maps derived from it (packing's source map, modulate's range check, attention's key-order permutation check) are
  built by the first (eager) call on the graph's own static layout tensors and only looked up during the capture
  (`runtime.frozen_index_caches()`: a miss raises instead of synchronising); the AdaLN row index is one
  `runtime.derived` tensor per layout. Every integer argument is keyed by its bytes (`cuda_graph.signature`), so a
  graph only ever serves the layout whose metadata it baked in.
- Fails closed: an ineligible call runs eager and says why; a capture that fails leaves its signature eager with
  the reason in the trace (the benchmark fails its graph row on any "eager"). Strict refusals (`StrictError`) are
  raised by the first, eager call of a signature, exactly as without graphs.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import torch

from . import cuda_graph
from .fast import switch  # the one boolean context switch helper (fast's switches use it too)

MAX_GRAPHS = cuda_graph.MAX_GRAPHS
# Packed rows up to which strict forwards are captured: 12,369 (1344x768x39f) and below, where the host's launch path
# is a visible part of a forward. Past it a forward is seconds of GPU work (the ~10 ms a graph saves is noise) and a
# graph's private memory pool -- a forward's peak activations -- would stay held after the call, next to the VAE
# decode that needs that memory.
MAX_ROWS = 16384
_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("h3lab_strict_graphs", default=True)


def _refuse(args: tuple) -> str:
    return cuda_graph.refuse_rows(args, MAX_ROWS, "strict_graph.MAX_ROWS")


POLICY = cuda_graph.Policy(mode="strict", enabled=_enabled, switch_name="strict_graph.use_graphs", refuse=_refuse)


def use_graphs(enabled: bool):
    """Enable (default) or disable CUDA graphs for the enclosed strict forwards."""
    return switch(_enabled, enabled, "use_graphs")


def last_path() -> dict:
    """How the last strict forward in this context ran: {"cuda_graph": "eager" | "captured" | "replay", ...}."""
    return dict(POLICY.last_path.get())


class GraphCache(cuda_graph.GraphCache):
    """A graph cache of strict forwards (`cuda_graph.GraphCache` with the strict policy)."""

    def __init__(self, backend: Any = None, max_graphs: int = MAX_GRAPHS):
        super().__init__(POLICY, backend, max_graphs)


GRAPHS = GraphCache()


def run(model: torch.nn.Module, args: tuple, body: Callable[..., tuple]) -> tuple:
    """The strict forward of `args` through the process's strict graph cache (see `h3lab.cuda_graph`)."""
    return GRAPHS.run(model, args, body)
