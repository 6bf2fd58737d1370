"""Strict GEMM vs torch/cuBLAS on the H3 projection shapes, with byte-equality checks at the real shapes.

    python benchmarks/benchmark_gemm.py --out benchmarks/results/gemm.json            # H200: forward + backward
    python benchmarks/benchmark_gemm.py --dry-run --out /tmp/gemm.json                # CPU interpreter, tiny shapes
    python benchmarks/benchmark_gemm.py --sweep                                       # H200: candidate tiles
    python benchmarks/benchmark_gemm.py --schedules --projs o_proj ffn_down           # H200: tree schedules

Rows M in {2066, 7272} (512x512x22f and 864x480x56f); (K, N): q/k/v 5376->7168 (`linear`), o-proj 7168->5376
(`linear_tree`), ffn up 5376->28672 (`linear`), ffn down 14336->5376 (`linear_tree`); bfloat16 with bias.
Time: `triton.testing.do_bench` (L2 flushed between runs), median of all runs; TFLOP/s = 2*M*N*K / t forward and
4*M*N*K / t backward (dX and dW); `ratio` = strict time / torch time measured in the same run.
Checks on the strict output (strict rows of the JSON): `rows_equal` (the first row alone and the first half of the
rows give the same bytes as in the full batch), `repeat_equal`, `tp_equal` (tree ops: TP2/4/8 subtrees recombined
give the TP1 bytes), `bwd_repeat_equal` (two backward runs), and `rel_l2_vs_fp32` for strict and torch alike.
`--sweep` times other tile configs through the same kernel (exploration only; the contract's tiles are constants).
`--schedules` times the `linear_tree` schedules that keep the bytes (chunk-by-chunk loops with pointer slots, the
contract's TMA slots, the paired chunks) against cuBLAS, interleaved per shape, each output compared byte for byte
with the chunk-by-chunk loops' (`equal_chunkloops`); two diagnostic rows (`tree: false`, other bytes) time one plain
K loop at the tree's tile and at `linear`'s, the ceiling a tree schedule could reach.
"""

from __future__ import annotations


from _common import equal, header, kernel_parser, measure, prepare, rel_l2, table, write

SHAPES = [  # (name, op, K, N)
    ("qkv", "linear", 5376, 7168),
    ("o_proj", "linear_tree", 7168, 5376),
    ("ffn_up", "linear", 5376, 28672),
    ("ffn_down", "linear_tree", 14336, 5376),
]
ROWS = (2066, 7272)
DRY_SHAPES = [("qkv", "linear", 96, 80), ("o_proj", "linear_tree", 128, 72)]
DRY_ROWS = (3, 67)


# ------------------------------------------------------------------------------------------ the benchmark
def _rows_checks(fn, x, w, b, y) -> bool:
    half = x.shape[0] // 2 + 1
    return bool(equal(fn(x[:1], w, b), y[:1]) and equal(fn(x[:half], w, b), y[:half]))


def _tp_check(gemm, x, w, b, y) -> bool:
    K = x.shape[1]
    for ranks in (2, 4, 8):
        width = K // ranks
        parts = [gemm.tree_partial(x[:, r * width:(r + 1) * width], w[:, r * width:(r + 1) * width], 8 // ranks)
                 for r in range(ranks)]
        if not equal(gemm.tree_combine(parts, b, y.dtype), y):
            return False
    return True


def bench_shape(name: str, op: str, K: int, N: int, M: int, device: str, backward: bool) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from h3kernels import gemm

    gen = torch.Generator(device=device).manual_seed(M * 7 + K)
    x = torch.randn(M, K, device=device, generator=gen).bfloat16()
    w = (torch.randn(N, K, device=device, generator=gen) * K**-0.5).bfloat16()
    b = torch.randn(N, device=device, generator=gen).bfloat16()
    strict = getattr(gemm, op)
    truth = F.linear(x.float(), w.float(), b.float())  # float32 reference (TF32 is off for matmul by default)
    shape = f"{M}x{K}x{N}"
    flops = 2.0 * M * N * K
    rows = []
    for impl, fn in (("h3lab-strict", strict), ("h3lab-off", F.linear)):
        y = fn(x, w, b)
        row = {"shape": shape, "rows": M, "impl": impl, "op": op, "proj": name, "pass": "forward",
               "backend": "triton" if impl == "h3lab-strict" else "cuBLAS",
               "rel_l2_vs_fp32": rel_l2(y, truth), **measure(lambda: fn(x, w, b), device)}
        row["tflops"] = flops / row["median_s"] / 1e12
        if impl == "h3lab-strict":
            row["repeat_equal"] = equal(fn(x, w, b), y)
            row["rows_equal"] = _rows_checks(fn, x, w, b, y)
            if op == "linear_tree":
                row["tp_equal"] = _tp_check(gemm, x, w, b, y)
        rows.append(row)
        del y
    rows[0]["ratio"] = rows[0]["median_s"] / rows[1]["median_s"]
    if backward:
        dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
        bwd = []
        for impl, fn in (("h3lab-strict", strict), ("h3lab-off", F.linear)):
            xg, wg, bg = (t.detach().clone().requires_grad_() for t in (x, w, b))
            y = fn(xg, wg, bg)
            grads = lambda: torch.autograd.grad(y, (xg, wg, bg), dy, retain_graph=True)  # noqa: E731
            g1, g2 = grads(), grads()
            row = {"shape": shape, "rows": M, "impl": impl, "op": op, "proj": name, "pass": "backward",
                   "backend": "triton" if impl == "h3lab-strict" else "cuBLAS",
                   "bwd_repeat_equal": all(equal(a, c) for a, c in zip(g1, g2)), **measure(grads, device)}
            row["tflops"] = 2 * flops / row["median_s"] / 1e12
            bwd.append(row)
            del y, g1, g2
        bwd[0]["ratio"] = bwd[0]["median_s"] / bwd[1]["median_s"]
        rows += bwd
    return rows


def sweep(device: str, rows_list, shapes) -> list[dict]:
    """Time candidate tile configs of the same kernel on each shape, forward through TMA descriptors and through
    pointers (and whether the two give the same bytes), plus the two backward GEMMs. Exploration only: the
    contract's tiles are the constants in `gemm`."""
    import torch
    from h3kernels import gemm

    T = gemm.Tile
    linear_candidates = [T(128, 256, 64, 8, 8, 3, True), T(128, 256, 64, 8, 8, 3, False),
                         T(128, 128, 64, 8, 4, 4, True)]
    # BLOCK_M / BLOCK_N / stages / warps only (BLOCK_K = 64 keeps the reduction order, hence the bytes)
    tree_candidates = [T(128, 128, 64, 8, 8, 4, True), T(128, 128, 64, 8, 8, 3, True),
                       T(128, 128, 64, 8, 8, 3, False), T(128, 128, 64, 8, 8, 5, True), T(128, 64, 64, 8, 4, 4, True),
                       T(64, 128, 64, 8, 4, 4, True), T(128, 256, 64, 8, 8, 3, True), T(256, 128, 64, 8, 8, 3, True),
                       T(128, 128, 64, 4, 8, 4, True)]
    out = []

    def run(label, fn, flops, **keys):
        try:
            y = fn()
            t = measure(fn, device)["median_s"]
        except Exception as exc:  # a config that does not compile (shared memory, registers) is reported
            out.append({**keys, "what": label, "error": str(exc)[:300]})
            print(out[-1], flush=True)
            return None
        out.append({**keys, "what": label, "median_s": t, "tflops": flops / t / 1e12})
        print(out[-1], flush=True)
        return y

    for M in rows_list:
        for name, op, K, N in shapes:
            gen = torch.Generator(device=device).manual_seed(1)
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            w = (torch.randn(N, K, device=device, generator=gen) * K**-0.5).bfloat16()
            dy = torch.randn(M, N, device=device, generator=gen).bfloat16()
            chunks = gemm.TREE_CHUNKS if op == "linear_tree" else 1
            flops = 2.0 * M * N * K
            run("cublas-fwd", lambda: torch.nn.functional.linear(x, w), flops, rows=M, proj=name, tile="cuBLAS")
            run("cublas-dx", lambda: dy @ w, flops, rows=M, proj=name, tile="cuBLAS")
            run("cublas-dw", lambda: dy.t() @ x, flops, rows=M, proj=name, tile="cuBLAS")
            for tile in tree_candidates if op == "linear_tree" else linear_candidates:
                keys = dict(rows=M, proj=name, tile=tile.describe())
                y_tma = run("fwd-tma", lambda: gemm._gemm(x, w, None, chunks, tile, x.dtype, True), flops, **keys)
                y_ptr = run("fwd-ptr", lambda: gemm._gemm(x, w, None, chunks, tile, x.dtype, False), flops, **keys)
                if y_tma is not None and y_ptr is not None:
                    out[-1]["tma_equal"] = bool(torch.equal(y_tma, y_ptr))
                if op == "linear":
                    run("dx-tma", lambda: gemm._gemm(dy, w.t(), None, 1, tile, x.dtype), flops, **keys)
                    run("dw-tma", lambda: gemm._gemm(dy.t(), x.t(), None, 1, tile, x.dtype), flops, **keys)
    return out


def schedules(device: str, rows_list, shapes) -> list[dict]:
    """`linear_tree` bf16 schedules (same BLOCK 128x128x64, so the same bytes) against cuBLAS on each tree shape:
    the chunk-by-chunk loops at 4 stages with pointer slots, the contract tile (the same loops, TMA slots), and the
    paired chunks at 3 stages; every output checked byte-equal to the chunk-by-chunk loops'."""
    import dataclasses

    import torch
    from h3kernels import gemm

    base = gemm.TREE_TILES[torch.bfloat16]
    R = dataclasses.replace
    variants = [("chunkloops-s4", R(base, paired=False, slot_tma=False, num_stages=4)), ("contract", base),
                ("paired-s3", R(base, paired=True, slot_tma=False, num_stages=3))]
    # not the tree (other bytes, timed only): one K loop and one accumulator at the tree's tile, and at `linear`'s
    diagnostics = [("kloop-tree-tile", base), ("kloop-linear-tile", gemm.LINEAR_TILES[torch.bfloat16])]
    out = []
    for M in rows_list:
        for name, op, K, N in shapes:
            if op != "linear_tree":
                continue
            gen = torch.Generator(device=device).manual_seed(2)
            x = torch.randn(M, K, device=device, generator=gen).bfloat16()
            w = (torch.randn(N, K, device=device, generator=gen) * K**-0.5).bfloat16()
            b = torch.randn(N, device=device, generator=gen).bfloat16()
            flops = 2.0 * M * N * K
            t = measure(lambda: torch.nn.functional.linear(x, w, b), device)["median_s"]
            out.append({"rows": M, "proj": name, "what": "cublas", "median_s": t, "tflops": flops / t / 1e12})
            ref = None
            for label, tile in variants:
                fn = lambda tile=tile: gemm._gemm(x, w, b, gemm.TREE_CHUNKS, tile, x.dtype)  # noqa: E731
                try:
                    y = fn()
                    ts = measure(fn, device)["median_s"]
                except Exception as exc:  # a schedule that does not compile or launch (shared memory) is reported
                    out.append({"rows": M, "proj": name, "what": label, "error": str(exc)[:300]})
                    continue
                ref = y if ref is None else ref
                out.append({"rows": M, "proj": name, "what": label, "tile": tile.describe(), "median_s": ts,
                            "tflops": flops / ts / 1e12, "ratio_vs_cublas": ts / t,
                            "equal_chunkloops": bool(torch.equal(y, ref))})
            for label, tile in diagnostics:
                ts = measure(lambda tile=tile: gemm._gemm(x, w, b, 1, tile, x.dtype), device)["median_s"]
                out.append({"rows": M, "proj": name, "what": label, "tile": tile.describe(), "median_s": ts,
                            "tflops": flops / ts / 1e12, "ratio_vs_cublas": ts / t, "tree": False})
            print(table(out[-len(variants) - len(diagnostics) - 1:],
                        ["proj", "rows", "what", "median_s", "tflops", "ratio_vs_cublas", "equal_chunkloops"]),
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = kernel_parser(__doc__.splitlines()[0], "gemm")
    parser.add_argument("--rows", type=int, nargs="+", help="row counts M (default 2066 7272)")
    parser.add_argument("--schedules", action="store_true", help="time the byte-equal linear_tree schedules")
    parser.add_argument("--projs", nargs="+", choices=[s[0] for s in SHAPES], help="only these projections")
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.dry_run, flag="--dry-run")
    doc = header("gemm", __file__, argv, device)
    rows_list = args.rows or (DRY_ROWS if args.dry_run else ROWS)
    shapes = [s for s in (DRY_SHAPES if args.dry_run else SHAPES) if not args.projs or s[0] in args.projs]
    if args.schedules:
        doc["results"] = schedules(device, rows_list, shapes)
    elif args.sweep:
        doc["results"] = sweep(device, rows_list, shapes)
    else:
        for M in rows_list:
            for name, op, K, N in shapes:
                doc["results"] += bench_shape(name, op, K, N, M, device, backward=not args.no_backward)
                print(table(doc["results"][-4:], ["proj", "rows", "impl", "pass", "median_s", "tflops", "ratio"]),
                      flush=True)
        print(table(doc["results"], ["proj", "shape", "impl", "pass", "median_s", "tflops", "ratio", "rel_l2_vs_fp32",
                                     "rows_equal", "repeat_equal", "tp_equal", "bwd_repeat_equal"]))
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
