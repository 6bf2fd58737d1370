"""Strict elementwise ops: `add(a, b)`, `silu(x)` and `swiglu(h)` (value * silu(gate), h = [value; gate]).

Contract
--------
math        add:    out = round(a + b)
            silu:   out = round(x / (1 + exp(-x)))
            swiglu: out = round(value * round(gate / (1 + exp(-gate)))), value = h[..., :F], gate = h[..., F:]
            `round` rounds to the tensor dtype (nearest, ties to even); every step runs in float32 on the exact
            upcast operands, with IEEE division (`div_rn`) and no FMA contraction (`enable_fp_fusion=False`). These
            are the cast points of torch's CPU and CUDA kernels on bfloat16 / float16 (silu computed in float32 and
            rounded, then the product rounded), so `add` is bit-equal to the reference in every dtype, and silu /
            swiglu are bit-equal whenever the float32 `exp` agrees closely enough to round to the same value.
exp         libdevice `__nv_expf` on CUDA (what torch's CUDA silu calls; Triton's own `tl.exp` is `ex2.approx`,
            refused by the strict contract): on an H200 silu and swiglu are bit-equal to torch's CUDA ops in float32,
            bfloat16 and float16. Under the interpreter numpy's float32 exp stands in; torch's CPU silu uses SLEEF,
            so float32 (and, rarely, float16) silu differs from the CPU reference by an ulp on some elements (bounded
            against the float64 truth in the tests); in bfloat16 the rounding absorbs it (bit-equal on the test sets;
            on 4M random bfloat16 inputs, numpy vs SLEEF silu gave 0 differing outputs).
backward    add:    da = db = dy (the same tensor).
            silu:   dx = round(dy * sig * (1 + x * (1 - sig))), sig = 1 / (1 + exp(-x)), float32, one rounding.
            swiglu: d value = round(dy * silu(gate)); d gate = round(dy * value * sig * (1 + gate * (1 - sig))).
accumulator none: no reductions, so every output element depends only on its own inputs (row, batch and launch
            invariance are structural).
tiles       flat BLOCK = 1024 elements (add, silu); swiglu (ROWS, BLOCK_F) tiles, BLOCK_F = min(next_pow2(F), 1024),
            ROWS = clamp(2048 // BLOCK_F, 1, 64).
refused     dtypes other than float32 / bfloat16 / float16; add of two dtypes or shapes (no broadcasting);
            non-contiguous inputs; empty tensors; swiglu with an odd last axis; mixed devices; CPU without
            TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import registry
from h3kernels._launch import lean
from h3kernels._offsets import flat_offsets, tile_offsets
from h3kernels._strict_math import exp_f32, libdevice_enabled, round_to

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK = 1024


# ---------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _sigmoid(x, LIBDEVICE: tl.constexpr):
    return tl.math.div_rn(1.0, 1.0 + exp_f32(-x, LIBDEVICE))


@triton.jit
def _silu(x, LIBDEVICE: tl.constexpr):
    """x / (1 + exp(-x)), the expression torch's CPU and CUDA silu kernels evaluate."""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x, LIBDEVICE))


@triton.jit
def _silu_grad(x, LIBDEVICE: tl.constexpr):
    sig = _sigmoid(x, LIBDEVICE)
    return sig * (1.0 + x * (1.0 - sig))


@lean
@triton.jit
def _add_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = flat_offsets(tl.program_id(0), BLOCK)
    ok = offs < n
    a = tl.load(a_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    DT = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, round_to(a + b, DT).to(DT), mask=ok)


@lean
@triton.jit
def _silu_kernel(x_ptr, dy_ptr, out_ptr, n, BACKWARD: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    offs = flat_offsets(tl.program_id(0), BLOCK)
    ok = offs < n
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:
        dy = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = dy * _silu_grad(x, LIBDEVICE)
    else:
        y = _silu(x, LIBDEVICE)
    DT = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, round_to(y, DT).to(DT), mask=ok)


@triton.jit
def _swiglu_tile(h_ptr, n_rows, F: tl.constexpr, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    """(ROWS, BLOCK_F) tile of value = h[:, :F] and gate = h[:, F:] in float32, with its offsets and mask."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < n_rows)[:, None] & (cols < F)[None, :]
    h_offs = tile_offsets(rows, 2 * F, cols, 1)
    value = tl.load(h_ptr + h_offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(h_ptr + h_offs + F, mask=mask, other=0.0).to(tl.float32)
    return value, gate, h_offs, tile_offsets(rows, F, cols, 1), mask


@lean
@triton.jit
def _swiglu_fwd_kernel(
    h_ptr, out_ptr, n_rows, F: tl.constexpr, ROWS: tl.constexpr, BLOCK_F: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    value, gate, _, offs, mask = _swiglu_tile(h_ptr, n_rows, F, ROWS, BLOCK_F)
    DT = out_ptr.dtype.element_ty
    act = round_to(_silu(gate, LIBDEVICE), DT)  # F.silu(gate) is its own rounded tensor
    tl.store(out_ptr + offs, round_to(value * act, DT).to(DT), mask=mask)


@lean
@triton.jit
def _swiglu_bwd_kernel(
    h_ptr, dy_ptr, dh_ptr, n_rows, F: tl.constexpr, ROWS: tl.constexpr, BLOCK_F: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    value, gate, h_offs, offs, mask = _swiglu_tile(h_ptr, n_rows, F, ROWS, BLOCK_F)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    DT = dh_ptr.dtype.element_ty
    d_value = dy * _silu(gate, LIBDEVICE)
    d_gate = (dy * value) * _silu_grad(gate, LIBDEVICE)
    tl.store(dh_ptr + h_offs, round_to(d_value, DT).to(DT), mask=mask)
    tl.store(dh_ptr + h_offs + F, round_to(d_gate, DT).to(DT), mask=mask)


# ------------------------------------------------------------------------------------------------ validation
def _check_tensor(op: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise registry.StrictUnsupported(f"{op}: {name} dtype {t.dtype} not served (float32, bfloat16, float16)")
    if t.numel() == 0:
        raise registry.StrictUnsupported(f"{op}: {name} shape {list(t.shape)} is empty")
    if not t.is_contiguous():
        raise registry.StrictUnsupported(f"{op}: {name} of shape {list(t.shape)} strides {t.stride()} is not contiguous")


def _validate_add(a, b) -> None:
    tensors = [t for t in (a, b) if isinstance(t, torch.Tensor)]
    registry.check_device(*tensors, op="add")
    _check_tensor("add", "a", a)
    _check_tensor("add", "b", b)
    if a.dtype != b.dtype:
        raise registry.StrictUnsupported(f"add: dtypes {a.dtype} and {b.dtype} differ (no type promotion in strict)")
    if a.shape != b.shape:
        raise registry.StrictUnsupported(f"add: shapes {list(a.shape)} and {list(b.shape)} differ (no broadcasting in strict)")


def _validate_silu(x) -> None:
    if isinstance(x, torch.Tensor):
        registry.check_device(x, op="silu")
    _check_tensor("silu", "x", x)


def _validate_swiglu(h) -> int:
    if isinstance(h, torch.Tensor):
        registry.check_device(h, op="swiglu")
    _check_tensor("swiglu", "h", h)
    if h.shape[-1] % 2:
        raise registry.StrictUnsupported(f"swiglu: last axis {h.shape[-1]} of h must be even ([value; gate] halves)")
    return h.shape[-1] // 2


def _exp_name() -> str:
    return "libdevice" if libdevice_enabled() else "numpy(interpreter)"


def check_add(a, b) -> dict:
    _validate_add(a, b)
    return {"kernel_id": "h3kernels.elementwise.add.v1", "tile": f"BLOCK={BLOCK}", "acc_dtype": "float32"}


def check_silu(x) -> dict:
    _validate_silu(x)
    return {
        "kernel_id": f"h3kernels.elementwise.silu.v1[{_exp_name()} exp]", "tile": f"BLOCK={BLOCK}", "acc_dtype": "float32"
    }


def check_swiglu(h) -> dict:
    f = _validate_swiglu(h)
    return {
        "kernel_id": f"h3kernels.elementwise.swiglu.v1[{_exp_name()} exp]",
        "tile": f"BLOCK_F={min(BLOCK, triton.next_power_of_2(f))},ROWS={max(1, min(64, 2048 // min(BLOCK, triton.next_power_of_2(f))))}",
        "acc_dtype": "float32",
    }


# ------------------------------------------------------------------------------------------- autograd + runs
def _flat_grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


class _Add(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        out = torch.empty_like(a)
        _add_kernel[_flat_grid(a.numel())](a, b, out, a.numel(), BLOCK=BLOCK, enable_fp_fusion=False)
        return out

    @staticmethod
    def backward(ctx, dy):
        return dy, dy


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        _silu_kernel[_flat_grid(x.numel())](
            x, x, out, x.numel(), BACKWARD=False, BLOCK=BLOCK, LIBDEVICE=libdevice_enabled(), enable_fp_fusion=False
        )
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        _silu_kernel[_flat_grid(x.numel())](
            x, dy, dx, x.numel(), BACKWARD=True, BLOCK=BLOCK, LIBDEVICE=libdevice_enabled(), enable_fp_fusion=False
        )
        return dx


def _swiglu_tile_cfg(h: torch.Tensor) -> tuple[int, int, int, int, tuple[int, int]]:
    """(F, rows, ROWS, BLOCK_F, grid): (ROWS, BLOCK_F) tiles, ROWS * BLOCK_F ~ 2048."""
    f = h.shape[-1] // 2
    n_rows = h.numel() // h.shape[-1]
    block_f = min(BLOCK, triton.next_power_of_2(f))
    rows = max(1, min(64, 2048 // block_f))
    return f, n_rows, rows, block_f, (triton.cdiv(n_rows, rows), triton.cdiv(f, block_f))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        f, n_rows, rows, block_f, grid = _swiglu_tile_cfg(h)
        out = h.new_empty((*h.shape[:-1], f))
        _swiglu_fwd_kernel[grid](
            h, out, n_rows, F=f, ROWS=rows, BLOCK_F=block_f, LIBDEVICE=libdevice_enabled(), enable_fp_fusion=False
        )
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx, dy):
        (h,) = ctx.saved_tensors
        f, n_rows, rows, block_f, grid = _swiglu_tile_cfg(h)
        dh = torch.empty_like(h)
        _swiglu_bwd_kernel[grid](
            h, dy.contiguous(), dh, n_rows, F=f, ROWS=rows, BLOCK_F=block_f, LIBDEVICE=libdevice_enabled(),
            enable_fp_fusion=False,
        )
        return dh


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Strict `a + b` (same shape and dtype)."""
    _validate_add(a, b)
    return _Add.apply(a, b)


def silu(x: torch.Tensor) -> torch.Tensor:
    """Strict `F.silu(x)`."""
    _validate_silu(x)
    return _Silu.apply(x)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """Strict `value * F.silu(gate)` with `value, gate = h.chunk(2, dim=-1)`."""
    _validate_swiglu(h)
    return _SwiGLU.apply(h)


# ------------------------------------------------------------------------------------------------ references
def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def reference_add(a, b):
    return a.to(_acc(a)) + b.to(_acc(b))


def reference_silu(x):
    """float32 (float64 in -> float64) silu, no intermediate rounding."""
    xf = x.to(_acc(x))
    return xf / (1.0 + torch.exp(-xf))


def reference_swiglu(h):
    value, gate = h.to(_acc(h)).chunk(2, dim=-1)
    return value * (gate / (1.0 + torch.exp(-gate)))


registry.register("add", run=add, check=check_add)
registry.register("silu", run=silu, check=check_silu)
registry.register("swiglu", run=swiglu, check=check_swiglu)
