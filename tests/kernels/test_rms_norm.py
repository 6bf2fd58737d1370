"""Strict RMSNorm (kernels/rms_norm.py) under the Triton interpreter: accuracy against the float64 truth with a
derived tolerance, near bit-equality with torch in bf16, byte invariances, deterministic accurate gradients, and
refusals."""

import pytest
import torch
import torch.nn.functional as F

from h3kernels import registry
from h3kernels import rms_norm as K
from strict_testing import assert_error_within, randn
from h3lab.execution import runtime

EPS = 1e-5
DTYPES = [torch.bfloat16, torch.float32, torch.float16]
# (shape, why): hidden 24 (tiny blocks, BLOCK_D 32), per-head D=16 on (B,S,H,D), an odd width, D=128 tile.
# Row counts are not multiples of the 64-row tile.
SHAPES = [((2, 37, 24), "tiny hidden"), ((2, 5, 2, 16), "tiny q/k heads"), ((1, 9, 77), "odd width"), ((1, 3, 4, 128), "D=128")]


def _weight(d, dtype, seed=1):
    return (1.0 + 0.1 * randn(d, seed=seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,why", SHAPES, ids=[s[1] for s in SHAPES])
def test_forward_accuracy_and_bf16_bytes(shape, why, dtype):
    x = randn(*shape, dtype=dtype, seed=2)
    w = _weight(shape[-1], dtype)
    out = K.rms_norm(x, w, EPS)
    ref = F.rms_norm(x, (shape[-1],), w, EPS)  # torch in the same dtype
    assert out.dtype == dtype and out.shape == x.shape
    truth = K.reference(x.double(), w.double(), EPS)
    assert_error_within(out, ref, truth, f"rms_norm {why} {dtype}")
    if dtype == torch.bfloat16:
        # torch's CPU rsqrt and summation order are ISA-specific, so bytes are not promised; bf16 rounding absorbs
        # the ~1 ulp float32 differences almost always (0 differing elements on these sets when written).
        assert (out != ref).float().mean().item() <= 1e-3


def test_no_weight_matches_reference():
    x = randn(3, 7, 24, seed=3)
    out = K.rms_norm(x, None, EPS)
    assert_error_within(out, F.rms_norm(x, (24,), None, EPS), K.reference(x.double(), None, EPS), "rms_norm no weight")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_row_invariance(dtype):
    """Repeat, batch 1 vs N, batch position, unrelated-row mutation, permutation of rows: byte-equal rows."""
    b, s, d = 4, 41, 24  # 164 rows: three 64-row tiles, the last ragged
    x = randn(b, s, d, dtype=dtype, seed=4)
    w = _weight(d, dtype)
    full = K.rms_norm(x, w, EPS)
    assert torch.equal(full, K.rms_norm(x, w, EPS))  # repeat
    for i in range(b):
        assert torch.equal(K.rms_norm(x[i : i + 1].contiguous(), w, EPS), full[i : i + 1])  # batch 1 vs N
    moved = torch.cat([randn(2, s, d, dtype=dtype, seed=5), x[1:2]]).contiguous()  # row 1 at position 2
    assert torch.equal(K.rms_norm(moved, w, EPS)[2], full[1])
    mutated = x.clone()
    mutated[0] = randn(s, d, dtype=dtype, seed=6)
    assert torch.equal(K.rms_norm(mutated, w, EPS)[1:], full[1:])
    perm = torch.randperm(s, generator=torch.Generator().manual_seed(7))
    assert torch.equal(K.rms_norm(x[:, perm].contiguous(), w, EPS), full[:, perm])


def test_head_layout_invariance():
    """Per-head norm on (B, S, H, D): a head row's bytes do not depend on which other heads/rows share its tile."""
    x = randn(2, 5, 3, 16, dtype=torch.bfloat16, seed=8)
    w = _weight(16, torch.bfloat16)
    full = K.rms_norm(x, w, EPS)
    one = K.rms_norm(x[1:, 2:3, 1:2].contiguous(), w, EPS)
    assert torch.equal(one, full[1:, 2:3, 1:2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(2, 550, 24), (1, 6, 77)], ids=["2 chunks", "odd width"])
def test_backward_accurate_and_deterministic(shape, dtype):
    d = shape[-1]
    x = randn(*shape, dtype=dtype, seed=9).requires_grad_()
    w = _weight(d, dtype).requires_grad_()
    dy = randn(*shape, dtype=dtype, seed=10)
    gx, gw = torch.autograd.grad(K.rms_norm(x, w, EPS), (x, w), dy)
    gx2, gw2 = torch.autograd.grad(K.rms_norm(x, w, EPS), (x, w), dy)
    assert torch.equal(gx, gx2) and torch.equal(gw, gw2)  # two runs, same bytes
    assert gx.dtype == dtype and gw.dtype == dtype
    rx, rw = torch.autograd.grad(F.rms_norm(x, (d,), w, EPS), (x, w), dy)
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    tx, tw = torch.autograd.grad(K.reference(x64, w64, EPS), (x64, w64), dy.double())
    assert_error_within(gx, rx, tx, f"rms_norm dx {shape} {dtype}")
    assert_error_within(gw, rw, tw, f"rms_norm dw {shape} {dtype}")


def test_weight_grad_sums_every_chunk():
    """dw over 1100 rows (two 1024-row chunks, the second ragged) is the full sum over rows, to float32 rounding."""
    assert K._tile(24)["CHUNK"] == 1024
    x = randn(1100, 24, seed=11).requires_grad_()
    w = _weight(24, torch.float32).requires_grad_()
    dy = randn(1100, 24, seed=12)
    (gw,) = torch.autograd.grad(K.rms_norm(x, w, EPS), (w,), dy)
    rstd = 1.0 / torch.sqrt((x.detach() ** 2).sum(-1, keepdim=True) / 24 + EPS)
    contrib = dy * (x.detach() * rstd)  # (1100, 24) per-row terms
    # a dropped or doubled chunk would be off by O(1); float32 summation error is ~1e-6 of sum |terms|
    assert torch.allclose(gw.double(), contrib.double().sum(0), rtol=0, atol=64 * 2**-24 * contrib.abs().sum(0).max().item())


def test_check_reports_provenance_and_dispatch():
    x = randn(2, 3, 24, dtype=torch.bfloat16, seed=13)
    w = _weight(24, torch.bfloat16)
    info = K.check(x, w, EPS)
    assert info["kernel_id"] == "h3kernels.rms_norm.rms_norm.v1" and info["acc_dtype"] == "float32"
    assert "BLOCK_D=32" in info["tile"]
    assert registry.STRICT_OPS["rms_norm"].run is K.rms_norm
    with runtime.use_mode("strict"):
        ops = runtime.ops()
        out = ops.rms_norm(x, w, EPS, point="blocks.0.norm1")
    assert torch.equal(out, K.rms_norm(x, w, EPS))
    rec = runtime.last_trace().records[-1]
    assert (rec.op, rec.actual, rec.kernel_id) == ("rms_norm", "strict", "h3kernels.rms_norm.rms_norm.v1")


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (randn(2, 3, 24, dtype=torch.float64), _weight(24, torch.float64), EPS), "dtype torch.float64"),
        (lambda: (randn(2, 3, 24), _weight(24, torch.bfloat16), EPS), "weight dtype"),
        (lambda: (randn(2, 3, 24), _weight(16, torch.float32), EPS), r"weight shape \[16\]"),
        (lambda: (randn(2, 3, 24), _weight(24, torch.float32), None), "eps=None"),
        (lambda: (randn(2, 3, 24), _weight(24, torch.float32), -1.0), "eps=-1.0"),
        (lambda: (randn(3, 24, 2).transpose(1, 2), _weight(24, torch.float32), EPS), "not contiguous"),
        (lambda: (torch.empty(0, 24), _weight(24, torch.float32), EPS), "empty"),
        (lambda: (randn(2, 3, 24), _weight(24, torch.float32).to("meta"), EPS), "mixed devices"),
        (lambda: (torch.ones(2, 3, 24, dtype=torch.int32), None, EPS), "dtype torch.int32"),
        (lambda: (randn(1, 20000), None, EPS), "exceeds the single-tile limit"),
    ],
    ids=["float64", "weight dtype", "weight shape", "eps None", "eps negative", "non-contiguous", "empty",
         "mixed devices", "int", "too wide"],
)
def test_bad_inputs_refused(make, match):
    args = make()
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.check(*args)
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.rms_norm(*args)


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check(randn(2, 3, 24), None, EPS)
