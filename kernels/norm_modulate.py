"""Strict fused RMSNorm + AdaLN modulation: `norm_modulate(x, weight, eps, scale, shift, index)`, forward and backward.

Serves the blocks' `modulate(rms_norm(x, w, eps), scale, shift, index)` pairs on (B, S, hidden) in one pass: the
normalised rows never go to memory in the forward. It is the composition of the two strict kernels, not a new
evaluation of the math: it calls their shared `@triton.jit` pieces with their tiles, so every byte is theirs.

Contract
--------
math        out = round(round(y * round(1 + scale[i])) + shift[i]), i = index[s] (modulate's contract), on
            y = round((x * rstd) * w), rstd = 1 / sqrt(sum(x*x) / D + eps) (rms_norm's contract); `round` rounds to
            x.dtype (nearest, ties to even), every step in float32 from the exact upcast operands.
            **Bit-equal to the unfused strict chain** `modulate.modulate(rms_norm.rms_norm(x, w, eps), scale, shift,
            index)` in every served dtype, shape and batch, forward and backward (dx, dw, dscale, dshift): y is
            rounded to x.dtype exactly where the chain stores it, and the same helpers (`rms_norm._normalize_rows`,
            `modulate._modulate_tile`, `modulate._gather_tile`) run on the same values.
accumulator float32 (row statistics, the dw and table-gradient sums).
reduction   sum(x*x) along the row by rms_norm's single (ROWS, BLOCK_D) tile and one `tl.sum(axis=1)`, with rms_norm's
            (ROWS, BLOCK_D, num_warps) for the same D: the same tree, fixed by D only. The modulation is elementwise.
IEEE ops    div_rn / sqrt_rn for the mean and rstd, no FMA contraction (`enable_fp_fusion=False` on every launch).
backward    the chain's backward, run by the chain's launchers: dy = round(dout * round(1 + scale[i]))
            (`modulate._row_scale`), then dx, dw = `rms_norm._backward(x, w, rstd, dy)`; dscale[r] = sum dout * y,
            dshift[r] = sum dout over the rows reading table row r (`modulate._table_grads`, its fixed order, no
            atomics). Saved: x, w, scale, index and the float32 rstd (one per row) -- not y: y is recomputed by the
            rms_norm forward kernel (bit-identical) only when dscale is needed, which saves the (B, S, D) activation
            the unfused chain keeps. `ctx.needs_input_grad` skips every unneeded launch.
tiles       forward: rms_norm's `_tile(D)`: BLOCK_D = next_pow2(D), ROWS = clamp(8192 // BLOCK_D, 1, 64), num_warps
            = 4 / 8 / 16 for BLOCK_D <= 256 / <= 8192 / larger; one program = ROWS whole rows. Backward: rms_norm's
            tiles for dx / dw, modulate's (BLOCK_D <= 128, CHUNK = 32, GROUP = 16) for the table gradients.
index       as modulate: int64 (S,), 0 <= index < R, checked on the host once per index tensor (modulate's cache),
            clamped in the kernel.
refused     whatever rms_norm or modulate refuses (their validators run, messages prefixed `norm_modulate:`): dtypes
            other than float32 / bfloat16 / float16 or mixed among x, w, scale, shift; x not a non-empty contiguous
            (B, S, D); D > 16384; w not contiguous (D,) (None is served); eps not a positive number; tables not
            (R, D) with unit column stride (row-strided `chunk` views served) or of different R; index not int64
            (S,) or out of range; mixed devices; CPU without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import modulate, registry, rms_norm
from h3kernels._launch import lean
from h3kernels._strict_math import round_to
from h3kernels.modulate import _gather_tile, _modulate_tile
from h3kernels.rms_norm import _normalize_rows

KERNEL_ID = "h3kernels.norm_modulate.norm_modulate.v1"


# ---------------------------------------------------------------------------------------------------- kernel
@lean
@triton.jit
def _norm_modulate_fwd_kernel(
    x_ptr, w_ptr, scale_ptr, shift_ptr, index_ptr, out_ptr, rstd_ptr, n_rows, S, R, scale_stride, shift_stride, eps,
    D: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat b * S + s
    cols = tl.arange(0, BLOCK_D)  # the whole row
    row_ok = rows < n_rows
    offs, t, mask = _gather_tile(index_ptr, rows, row_ok, S, R, cols, D)
    DT = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
    y, rstd = _normalize_rows(x, w_ptr, cols, eps, D, HAS_WEIGHT)
    y = round_to(y, DT)  # the rms_norm output as the unfused chain stores it
    out = _modulate_tile(y, scale_ptr, shift_ptr, t, scale_stride, shift_stride, cols, mask, DT)
    tl.store(out_ptr + offs, out.to(DT), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


# ------------------------------------------------------------------------------------------------- launcher
def _validate(x, weight, eps, scale, shift, index) -> tuple[dict, dict]:
    """(rms_norm tile, modulate index entry): both validators, so the fused op refuses what either refuses."""
    op = "norm_modulate"
    tile = rms_norm._validate(x, weight, eps, op=op)
    return tile, modulate._validate_modulate(x, scale, shift, index, op=op)


def check(x, weight, eps, scale, shift, index) -> dict:
    tile, _ = _validate(x, weight, eps, scale, shift, index)
    table = f"table:BLOCK_D<={modulate.BLOCK_TABLE},CHUNK={modulate.CHUNK},GROUP={modulate.GROUP}"
    return {"kernel_id": KERNEL_ID, "tile": f"{rms_norm._tile_str(tile)};{table}", "acc_dtype": "float32"}


def _forward(x, weight, eps, scale, shift, index, tile: dict):
    b, s, d = x.shape
    out = torch.empty_like(x)
    rstd = torch.empty(b * s, dtype=torch.float32, device=x.device)
    _norm_modulate_fwd_kernel[(triton.cdiv(b * s, tile["ROWS"]),)](
        x, weight if weight is not None else x, scale, shift, index, out, rstd, b * s, s, scale.shape[0],
        scale.stride(0), shift.stride(0), float(eps),
        D=d, HAS_WEIGHT=weight is not None, ROWS=tile["ROWS"], BLOCK_D=tile["BLOCK_D"],
        num_warps=tile["num_warps"], enable_fp_fusion=False,
    )
    return out, rstd


class _NormModulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, scale, shift, index, tile, entry):
        out, rstd = _forward(x, weight, eps, scale, shift, index, tile)
        ctx.save_for_backward(x, weight, scale, index, rstd)
        ctx.eps, ctx.tile, ctx.entry = eps, tile, entry
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, scale, index, rstd = ctx.saved_tensors
        need_x, need_w, _, need_scale, need_shift = ctx.needs_input_grad[:5]
        dout = dout.contiguous()
        dx = dw = dscale = dshift = None
        if need_scale or need_shift:
            y = rms_norm._forward(x, weight, ctx.eps, ctx.tile)[0] if need_scale else None  # recomputed, same bytes
            dscale, dshift = modulate._table_grads(
                dout, y, index, ctx.entry, scale.shape[0], scale.dtype, need_scale, need_shift
            )
        if need_x or need_w:
            dy = modulate._row_scale(dout, scale, index, add_one=True)  # gradient reaching the rms_norm output
            dx, dw = rms_norm._backward(x, weight, rstd, dy, ctx.tile)
        return (dx if need_x else None), (dw if need_w else None), None, dscale, dshift, None, None, None


def norm_modulate(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor, shift: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """Strict `modulate(rms_norm(x, weight, eps), scale, shift, index)` in one pass (see the module contract)."""
    tile, entry = _validate(x, weight, eps, scale, shift, index)
    return _NormModulate.apply(x, weight, eps, scale, shift, index, tile, entry)


# ------------------------------------------------------------------------------------------------ reference
def reference(x, weight, eps, scale, shift, index):
    """The float32 torch reference (float64 in, float64 out for a truth): both references chained, no rounding."""
    return modulate.reference_modulate(rms_norm.reference(x, weight, eps), scale, shift, index)


registry.register("norm_modulate", run=norm_modulate, check=check)
