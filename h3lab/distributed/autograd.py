"""The backward of the strict collectives: a training step on a CP (Ulysses) mesh, byte-equal to one process.

Why this is a separate contract
-------------------------------
A strict forward is byte-equal on a mesh because every row's bytes depend only on that row (and, for attention, on
the whole document in canonical key order, which every CP rank sees for its heads). A backward also *reduces over
rows*: the weight gradient of a projection sums over every packed row. So the forward's argument does not carry
over; each collective and each row reduction needs its own declared backward.

The one-process reductions (kernels/gemm.py "Backward", kernels/attention.py "Backward")
- dW = dY^T @ X: per weight element ONE float32 accumulator folded over the M rows in fixed BLOCK_K-row tiles,
  ascending (no split over rows, no tree, no atomics); dB likewise folds rows into 64 lanes in ascending row chunks.
- dX = dY @ W: per row, a fold over the N outputs in BLOCK_K tiles; rows are independent (row-invariant).
- attention dQ, dK, dV: one program per (key or query block, batch, head) over all rows of the document in
  `key_order`: heads are independent.

Proof of the weight-gradient rule (which of the two candidate forms matches)
- "rank partials combined in the kernel's tree": the dW kernel has no tree over rows, it has a left fold
  acc_t = acc_(t-1) + dY_t^T X_t over row tiles t = 0, 1, ... . A CP rank holding rows [lo, hi) can only start its
  own fold from zero, so rank partials P_0 = fold(tiles of rank 0), P_1 = fold(tiles of rank 1) and any combine
  P_0 + P_1 is ((d_0 + d_1) + ...) + ((0 + d_k) + d_(k+1) ...), a re-association of the one-process
  (((d_0 + d_1) + ...) + d_k) + d_(k+1) ...: float32 addition is not associative, so those bytes differ (in
  general, and in the test: `linear(..., weight_grad="rank_partials")` is that form, and it is detected). No partial
  form exists without an accumulator-carrying kernel (a pipeline over ranks), which kernels/gemm.py does not have.
- "gather the rows in canonical order first": all_gather X's rows and dY's rows over the CP group in rank order
  (= packed order, `RowShards`), then run the same strict kernel on the (M, K) and (M, N) tensors one process has:
  the same fold over the same rows in the same tiles, so the same bytes. This is the form used. The gather moves
  bytes only (gloo's transport padding is dropped before any use), and every CP rank computes the same dW.

The backward of each piece (`RowGatheredLinear`, `ScatterRows`, `GatherRows`, `UlyssesExchange`)
- block-0 row cut (forward: a local slice of the replicated packed rows): backward = all_gather of the rows'
  gradients in rank order -> the full (B, S, hidden) gradient, identical on every rank (the pack, the refiner and
  the input projections upstream then run their one-process backward on every rank). Never a sum.
- gather_rows at the heads (forward: all_gather of the rank's rows): every rank computes the same loss from the same
  gathered tensor, so the incoming gradient is replicated and the rank's gradient is its slice (no reduce-scatter:
  that would sum cp identical copies).
- rows_to_heads (Ulysses all_to_all): backward = heads_to_rows of the gradient, and the reverse: the exact inverse
  permutation of bytes, nothing added. Attention's backward then runs per head over all S rows (its own contract).
- projections inside the blocks whose weight (or bias) is trainable, e.g. the LoRA factors: forward is the strict
  op on the rank's rows (row-invariant); backward: dX of the rank's rows by the strict kernel on its rows
  (row-invariant, nothing moved), dW (dB) by the strict kernel on the gathered X and dY rows (proof above).
Frozen projections keep the strict kernel's own backward (dX only, row-invariant). Every backward collective is
called in the autograd engine's order of one graph, the same graph on every rank.

What it costs (per backward; S packed rows, cp ranks; a projection x (S, K) -> (S, N))
- communication per trainable projection: each rank receives (cp - 1) / cp * S * (K + N) elements of X and dY in
  the factor's dtype (LoRA: float32), e.g. a rank-16 LoRA on to_q at full width (K 5376, N 7168 of the factor pair:
  A's X (S, 5376) and dY (S, 16), B's X (S, 16) and dY (S, 7168): 50.3 KB per row in all) at CP2: 25.2 KB per
  row, 2.7 GB at 109,205 rows on each rank for that projection; the block-0 cut (cp - 1) / cp * S * hidden * 2 B
  once; Ulysses' backward moves what its forward moves (dO in, dQ/dK/dV out).
- memory: the gathered X and dY of one factor at a time (transient; at 109,205 rows A's X 2.3 GB, B's dY 3.1 GB),
  on top of the per-rank activations (S / cp rows, attention all S rows of H / cp heads).
- compute: dX is split over ranks; each trainable dW is computed on every rank over all rows (for LoRA factors,
  S * K * r multiply-adds: small beside the frozen projections' dX). Refinements left open: gather X in its bf16
  (the LoRA input is an exact bf16 -> float32 cast) to halve its bytes, and compute layer l's dW on rank l mod cp
  only, then all-gather the (r, K) results (balances the transient memory).

TP: implemented in `tp_autograd.py` (the one-process dX on the gathered shapes, LoRA factors replicated). The
analysis first written here, kept for the cheaper forms it names:
- row-parallel `linear_tree` (k_chunks): y = tree(p_0 .. p_(tp-1)) + b; each partial enters with coefficient 1, so
  dp_r = dY (replicated) and rank r's dX columns are linear(dY, W_r^T): the kernel's own dX for those columns
  (output columns are independent), nothing moved. The backward of the all_gather of partials is the identity on
  the rank's own partial: never a reduce-scatter.
- column-parallel (q, k, v, ff.net.0.proj): one process folds dX = dY @ W over all N in one accumulator; TP ranks
  hold N / tp each, so partials summed in any order or tree re-associate that fold: not byte-equal. The byte-equal
  form: all_gather dY's column blocks (grouped as `cat_grouped`), all_to_all the frozen weight shard into K-column
  blocks W[:, K_j] (all N rows in the full weight's order), rank j computes dX[:, K_j] = linear(dY, W[:, K_j]^T), and
  the dX column blocks are all-gathered. Cost per row: (tp - 1) / tp * (N + K) * 2 B, plus (tp - 1) / tp^2 of the
  weight per layer and backward (or that block cached once: 1 / tp more weight memory per rank).
- LoRA under TP: B of a column-parallel layer sharded by output rows (dB an exact slice, local), A replicated, its
  dA needs dD @ B over the full N (all_gather dD's columns and B's rows: N * r, small).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..execution import runtime
from .collectives import _all_gather, gather_rows, heads_to_rows, rows_to_heads
from .errors import DistributedError
from .mesh import Mesh
from .shards import RowShards

WEIGHT_GRADS = ("gather", "rank_partials")  # the contract, and the fault the tests show is not byte-equal
# Modules that run on every packed row, replicated on every CP rank, before the block-0 cut: their gradients arrive
# whole through `ScatterRows`' backward, so any of their parameters trains as in one process.
REPLICATED_PREFIXES = ("token_refiner.", "proj_in.", "audio_proj_in.", "context_embedder.")


def _needs(tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# ------------------------------------------------------------------------------------------ rows and heads
class ScatterRows(torch.autograd.Function):
    """x (B, S, C) replicated -> this rank's rows (B, S_r, C); backward: all_gather of the rows' gradients."""

    @staticmethod
    def forward(ctx, x, mesh: Mesh, rows: RowShards, part: int, point: str):
        ctx.mesh, ctx.rows, ctx.point = mesh, rows, point
        return rows.take(x, part, 1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return gather_rows(grad.contiguous(), ctx.mesh, ctx.rows, dim=1, point=f"{ctx.point} (backward)"), \
            None, None, None, None


class GatherRows(torch.autograd.Function):
    """x (B, S_r, C) -> all rows (B, S, C); backward: this rank's slice of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, mesh: Mesh, rows: RowShards, part: int, point: str):
        ctx.rows, ctx.part = rows, part
        return gather_rows(x, mesh, rows, dim=1, point=point)

    @staticmethod
    def backward(ctx, grad):
        return ctx.rows.take(grad, ctx.part, 1).contiguous(), None, None, None, None


class UlyssesExchange(torch.autograd.Function):
    """One Ulysses all_to_all (`there`: rows_to_heads or heads_to_rows) whose backward is the other one (`back`) on the
    gradient: the inverse permutation of bytes, nothing added."""

    @staticmethod
    def forward(ctx, x, mesh: Mesh, rows: RowShards, point: str, there: Callable, back: Callable):
        ctx.mesh, ctx.rows, ctx.point, ctx.back = mesh, rows, point, back
        return there(x, mesh, rows, point=point)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad.contiguous(), ctx.mesh, ctx.rows, point=f"{ctx.point} (backward)"), \
            None, None, None, None, None


def scatter_rows(x: torch.Tensor, mesh: Mesh, rows: RowShards, part: int, point: str = "") -> torch.Tensor:
    """The block-0 cut with its backward (all_gather of the gradient rows); a plain slice when nothing needs grad."""
    if not _needs((x,)):
        return rows.take(x, part, 1).contiguous()
    return ScatterRows.apply(x, mesh, rows, part, point)


def gather_rows_grad(x: torch.Tensor, mesh: Mesh, rows: RowShards, part: int, point: str = "") -> torch.Tensor:
    """`collectives.gather_rows` along dim 1 with its backward (the rank's slice of a replicated gradient)."""
    if not _needs((x,)):
        return gather_rows(x, mesh, rows, dim=1, point=point)
    return GatherRows.apply(x, mesh, rows, part, point)


def ulysses_attention(q, k, v, key_order, mesh: Mesh, rows: RowShards, attention: Callable[..., torch.Tensor],
                      point: str = "") -> torch.Tensor:
    """`collectives.ulysses_attention` whose exchanges carry their inverse as backward; `attention` (the op table's)
    runs with its own autograd on all S rows of the rank's heads."""
    qh, kh, vh = (UlyssesExchange.apply(t, mesh, rows, point, rows_to_heads, heads_to_rows) for t in (q, k, v))
    return UlyssesExchange.apply(attention(qh, kh, vh, key_order), mesh, rows, point, heads_to_rows, rows_to_heads)


# ------------------------------------------------------------------------------------- trainable projections
class RowGatheredLinear(torch.autograd.Function):
    """y = op(x, weight, bias) on this rank's rows; backward: dX on the rank's rows, dW / dB on the gathered rows
    (module docstring). `op_name` is "linear" or "linear_tree", run as `mode` dispatches it (strict on a mesh)."""

    @staticmethod
    def forward(ctx, x, weight, bias, forward_op, op_name: str, mode: str, mesh: Mesh, rows: RowShards,
                weight_grad: str, point: str):
        ctx.save_for_backward(x, weight, bias)
        ctx.op_name, ctx.mode, ctx.mesh, ctx.rows, ctx.weight_grad, ctx.point = (
            op_name, mode, mesh, rows, weight_grad, point)
        return forward_op(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dw = db = None
        dy = dy.contiguous()
        with runtime.use_mode(ctx.mode), torch.enable_grad():
            op = runtime.mode_op(ctx.op_name)
            if need_x:
                xl = x.detach().requires_grad_()
                (dx,) = torch.autograd.grad(op(xl, weight.detach(), None), (xl,), dy)
            if need_w or need_b:
                dw, db = _weight_grads(op, ctx, x, weight, bias, dy, need_w, need_b)
        return dx, dw, db, None, None, None, None, None, None, None


def _weight_grads(op, ctx, x, weight, bias, dy, need_w: bool, need_b: bool):
    """(dW, dB) of one process: the strict kernel's backward on the rows gathered in packed order ("gather"), or the
    fault: each rank's own rows, the rank partials all-gathered and summed in rank order ("rank_partials")."""
    mesh, rows, point = ctx.mesh, ctx.rows, f"{ctx.point} (weight gradient)"
    if ctx.weight_grad == "gather":
        x = gather_rows(x.detach(), mesh, rows, dim=1, point=point)
        dy = gather_rows(dy, mesh, rows, dim=1, point=point)
    wl = weight.detach().requires_grad_(need_w)
    bl = bias.detach().requires_grad_(need_b) if bias is not None else None
    leaves = [t for t in (wl, bl) if t is not None and t.requires_grad]
    grads = list(torch.autograd.grad(op(x.detach(), wl, bl), leaves, dy))
    if ctx.weight_grad == "rank_partials":
        summed = []
        for g in grads:
            parts = _all_gather(g.contiguous(), mesh, rows.axis)
            acc = parts[0]
            for p in parts[1:]:
                acc = acc + p
            summed.append(acc)
        grads = summed
    dw = grads.pop(0) if need_w else None
    db = grads.pop(0) if need_b else None
    return dw, db


def linear(op_name: str, ops: runtime.Ops, point: str, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None, mesh: Mesh, rows: RowShards, weight_grad: str = "gather") -> torch.Tensor:
    """A block projection on this rank's rows (x (B, S_r, K)); with a trainable weight or bias under grad, the
    `RowGatheredLinear` backward; otherwise the op table's call (the kernel's own row-invariant backward)."""
    if weight_grad not in WEIGHT_GRADS:
        raise DistributedError(f"weight_grad={weight_grad!r}: must be one of {WEIGHT_GRADS}")

    def forward_op(x_, w_, b_):
        return ops.dispatch(op_name, point, (x_, w_, b_))

    if not _needs((weight, bias)):
        return forward_op(x, weight, bias)
    mine = rows.sizes[mesh.local_rank(rows.axis)]
    if x.dim() != 3 or x.shape[1] != mine:
        raise DistributedError(f"{point}: a trainable projection on topology {mesh.topology.name} takes this rank's "
                               f"rows (B, {mine}, K), got x of shape {tuple(x.shape)}")
    if not ops.fusable(op_name):
        raise DistributedError(f"{point}: an override of {op_name} cannot train on topology {mesh.topology.name} "
                               "(its weight gradient is the strict kernel's over the gathered rows)")
    return RowGatheredLinear.apply(x, weight, bias, forward_op, op_name, ops.mode, mesh, rows, weight_grad, point)


# ------------------------------------------------------------------------------------------------ the rules
def trainable_problem(model: nn.Module) -> str:
    """Why the trainable parameters of `model` have no declared mesh gradient ("" when they all do): a parameter
    must belong to a projection (`layers.Linear`) inside a transformer block other than its AdaLN table, or to a module
    that runs replicated before the block-0 cut (`REPLICATED_PREFIXES`)."""
    from ..model.layers import Linear

    served = set()
    for path, module in model.named_modules():
        parts = path.split(".")
        if (isinstance(module, Linear) and len(parts) > 2 and parts[0] == "transformer_blocks"
                and parts[2] != "adaln_proj"):
            served.update(f"{path}.{n}" for n, _ in module.named_parameters(recurse=False))
    for name, p in model.named_parameters():
        if p.requires_grad and name not in served and not name.startswith(REPLICATED_PREFIXES):
            return (f"trainable parameter {name!r} has no declared mesh gradient (its gradient reduces over rows "
                    "that CP splits outside a block projection); train LoRA factors of the block or refiner "
                    "projections, or freeze it")
    return ""


def training_problem(placement: Any) -> str:
    """Why a forward with grad cannot run on `placement` ("" when it can): CP and / or TP (`tp_autograd.py`), with or
    without SP (its row cuts and gathers carry this module's row backward), no probe faults, no gradient checkpointing, every trainable parameter served (`trainable_problem`; under TP only
    LoRA factors, `tp_autograd.trainable_problem`)."""
    t = placement.topology
    name = t.name
    faults = getattr(placement, "faults", None)
    if faults is not None and faults.to_dict():
        return f"topology {name}: faults {faults.to_dict()} are forward-only probes; a training forward takes none"
    if getattr(placement.model, "gradient_checkpointing", False):
        return (f"topology {name}: gradient checkpointing recomputes blocks outside the sharded forward; train on a "
                "mesh without it (it is byte-neutral)")
    if t.tp > 1:
        from .tp_autograd import trainable_problem as tp_problem

        problem = tp_problem(placement.model, name)
        if problem:
            return problem
    return trainable_problem(placement.model)
