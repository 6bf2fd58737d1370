"""Strict fused Q/K RMSNorm + partial RoPE: `qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)` -> (q, k).

Serves the attention's `rope(rms_norm(q, wq, eps), cos, sin)` and the same for k on (B, S, H, D) in one launch: each
program reads whole head rows of q or k, normalises them with the learned weight, rotates the leading R channels and
writes the result; the normalised rows never go to memory. It is the composition of the strict `rms_norm` and `rope`
kernels, not a new evaluation of the math: the row statistic comes from `rms_norm._normalize_rows` on rms_norm's tile
for D, and every step rounds where the unfused chain stores a tensor.

Contract
--------
math        y = round((x * rstd) * w), rstd = 1 / sqrt(sum(x*x) / D + eps) (rms_norm's contract), then rope's:
            c = round(cos), s = round(sin); out_i = round(round(y_i * c_i) + round(-y_{i+R/2} * s_i)) for i < R/2,
            out_i = round(round(y_i * c_i) + round(y_{i-R/2} * s_i)) for R/2 <= i < R, out_i = y_i for i >= R.
            `round` rounds to x.dtype (nearest, ties to even), every step in float32 from exact upcast operands.
            The partner y_p is normalised again from its own load with the row's one rstd: the same float32 ops on
            the same values, so it equals the stored y_p bit for bit.
            **Bit-equal to the unfused strict chain** `rope.rope(rms_norm.rms_norm(x, w, eps), cos, sin)` for q and
            for k, forward and backward, in every served dtype, shape and batch (tests/kernels/test_qk_norm_rope.py).
accumulator float32 (row statistic).
reduction   sum(x*x) along a head row by rms_norm's single (ROWS, BLOCK_D) tile and one `tl.sum(axis=1)` with rms_norm's
            (ROWS, BLOCK_D, num_warps) for the same D (`rms_norm._tile(D)`; head 128 -> (64, 128), 4 warps): the same
            tree, fixed by D only, never by the row count, batch size or row position. RoPE is elementwise.
IEEE ops    div_rn / sqrt_rn for the mean and rstd, no FMA contraction (`enable_fp_fusion=False`).
launch      one launch for both tensors: grid (cdiv(B*S*H, ROWS), 2), program_id(1) 0 = q, 1 = k.
backward    the unfused chain's backward, recomputed: the strict rms_norm and rope autograd functions are run again on
            the saved inputs (bit-identical forward) and differentiated by autograd, so dq, dk, dwq, dwk are the
            chain's bytes. Saved: q, k and the weights (not the normalised rows).
refused     whatever rms_norm or rope refuses for q or k (their validators run, messages prefixed `qk_norm_rope:`):
            dtypes other than float32 / bfloat16 / float16; q, k not contiguous non-empty (B, S, H, D) of one shape and
            dtype; a weight not a contiguous (D,) of that dtype (None is served); eps not a positive number; cos / sin
            not (S, R) contiguous tables with R even and 0 < R <= D, or requiring grad; D > 16384; mixed devices;
            CPU without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import registry, rms_norm, rope
from h3kernels._launch import lean
from h3kernels._offsets import tile_offsets
from h3kernels._strict_math import round_to
from h3kernels.rms_norm import _normalize_rows

KERNEL_ID = "h3kernels.qk_norm_rope.qk_norm_rope.v1"
OP = "qk_norm_rope"


# ---------------------------------------------------------------------------------------------------- kernel
@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, rows, n_rows, S, eps,
                    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    """Normalise and rotate a (ROWS, BLOCK_D) tile of flat (b, s, h) head rows of one tensor."""
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    half = R // 2
    first = cols < half  # x1 channels
    rot = cols < R  # rotated channels; the rest pass through
    partner = tl.where(first, cols + half, cols - half)
    mask = row_ok[:, None] & (cols < D)[None, :]
    rmask = row_ok[:, None] & rot[None, :]
    DT = out_ptr.dtype.element_ty
    offs = tile_offsets(rows, D, cols, 1)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D) whole head rows
    y, rstd = _normalize_rows(x, w_ptr, cols, eps, D, HAS_WEIGHT)
    y = round_to(y, DT)  # the rms_norm output as the unfused chain stores it
    # the partner channel's normalised value: its own load, the row's rstd, the same two float32 products
    xp = tl.load(x_ptr + tile_offsets(rows, D, partner, 1), mask=rmask, other=0.0).to(tl.float32)
    yp = xp * rstd[:, None]
    if HAS_WEIGHT:
        yp = yp * tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)[None, :]
    yp = round_to(yp, DT)
    pos = (rows // H) % S  # packed position of each row
    tab = tl.cast(pos, tl.int64)[:, None] * R
    c = round_to(tl.load(cos_ptr + tab + cols[None, :], mask=rmask, other=0.0).to(tl.float32), DT)
    s = round_to(tl.load(sin_ptr + tab + cols[None, :], mask=rmask, other=0.0).to(tl.float32), DT)
    sign = tl.where(first, -1.0, 1.0)[None, :]  # rotate_half: [-x2, x1]
    out = round_to(round_to(y * c, DT) + round_to((sign * yp) * s, DT), DT)
    out = tl.where(rot[None, :], out, y)
    tl.store(out_ptr + offs, out.to(DT), mask=mask)


@lean
@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, wq_ptr, wk_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, n_rows, S, eps,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat (b, s, h) head rows
    if tl.program_id(1) == 0:
        _norm_rope_rows(q_ptr, wq_ptr, q_out_ptr, cos_ptr, sin_ptr, rows, n_rows, S, eps, H, D, R, HAS_WEIGHT,
                        BLOCK_D)
    else:
        _norm_rope_rows(k_ptr, wk_ptr, k_out_ptr, cos_ptr, sin_ptr, rows, n_rows, S, eps, H, D, R, HAS_WEIGHT,
                        BLOCK_D)


# ------------------------------------------------------------------------------------------------- launcher
def _validate(q, k, q_weight, k_weight, eps, cos, sin) -> tuple[dict, int]:
    """(rms_norm tile, rotary width R): both validators on q and on k, so the fused op refuses what either refuses."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise registry.StrictUnsupported(f"{OP}: {name} must be a tensor, got {type(t).__name__}")
    if k.shape != q.shape or k.dtype != q.dtype:
        raise registry.StrictUnsupported(
            f"{OP}: k {list(k.shape)} {k.dtype} must have q's shape and dtype ({list(q.shape)} {q.dtype})")
    if (q_weight is None) != (k_weight is None):
        raise registry.StrictUnsupported(f"{OP}: q_weight and k_weight must both be tensors or both None")
    tile = rms_norm._validate(q, q_weight, eps, op=f"{OP}: q")
    rms_norm._validate(k, k_weight, eps, op=f"{OP}: k")
    for name, x in (("q", q), ("k", k)):
        try:
            r, _ = rope._validate_rope(x, cos, sin)
        except registry.StrictUnsupported as exc:
            raise registry.StrictUnsupported(f"{OP}: {name}: {str(exc).removeprefix('rope: ')}") from None
    return tile, r


def check(q, k, q_weight, k_weight, eps, cos, sin) -> dict:
    tile, r = _validate(q, k, q_weight, k_weight, eps, cos, sin)
    return {"kernel_id": KERNEL_ID, "tile": f"{rms_norm._tile_str(tile)};R={r};grid=(rows,2)", "acc_dtype": "float32"}


def _forward(q, k, q_weight, k_weight, eps, cos, sin, tile: dict, r: int):
    b, s, h, d = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    n_rows = b * s * h
    has_w = q_weight is not None
    _qk_norm_rope_kernel[(triton.cdiv(n_rows, tile["ROWS"]), 2)](
        q, k, q_weight if has_w else q, k_weight if has_w else k, q_out, k_out, cos, sin, n_rows, s, float(eps),
        H=h, D=d, R=r, HAS_WEIGHT=has_w, ROWS=tile["ROWS"], BLOCK_D=tile["BLOCK_D"],
        num_warps=tile["num_warps"], enable_fp_fusion=False,
    )
    return q_out, k_out


def _chain(x, weight, eps, cos, sin):
    """The unfused strict chain (what the backward differentiates)."""
    return rope.rope(rms_norm.rms_norm(x, weight, eps), cos, sin)


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, cos, sin, tile, r):
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps = eps
        return _forward(q, k, q_weight, k_weight, eps, cos, sin, tile, r)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        need = ctx.needs_input_grad[:4]
        grads = [None] * 4
        for i, (x, w, dout) in enumerate(((q, q_weight, dq_out), (k, k_weight, dk_out))):
            if not (need[i] or need[i + 2]):
                continue
            with torch.enable_grad():
                x_ = x.detach().requires_grad_(need[i])
                w_ = None if w is None else w.detach().requires_grad_(need[i + 2])
                out = _chain(x_, w_, ctx.eps, cos, sin)
                wants = [t for t, n in ((x_, need[i]), (w_, need[i + 2])) if n]
                got = iter(torch.autograd.grad(out, wants, dout))
            grads[i] = next(got) if need[i] else None
            grads[i + 2] = next(got) if need[i + 2] else None
        return (*grads, None, None, None, None, None)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict `(rope(rms_norm(q, q_weight, eps), cos, sin), rope(rms_norm(k, k_weight, eps), cos, sin))` in one
    launch (see the module contract)."""
    tile, r = _validate(q, k, q_weight, k_weight, eps, cos, sin)
    return _QKNormRope.apply(q, k, q_weight, k_weight, eps, cos, sin, tile, r)


# ------------------------------------------------------------------------------------------------ reference
def reference(x, weight, eps, cos, sin, acc=torch.float32):
    """One tensor's float32 reference (float64 for a truth): both references chained, no intermediate rounding.
    The tables are cast to x's dtype first, as the released code does."""
    y = rms_norm.reference(x.to(acc), None if weight is None else weight.to(acc), eps)
    return rope.reference_rope(y, cos.to(x.dtype), sin.to(x.dtype), acc=acc)


registry.register(OP, run=qk_norm_rope, check=check)
