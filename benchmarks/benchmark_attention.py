"""Strict attention vs torch SDPA on the H3 shapes (56 heads x 128), with byte-equality checks at those shapes.

    python benchmarks/benchmark_attention.py --out benchmarks/results/attention.json     # H200
    python benchmarks/benchmark_attention.py --dry-run --out /tmp/attention.json         # CPU interpreter, tiny
    python benchmarks/benchmark_attention.py --sweep --precompile 12 --out benchmarks/results/attention_sweep.json
    python benchmarks/benchmark_attention.py --sweep-tiles --out /tmp/tiles.json          # older tile candidates

`--sweep`: the forward variants of `attention_sweep.py` (byte checks against the contract's kernel, timings against
SDPA / cuDNN / flash) at 2,066 / 12,369 / 37,853 rows (`--sweep-seqs`); `--sweep-tiles`: forward and backward tiles.

S in {2066, 7272}, B = 1, bfloat16, q/k/v (B, S, 56, 128) contiguous (as rope produces them).
Time: `triton.testing.do_bench`, median of all runs; TFLOP/s = 4*B*H*S^2*D / t forward, 2.5x that backward
(the flash-attention convention: 5 matmuls against 2); `ratio` = strict time / SDPA time in the same run
(`h3lab-off` is the op-table reference, SDPA in (B, H, S, D) as Diffusers calls it).
Checks (strict rows): `batch_equal` (item 0 of a batch of 2 equals the same item alone), `repeat_equal`,
`perm_equal` (rows permuted with the canonical key_order give the permuted bytes), `bwd_repeat_equal`, and
`rel_l2_vs_fp32` for strict and SDPA against a float32 reference computed head by head.
"""

from __future__ import annotations

import math

from _common import equal, header, kernel_parser, measure, prepare, rel_l2, table, write

HEADS, HEAD_DIM = 56, 128
SEQS = (2066, 7272)
DRY = dict(heads=2, head_dim=16, seqs=(67, 130))


def _fp32_reference(q, k, v):
    """softmax(q k^T / sqrt(D)) v in float32, one head at a time to bound memory: (B, S, H, D) float32."""
    import torch

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(q.shape[2]):
        qh, kh, vh = (t[:, :, h].float() for t in (q, k, v))  # (B, S, D)
        p = torch.softmax(qh @ kh.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        out[:, :, h] = p @ vh
    return out


def bench_seq(S: int, heads: int, head_dim: int, device: str, backward: bool) -> list[dict]:
    import torch
    from h3kernels import attention as attn
    from h3lab.execution import runtime

    gen = torch.Generator(device=device).manual_seed(S)
    q2, k2, v2 = (torch.randn(2, S, heads, head_dim, device=device, generator=gen).bfloat16() for _ in range(3))
    q, k, v = q2[:1], k2[:1], v2[:1]
    truth = _fp32_reference(q, k, v)
    shape = f"1x{S}x{heads}x{head_dim}"
    flops = 4.0 * S * S * heads * head_dim
    rows = []
    for impl, fn in (("h3lab-strict", attn.attention), ("h3lab-off", runtime.attention)):
        o = fn(q, k, v)
        row = {"shape": shape, "rows": S, "impl": impl, "pass": "forward",
               "backend": "triton" if impl == "h3lab-strict" else "sdpa",
               "rel_l2_vs_fp32": rel_l2(o, truth), **measure(lambda: fn(q, k, v), device)}
        row["tflops"] = flops / row["median_s"] / 1e12
        if impl == "h3lab-strict":
            row["repeat_equal"] = equal(fn(q, k, v), o)
            row["batch_equal"] = equal(fn(q2, k2, v2)[:1], o)
            perm = torch.randperm(S, generator=torch.Generator().manual_seed(0)).to(device)
            inverse = torch.argsort(perm)
            permuted = attn.attention(q[:, perm], k[:, perm], v[:, perm], key_order=inverse)
            row["perm_equal"] = equal(permuted[:, inverse], o)
        rows.append(row)
        del o
    rows[0]["ratio"] = rows[0]["median_s"] / rows[1]["median_s"]
    if backward:
        do = torch.randn(1, S, heads, head_dim, device=device, generator=gen).bfloat16()
        bwd = []
        for impl, fn in (("h3lab-strict", attn.attention), ("h3lab-off", runtime.attention)):
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            o = fn(qg, kg, vg)
            grads = lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True)  # noqa: E731
            g1, g2 = grads(), grads()
            row = {"shape": shape, "rows": S, "impl": impl, "pass": "backward",
                   "backend": "triton" if impl == "h3lab-strict" else "sdpa",
                   "bwd_repeat_equal": all(equal(a, c) for a, c in zip(g1, g2)), **measure(grads, device)}
            row["tflops"] = 2.5 * flops / row["median_s"] / 1e12
            bwd.append(row)
            del o, g1, g2
        bwd[0]["ratio"] = bwd[0]["median_s"] / bwd[1]["median_s"]
        rows += bwd
    return rows


def sweep_tiles(seqs, device: str) -> list[dict]:
    """Time candidate tile configs (exploration only: the contract's tiles are the constants in TILES)."""
    import torch
    from h3kernels import attention as attn

    T = attn.AttentionTiles
    fwd = [T(128, 128, 8, 3, 128, 32, 128, 32, 8, 3), T(128, 128, 8, 2, 128, 32, 128, 32, 8, 3),
           T(128, 128, 8, 4, 128, 32, 128, 32, 8, 3), T(128, 64, 8, 3, 128, 32, 128, 32, 8, 3)]
    bwd = [T(128, 128, 8, 3, 128, 32, 128, 32, 8, 3), T(128, 128, 8, 3, 128, 32, 128, 32, 8, 2),
           T(128, 128, 8, 3, 128, 64, 128, 64, 8, 3), T(128, 128, 8, 3, 64, 32, 64, 32, 4, 3),
           T(128, 128, 8, 3, 128, 32, 64, 32, 8, 3), T(128, 128, 8, 3, 128, 32, 128, 64, 8, 3)]
    contract = attn.TILES[torch.bfloat16]
    out = []
    try:
        for S in seqs:
            gen = torch.Generator(device=device).manual_seed(S)
            q, k, v, do = (torch.randn(1, S, HEADS, HEAD_DIM, device=device, generator=gen).bfloat16()
                           for _ in range(4))
            for which, cands in (("forward", fwd), ("backward", bwd)):
                for tiles in cands:
                    attn.TILES[torch.bfloat16] = tiles
                    try:
                        if which == "forward":
                            t = measure(lambda: attn.attention(q, k, v), device)["median_s"]
                        else:
                            qg = q.clone().requires_grad_()
                            o = attn.attention(qg, k, v)
                            t = measure(lambda: torch.autograd.grad(o, qg, do, retain_graph=True), device)["median_s"]
                    except Exception as exc:  # shared-memory overflow etc.: reported, not fatal
                        out.append({"rows": S, "pass": which, "tile": tiles.describe(), "error": str(exc)[:200]})
                        print(out[-1], flush=True)
                        continue
                    out.append({"rows": S, "pass": which, "tile": tiles.describe(), "median_s": t})
                    print(out[-1], flush=True)
    finally:
        attn.TILES[torch.bfloat16] = contract
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = kernel_parser(__doc__.splitlines()[0], "attention")
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths S (default 2066 7272)")
    parser.add_argument("--sweep-seqs", type=int, nargs="+",
                        help="--sweep: sequence lengths (default 2066 12369 37853; dry run 67 130 256)")
    parser.add_argument("--sweep-tiles", action="store_true",
                        help="time the older forward/backward tile candidates instead of the forward variants")
    parser.add_argument("--sweep-variants", nargs="+", metavar="NAME",
                        help="--sweep: only these variants (attention_sweep.variants names; default all)")
    parser.add_argument("--precompile", type=int, default=0,
                        help="--sweep on CUDA: compile the variants first in this many processes (Triton cache)")
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.dry_run, flag="--dry-run")
    heads, head_dim = (DRY["heads"], DRY["head_dim"]) if args.dry_run else (HEADS, HEAD_DIM)
    doc = header("attention", __file__, argv, device)
    seqs = args.seqs or (DRY["seqs"] if args.dry_run else SEQS)
    if args.sweep or args.sweep_tiles:
        if args.sweep_tiles:
            doc["results"] = sweep_tiles(seqs, device)
        else:
            from attention_sweep import sweep_forward

            doc["variants"], doc["results"] = sweep_forward(args.sweep_seqs, heads, head_dim, device,
                                                            args.precompile, args.sweep_variants)
            print(table(doc["results"], ["rows", "variant", "class", "bytes_equal", "median_s", "tflops",
                                         "ratio_vs_cudnn", "ratio_vs_sdpa", "error"]))
        write(args.out, doc)
        return doc
    for S in seqs:
        doc["results"] += bench_seq(S, heads, head_dim, device, backward=not args.no_backward)
    print(table(doc["results"], ["shape", "impl", "pass", "median_s", "tflops", "ratio", "rel_l2_vs_fp32",
                                 "batch_equal", "repeat_equal", "perm_equal", "bwd_repeat_equal"]))
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
