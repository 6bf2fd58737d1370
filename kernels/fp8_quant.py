"""Per-row FP8 e4m3 quantisation for `--mode fast` (h3lab/fast.py). NOT a strict kernel: it registers no op.

Contract
--------
`quantize_rows(x)`: x (M, K) bfloat16/float32 on CUDA, unit column stride -> (q (M, K) float8_e4m3fn contiguous,
scale (M, 1) float32) with scale[m] = max(amax_k |x[m, k]|, AMAX_FLOOR) / FP8_MAX and
q[m, k] = e4m3(clamp(x[m, k] / scale[m], -FP8_MAX, FP8_MAX)): float32 division rounded to nearest (div_rn), round
to e4m3 by Triton's float32 -> float8e4nv conversion (round to nearest even requested), so x ~= q * scale. One
program per row, two sweeps over the row in BLOCK columns (the amax, then the scaled cast; the second sweep reads the
row back from L2), int64 row offsets. The same math in torch is `quantize_rows_reference` (h3lab/fast.py). On the
H200 the pair is NOT byte-equal to the reference (forward_every_length_rerun.json: the scales differ, and 838-2,559
of 1-11 M e4m3 bytes, max dequantised difference 0.75; suspected: torch divides a tensor by a Python scalar as a
multiplication by its reciprocal, the kernel divides with div_rn), while the FP8 product is within 1.5e-3 relative L2
of the float32 emulation. Fast mode promises no bytes, so this is recorded, not hidden.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero
BLOCK = 1024


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
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR), FP8_MAX)
    for k0 in range(0, K, BLOCK):
        ok = k0 + cols < K
        v = tl.load(x_row + k0 + cols, mask=ok, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_row + k0 + cols, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=ok)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of the (M, K) CUDA tensor x (see the module contract). No checks beyond the layout."""
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), BLOCK=BLOCK, FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR,
                                num_warps=4)
    return q, scale
