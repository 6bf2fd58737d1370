"""Per-row FP8 e4m3 quantisation for `--mode fast` (h3lab/execution/fast.py). NOT a strict kernel: it registers no op.

Contract
--------
`quantize_rows(x)`: x (M, K) bfloat16/float32 on CUDA, unit column stride -> (q (M, K) float8_e4m3fn contiguous,
scale (M, 1) float32) with scale[m] = max(amax_k |x[m, k]|, AMAX_FLOOR) / FP8_MAX and
q[m, k] = e4m3(clamp(x[m, k] / scale[m], -FP8_MAX, FP8_MAX)): float32 divisions rounded to nearest (div_rn), then
`e4m3_code`: round to nearest even onto float8_e4m3fn by integer arithmetic on the float32 bits (normals: the
mantissa rounded to 3 bits; subnormals, |v| < 2**-6: v * 2**9 rounded half-even to an integer; NaN -> 0x7F), stored
as the code byte. The rounding is written out rather than left to the float32 -> float8e4nv conversion because
Triton's CPU interpreter rounds that conversion wrongly just below powers of two (seen: 127.76 -> 64), so the CPU
tests could not check the bytes; written out, the codes are the same bytes on the interpreter and the GPU, equal to
torch's own float32 -> float8_e4m3fn cast (round to nearest even) of the same quotient. One program per row, two
sweeps over the row in BLOCK columns (the amax, then the scaled cast; the second reads the row back from L2), int64
row offsets. The same math in torch is `quantize_rows_reference` (h3lab/execution/fast.py), which divides by a tensor (a
true division on every device: CUDA multiplies by the reciprocal when the divisor is a Python scalar, which
makes the scales differ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero
MIN_NORMAL = 0.015625  # 2**-6, the smallest normal e4m3 magnitude
BLOCK = 1024


@triton.jit
def e4m3_code(v):
    """float32 v with |v| <= 448 (or NaN) -> its float8_e4m3fn code (uint8), round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    abits = a.to(tl.int32, bitcast=True)
    # normal: keep 3 mantissa bits, round half to even (a carry moves into the exponent); rebias 127 -> 7
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - 960
    # subnormal: a step of 2**-9; a * 512 < 8 is exact, its integer part and fraction too
    y = a * 512.0
    whole = y.to(tl.int32)
    frac = y - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = whole + up.to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub) | sign
    code = tl.where(v != v, 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def row_scale(amax, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """A row's float32 scale from its amax: div_rn(max(amax, AMAX_FLOOR), FP8_MAX)."""
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FP8_MAX)


@triton.jit
def scaled_code(v, scale, FP8_MAX: tl.constexpr):
    """float32 v over its row's scale, clamped to +-FP8_MAX, as its e4m3 code (`e4m3_code`)."""
    return e4m3_code(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX))


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                          AMAX_FLOOR: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * K
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = row_scale(tl.max(amax, axis=0), FP8_MAX, AMAX_FLOOR)
    for k0 in range(0, K, BLOCK):
        ok = k0 + cols < K
        v = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(q_row + k0 + cols, scaled_code(v, scale, FP8_MAX), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of the (M, K) tensor x (see the module contract). No checks beyond the layout."""
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(M,)](x, q.view(torch.uint8), scale, K, x.stride(0), BLOCK=BLOCK, FP8_MAX=FP8_MAX,
                                AMAX_FLOOR=AMAX_FLOOR, num_warps=4)
    return q, scale
