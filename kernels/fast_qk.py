"""Per-head RMSNorm and partial RoPE on (B, S, H, D) in one launch each, for `--mode fast` (h3lab/execution/fast.py). NOT strict:
no op is registered and no bytes are promised (float32 arithmetic, one bfloat16 rounding, where torch's `off` ops
round after every op).

Contract (one program per (row, block of HB heads); the head's D channels in one BLOCK_D = next power of two;
int64 row offsets)
--------
`head_rms_norm(x, weight, eps)`: x (B, S, H, D) bfloat16, unit stride on D; weight (D,) -> y (B, S, H, D) bfloat16
contiguous, y = bf16(x / sqrt(mean_D(x*x) + eps) * weight) in float32 (the Q/K norm `rms_norm` op on heads).
`rope(x, cos, sin)`: x (B, S, H, D) bfloat16, unit stride on D; cos, sin (S, R) float32 with R even, R <= D ->
y (B, S, H, D) bfloat16 contiguous: channels j < R: x[j] * c[j] + r[j] * s[j] with r = rotate_half(x[:R])
(r[j] = -x[j + R/2] for j < R/2, x[j - R/2] after), c and s the tables rounded to bfloat16 first (as the `rope`
op casts them), float32 arithmetic, one rounding; channels j >= R pass through. The bfloat16 rounding is
`_strict_math.round_to` (exact on the interpreter too). The references are `h3lab.execution.runtime.rms_norm` / `rope` (the
`off` ops). Refused (ValueError, one line): other dtypes or ranks, a non-unit D stride, tables of the wrong shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._strict_math import round_to

HB = 8  # heads per program


@triton.jit
def _head_tile(x_ptr, S, H, D, stride_b, stride_s, stride_h, HB: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile: its packed row (int64), the row's position s, its HB heads, the D channels, the in-bounds
    mask, and the pointers to each head's channel 0 in x."""
    row = tl.program_id(0).to(tl.int64)
    b, s = row // S, row % S
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    cols = tl.arange(0, BLOCK_D)
    ok = (heads[:, None] < H) & (cols[None, :] < D)
    return row, s, heads, cols, ok, x_ptr + b * stride_b + s * stride_s + heads[:, None].to(tl.int64) * stride_h


@triton.jit
def _head_rms_norm_kernel(x_ptr, w_ptr, y_ptr, S, H, D, stride_b, stride_s, stride_h, eps,
                          HB: tl.constexpr, BLOCK_D: tl.constexpr):
    row, s, heads, cols, ok, base = _head_tile(x_ptr, S, H, D, stride_b, stride_s, stride_h, HB, BLOCK_D)
    x = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = round_to(x * inv[:, None] * w[None, :], tl.bfloat16)
    tl.store(y_ptr + (row * H + heads[:, None]) * D + cols[None, :], y.to(tl.bfloat16), mask=ok)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, S, H, D, R, stride_b, stride_s, stride_h, stride_cs,
                 HB: tl.constexpr, BLOCK_D: tl.constexpr):
    row, s, heads, cols, ok, base = _head_tile(x_ptr, S, H, D, stride_b, stride_s, stride_h, HB, BLOCK_D)
    x = tl.load(base + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    half = R // 2
    rot = cols < R
    partner = tl.where(cols < half, cols + half, cols - half)
    xp = tl.load(base + partner[None, :], mask=ok & rot[None, :], other=0.0).to(tl.float32)
    xp = tl.where((cols < half)[None, :], -xp, xp)
    c = round_to(tl.load(cos_ptr + s * stride_cs + cols, mask=rot, other=1.0), tl.bfloat16)
    sn = round_to(tl.load(sin_ptr + s * stride_cs + cols, mask=rot, other=0.0), tl.bfloat16)
    y = tl.where(rot[None, :], round_to(x * c[None, :] + xp * sn[None, :], tl.bfloat16), x)
    tl.store(y_ptr + (row * H + heads[:, None]) * D + cols[None, :], y.to(tl.bfloat16), mask=ok)


def _heads(x: torch.Tensor, what: str) -> tuple[int, int, int, int]:
    if x.dtype != torch.bfloat16 or x.dim() != 4 or x.stride(-1) != 1:
        raise ValueError(f"{what}: x is {x.dtype} of rank {x.dim()} with last stride {x.stride(-1)}: must be "
                         "bfloat16 (B, S, H, D) with unit stride on D")
    return tuple(x.shape)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of x (B, S, H, D) (see the module contract)."""
    B, S, H, D = _heads(x, "head_rms_norm")
    if weight.shape != (D,):
        raise ValueError(f"head_rms_norm: weight has shape {list(weight.shape)}: must be ({D},)")
    y = torch.empty((B, S, H, D), dtype=torch.bfloat16, device=x.device)
    _head_rms_norm_kernel[(B * S, triton.cdiv(H, HB))](x, weight.contiguous(), y, S, H, D, x.stride(0), x.stride(1),
                                                      x.stride(2), float(eps), HB=HB,
                                                      BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotate-half RoPE of x (B, S, H, D) (see the module contract)."""
    B, S, H, D = _heads(x, "rope")
    R = cos.shape[-1] if cos.dim() == 2 else -1
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != S or R % 2 or R > D \
            or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"rope: cos/sin are {cos.dtype} {list(cos.shape)} / {sin.dtype} {list(sin.shape)}: must be "
                         f"float32 ({S}, R) with R even and <= {D}")
    cos, sin = cos.contiguous(), sin.contiguous()
    y = torch.empty((B, S, H, D), dtype=torch.bfloat16, device=x.device)
    _rope_kernel[(B * S, triton.cdiv(H, HB))](x, cos, sin, y, S, H, D, R, x.stride(0), x.stride(1), x.stride(2),
                                             cos.stride(0), HB=HB, BLOCK_D=triton.next_power_of_2(D), num_warps=4)
    return y
