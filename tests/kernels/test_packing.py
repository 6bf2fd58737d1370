"""Strict packed-row copies (kernels/packing.py): `pack_rows` / `select_rows` bit-equal to the reference with
atomic-free backward, invariant to batch and to a consistent permutation of packed rows, and refusing layouts that
break the copy-once rule."""

import pytest
import torch

from h3kernels import packing as K
from h3kernels import registry
from strict_testing import randn
from h3lab.execution import runtime

S, B, D = 23, 2, 24
NT, NV, NA = 5, 12, 6  # text, video, audio rows


def _layout(seed=0):
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(seed))
    return perm[:NT].contiguous(), perm[NT : NT + NV].contiguous(), perm[NT + NV :].contiguous()


def _parts(dtype=torch.bfloat16, b=B, seed=1):
    ti, vi, ai = _layout()
    text = randn(b, NT, D, dtype=dtype, seed=seed)
    video = randn(b, NV, D, seed=seed + 1)  # float32 projections, cast to the text dtype by the copy
    audio = randn(b, NA, D, seed=seed + 2)
    return (ti, text), (vi, video), (ai, audio)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_pack_bit_equal_with_gather_backward(dtype):
    t, v, a = _parts(dtype)
    rows = [p[1].requires_grad_() for p in (t, v, a)]
    out = K.pack_rows(S, t, v, a)
    assert torch.equal(out, runtime.pack_rows(S, t, v, a)) and out.dtype == dtype
    dout = randn(B, S, D, dtype=dtype, seed=4)
    g = torch.autograd.grad(out, rows, dout)
    r = torch.autograd.grad(runtime.pack_rows(S, t, v, a), rows, dout)
    for mine, ref, src in zip(g, r, rows):
        assert mine.dtype == src.dtype and torch.equal(mine, ref)


def test_pack_strided_rows_served():
    t, v, a = _parts()
    wide = randn(B, NV, 2 * D, seed=5)
    v = (v[0], wide[..., :D])  # row stride 2D, unit last stride
    assert torch.equal(K.pack_rows(S, t, v, a), runtime.pack_rows(S, t, v, a))


def test_pack_invariances():
    t, v, a = _parts(b=3)
    full = K.pack_rows(S, t, v, a)
    assert torch.equal(full, K.pack_rows(S, t, v, a))
    for i in range(3):
        one = [(p[0], p[1][i : i + 1]) for p in (t, v, a)]
        assert torch.equal(K.pack_rows(S, *one), full[i : i + 1])
    # a consistent permutation of the packed rows: packed row q of the new layout is old row perm[q]
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(6))
    inv = torch.argsort(perm)
    moved = [(inv[p[0]].contiguous(), p[1]) for p in (t, v, a)]
    assert torch.equal(K.pack_rows(S, *moved), full[:, perm])


def test_select_rows_bit_equal_and_invariant():
    x = randn(B, S, D, seed=7).requires_grad_()
    _, vi, _ = _layout()
    out = K.select_rows(x, vi)
    assert torch.equal(out, runtime.select_rows(x, vi))
    dy = randn(B, NV, D, seed=8)
    (g,) = torch.autograd.grad(out, (x,), dy)
    (r,) = torch.autograd.grad(runtime.select_rows(x, vi), (x,), dy)
    assert torch.equal(g, r)  # unselected rows exactly zero, selected rows the copied gradient
    (g2,) = torch.autograd.grad(K.select_rows(x, vi), (x,), dy)
    assert torch.equal(g, g2)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(9))
    inv = torch.argsort(perm)
    assert torch.equal(K.select_rows(x[:, perm].contiguous(), inv[vi].contiguous()), out)
    assert torch.equal(K.select_rows(x[1:].contiguous(), vi), out[1:])


def test_select_rows_bf16_and_strided():
    x = randn(B, S, 3 * D, dtype=torch.bfloat16, seed=10)[..., D : 2 * D]
    idx = torch.tensor([3, 0, 22, 7])
    assert torch.equal(K.select_rows(x, idx), runtime.select_rows(x, idx))


def test_check_and_dispatch():
    t, v, a = _parts()
    assert K.check_pack_rows(S, t, v, a)["kernel_id"] == "h3kernels.packing.pack_rows.v1"
    with runtime.use_mode("strict"):
        ops = runtime.ops()
        x = ops.pack_rows(S, t, v, a, point="pack")
        y = ops.select_rows(x, v[0], point="video_out")
    assert torch.equal(y, runtime.select_rows(runtime.pack_rows(S, t, v, a), v[0]))
    assert [r.kernel_id for r in runtime.last_trace().records] == ["h3kernels.packing.pack_rows.v1", "h3kernels.packing.select_rows.v1"]


def _bad_pack_cases():
    t, v, a = _parts()
    ti, vi, ai = t[0], v[0], a[0]
    return [
        ("overlap", (S, t, v, (torch.cat([ai[:-1], ti[:1]]), a[1])), f"packed row {int(ti[0])} is claimed by both text_idx and audio_idx"),
        ("duplicate", (S, t, v, (torch.cat([ai[:-1], ai[:1]]), a[1])), f"audio_idx repeats packed row {int(ai[0])}"),
        ("out of range", (S, t, v, (torch.cat([ai[:-1], torch.tensor([S])]), a[1])), f"audio_idx value {S} out of range"),
        ("not covering", (S + 1, t, v, a), "hold 23 rows but seq_len=24"),
        ("index int32", (S, (ti.int(), t[1]), v, a), "text_idx dtype torch.int32 must be int64"),
        ("index length", (S, (ti[:-1], t[1]), v, a), r"text_idx shape \[4\] must be \(5,\)"),
        ("rows dtype", (S, (ti, t[1].double()), v, a), "text rows dtype torch.float64"),
        ("width mismatch", (S, t, (vi, v[1][..., :8]), a), "video rows shape .* must match text's batch 2 and width 24"),
        ("batch mismatch", (S, t, (vi, v[1][:1]), a), "must match text's batch"),
        ("last stride", (S, t, (vi, randn(B, D, NV).transpose(1, 2)), a), "last-axis stride"),
        ("seq_len", (0, t, v, a), "seq_len=0 must be a positive integer"),
        ("not a pair", (S, t, v, (ai,)), "audio must be an"),
        ("mixed devices", (S, t, (vi, v[1].to("meta")), a), "mixed devices"),
    ]


@pytest.mark.parametrize("case", _bad_pack_cases(), ids=lambda c: c[0])
def test_pack_bad_layouts_refused(case):
    _, args, match = case
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.check_pack_rows(*args)
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.pack_rows(*args)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda x: (x, torch.tensor([1, 4, 1])), "index repeats row 1; strict needs unique rows"),
        (lambda x: (x, torch.tensor([1, S])), f"index value {S} out of range for {S} rows"),
        (lambda x: (x, torch.tensor([-1, 2])), "index value -1 out of range"),
        (lambda x: (x, torch.tensor([1, 2], dtype=torch.int32)), "index dtype torch.int32 must be int64"),
        (lambda x: (x, torch.tensor([], dtype=torch.int64)), "index is empty"),
        (lambda x: (x[0], torch.tensor([1])), r"x shape \[23, 24\] must be \(B, N, D\)"),
        (lambda x: (x.int(), torch.tensor([1])), "x dtype torch.int32"),
    ],
    ids=["duplicate", "high", "negative", "int32", "empty", "rank", "dtype"],
)
def test_select_bad_inputs_refused(make, match):
    args = make(randn(B, S, D, seed=11))
    with pytest.raises(registry.StrictUnsupported, match=match):
        K.select_rows(*args)


def test_cpu_without_interpreter_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        K.check_select_rows(randn(B, S, D), torch.tensor([1]))


def test_validation_cache_is_not_stale():
    """Index checks are cached per index tensor, but an in-place write forces them to run again."""
    x = randn(B, S, D, seed=12)
    idx = torch.tensor([4, 9, 2])
    K.select_rows(x, idx)
    idx[1] = 4  # now a duplicate
    with pytest.raises(registry.StrictUnsupported, match="index repeats row 4"):
        K.select_rows(x, idx)
    t, v, a = _parts()
    K.pack_rows(S, t, v, a)
    v[0][0] = t[0][0]  # video now claims a text row
    with pytest.raises(registry.StrictUnsupported, match="claimed by both text_idx and video_idx"):
        K.pack_rows(S, t, v, a)
