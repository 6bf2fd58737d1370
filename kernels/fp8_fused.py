"""Fused FP8 producers for `--mode fast` (h3lab/execution/fast.py): the op that makes a projection's input also emits it as
per-row float8_e4m3fn codes and scales, so the projection skips its own quantiser launch. NOT strict; no op is
registered.

Contract (one program per row of the (M, D) / (M, 2F) input; the whole row in one BLOCK = next power of two,
refused above MAX_COLS; float32 arithmetic; int64 row offsets)
--------
`norm_modulate_quant(x, weight, eps, scale, shift, index)`: x (B, S, D) bfloat16, unit column stride; weight (D,);
scale/shift tables (R, D) (any row stride, unit column stride); index (S,) int64 -> (y (B, S, D) bfloat16,
q (B*S, D) float8_e4m3fn, s (B*S, 1) float32) where, per row r = (b, s) and i = index[s],
    y = bf16( x * 1/sqrt_rn(mean(x*x) + eps) * weight * (1 + scale[i]) + shift[i] )     (all float32, one rounding:
                                                                                         `_strict_math.round_to`)
and (q, s) quantise y exactly as `fp8_quant.quantize_rows(y)` does (the amax of the rounded bfloat16 row, div_rn,
`e4m3_code`). The sum of squares is Triton's tree over the row (not torch's order: y can differ from a float32
torch reference by one bfloat16 rounding step); the codes and scales are a function of y alone.
`swiglu_quant(h)`: h (..., 2F) bfloat16, unit column stride, [value; gate] halves -> (y (..., F) bfloat16, q, s)
with y = bf16(value * gate / (1 + exp(-gate))) in float32, and (q, s) of y as above.
The bfloat16 rounding is `_strict_math.round_to` (integer arithmetic: Triton's CPU interpreter truncates the
float32 -> bfloat16 cast; the GPU rounds to nearest even, as it does). The torch references are
`h3lab.execution.fast.norm_modulate_quant_reference` / `swiglu_quant_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._strict_math import round_to
from .fp8_quant import AMAX_FLOOR, FP8_MAX, row_scale, scaled_code

MAX_COLS = 16384  # one row per program, held in registers


@triton.jit
def _quantize_row(y, q_row, s_ptr, row, cols, ok, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """Store the e4m3 codes and the scale of one float32 row y (already rounded to bfloat16)."""
    amax = tl.max(tl.where(ok, tl.abs(y), 0.0), axis=0)
    scale = row_scale(amax, FP8_MAX, AMAX_FLOOR)
    tl.store(q_row + cols, scaled_code(y, scale, FP8_MAX), mask=ok)
    tl.store(s_ptr + row, scale)


@triton.jit
def _norm_modulate_quant_kernel(x_ptr, w_ptr, sc_ptr, sh_ptr, idx_ptr, y_ptr, q_ptr, s_ptr, S, D, stride_xb,
                                stride_xs, stride_sc, stride_sh, eps, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                                AMAX_FLOOR: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    cols = tl.arange(0, BLOCK)
    ok = cols < D
    x = tl.load(x_ptr + b * stride_xb + s * stride_xs + cols, mask=ok, other=0.0).to(tl.float32)
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps))
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    i = tl.load(idx_ptr + s).to(tl.int64)
    sc = tl.load(sc_ptr + i * stride_sc + cols, mask=ok, other=0.0).to(tl.float32)
    sh = tl.load(sh_ptr + i * stride_sh + cols, mask=ok, other=0.0).to(tl.float32)
    y = round_to(x * inv * w * (1.0 + sc) + sh, tl.bfloat16)
    tl.store(y_ptr + row * D + cols, y.to(tl.bfloat16), mask=ok)
    _quantize_row(y, q_ptr + row * D, s_ptr, row, cols, ok, FP8_MAX, AMAX_FLOOR)


@triton.jit
def _swiglu_quant_kernel(h_ptr, y_ptr, q_ptr, s_ptr, F, stride_h, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                         AMAX_FLOOR: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < F
    value = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
    gate = tl.load(h_ptr + row * stride_h + F + cols, mask=ok, other=0.0).to(tl.float32)
    y = round_to(value * tl.math.div_rn(gate, 1.0 + tl.exp(-gate)), tl.bfloat16)
    tl.store(y_ptr + row * F + cols, y.to(tl.bfloat16), mask=ok)
    _quantize_row(y, q_ptr + row * F, s_ptr, row, cols, ok, FP8_MAX, AMAX_FLOOR)


def _block(cols: int, what: str) -> int:
    if not 1 <= cols <= MAX_COLS:
        raise ValueError(f"{what} has {cols} columns per row: the fused FP8 producer holds a row in one program "
                         f"(1..{MAX_COLS} columns)")
    return max(16, triton.next_power_of_2(cols))


def _outputs(rows: int, cols: int, like: torch.Tensor):
    return (torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=like.device),
            torch.empty((rows, 1), dtype=torch.float32, device=like.device))


def _bf16_rows(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
        raise ValueError(f"{name} is {t.dtype} with column stride {t.stride(-1)}: the fused FP8 producer takes "
                         "bfloat16 rows with unit column stride")


def norm_modulate_quant(x, weight, eps: float, scale, shift, index):
    """(y, q, s) of the AdaLN pre-norm (see the module contract)."""
    _bf16_rows(x, "x")
    if x.dim() != 3:
        raise ValueError(f"x has shape {list(x.shape)}: norm_modulate_quant takes (batch, rows, features)")
    B, S, D = x.shape
    block = _block(D, "x")
    for name, t in (("scale", scale), ("shift", shift)):
        if t.dim() != 2 or t.shape[1] != D or t.stride(1) != 1:
            raise ValueError(f"{name} table has shape {list(t.shape)} and strides {t.stride()}: must be (R, {D}) "
                             "with unit column stride")
    if index.dtype != torch.int64 or index.shape != (S,):
        raise ValueError(f"index is {index.dtype} {list(index.shape)}: must be int64 of shape ({S},)")
    weight = weight.contiguous()
    y = torch.empty((B, S, D), dtype=torch.bfloat16, device=x.device)
    q, s = _outputs(B * S, D, x)
    _norm_modulate_quant_kernel[(B * S,)](
        x, weight, scale, shift, index, y, q.view(torch.uint8), s, S, D, x.stride(0), x.stride(1), scale.stride(0),
        shift.stride(0), float(eps), BLOCK=block, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR,
        num_warps=8 if block >= 4096 else 4)
    return y, q, s


def swiglu_quant(h):
    """(y, q, s) of SwiGLU on the fc1 output h (..., 2F) (see the module contract)."""
    _bf16_rows(h, "h")
    if h.shape[-1] % 2:
        raise ValueError(f"h has {h.shape[-1]} columns: SwiGLU needs an even [value; gate] width")
    F = h.shape[-1] // 2
    block = _block(F, "h's value half")
    h2 = h.reshape(-1, h.shape[-1])
    if h2.stride(1) != 1:
        h2 = h2.contiguous()
    M = h2.shape[0]
    y = torch.empty((M, F), dtype=torch.bfloat16, device=h.device)
    q, s = _outputs(M, F, h)
    _swiglu_quant_kernel[(M,)](h2, y, q.view(torch.uint8), s, F, h2.stride(0), BLOCK=block, FP8_MAX=FP8_MAX,
                               AMAX_FLOOR=AMAX_FLOOR, num_warps=16 if block >= 8192 else (8 if block >= 2048 else 4))
    return y.reshape(*h.shape[:-1], F), q, s
