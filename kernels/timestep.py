"""Strict H3 timestep sinusoid: `timestep_embedding(t, dim)` -> (T, dim) float32 [cos | sin].

Contract
--------
math        half = dim // 2; for j < half:
              freq_j = exp(float32(-ln(10000)) * j / half)      (float32 multiply, IEEE division, exp)
              arg_j  = float32(t) * freq_j                       (float32 multiply)
              out[:, j] = cos(arg_j), out[:, half + j] = sin(arg_j)
            the steps and their order are the reference's (`-math.log(10000) * arange(half)` rounds the product to
            float32, then `/ half`, `exp`, `t.float() * .`), so every multiply and division is bit-equal to it;
            exp / cos / sin are libdevice `__nv_expf` / `__nv_cosf` / `__nv_sinf` on CUDA (the CUDA math library,
            no `.approx` substitution) and numpy's float32 functions under the interpreter. They are not promised
            bit-equal to torch's CPU (SLEEF) results; the tests bound the error against the float64 truth by about
            twice torch's own float32 error (on an H200 the output was bit-equal to torch's CUDA sinusoid).
            Deterministic and row-invariant: out[i] depends on t[i] and dim only.
accumulator none (no reduction); float32 throughout, output float32 whatever t's floating dtype.
tiles       one program per timestep row, BLOCK = next_pow2(half) columns.
refused     t not a non-empty 1-D float32 / bfloat16 / float16 tensor; t requiring grad (the sinusoid is a
            non-differentiable input feature in H3); dim not an even int in [2, 8192]; non-contiguous t; mixed
            devices; CPU without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from h3kernels import registry
from h3kernels._launch import lean
from h3kernels._strict_math import cos_f32, exp_f32, libdevice_enabled, sin_f32

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_DIM = 8192
NEG_LOG_MAX_PERIOD = -math.log(10000)  # rounded to float32 when it meets the float32 arange, as in the reference


@lean
@triton.jit
def _timestep_kernel(t_ptr, out_ptr, neg_log_period, HALF: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    i = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    ok = j < HALF
    exponent = tl.math.div_rn(neg_log_period * j.to(tl.float32), HALF * 1.0)  # (-ln 1e4 * j) / half
    arg = tl.load(t_ptr + i).to(tl.float32) * exp_f32(exponent, LIBDEVICE)
    row = i.to(tl.int64) * (2 * HALF)
    tl.store(out_ptr + row + j, cos_f32(arg, LIBDEVICE), mask=ok)  # flip_sin_to_cos: [cos | sin]
    tl.store(out_ptr + row + HALF + j, sin_f32(arg, LIBDEVICE), mask=ok)


def _validate(t, dim) -> int:
    op = "timestep_embedding"
    if not isinstance(t, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: t must be a tensor, got {type(t).__name__}")
    registry.check_device(t, op=op)
    if t.dtype not in DTYPES:
        raise registry.StrictUnsupported(f"{op}: t dtype {t.dtype} not served (float32, bfloat16, float16)")
    if t.dim() != 1 or t.numel() == 0:
        raise registry.StrictUnsupported(f"{op}: t shape {list(t.shape)} must be a non-empty (T,)")
    if not t.is_contiguous():
        raise registry.StrictUnsupported(f"{op}: t strides {t.stride()} are not contiguous")
    if t.requires_grad:
        raise registry.StrictUnsupported(f"{op}: t requires grad; the strict sinusoid is not differentiable")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2 or dim > MAX_DIM:
        raise registry.StrictUnsupported(f"{op}: dim={dim!r} must be an even integer in [2, {MAX_DIM}]")
    return dim // 2


def check(t, dim) -> dict:
    half = _validate(t, dim)
    fn = "libdevice" if libdevice_enabled() else "numpy(interpreter)"
    return {
        "kernel_id": f"h3kernels.timestep.timestep_embedding.v1[{fn} exp/cos/sin]",
        "tile": f"BLOCK={triton.next_power_of_2(half)}",
        "acc_dtype": "float32",
    }


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Strict H3 timestep sinusoid (see the module contract)."""
    half = _validate(t, dim)
    out = torch.empty((t.shape[0], dim), dtype=torch.float32, device=t.device)
    _timestep_kernel[(t.shape[0],)](
        t, out, NEG_LOG_MAX_PERIOD, HALF=half, BLOCK=triton.next_power_of_2(half),
        LIBDEVICE=libdevice_enabled(), enable_fp_fusion=False,
    )
    return out


def reference(t: torch.Tensor, dim: int, dtype=torch.float64) -> torch.Tensor:
    """The sinusoid evaluated in `dtype` (float64: the truth), from the float32 frequencies the op defines."""
    half = dim // 2
    exponent = NEG_LOG_MAX_PERIOD * torch.arange(half, dtype=torch.float32, device=t.device) / half
    freqs = torch.exp(exponent.to(dtype))
    arg = t.float().to(dtype)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)


registry.register("timestep_embedding", run=timestep_embedding, check=check)
