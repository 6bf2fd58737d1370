"""Strict 3-axis MM-RoPE (kernels/rope.py): `rope` is bit-equal to the reference in every dtype and invariant to
batch and row permutation, its backward is the exact transpose rotation; `rope_table` is deterministic and as
accurate against the float64 truth as torch's float32 cos / sin."""

import pytest
import torch

from h3kernels import registry
from h3kernels import rope as K
from strict_testing import assert_error_within, randn
from h3lab.execution import runtime

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
# (H, D, F): tiny (12 of 16 channels rotate), released head geometry (96 of 128) with 3 heads.
GEOMETRIES = [(2, 16, 2), (3, 128, 16)]


def _positions(s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randint(0, hi, (s,), generator=g) for hi in (22, 30, 53)], dim=-1)  # (S, 3) t,h,w


def _inv_freq(f, theta=10000.0):
    return 1.0 / (theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32) / (2 * f)))


def _tables(s, f, seed=0):
    return runtime.rope_table(_positions(s, seed), _inv_freq(f))


@pytest.mark.parametrize("h,d,f", GEOMETRIES, ids=["tiny 12/16", "released 96/128"])
def test_rope_table_accuracy_and_determinism(h, d, f):
    pos, inv = _positions(19, seed=1), _inv_freq(f)
    cos, sin = K.rope_table(pos, inv)
    cos2, sin2 = K.rope_table(pos, inv)
    assert torch.equal(cos, cos2) and torch.equal(sin, sin2)
    assert cos.dtype == torch.float32 and cos.shape == (19, 6 * f)
    ref_cos, ref_sin = runtime.rope_table(pos, inv)
    true_cos, true_sin = K.reference_rope_table(pos, inv)
    # the angle is one float32 multiply in both: only cos / sin implementations differ (see the contract)
    assert_error_within(cos, ref_cos, true_cos, "rope_table cos", floor_ulps=2)
    assert_error_within(sin, ref_sin, true_sin, "rope_table sin", floor_ulps=2)
    assert (cos.double() - true_cos).abs().max() <= 4 * 2**-24 * true_cos.abs().max()  # ~2 ulp of the range


def test_rope_table_row_invariance():
    pos, inv = _positions(23, seed=2), _inv_freq(2)
    cos, sin = K.rope_table(pos, inv)
    perm = torch.randperm(23, generator=torch.Generator().manual_seed(3))
    pcos, psin = K.rope_table(pos[perm].contiguous(), inv)
    assert torch.equal(pcos, cos[perm]) and torch.equal(psin, sin[perm])
    one_cos, _ = K.rope_table(pos[5:6].contiguous(), inv)
    assert torch.equal(one_cos, cos[5:6])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h,d,f", GEOMETRIES, ids=["tiny 12/16", "released 96/128"])
def test_rope_bit_equal_to_reference(h, d, f, dtype):
    s = 7
    x = randn(2, s, h, d, dtype=dtype, seed=4)
    cos, sin = _tables(s, f, seed=5)
    out = K.rope(x, cos, sin)
    assert torch.equal(out, runtime.rope(x, cos, sin))
    assert torch.equal(out[..., 6 * f :], x[..., 6 * f :])  # pass-through channels untouched


def test_rope_float16_tables_are_cast_like_the_reference():
    x = randn(1, 5, 2, 16, dtype=torch.bfloat16, seed=6)
    cos, sin = _tables(5, 2, seed=7)
    cos, sin = cos.half(), sin.half()  # fp16 tables cast to bf16 first, exactly as the reference does
    assert torch.equal(K.rope(x, cos, sin), runtime.rope(x, cos, sin))


def test_rope_invariances():
    b, s, h, d, f = 3, 9, 2, 16, 2
    x = randn(b, s, h, d, dtype=torch.bfloat16, seed=8)
    pos = _positions(s, seed=9)
    cos, sin = runtime.rope_table(pos, _inv_freq(f))
    full = K.rope(x, cos, sin)
    assert torch.equal(full, K.rope(x, cos, sin))  # repeat
    for i in range(b):
        assert torch.equal(K.rope(x[i : i + 1].contiguous(), cos, sin), full[i : i + 1])  # batch 1 vs N
    assert torch.equal(K.rope(x[[2, 0, 1]].contiguous(), cos, sin), full[[2, 0, 1]])  # batch position
    mutated = x.clone()
    mutated[0] = randn(s, h, d, dtype=torch.bfloat16, seed=10)
    assert torch.equal(K.rope(mutated, cos, sin)[1:], full[1:])  # unrelated-row mutation
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(11))  # rows permuted with their positions
    pcos, psin = runtime.rope_table(pos[perm].contiguous(), _inv_freq(f))
    assert torch.equal(K.rope(x[:, perm].contiguous(), pcos, psin), full[:, perm])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("h,d,f", GEOMETRIES, ids=["tiny 12/16", "released 96/128"])
def test_rope_backward(h, d, f, dtype):
    s = 6
    x = randn(2, s, h, d, dtype=dtype, seed=12).requires_grad_()
    cos, sin = _tables(s, f, seed=13)
    dy = randn(2, s, h, d, dtype=dtype, seed=14)
    (gx,) = torch.autograd.grad(K.rope(x, cos, sin), (x,), dy)
    (gx2,) = torch.autograd.grad(K.rope(x, cos, sin), (x,), dy)
    assert torch.equal(gx, gx2) and gx.dtype == dtype
    (rx,) = torch.autograd.grad(runtime.rope(x, cos, sin), (x,), dy)
    x64 = x.detach().double().requires_grad_()
    c64, s64 = cos.to(dtype).double(), sin.to(dtype).double()  # the op casts the tables to x's dtype first
    (tx,) = torch.autograd.grad(K.reference_rope(x64, c64, s64, acc=torch.float64), (x64,), dy.double())
    assert_error_within(gx, rx, tx, f"rope dx {dtype}")
    assert torch.equal(gx[..., 6 * f :], dy[..., 6 * f :])


def test_check_and_dispatch():
    x = randn(1, 4, 2, 16, dtype=torch.bfloat16, seed=15)
    pos, inv = _positions(4, seed=16), _inv_freq(2)
    assert K.check_rope_table(pos, inv)["acc_dtype"] == "float32"
    assert "numpy(interpreter)" in K.check_rope_table(pos, inv)["kernel_id"]
    with runtime.use_mode("strict"):
        ops = runtime.ops()
        cos, sin = ops.rope_table(pos, inv, point="rope_cos")
        q = ops.rope(x, cos, sin, point="blocks.0.q_rope")
    assert torch.equal(q, runtime.rope(x, cos, sin))
    assert [r.kernel_id for r in runtime.last_trace().records][1] == "h3kernels.rope.rope.v1"


def _bad_rope_cases():
    x = randn(1, 4, 2, 16, seed=17)
    cos, sin = _tables(4, 2)
    return [
        ("x dtype", (x.double(), cos, sin), "x dtype torch.float64"),
        ("x rank", (x[0], cos, sin), r"must be a non-empty \(B, S, H, D\)"),
        ("x non-contiguous", (x.transpose(1, 2).contiguous().transpose(1, 2), cos, sin), "not contiguous"),
        ("table rows", (x, cos[:3], sin[:3]), r"cos shape \[3, 12\] must be \(4, R\)"),
        ("table odd", (x, cos[:, :11].contiguous(), sin[:, :11].contiguous()), "rotary width 11 must be even"),
        ("table too wide", (x, torch.cat([cos, cos], 1), torch.cat([sin, sin], 1)), "rotary width 24 must be even and in"),
        ("sin shape", (x, cos, sin[:, :10].contiguous()), "sin shape"),
        ("table int", (x, cos.int(), sin), "cos dtype torch.int32"),
        ("table grad", (x, cos.clone().requires_grad_(), sin), "cos requires grad"),
        ("empty", (x[:, :0], cos[:0], sin[:0]), "non-empty"),
        ("mixed devices", (x, cos.to("meta"), sin), "mixed devices"),
    ]


@pytest.mark.parametrize("case", _bad_rope_cases(), ids=lambda c: c[0])
def test_rope_bad_inputs_refused(case):
    _, args, match = case
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.check_rope(*args)
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.rope(*args)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (_positions(4).double(), _inv_freq(2)), "position_ids dtype torch.float64"),
        (lambda: (_positions(4)[:, :2].contiguous(), _inv_freq(2)), r"must be a non-empty \(S, 3\)"),
        (lambda: (_positions(4), _inv_freq(2).double()), "inv_freq dtype torch.float64"),
        (lambda: (_positions(4), _inv_freq(2).requires_grad_()), "inv_freq requires grad"),
        (lambda: (_positions(4), torch.zeros(0)), r"inv_freq shape \[0\]"),
        (lambda: (_positions(0), _inv_freq(2)), "non-empty"),
        (lambda: (_positions(4).t().contiguous().t(), _inv_freq(2)), "not contiguous"),
    ],
    ids=["pos float64", "pos shape", "inv_freq float64", "inv_freq grad", "inv_freq empty", "empty", "non-contiguous"],
)
def test_rope_table_bad_inputs_refused(make, match):
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.rope_table(*make())


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check_rope_table(_positions(4), _inv_freq(2))
