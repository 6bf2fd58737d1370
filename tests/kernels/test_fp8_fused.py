"""kernels/fp8_fused.py through Triton's interpreter against the float32 torch references in h3lab/execution/fast.py: the
bfloat16 rows within one bfloat16 rounding step of the float32 reference, the e4m3 codes and scales byte-equal to
the reference quantisation of those rows, and bad inputs refused in one line."""

from __future__ import annotations

import pytest
import torch

from strict_testing import randn
from h3kernels.fp8_fused import MAX_COLS, norm_modulate_quant, swiglu_quant
from h3lab.execution import fast


def _within_one_bf16_step(y: torch.Tensor, ref: torch.Tensor) -> None:
    step = ref.float().abs() * 2.0**-8 + 1e-30  # bf16 keeps 8 significant bits: one rounding step at most
    assert bool(((y.float() - ref.float()).abs() <= step).all())
    assert float((y.float() != ref.float()).float().mean()) < 0.02  # most rows round the same way


def _codes_of_own_rows(y, q, s) -> None:
    qr, sr = fast.quantize_rows_reference(y)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


def test_norm_modulate_quant_against_float32_reference():
    B, S, D, T = 2, 7, 200, 3  # D not a power of two: a masked tail
    x = randn(B, S, D, dtype=torch.bfloat16, seed=1, scale=2.0)
    w = randn(D, dtype=torch.bfloat16, seed=2, scale=0.5) + 1
    table = randn(T * 3, 6 * D, dtype=torch.bfloat16, seed=3, scale=0.3)
    shift, scale = table.chunk(6, dim=-1)[:2]  # strided views of the AdaLN table, as the block passes them
    index = torch.tensor([0, 4, 8, 1, 1, 2, 7], dtype=torch.int64)
    y, q, s = norm_modulate_quant(x, w, 1e-6, scale, shift, index)
    yr, _, _ = fast.norm_modulate_quant_reference(x, w, 1e-6, scale, shift, index)
    assert y.shape == (B, S, D) and y.dtype == torch.bfloat16 and q.shape == (B * S, D) and s.shape == (B * S, 1)
    _within_one_bf16_step(y, yr)
    _codes_of_own_rows(y, q, s)
    ref_off = torch.nn.functional.rms_norm(x, (D,), w, 1e-6) * (1 + scale[index]) + shift[index]
    assert float((y.float() - ref_off.float()).norm() / ref_off.float().norm()) < 1e-2  # the op it stands for


def test_swiglu_quant_against_float32_reference():
    h = randn(3, 5, 2 * 300, dtype=torch.bfloat16, seed=4, scale=2.0)
    y, q, s = swiglu_quant(h)
    yr, _, _ = fast.swiglu_quant_reference(h)
    assert y.shape == (3, 5, 300) and q.shape == (15, 300) and s.shape == (15, 1)
    _within_one_bf16_step(y, yr)
    _codes_of_own_rows(y.reshape(15, 300), q, s)


def test_fused_producers_refuse_bad_inputs_in_one_line():
    x = randn(1, 4, 64, dtype=torch.bfloat16, seed=5)
    w, tab, idx = torch.ones(64, dtype=torch.bfloat16), randn(3, 64, dtype=torch.bfloat16, seed=6), torch.zeros(4, dtype=torch.int64)
    cases = [
        (lambda: norm_modulate_quant(x.float(), w, 1e-6, tab, tab, idx), "bfloat16 rows"),
        (lambda: norm_modulate_quant(x[0], w, 1e-6, tab, tab, idx), "(batch, rows, features)"),
        (lambda: norm_modulate_quant(x, w, 1e-6, tab[:, :32], tab, idx), "must be (R, 64)"),
        (lambda: norm_modulate_quant(x, w, 1e-6, tab, tab, idx.int()), "must be int64 of shape (4,)"),
        (lambda: swiglu_quant(randn(2, 63, dtype=torch.bfloat16)), "even [value; gate] width"),
        (lambda: swiglu_quant(torch.ones(1, 2 * (MAX_COLS + 2), dtype=torch.bfloat16)), f"1..{MAX_COLS} columns"),
    ]
    for call, rule in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert rule in str(info.value) and "\n" not in str(info.value)
