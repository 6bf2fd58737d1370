"""Strict timestep sinusoid (kernels/timestep.py): layout [cos | sin], accuracy against the float64 truth within
twice torch's float32 error, determinism and row invariance, refusals."""

import math

import pytest
import torch

from h3kernels import registry
from h3kernels import timestep as K
from strict_testing import assert_error_within
from h3lab.execution import runtime


def _t(n, seed=0):
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))  # unscaled timesteps in [0, 1)


@pytest.mark.parametrize("dim", [16, 256, 10], ids=["tiny", "released", "non-pow2 half"])
def test_accuracy(dim):
    t = _t(7, seed=dim)
    out = K.timestep_embedding(t, dim)
    assert out.shape == (7, dim) and out.dtype == torch.float32
    assert_error_within(out, runtime.timestep_embedding(t, dim), K.reference(t, dim), f"timestep dim={dim}")


def test_layout_is_cos_then_sin():
    t = torch.tensor([0.0, 1.0])
    out = K.timestep_embedding(t, 8)
    assert torch.equal(out[0], torch.tensor([1.0] * 4 + [0.0] * 4))  # t = 0: cos 1, sin 0, exactly
    assert torch.allclose(out[1, :4] ** 2 + out[1, 4:] ** 2, torch.ones(4), atol=1e-6)
    assert abs(out[1, 0].item() - math.cos(1.0)) <= 2**-23 and abs(out[1, 4].item() - math.sin(1.0)) <= 2**-23  # freq_0 = 1


def test_determinism_and_row_invariance():
    t = _t(9, seed=1)
    out = K.timestep_embedding(t, 256)
    assert torch.equal(out, K.timestep_embedding(t, 256))
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(2))
    assert torch.equal(K.timestep_embedding(t[perm].contiguous(), 256), out[perm])
    assert torch.equal(K.timestep_embedding(t[4:5].contiguous(), 256), out[4:5])


def test_half_precision_t_is_upcast_like_the_reference():
    t = _t(5, seed=3).bfloat16()
    out = K.timestep_embedding(t, 16)
    assert_error_within(out, runtime.timestep_embedding(t, 16), K.reference(t, 16), "timestep bf16 t")


def test_check_and_dispatch():
    t = _t(3)
    info = K.check(t, 16)
    assert info["tile"] == "BLOCK=8" and info["acc_dtype"] == "float32"
    with runtime.use_mode("strict"):
        out = runtime.ops().timestep_embedding(t, 16, point="time_sinusoid")
    assert torch.equal(out, K.timestep_embedding(t, 16))
    assert runtime.last_trace().records[0].actual == "strict"


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (_t(3).double(), 16), "t dtype torch.float64"),
        (lambda: (torch.arange(3), 16), "t dtype torch.int64"),
        (lambda: (_t(3)[None], 16), r"t shape \[1, 3\]"),
        (lambda: (_t(0), 16), r"t shape \[0\]"),
        (lambda: (_t(6)[::2], 16), "not contiguous"),
        (lambda: (_t(3).requires_grad_(), 16), "requires grad"),
        (lambda: (_t(3), 15), "dim=15 must be an even integer"),
        (lambda: (_t(3), 0), "dim=0"),
        (lambda: (_t(3), 16.0), "dim=16.0"),
    ],
    ids=["float64", "int", "2-D", "empty", "strided", "grad", "odd dim", "zero dim", "float dim"],
)
def test_bad_inputs_refused(make, match):
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.timestep_embedding(*make())


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check(_t(3), 16)
