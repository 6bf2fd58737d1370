"""Strict 3-axis MM-RoPE: `rope_table(position_ids, inv_freq)` -> (cos, sin) and `rope(x, cos, sin)`.

rope_table
----------
math        angle[s, a*F + f] = float32(position_ids[s, a]) * inv_freq[f] for the axes a = t, h, w, the 3F angles
            repeated twice: (S, 6F) columns [t, h, w, t, h, w]; cos = cos(angle), sin = sin(angle), float32.
            The product is one float32 multiply (bit-equal to the reference's); cos / sin are libdevice `__nv_cosf`
            / `__nv_sinf` on CUDA (the CUDA math library torch's CUDA kernels use; max error 2 ulp, no `.approx`
            substitution) and numpy's float32 cos / sin under the interpreter. Both are deterministic; the tests
            bound the error against the float64 truth (of the float32 angles) by that of torch's own float32 cos /
            sin. Not promised bit-equal to torch, though on an H200 the tables were bit-equal to torch's CUDA ones
            (torch's CPU SLEEF results differ from numpy's on ~15% of the entries by an ulp).
refused     position_ids not (S, 3) of int32 / int64 / float32; inv_freq not a float32 (F,) vector or
            requiring grad (the tables are not differentiable); S or F zero; 6F > 4096; non-contiguous inputs.

rope
----
math        x (B, S, H, D); the leading R = cos.shape[-1] channels rotate, the rest pass through unchanged:
            c = round(cos), s = round(sin) (cast to x's dtype first, as the released code does), then for channel
            i < R/2:  out_i = round(round(x_i * c_i) + round(-x_{i+R/2} * s_i)),
            for R/2 <= i < R: out_i = round(round(x_i * c_i) + round(x_{i-R/2} * s_i)).
            `round` rounds to x's dtype (nearest, ties to even), each step computed in float32 from exact operands:
            torch's own evaluation on bfloat16 / float16 tensors, so the forward is **bit-equal** to the reference
            in every served dtype (float32: no FMA contraction, `enable_fp_fusion=False`).
backward    dx_i = dy_i * c_i + dy_{i+R/2} * s_{i+R/2}          (i < R/2)
            dx_i = dy_i * c_i - dy_{i-R/2} * s_{i-R/2}          (R/2 <= i < R)
            dx_i = dy_i                                           (i >= R)
            in float32 with the same cast c, s, one rounding to x's dtype. No gradient for cos / sin.
tiles       one program per ROWS (b, s, h) rows x BLOCK_D = next_pow2(D) channels; ROWS = clamp(2048 // BLOCK_D,
            1, 16). No reduction anywhere: row, batch, position and launch invariance are structural.
refused     dtypes other than float32 / bfloat16 / float16; x not a contiguous (B, S, H, D); cos / sin not (S, R)
            contiguous floating tables of one shape with R even, 0 < R <= D; cos / sin requiring grad; empty
            tensors; mixed devices; CPU without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import registry
from h3kernels._launch import lean
from h3kernels._offsets import tile_offsets
from h3kernels._strict_math import cos_f32, libdevice_enabled, round_to, sin_f32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POSITION_DTYPES = (torch.int32, torch.int64, torch.float32)
MAX_TABLE_WIDTH = 4096


# ---------------------------------------------------------------------------------------------------- kernels
@lean
@triton.jit
def _rope_table_kernel(
    pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr, F: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    s = tl.program_id(0)
    cols = tl.arange(0, BLOCK)  # (BLOCK,) >= 6F angle columns
    ok = cols < 6 * F
    col = cols % (3 * F)  # [t, h, w] block, then repeated
    axis = col // F
    f = col - axis * F
    pos = tl.load(pos_ptr + s * 3 + axis, mask=ok, other=0).to(tl.float32)  # position_ids.to(float32)
    angle = pos * tl.load(inv_freq_ptr + f, mask=ok, other=0.0)
    out = s.to(tl.int64) * (6 * F) + cols
    tl.store(cos_ptr + out, cos_f32(angle, LIBDEVICE), mask=ok)
    tl.store(sin_ptr + out, sin_f32(angle, LIBDEVICE), mask=ok)


@lean
@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, S,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BACKWARD: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Forward (x -> out) or, with BACKWARD, the transpose rotation (dy -> dx)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat (b, s, h) rows
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    half = R // 2
    first = cols < half  # x1 channels
    rot = cols < R  # rotated channels; the rest pass through
    partner = tl.where(first, cols + half, cols - half)
    pos = (rows // H) % S  # packed position of each row
    mask = row_ok[:, None] & (cols < D)[None, :]
    rmask = row_ok[:, None] & rot[None, :]
    DT = out_ptr.dtype.element_ty
    offs = tile_offsets(rows, D, cols, 1)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + tile_offsets(rows, D, partner, 1), mask=rmask, other=0.0).to(tl.float32)
    tab = tl.cast(pos, tl.int64)[:, None] * R
    c = round_to(tl.load(cos_ptr + tab + cols[None, :], mask=rmask, other=0.0).to(tl.float32), DT)
    if BACKWARD:
        # the partner's sin: dx_i = dy_i c_i +/- dy_p s_p
        sp = round_to(tl.load(sin_ptr + tab + partner[None, :], mask=rmask, other=0.0).to(tl.float32), DT)
        sign = tl.where(first, 1.0, -1.0)[None, :]
        y = x * c + (sign * xp) * sp
    else:
        s = round_to(tl.load(sin_ptr + tab + cols[None, :], mask=rmask, other=0.0).to(tl.float32), DT)
        sign = tl.where(first, -1.0, 1.0)[None, :]  # rotate_half: [-x2, x1]
        y = round_to(round_to(x * c, DT) + round_to((sign * xp) * s, DT), DT)
    y = tl.where(rot[None, :], y, x)
    tl.store(out_ptr + offs, round_to(y, DT).to(DT), mask=mask)


# ------------------------------------------------------------------------------------------------- launchers
def _rows_tile(d: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(d)
    return block_d, max(1, min(16, 2048 // block_d))


def _validate_table(position_ids, inv_freq) -> int:
    op = "rope_table"
    for name, t in (("position_ids", position_ids), ("inv_freq", inv_freq)):
        if not isinstance(t, torch.Tensor):
            raise registry.StrictUnsupported(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    registry.check_device(position_ids, inv_freq, op=op)
    if position_ids.dtype not in POSITION_DTYPES:
        raise registry.StrictUnsupported(f"{op}: position_ids dtype {position_ids.dtype} not served (int32, int64, float32)")
    if position_ids.dim() != 2 or position_ids.shape[1] != 3 or position_ids.shape[0] == 0:
        raise registry.StrictUnsupported(f"{op}: position_ids shape {list(position_ids.shape)} must be a non-empty (S, 3)")
    if inv_freq.dtype != torch.float32:
        raise registry.StrictUnsupported(f"{op}: inv_freq dtype {inv_freq.dtype} must be float32")
    if inv_freq.dim() != 1 or inv_freq.numel() == 0 or 6 * inv_freq.numel() > MAX_TABLE_WIDTH:
        raise registry.StrictUnsupported(
            f"{op}: inv_freq shape {list(inv_freq.shape)} must be (F,) with 0 < 6F <= {MAX_TABLE_WIDTH}"
        )
    if inv_freq.requires_grad:
        raise registry.StrictUnsupported(f"{op}: inv_freq requires grad; the strict tables are not differentiable")
    for name, t in (("position_ids", position_ids), ("inv_freq", inv_freq)):
        if not t.is_contiguous():
            raise registry.StrictUnsupported(f"{op}: {name} strides {t.stride()} are not contiguous")
    return inv_freq.numel()


def check_rope_table(position_ids, inv_freq) -> dict:
    f = _validate_table(position_ids, inv_freq)
    fn = "libdevice" if libdevice_enabled() else "numpy(interpreter)"
    return {
        "kernel_id": f"h3kernels.rope.rope_table.v1[{fn} cos/sin]", "tile": f"BLOCK={triton.next_power_of_2(6 * f)}",
        "acc_dtype": "float32",
    }


def rope_table(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict 3-axis RoPE tables (see the module contract)."""
    f = _validate_table(position_ids, inv_freq)
    s = position_ids.shape[0]
    cos = torch.empty((s, 6 * f), dtype=torch.float32, device=inv_freq.device)
    sin = torch.empty_like(cos)
    _rope_table_kernel[(s,)](
        position_ids, inv_freq, cos, sin, F=f, BLOCK=triton.next_power_of_2(6 * f),
        LIBDEVICE=libdevice_enabled(), enable_fp_fusion=False,
    )
    return cos, sin


def _validate_rope(x, cos, sin) -> tuple[int, int]:
    op = "rope"
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise registry.StrictUnsupported(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    registry.check_device(x, cos, sin, op=op)
    if x.dtype not in DTYPES:
        raise registry.StrictUnsupported(f"{op}: x dtype {x.dtype} not served (float32, bfloat16, float16)")
    if x.dim() != 4 or x.numel() == 0:
        raise registry.StrictUnsupported(f"{op}: x shape {list(x.shape)} must be a non-empty (B, S, H, D)")
    if not x.is_contiguous():
        raise registry.StrictUnsupported(f"{op}: x of shape {list(x.shape)} strides {x.stride()} is not contiguous")
    s, d = x.shape[1], x.shape[3]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype not in TABLE_DTYPES:
            raise registry.StrictUnsupported(f"{op}: {name} dtype {t.dtype} not served (float32, bfloat16, float16)")
        if t.dim() != 2 or t.shape[0] != s:
            raise registry.StrictUnsupported(f"{op}: {name} shape {list(t.shape)} must be ({s}, R), one row per position")
        if not t.is_contiguous():
            raise registry.StrictUnsupported(f"{op}: {name} strides {t.stride()} are not contiguous")
        if t.requires_grad:
            raise registry.StrictUnsupported(f"{op}: {name} requires grad; strict RoPE serves no table gradient")
    if sin.shape != cos.shape:
        raise registry.StrictUnsupported(f"{op}: sin shape {list(sin.shape)} differs from cos {list(cos.shape)}")
    r = cos.shape[1]
    if r == 0 or r % 2 or r > d:
        raise registry.StrictUnsupported(f"{op}: rotary width {r} must be even and in (0, head_dim={d}]")
    return r, d


def check_rope(x, cos, sin) -> dict:
    r, d = _validate_rope(x, cos, sin)
    block_d, rows = _rows_tile(d)
    return {
        "kernel_id": "h3kernels.rope.rope.v1", "tile": f"BLOCK_D={block_d},ROWS={rows},R={r}", "acc_dtype": "float32"
    }


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    b, s, h, d = x.shape
    out = torch.empty_like(x)
    n_rows = b * s * h
    block_d, rows = _rows_tile(d)
    _rope_kernel[(triton.cdiv(n_rows, rows),)](
        x, cos, sin, out, n_rows, s, H=h, D=d, R=cos.shape[1], BACKWARD=backward,
        ROWS=rows, BLOCK_D=block_d, enable_fp_fusion=False,
    )
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy.contiguous(), cos, sin, backward=True), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Strict partial rotate-half RoPE on (B, S, H, D) (see the module contract)."""
    _validate_rope(x, cos, sin)
    return _Rope.apply(x, cos, sin)


# ------------------------------------------------------------------------------------------------ references
def reference_rope_table(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype=torch.float64):
    """cos / sin in `dtype` (float64: the truth) of the op's angles, which are float32 products by definition."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.view(1, 1, -1)  # (S, 3, F) float32
    freqs = freqs.to(dtype)
    freqs = torch.cat(freqs.unbind(dim=1), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, acc=torch.float32) -> torch.Tensor:
    """The rotation computed in `acc` (float32, or float64 for a truth) with no intermediate rounding, after the
    released cast of cos / sin to x's dtype (part of the op's definition). Differentiable in x."""
    r = cos.shape[-1]
    xf = x.to(acc)
    c = cos.to(x.dtype).to(acc)[None, :, None, :]
    s = sin.to(x.dtype).to(acc)[None, :, None, :]
    x1, x2 = xf[..., : r // 2], xf[..., r // 2 : r]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((xf[..., :r] * c + rotated * s, xf[..., r:]), dim=-1)


registry.register("rope_table", run=rope_table, check=check_rope_table)
registry.register("rope", run=rope, check=check_rope)
