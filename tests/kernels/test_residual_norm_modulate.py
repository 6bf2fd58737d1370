"""Strict fused gated residual + RMSNorm + modulation (kernels/residual_norm_modulate.py) under the Triton
interpreter: both outputs and every gradient byte-equal to the unfused strict chain `gated_residual` then
`norm_modulate`, accuracy against the float64 truth with a derived tolerance, batch and row invariance on fresh
random inputs, and the refusals of the chain's validators."""

import pytest
import torch

from h3kernels import modulate as M
from h3kernels import norm_modulate as NM
from h3kernels import registry
from h3kernels import residual_norm_modulate as K
from strict_testing import (adaln_projection, adaln_row_index, assert_error_within,
                            norm_weight, randn)
from h3lab.execution import runtime

EPS = 1e-5  # H3Config.norm_eps
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
S, T = 37, 2  # 37 packed rows (no tile multiple); 2 timesteps x 3 modalities -> R = 6 table rows
WIDTHS = [24, 96, 336]  # the tiny model's width and non-power-of-two widths like the release's 5376


def _tables(table):
    """(gate_msa, scale_mlp, shift_mlp): row-strided views, as the model passes them."""
    chunks = table.chunk(6, dim=-1)
    return chunks[2], chunks[4], chunks[3]


def _call(fn, res, y, w, table, idx):
    gate, scale, shift = _tables(table)
    return fn(res, gate, idx, y, w, EPS, scale, shift)


def _unfused(res, gate, idx, y, w, eps, scale, shift):
    """The unfused strict chain the fused kernel must reproduce byte for byte."""
    stream = M.gated_residual(res, gate, idx, y)
    return stream, NM.norm_modulate(stream, w, eps, scale, shift, idx)


def _torch(*args):
    return runtime.REFERENCE_OPS["residual_norm_modulate"](*args)


def _inputs(b, d, dtype, seed):
    return randn(b, S, d, dtype=dtype, seed=seed, scale=2.0), randn(b, S, d, dtype=dtype, seed=seed + 1)


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_bytes_equal_unfused_chain(dtype, d):
    table, idx = adaln_projection(T, d, dtype), adaln_row_index(S, T)
    for b in (1, 3):
        res, y = _inputs(b, d, dtype, seed=3 + b)
        for w in (norm_weight(d, dtype), None):
            out = _call(K.residual_norm_modulate, res, y, w, table, idx)
            want = _call(_unfused, res, y, w, table, idx)
            for name, a, e in zip(("stream", "modulated"), out, want):
                assert a.dtype == dtype and a.shape == res.shape
                assert torch.equal(a, e), f"{name} B={b} weight={w is not None}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_accuracy(dtype):
    """Error against the float64 truth <= 2x torch's same-dtype composition of the reference ops."""
    d = 96
    res, y = _inputs(2, d, dtype, seed=6)
    w, table, idx = norm_weight(d, dtype), adaln_projection(T, d, dtype, seed=7), adaln_row_index(S, T, seed=8)
    out = _call(K.residual_norm_modulate, res, y, w, table, idx)
    torch_out = _call(_torch, res, y, w, table, idx)
    truth = _call(K.reference, res.double(), y.double(), w.double(), table.double(), idx)
    for name, o, t, tr in zip(("stream", "modulated"), out, torch_out, truth):
        assert_error_within(o, t, tr, f"residual_norm_modulate {name} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_batch_and_row_invariance(dtype):
    d = 96
    res, y = _inputs(3, d, dtype, seed=9)
    w, table, idx = norm_weight(d, dtype), adaln_projection(T, d, dtype, seed=10), adaln_row_index(S, T, seed=11)
    full = _call(K.residual_norm_modulate, res, y, w, table, idx)
    assert all(torch.equal(a, b) for a, b in zip(full, _call(K.residual_norm_modulate, res, y, w, table, idx)))
    for b in range(3):  # batch 1 vs N, every position
        one = _call(K.residual_norm_modulate, res[b : b + 1].contiguous(), y[b : b + 1].contiguous(), w, table, idx)
        assert all(torch.equal(o, f[b : b + 1]) for o, f in zip(one, full)), b
    mres, my = res.clone(), y.clone()
    mres[1], my[1] = randn(S, d, dtype=dtype, seed=12), randn(S, d, dtype=dtype, seed=13)
    my[0, 5] = randn(d, dtype=dtype, seed=14)  # one row of batch 0: the other rows keep their bytes
    out = _call(K.residual_norm_modulate, mres, my, w, table, idx)
    for o, f in zip(out, full):
        assert torch.equal(o[2], f[2]) and torch.equal(o[0, :5], f[0, :5]) and torch.equal(o[0, 6:], f[0, 6:])
        assert not torch.equal(o[0, 5], f[0, 5])


def _grads(fn, res, y, w, table, idx, d_stream, d_out):
    wrt = [t for t in (res, y, w, table) if t is not None and t.requires_grad]
    return torch.autograd.grad(_call(fn, res, y, w, table, idx), wrt, (d_stream, d_out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_bytes_equal_unfused_chain(dtype):
    d, s = 24, S
    res, y = _inputs(2, d, dtype, seed=15)
    leaves = [t.requires_grad_() for t in (res, y, norm_weight(d, dtype), adaln_projection(T, d, dtype, seed=16))]
    d_stream, d_out = randn(2, s, d, dtype=dtype, seed=17), randn(2, s, d, dtype=dtype, seed=18)
    idx = adaln_row_index(S, T, seed=19)
    g = _grads(K.residual_norm_modulate, *leaves, idx, d_stream, d_out)
    chain = _grads(_unfused, *leaves, idx, d_stream, d_out)
    names = ("dresidual", "dy", "dweight", "dtable")
    for name, a, b in zip(names, g, chain):
        assert a.dtype == dtype and torch.equal(a, b), name
    t64 = [t.detach().double().requires_grad_() for t in leaves]
    truth = _grads(K.reference, *t64, idx, d_stream.double(), d_out.double())
    torch_g = _grads(_torch, *leaves, idx, d_stream, d_out)
    for name, a, b, t in zip(names, g, torch_g, truth):
        assert_error_within(a, b, t, f"residual_norm_modulate {name} {dtype}")


def test_partial_backward_bytes_equal_unfused_chain():
    """Frozen weights and tables (a LoRA-style step): only the stream gradients, each equal to the chain's."""
    d, dtype = 24, torch.bfloat16
    res, y = (t.requires_grad_() for t in _inputs(1, d, dtype, seed=20))
    w, table, idx = norm_weight(d, dtype), adaln_projection(T, d, dtype, seed=21), adaln_row_index(S, T, seed=22)
    d_stream, d_out = randn(1, S, d, dtype=dtype, seed=23), randn(1, S, d, dtype=dtype, seed=24)
    g = _grads(K.residual_norm_modulate, res, y, w, table, idx, d_stream, d_out)
    assert all(torch.equal(a, b) for a, b in zip(g, _grads(_unfused, res, y, w, table, idx, d_stream, d_out)))


def test_check_and_registry():
    res, y = _inputs(1, 24, torch.bfloat16, seed=25)
    gate, scale, shift = _tables(adaln_projection(T, 24, torch.bfloat16))
    info = K.check(res, gate, adaln_row_index(S, T), y, norm_weight(24, torch.bfloat16), EPS, scale, shift)
    assert info["kernel_id"] == "h3kernels.residual_norm_modulate.residual_norm_modulate.v1"
    assert "BLOCK_D=32,ROWS=64" in info["tile"] and info["acc_dtype"] == "float32"  # rms_norm's tile for D = 24
    op = registry.STRICT_OPS["residual_norm_modulate"]
    assert op.run is K.residual_norm_modulate and op.check is K.check


def _bad_cases():
    res, y = _inputs(2, 24, torch.float32, seed=26)
    w, idx = norm_weight(24, torch.float32), adaln_row_index(S, T)
    g, sc, sh = _tables(adaln_projection(T, 24, torch.float32))
    return [
        ("float64", (res.double(), g.double(), idx, y.double(), w.double(), EPS, sc.double(), sh.double()),
         "dtype torch.float64 not served"),
        ("y dtype", (res, g, idx, y.bfloat16(), w, EPS, sc, sh), "y dtype torch.bfloat16 differs"),
        ("y shape", (res, g, idx, y[:1], w, EPS, sc, sh), r"y shape \[1, 37, 24\] differs from residual"),
        ("gate width", (res, g[:, :8], idx, y, w, EPS, sc, sh), r"gate shape \[6, 8\] must be a non-empty \(R, 24\)"),
        ("weight shape", (res, g, idx, y, w[:16], EPS, sc, sh), r"weight shape \[16\] must be \(24,\)"),
        ("eps zero", (res, g, idx, y, w, 0.0, sc, sh), "eps=0.0 must be a positive number"),
        ("table rows", (res, g, idx, y, w, EPS, sc, sh[:3]), "scale has 6 rows but shift has 3"),
        ("gate vs scale rows", (res, torch.cat([g, g]), idx, y, w, EPS, sc, sh), "gate has 12 rows but scale has 6"),
        ("index int32", (res, g, idx.int(), y, w, EPS, sc, sh), "index dtype torch.int32 must be int64"),
        ("index high", (res, g, idx + 3 * T, y, w, EPS, sc, sh), "out of range for a table of 6 rows"),
        ("device", (res, g, idx, y.to("meta"), w, EPS, sc, sh), "mixed devices"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_refused(case):
    _, args, match = case
    for fn in (K.check, K.residual_norm_modulate):
        with pytest.raises(registry.StrictUnsupported, match=match) as exc:
            fn(*args)
        assert str(exc.value).startswith("residual_norm_modulate: ") and "\n" not in str(exc.value)


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    res, y = _inputs(1, 24, torch.float32, seed=27)
    g, sc, sh = _tables(adaln_projection(T, 24, torch.float32))
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check(res, g, adaln_row_index(S, T), y, None, EPS, sc, sh)
