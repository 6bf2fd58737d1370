"""Exact rounding and IEEE transcendental choices shared by the strict elementwise / norm / RoPE kernels.

Why this file exists:
- Triton's CPU interpreter (3.6 and 3.9) casts float32 -> bfloat16 by *truncation*, even with
  `fp_downcast_rounding="rtne"` (measured: ~half of random values round differently from torch). `round_to`
  therefore rounds to bfloat16 with integer bit operations (round to nearest, ties to even, NaN kept), which is
  exact on the GPU and in the interpreter alike. float16 uses the native cast (numpy's RNE in the interpreter,
  `cvt.rn` on the GPU). A value returned by `round_to` is exactly representable, so the final `.to(dtype)` store
  is exact whichever rounding the backend applies.
- Triton lowers float32 `tl.exp` to `ex2.approx(x * log2 e)` on NVIDIA (the fast-math substitution the strict
  contract forbids). On CUDA these helpers call libdevice (`__nv_expf`, `__nv_sinf`, `__nv_cosf`: the CUDA math
  library functions torch's own CUDA kernels use, max error 2 ulp); under the interpreter, where libdevice does not
  exist, they fall back to `tl.exp` / `tl.sin` / `tl.cos` (numpy float32). Launchers pass
  `LIBDEVICE=libdevice_enabled()`. Note for PTX audits: `__nv_expf` itself evaluates its final 2^f with one
  `ex2.approx` on an fma range-reduced argument (that is how CUDA's full-accuracy expf is built), so the compiled
  silu / swiglu / sinusoid kernels do contain `ex2.approx` and `fma` -- inside libdevice only. Measured on an H200
  (torch 2.11, triton 3.6): silu / swiglu (float32, bfloat16, float16), rope_table and the sinusoid are bit-equal to
  torch's CUDA ops.
Divisions and square roots in strict kernels use `tl.math.div_rn` / `tl.math.sqrt_rn` (IEEE round to nearest), and
every launch passes `enable_fp_fusion=False` (no mul+add contraction into FMA).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from h3kernels import registry

def libdevice_enabled() -> bool:
    """libdevice transcendental functions exist only in compiled (CUDA) kernels, not in the interpreter."""
    return not registry.interpreted()


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 `x` rounded to DTYPE (nearest, ties to even) and returned as float32: torch's rounding of one op."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif DTYPE == tl.float16:
        y = x.to(tl.float16).to(tl.float32)
    else:
        y = x
    return y


@triton.jit
def exp_f32(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def sin_f32(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.sin(x)
    else:
        y = tl.sin(x)
    return y


@triton.jit
def cos_f32(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.cos(x)
    else:
        y = tl.cos(x)
    return y
