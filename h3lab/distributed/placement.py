"""`parallelize(model, mesh)`: the TP / CP (Ulysses) / SP plan of `plan.py` applied to a built `H3Transformer` from
outside. The model's code stays single-device; its forward keeps its signature and returns the full video / audio
velocities on every rank, byte-equal (strict) to one process for the same logical rows.

What `parallelize` does (in place, once per model):
- TP (tp > 1): `plan.shard_parameters_` with the mesh's row-parallel strategy (a model that holds only its shard
  already, `shard_load.load_sharded_transformer` / `random_sharded_transformer`, is checked and kept as it is). q/k/v
  and `ff.net.0.proj` are column-parallel (whole heads; matching `[value_r; gate_r]`), their outputs stay sharded
  through the per-head Q/K norm, RoPE, attention and SwiGLU (the model counts heads from the width). `attn.to_out.0`
  / `ff.net.2` are served by the runtime's placement layer as `collectives.row_parallel_tree` (each rank's tree
  chunks -> float32 partials -> all_gather -> the declared tree, or the n_split form: never an all-reduce).
  `adaln_proj.linear` (6 x 3 table blocks) and `norm_out.linear` ([shift | scale]) are sharded by output channel and
  gathered back by a forward hook (`gather_columns(groups=18 | 2)`), so the table the blocks index is the one-process
  table.
- CP (cp > 1, `plan.CP_PLAN`): the packed rows are cut into `RowShards` at the input of `transformer_blocks.0`
  (after `pack`; the input projections, the refiner, the timestep MLP and the RoPE table build run replicated), the
  per-row metadata with them, by the same shards: each block's `adaln_indices` (block pre-hook), the RoPE tables
  (at `rope`'s output) and `norm_out`'s `timestep_indices`. Document metadata (`key_order`, the stream indices, the
  timestep table) stays global. Block attention is served as `ulysses_attention` around the mode's attention op
  (overrides included): all S rows of the rank's H / (tp*cp) heads, keys in canonical order. `proj_out` /
  `audio_proj_out` gather their rows back (rank order = packed order) before the model selects the video / audio
  rows with the global indices. Uneven lengths: shards of sizes like `tensor_split` (19 over 3: 7, 6, 6), never a
  padding row in any arithmetic, so a row's bytes do not depend on S mod cp.
- SP (sp, needs tp > 1): inside a CP shard, the residual stream, the AdaLN pre-norms / modulations and the gated
  residuals run on the rank's SP rows (`RowShards` over the TP group); a pre-hook on `attn` and on `ff` gathers the
  rows once for the column-parallel projections; the row-parallel layers return SP rows (`out_rows`: all_to_all).
- Every forward (root hooks on the model): the rank's `Frame` (its rows) is made current, the runtime placement
  (`runtime.use_placement`) and the hook view (`hooks.use_view`) are entered, a `CollectiveLog` is begun, and one
  `all_gather_object` over the world makes every rank agree before any work -- same mode, overrides, hooked points,
  input bytes (digests) and row ownership -- or every rank raises the same one-line error. The trace gets
  `placement` (topology, rank, the rows and heads this rank holds) and `collectives` (each collective, its
  algorithm, fallback state: strict collectives never fall back).

Strict rules: a forward on more than one rank runs in mode strict only (the row-parallel layers exist only as the
declared tree; there is no production multi-rank path). With grad it runs on CP meshes only (tp 1, no SP; `autograd.py`:
the block-0 cut, the head gathers and the Ulysses exchanges carry their declared backward, and block projections with
a trainable weight compute it over the gathered rows); TP / SP forwards are forward-only. A rank whose rows are not
the plan's (`OwnershipError`) makes the run non-comparable: every rank refuses it before computing.

Hooks: a hook registered on the model sees, at every point it selects, the tensor one process has there (the view
gathers rows over SP then CP, columns or heads over TP); a replacement is cut back to each rank's shard and must be
made on every rank alike (checked). Reshaping hooks are refused on a sharded forward.

`Faults` exist only for the ablation matrix's distributed probes (A4 rows given to the wrong rank, H17 metadata not
co-sharded, A7 a ring-attention KV-block plan with its merge order): never for a run.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from h3kernels import gemm

from .. import runtime
from ..hashing import model_fingerprint, tensor_digest
from ..model.hooks import HookPoint, use_view
from . import autograd as mesh_autograd
from .collectives import (
    CollectiveLog,
    begin_log,
    gather_columns,
    gather_rows,
    row_parallel_tree,
    scatter_rows,
    ulysses_attention,
)
from .errors import DistributedError, TopologyError
from .mesh import Mesh, Topology, check_config
from .plan import TP_PLAN, _full_shape, column_groups, shard_parameters_, split_rule
from .shards import RowShards, split_grouped


class OwnershipError(DistributedError):
    """A rank holds rows (or heads) that the topology's plan gives to another rank: the run is not comparable."""


@dataclass(frozen=True)
class Faults:
    """Deliberate plan faults for the ablation matrix's distributed probes (never for a run).
    rotate_rows (A4): CP rank i holds the rows (and their metadata) of shard (i + 1) % cp.
    local_metadata (H17): the hidden rows are sharded, the per-row metadata is not: local row j reads global row j.
    ring_merge (A7): block attention as a ring plan -- the keys in 2 * cp blocks (each CP shard halved), an online
      softmax over them with the running output rounded to the activation dtype after every block -- merged in
      "canonical" block order on every rank, or in "rank" order (each rank starts from its own shard)."""

    rotate_rows: bool = False
    local_metadata: bool = False
    ring_merge: str = ""

    def __post_init__(self) -> None:
        if self.ring_merge not in ("", "canonical", "rank"):
            raise DistributedError(f"ring_merge={self.ring_merge!r}: must be '', 'canonical' or 'rank'")

    def to_dict(self) -> dict:
        return {k: v for k, v in (("rotate_rows", self.rotate_rows), ("local_metadata", self.local_metadata),
                                  ("ring_merge", self.ring_merge)) if v}


@dataclass(frozen=True)
class Frame:
    """The rows of one forward on this rank. `cp_rows` cuts the S packed rows over the CP group, `sp_rows` (SP only)
    this CP shard over the TP group. [cp_lo, cp_hi) / [lo, hi): the packed rows this rank holds at the CP level /
    in its residual stream (SP level; equal without SP). meta_*: the rows its per-row metadata is cut to (the same
    but under the H17 fault)."""

    seq_len: int
    cp_rows: RowShards
    cp_part: int
    sp_rows: RowShards | None
    sp_part: int
    cp_lo: int
    cp_hi: int
    lo: int
    hi: int
    meta_cp: tuple[int, int]
    meta_sp: tuple[int, int]

    def to_dict(self) -> dict:
        out = {"seq_len": self.seq_len, "cp_rows": [self.cp_lo, self.cp_hi], "rows": [self.lo, self.hi],
               "cp_shards": list(self.cp_rows.sizes)}
        if self.sp_rows is not None:
            out["sp_shards"] = list(self.sp_rows.sizes)
        return out


_frame: contextvars.ContextVar[Frame | None] = contextvars.ContextVar("h3lab_placement_frame", default=None)
# model -> weakref to its Placement; the model holds the Placement (`_h3lab_placement`), so the pair is one cycle
# the garbage collector frees (a strong value here would keep every parallelized model and its weights alive)
_PLACEMENTS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_ANNOUNCERS: list[Callable[["Placement", dict], None]] = []  # lead mode (follow.py): tell the other ranks

# Hook points by layout: which rows a point's tensor holds on a rank ("sp": its residual-stream rows, "cp": its CP
# shard, absent: all rows) and which columns ((groups,) on the last axis, "heads" on axis 2; absent: all).
_SP_POINTS = {"norm1", "modulate1", "o_proj", "residual1", "norm2", "modulate2", "ffn_down", "residual2"}
_CP_POINTS = {"q", "k", "v", "q_norm", "k_norm", "q_rope", "k_rope", "attention", "ffn_up", "swiglu"}
_COLUMNS = {"q": 1, "k": 1, "v": 1, "ffn_up": 2, "swiglu": 1, "q_norm": "heads", "k_norm": "heads",
            "q_rope": "heads", "k_rope": "heads", "attention": "heads"}


def point_layout(name: str) -> tuple[str, Any]:
    """(rows, columns) of hook point `name` on a rank: rows "sp" | "cp" | "all"; columns None | groups | "heads"."""
    parts = name.split(".")
    if parts[0] in ("blocks", "refiner") and len(parts) == 3:
        suffix = parts[2]
        rows = "all"
        if parts[0] == "blocks":
            rows = "sp" if suffix in _SP_POINTS else "cp" if suffix in _CP_POINTS else "all"
        return rows, _COLUMNS.get(suffix)
    if name in ("final_norm", "final_modulate"):
        return "sp", None
    return "all", None


def row_owner(placement: Mapping[str, Any], point: str, packed_row: int, seq_len: int) -> dict:
    """Who holds packed row `packed_row` of `seq_len` at hook point `point` under a `RunSpec.placement` value: the
    global rank(s), the CP rank, the TP rank (SP points; else every TP rank of the CP group holds the row, its
    columns or heads split), the local row there, and a `text` for reports."""
    tp, cp, sp = int(placement.get("tp", 1)), int(placement.get("cp", 1)), bool(placement.get("sp", False))
    cp_rows = RowShards(seq_len, cp, "cp")
    i, local = cp_rows.owner(packed_row)
    rows, _ = point_layout(point)
    if rows == "all":
        where = "computed on every rank at this point"
        return {"ranks": list(range(tp * cp)), "cp": i, "tp": None, "local_row": local,
                "text": f"(in the block stack owned by cp rank {i}, local row {local}; {where})"}
    if sp and rows == "sp":
        j, local = RowShards(cp_rows.sizes[i], tp, "tp").owner(local)
        rank = i * tp + j
        return {"ranks": [rank], "cp": i, "tp": j, "local_row": local,
                "text": f"(owned by rank {rank}: cp {i}, tp {j}, local row {local})"}
    ranks = [i * tp + j for j in range(tp)]
    who = f"rank {ranks[0]}" if tp == 1 else f"ranks {ranks} (its columns split over tp)"
    return {"ranks": ranks, "cp": i, "tp": None, "local_row": local,
            "text": f"(owned by {who}: cp {i}, local row {local})"}


def placement_of(model: nn.Module) -> "Placement | None":
    """The `Placement` `parallelize` applied to `model` (None for a one-process model)."""
    ref = _PLACEMENTS.get(model)
    return ref() if ref is not None else None


def add_announcer(fn: Callable[["Placement", dict], None]) -> Callable[[], None]:
    """Lead mode (`follow.lead`): `fn(placement, arguments)` before every sharded forward on this rank; returns the
    function that removes it."""
    _ANNOUNCERS.append(fn)
    return lambda: _ANNOUNCERS.remove(fn)


# ====================================================================================================== placement
class Placement:
    """A model's placement on one rank (see the module docstring). Build with `parallelize`."""

    def __init__(self, model: nn.Module, mesh: Mesh, name: str, faults: Faults, split: list[str]):
        self.model, self.mesh, self.name, self.faults, self.split = model, mesh, name, faults, split
        t = mesh.topology
        self.tp, self.cp, self.sp = t.tp, t.cp, t.sp
        self.world = t.world_size
        heads = model.config.num_attention_heads // t.tp
        self.heads = (mesh.local_rank("tp") * heads, (mesh.local_rank("tp") + 1) * heads)
        self._signature = inspect.signature(type(model).forward)
        self._stack: contextlib.ExitStack | None = None
        self._log: CollectiveLog | None = None
        self._global_shapes: dict[str, torch.Size] = {}
        self._trace_before: runtime.Trace | None = None
        self.handles: list = []

    @property
    def topology(self) -> Topology:
        return self.mesh.topology

    def spec_value(self) -> dict:
        """The `RunSpec.placement` value of this topology."""
        t = self.topology
        return {"tp": t.tp, "cp": t.cp, "sp": t.sp, "row_parallel": t.row_parallel}

    def describe(self) -> dict:
        """What the trace records: topology, rank, device, backend, the rows and heads this rank holds."""
        out = {"name": self.name, **self.mesh.to_dict(), "heads": list(self.heads),
               "agreement": "all_gather_object over the world: mode, overrides, hooked points, input digests, "
                            "row ownership"}
        frame = _frame.get()
        if frame is not None:
            out["rows"] = frame.to_dict()
        if self.faults.to_dict():
            out["faults"] = self.faults.to_dict()
        return out

    # ----------------------------------------------------------------------------------------------- forward
    def _pre_forward(self, module, args, kwargs):
        arguments = self._signature.bind(module, *args, **kwargs).arguments
        stack = contextlib.ExitStack()
        try:
            frame, problem = self._frame_for(arguments.get("position_ids"))
            for announce in list(_ANNOUNCERS):
                announce(self, arguments)
            self._log = begin_log(self.mesh)
            t0 = time.perf_counter()
            self._agree(arguments, frame, problem)
            if self._log.timed and self.world > 1:
                self._log.control_seconds = time.perf_counter() - t0
            stack.enter_context(_use_frame(frame))
            stack.enter_context(runtime.use_placement(self))
            stack.enter_context(use_view(self))
            self._global_shapes = {}
            self._trace_before = runtime.last_trace()
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return None

    def _post_forward(self, module, args, kwargs, output):
        stack, self._stack = self._stack, None
        if stack is None:  # the pre-hook refused the forward
            return None
        try:
            trace = runtime.last_trace()
            if trace is not None and trace is not self._trace_before and trace.placement is not None:
                trace.collectives = self._log
        finally:
            stack.close()
        return None

    def _frame_for(self, position_ids) -> tuple[Frame | None, str]:
        """This rank's rows for a forward over `position_ids` (S, 3), and the reason it cannot run ("" if it can)."""
        problem = ""
        mode = runtime.current_mode()
        if self.world > 1 and mode != "strict":
            problem = (f"mode {mode!r} on topology {self.topology.name}: a forward on several ranks runs in mode "
                       "strict only (the row-parallel layers reduce by the declared 8-chunk tree; there is no "
                       "production multi-rank path)")
        elif self.world > 1 and torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters()):
            problem = mesh_autograd.training_problem(self)  # CP training (autograd.py); TP / SP stay forward-only
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] < 1:
            return None, problem or f"position_ids must be an (S, 3) tensor, got {type(position_ids).__name__}"
        try:
            return self._frame(int(position_ids.shape[0])), problem
        except TopologyError as exc:
            return None, problem or f"topology {self.topology.name}: {exc}"

    def _frame(self, seq_len: int) -> Frame:
        cp_rows = self.mesh.row_shards(seq_len)
        cp_part = self.mesh.local_rank("cp")
        if self.faults.rotate_rows:
            cp_part = (cp_part + 1) % self.cp
        cp_lo, cp_hi = cp_rows.bounds(cp_part)
        sp_rows, sp_part, lo, hi = None, 0, cp_lo, cp_hi
        if self.sp:
            sp_rows = self.mesh.sp_shards(cp_hi - cp_lo)
            sp_part = self.mesh.local_rank("tp")
            a, b = sp_rows.bounds(sp_part)
            lo, hi = cp_lo + a, cp_lo + b
        meta_cp, meta_sp = (cp_lo, cp_hi), (lo, hi)
        if self.faults.local_metadata:
            meta_cp, meta_sp = (0, cp_hi - cp_lo), (0, hi - lo)
        return Frame(seq_len, cp_rows, cp_part, sp_rows, sp_part, cp_lo, cp_hi, lo, hi, meta_cp, meta_sp)

    def _agree(self, arguments: Mapping[str, Any], frame: Frame | None, problem: str) -> None:
        """One exchange before any work: every rank raises the same error, or none does."""
        if self.world == 1:
            if problem:
                raise DistributedError(problem)
            return
        record = {
            "problem": problem,
            "mode": runtime.current_mode(),
            "overrides": list(runtime.active_overrides()),
            "hooked": sorted(self.model.hooked_points()) if hasattr(self.model, "hooked_points") else [],
            "inputs": {k: tensor_digest(v, "auto") for k, v in arguments.items()
                       if isinstance(v, torch.Tensor) and k != "self"},
            "rows": None if frame is None else [frame.cp_lo, frame.cp_hi, frame.lo, frame.hi],
            "coords": dict(self.mesh.coords),
        }
        records: list = [None] * self.world
        dist.all_gather_object(records, record, group=self.mesh.replica_group)  # data-parallel replicas differ
        verdict, error = _verdict(records, self.topology, frame)
        if verdict:
            raise error(verdict)

    # ---------------------------------------------------------------------------------------- runtime layer
    def serve(self, name: str, point: str, ops: runtime.Ops) -> Callable[..., Any] | None:
        """The runtime placement layer: a callable serving `name` at `point` on the shards, or None."""
        frame = _frame.get()
        if frame is None:
            return None
        if name == "linear_tree" and self.tp > 1:
            return lambda x, weight, bias=None: self._row_parallel(ops, point, frame, x, weight, bias)
        if (name in ("linear", "linear_tree") and self.cp > 1 and torch.is_grad_enabled()
                and point.startswith("blocks.") and ".adaln_table" not in point):
            return lambda x, weight, bias=None: mesh_autograd.linear(name, ops, point, x, weight, bias, self.mesh,
                                                                     frame.cp_rows)
        if name == "attention" and self.cp > 1 and point.startswith("blocks."):
            return lambda q, k, v, key_order=None: self._attention(ops, point, frame, q, k, v, key_order)
        return None

    def _row_parallel(self, ops, point, frame: Frame, x, weight, bias):
        if not ops.fusable("linear_tree"):
            raise DistributedError(
                f"{point}: an override of linear_tree cannot run on the row-parallel shards of topology "
                f"{self.topology.name} (each rank holds K / {self.tp} of the reduction)"
            )
        if ops.mode != "strict":
            raise DistributedError(f"{point}: the row-parallel linear_tree of topology {self.topology.name} runs in "
                                   f"mode strict only (mode {ops.mode!r})")
        out_rows = frame.sp_rows if point.startswith("blocks.") else None
        strategy = self.topology.strategy
        ops.log_served("linear_tree", point, {
            "kernel_id": f"h3lab.distributed.row_parallel_tree[{strategy}]/h3kernels.gemm.tree",
            "tile": gemm.TREE_TILES[x.dtype].describe() if x.dtype in gemm.TREE_TILES else "",
            "acc_dtype": "float32",
        }, (x, weight, bias))
        return row_parallel_tree(x, weight, bias, self.mesh, out_rows=out_rows, point=point)

    def _attention(self, ops, point, frame: Frame, q, k, v, key_order):
        if self.faults.ring_merge:
            return self._ring_attention(ops, point, frame, q, k, v, key_order)

        def inner(qh, kh, vh, order):
            return ops.dispatch("attention", point, (qh, kh, vh, order))

        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return mesh_autograd.ulysses_attention(q, k, v, key_order, self.mesh, frame.cp_rows, inner, point=point)
        return ulysses_attention(q, k, v, key_order, self.mesh, frame.cp_rows, attention=inner, point=point)

    def _ring_attention(self, ops, point, frame: Frame, q, k, v, key_order):
        """The A7 fault: a ring-attention KV-block plan (module docstring), computed in float32 torch."""
        if key_order is not None:
            raise DistributedError(f"{point}: the ring-merge fault supports canonical layouts only (key_order=None)")
        keys = gather_rows(k, self.mesh, frame.cp_rows, dim=1, point=point)
        values = gather_rows(v, self.mesh, frame.cp_rows, dim=1, point=point)
        blocks = []
        for part in range(self.cp):
            lo, hi = frame.cp_rows.bounds(part)
            mid = lo + (hi - lo + 1) // 2
            blocks += [(lo, mid), (mid, hi)]
        blocks = [b for b in blocks if b[1] > b[0]]
        if self.faults.ring_merge == "rank":
            start = 2 * frame.cp_part
            blocks = blocks[start:] + blocks[:start]
        qf = q.float().permute(0, 2, 1, 3)
        scale = 1.0 / math.sqrt(q.shape[-1])
        out = lse = None
        for lo, hi in blocks:
            kf = keys[:, lo:hi].float().permute(0, 2, 1, 3)
            vf = values[:, lo:hi].float().permute(0, 2, 1, 3)
            s = qf @ kf.transpose(-1, -2) * scale
            block_lse = torch.logsumexp(s, dim=-1, keepdim=True)
            block_out = torch.softmax(s, dim=-1) @ vf
            if out is None:
                out, lse = block_out.to(q.dtype), block_lse
                continue
            new = torch.logaddexp(lse, block_lse)
            out = (out.float() * torch.exp(lse - new) + block_out * torch.exp(block_lse - new)).to(q.dtype)
            lse = new
        ops.log_served("attention", point, {"kernel_id": f"fault:ring_merge[{self.faults.ring_merge}]", "tile": "",
                                            "acc_dtype": "float32"}, (q, k, v))
        return out.permute(0, 2, 1, 3).contiguous()

    # ------------------------------------------------------------------------------------------- hook view
    def to_global(self, point: HookPoint, tensor: torch.Tensor) -> torch.Tensor:
        frame = self._current(point.name)
        rows, cols = point_layout(point.name)
        t = tensor
        if cols is not None and self.tp > 1:
            if cols == "heads":
                t = gather_columns(t.flatten(-2, -1), self.mesh, 1, point=point.name).unflatten(-1, (-1, t.shape[-1]))
            else:
                t = gather_columns(t, self.mesh, cols, point=point.name)
        if rows == "sp" and frame.sp_rows is not None:
            t = gather_rows(t, self.mesh, frame.sp_rows, dim=1, point=point.name)
        if rows in ("sp", "cp") and self.cp > 1:
            t = gather_rows(t, self.mesh, frame.cp_rows, dim=1, point=point.name)
        self._global_shapes[point.name] = t.shape
        return t

    def to_local(self, point: HookPoint, tensor: torch.Tensor) -> torch.Tensor:
        frame = self._current(point.name)
        want = self._global_shapes.get(point.name)
        if want is not None and tensor.shape != want:
            raise DistributedError(
                f"a hook at {point.name} returned shape {list(tensor.shape)} on topology {self.topology.name}: on a "
                f"sharded forward a replacement keeps the one-process shape {list(want)} (no reshaping)"
            )
        rows, cols = point_layout(point.name)
        t = tensor
        if rows in ("sp", "cp") and self.cp > 1:
            t = frame.cp_rows.take(t, frame.cp_part, 1)
        if rows == "sp" and frame.sp_rows is not None:
            t = frame.sp_rows.take(t, frame.sp_part, 1)
        if cols is not None and self.tp > 1:
            r = self.mesh.local_rank("tp")
            if cols == "heads":
                t = t.narrow(2, t.shape[2] // self.tp * r, t.shape[2] // self.tp)
            else:
                t = split_grouped(t, -1, cols, self.tp, r, name=point.name)
        return t.contiguous()

    def agree(self, point: HookPoint, replaced: bool) -> bool:
        if self.world == 1:
            return replaced
        flag = torch.tensor([int(replaced)], dtype=torch.int32, device="cpu" if self.mesh.staged else self.mesh.device)
        flags = [torch.empty_like(flag) for _ in range(self.world)]
        dist.all_gather(flags, flag, group=self.mesh.replica_group)
        got = [int(f.item()) for f in flags]
        if len(set(got)) > 1:
            did = [r for r, f in enumerate(got) if f]
            raise DistributedError(
                f"a hook at {point.name} replaced the tensor on rank(s) {did} of {self.world} only: on a sharded "
                "forward a replacement must be made on every rank alike"
            )
        return bool(got[0])

    def _current(self, where: str) -> Frame:
        frame = _frame.get()
        if frame is None:
            raise DistributedError(f"{where}: a module of a model parallelized on {self.topology.name} ran outside "
                                   "the model's forward (call the model itself)")
        return frame

    # --------------------------------------------------------------------------------------- module hooks
    def _cut(self, t: torch.Tensor, level: str, dim: int, metadata: bool) -> torch.Tensor:
        frame = self._current("row cut")
        lo, hi = (frame.meta_cp if level == "cp" else frame.meta_sp) if metadata else (
            (frame.cp_lo, frame.cp_hi) if level == "cp" else (frame.lo, frame.hi))
        return t.narrow(dim, lo, hi - lo)

    def _block_pre(self, index: int):
        signature = inspect.signature(type(self.model.transformer_blocks[index]).forward)

        def hook(module, args, kwargs):
            a = signature.bind(module, *args, **kwargs).arguments
            frame = self._current(f"transformer_blocks.{index}")
            x, indices = a["x"], a["adaln_indices"]
            if index == 0 and x.shape[1] == frame.seq_len:
                x = self._scatter(x, indices, frame)
            if x.shape[1] != frame.hi - frame.lo:
                raise DistributedError(
                    f"transformer_blocks.{index}: hidden rows {x.shape[1]} on rank {self.mesh.rank} of "
                    f"{self.topology.name}; this rank holds packed rows [{frame.lo}, {frame.hi}) of {frame.seq_len}"
                )
            a["x"] = x
            a["adaln_indices"] = self._cut(indices, "sp", 0, metadata=True)
            del a["self"]
            return (), dict(a)

        return hook

    def _scatter(self, x: torch.Tensor, indices: torch.Tensor, frame: Frame) -> torch.Tensor:
        """Block 0's cut of the packed rows (logged as the co-sharding of the rows and their AdaLN indices)."""
        if self.faults.to_dict():
            return self._cut(x, "sp", 1, metadata=False).contiguous()
        grad = torch.is_grad_enabled() and x.requires_grad
        shards = scatter_rows({"hidden_states": x.detach() if grad else x, "adaln_indices": indices}, self.mesh,
                              frame.cp_rows, point="transformer_blocks.0")
        if grad:  # training (CP only): the cut's backward all-gathers the rows' gradients (autograd.py)
            return mesh_autograd.scatter_rows(x, self.mesh, frame.cp_rows, frame.cp_part, "transformer_blocks.0")
        if frame.sp_rows is not None:
            shards = scatter_rows(shards, self.mesh, frame.sp_rows, point="transformer_blocks.0")
        return shards["hidden_states"].contiguous()  # a row slice of a batch > 1 is strided; kernels want rows

    def _rope_post(self, module, args, output):
        cos, sin = output
        return self._cut(cos, "cp", 0, metadata=True), self._cut(sin, "cp", 0, metadata=True)

    def _gather_sp(self, where: str):
        def hook(module, args):
            frame = self._current(where)
            x, *rest = args
            return (gather_rows(x, self.mesh, frame.sp_rows, dim=1, point=where), *rest)

        return hook

    def _norm_out_pre(self, module, args, kwargs):
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
        bound["timestep_indices"] = self._cut(bound["timestep_indices"], "sp", 0, metadata=True)
        del bound["self"]
        return (), dict(bound)

    def _columns_post(self, path: str, groups: int):
        def hook(module, args, output):
            self._current(path)
            return gather_columns(output, self.mesh, groups, point=path)

        return hook

    def _rows_post(self, path: str):
        def hook(module, args, output):
            frame = self._current(path)
            if frame.sp_rows is not None:
                output = gather_rows(output, self.mesh, frame.sp_rows, dim=1, point=path)
            if self.cp > 1:
                output = mesh_autograd.gather_rows_grad(output, self.mesh, frame.cp_rows, frame.cp_part, point=path)
            return output

        return hook

    def _install(self) -> None:
        m, add = self.model, self.handles.append
        add(m.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        add(m.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True))
        config = m.config
        if self.tp > 1:
            for i, block in enumerate(m.transformer_blocks):
                path = f"transformer_blocks.{i}.adaln_proj.linear"
                groups = column_groups(path, config.adaln_dim, config)
                add(block.adaln_proj.linear.register_forward_hook(self._columns_post(path, groups)))
            groups = column_groups("norm_out.linear", 2 * config.hidden_size, config)
            add(m.norm_out.linear.register_forward_hook(self._columns_post("norm_out.linear", groups)))
        if self.cp > 1 or self.sp:
            for i, block in enumerate(m.transformer_blocks):
                add(block.register_forward_pre_hook(self._block_pre(i), with_kwargs=True))
                if self.sp:
                    add(block.attn.register_forward_pre_hook(self._gather_sp(f"transformer_blocks.{i}.attn")))
                    add(block.ff.register_forward_pre_hook(self._gather_sp(f"transformer_blocks.{i}.ff")))
            add(m.rope.register_forward_hook(self._rope_post))
            add(m.norm_out.register_forward_pre_hook(self._norm_out_pre, with_kwargs=True))
            add(m.proj_out.register_forward_hook(self._rows_post("proj_out")))
            add(m.audio_proj_out.register_forward_hook(self._rows_post("audio_proj_out")))

    def __repr__(self) -> str:
        return f"Placement({self.name!r}, {self.mesh!r}{', faults ' + str(self.faults.to_dict()) if self.faults.to_dict() else ''})"


@contextlib.contextmanager
def _use_frame(frame: Frame | None):
    token = _frame.set(frame)
    try:
        yield frame
    finally:
        _frame.reset(token)


def _verdict(records: list[dict], topology: Topology, frame: Frame | None) -> tuple[str, type]:
    """The one verdict every rank reaches from the gathered agreement records ("" = go)."""
    problems = [(r, rec["problem"]) for r, rec in enumerate(records) if rec["problem"]]
    if problems:
        r, problem = problems[0]
        same = len(problems) == len(records) and all(p == problem for _, p in problems)
        return (problem if same else f"rank {r}: {problem}"), DistributedError
    for key, what in (("mode", "the runtime mode"), ("overrides", "the op overrides"), ("hooked", "the hooked points")):
        values = [rec[key] for rec in records]
        if any(v != values[0] for v in values):
            listed = ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values))
            return (f"ranks disagree on {what} of a forward on {topology.name} ({listed}): every rank must run "
                    "the same forward"), DistributedError
    names = records[0]["inputs"]
    for r, rec in enumerate(records[1:], start=1):
        if set(rec["inputs"]) != set(names):
            return f"rank {r} passed inputs {sorted(rec['inputs'])}, rank 0 {sorted(names)}", DistributedError
        for name, digest in rec["inputs"].items():
            if digest != names[name]:
                return (f"input {name} differs between rank 0 and rank {r} on {topology.name}: every rank must "
                        "get the same inputs (broadcast them from rank 0)"), DistributedError
    seq_len = frame.seq_len
    cp_rows = RowShards(seq_len, topology.cp, "cp")
    for r, rec in enumerate(records):
        i, j = rec["coords"]["cp"], rec["coords"]["tp"]
        lo, hi = cp_rows.bounds(i)
        want = [lo, hi, lo, hi]
        if topology.sp:
            a, b = RowShards(hi - lo, topology.tp, "tp").bounds(j)
            want = [lo, hi, lo + a, lo + b]
        if rec["rows"] != want:
            got = rec["rows"]
            return (f"rank {r} (cp {i}, tp {j}) holds packed rows [{got[2]}, {got[3]}) of {seq_len}; the "
                    f"{topology.name} plan gives it [{want[2]}, {want[3]}): wrong ownership, the run is not "
                    "comparable"), OwnershipError
    return "", DistributedError


# ==================================================================================================== parallelize
def parallelize(model: nn.Module, mesh: Mesh, *, name: str = "transformer", faults: Faults | None = None) -> Placement:
    """Apply the TP / CP / SP plan of `mesh.topology` to `model` (an `H3Transformer` on `mesh.device`) in place and
    return its `Placement` (see the module docstring). The model's fingerprint is taken from the full weights first,
    so a sharded run records the one-process checkpoint identity. Refused (one line): a model that is not an
    H3Transformer, one already parallelized, a topology its widths do not admit, parameters off the mesh's device."""
    if not all(hasattr(model, a) for a in ("config", "transformer_blocks", "hook_points", "norm_out")):
        raise DistributedError(f"parallelize: {type(model).__name__} is not an h3lab H3Transformer")
    if placement_of(model) is not None:
        raise DistributedError(f"parallelize: the model is already parallelized ({placement_of(model)!r})")
    if not isinstance(mesh, Mesh):
        raise DistributedError(f"parallelize: mesh is a {type(mesh).__name__}; build it with init_mesh(tp=..., cp=...)")
    check_config(mesh.topology, model.config)
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    bad = [d for d in devices if d.type != mesh.device.type or (d.type == "cuda" and d != mesh.device)]
    if bad:
        raise DistributedError(f"parallelize: the model is on {sorted(map(str, devices))}, the mesh's rank "
                               f"{mesh.rank} on {mesh.device}: move the model to its rank's device first")
    faults = faults or Faults()
    if (faults.rotate_rows or faults.local_metadata or faults.ring_merge) and mesh.topology.cp == 1:
        raise DistributedError(f"faults {faults.to_dict()} need cp > 1 (topology {mesh.topology.name})")
    t = mesh.topology
    held = getattr(model, "h3lab_shard", None)  # set by shard_load: the model holds only its TP shard already
    if held is not None:
        want = (t.tp, mesh.local_rank("tp"), t.strategy)
        if tuple(held) != want:
            raise DistributedError(f"parallelize: the model holds the shard (tp, rank, strategy) = {tuple(held)}, "
                                   f"rank {mesh.rank} of {t.name} needs {want}: load the shard for this mesh")
        if not getattr(model, "fingerprint", ""):
            raise DistributedError("parallelize: a model holding only its shard needs the full weights' fingerprint "
                                   "(set by its loader)")
    if isinstance(getattr(model, "fingerprint", None), str) and not model.fingerprint:
        model.fingerprint = model_fingerprint(model)  # the full weights' identity, before sharding
    split = []
    if held is not None:
        split = [n for n, p in model.named_parameters()
                 if split_rule(n, _full_shape(p.shape, n, t.tp, TP_PLAN), model.config, t.tp,
                               row_parallel=t.row_parallel) is not None]
    elif t.tp > 1:
        split = shard_parameters_(model, model.config, t.tp, mesh.local_rank("tp"), row_parallel=t.row_parallel)
    placement = Placement(model, mesh, name, faults, split)
    placement._install()
    model.__dict__["_h3lab_placement"] = placement
    _PLACEMENTS[model] = weakref.ref(placement)
    return placement
