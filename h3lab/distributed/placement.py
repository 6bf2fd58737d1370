"""`Placement`: the TP / CP (Ulysses) / SP plans of `plan.py` interpreted on a built `H3Transformer` from outside
(`apply.apply_plan` / `parallelize` build it, `apply.remove_plan` undoes it). The model's code stays single-device;
its forward keeps its signature and returns the full video / audio velocities on every rank, byte-equal (strict) to
one process for the same logical rows.

What the interpretation (`Placement._install`) amounts to for the model's plans:
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
  rows once for the column-parallel projections; the row-parallel layers return SP rows (`out_rows`: all_to_all),
  and so does a LoRA B on them (it runs on the CP shard's rows and keeps the rank's).
- Every forward (root hooks on the model): the rank's `Frame` (its rows) is made current, the runtime placement
  (`runtime.use_placement`) and the hook view (`hooks.use_view`) are entered, a `CollectiveLog` is begun, and one
  `all_gather_object` over the world makes every rank agree before any work -- same mode, overrides, hooked points,
  input bytes (digests) and row ownership -- or every rank raises the same one-line error. The trace gets
  `placement` (topology, rank, the rows and heads this rank holds) and `collectives` (each collective, its
  algorithm, fallback state: strict collectives never fall back).

Strict rules: a forward on more than one rank runs in mode strict only (the row-parallel layers exist only as the
declared tree; there is no production multi-rank path). With grad it runs on CP, TP and TP x CP meshes, with or
without SP (`autograd.py`: the block-0 cuts (CP, then SP), the row gathers (SP, CP) and the Ulysses exchanges carry
their declared backward, and block projections with a trainable weight compute it over the gathered rows;
`tp_autograd.py`: the TP layers' frozen base computes the one-process dX from the gathered dY (its rows gathered
first under SP) and weight, LoRA factors stay whole, `tp_points`). A rank whose rows are not
the plan's (`OwnershipError`) makes the run non-comparable: every rank refuses it before computing.

Hooks: a hook registered on the model sees, at every point it selects, the tensor one process has there (the view
gathers rows over SP then CP, columns or heads over TP, by the point's `Sharded` layout in the hook-point table,
`model/hooks.py`); a replacement is cut back to each rank's shard and must be
made on every rank alike (checked). Reshaping hooks are refused on a sharded forward.

Seams: `frame(seq_len)` (the rows this rank holds), `scatter` (block 0's cut of the packed rows) and `attention` (the
served block attention) are the methods a research wrapper may override; `wrap_placement(placement, wrap)` puts such
a wrapper in the placement's place on its model. The ablation matrix's fault probes (`h3lab.research.ablation.faults`) are
one; this module has no fault branch.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from h3kernels import gemm

from ..execution import context, runtime
from ..hashing import tensor_digest
from ..model.hooks import HookPoint, sharded_layout, use_view
from . import autograd as mesh_autograd
from . import tp_autograd
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
from .mesh import Mesh, Topology
from .plan import (
    CP_PLAN,
    TP_PLAN,
    HeadExchange,
    PlanEntry,
    RowGather,
    RowSplit,
    StreamSplit,
    column_groups,
    module_regex,
)
from .shards import RowShards, split_grouped


class OwnershipError(DistributedError):
    """A rank holds rows (or heads) that the topology's plan gives to another rank: the run is not comparable."""


@dataclass(frozen=True)
class Frame:
    """The rows of one forward on this rank. `cp_rows` cuts the S packed rows over the CP group, `sp_rows` (SP only)
    this CP shard over the TP group. [cp_lo, cp_hi) / [lo, hi): the packed rows this rank holds at the CP level /
    in its residual stream (SP level; equal without SP). meta_*: the rows its per-row metadata is cut to (the same
    rows; a research wrapper may plant others, e.g. the ablation's H17 fault)."""

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


# The running forward's frame is a field of the one execution context (`h3lab.execution.context`: placement_frame).
# model -> weakref to its Placement; the model holds the Placement (`_h3lab_placement`), so the pair is one cycle
# the garbage collector frees (a strong value here would keep every parallelized model and its weights alive)
_PLACEMENTS: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()
_ANNOUNCERS: list[Callable[["Placement", dict], None]] = []  # lead mode (follow.py): tell the other ranks

def row_owner(placement: Mapping[str, Any], point: str, packed_row: int, seq_len: int) -> dict:
    """Who holds packed row `packed_row` of `seq_len` at hook point `point` under a `RunSpec.placement` value: the
    global rank(s), the CP rank, the TP rank (SP points; else every TP rank of the CP group holds the row, its
    columns or heads split), the local row there, and a `text` for reports."""
    tp, cp, sp = int(placement.get("tp", 1)), int(placement.get("cp", 1)), bool(placement.get("sp", False))
    cp_rows = RowShards(seq_len, cp, "cp")
    i, local = cp_rows.owner(packed_row)
    rows = sharded_layout(point).rows  # the hook-point table's layout (model/hooks.py)
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

    def __init__(self, model: nn.Module, mesh: Mesh, name: str, split: list[str],
                 tp_plan: Mapping[str, PlanEntry] = TP_PLAN, cp_plan: Mapping[str, tuple] = CP_PLAN):
        self.model, self.mesh, self.name, self.split = model, mesh, name, split
        self.tp_plan, self.cp_plan = tp_plan, cp_plan
        self._tree, self._exchanged = False, frozenset()  # set by `_install` from the plans
        self.tp_points: dict[str, tuple[str, int]] = {}  # TP layer point -> ("col", groups) | ("row", 1): `_install`
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
        frame = context.current().placement_frame
        if frame is not None:
            out["rows"] = frame.to_dict()
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
            problem = mesh_autograd.training_problem(self)  # autograd.py, tp_autograd.py
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] < 1:
            return None, problem or f"position_ids must be an (S, 3) tensor, got {type(position_ids).__name__}"
        try:
            return self.frame(int(position_ids.shape[0])), problem
        except TopologyError as exc:
            return None, problem or f"topology {self.topology.name}: {exc}"

    def frame(self, seq_len: int, cp_part: int | None = None) -> Frame:
        """The rows of a forward over `seq_len` packed rows on this rank (CP part `cp_part`: default the rank's)."""
        cp_rows = self.mesh.row_shards(seq_len)
        cp_part = self.mesh.local_rank("cp") if cp_part is None else cp_part
        cp_lo, cp_hi = cp_rows.bounds(cp_part)
        sp_rows, sp_part, lo, hi = None, 0, cp_lo, cp_hi
        if self.sp:
            sp_rows = self.mesh.sp_shards(cp_hi - cp_lo)
            sp_part = self.mesh.local_rank("tp")
            a, b = sp_rows.bounds(sp_part)
            lo, hi = cp_lo + a, cp_lo + b
        return Frame(seq_len, cp_rows, cp_part, sp_rows, sp_part, cp_lo, cp_hi, lo, hi, (cp_lo, cp_hi), (lo, hi))

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
        frame = context.current().placement_frame
        if frame is None:
            return None
        if name in ("linear", "linear_tree") and self.tp > 1:
            served = self._tp_linear(name, point, ops, frame)
            if served is not None:
                return served
        if name == "linear_tree" and self._tree:
            return lambda x, weight, bias=None: self._row_parallel(ops, point, frame, x, weight, bias)
        if name in ("linear", "linear_tree") and self._cp_trains(point):
            return self._linear(name, point, ops, frame)
        if name == "attention" and point in self._exchanged:
            return lambda q, k, v, key_order=None: self.attention(ops, point, frame, q, k, v, key_order)
        return None

    def _cp_trains(self, point: str) -> bool:
        return (self.cp > 1 and torch.is_grad_enabled() and point.startswith("blocks.")
                and ".adaln_table" not in point)

    def _linear(self, name: str, point: str, ops, frame: Frame) -> Callable[..., torch.Tensor]:
        """A projection on the rank's rows: with grad on a CP mesh, `autograd.linear` (weight gradients over the
        gathered rows), else the op table's call."""
        if self._cp_trains(point):
            return lambda x, weight, bias=None: mesh_autograd.linear(name, ops, point, x, weight, bias, self.mesh,
                                                                     frame.cp_rows)
        return lambda x, weight, bias=None: ops.dispatch(name, point, (x, weight, bias))

    def _tp_linear(self, name: str, point: str, ops, frame: Frame) -> Callable[..., torch.Tensor] | None:
        """TP layers and their LoRA factors (`tp_autograd.py`): a LoRA B of a column-parallel layer runs whole and
        keeps the rank's columns, a LoRA A of a row-parallel layer runs on the gathered columns; with grad, the
        frozen column- / row-parallel base computes the one-process dX in its backward. None: not a TP point."""
        base, _, factor = point.rpartition(".")
        if factor in ("lora_a", "lora_b") and base in self.tp_points:
            kind, groups = self.tp_points[base]
            inner = self._linear(name, point, ops, frame)
            if kind == "col" and factor == "lora_b":
                return lambda x, weight, bias=None: tp_autograd.take_columns(inner(x, weight, bias), self.mesh,
                                                                             groups, point)
            if kind == "row" and factor == "lora_a":
                return lambda x, weight, bias=None: inner(tp_autograd.full_columns(x, self.mesh, point), weight,
                                                          bias)
            out_rows = self._out_rows(base, frame)
            if kind == "row" and out_rows is not None:  # SP: the base returns the rank's SP rows; B runs on the
                # CP shard's rows (replicated over TP) and keeps the rank's, its backward all-gathers their gradient
                return lambda x, weight, bias=None: mesh_autograd.scatter_rows(
                    inner(x, weight, bias), self.mesh, out_rows, frame.sp_part, point)
            return inner
        kind, groups = self.tp_points.get(point, ("", 0))
        if not torch.is_grad_enabled():  # a forward without grad serves the base layers as before
            return None
        if kind == "row" and name == "linear_tree" and self._tree:
            def row(x, weight, bias=None):
                forward = lambda x_, w_, b_: self._row_parallel(ops, point, frame, x_, w_, b_)  # noqa: E731
                if not x.requires_grad:
                    return forward(x, weight, bias)
                _frozen(point, weight, bias)
                return tp_autograd.RowParallel.apply(x, weight, bias, forward, ops.mode, self.mesh, point,
                                                     self._out_rows(point, frame))

            return row
        if kind == "col":
            def col(x, weight, bias=None):
                forward = lambda x_, w_, b_: ops.dispatch(name, point, (x_, w_, b_))  # noqa: E731
                if not x.requires_grad:
                    return forward(x, weight, bias)
                _frozen(point, weight, bias)
                return tp_autograd.ColumnParallel.apply(x, weight, bias, forward, ops.mode, self.mesh, groups, point)

            return col
        return None

    @staticmethod
    def _out_rows(point: str, frame: Frame) -> RowShards | None:
        """The rows a row-parallel layer at `point` returns: the rank's SP rows where its output joins the block
        stack's stream (SP), else None (every row of the CP shard)."""
        return frame.sp_rows if sharded_layout(point).rows == "sp" else None

    def _row_parallel(self, ops, point, frame: Frame, x, weight, bias):
        if not ops.fusable("linear_tree"):
            raise DistributedError(
                f"{point}: an override of linear_tree cannot run on the row-parallel shards of topology "
                f"{self.topology.name} (each rank holds K / {self.tp} of the reduction)"
            )
        if ops.mode != "strict":
            raise DistributedError(f"{point}: the row-parallel linear_tree of topology {self.topology.name} runs in "
                                   f"mode strict only (mode {ops.mode!r})")
        out_rows = self._out_rows(point, frame)
        strategy = self.topology.strategy
        ops.log_served("linear_tree", point, {
            "kernel_id": f"h3lab.distributed.row_parallel_tree[{strategy}]/h3kernels.gemm.tree",
            "tile": gemm.TREE_TILES[x.dtype].describe() if x.dtype in gemm.TREE_TILES else "",
            "acc_dtype": "float32",
        }, (x, weight, bias))
        return row_parallel_tree(x, weight, bias, self.mesh, out_rows=out_rows, point=point)

    def attention(self, ops, point: str, frame: Frame, q, k, v, key_order):
        """Block attention on the CP shards: `ulysses_attention` around the mode's attention op (overrides included)."""

        def inner(qh, kh, vh, order):
            return ops.dispatch("attention", point, (qh, kh, vh, order))

        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return mesh_autograd.ulysses_attention(q, k, v, key_order, self.mesh, frame.cp_rows, inner, point=point)
        return ulysses_attention(q, k, v, key_order, self.mesh, frame.cp_rows, attention=inner, point=point)

    # ------------------------------------------------------------------------------------------- hook view
    def to_global(self, point: HookPoint, tensor: torch.Tensor) -> torch.Tensor:
        frame = self._current(point.name)
        rows, cols = point.sharded
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
        rows, cols = point.sharded
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
        frame = context.current().placement_frame
        if frame is None:
            raise DistributedError(f"{where}: a module of a model parallelized on {self.topology.name} ran outside "
                                   "the model's forward (call the model itself)")
        return frame

    # ------------------------------------------------------------------------ the plan, interpreted as hooks
    def cut(self, t: torch.Tensor, level: str, dim: int, metadata: bool) -> torch.Tensor:
        """`t` narrowed along `dim` to this rank's rows at `level` ("cp" or "sp": the residual-stream rows); per-row
        `metadata` by the frame's metadata rows."""
        frame = self._current("row cut")
        lo, hi = (frame.meta_cp if level == "cp" else frame.meta_sp) if metadata else (
            (frame.cp_lo, frame.cp_hi) if level == "cp" else (frame.lo, frame.hi))
        return t.narrow(dim, lo, hi - lo)

    def scatter(self, x: torch.Tensor, metadata: Mapping[str, torch.Tensor], frame: Frame, point: str) -> torch.Tensor:
        """The cut of the packed rows where they arrive whole (logged at `point` as the co-sharding of the rows and
        their per-row `metadata`, by name)."""
        grad = torch.is_grad_enabled() and x.requires_grad
        shards = scatter_rows({"hidden_states": x.detach() if grad else x, **metadata}, self.mesh, frame.cp_rows,
                              point=point)
        if frame.sp_rows is not None:
            shards = scatter_rows(shards, self.mesh, frame.sp_rows, point=point)
        if grad:  # training: each cut's backward all-gathers the rows' gradients, SP then CP (autograd.py)
            x = mesh_autograd.scatter_rows(x, self.mesh, frame.cp_rows, frame.cp_part, point)
            if frame.sp_rows is not None:
                x = mesh_autograd.scatter_rows(x, self.mesh, frame.sp_rows, frame.sp_part, point)
            return x
        return shards["hidden_states"].contiguous()  # a row slice of a batch > 1 is strided; kernels want rows

    def _apply_in(self, path: str, entry, value, frame: Frame, bound: Mapping[str, Any]):
        """One CP_PLAN entry on one input of module `path`."""
        if isinstance(entry, RowSplit):
            return self.cut(value, entry.rows, entry.dim, metadata=True)
        if isinstance(entry, RowGather):  # SP rows -> the CP shard's rows (backward: the rank's slice)
            return self._gather_sp(value, frame, entry.dim, path)
        # StreamSplit: the packed rows, cut where they arrive whole, then checked
        if value.shape[1] == frame.seq_len:
            value = self.scatter(value, {entry.with_: bound[entry.with_]}, frame, path)
        if value.shape[1] != frame.hi - frame.lo:
            raise DistributedError(
                f"{path}: hidden rows {value.shape[1]} on rank {self.mesh.rank} of {self.topology.name}; this rank "
                f"holds packed rows [{frame.lo}, {frame.hi}) of {frame.seq_len}"
            )
        return value

    def _pre_hook(self, path: str, module: nn.Module, entries: tuple):
        """A forward pre-hook applying `entries` (input entries of CP_PLAN) in order. Entries naming arguments bind
        the call's arguments and pass them back by name; entries of positional inputs only keep the call's form."""
        named = any(isinstance(e.what, str) for e in entries)
        if named:
            signature = inspect.signature(type(module).forward)

            def hook(mod, args, kwargs):
                frame = self._current(path)
                a = signature.bind(mod, *args, **kwargs).arguments
                for entry in entries:
                    a[entry.what] = self._apply_in(path, entry, a[entry.what], frame, a)
                del a["self"]
                return (), dict(a)

            return module.register_forward_pre_hook(hook, with_kwargs=True)

        def positional(mod, args):
            frame = self._current(path)
            args = list(args)
            for entry in entries:
                args[entry.what] = self._apply_in(path, entry, args[entry.what], frame, {})
            return tuple(args)

        return module.register_forward_pre_hook(positional)

    def _post_hook(self, path: str, module: nn.Module, entries: tuple):
        """A forward hook applying output `entries` in order: RowSplit of output items, RowGather of the output."""

        def hook(mod, args, output):
            frame = self._current(path)
            for entry in entries:
                if isinstance(entry, RowSplit):
                    items = list(output)
                    items[entry.what] = self.cut(items[entry.what], entry.rows, entry.dim, metadata=True)
                    output = tuple(items)
                else:  # RowGather of the output: SP rows, then CP rows
                    if frame.sp_rows is not None:
                        output = self._gather_sp(output, frame, entry.dim, path)
                    if entry.to == "all" and self.cp > 1:
                        output = (mesh_autograd.gather_rows_grad(output, self.mesh, frame.cp_rows, frame.cp_part,
                                                                 point=path) if entry.dim == 1  # with its backward
                                  else gather_rows(output, self.mesh, frame.cp_rows, dim=entry.dim, point=path))
            return output

        return module.register_forward_hook(hook)

    def _gather_sp(self, t: torch.Tensor, frame: Frame, dim: int, point: str) -> torch.Tensor:
        """The rank's SP rows -> every row of its CP shard; with grad (dim 1) the gather whose backward is the rank's
        slice of the replicated gradient (`autograd.GatherRows` over the TP group), never a reduce-scatter."""
        if dim == 1:
            return mesh_autograd.gather_rows_grad(t, self.mesh, frame.sp_rows, frame.sp_part, point=point)
        return gather_rows(t, self.mesh, frame.sp_rows, dim=dim, point=point)

    def _columns_post(self, path: str, groups: int):
        def hook(module, args, output):
            self._current(path)
            return gather_columns(output, self.mesh, groups, point=path)

        return hook

    def _install(self) -> None:
        """The plans, interpreted (DESIGN: the plan is data, one interpreter applies it): the root hooks of every
        forward; TP (tp > 1): a `colwise_adaln` module's output gathered by `gather_columns(groups)`, `rowwise_tree`
        modules served as the row-parallel tree; CP / SP (cp > 1 or sp): per matched module one pre-hook for its input
        entries and one forward hook for its output entries, in plan order, `HeadExchange` attention points served
        as Ulysses attention; a `RowGather` to "cp" exists only under SP."""
        m, add = self.model, self.handles.append
        add(m.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        add(m.register_forward_hook(self._post_forward, with_kwargs=True, always_call=True))
        modules = dict(m.named_modules())
        self._tree, self._exchanged = False, frozenset()
        if self.tp > 1:
            self.tp_points = {}
            for pattern, entry in self.tp_plan.items():
                for path, module in _matching(modules, pattern, required=False):  # e.g. no refiner blocks
                    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module  # peft LoRA
                    if entry.style == "colwise_adaln":
                        groups = column_groups(path, base.weight.shape[0] * self.tp, m.config, self.tp_plan)
                        add(module.register_forward_hook(self._columns_post(path, groups)))
                    elif entry.style == "rowwise_tree":
                        if not getattr(base, "tree", False):
                            raise DistributedError(f"plan entry {pattern!r}: style rowwise_tree on {path}, which does "
                                                   "not run linear_tree")
                        self._tree = True
                        self.tp_points[base.point] = ("row", 1)
                    elif entry.style.startswith("colwise"):
                        groups = column_groups(path, base.weight.shape[0] * self.tp, m.config, self.tp_plan)
                        self.tp_points[base.point] = ("col", groups)
        if self.cp > 1 or self.sp:
            exchanged = set()
            for path, entries in _entries_by_module(modules, self.cp_plan):
                module = modules[path]
                entries = [e for e in entries if not (isinstance(e, RowGather) and e.to == "cp" and not self.sp)]
                if any(isinstance(e, HeadExchange) for e in entries) and self.cp > 1:
                    site = getattr(module, "hook_attention", None)
                    if site is None:
                        raise DistributedError(f"plan entry HeadExchange at {path}: the module runs no attention op")
                    exchanged.add(site.name)
                inputs = tuple(e for e in entries if isinstance(e, (RowSplit, StreamSplit, RowGather))
                               and not _is_output(e))
                outputs = tuple(e for e in entries if _is_output(e))
                if inputs:
                    add(self._pre_hook(path, module, inputs))
                if outputs:
                    add(self._post_hook(path, module, outputs))
            self._exchanged = frozenset(exchanged)

    def __repr__(self) -> str:
        return f"Placement({self.name!r}, {self.mesh!r})"


def _frozen(point: str, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise DistributedError(f"{point}: a TP-sharded base weight has no declared gradient (train LoRA factors)")


@contextlib.contextmanager
def _use_frame(frame: Frame | None):
    with context.use(placement_frame=frame):
        yield frame


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


def _is_output(entry) -> bool:
    return (isinstance(entry, RowSplit) and isinstance(entry.what, int)) or (
        isinstance(entry, RowGather) and entry.what == "output")


def _matching(modules: Mapping[str, nn.Module], pattern: str, required: bool = True) -> list[tuple[str, nn.Module]]:
    regex = module_regex(pattern)
    hits = [(path, mod) for path, mod in modules.items() if regex.fullmatch(path)]
    if required and not hits:
        raise DistributedError(f"plan entry {pattern!r} names no module of the model")
    return hits


def _entries_by_module(modules: Mapping[str, nn.Module], cp_plan: Mapping[str, tuple]) -> list[tuple[str, list]]:
    """(module path, its CP_PLAN entries in plan order) for every module some entry names, in module order."""
    found: dict[str, list] = {}
    for pattern, entries in cp_plan.items():
        for path, _ in _matching(modules, pattern):
            found.setdefault(path, []).extend(entries)
    return [(path, found[path]) for path in modules if path in found]
