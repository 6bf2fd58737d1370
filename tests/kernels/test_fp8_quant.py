"""kernels/fp8_quant.py through Triton's interpreter: `e4m3_code` equals torch's float32 -> float8_e4m3fn cast
(round to nearest even) byte for byte over the whole range, and `quantize_rows` equals `fast.quantize_rows_reference`
byte for byte (codes and scales), zero, tiny and negative rows included."""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from strict_testing import randn
from h3kernels.fp8_quant import e4m3_code, quantize_rows
from h3lab.execution import fast


@triton.jit
def _codes_kernel(v_ptr, o_ptr, N, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    tl.store(o_ptr + i, e4m3_code(tl.load(v_ptr + i, mask=ok, other=0.0)), mask=ok)


def test_e4m3_code_is_torchs_round_to_nearest_even():
    # every representable magnitude, every midpoint between neighbours and a float32 step either side, both signs
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid.abs() <= 448)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                      torch.nextafter(mids, torch.full_like(mids, -1e9))])
    v = torch.cat([grid, near, randn(3000, seed=3, scale=60.0).clamp(-448, 448), randn(500, seed=4, scale=0.01),
                   torch.tensor([0.0, -0.0, 448.0, -448.0, float("nan")])]).contiguous()
    out = torch.empty(v.numel(), dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter casts the NaN lane to int on the way
        _codes_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    expect = v.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = out != expect
    assert not bool(bad.any()), (v[bad][:5], out[bad][:5], expect[bad][:5])


def test_quantize_rows_bytes_equal_the_reference():
    x = randn(6, 1300, dtype=torch.bfloat16, seed=5, scale=3.0)  # two BLOCK sweeps and a ragged tail
    x[1] *= 1e-4  # codes in the subnormal range
    x[2] = 0.0  # the AMAX_FLOOR scale
    x[3, :7] = torch.tensor([0.0, -0.0, 1e-8, -3e-4, 5e-3, 448.0, -1000.0])
    q, s = quantize_rows(x)
    qr, sr = fast.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 1)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
