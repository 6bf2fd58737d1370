"""Strict AdaLN row-gathered ops (kernels/modulate.py): `modulate` and `gated_residual` are bit-equal to the
reference ops in every dtype, row/batch/permutation invariant, and their table gradients are deterministic,
atomic-free and accurate."""

import pytest
import torch

from h3kernels import registry
from h3kernels import modulate as K
from strict_testing import assert_error_within, randn
from h3lab.execution import runtime

DTYPES = [torch.bfloat16, torch.float32, torch.float16]
B, S, D, T = 2, 37, 24, 2  # 2 timesteps x 3 modalities -> R = 6 table rows


def _index(s=S, r=3 * T, seed=0):
    return torch.randint(0, r, (s,), generator=torch.Generator().manual_seed(seed))


def _tables(dtype, n=2, seed=1):
    """(R, n*D) projection output chunked into n row-strided (R, D) views, as the model's AdaLN tables are."""
    return randn(3 * T, n * D, dtype=dtype, seed=seed, scale=0.5).chunk(n, dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_modulate_bit_equal_to_reference(dtype):
    x = randn(B, S, D, dtype=dtype, seed=2)
    scale, shift = _tables(dtype)
    idx = _index()
    assert not scale.is_contiguous()  # row-strided view served
    assert torch.equal(K.modulate(x, scale, shift, idx), runtime.modulate(x, scale, shift, idx))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_residual_bit_equal_to_reference(dtype):
    res, y = randn(B, S, D, dtype=dtype, seed=3), randn(B, S, D, dtype=dtype, seed=4)
    (gate,) = _tables(dtype, n=1, seed=5)
    idx = _index(seed=6)
    assert torch.equal(K.gated_residual(res, gate, idx, y), runtime.gated_residual(res, gate, idx, y))


def test_rounding_points_matter():
    """The bf16 result differs from a single rounding of the float32 math: the per-op rounding is what is matched."""
    x = randn(B, S, D, dtype=torch.bfloat16, seed=7)
    scale, shift = _tables(torch.bfloat16)
    idx = _index()
    once = K.reference_modulate(x, scale, shift, idx).to(torch.bfloat16)
    assert not torch.equal(K.modulate(x, scale, shift, idx), once)


@pytest.mark.parametrize("op", ["modulate", "gated_residual"])
def test_invariances(op):
    dtype = torch.bfloat16
    x, y = randn(3, S, D, dtype=dtype, seed=8), randn(3, S, D, dtype=dtype, seed=9)
    t1, t2 = _tables(dtype, seed=10)
    idx = _index(seed=11)

    def run(x, y, idx):
        if op == "modulate":
            return K.modulate(x, t1, t2, idx)
        return K.gated_residual(x, t1, idx, y)

    full = run(x, y, idx)
    assert torch.equal(full, run(x, y, idx))  # repeat
    for b in range(3):  # batch 1 vs N
        assert torch.equal(run(x[b : b + 1].contiguous(), y[b : b + 1].contiguous(), idx), full[b : b + 1])
    mutated = x.clone()
    mutated[1] = randn(S, D, dtype=dtype, seed=12)
    assert torch.equal(run(mutated, y, idx)[[0, 2]], full[[0, 2]])  # unrelated-row mutation
    swapped = run(x[[2, 0, 1]].contiguous(), y[[2, 0, 1]].contiguous(), idx)  # batch position
    assert torch.equal(swapped, full[[2, 0, 1]])
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(13))  # rows permuted with their index
    out = run(x[:, perm].contiguous(), y[:, perm].contiguous(), idx[perm].contiguous())
    assert torch.equal(out, full[:, perm])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_modulate_backward(dtype):
    x = randn(B, 70, D, dtype=dtype, seed=14).requires_grad_()  # ~23 rows per table row x 2: two 32-entry chunks
    big = randn(3 * T, 2 * D, dtype=dtype, seed=15, scale=0.5).requires_grad_()
    idx = _index(70, 3 * T - 1, seed=16)  # the last table row is unused: its gradient must be exactly zero
    dy = randn(B, 70, D, dtype=dtype, seed=17)

    def grads(fn):
        scale, shift = big.chunk(2, dim=-1)
        return torch.autograd.grad(fn(x, scale, shift, idx), (x, big), dy)

    gx, gt = grads(K.modulate)
    gx2, gt2 = grads(K.modulate)
    assert torch.equal(gx, gx2) and torch.equal(gt, gt2)  # deterministic
    rx, rt = grads(runtime.modulate)
    assert torch.equal(gx, rx)  # dx = round(dy * round(1 + scale)): torch's own single multiply
    assert torch.count_nonzero(gt[-1]) == 0
    x64 = x.detach().double().requires_grad_()
    b64 = big.detach().double().requires_grad_()
    _, tt = torch.autograd.grad(K.reference_modulate(x64, *b64.chunk(2, dim=-1), idx), (x64, b64), dy.double())
    assert_error_within(gt, rt, tt, f"modulate d(scale, shift) {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gated_residual_backward(dtype):
    res = randn(B, 70, D, dtype=dtype, seed=18).requires_grad_()
    y = randn(B, 70, D, dtype=dtype, seed=19).requires_grad_()
    gate = randn(3 * T, D, dtype=dtype, seed=20, scale=0.5).requires_grad_()
    idx = _index(70, seed=21)
    dout = randn(B, 70, D, dtype=dtype, seed=22)
    g = torch.autograd.grad(K.gated_residual(res, gate, idx, y), (res, gate, y), dout)
    g2 = torch.autograd.grad(K.gated_residual(res, gate, idx, y), (res, gate, y), dout)
    assert all(torch.equal(a, b) for a, b in zip(g, g2))
    r = torch.autograd.grad(runtime.gated_residual(res, gate, idx, y), (res, gate, y), dout)
    assert torch.equal(g[0], dout) and torch.equal(g[2], r[2])
    t64 = [t.detach().double().requires_grad_() for t in (res, gate, y)]
    truth = torch.autograd.grad(K.reference_gated_residual(t64[0], t64[1], idx, t64[2]), t64, dout.double())
    assert_error_within(g[1], r[1], truth[1], f"gated_residual d(gate) {dtype}")


def test_table_grads_cover_batches_and_chunks():
    """Table rows 0 and 1 each collect ~40 (b, s) entries (two 32-entry chunks, both batches): the float32 sums
    match the float64 sums to float32 rounding (a dropped / doubled chunk or batch would be off by O(1)), and a
    table row used by no packed row gets exact zeros."""
    b, s = 2, 40
    x = randn(b, s, D, seed=23).requires_grad_()
    scale, shift = (t.detach().requires_grad_() for t in _tables(torch.float32, seed=24))
    idx = _index(s, 2, seed=25)
    dy = randn(b, s, D, seed=26)
    gs, gh = torch.autograd.grad(K.modulate(x, scale, shift, idx), (scale, shift), dy)
    onehot = torch.nn.functional.one_hot(idx, 3 * T).double()  # (S, R)
    want_s = torch.einsum("bsd,sr->rd", dy.double() * x.detach().double(), onehot)
    want_h = torch.einsum("bsd,sr->rd", dy.double(), onehot)
    assert (idx == 0).sum() * b > K.CHUNK
    tol = 8 * 2**-24 * b * s  # float32 summation of ~80 O(1) terms
    assert torch.allclose(gs.double(), want_s, rtol=0, atol=tol)
    assert torch.allclose(gh.double(), want_h, rtol=0, atol=tol)
    assert torch.count_nonzero(gs[2:]) == 0 and torch.count_nonzero(gh[2:]) == 0


def test_index_validation_is_cached_but_not_stale():
    x = randn(1, 5, D, seed=27)
    scale, shift = _tables(torch.float32)
    idx = _index(5, seed=28)
    K.modulate(x, scale, shift, idx)
    idx[0] = 3 * T  # in-place write bumps the version: the cached range check must run again
    with pytest.raises(registry.StrictUnsupported, match=r"index value 6 out of range for a table of 6 rows"):
        K.modulate(x, scale, shift, idx)


def test_check_and_dispatch():
    x = randn(B, S, D, dtype=torch.bfloat16, seed=29)
    scale, shift = _tables(torch.bfloat16)
    idx = _index()
    assert K.check_modulate(x, scale, shift, idx)["kernel_id"] == "h3kernels.modulate.modulate.v1"
    assert K.check_gated_residual(x, scale, idx, x)["acc_dtype"] == "float32"
    with runtime.use_mode("strict"):
        ops = runtime.ops()
        out = ops.modulate(x, scale, shift, idx, point="blocks.0.modulate1")
        res = ops.gated_residual(x, scale, idx, out, point="blocks.0.residual1")
    assert torch.equal(out, runtime.modulate(x, scale, shift, idx))
    assert torch.equal(res, runtime.gated_residual(x, scale, idx, out))
    assert [r.actual for r in runtime.last_trace().records] == ["strict", "strict"]


def _bad_modulate_cases():
    x = randn(B, S, D, seed=30)
    sc, sh = _tables(torch.float32)
    idx = _index()
    return [
        ("x dtype", (x.double(), sc.double(), sh.double(), idx), "dtype torch.float64 not served"),
        ("mixed dtype", (x, sc.bfloat16(), sh, idx), "scale dtype torch.bfloat16 differs"),
        ("index int32", (x, sc, sh, idx.int()), "index dtype torch.int32 must be int64"),
        ("index length", (x, sc, sh, idx[:-1]), r"index shape \[36\] must be \(37,\)"),
        ("index negative", (x, sc, sh, torch.where(idx == idx[0], -1, idx)), "index value -1 out of range"),
        ("index high", (x, sc, sh, idx + 10), "out of range for a table of 6 rows"),
        ("x non-contiguous", (x.transpose(0, 1).contiguous().transpose(0, 1), sc, sh, idx), "not contiguous"),
        ("table width", (x, sc[:, :8], sh, idx), r"scale shape \[6, 8\] must be a non-empty \(R, 24\)"),
        ("table col stride", (x, randn(D, 6, seed=31).t(), sh, idx), "column stride 6 must be 1"),
        ("rows mismatch", (x, sc, sh[:3], idx), "scale has 6 rows but shift has 3"),
        ("empty", (x[:, :0], sc, sh, idx[:0]), "must be a non-empty"),
        ("mixed devices", (x, sc, sh, idx.to("meta")), "mixed devices"),
    ]


@pytest.mark.parametrize("case", _bad_modulate_cases(), ids=lambda c: c[0])
def test_modulate_bad_inputs_refused(case):
    _, args, match = case
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.check_modulate(*args)
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.modulate(*args)


def test_gated_residual_bad_inputs_refused():
    res, y = randn(B, S, D, seed=32), randn(B, S, D, seed=33)
    (gate,) = _tables(torch.float32, n=1)
    idx = _index()
    with pytest.raises(registry.StrictUnsupported, match="y dtype torch.bfloat16 differs"):
        K.gated_residual(res, gate, idx, y.bfloat16())
    with pytest.raises(registry.StrictUnsupported, match="y shape"):
        K.gated_residual(res, gate, idx, y[:, :-1].contiguous())
    with pytest.raises(registry.StrictUnsupported, match="out of range"):
        K.gated_residual(res, gate, idx + 6, y)


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    sc, sh = _tables(torch.float32)
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check_modulate(randn(B, S, D), sc, sh, _index())
