"""Strict elementwise ops (kernels/elementwise.py): `add` bit-equal in every dtype, `silu` / `swiglu` bit-equal to
the reference in bfloat16 and within the derived tolerance elsewhere, invariances, deterministic accurate
backward, refusals."""

import pytest
import torch

from h3kernels import elementwise as K
from h3kernels import registry
from strict_testing import assert_error_within, randn
from h3lab.execution import runtime

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
SHAPE = (3, 50, 24)  # 3600 elements: 4 flat 1024-blocks, the last ragged


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_bit_equal(dtype):
    a, b = randn(*SHAPE, dtype=dtype, seed=1), randn(*SHAPE, dtype=dtype, seed=2, scale=3.0)
    assert torch.equal(K.add(a, b), runtime.add(a, b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_forward(dtype):
    x = randn(*SHAPE, dtype=dtype, seed=3, scale=3.0)
    out, ref = K.silu(x), runtime.silu(x)
    assert_error_within(out, ref, K.reference_silu(x.double()), f"silu {dtype}")
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)  # float32 silu rounded once, as torch does on bf16


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_forward(dtype):
    h = randn(3, 50, 80, dtype=dtype, seed=4, scale=2.0)
    out, ref = K.swiglu(h), runtime.swiglu(h)
    assert out.shape == (3, 50, 40) and out.dtype == dtype
    assert_error_within(out, ref, K.reference_swiglu(h.double()), f"swiglu {dtype}")
    if dtype == torch.bfloat16:
        assert torch.equal(out, ref)  # round(value * round(silu(gate)))


def test_swiglu_two_roundings_are_matched():
    """A single rounding of value * silu(gate) would differ from torch on bf16: the intermediate one is matched."""
    h = randn(4, 64, 80, dtype=torch.bfloat16, seed=5, scale=2.0)
    once = K.reference_swiglu(h).to(torch.bfloat16)
    assert not torch.equal(once, runtime.swiglu(h))
    assert torch.equal(K.swiglu(h), runtime.swiglu(h))


def test_invariances():
    """Element ops: a row's bytes never depend on the rest of the batch or on the flat block it lands in."""
    h = randn(3, 17, 80, dtype=torch.bfloat16, seed=6, scale=2.0)
    x, y = h[..., :40].contiguous(), h[..., 40:].contiguous()
    for fn, args in ((K.swiglu, (h,)), (K.silu, (x,)), (K.add, (x, y))):
        full = fn(*args)
        assert torch.equal(full, fn(*args))
        for b in range(3):
            assert torch.equal(fn(*(a[b : b + 1].contiguous() for a in args)), full[b : b + 1])
        perm = torch.randperm(17, generator=torch.Generator().manual_seed(7))
        assert torch.equal(fn(*(a[:, perm].contiguous() for a in args)), full[:, perm])
        shifted = fn(*(torch.cat([a[:, :5], a], 1).contiguous() for a in args))  # every element moves block
        assert torch.equal(shifted[:, 5:], full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward(dtype):
    h = randn(2, 30, 80, dtype=dtype, seed=8, scale=2.0).requires_grad_()
    dy = randn(2, 30, 40, dtype=dtype, seed=9)
    (g,) = torch.autograd.grad(K.swiglu(h), (h,), dy)
    (g2,) = torch.autograd.grad(K.swiglu(h), (h,), dy)
    assert torch.equal(g, g2)
    (r,) = torch.autograd.grad(runtime.swiglu(h), (h,), dy)
    h64 = h.detach().double().requires_grad_()
    (t,) = torch.autograd.grad(K.reference_swiglu(h64), (h64,), dy.double())
    assert_error_within(g, r, t, f"swiglu dh {dtype}")

    x = randn(2, 30, 40, dtype=dtype, seed=10, scale=3.0).requires_grad_()
    (g,) = torch.autograd.grad(K.silu(x), (x,), dy)
    (g2,) = torch.autograd.grad(K.silu(x), (x,), dy)
    assert torch.equal(g, g2)
    (r,) = torch.autograd.grad(runtime.silu(x), (x,), dy)
    x64 = x.detach().double().requires_grad_()
    (t,) = torch.autograd.grad(K.reference_silu(x64), (x64,), dy.double())
    assert_error_within(g, r, t, f"silu dx {dtype}")

    a = randn(2, 30, 40, dtype=dtype, seed=11).requires_grad_()
    ga, gb = torch.autograd.grad(K.add(a, x), (a, x), dy)
    assert torch.equal(ga, dy) and torch.equal(gb, dy)


def test_check_and_dispatch():
    h = randn(2, 5, 80, dtype=torch.bfloat16, seed=12)
    assert K.check_swiglu(h)["tile"] == "BLOCK_F=64,ROWS=32"
    assert "numpy(interpreter) exp" in K.check_silu(h)["kernel_id"]
    assert K.check_add(h, h)["kernel_id"] == "h3kernels.elementwise.add.v1"
    with runtime.use_mode("strict"):
        ops = runtime.ops()
        out = ops.swiglu(h, point="blocks.0.swiglu")
        temb = ops.silu(h[0, :, :4].float().contiguous(), point="time_mlp")
        s = ops.add(out, out, point="refiner.0.residual1")
    assert torch.equal(out, runtime.swiglu(h)) and torch.equal(s, runtime.add(out, out))
    assert temb.dtype == torch.float32
    assert {r.actual for r in runtime.last_trace().records} == {"strict"}


@pytest.mark.parametrize(
    "fn,make,match",
    [
        (K.check_add, lambda: (randn(2, 3), randn(2, 3).bfloat16()), "dtypes torch.float32 and torch.bfloat16 differ"),
        (K.check_add, lambda: (randn(2, 3), randn(1, 3)), "no broadcasting"),
        (K.check_add, lambda: (randn(2, 3).double(), randn(2, 3).double()), "dtype torch.float64 not served"),
        (K.check_add, lambda: (randn(3, 2).t(), randn(2, 3)), "not contiguous"),
        (K.check_add, lambda: (randn(2, 3), randn(2, 3).to("meta")), "mixed devices"),
        (K.check_silu, lambda: (torch.ones(4, dtype=torch.int64),), "dtype torch.int64"),
        (K.check_silu, lambda: (torch.empty(0, 3),), "empty"),
        (K.check_swiglu, lambda: (randn(2, 7),), "last axis 7 of h must be even"),
        (K.check_swiglu, lambda: (randn(4, 6)[:, ::2],), "not contiguous"),
    ],
    ids=["add dtypes", "add broadcast", "add float64", "add non-contiguous", "add devices", "silu int", "silu empty",
         "swiglu odd", "swiglu strided"],
)
def test_bad_inputs_refused(fn, make, match):
    with pytest.raises(registry.StrictUnsupported, match=match):
        fn(*make())


def test_run_refuses_like_check():
    with pytest.raises(registry.StrictUnsupported, match="no broadcasting"):
        K.add(randn(2, 3), randn(1, 3))
    with pytest.raises(registry.StrictUnsupported, match="must be even"):
        K.swiglu(randn(2, 7))


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check_silu(randn(4))
