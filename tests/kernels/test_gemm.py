"""Strict GEMM (`h3kernels.gemm`): accuracy against a float64 truth with a derived tolerance, byte-invariance of rows
(repeat, batch 1 vs N, batch position, unrelated-row mutation, row counts at tile edges, strides), the declared
8-chunk tree (tensor-parallel subtrees reproduce TP1 bytes), backward accuracy and determinism, and refusals.
Runs on CPU under TRITON_INTERPRET=1 (tests/conftest.py); shapes are tiny because every program runs in Python."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from h3kernels import gemm, registry
from strict_testing import assert_error_within, randn
from h3lab.execution import runtime

DTYPES = [torch.bfloat16, torch.float32]
OPS = {"linear": gemm.linear, "linear_tree": gemm.linear_tree}
N = 80  # not a tile multiple: the N tail is exercised everywhere


def _inputs(dtype, rows=(2, 33), K=96, bias=True, seed=0):
    x = randn(*rows, K, dtype=dtype, seed=seed)
    w = randn(N, K, dtype=dtype, seed=seed + 1, scale=K**-0.5)
    b = randn(N, dtype=dtype, seed=seed + 2) if bias else None
    return x, w, b


def _truth(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# ------------------------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("K,bias", [(96, True), (128, False), (512, True)])  # 512: every tree chunk is a full tile
def test_forward_matches_truth(dtype, op, K, bias):
    x, w, b = _inputs(dtype, K=K, bias=bias)
    y = OPS[op](x, w, b)
    assert y.shape == (2, 33, N) and y.dtype == dtype
    assert_error_within(y, F.linear(x, w, b), _truth(x, w, b), f"{op} {dtype} K={K}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_rounding_at_the_end(dtype):
    """The bias-free tree output is exactly its float32 accumulator rounded once to nearest even (torch's cast)."""
    x, w, _ = _inputs(dtype, K=128, bias=False)
    assert torch.equal(gemm.linear_tree(x, w), gemm.tree_partial(x, w, 8).to(dtype))


# ----------------------------------------------------------------------------------------------- invariance
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_rows_are_invariant(dtype, op):
    fn = OPS[op]
    x, w, b = _inputs(dtype, rows=(3, 43), K=128)  # 129 rows: crosses the 64- and 128-row tiles
    y = fn(x, w, b)
    assert torch.equal(fn(x, w, b), y), "repeat"
    assert torch.equal(fn(x[:1], w, b), y[:1]), "batch 1 vs 3"
    assert torch.equal(fn(x[2:3], w, b), y[2:3]), "batch position"
    mutated = x.clone()
    mutated[1] = randn(43, 128, dtype=dtype, seed=7)
    y_mut = fn(mutated, w, b)
    assert torch.equal(y_mut[0], y[0]) and torch.equal(y_mut[2], y[2]), "unrelated batch item mutated"
    assert not torch.equal(y_mut[1], y[1])
    flat, y_flat = x.reshape(-1, 128), y.reshape(-1, N)
    for m in (1, 63, 64, 65, 127, 128, 129):  # row counts at tile edges
        assert torch.equal(fn(flat[:m], w, b), y_flat[:m]), f"{m} rows"
    assert torch.equal(fn(flat[70:71], w, b), y_flat[70:71]), "a single row from the middle"


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_give_the_same_bytes(dtype):
    x, w, b = _inputs(dtype, rows=(2, 20), K=512)
    x_view = torch.cat([x[..., :1], x], dim=-1)[..., 1:]  # base one element off: not 16-byte aligned, pointer loads
    w_t = w.t().contiguous().t()  # (N, 512) with strides (1, N): a transposed descriptor
    assert not x_view.is_contiguous() and not w_t.is_contiguous()
    for fn in OPS.values():
        y = fn(x, w, b)
        assert torch.equal(fn(x_view, w, b), y) and torch.equal(fn(x, w_t, b), y) and torch.equal(fn(x_view, w_t, b), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_chunks", [1, 8])
def test_descriptor_and_pointer_paths_agree(dtype, n_chunks):
    """Row-major (or transposed row-major) operands go through TMA descriptors, others through pointers: same
    tiles, same order, same bytes, for every operand layout the forward and backward use."""
    x, w, b = _inputs(dtype, rows=(72,), K=512)  # 72 and N = 80 rows: 16-byte aligned transposed strides
    tile = (gemm.TREE_TILES if n_chunks == 8 else gemm.LINEAR_TILES)[dtype]
    x_t, w_t = x.t().contiguous().t(), w.t().contiguous().t()  # transposes of row-major tensors
    y = gemm._gemm(x, w, b, n_chunks, tile, dtype, use_tma=False)
    for xs, ws in ((x, w), (x_t, w), (x, w_t), (x_t, w_t)):
        assert torch.equal(gemm._gemm(xs, ws, b, n_chunks, tile, dtype, use_tma=True), y)
        assert torch.equal(gemm._gemm(xs, ws, b, n_chunks, tile, dtype, use_tma=False), y)
    assert_error_within(y, F.linear(x, w, b), _truth(x, w, b), f"{dtype} {n_chunks} chunks")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_tree_partials_reproduce_tp1(dtype, ranks):
    """A TP rank owning 8/ranks consecutive K-chunks computes its subtree; the combine finishes the declared tree."""
    K = 128
    x, w, b = _inputs(dtype, K=K)
    width = K // ranks
    partials = [
        gemm.tree_partial(x[..., r * width:(r + 1) * width], w[:, r * width:(r + 1) * width], 8 // ranks)
        for r in range(ranks)
    ]
    assert all(p.dtype == torch.float32 for p in partials)
    assert torch.equal(gemm.tree_combine(partials, b, dtype), gemm.linear_tree(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,K,n_chunks,use_tma", [
    ((33,), 512, 8, None),  # whole BLOCK_K tiles per chunk: TMA descriptors
    ((33,), 512, 8, False),  # the same through pointers
    ((5,), 96, 8, None),  # chunks of 12: a masked tail in every chunk (pointers)
    ((2, 35), 1024, 4, None),  # a TP2 rank's subtree
    ((70,), 256, 2, False),  # a TP4 rank's subtree
])
@pytest.mark.parametrize("paired", [True, False])
def test_tree_schedules_equal_the_chunk_by_chunk_loops(dtype, rows, K, n_chunks, use_tma, paired):
    """`Tile.paired` (chunks 2j and 2j+1 in one loop, two accumulators) is a schedule, not new arithmetic: every
    output byte equals the chunk-by-chunk loops' on fresh random inputs, bias or not, float32 partials too. The
    contract's `slot_tma` (the slots through a TMA descriptor) needs CUDA: here it takes the pointer slots, and the
    H200 run checks its bytes (`benchmark_gemm.py --schedules`)."""
    x, w, b = _inputs(dtype, rows=rows, K=K, seed=K + n_chunks)
    x2d = x.reshape(-1, K)
    schedule = dataclasses.replace(gemm.TREE_TILES[dtype], paired=paired)
    loops = dataclasses.replace(gemm.TREE_TILES[dtype], paired=False, slot_tma=False)
    for bias, out_dtype in ((b, dtype), (None, torch.float32)):
        y = gemm._gemm(x2d, w, bias, n_chunks, schedule, out_dtype, use_tma)
        assert torch.equal(y, gemm._gemm(x2d, w, bias, n_chunks, loops, out_dtype, use_tma))
    assert "chunkloops" in loops.describe() and "slottma" not in loops.describe()
    assert "slottma" in gemm.TREE_TILES[torch.bfloat16].describe()


def test_tree_differs_from_the_flat_k_loop():
    """The tree is a different (declared) order, not a relabelled `linear`: on these inputs some bytes differ."""
    x, w, b = _inputs(torch.float32, K=512)
    assert not torch.equal(gemm.linear_tree(x, w, b), gemm.linear(x, w, b))


# ------------------------------------------------------------------------------- narrow float32 (parallel chunks)
NARROW_K = gemm.SPLIT_MIN_K  # the smallest K the rule splits: 8 chunks of 8 BLOCK_K tiles each


def _narrow(rows=(3, 23), n=64, k=NARROW_K, seed=20):
    x = randn(*rows, k, dtype=torch.float32, seed=seed)
    w = randn(n, k, dtype=torch.float32, seed=seed + 1, scale=k**-0.5)
    b = randn(n, dtype=torch.float32, seed=seed + 2)
    return x, w, b


def test_split_rule_reads_the_weight_shape_only():
    f32 = torch.float32
    assert gemm.splits(f32, 64, NARROW_K) and gemm.splits(f32, gemm.SPLIT_MAX_N, 4 * NARROW_K)
    assert not gemm.splits(f32, gemm.SPLIT_MAX_N + 1, NARROW_K), "wide outputs fill the GPU already"
    assert not gemm.splits(f32, 64, NARROW_K - 256), "short K"
    assert not gemm.splits(f32, 64, NARROW_K + 32), "chunks must be whole BLOCK_K tiles"
    assert not gemm.splits(torch.bfloat16, 64, NARROW_K), "bf16 tiles are wide enough"
    for m in (1, 69):  # the provenance (and so the arithmetic) is the same for any row count
        x, w, b = _narrow(rows=(m,))
        info = gemm.check_linear(x, w, b)
        assert info["kernel_id"] == "h3kernels.gemm.linear.tree8.float32" and info["tile"].endswith("-split8")


@pytest.mark.parametrize("use_tma", [True, False])
def test_parallel_chunks_equal_the_one_program_tree(use_tma):
    """The partials kernel plus `tree_combine` reproduces the one-program tree byte for byte (both operand paths),
    so a narrow `linear` is `linear_tree`; accuracy stays within 2x torch of a float64 truth."""
    x, w, b = _narrow()
    x2d, tile = x.reshape(-1, NARROW_K), gemm.TREE_TILES[torch.float32]
    one_program = gemm._gemm(x2d, w, b, 8, tile, torch.float32, use_tma=False)
    parallel = gemm._gemm(x2d, w, b, 8, tile, torch.float32, use_tma=use_tma, split=True)
    assert torch.equal(parallel, one_program)
    y = gemm.linear(x, w, b)
    assert torch.equal(y.reshape(-1, 64), one_program) and torch.equal(gemm.linear_tree(x, w, b), y)
    assert_error_within(y, F.linear(x, w, b), _truth(x, w, b), "narrow linear")


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_combine_kernel_is_tree_combine(out_dtype, bias):
    """The one-launch combine of the 8 partials adds them as `tree_combine` does (same pairs, same order, bias in
    float32, one cast): the same bytes, on partials of mixed magnitudes where the order shows."""
    parts = randn(8, 70, 90, dtype=torch.float32, seed=40) * torch.logspace(-3, 3, 8).reshape(8, 1, 1)
    b = randn(90, dtype=out_dtype, seed=41) if bias else None
    got = gemm._combine_partials(parts, b, out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, gemm.tree_combine(list(parts.unbind(0)), b, out_dtype))
    flat = ((parts[0] + parts[1]) + (parts[2] + parts[3])) + ((parts[4] + parts[5]) + (parts[6] + parts[7]))
    assert not torch.equal(flat, parts.sum(0)), "inputs where the order changes the bytes"


def test_narrow_rows_are_invariant():
    x, w, b = _narrow(rows=(3, 43))
    y = gemm.linear(x, w, b)
    assert torch.equal(gemm.linear(x, w, b), y), "repeat"
    assert torch.equal(gemm.linear(x[1:2], w, b), y[1:2]), "batch 1 vs 3 at position 1"
    flat, y_flat = x.reshape(-1, NARROW_K), y.reshape(-1, 64)
    for m in (1, 64, 65):
        assert torch.equal(gemm.linear(flat[:m], w, b), y_flat[:m]), f"{m} rows"
    perm = torch.randperm(flat.shape[0], generator=torch.Generator().manual_seed(3))
    assert torch.equal(gemm.linear(flat[perm], w, b), y_flat[perm]), "permuted rows"


def test_narrow_backward_dx_splits_and_stays_row_invariant():
    """A LoRA B factor (N_out = 2048 outputs over rank 64): the forward is wide, dX = dY @ B is narrow (64 outputs
    over K = 2048) and runs the parallel tree. dX matches a float64 truth, repeats, and its rows do not depend on
    the batch; dW (over rows) is unchanged by the rule."""
    h = randn(2, 37, 64, dtype=torch.float32, seed=30)
    w = randn(NARROW_K, 64, dtype=torch.float32, seed=31, scale=0.125)
    dy = randn(2, 37, NARROW_K, dtype=torch.float32, seed=32)
    assert gemm.splits(torch.float32, 64, NARROW_K) and not gemm.splits(torch.float32, NARROW_K, 64)

    def grads(hh, gg):
        hh = hh.clone().requires_grad_()
        ww = w.clone().requires_grad_()
        gemm.linear(hh, ww).backward(gg)
        return hh.grad, ww.grad

    dx, dw = grads(h, dy)
    dx2, dw2 = grads(h, dy)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2), "repeat"
    assert torch.equal(grads(h[1:], dy[1:])[0], dx[1:]), "dX rows: batch 1 vs 2"
    tree = gemm._gemm(dy.reshape(-1, NARROW_K), w.t(), None, 8, gemm.TREE_TILES[torch.float32], torch.float32)
    assert torch.equal(dx.reshape(-1, 64), tree), "dX is the declared tree"
    truth = (dy.double() @ w.double())
    assert_error_within(dx, dy @ w, truth, "narrow dX")
    assert_error_within(dw, torch.einsum("bmn,bmk->nk", dy, h), torch.einsum("bmn,bmk->nk", dy.double(), h.double()),
                        "dW")


def test_no_grad_and_grad_forwards_match():
    x, w, b = _inputs(torch.bfloat16)
    with torch.no_grad():
        y0 = gemm.linear(x, w, b)
    y1 = gemm.linear(x.requires_grad_(), w.requires_grad_(), b)
    assert torch.equal(y0, y1.detach())


# --------------------------------------------------------------------------------------------------- backward
def _grads(fn, x, w, b, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    fn(x, w, b).backward(dy)
    return x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_backward_matches_truth(dtype, op):
    x, w, b = _inputs(dtype, rows=(3, 43), K=128)  # 129 rows: dW and dB reduce over 3 row chunks
    dy = randn(3, 43, N, dtype=dtype, seed=5)
    got = _grads(OPS[op], x, w, b, dy)
    ref = _grads(F.linear, x, w, b, dy)
    truth = _grads(F.linear, x.double(), w.double(), b.double(), dy.double())
    for name, g, r, t in zip(("dx", "dw", "db"), got, ref, truth):
        assert g.dtype == dtype and g.shape == t.shape
        assert_error_within(g, r, t, f"{op} {dtype} {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_backward_is_deterministic_and_dx_rows_invariant(dtype, op):
    x, w, b = _inputs(dtype, rows=(129,), K=128)
    dy = randn(129, N, dtype=dtype, seed=9)
    first = _grads(OPS[op], x, w, b, dy)
    second = _grads(OPS[op], x.clone(), w.clone(), b.clone(), dy.clone())
    for name, g1, g2 in zip(("dx", "dw", "db"), first, second):
        assert torch.equal(g1, g2), f"two backward runs differ in {name}"
    for m in (1, 65):
        dx_m = _grads(OPS[op], x[:m], w, b, dy[:m])[0]
        assert torch.equal(dx_m, first[0][:m]), f"dX rows of a {m}-row batch"


def test_backward_accepts_broadcast_gradients():
    """A stride-0 incoming gradient (from .sum()) is read in place."""
    x, w, b = _inputs(torch.float32, rows=(10,), K=96)
    got = _grads(lambda *a: gemm.linear(*a).sum(), x, w, b, torch.tensor(1.0))
    ref = _grads(lambda *a: F.linear(*[t.double() for t in a]).sum(), x, w, b, torch.tensor(1.0, dtype=torch.float64))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r.double(), rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------- refusals
def _bad_cases():
    x, w, b = _inputs(torch.float32, rows=(4,), K=96)
    xb, wb, bb = (t.bfloat16() for t in (x, w, b))
    return {
        "float16": ((x.half(), w.half(), b.half()), "not supported"),
        "float64": ((x.double(), w.double(), None), "not supported"),
        "mixed dtypes": ((xb, w, b), "mixed dtypes"),
        "mixed bias dtype": ((xb, wb, b), "mixed dtypes"),
        "mixed devices": ((x, w.to("meta"), b), "mixed devices"),
        "meta device": ((x.to("meta"), w.to("meta"), None), "not supported by strict"),
        "K mismatch": ((x[:, :95], w, b), "does not match"),
        "weight 3-D": ((x, w[None], b), "must be 2-D"),
        "bias shape": ((x, w, b[:5]), "bias has shape"),
        "empty rows": ((x[:0], w, b), "empty"),
        "empty K": ((x[:, :0], w[:, :0], b), "empty"),
        "not a tensor": ((x.tolist(), w, b), "must be a torch.Tensor"),
    }


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_inputs_are_refused_by_check_and_run(op, case):
    args, message = _bad_cases()[case]
    check = registry.STRICT_OPS[op].check
    with pytest.raises(registry.StrictUnsupported, match=message):
        check(*args)
    with pytest.raises(registry.StrictUnsupported, match=message):
        OPS[op](*args)


def test_tree_refuses_k_not_multiple_of_8():
    x, w, b = _inputs(torch.float32, rows=(4,), K=100)
    with pytest.raises(registry.StrictUnsupported, match="K = 100 is not a multiple of 8"):
        registry.STRICT_OPS["linear_tree"].check(x, w, b)
    with pytest.raises(registry.StrictUnsupported, match="not a multiple of 8"):
        gemm.linear_tree(x, w, b)
    assert registry.STRICT_OPS["linear"].check(x, w, b)["kernel_id"].startswith("h3kernels.gemm.linear")
    with pytest.raises(registry.StrictUnsupported, match="n_chunks = 3"):
        gemm.tree_partial(x, w, 3)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    x, w, b = _inputs(torch.float32, rows=(4,))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for op in OPS:
        with pytest.raises(registry.StrictUnsupported, match="TRITON_INTERPRET=1"):
            registry.STRICT_OPS[op].check(x, w, b)


# ------------------------------------------------------------------------------------------------ benchmark
def test_benchmark_dry_run_writes_the_schema(tmp_path, monkeypatch):
    """The GPU benchmark's non-timing logic (shapes, checks, JSON) runs tiny in the interpreter."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_gemm.py"])
    import benchmark_gemm

    out = tmp_path / "gemm.json"
    benchmark_gemm.main(["--dry-run", "--rows", "67", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"name", "date", "gpu", "torch", "triton", "git_rev", "command", "results"} <= set(doc)
    rows = doc["results"]
    assert len(rows) == 8  # 2 projections x (strict, torch) x (forward, backward)
    for r in rows:
        assert {"shape", "rows", "impl", "median_s", "runs", "peak_mem_gib"} <= set(r) and r["median_s"] > 0
    strict = [r for r in rows if r["impl"] == "h3lab-strict"]
    assert all(r["rows_equal"] and r["repeat_equal"] for r in strict if r["pass"] == "forward")
    assert all(r["tp_equal"] for r in strict if r["op"] == "linear_tree" and r["pass"] == "forward")
    assert all(r["bwd_repeat_equal"] for r in strict if r["pass"] == "backward")


def test_benchmark_schedules_dry_run_compares_bytes(tmp_path, monkeypatch):
    """`--schedules` times cuBLAS and each byte-equal tree schedule, and records each one's equality with the
    chunk-by-chunk loops."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_gemm.py"])
    import benchmark_gemm

    out = tmp_path / "gemm.json"
    benchmark_gemm.main(["--schedules", "--dry-run", "--rows", "67", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["what"] for r in rows] == ["cublas", "chunkloops-s4", "contract", "paired-s3", "kloop-tree-tile",
                                         "kloop-linear-tile"]
    assert all(r["equal_chunkloops"] and r["median_s"] > 0 for r in rows[1:4])
    assert all(r["tree"] is False and "equal_chunkloops" not in r for r in rows[4:])
    assert rows[2]["tile"] == gemm.TREE_TILES[torch.bfloat16].describe()


def test_fp32_benchmark_dry_run_checks_every_variant(tmp_path, monkeypatch):
    """benchmark_gemm_fp32 (the LoRA factor products, both precisions, the narrow rule) runs tiny in the
    interpreter: every strict row repeats, keeps its rows invariant where rows are the batch, and a split row equals
    the one-program tree."""
    import json
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["benchmark_gemm_fp32.py"])
    import benchmark_gemm_fp32

    out = tmp_path / "gemm_fp32.json"
    benchmark_gemm_fp32.main(["--dry-run", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    strict = [r for r in rows if r["impl"] == "h3lab-strict"]
    assert len([r for r in rows if r["impl"] == "torch-fp32"]) == 6  # the six products of one factor pair
    assert {r["precision"] for r in strict} == set(gemm.PRECISIONS) and any(r["split"] for r in strict)
    assert all(r["repeat_equal"] and r.get("rows_equal", True) and r.get("tree_equal", True) for r in strict)
    assert all(r["rel_l2"] <= 2 * r["torch_rel_l2"] + 1e-6 for r in strict)


# -------------------------------------------------------------------------------------------- registry, runtime
@pytest.mark.parametrize("dtype", DTYPES)
def test_registered_check_reports_provenance(dtype):
    x, w, b = _inputs(dtype, rows=(4,), K=128)
    for op, tiles in (("linear", gemm.LINEAR_TILES), ("linear_tree", gemm.TREE_TILES)):
        info = registry.STRICT_OPS[op].check(x, w, b)
        assert set(info) == {"kernel_id", "tile", "acc_dtype"}
        assert info["acc_dtype"] == "float32" and info["tile"] == tiles[dtype].describe()
        assert str(dtype).replace("torch.", "") in info["kernel_id"]


def test_strict_runtime_dispatches_to_the_kernels():
    x, w, b = _inputs(torch.bfloat16, K=128)
    with runtime.use_mode("strict"):
        ops = runtime.ops()
        y = ops.linear(x, w, b, point="blocks.0.to_q")
        y_tree = ops.linear_tree(x, w, b, point="blocks.0.o_proj")
    assert torch.equal(y, gemm.linear(x, w, b)) and torch.equal(y_tree, gemm.linear_tree(x, w, b))
    records = runtime.last_trace().records
    assert [r.actual for r in records] == ["strict", "strict"]
    assert records[1].kernel_id == "h3kernels.gemm.linear_tree.tree8.bfloat16"
    with runtime.use_mode("strict"), pytest.raises(runtime.StrictError, match="not a multiple of 8"):
        runtime.ops().linear_tree(x[..., :100], w[:, :100], b, point="blocks.0.ffn_down")
