"""The backward of the TP collectives: a LoRA step on a TP (and TP x CP) mesh, byte-equal to one process.

Why the forward's argument does not carry over (see `autograd.py` for CP): a column-parallel layer's forward is
byte-equal because output columns are independent, but its input gradient dX = dY @ W folds over ALL N outputs in
one accumulator (kernels/gemm.py "Backward"), and a row-parallel layer's dX folds over all N outputs of the full
weight. TP ranks hold N / tp (column-parallel) or K / tp (row-parallel) of each weight, so any sum of rank partials
re-associates that fold: not byte-equal. The form used here is the one-process computation on the one-process
shapes, reached by gathers (bytes only) in the declared order, never a reduce-scatter or an all-reduce.

Each piece (frozen base weights; LoRA factors replicated whole on every rank, so every rank holds the one-process
gradient of every factor and the optimizer stays in step without a gradient collective)
- `ColumnParallel` (q / k / v, ff.net.0.proj; x replicated, W_r the rank's rows, groups 1 or 2 for [value; gate]):
  forward: the strict op on (x, W_r) -- the rank's columns. Backward: all_gather dY's column blocks and W's row
  blocks over the TP group in rank order (`cat_grouped`: the full (.., N) gradient and the full (N, K) weight, the
  one-process layouts), then dX = linear(dY, W^T): the kernel's own dX form (kernels/gemm.py "Backward": dX runs
  `linear`'s kernel and tiles on (dY, W^T), the Narrow rule from W^T's shape) on the full shapes, so the one-process
  bytes, identical on every rank (the replicated input's gradient).
- `RowParallel` (attn.to_out.0, ff.net.2; x the rank's K / tp columns): forward: `collectives.row_parallel_tree`
  (the declared 8-chunk tree: full y on every rank). Backward: dY is replicated (everything after the layer runs
  replicated); W gathered whole (k_chunks: column blocks, n_split: row blocks, rank order), dX = linear(dY, W^T) on
  the full shapes, and the rank keeps its K columns: a slice, nothing added.
- `TakeColumns` (a split: the LoRA B output of a column-parallel layer): every rank computes B's full (.., N) output
  by the strict op on the full factor, then keeps its columns (grouped like the base's). Backward: the all_gather of
  the column gradients (`cat_grouped`) -> the full dY, and the strict op's own backward on the full shapes (dB over
  all rows, dh over all N).
- `GatherColumns` (a gather: the LoRA A input of a row-parallel layer): the rank's K / tp input columns all-gathered
  to the full (.., K) rows, so A's product runs on the one-process shapes. Backward: the incoming gradient is the
  same on every rank, the rank keeps its columns.
- A LoRA A of a column-parallel layer and B of a row-parallel one see replicated, full tensors: no collective.
With CP as well (TP x CP), the trainable factors at the block points keep CP's rule (`autograd.linear`: dW over the
rows gathered in packed order) inside these TP pieces: the two compose because CP moves rows and TP columns.

Costs (per backward, per column-parallel layer of N outputs over K, S rows on the rank): the dY gather
(tp - 1) / tp * S * N elements, the weight gather (tp - 1) / tp * N * K (transient: at H3Config.full() widths
ff.net.0.proj's 28,672 x 5,376 bf16 is 308 MB), and the full dX (S * N * K multiply-adds) on EVERY rank: TP splits
the forward, not this backward's dX. The column-split form (rank j computes dX[:, K_j] from an all_to_all of weight
blocks) is cheaper, but its bytes rest on the dX kernel being invariant to the output width K / tp, which the Narrow
rule (chosen from the weight's shape) does not promise; it is left open.

SP (the residual stream of a CP shard split over its TP ranks): the row-parallel layers whose output joins the
stream return the rank's SP rows (`out_rows`), so `RowParallel`'s backward first all-gathers dY's rows over the TP
group (rank order = the shard's row order; bytes only) and computes the same one-process dX on all of the shard's
rows; a LoRA B of such a layer runs on all the shard's rows (replicated over TP) and keeps the rank's rows
(`autograd.scatter_rows` over the SP shards: its backward is the all_gather of the rows' gradients). The SP cut at
block 0 and the SP gathers before attention / the FFN and at the output carry `autograd.py`'s row backward (gather
the gradient rows; take the rank's slice of a replicated gradient), never a reduce-scatter sum.
"""

from __future__ import annotations

import torch

from ..execution import runtime
from .collectives import _all_gather, gather_columns, gather_rows
from .mesh import Mesh
from .plan import is_lora_factor, plan_entry
from .shards import RowShards, cat_grouped, split_grouped

TRAINABLE_STYLES = ("colwise_heads", "colwise_swiglu", "rowwise_tree", "replicated")


def _full_weight(w: torch.Tensor, mesh: Mesh, dim: int, groups: int, point: str) -> torch.Tensor:
    """The one-process weight from the TP ranks' shards along `dim` (rank order, grouped layout)."""
    return cat_grouped(_all_gather(w.detach().contiguous(), mesh, "tp"), dim, groups, name=f"{point} (backward)")


def _dx(mode: str, dy: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dX = dY @ W as the strict kernel's backward computes it: `linear(dY, W^T)` (kernels/gemm.py "Backward")."""
    with runtime.use_mode(mode):
        return runtime.mode_op("linear")(dy.to(dtype).contiguous(), weight.t())


class ColumnParallel(torch.autograd.Function):
    """y_r = op(x, W_r, b_r) (the rank's columns); backward: dX on the gathered dY and weight (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, forward_op, mode: str, mesh: Mesh, groups: int, point: str):
        ctx.save_for_backward(weight)
        ctx.mode, ctx.mesh, ctx.groups, ctx.point, ctx.dtype = mode, mesh, groups, point, x.dtype
        return forward_op(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            point = f"{ctx.point} (backward)"
            dy_full = gather_columns(dy.contiguous(), ctx.mesh, ctx.groups, point=point)
            dx = _dx(ctx.mode, dy_full, _full_weight(weight, ctx.mesh, 0, ctx.groups, ctx.point), ctx.dtype)
        return dx, None, None, None, None, None, None, None


class RowParallel(torch.autograd.Function):
    """y = row_parallel_tree(x_r, W_r, b) (full y on every rank); backward: the rank's columns of the one-process
    dX from the replicated dY and the gathered weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, forward_op, mode: str, mesh: Mesh, point: str,
                out_rows: RowShards | None = None):
        ctx.save_for_backward(weight)
        ctx.mode, ctx.mesh, ctx.point, ctx.dtype, ctx.k = mode, mesh, point, x.dtype, x.shape[-1]
        ctx.out_rows = out_rows
        return forward_op(x, weight, bias)  # the placement's row_parallel_tree

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            mesh = ctx.mesh
            dy = dy.contiguous()
            if ctx.out_rows is not None:  # SP: the rank's rows of dY -> every row of the CP shard (bytes only)
                dy = gather_rows(dy, mesh, ctx.out_rows, dim=1, point=f"{ctx.point} (backward)")
            dim = -1 if mesh.topology.strategy == "k_chunks" else 0  # k_chunks: W (N, K/tp); n_split: W (N/tp, K)
            full = _dx(ctx.mode, dy, _full_weight(weight, mesh, dim, 1, ctx.point), ctx.dtype)
            r = mesh.local_rank("tp")
            dx = full.narrow(-1, r * ctx.k, ctx.k).contiguous()
        return dx, None, None, None, None, None, None, None


class TakeColumns(torch.autograd.Function):
    """The rank's grouped columns of a full (.., N) tensor; backward: the all_gather of the column gradients."""

    @staticmethod
    def forward(ctx, y, mesh: Mesh, groups: int, point: str):
        ctx.mesh, ctx.groups, ctx.point = mesh, groups, point
        return split_grouped(y, -1, groups, mesh.size("tp"), mesh.local_rank("tp"), name=point)

    @staticmethod
    def backward(ctx, grad):
        return gather_columns(grad.contiguous(), ctx.mesh, ctx.groups, point=f"{ctx.point} (backward)"), \
            None, None, None


class GatherColumns(torch.autograd.Function):
    """All TP ranks' columns of (.., K / tp) -> (.., K) in rank order; backward: the rank's columns of the
    replicated gradient."""

    @staticmethod
    def forward(ctx, x, mesh: Mesh, point: str):
        ctx.mesh, ctx.point, ctx.k = mesh, point, x.shape[-1]
        return gather_columns(x.contiguous(), mesh, 1, point=point)

    @staticmethod
    def backward(ctx, grad):
        r = ctx.mesh.local_rank("tp")
        return grad.narrow(-1, r * ctx.k, ctx.k).contiguous(), None, None


def take_columns(y: torch.Tensor, mesh: Mesh, groups: int, point: str) -> torch.Tensor:
    """The rank's grouped columns of `y`; with grad, the split whose backward all-gathers (`TakeColumns`)."""
    if torch.is_grad_enabled() and y.requires_grad:
        return TakeColumns.apply(y, mesh, groups, point)
    return split_grouped(y, -1, groups, mesh.size("tp"), mesh.local_rank("tp"), name=point)


def full_columns(x: torch.Tensor, mesh: Mesh, point: str) -> torch.Tensor:
    """All TP ranks' columns of `x` in rank order; with grad, the gather whose backward slices (`GatherColumns`)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return GatherColumns.apply(x, mesh, point)
    return gather_columns(x.contiguous(), mesh, 1, point=point)


def trainable_problem(model: torch.nn.Module, topology: str) -> str:
    """Why the trainable parameters of `model` have no declared TP gradient ("" when they all do): under TP only
    LoRA factors train, on a layer whose plan style is column-parallel (heads, SwiGLU), row-parallel or replicated
    (a colwise_adaln table is gathered forward-only)."""
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not is_lora_factor(name):
            return (f"trainable parameter {name!r} on topology {topology}: under TP only LoRA factors train (base "
                    "weights are sharded and have no declared TP gradient); freeze it")
        path = name.split(".lora_")[0]
        style = plan_entry(f"{path}.weight")[1].style
        if style not in TRAINABLE_STYLES:
            return (f"trainable parameter {name!r} on topology {topology}: a LoRA factor on a {style} layer has no "
                    f"declared TP gradient (styles {list(TRAINABLE_STYLES)} train)")
    return ""
