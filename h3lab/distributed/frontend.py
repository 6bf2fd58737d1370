"""The torchrun front end: `torchrun --nproc-per-node N -m h3lab --tp T --cp C [--sp] [--row-parallel S]
[--share-device] ...` (`--share-device`: every rank on one GPU, gloo + CUDA IPC slots; bytes only, see `mesh.py`).

`h3lab.frontends.cli` calls `mesh_request(args)` (None unless a mesh flag is given or WORLD_SIZE > 1) and, with a mesh,
`run_on_mesh(args, mesh, action, session_factory)`:
- every rank builds the mesh (`init_mesh`: under torchrun it starts the process group, NCCL for CUDA devices, gloo
  for `--device cpu`; a refused topology is the same one-line error on every rank) and a control channel;
- rank 0 runs the action (preflight included) as one process would -- one-shot generation, REPL, replay -- with a
  session on the mesh (`Session(mesh=...)`: its transformers parallelized, its specs recording the placement), and
  leads (`follow.lead`): every placed run and every sharded forward is announced; only rank 0 encodes, decodes,
  writes and prints;
- the other ranks follow (`follow.follow`) with their own session, which loads and parallelizes a transformer the
  first time rank 0 runs it; they return when rank 0's action ends (also on error);
- errors: rank 0's action failing, or a follower failing a message, does not end any rank early: after "stop"
  every rank gives its first failure (wall time, one line) to one `all_gather_object` on the control group, and
  every rank raises the earliest one alike (`MeshFailure`, "rank R: " in front when R is not 0), so the CLI prints
  the same line on every rank and exits 2 -- never a peer's teardown ("Connection closed by peer");
- `close_mesh()` then ends the process group `mesh_request` started: every rank meets at a barrier and destroys
  it, so no rank exits with the group's threads still alive (a follower that did aborted at exit:
  "terminate called without an active exception").
The mode defaults to strict on a mesh of more than one rank; another mode is refused there. World size 1
(`h3lab --tp 1`) runs the same code path without a process group.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch.distributed as dist

from ..errors import H3Error, user_message
from .errors import TopologyError
from .follow import Channel, follow, lead
from .mesh import Mesh, init_mesh

MESH_ARGS = ("tp", "cp", "sp", "row_parallel", "share_device")


def mesh_request(args: Any) -> Mesh | None:
    """The mesh the flags (or torchrun's WORLD_SIZE) ask for, built on every rank; None for a one-process run.
    Sets `args.mesh` and, on a mesh of several ranks, `args.mode` to strict when it was not given."""
    asked = any(getattr(args, name, None) not in (None, False) for name in MESH_ARGS)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not asked and world == 1:
        return None
    tp, cp, dp = args.tp or 1, args.cp or 1, getattr(args, "dp", 1) or 1  # dp: `h3lab train --dp`
    if dp * tp * cp != world:
        flags = f"--tp {tp} --cp {cp}" + (f" --dp {dp}" if dp > 1 else "")
        raise TopologyError(f"{flags} needs {dp * tp * cp} rank(s), this launch has {world}: run "
                            f"torchrun --nproc-per-node {dp * tp * cp} -m h3lab {flags} ...")
    if tp * cp > 1:
        if args.mode is None:
            args.mode = "strict"
        elif args.mode != "strict":
            raise TopologyError(f"--mode {args.mode} with --tp {tp} --cp {cp}: a forward on several ranks runs in mode "
                                "strict only")
    mesh = init_mesh(tp=tp, cp=cp, sp=bool(args.sp), device=args.device, row_parallel=args.row_parallel or "auto",
                     share_device=bool(getattr(args, "share_device", False)), dp=dp)
    args.mesh = mesh
    return mesh


class MeshFailure(H3Error):
    """The earliest failure of any rank, raised on every rank alike (module docstring)."""


def run_on_mesh(args: Any, mesh: Mesh, action: Callable[[], int], session_factory: Callable[[], Any]) -> int:
    """Rank 0 runs `action()` and leads; the other ranks follow with `session_factory()`'s transformers. Any rank's
    failure is raised on every rank as the earliest one (`MeshFailure`)."""
    channel = Channel(mesh)
    rc, mine, error = 0, None, None
    sessions: list = []

    def models(key: str):
        if not sessions:
            sessions.append(session_factory())
        return sessions[0].transformer(key)

    try:
        if mesh.rank == 0:
            with lead(channel):
                rc = action()
        else:
            mine = follow(channel, models)
    except BaseException as exc:  # noqa: BLE001 - every rank must reach the exchange below
        error = exc
        if isinstance(exc, Exception):
            mine = (time.time(), user_message(exc))
    first = _first_failure(channel, mesh.rank, mine)
    if error is not None and (not isinstance(error, Exception) or os.environ.get("H3LAB_DEBUG")):
        raise error  # Ctrl-C stays Ctrl-C; H3LAB_DEBUG shows this rank's own traceback
    if first is not None:
        raise MeshFailure(first) from error
    return rc


def _first_failure(channel: Channel, rank: int, mine: tuple[float, str] | None) -> str | None:
    """The earliest failure of all ranks (every rank calls this once, after "stop"), as one line."""
    record = (mine[0], rank, mine[1]) if mine else None
    records: list = [record]
    if channel.group is not None:
        gathered: list = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(gathered, record, group=channel.group)
            records = gathered
        except Exception:  # noqa: BLE001 - a peer is gone: report what this rank knows
            pass
    failures = sorted(r for r in records if r is not None)
    if not failures:
        return None
    _, r, message = failures[0]
    return message if r == 0 else f"rank {r}: {message}"


def close_mesh() -> None:
    """End the process group the front end started (`mesh_request`), after every rank has finished: a barrier, then
    `destroy_process_group`. Nothing without a group (world size 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()

