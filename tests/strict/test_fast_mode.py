"""`--mode fast` (h3lab/execution/fast.py) on the CPU: the quantised product's float32 emulation against a float64 truth, the
per-channel weight cache, and every refusal (the CPU, autograd, strict-contract code asking for fast) as one line.
The FP8 GPU path itself (`torch._scaled_mm`, the Triton row quantiser) is checked on the H200 by
benchmarks/benchmark_every_length.py, byte for byte against `quantize_rows_reference`."""

from __future__ import annotations

import pytest
import torch
from strict_cases import forward_kwargs, make_layout, make_request

from strict_testing import randn
from h3lab import H3Transformer
from h3lab.execution import context, fast, runtime


def test_fast_is_a_mode_and_not_strict():
    assert "fast" in runtime.MODES
    assert runtime.Trace(mode="fast", device="cuda").to_dict()["strict"] is False
    assert "strict" not in runtime.Trace(mode="strict", device="cuda").to_dict()  # other traces keep their keys


def test_quantize_rows_reference_error_bound():
    x = randn(37, 96, dtype=torch.bfloat16, seed=1, scale=3.0)
    q, scale = fast.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (37, 1)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    assert torch.equal(scale, amax / fast.FP8_MAX)
    back = q.float() * scale
    assert back.abs().amax(dim=1, keepdim=True).sub(amax).abs().max() <= 1e-6 * amax.max()  # the amax is exact
    # e4m3: 3 mantissa bits, a relative error of at most 2**-4 for normals; subnormals lose at most half their step
    err = (back - x.float()).abs()
    bound = torch.maximum(x.float().abs() * 2.0**-4, scale * 2.0**-10)
    assert bool((err <= bound).all()) and float(err.max()) > 0


def test_linear_reference_against_float64_truth():
    x = randn(3, 50, 128, dtype=torch.bfloat16, seed=2)
    w = randn(64, 128, dtype=torch.bfloat16, seed=3, scale=128**-0.5)
    b = randn(64, dtype=torch.bfloat16, seed=4, scale=0.02)
    truth = x.double() @ w.double().t() + b.double()
    y = fast.linear_reference(x, w, b)
    assert y.shape == (3, 50, 64) and y.dtype == torch.bfloat16
    rel = float((y.double() - truth).norm() / truth.norm())
    bf16 = float((torch.nn.functional.linear(x, w, b).double() - truth).norm() / truth.norm())
    assert bf16 < rel < 0.08, (rel, bf16)  # FP8 costs accuracy against bf16, within e4m3's few per cent


def test_weight_cache_quantises_once_and_follows_in_place_updates():
    w = randn(32, 48, dtype=torch.bfloat16, seed=5)
    q1, s1 = fast.WEIGHTS.get(w)
    q2, s2 = fast.WEIGHTS.get(w)
    assert q1 is q2 and s1 is s2 and s1.shape == (1, 32)
    with torch.no_grad():
        w.mul_(2)
    q3, s3 = fast.WEIGHTS.get(w)
    assert q3 is not q1 and torch.equal(s3, 2 * s1)


@pytest.fixture(scope="module")
def model(tiny_snapshot) -> H3Transformer:
    return H3Transformer.from_pretrained(tiny_snapshot, subfolder="transformer")


def _kwargs(model):
    layout = make_layout("t2va", model.config.patch_size)
    return forward_kwargs(layout, [make_request(model.config, layout, 7)])


def test_fast_refuses_the_cpu_in_one_line(model):
    with runtime.use_mode("fast"), torch.no_grad(), pytest.raises(runtime.FastModeError) as info:
        model(**_kwargs(model))
    msg = str(info.value)
    assert "\n" not in msg and "needs a CUDA GPU" in msg and "on cpu" in msg
    assert runtime.current_mode() == "off"  # the mode is left as it was


def test_fast_refuses_autograd(model):
    x = randn(2, 16, dtype=torch.bfloat16, seed=6).requires_grad_()
    w = randn(16, 16, dtype=torch.bfloat16, seed=7)
    with runtime.use_mode("fast"), pytest.raises(runtime.FastModeError, match="inference-only"):
        runtime.ops().linear(x, w, point="probe")


def test_require_not_fast():
    runtime.require_not_fast("an RL rollout")  # off: nothing to refuse
    with runtime.use_mode("strict"):
        runtime.require_not_fast("an RL rollout")
    with runtime.use_mode("fast"), pytest.raises(runtime.FastModeError) as info:
        runtime.require_not_fast("an RL rollout")
    assert str(info.value).startswith("an RL rollout needs the strict contract") and "\n" not in str(info.value)
    with pytest.raises(runtime.FastModeError):
        runtime.require_not_fast("a rollout", mode="fast")


def test_fp8_attention_choice_and_its_refusal():
    q = torch.zeros(1, fast.FP8_ATTENTION_MIN_ROWS, 2, 128, dtype=torch.bfloat16)
    short, small_d = q[:, :64], torch.zeros(1, 8000, 2, 64, dtype=torch.bfloat16)
    assert fast._fp8_attention_wanted((q,)) and not fast._fp8_attention_wanted((short,))  # "auto": the crossover
    assert not fast._fp8_attention_wanted((small_d,))  # auto: head_dim 128 only (the measured case)
    with fast.use_fp8_attention("on"):
        assert fast._fp8_attention_wanted((short,)) and fast._fp8_attention_wanted((small_d,))
        assert not fast._fp8_attention_wanted((torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16),))  # unsupported D
        key_on = context.current().digest()
    with fast.use_fp8_attention("off"):
        assert not fast._fp8_attention_wanted((q,))
        assert context.current().digest() != key_on  # a captured forward never serves another attention choice
    with pytest.raises(ValueError) as info:
        with fast.use_fp8_attention("yes"):
            pass
    assert "must be one of auto, on, off" in str(info.value) and "\n" not in str(info.value)
