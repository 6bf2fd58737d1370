"""Multi-process test harness: `run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in
`world_size` CPU processes joined by a gloo process group and returns each rank's result (rank order). It is
`h3lab.distributed.launch.spawn` (forkserver with torch, triton, h3kernels and h3lab preloaded, file rendezvous,
results back through safetensors, a timeout), which the ablation matrix's distributed rows use too;
`TRITON_INTERPRET=1` (set by tests/conftest.py) is inherited. `fn` must be a module-level function."""

from __future__ import annotations

from h3lab.distributed.launch import spawn


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list[dict]:
    return spawn(fn, world_size, *args, timeout=timeout)
