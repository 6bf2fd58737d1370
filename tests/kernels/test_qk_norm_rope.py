"""Strict fused Q/K RMSNorm + RoPE (kernels/qk_norm_rope.py) under the Triton interpreter: forward and gradients
byte-equal to the unfused strict chain `rope(rms_norm(...))` for q and k, accuracy against the float64 truth with a
derived tolerance, batch and row invariance on fresh random inputs, and the refusals of both validators."""

import pytest
import torch

from h3kernels import qk_norm_rope as K
from h3kernels import registry
from h3kernels import rms_norm as N
from h3kernels import rope as P
from strict_testing import assert_error_within, randn
from h3lab.execution import runtime

EPS = 1e-6  # H3Config.qk_norm_eps
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
S, H = 19, 3  # 19 packed rows x 3 heads: 57 head rows per batch item (no tile multiple)
# (D, R): the release's partial rotation (96 of 128 channels) at a small width, a full rotation, a wide head
SHAPES = [(16, 12), (24, 24), (64, 48)]


def _case(b, d, r, dtype, seed=0):
    q = randn(b, S, H, d, dtype=dtype, seed=seed)
    k = randn(b, S, H, d, dtype=dtype, seed=seed + 1, scale=3.0)
    wq = (1.0 + 0.1 * randn(d, seed=seed + 2)).to(dtype)
    wk = (1.0 + 0.1 * randn(d, seed=seed + 3)).to(dtype)
    angles = randn(S, r, seed=seed + 4, scale=4.0)
    return q, k, wq, wk, angles.cos(), angles.sin()


def _unfused(q, k, wq, wk, eps, cos, sin):
    """The unfused strict chain the fused kernel must reproduce byte for byte."""
    return P.rope(N.rms_norm(q, wq, eps), cos, sin), P.rope(N.rms_norm(k, wk, eps), cos, sin)


def _torch(q, k, wq, wk, eps, cos, sin):
    """torch's same-dtype composition of the reference ops (the error yardstick)."""
    return runtime.REFERENCE_OPS["qk_norm_rope"](q, k, wq, wk, eps, cos, sin)


@pytest.mark.parametrize("d,r", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_bytes_equal_unfused_chain(dtype, d, r):
    for b in (1, 2):
        q, k, wq, wk, cos, sin = _case(b, d, r, dtype, seed=3 + b)
        for weights in ((wq, wk), (None, None)):
            out = K.qk_norm_rope(q, k, *weights, EPS, cos, sin)
            want = _unfused(q, k, *weights, EPS, cos, sin)
            for name, a, e in zip("qk", out, want):
                assert a.dtype == dtype and a.shape == q.shape
                assert torch.equal(a, e), f"{name} B={b} weight={weights[0] is not None}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_accuracy(dtype):
    """Error against the float64 truth <= 2x torch's same-dtype composition of the reference ops."""
    q, k, wq, wk, cos, sin = _case(2, 64, 48, dtype, seed=7)
    out = K.qk_norm_rope(q, k, wq, wk, EPS, cos, sin)
    torch_out = _torch(q, k, wq, wk, EPS, cos, sin)
    for name, x, w, o, t in zip("qk", (q, k), (wq, wk), out, torch_out):
        truth = K.reference(x, w, EPS, cos, sin, acc=torch.float64)
        assert_error_within(o, t, truth, f"qk_norm_rope {name} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_batch_and_row_invariance(dtype):
    q, k, wq, wk, cos, sin = _case(3, 24, 16, dtype, seed=9)
    full = K.qk_norm_rope(q, k, wq, wk, EPS, cos, sin)
    again = K.qk_norm_rope(q, k, wq, wk, EPS, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(full, again))  # repeat
    for b in range(3):  # batch 1 vs N, every position
        one = K.qk_norm_rope(q[b : b + 1].contiguous(), k[b : b + 1].contiguous(), wq, wk, EPS, cos, sin)
        assert all(torch.equal(o, f[b : b + 1]) for o, f in zip(one, full)), b
    mq, mk = q.clone(), k.clone()
    mq[1], mk[1] = randn(S, H, 24, dtype=dtype, seed=10), randn(S, H, 24, dtype=dtype, seed=11)
    mq[0, 5, 2] = randn(24, dtype=dtype, seed=12)  # one head row of batch 0: the others keep their bytes
    out = K.qk_norm_rope(mq, mk, wq, wk, EPS, cos, sin)
    assert torch.equal(out[1][[0, 2]], full[1][[0, 2]]) and torch.equal(out[0][2], full[0][2])
    keep = torch.ones(S, H, dtype=torch.bool)
    keep[5, 2] = False
    assert torch.equal(out[0][0][keep], full[0][0][keep]) and not torch.equal(out[0][0, 5, 2], full[0][0, 5, 2])


def _grads(fn, q, k, wq, wk, cos, sin, dq, dk):
    wrt = [t for t in (q, k, wq, wk) if t is not None and t.requires_grad]
    return torch.autograd.grad(fn(q, k, wq, wk, EPS, cos, sin), wrt, (dq, dk))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_bytes_equal_unfused_chain(dtype):
    q, k, wq, wk, cos, sin = _case(2, 16, 12, dtype, seed=13)
    leaves = [t.requires_grad_() for t in (q, k, wq, wk)]
    dq, dk = randn(*q.shape, dtype=dtype, seed=14), randn(*q.shape, dtype=dtype, seed=15)
    g = _grads(K.qk_norm_rope, *leaves, cos, sin, dq, dk)
    chain = _grads(_unfused, *leaves, cos, sin, dq, dk)
    for name, a, b in zip(("dq", "dk", "dwq", "dwk"), g, chain):
        assert a.dtype == dtype and torch.equal(a, b), name
    t64 = [t.detach().double().requires_grad_() for t in leaves]
    truth = _grads(lambda q, k, wq, wk, eps, c, s: (K.reference(q, wq, eps, c, s, torch.float64),
                                                    K.reference(k, wk, eps, c, s, torch.float64)),
                   *t64, cos, sin, dq.double(), dk.double())
    torch_g = _grads(_torch, *leaves, cos, sin, dq, dk)
    for name, a, b, t in zip(("dq", "dk", "dwq", "dwk"), g, torch_g, truth):
        assert_error_within(a, b, t, f"qk_norm_rope {name} {dtype}")


def test_partial_backward_bytes_equal_unfused_chain():
    """Only q's input gradient requested (frozen weights, k detached): it equals the chain's."""
    q, k, wq, wk, cos, sin = _case(1, 24, 16, torch.bfloat16, seed=16)
    q.requires_grad_()
    dq = randn(*q.shape, dtype=q.dtype, seed=17)
    fused = torch.autograd.grad(K.qk_norm_rope(q, k, wq, wk, EPS, cos, sin)[0], q, dq)[0]
    assert torch.equal(fused, torch.autograd.grad(_unfused(q, k, wq, wk, EPS, cos, sin)[0], q, dq)[0])


def test_check_and_registry():
    q, k, wq, wk, cos, sin = _case(1, 128, 96, torch.bfloat16, seed=19)
    info = K.check(q, k, wq, wk, EPS, cos, sin)
    assert info["kernel_id"] == "h3kernels.qk_norm_rope.qk_norm_rope.v1" and info["acc_dtype"] == "float32"
    assert "BLOCK_D=128,ROWS=64" in info["tile"] and "warps=4" in info["tile"] and "R=96" in info["tile"]
    op = registry.STRICT_OPS["qk_norm_rope"]
    assert op.run is K.qk_norm_rope and op.check is K.check


def _bad_cases():
    q, k, wq, wk, cos, sin = _case(1, 16, 12, torch.float32, seed=20)
    return [
        ("q float64", (q.double(), k.double(), wq.double(), wk.double(), EPS, cos, sin), "dtype torch.float64 not served"),
        ("k shape", (q, k[:, :-1], wq, wk, EPS, cos, sin), r"k \[1, 18, 3, 16\] torch.float32 must have q's shape"),
        ("k dtype", (q, k.bfloat16(), wq, wk, EPS, cos, sin), "must have q's shape and dtype"),
        ("one weight", (q, k, wq, None, EPS, cos, sin), "both be tensors or both None"),
        ("weight dtype", (q, k, wq.bfloat16(), wk, EPS, cos, sin), "weight dtype torch.bfloat16 differs"),
        ("k weight shape", (q, k, wq, wk[:8], EPS, cos, sin), r"k: weight shape \[8\] must be \(16,\)"),
        ("eps zero", (q, k, wq, wk, 0.0, cos, sin), "eps=0.0 must be a positive number"),
        ("q 3-D", (q[0], k[0], wq, wk, EPS, cos, sin), r"x shape \[19, 3, 16\] must be a non-empty \(B, S, H, D\)"),
        ("q non-contiguous", (q.transpose(1, 2).contiguous().transpose(1, 2),) * 2 + (wq, wk, EPS, cos, sin),
         "not contiguous"),
        ("odd rotary", (q, k, wq, wk, EPS, cos[:, :11].contiguous(), sin[:, :11].contiguous()), "rotary width 11 must be even"),
        ("wide rotary", (q, k, wq, wk, EPS, torch.ones(S, 18), torch.ones(S, 18)), r"rotary width 18 must be even and in"),
        ("table rows", (q, k, wq, wk, EPS, cos[:-1], sin[:-1]), r"cos shape \[18, 12\] must be \(19, R\)"),
        ("table grad", (q, k, wq, wk, EPS, cos.clone().requires_grad_(), sin), "cos requires grad"),
        ("device", (q, k.to("meta"), wq, wk, EPS, cos, sin), "mixed devices"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_refused(case):
    _, args, match = case
    for fn in (K.check, K.qk_norm_rope):
        with pytest.raises(registry.StrictUnsupported, match=match) as exc:
            fn(*args)
        assert str(exc.value).startswith("qk_norm_rope: ") and "\n" not in str(exc.value)


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, wq, wk, cos, sin = _case(1, 16, 12, torch.float32)
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check(q, k, wq, wk, EPS, cos, sin)


def test_fusion_benchmark_dry_run_writes_the_schema(tmp_path, monkeypatch):
    """`benchmark_elementwise.py --fusions` (both fusions against their unfused sequences) runs tiny in the
    interpreter: the schema, the byte checks, and the bytes per row at the full width."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_elementwise.py"])
    import benchmark_elementwise as B

    out = tmp_path / "fusions.json"
    B.main(["--fusions", "--dry-run", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    rows = doc["results"]
    assert {(r["rows"], r["op"], r["variant"], r["pass"]) for r in rows} == {
        (m, op, v, p) for m in B.FUSION_DRY_ROWS for op in runtime.FUSIONS
        for v, p in (("fused", "forward"), ("unfused", "forward"), ("torch", "forward"), ("fused", "backward"),
                     ("unfused", "backward"))}
    for r in rows:
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r) and r["median_s"] > 0
        if r["variant"] == "fused" and r["pass"] == "forward":
            assert r["fused_equal_unfused"] and r["rows_equal"] and r["repeat_equal"]
        if r["variant"] == "fused" and r["pass"] == "backward":
            assert r["grads_equal_unfused"]
    full = B.fusion_bytes(dict(HIDDEN=5376, HEADS=56, HEAD_DIM=128, ROTARY=96))
    assert full["qk_norm_rope"][:2] == (58880, 116672)  # per packed row: q and k read once, written once
    assert full["residual_norm_modulate"][:2] == (43016, 53780)  # the stream is not read back
    assert B.FUSION_ROWS == (2066, 37853)
