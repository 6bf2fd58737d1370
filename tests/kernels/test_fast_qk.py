"""kernels/fast_qk.py through Triton's interpreter against the `off` ops in float32: within one bfloat16 rounding,
strided head views read in place, the pass-through channels exact, and bad inputs refused in one line."""

from __future__ import annotations

import pytest
import torch

from strict_testing import randn
from h3kernels.fast_qk import head_rms_norm, rope
from h3lab.execution import runtime


def _within_one_bf16_step(y, ref):
    assert bool(((y.float() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-6).all())


def test_head_rms_norm_against_float32_reference():
    x = randn(2, 5, 22, 64, dtype=torch.bfloat16, seed=1, scale=2.0)[:, :, ::2]  # 11 heads, strided
    w = randn(64, dtype=torch.bfloat16, seed=2, scale=0.1) + 1
    y = head_rms_norm(x, w, 1e-6)
    assert y.shape == x.shape and y.is_contiguous()
    _within_one_bf16_step(y, runtime.rms_norm(x.float(), w.float(), 1e-6))


def test_rope_against_float32_reference():
    x = randn(1, 6, 9, 32, dtype=torch.bfloat16, seed=3, scale=2.0)
    cos, sin = randn(6, 24, seed=4), randn(6, 24, seed=5)
    y = rope(x, cos, sin)
    ref = runtime.rope(x.float(), cos.bfloat16().float(), sin.bfloat16().float())
    _within_one_bf16_step(y, ref)
    assert torch.equal(y[..., 24:], x[..., 24:])
    assert float((y.float() - runtime.rope(x.float(), sin, cos)).abs().max()) > 0.1  # swapped tables are caught


def test_fast_qk_refuses_bad_inputs_in_one_line():
    x = randn(1, 4, 2, 16, dtype=torch.bfloat16, seed=6)
    cases = [
        (lambda: head_rms_norm(x.float(), torch.ones(16), 1e-6), "must be bfloat16 (B, S, H, D)"),
        (lambda: head_rms_norm(x, torch.ones(8), 1e-6), "must be (16,)"),
        (lambda: rope(x, torch.ones(4, 6), torch.ones(4, 5)), "R even"),
        (lambda: rope(x, torch.ones(4, 18), torch.ones(4, 18)), "<= 16"),
    ]
    for call, rule in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert rule in str(info.value) and "\n" not in str(info.value)
