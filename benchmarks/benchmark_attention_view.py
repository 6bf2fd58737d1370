"""One attention view at full size: the exact float64 probe of `h3lab.research.views.attention` over one block's Q and K,
summed over the packed layout's regions, against the strict attention forward of the same block (what the probe
recomputes the probabilities of).

Per shape (the t2va layouts of `benchmark_forward.SHAPES`: 512x512x22f = 2,066 rows, 1344x768x124f = 37,853 rows),
random bfloat16 Q, K, V (B=1, S, 56 heads, 128 channels; Q and K RMS-normalised per head as the block's q_norm /
k_norm leave them) and the layout's regions (143 or 200 text tokens, one region per latent frame, audio by latent):

  h3lab-strict        the strict attention forward (`runtime.ops` in strict mode): the baseline, the op probed
  view-all-heads      `attention_map` over every query row and all 56 heads (the full view), at the chunk budget of
                      `--chunk-gib` (default 1 GiB, the library default) and at 8 GiB
  view-8-heads        heads 0-7, every query row
  view-text-queries   the text rows as queries (text -> everything), all heads

Each row: median seconds (CUDA events, `--runs` after one warm-up), peak GiB, the float64 flops of the QK^T products
(2 R S H D) and their rate, chunk rows, and the ratio to the strict attention forward of the same shape. The S x S
float32 probability matrix one would otherwise hold is reported beside it (`dense_probabilities_gib`).

    python benchmarks/benchmark_attention_view.py --out benchmarks/results/attention_view.json     # H100 / H200
    python benchmarks/benchmark_attention_view.py --tiny --out /tmp/attention_view.json             # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import header, prepare, table, timed, write

from benchmark_forward import SHAPES  # noqa: E402 - the benchmark shapes: latent frames, grid, audio, text rows

FULL_SHAPES = ("512x512x22f", "1344x768x124f")
HEADS, HEAD_DIM = 56, 128
TINY_HEADS, TINY_HEAD_DIM = 2, 16


def qkv(rows: int, heads: int, dim: int, device: str, seed: int = 0):
    """(1, S, H, D) bfloat16 Q, K, V; Q and K with unit RMS per head (the q_norm / k_norm output before RoPE)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, rows, heads, dim, generator=g) for _ in range(3))
    q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) for t in (q, k))
    return tuple(t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v))


def _row(shape: str, rows: int, impl: str, times: list[float], peak: float, **extra) -> dict:
    median = statistics.median(times)
    out = {"shape": shape, "rows": rows, "impl": impl, "median_s": median, "runs": len(times), "peak_mem_gib": peak}
    if "flops" in extra:
        extra["float64_tflops"] = extra["flops"] / median / 1e12
    return {**out, **extra}


def run_shape(shape: str, heads: int, dim: int, device: str, runs: int, chunk_gib: float) -> list[dict]:
    from h3lab.execution import runtime
    from h3lab.run.layout import build_layout
    from h3lab.research.views.attention import attention_map, chunk_rows
    from h3lab.research.views.regions import layout_regions, select

    frames, lh, lw, audio, text = SHAPES[shape]
    layout = build_layout("t2va", torch.ones(text, dtype=torch.long), frames, lh, lw, audio)
    regions = layout_regions(layout)
    S = layout.sequence_length
    q, k, v = qkv(S, heads, dim, device)

    def strict_forward():
        with runtime.use_mode("strict"), runtime.use_ops(runtime.ops(device=device, record=False)):
            return runtime.current_ops().attention(q, k, v, None, point="blocks.0.attention")

    base_times, base_peak = timed(strict_forward, runs, device)
    rows = [_row(shape, S, "h3lab-strict", base_times, base_peak, what="strict attention forward (the op probed)")]
    cases = [("view-all-heads", None, None, chunk_gib), ("view-all-heads", None, None, 8.0),
             ("view-8-heads", list(range(min(8, heads))), None, chunk_gib),
             ("view-text-queries", None, select(regions, "text"), chunk_gib)]
    for impl, hs, query, gib in cases:
        n_heads = heads if hs is None else len(hs)
        chunk = chunk_rows(S, n_heads, int(gib * 2**30))
        view = {}

        def probe(hs=hs, query=query, chunk=chunk):
            view["map"] = attention_map(q[0], k[0], regions, block=0, step=0, query=query, heads=hs, chunk=chunk)

        times, peak = timed(probe, runs, device)
        m = view["map"]
        R = int(m.rows.sum())
        rows.append(_row(shape, S, impl, times, peak, heads=n_heads, query_rows=R, chunk_gib=gib, chunk_rows=chunk,
                         flops=2 * R * S * n_heads * dim, query_regions=len(m.query_labels),
                         key_regions=len(m.key_labels), dense_probabilities_gib=S * S * n_heads * 4 / 2**30,
                         max_row_sum_error=float((m.weights.sum(-1) - 1).abs().max()),
                         ratio_vs_strict_attention=statistics.median(times) / statistics.median(base_times)))
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON results path (benchmarks/results/attention_view.json)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny heads on the tiny shape")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per case after one warm-up")
    parser.add_argument("--chunk-gib", type=float, default=1.0, help="chunk budget of the views (GiB)")
    parser.add_argument("--shapes", nargs="+", default=None, help=f"default: {' '.join(FULL_SHAPES)}")
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.tiny, flag="--tiny")
    shapes = args.shapes or (["tiny-64x64x22f"] if args.tiny else list(FULL_SHAPES))
    heads, dim = (TINY_HEADS, TINY_HEAD_DIM) if args.tiny else (HEADS, HEAD_DIM)
    doc = header("attention_view", __file__, argv, device, heads=heads, head_dim=dim,
                 arithmetic="float64 probe (h3lab.research.views.attention.ARITHMETIC); baseline: strict bf16 attention")
    for shape in shapes:
        doc["results"] += run_shape(shape, heads, dim, device, args.runs, args.chunk_gib)
        print(table([r for r in doc["results"] if r["shape"] == shape],
                    ["shape", "rows", "impl", "heads", "query_rows", "chunk_gib", "median_s", "peak_mem_gib",
                     "float64_tflops", "ratio_vs_strict_attention"]), flush=True)
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
