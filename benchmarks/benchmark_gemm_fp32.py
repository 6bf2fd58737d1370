"""Strict float32 GEMMs of a rank-64 LoRA step on the H3 projections: FMA ("ieee") vs the tensor core's three-TF32
split ("tf32x3"), one program per output tile vs the narrow rule's parallel tree chunks, against cuBLAS float32.

    python benchmarks/benchmark_gemm_fp32.py --out benchmarks/results/gemm_fp32.json   # H200, about a minute
    python benchmarks/benchmark_gemm_fp32.py --dry-run --out /tmp/gemm_fp32.json       # CPU interpreter, tiny shapes

Per projection (K_in -> N_out; q/k/v 5376->7168, o 7168->5376 and ffn down 14336->5376 are trees, ffn up
5376->28672) the six float32 products of one LoRA factor pair at M rows, as `kernels/gemm.py`'s autograd issues them:
`a_fwd` x @ A^T (narrow: 64 outputs over K_in), `b_fwd` h @ B^T (K = 64), `dh` dd @ B (narrow: 64 outputs over
N_out), `dB` dd^T @ h, `dx` dh @ A (K = 64), `dA` dh^T @ x (the weight gradients reduce over the M rows). Inputs are
bf16 values in float32 (a LoRA layer casts x up), factors float32.
Variants: `precision` x `split` (split only where `gemm.splits` allows it) x `tile` (`--tiles`: the contract's
64x64x32 and candidates, exploration). Time: do_bench median (L2 flushed). `rel_l2` of each output vs a float64
truth, for the strict variant and for torch (cuBLAS float32, TF32 off) alike; `rows_equal` (first row alone and the
first half of the rows give the bytes of the full batch) and `repeat_equal` for strict; `tree_equal` (split rows:
the parallel chunks give the one-program tree's bytes).
"""

from __future__ import annotations

import dataclasses

from _common import equal, header, kernel_parser, measure, prepare, rel_l2, table, write

PROJECTIONS = [  # (name, K_in, N_out, tree)
    ("qkv", 5376, 7168, False),
    ("o_proj", 7168, 5376, True),
    ("ffn_up", 5376, 28672, False),
    ("ffn_down", 14336, 5376, True),
]
DRY_PROJECTIONS = [("narrow", 2048, 96, False)]
RANK = 64
TILES = {  # name -> (block_m, block_n, block_k, group_m, warps, stages)
    "64x64x32w4": (64, 64, 32, 8, 4, 3),
    "128x64x32w4": (128, 64, 32, 8, 4, 3),
    "128x128x32w8": (128, 128, 32, 8, 8, 3),
    "64x128x32w4": (64, 128, 32, 8, 4, 3),
}


def products(K_in: int, N_out: int, M: int, device: str):
    """(name, x, w, batch_rows) for the six products y = x @ w^T of one factor pair (w laid out as the autograd
    passes it: transposed views where the backward uses them). `batch_rows`: the rows of x are the batch's rows
    (batch invariance applies, the narrow rule may split); False for the weight gradients, which reduce over them."""
    import torch

    gen = torch.Generator(device=device).manual_seed(M + K_in + N_out)
    x = torch.randn(M, K_in, device=device, generator=gen).bfloat16().float()
    a = torch.randn(RANK, K_in, device=device, generator=gen) * K_in**-0.5
    b = torch.randn(N_out, RANK, device=device, generator=gen) * RANK**-0.5
    h = torch.randn(M, RANK, device=device, generator=gen)
    dd = torch.randn(M, N_out, device=device, generator=gen)
    dh = torch.randn(M, RANK, device=device, generator=gen)
    return [
        ("a_fwd", x, a, True), ("b_fwd", h, b, True), ("dh", dd, b.t(), True),
        ("dB", dd.t(), h.t(), False), ("dx", dh, a.t(), True), ("dA", dh.t(), x.t(), False),
    ]


def bench(gemm, name, kind, x, w, batch_rows: bool, tile, split: bool, truth, torch_err, device) -> dict:
    import torch

    n_chunks = 8 if split else 1

    def run(xx):
        return gemm._gemm(xx, w, None, n_chunks, tile, torch.float32, split=split)

    y = run(x)
    row = {"proj": name, "product": kind, "M": x.shape[0], "N": w.shape[0], "K": x.shape[1],
           "impl": "h3lab-strict", "precision": tile.precision, "split": split, "tile": tile.describe(split),
           "median_s": measure(lambda: run(x), device)["median_s"], "rel_l2": rel_l2(y, truth), "torch_rel_l2": torch_err,
           "repeat_equal": equal(run(x), y)}
    if batch_rows:
        half = x.shape[0] // 2 + 1
        row["rows_equal"] = bool(equal(run(x[:1]), y[:1]) and equal(run(x[:half]), y[:half]))
    if split:
        row["tree_equal"] = equal(gemm._gemm(x, w, None, 8, tile, torch.float32), y)
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = kernel_parser(__doc__.splitlines()[0], "gemm_fp32")
    parser.add_argument("--rows", type=int, default=2066, help="row count M (default 2066: 512x512x22f)")
    parser.add_argument("--tiles", default="64x64x32w4", help=f"comma list of tiles to try ({', '.join(TILES)})")
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.dry_run, flag="--dry-run")
    import torch
    import torch.nn.functional as F
    from h3kernels import gemm

    tiles = args.tiles.split(",")
    if any(t not in TILES for t in tiles):
        parser.error(f"--tiles {args.tiles!r}: each must be one of {', '.join(TILES)}")
    M = 67 if args.dry_run else args.rows
    doc = header("gemm_fp32", __file__, argv, device, rank=RANK, rows=M)
    for name, K_in, N_out, tree in (DRY_PROJECTIONS if args.dry_run else PROJECTIONS):
        for kind, x, w, batch_rows in products(K_in, N_out, M, device):
            truth = F.linear(x.double(), w.double())
            torch_row = {"proj": name, "product": kind, "M": x.shape[0], "N": w.shape[0], "K": x.shape[1],
                         "impl": "torch-fp32", "median_s": measure(lambda: F.linear(x, w), device)["median_s"],
                         "rel_l2": rel_l2(F.linear(x, w), truth)}
            doc["results"].append(torch_row)
            narrow = batch_rows and gemm.splits(torch.float32, w.shape[0], x.shape[1])
            for tname in tiles:
                bm, bn, bk, g, warps, stages = TILES[tname]
                for precision in gemm.PRECISIONS:
                    tile = dataclasses.replace(gemm.TREE_TILES[torch.float32], block_m=bm, block_n=bn, block_k=bk,
                                               group_m=g, num_warps=warps, num_stages=stages, precision=precision)
                    for split in ((False, True) if narrow else (False,)):
                        row = bench(gemm, name, kind, x, w, batch_rows, tile, split, truth, torch_row["rel_l2"], device)
                        row["ratio"] = row["median_s"] / torch_row["median_s"]
                        doc["results"].append(row)
                        print(table([row], ["proj", "product", "tile", "split", "median_s", "ratio", "rel_l2",
                                            "torch_rel_l2", "rows_equal"]).splitlines()[1], flush=True)
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
