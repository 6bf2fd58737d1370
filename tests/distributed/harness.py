"""Multi-process test harness: `run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in
`world_size` CPU processes joined by a gloo process group, and returns each rank's result.

- Processes start from a forkserver that has imported torch, triton and h3kernels once, so a run costs well under a
  second of start-up instead of a fresh interpreter per rank; `TRITON_INTERPRET=1` (set by tests/conftest.py) is
  inherited. `fn` must be a module-level function (it is pickled by reference).
- Rendezvous through a file in a fresh temporary directory (no ports); gloo's timeout is 60 s, so a rank stuck in a
  collective fails the run rather than the whole suite.
- `fn` returns a dict of tensors and strings (or None). Tensors come back through one safetensors file per rank,
  strings through its metadata; the list is in rank order.
- A rank that raises fails the run with its traceback (torch.multiprocessing terminates the other ranks); a run past
  `timeout` seconds terminates the processes it started and raises TimeoutError.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

_PRELOAD = ["torch", "triton", "h3kernels", "h3kernels.gemm", "h3kernels.attention", "h3lab.distributed"]
_started = False


def _ensure_forkserver() -> None:
    global _started
    if not _started:
        multiprocessing.set_forkserver_preload(_PRELOAD)
        _started = True


def _child(rank: int, fn, world_size: int, rendezvous: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args) or {}
    finally:
        dist.destroy_process_group()
    tensors = {k: v.detach().contiguous().clone() for k, v in result.items() if isinstance(v, torch.Tensor)}
    strings = {k: v for k, v in result.items() if isinstance(v, str)}
    if len(tensors) + len(strings) != len(result):
        raise TypeError(f"rank {rank}: results must be tensors or strings, got {sorted(result)}")
    tmp = os.path.join(out_dir, f"rank{rank}.tmp")
    save_file(tensors, tmp, metadata=strings)
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.safetensors"))


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list[dict]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; each rank's returned dict, in rank order."""
    _ensure_forkserver()
    with tempfile.TemporaryDirectory(prefix="h3lab-dist-") as tmp:
        ctx = torch_mp.start_processes(
            _child, args=(fn, world_size, os.path.join(tmp, "rendezvous"), tmp, args), nprocs=world_size,
            join=False, start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    if process.is_alive():
                        process.terminate()
                raise TimeoutError(f"run_ranks({fn.__name__}, {world_size}): ranks still running after {timeout} s")
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.safetensors")
            out: dict = dict(load_file(path))
            with safe_open(path, "pt") as f:
                out.update(f.metadata() or {})
            results.append(out)
        return results
