"""kernels/fp8_attention.py through Triton's interpreter (FP8 products upcast to float32 there, see its contract):
accuracy against float32 SDPA and against the same block quantisation emulated in torch, the key order, strided
(B, S, H, D) views read in place, the block quantiser's bytes, and bad inputs refused in one line."""

from __future__ import annotations

import pytest
import torch

from strict_testing import randn
from h3kernels.fp8_attention import attention_fp8, attention_fp8_reference, quantize_blocks, quantize_blocks_reference


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _sdpa32(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        *(t.float().permute(0, 2, 1, 3) for t in (q, k, v))).permute(0, 2, 1, 3)


def test_attention_fp8_within_bound_of_float32_sdpa():
    B, S, H, D = 2, 45, 2, 64  # S not a multiple of the 32-row interpreter block: a masked tail of keys and queries
    qkv = randn(B, S, 3 * H * D, dtype=torch.bfloat16, seed=11)  # one projection output, q/k/v strided views of it
    q, k, v = (t.unflatten(-1, (H, D)) for t in qkv.chunk(3, dim=-1))
    v = v * 3  # a value scale unlike q/k's
    out = attention_fp8(q, k, v)
    assert out.shape == (B, S, H, D) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert bool(torch.isfinite(out.float()).all())
    assert _rel(out, _sdpa32(q, k, v)) < 0.08
    assert _rel(out, attention_fp8_reference(q, k, v, 32, 32)) < 0.04
    assert _rel(out, _sdpa32(q, k, v.flip(1))) > 0.3  # the bound is tight enough to see a wrong value row


def test_attention_fp8_key_order_only_reorders_the_sum():
    q, k, v = (randn(1, 40, 1, 32, dtype=torch.bfloat16, seed=s) for s in (1, 2, 3))
    order = torch.randperm(40, generator=torch.Generator().manual_seed(4))
    out = attention_fp8(q, k, v, order)
    assert _rel(out, _sdpa32(q, k, v)) < 0.08  # attention is invariant to the key order
    assert _rel(out, attention_fp8(q, k, v)) < 0.04


def test_quantize_blocks_codes_equal_the_torch_emulation():
    x = randn(1, 70, 3, 32, dtype=torch.bfloat16, seed=5, scale=4.0)
    codes, scales = quantize_blocks(x, 32, transpose=False)
    ref_codes, ref_scales = quantize_blocks_reference(x, 32)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    t_codes, _ = quantize_blocks(x, 32, transpose=True)
    assert torch.equal(t_codes.transpose(1, 2).view(torch.uint8), codes.view(torch.uint8))
    assert bool((codes.view(torch.uint8)[:, 70:] == 0).all())  # the padding rows


def test_attention_fp8_refuses_bad_inputs_in_one_line():
    q = randn(1, 8, 2, 32, dtype=torch.bfloat16, seed=6)
    cases = [
        (lambda: attention_fp8(q.float(), q, q), "must be bfloat16 (B, S, H, D)"),
        (lambda: attention_fp8(q, q[:, :4], q), "must match q's"),
        (lambda: attention_fp8(q[..., :16], q[..., :16], q[..., :16]), "head_dim 16 is not supported"),
        (lambda: attention_fp8(q, q, q.transpose(1, 3).contiguous().transpose(1, 3)), "stride"),
        (lambda: attention_fp8(q, q, q, torch.arange(8, dtype=torch.int32)), "must be int64 of shape (8,)"),
    ]
    for call, rule in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert rule in str(info.value) and "\n" not in str(info.value)
