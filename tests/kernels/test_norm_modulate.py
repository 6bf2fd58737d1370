"""Strict fused RMSNorm + modulation (kernels/norm_modulate.py) under the Triton interpreter: forward and gradients
byte-equal to the unfused strict chain `modulate(rms_norm(...))`, accuracy against the float64 truth with a derived
tolerance, batch invariance, and the refusals of both validators."""

import pytest
import torch

from h3kernels import modulate as M
from h3kernels import norm_modulate as K
from h3kernels import registry
from h3kernels import rms_norm as N
from strict_testing import (adaln_projection, adaln_row_index, assert_error_within,
                            norm_weight, randn)
from h3lab.execution import runtime

EPS = 1e-5  # H3Config.norm_eps
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
S, T = 37, 2  # 37 packed rows (no tile multiple); 2 timesteps x 3 modalities -> R = 6 table rows
# hidden 24 is the tiny model's; 96, 160 and 336 are non-power-of-two widths like the release's 5376 = 21 * 256
WIDTHS = [24, 96, 160, 336]


def _tables(table):
    shift, scale = table.chunk(6, dim=-1)[:2]
    return scale, shift


def _unfused(x, w, eps, scale, shift, idx):
    """The unfused strict chain the fused kernel must reproduce byte for byte."""
    return M.modulate(N.rms_norm(x, w, eps), scale, shift, idx)


def _torch(x, w, eps, scale, shift, idx):
    """torch's same-dtype composition of the two reference ops (the error yardstick)."""
    ref = runtime.REFERENCE_OPS
    return ref["modulate"](ref["rms_norm"](x, w, eps), scale, shift, idx)


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_bytes_equal_unfused_chain(dtype, d):
    scale, shift = _tables(adaln_projection(T, d, dtype))
    assert not scale.is_contiguous()  # row-strided views, as the model passes them
    idx = adaln_row_index(S, T)
    for b in (1, 3):
        x = randn(b, S, d, dtype=dtype, seed=3 + b)
        for w in (norm_weight(d, dtype), None):
            out = K.norm_modulate(x, w, EPS, scale, shift, idx)
            assert out.dtype == dtype and out.shape == x.shape
            assert torch.equal(out, _unfused(x, w, EPS, scale, shift, idx)), f"B={b} weight={w is not None}"


def test_contiguous_tables_same_bytes():
    scale, shift = _tables(adaln_projection(T, 96, torch.bfloat16))
    x, w, idx = randn(2, S, 96, dtype=torch.bfloat16, seed=5), norm_weight(96, torch.bfloat16), adaln_row_index(S, T)
    out = K.norm_modulate(x, w, EPS, scale.contiguous(), shift.contiguous(), idx)
    assert torch.equal(out, K.norm_modulate(x, w, EPS, scale, shift, idx))


@pytest.mark.parametrize("d", [24, 336])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_accuracy(dtype, d):
    """Error against the float64 truth <= 2x torch's same-dtype composition of the two reference ops."""
    x, w = randn(2, S, d, dtype=dtype, seed=6), norm_weight(d, dtype)
    scale, shift = _tables(adaln_projection(T, d, dtype))
    idx = adaln_row_index(S, T, seed=7)
    torch_out = _torch(x, w, EPS, scale, shift, idx)
    truth = K.reference(x.double(), w.double(), EPS, scale.double(), shift.double(), idx)
    assert_error_within(K.norm_modulate(x, w, EPS, scale, shift, idx), torch_out, truth, f"norm_modulate {d} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_batch_invariance(dtype):
    d = 160
    x, w = randn(3, S, d, dtype=dtype, seed=8), norm_weight(d, dtype)
    scale, shift = _tables(adaln_projection(T, d, dtype))
    idx = adaln_row_index(S, T, seed=9)
    full = K.norm_modulate(x, w, EPS, scale, shift, idx)
    assert torch.equal(full, K.norm_modulate(x, w, EPS, scale, shift, idx))  # repeat
    for b in range(3):  # batch 1 vs N
        assert torch.equal(K.norm_modulate(x[b : b + 1].contiguous(), w, EPS, scale, shift, idx), full[b : b + 1])
    mutated = x.clone()
    mutated[1] = randn(S, d, dtype=dtype, seed=10)
    assert torch.equal(K.norm_modulate(mutated, w, EPS, scale, shift, idx)[[0, 2]], full[[0, 2]])
    mutated[0, 5] = randn(d, dtype=dtype, seed=11)  # one row of batch 0: the other rows of batch 0 keep their bytes
    out = K.norm_modulate(mutated, w, EPS, scale, shift, idx)
    assert torch.equal(out[0, :5], full[0, :5]) and torch.equal(out[0, 6:], full[0, 6:])


def _grads(fn, x, w, table, idx, dy):
    """Gradients of fn(x, w, eps, scale, shift, idx) w.r.t. whichever of x, w, table require them."""
    scale, shift = _tables(table)
    wrt = [t for t in (x, w, table) if t is not None and t.requires_grad]
    return torch.autograd.grad(fn(x, w, EPS, scale, shift, idx), wrt, dy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("d", [24, 96])
def test_backward_bytes_equal_unfused_chain(d, dtype):
    s = 100  # 200 (b, s) rows over 6 table rows: ~33 each, so table sums span two 32-entry chunks
    x = randn(2, s, d, dtype=dtype, seed=12).requires_grad_()
    w = norm_weight(d, dtype).requires_grad_()
    table = adaln_projection(T, d, dtype, seed=13).requires_grad_()  # d(scale), d(shift) land in its first two chunks
    idx, dy = adaln_row_index(s, T, seed=14), randn(2, s, d, dtype=dtype, seed=15)
    g = _grads(K.norm_modulate, x, w, table, idx, dy)
    assert all(torch.equal(a, b) for a, b in zip(g, _grads(K.norm_modulate, x, w, table, idx, dy)))  # repeat
    chain = _grads(_unfused, x, w, table, idx, dy)
    for name, a, b in zip(("dx", "dweight", "dtable"), g, chain):
        assert a.dtype == dtype and torch.equal(a, b), name
    torch_g = _grads(_torch, x, w, table, idx, dy)
    t64 = [t.detach().double().requires_grad_() for t in (x, w, table)]
    truth = _grads(K.reference, *t64, idx, dy.double())
    for name, a, b, t in zip(("dx", "dweight", "dtable"), g, torch_g, truth):
        assert_error_within(a, b, t, f"norm_modulate {name} {d} {dtype}")


@pytest.mark.parametrize("wants", ["x", "tables", "x+tables no weight"])
def test_partial_backward_bytes_equal_unfused_chain(wants):
    """Only the requested gradients are computed (y is recomputed only for d(scale)); each equals the chain's."""
    dtype, d = torch.bfloat16, 96
    x = randn(1, S, d, dtype=dtype, seed=16).requires_grad_("x" in wants)
    w = None if "no weight" in wants else norm_weight(d, dtype)
    table = adaln_projection(T, d, dtype, seed=17).requires_grad_("tables" in wants)
    idx, dy = adaln_row_index(S, T, seed=18), randn(1, S, d, dtype=dtype, seed=19)
    g = _grads(K.norm_modulate, x, w, table, idx, dy)
    assert all(torch.equal(a, b) for a, b in zip(g, _grads(_unfused, x, w, table, idx, dy)))


def test_check_and_registry():
    x, w = randn(2, S, 24, dtype=torch.bfloat16, seed=20), norm_weight(24, torch.bfloat16)
    scale, shift = _tables(adaln_projection(T, 24, torch.bfloat16))
    info = K.check(x, w, EPS, scale, shift, adaln_row_index(S, T))
    assert info["kernel_id"] == "h3kernels.norm_modulate.norm_modulate.v1" and info["acc_dtype"] == "float32"
    assert "BLOCK_D=32,ROWS=64" in info["tile"]  # rms_norm's tile for D = 24
    op = registry.STRICT_OPS["norm_modulate"]
    assert op.run is K.norm_modulate and op.check is K.check
    assert registry.OP_MODULES.index("norm_modulate") == registry.OP_MODULES.index("modulate") + 1


def _bad_cases():
    x, w = randn(2, S, 24, seed=21), norm_weight(24, torch.float32)
    sc, sh = _tables(adaln_projection(T, 24, torch.float32))
    idx = adaln_row_index(S, T)
    return [
        ("x float64", (x.double(), w.double(), EPS, sc.double(), sh.double(), idx), "dtype torch.float64 not served"),
        ("weight dtype", (x, w.bfloat16(), EPS, sc, sh, idx), "weight dtype torch.bfloat16 differs"),
        ("table dtype", (x, w, EPS, sc.bfloat16(), sh, idx), "scale dtype torch.bfloat16 differs"),
        ("weight shape", (x, w[:16], EPS, sc, sh, idx), r"weight shape \[16\] must be \(24,\)"),
        ("x non-contiguous", (x.transpose(0, 1).contiguous().transpose(0, 1), w, EPS, sc, sh, idx), "not contiguous"),
        ("x 2-D", (x[0], w, EPS, sc, sh, idx), r"x shape \[37, 24\] must be a non-empty \(B, S, D\)"),
        ("x empty", (x[:, :0], w, EPS, sc, sh, idx[:0]), r"x shape \[2, 0, 24\] is empty"),
        ("eps zero", (x, w, 0.0, sc, sh, idx), "eps=0.0 must be a positive number"),
        ("eps None", (x, w, None, sc, sh, idx), "eps=None must be a positive number"),
        ("table width", (x, w, EPS, sc[:, :8], sh, idx), r"scale shape \[6, 8\] must be a non-empty \(R, 24\)"),
        ("table rows", (x, w, EPS, sc, sh[:3], idx), "scale has 6 rows but shift has 3"),
        ("index int32", (x, w, EPS, sc, sh, idx.int()), "index dtype torch.int32 must be int64"),
        ("index shape", (x, w, EPS, sc, sh, idx[:-1]), r"index shape \[36\] must be \(37,\)"),
        ("index high", (x, w, EPS, sc, sh, idx + 3 * T), "out of range for a table of 6 rows"),
        ("index negative", (x, w, EPS, sc, sh, idx - 3 * T), "index value -6 out of range"),
        ("index device", (x, w, EPS, sc, sh, idx.to("meta")), "mixed devices"),
        ("weight device", (x, w.to("meta"), EPS, sc, sh, idx), "mixed devices"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_refused(case):
    _, args, match = case
    for fn in (K.check, K.norm_modulate):
        with pytest.raises(registry.StrictUnsupported, match=match) as exc:
            fn(*args)
        assert str(exc.value).startswith("norm_modulate: ")


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    sc, sh = _tables(adaln_projection(T, 24, torch.float32))
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check(randn(2, S, 24), None, EPS, sc, sh, adaln_row_index(S, T))
