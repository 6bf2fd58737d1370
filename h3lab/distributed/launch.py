"""Local gloo ranks: `spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` CPU processes
joined by a gloo process group and returns each rank's result, in rank order. What the ablation matrix's
distributed rows and the tests use (a GPU run is launched with torchrun instead).

- Processes start from a forkserver that has imported torch, triton, h3kernels and h3lab's model, run-spec,
  drift and distributed modules once, so a run costs about a second of start-up instead of a fresh interpreter per
  rank. The environment is inherited (`TRITON_INTERPRET=1` for strict kernels on the CPU). `fn` must be a
  module-level function (it is pickled by reference); its arguments are pickled (tensors through shared memory).
- Rendezvous through a file in a fresh temporary directory (no ports); gloo's timeout is 60 s, so a rank stuck in a
  collective fails the run rather than hanging it.
- `fn` returns a dict of tensors and strings (or None). Tensors come back through one safetensors file per rank,
  strings through its metadata.
- A rank that raises fails the run (the other ranks are terminated) with `RankFailed`: one line naming the rank and
  its error's last line, chained to a `RankTraceback` holding that rank's whole traceback. The rank named is the
  cause, not the first one torch noticed: each failing rank records when and where it failed (joining the group or
  in `fn`) before it leaves the group, and the earliest failure in `fn` wins (else the earliest in the rendezvous),
  so a peer that then fails in a collective for losing it is never reported instead; and every rank has finished
  joining the group (a barrier) before any runs `fn`, so none can leave while a peer still connects. A rank that dies
  without raising (killed by a signal, `os._exit`) is named as the cause even when a peer's collective failed first
  for losing it: "rank 1 died mid-run (killed by SIGKILL); every other rank was stopped". Results are written per
  rank as a temporary file renamed into place, in a temporary directory removed with the run: nothing half-written
  is ever read or left. A run past `timeout`
  seconds terminates the processes it started and raises `TimeoutError`.
- Each rank runs with one torch thread.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .errors import DistributedError

PRELOAD = ["torch", "triton", "h3kernels", "h3kernels.gemm", "h3kernels.attention", "h3lab.model", "h3lab.run",
           "h3lab.research.drift", "h3lab.distributed"]
_started = False


def _ensure_forkserver() -> None:
    global _started
    if not _started:
        multiprocessing.set_forkserver_preload(PRELOAD)
        _started = True


def _child(rank: int, fn: Callable, world_size: int, rendezvous: str, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    stage = "rendezvous"
    try:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=60))
        # gloo's connect can return on one rank while a peer is still connecting to it: a rank that then finished
        # (or failed) at once and left would break the peer's connect. Everyone is connected past this barrier.
        dist.barrier()
        stage = "work"
        result = fn(rank, world_size, *args) or {}
    except BaseException as err:
        _note_failure(out_dir, rank, stage, err)  # before the group goes: a peer fails only after this
        with contextlib.suppress(Exception):  # a peer that already left must not mask this rank's own error
            dist.destroy_process_group()
        raise
    dist.destroy_process_group()
    tensors = {k: v.detach().contiguous().clone() for k, v in result.items() if isinstance(v, torch.Tensor)}
    strings = {k: v for k, v in result.items() if isinstance(v, str)}
    if len(tensors) + len(strings) != len(result):
        raise TypeError(f"rank {rank}: results must be tensors or strings, got {sorted(result)}")
    tmp = os.path.join(out_dir, f"rank{rank}.tmp")
    save_file(tensors, tmp, metadata=strings or None)  # an empty metadata dict writes an unreadable header
    os.replace(tmp, os.path.join(out_dir, f"rank{rank}.safetensors"))


def _note_failure(out_dir: str, rank: int, stage: str, err: BaseException) -> None:
    """Write `fail<rank>.json` (atomically): when this rank failed (CLOCK_MONOTONIC, shared by the machine's
    processes), in which stage ("rendezvous": joining the group; "work": `fn`), its error's last line and traceback."""
    lines = [line for line in traceback.format_exception_only(type(err), err) if line.strip()]
    record = {"ns": time.monotonic_ns(), "stage": stage, "line": lines[-1].strip() if lines else repr(err),
              "traceback": traceback.format_exc()}
    tmp = os.path.join(out_dir, f"fail{rank}.tmp")
    with contextlib.suppress(OSError):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(out_dir, f"fail{rank}.json"))


def _root_failure(out_dir: str, world_size: int) -> tuple[int, dict] | None:
    """The rank whose failure came first among those that failed in `fn`, else among those that failed joining the
    group: a peer that loses it fails later (in a collective, or in gloo's connect when it left before the group was
    up), so the earliest own failure is the cause. None when no rank left a record."""
    records = []
    for rank in range(world_size):
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(out_dir, f"fail{rank}.json"), encoding="utf-8") as f:
                records.append((rank, json.load(f)))
    if not records:
        return None
    return min(records, key=lambda item: (item[1]["stage"] != "work", item[1]["ns"], item[0]))


class RankTraceback(Exception):
    """A failed rank's whole traceback (the cause `RankFailed` is chained to)."""


class RankFailed(DistributedError):
    """A spawned rank raised; the message is its error's last line, the cause its traceback."""


def _joined(ctx, out_dir: str) -> bool:
    try:
        return ctx.join(timeout=0.5)
    except (torch_mp.ProcessRaisedException, torch_mp.ProcessExitedException) as exc:
        dead = _died(ctx)
        if dead:  # a rank that died (a signal, os._exit) is the cause; peers that raised only lost it
            raise RankFailed(f"rank {dead[0][0]} died mid-run ({dead[0][1]}); every other rank was stopped") from exc
        root = _root_failure(out_dir, len(ctx.processes))
        if root is not None:  # not necessarily the rank torch saw first: the one whose failure came first
            rank, record = root
            raise RankFailed(f"rank {rank} failed: {record['line']}") from RankTraceback(record["traceback"])
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise RankFailed(f"rank {exc.error_index} failed: {lines[-1].strip() if lines else exc}") from exc


def _died(ctx) -> list[tuple[int, str]]:
    """(rank, how) of ranks that ended without raising (no error file) and were not stopped by the SIGTERM that
    torch sends the survivors of a failure, in rank order."""
    out = []
    for rank, process in enumerate(ctx.processes):
        code = process.exitcode
        if code in (None, 0, -signal.SIGTERM) or os.access(ctx.error_files[rank], os.R_OK):
            continue
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        out.append((rank, how))
    return out


def spawn(fn: Callable, world_size: int, *args, timeout: float = 300.0) -> list[dict]:
    """Run `fn(rank, world_size, *args)` on `world_size` local gloo ranks; each rank's returned dict, rank order."""
    _ensure_forkserver()
    with tempfile.TemporaryDirectory(prefix="h3lab-dist-") as tmp:
        ctx = torch_mp.start_processes(
            _child, args=(fn, world_size, os.path.join(tmp, "rendezvous"), tmp, args), nprocs=world_size,
            join=False, start_method="forkserver",
        )
        deadline = time.monotonic() + timeout
        while not _joined(ctx, tmp):
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    if process.is_alive():
                        process.terminate()
                raise TimeoutError(f"spawn({fn.__name__}, {world_size}): ranks still running after {timeout} s")
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.safetensors")
            out: dict = dict(load_file(path))
            with safe_open(path, "pt") as f:
                out.update(f.metadata() or {})
            results.append(out)
        return results
