"""Strict attention (`h3kernels.attention`): accuracy of forward and backward against a float64 truth with a derived
tolerance, byte-invariance (repeat, batch 1 vs N, batch position, unrelated batch item and query-row mutation,
strided views, no-grad vs grad), the consistent-permutation property under a canonical `key_order`, backward
determinism, and refusals. CPU under TRITON_INTERPRET=1 (tests/conftest.py), tiny shapes."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from h3kernels import attention as attn
from h3kernels import registry
from strict_testing import assert_error_within, randn
from h3lab.execution import runtime

DTYPES = [torch.bfloat16, torch.float32]


def _qkv(shape, dtype, seed=0):
    return tuple(randn(*shape, dtype=dtype, seed=seed + i) for i in range(3))


def _sdpa(q, k, v):
    """torch's attention in the inputs' dtype (the op-table reference)."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _truth(q, k, v):
    q, k, v = (t.double() for t in (q, k, v))
    scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhst,bthd->bshd", torch.softmax(scores, dim=-1), v)


def _grads(fn, q, k, v, do, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


# ------------------------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 67, 2, 16), (1, 130, 1, 24), (1, 64, 2, 64)])  # 24: D padded to 32
def test_forward_matches_truth(dtype, shape):
    q, k, v = _qkv(shape, dtype)
    o = attn.attention(q, k, v)
    assert o.shape == shape and o.dtype == dtype and o.is_contiguous()
    assert_error_within(o, _sdpa(q, k, v), _truth(q, k, v), f"attention {dtype} {shape}")


@pytest.mark.parametrize("S", [1, 31, 33, 127, 128, 129])  # around the 32-row backward and 128-row forward tiles
def test_matches_truth_at_tile_edges(S):
    shape = (1, S, 2, 16)
    q, k, v = _qkv(shape, torch.bfloat16, seed=S)
    if S == 1:  # one key: dq = dk = 0 exactly in the truth, only the forward is meaningful
        assert_error_within(attn.attention(q, k, v), _sdpa(q, k, v), _truth(q, k, v), "attention S=1")
        return
    do = randn(*shape, dtype=torch.bfloat16, seed=100 + S)
    got, ref = _grads(attn.attention, q, k, v, do), _grads(_sdpa, q, k, v, do)
    truth = _grads(_sdpa, q.double(), k.double(), v.double(), do.double())
    for name, g, r, t in zip(("o", "dq", "dk", "dv"), got, ref, truth):
        assert_error_within(g, r, t, f"attention S={S} {name}")


def test_reference_is_the_math():
    q, k, v = _qkv((2, 9, 3, 16), torch.float32)
    torch.testing.assert_close(attn.reference(q, k, v).double(), _truth(q, k, v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_matches_truth(dtype):
    shape = (2, 67, 2, 16)
    q, k, v = _qkv(shape, dtype)
    do = randn(*shape, dtype=dtype, seed=11)
    got = _grads(attn.attention, q, k, v, do)
    ref = _grads(_sdpa, q, k, v, do)
    truth = _grads(_sdpa, q.double(), k.double(), v.double(), do.double())
    for name, g, r, t in zip(("o", "dq", "dk", "dv"), got, ref, truth):
        assert g.dtype == dtype and g.shape == shape
        assert_error_within(g, r, t, f"attention {dtype} {name}")


# ----------------------------------------------------------------------------------------------- invariance
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_are_invariant(dtype):
    q, k, v = _qkv((3, 70, 2, 16), dtype)
    o = attn.attention(q, k, v)
    assert torch.equal(attn.attention(q, k, v), o), "repeat"
    assert torch.equal(attn.attention(q[:1], k[:1], v[:1]), o[:1]), "batch 1 vs 3"
    assert torch.equal(attn.attention(q[2:], k[2:], v[2:]), o[2:]), "batch position"
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t, seed in ((q2, 20), (k2, 21), (v2, 22)):
        t[1] = randn(70, 2, 16, dtype=dtype, seed=seed)
    o2 = attn.attention(q2, k2, v2)
    assert torch.equal(o2[0], o[0]) and torch.equal(o2[2], o[2]), "unrelated batch item mutated"
    q3 = q.clone()
    q3[:, 5:] = randn(3, 65, 2, 16, dtype=dtype, seed=23)
    assert torch.equal(attn.attention(q3, k, v)[:, :5], o[:, :5]), "other query rows mutated"
    with torch.no_grad():
        assert torch.equal(attn.attention(q, k, v), o), "no-grad forward"


def test_strided_views_give_the_same_bytes():
    """q from a (B, H, S, D) buffer, v as the second half of a (B, S, H, 2D) buffer: read in place."""
    q, k, v = _qkv((2, 33, 2, 16), torch.bfloat16)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    v_view = torch.cat([randn(2, 33, 2, 16, dtype=torch.bfloat16, seed=30), v], dim=-1)[..., 16:]
    assert not q_view.is_contiguous() and not v_view.is_contiguous()
    assert torch.equal(attn.attention(q_view, k, v_view), attn.attention(q, k, v))
    do = randn(2, 33, 2, 16, dtype=torch.bfloat16, seed=31)
    do_view = do.transpose(1, 2).contiguous().transpose(1, 2)
    for a, b in zip(_grads(attn.attention, q_view, k, v_view, do_view), _grads(attn.attention, q, k, v, do)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("S", [128, 130, 400])  # no tail tile / a 2-key tail tile / 3 full tiles and a tail
def test_byte_keeping_forward_variants_keep_the_bytes(S):
    """The contract's forward loop (split tail, unmasked D) and the lookahead loop (tile j+1's scores before tile
    j's update) against the one masked loop, with and without a key_order: o and lse2 bit-identical (the
    interpreter runs the GPU's tile loop and masks)."""
    q, k, v = _qkv((2, S, 2, 16), torch.bfloat16, seed=40 + S)
    order = torch.randperm(S, generator=torch.Generator().manual_seed(S))
    one_loop = attn.ForwardVariant()
    assert attn.FORWARD[torch.bfloat16] != one_loop and attn.FORWARD[torch.bfloat16].split_tail
    for key_order in (None, order):
        ref_o, ref_lse = attn._forward(q, k, v, key_order, one_loop)
        lookahead = dataclasses.replace(attn.FORWARD[torch.bfloat16], lookahead=True)
        for variant in (attn.FORWARD[torch.bfloat16], attn.ForwardVariant(split_tail=True), lookahead):
            o, lse = attn._forward(q, k, v, key_order, variant)
            assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse), (variant.describe(), key_order is None)


def test_lookahead_without_split_tail_is_refused():
    """The lookahead loop runs over the full tiles before the tail: asked for without split_tail it would silently
    be the plain loop while describe() said lookahead, so the variant refuses it."""
    with pytest.raises(ValueError, match="lookahead=True\\) needs split_tail=True"):
        attn.ForwardVariant(lookahead=True)
    assert attn.ForwardVariant(split_tail=True, lookahead=True).describe() == "split_tail+lookahead"


def test_tma_is_taken_only_for_aligned_rows():
    """K/V go through TMA descriptors only where the (S, D) slab of every (b, h) is 16-byte aligned with stride-1
    rows; other views fall back to pointers (the same values)."""
    t = torch.empty(2, 40, 3, 16, dtype=torch.bfloat16)
    assert attn._tma_ok(t)
    assert attn._tma_ok(torch.empty(2, 40, 3, 32, dtype=torch.bfloat16)[..., 16:])  # 32-byte rows, 32-byte offset
    assert not attn._tma_ok(torch.empty(2, 40, 3, 17, dtype=torch.bfloat16)[..., 1:])  # 34-byte row stride
    assert not attn._tma_ok(t.transpose(2, 3))  # last-dim stride 3
    assert not attn._tma_ok(torch.empty(2, 40, 3, 24, dtype=torch.bfloat16)[..., 4:20])  # 8-byte base offset


@pytest.mark.parametrize("dtype", DTYPES)
def test_consistent_permutation_with_canonical_key_order(dtype):
    """Permute the packed rows of q, k, v by p; visiting keys in canonical order (key_order = argsort(p)) gives the
    permuted outputs and gradients, bit for bit."""
    shape = (2, 150, 2, 16)  # two 128-key forward tiles
    q, k, v = _qkv(shape, dtype)
    do = randn(*shape, dtype=dtype, seed=12)
    perm = torch.randperm(150, generator=torch.Generator().manual_seed(3))
    inverse = torch.argsort(perm)
    base = _grads(attn.attention, q, k, v, do)
    permuted = _grads(attn.attention, q[:, perm], k[:, perm], v[:, perm], do[:, perm], key_order=inverse)
    for name, a, b in zip(("o", "dq", "dk", "dv"), permuted, base):
        assert torch.equal(a[:, inverse], b), name
    # visiting the permuted packed order instead changes the online-softmax tiles, hence the bytes
    assert not torch.equal(attn.attention(q[:, perm], k[:, perm], v[:, perm])[:, inverse], base[0])
    # the identity order is the default
    assert torch.equal(attn.attention(q, k, v, key_order=torch.arange(150)), base[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_deterministic_and_batch_invariant(dtype):
    shape = (2, 67, 2, 16)
    q, k, v = _qkv(shape, dtype)
    do = randn(*shape, dtype=dtype, seed=13)
    first = _grads(attn.attention, q, k, v, do)
    second = _grads(attn.attention, q, k, v, do)
    alone = _grads(attn.attention, q[1:], k[1:], v[1:], do[1:])
    for name, a, b, c in zip(("o", "dq", "dk", "dv"), first, second, alone):
        assert torch.equal(a, b), f"two backward runs differ in {name}"
        assert torch.equal(a[1:], c), f"{name} of batch item 1 alone vs in a batch of 2"


# -------------------------------------------------------------------------------------------------- refusals
def _bad_cases():
    q, k, v = _qkv((1, 8, 2, 16), torch.float32)
    bf = lambda t: t.bfloat16()  # noqa: E731
    return {
        "float16": ((q.half(), k.half(), v.half()), "not supported"),
        "mixed dtypes": ((bf(q), k, v), "mixed dtypes"),
        "mixed devices": ((q, k.to("meta"), v), "mixed devices"),
        "3-D": ((q[0], k[0], v[0]), "must be 4-D"),
        "shape mismatch": ((q, k[:, :7], v[:, :7]), "must be equal"),
        "empty": ((q[:, :0], k[:, :0], v[:, :0]), "empty"),
        "head_dim 256": ((*_qkv((1, 4, 1, 256), torch.float32),), "exceeds the limit 128"),
        "not a tensor": ((q.tolist(), k, v), "must be a torch.Tensor"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs_are_refused_by_check_and_run(case):
    args, message = _bad_cases()[case]
    with pytest.raises(registry.StrictUnsupported, match=message):
        registry.STRICT_OPS["attention"].check(*args)
    with pytest.raises(registry.StrictUnsupported, match=message):
        attn.attention(*args)


def test_bad_key_order_is_refused():
    q, k, v = _qkv((1, 8, 2, 16), torch.float32)
    for order, message in (
        (torch.arange(8, dtype=torch.int32), "must be an int64 tensor of shape \\(8,\\)"),
        (torch.arange(7), "must be an int64 tensor of shape \\(8,\\)"),
        (torch.tensor([0, 1, 2, 3, 4, 5, 6, 6]), "not a permutation of 0..7"),
        (torch.arange(8).tolist(), "must be an int64 tensor"),
    ):
        with pytest.raises(registry.StrictUnsupported, match=message):
            attn.attention(q, k, v, key_order=order)
    order = torch.randperm(8)
    attn.attention(q, k, v, key_order=order)  # checked once, cached while the tensor is unchanged
    order[0] = order[1]  # in place: a new _version, so checked again
    with pytest.raises(registry.StrictUnsupported, match="not a permutation of 0..7"):
        attn.attention(q, k, v, key_order=order)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    q, k, v = _qkv((1, 8, 2, 16), torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
        registry.STRICT_OPS["attention"].check(q, k, v)


# ------------------------------------------------------------------------------------------------ benchmark
def test_benchmark_dry_run_writes_the_schema(tmp_path, monkeypatch):
    """The GPU benchmark's non-timing logic (shapes, checks, JSON) runs tiny in the interpreter."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    import benchmark_attention

    out = tmp_path / "attention.json"
    benchmark_attention.main(["--dry-run", "--seqs", "67", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    rows = doc["results"]
    assert [(r["impl"], r["pass"]) for r in rows] == [
        ("h3lab-strict", "forward"), ("h3lab-off", "forward"), ("h3lab-strict", "backward"), ("h3lab-off", "backward")
    ]
    for r in rows:
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r) and r["median_s"] > 0
    assert rows[0]["batch_equal"] and rows[0]["repeat_equal"] and rows[0]["perm_equal"] and rows[2]["bwd_repeat_equal"]


def test_forward_sweep_dry_run_reports_bytes_and_classes(tmp_path, monkeypatch):
    """--sweep on the interpreter: every variant row carries its class and byte check; the byte-keeping ones (all
    fall back to pointers on the CPU) equal the contract's bytes, pre-scaled q does not."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_attention.py"])
    import attention_sweep
    import benchmark_attention

    out = tmp_path / "sweep.json"
    benchmark_attention.main(["--dry-run", "--sweep", "--sweep-seqs", "67", "--sweep-variants", "contract",
                              "unmasked", "tma", "prescale_q", "--out", str(out)])
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"contract", "unmasked", "tma", "prescale_q", "sdpa"}
    assert all(rows[n]["bytes_equal"] and rows[n]["class"] == "byte-keeping" for n in ("contract", "unmasked", "tma"))
    assert rows["prescale_q"]["class"] == "byte-changing" and not rows["prescale_q"]["bytes_equal"]
    assert all(r["median_s"] > 0 and "error" not in r for r in rows.values())
    with pytest.raises(ValueError, match="unknown attention variants"):
        attention_sweep.variants(["tma", "no_such_variant"])


# -------------------------------------------------------------------------------------------- registry, runtime
def test_strict_runtime_dispatches_to_the_kernel():
    q, k, v = _qkv((1, 20, 2, 16), torch.bfloat16)
    info = registry.STRICT_OPS["attention"].check(q, k, v)
    assert info == {
        "kernel_id": "h3kernels.attention.flash_fixed_kv.bfloat16.keys_packed",
        "tile": attn.TILES[torch.bfloat16].describe(),
        "forward": "split_tail+even_d+tma+fp_fusion",
        "acc_dtype": "float32",
    }
    order = torch.randperm(20)
    assert registry.STRICT_OPS["attention"].check(q, k, v, order)["kernel_id"].endswith(".keys_canonical")
    with runtime.use_mode("strict"):
        o = runtime.ops().attention(q, k, v, point="blocks.0.attention")
    assert torch.equal(o, attn.attention(q, k, v))
    assert runtime.last_trace().records[0].kernel_id == info["kernel_id"]
