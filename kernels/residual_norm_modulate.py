"""Strict fused gated residual + RMSNorm + AdaLN modulation:
`residual_norm_modulate(residual, gate, index, y, weight, eps, scale, shift)` -> (stream, modulated).

Serves a block's middle: `stream = gated_residual(residual, gate, index, y)` (the attention branch added to the
stream) followed by `modulated = norm_modulate(stream, weight, eps, scale, shift, index)` (the FFN's AdaLN pre-norm)
in one pass over the rows: the new stream is written once and never read back. The block's two other seams are not
fused: the FFN's gated residual feeds the next block's norm, across the block boundary (its own AdaLN table, the
gradient-checkpoint and streaming unit, the reshapable `residual2` point), and the first norm reads the block's input.
It is the composition of the strict `gated_residual` and `norm_modulate` kernels, not a new evaluation of the math.

Contract
--------
math        stream = round(residual + round(gate[i] * y)) (gated_residual's contract), then on the rounded stream
            norm_modulate's: h = round((stream * rstd) * w), rstd = 1 / sqrt(sum(stream^2) / D + eps),
            modulated = round(round(h * round(1 + scale[i])) + shift[i]); i = index[s]; `round` rounds to the
            activation dtype (nearest, ties to even), every step in float32 from exact upcast operands.
            **Bit-equal to the unfused strict chain** `norm_modulate(gated_residual(...), ...)` (and so to
            `modulate(rms_norm(gated_residual(...)))`) in every served dtype, shape and batch, forward and backward
            (tests/kernels/test_residual_norm_modulate.py).
accumulator float32 (row statistic).
reduction   sum(stream^2) along the row by rms_norm's single (ROWS, BLOCK_D) tile and one `tl.sum(axis=1)`, with
            rms_norm's (ROWS, BLOCK_D, num_warps) for the same D (`rms_norm._tile(D)`): the same tree, fixed by D only.
            The residual and the modulation are elementwise.
IEEE ops    div_rn / sqrt_rn for the mean and rstd, no FMA contraction (`enable_fp_fusion=False`).
backward    the unfused chain's backward, recomputed: the strict gated_residual and norm_modulate autograd functions
            run again on the saved inputs (bit-identical forward) and autograd differentiates them with the two
            incoming gradients, adding the stream's two gradients as autograd adds them for the chain. Saved: the
            inputs, not the stream.
index       as modulate: int64 (S,), 0 <= index < R, checked on the host once per index tensor, clamped in the kernel.
refused     whatever gated_residual or norm_modulate refuses (messages prefixed `residual_norm_modulate:`): dtypes
            other than float32 / bfloat16 / float16 or mixed; residual / y not contiguous non-empty (B, S, D) of one
            shape; tables not (R, D) with unit column stride, or of different R; index not int64 (S,) or out of range;
            w not a contiguous (D,) (None is served); eps not a positive number; D > 16384; mixed devices; CPU without
            TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import modulate, norm_modulate, registry, rms_norm
from h3kernels._launch import lean
from h3kernels._strict_math import round_to
from h3kernels.modulate import _gather_tile, _modulate_tile
from h3kernels.rms_norm import _normalize_rows

KERNEL_ID = "h3kernels.residual_norm_modulate.residual_norm_modulate.v1"
OP = "residual_norm_modulate"


# ---------------------------------------------------------------------------------------------------- kernel
@lean
@triton.jit
def _residual_norm_modulate_kernel(
    res_ptr, gate_ptr, index_ptr, y_ptr, w_ptr, scale_ptr, shift_ptr, stream_ptr, out_ptr, n_rows, S, R,
    gate_stride, scale_stride, shift_stride, eps,
    D: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat b * S + s
    cols = tl.arange(0, BLOCK_D)  # the whole row
    offs, t, mask = _gather_tile(index_ptr, rows, rows < n_rows, S, R, cols, D)
    DT = out_ptr.dtype.element_ty
    res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + t * gate_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    stream = round_to(res + round_to(g * y, DT), DT)  # residual + gate[i] * y, as gated_residual stores it
    tl.store(stream_ptr + offs, stream.to(DT), mask=mask)
    h, _ = _normalize_rows(stream, w_ptr, cols, eps, D, HAS_WEIGHT)  # masked columns are exact zeros
    h = round_to(h, DT)  # the rms_norm output as the unfused chain stores it
    out = _modulate_tile(h, scale_ptr, shift_ptr, t, scale_stride, shift_stride, cols, mask, DT)
    tl.store(out_ptr + offs, out.to(DT), mask=mask)


# ------------------------------------------------------------------------------------------------- launcher
def _validate(residual, gate, index, y, weight, eps, scale, shift) -> tuple[dict, dict]:
    """(rms_norm tile, modulate index entry): every validator of the chain, so the fused op refuses what any refuses."""
    try:
        modulate._validate_gated(residual, gate, index, y)
        tile, entry = norm_modulate._validate(residual, weight, eps, scale, shift, index)
    except registry.StrictUnsupported as exc:
        text = str(exc).removeprefix("gated_residual: ").removeprefix("norm_modulate: ")
        raise registry.StrictUnsupported(f"{OP}: {text}") from None
    if gate.shape[0] != scale.shape[0]:
        raise registry.StrictUnsupported(f"{OP}: gate has {gate.shape[0]} rows but scale has {scale.shape[0]}")
    return tile, entry


def check(residual, gate, index, y, weight, eps, scale, shift) -> dict:
    tile, _ = _validate(residual, gate, index, y, weight, eps, scale, shift)
    return {"kernel_id": KERNEL_ID, "tile": rms_norm._tile_str(tile), "acc_dtype": "float32"}


def _forward(residual, gate, index, y, weight, eps, scale, shift, tile: dict):
    b, s, d = residual.shape
    stream, out = torch.empty_like(residual), torch.empty_like(residual)
    _residual_norm_modulate_kernel[(triton.cdiv(b * s, tile["ROWS"]),)](
        residual, gate, index, y, weight if weight is not None else residual, scale, shift, stream, out, b * s, s,
        scale.shape[0], gate.stride(0), scale.stride(0), shift.stride(0), float(eps),
        D=d, HAS_WEIGHT=weight is not None, ROWS=tile["ROWS"], BLOCK_D=tile["BLOCK_D"],
        num_warps=tile["num_warps"], enable_fp_fusion=False,
    )
    return stream, out


def _chain(residual, gate, index, y, weight, eps, scale, shift):
    """The unfused strict chain (what the backward differentiates)."""
    stream = modulate.gated_residual(residual, gate, index, y)
    return stream, norm_modulate.norm_modulate(stream, weight, eps, scale, shift, index)


class _ResidualNormModulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, gate, index, y, weight, eps, scale, shift, tile):
        ctx.save_for_backward(residual, gate, index, y, weight, scale, shift)
        ctx.eps = eps
        return _forward(residual, gate, index, y, weight, eps, scale, shift, tile)

    @staticmethod
    def backward(ctx, d_stream, d_out):
        residual, gate, index, y, weight, scale, shift = ctx.saved_tensors
        need = ctx.needs_input_grad
        slots = (0, 1, 3, 4, 6, 7)  # residual, gate, y, weight, scale, shift
        grads: list = [None] * 9
        if not any(need[i] for i in slots):
            return tuple(grads)
        with torch.enable_grad():
            inputs = [residual, gate, index, y, weight, ctx.eps, scale, shift]
            leaves = {}
            for i in slots:
                if inputs[i] is not None:
                    inputs[i] = leaves[i] = inputs[i].detach().requires_grad_(need[i])
            stream, out = _chain(*inputs)
            wants = [i for i in slots if need[i] and i in leaves]
            got = torch.autograd.grad((stream, out), [leaves[i] for i in wants], (d_stream, d_out))
        for i, g in zip(wants, got):
            grads[i] = g
        return tuple(grads)


def residual_norm_modulate(
    residual: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None,
    eps: float, scale: torch.Tensor, shift: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict `(s, modulate(rms_norm(s, weight, eps), scale, shift, index))` with `s = residual + gate[index] * y`,
    in one pass (see the module contract)."""
    tile, _ = _validate(residual, gate, index, y, weight, eps, scale, shift)
    return _ResidualNormModulate.apply(residual, gate, index, y, weight, eps, scale, shift, tile)


# ------------------------------------------------------------------------------------------------ reference
def reference(residual, gate, index, y, weight, eps, scale, shift):
    """The float32 torch reference (float64 in, float64 out for a truth): the three references chained, no
    rounding. Returns (stream, modulated)."""
    stream = modulate.reference_gated_residual(residual, gate, index, y)
    return stream, norm_modulate.reference(stream, weight, eps, scale, shift, index)


registry.register(OP, run=residual_norm_modulate, check=check)
