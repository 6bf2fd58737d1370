"""One full-size H3 block, forward + backward: strict against torch (`off`, the Diffusers arithmetic), at the two
benchmark row counts (target: strict backward deterministic and at most 1.5x torch's).

One `TransformerBlock` of the released width (hidden 5376, 56x128 heads, ffn 14336, AdaLN 2688 -> 96768) with seeded
random bf16 weights is run through the model's own block code (`h3lab/model/layers.py`) under each mode: forward
time, forward+backward time (gradients of the block input and of every weight), and whether two strict backward
passes give identical gradients (and torch's, for contrast). The packed layout is the t2va layout of the shape, so
AdaLN rows, RoPE tables and attention are those of a real request.

    python benchmarks/benchmark_block.py --out benchmarks/results/block.json     # H200
    python benchmarks/benchmark_block.py --tiny --out /tmp/block.json             # CPU smoke (tiny config)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _common import header, prepare, sync, timed, write

from benchmark_forward import SHAPES, init_random_  # noqa: E402 - the shapes and weight law of the forward benchmark


def build(config, device: str, seed: int):
    from h3lab.model.layers import TransformerBlock

    block = TransformerBlock(config, 0).to(device=device, dtype=torch.bfloat16)  # all block weights are bf16
    init_random_(block, seed)
    return block


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on H3Config.tiny()")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.tiny, flag="--tiny")

    from h3lab.execution import runtime
    from h3lab.config import H3Config
    from h3lab.run.layout import build_layout

    config = H3Config.tiny() if args.tiny else H3Config.full()
    shapes = ["tiny-64x64x22f"] if args.tiny else ["512x512x22f", "864x480x56f"]
    block = build(config, device, seed=0)
    doc = header("block", __file__, argv, device, config={"hidden": config.hidden_size, "heads": config.num_attention_heads})
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, 2 * config.rope_freq_dim, 2, dtype=torch.float32)
                                          / (2 * config.rope_freq_dim)))
    for shape in shapes:
        frames, lh, lw, audio, text = SHAPES[shape]
        layout = build_layout("t2va", torch.ones(text, dtype=torch.int64), frames, lh, lw, audio)
        unique_t, t_idx = layout.row_timesteps(0.3, 0.55)
        adaln_idx = (t_idx * 3 + layout.token_tags).to(device)
        cos, sin = runtime.rope_table(layout.position_ids.to(torch.float32), inv_freq)
        cos, sin = cos.to(device), sin.to(device)
        gen = torch.Generator().manual_seed(1)
        x0 = torch.randn(1, layout.sequence_length, config.hidden_size, generator=gen).to(device, torch.bfloat16)
        temb = torch.randn(unique_t.numel(), config.time_embed_dim, generator=gen).to(device)
        dy = torch.randn(x0.shape, generator=gen).to(device, torch.bfloat16)

        def forward(mode: str, grad: bool):
            x = x0.clone().requires_grad_(grad)
            with runtime.use_mode(mode), torch.set_grad_enabled(grad):
                with runtime.use_ops(runtime.ops(device=device, record=False)):
                    y = block(x, temb, adaln_idx, (cos, sin))
            return x, y

        def fwd_bwd(mode: str):
            block.zero_grad(set_to_none=True)
            x, y = forward(mode, True)
            y.backward(dy)
            return [x.grad] + [p.grad for p in block.parameters()]

        for mode, impl in (("off", "torch"), ("strict", "h3lab-strict")):
            f_times, f_peak = timed(lambda: forward(mode, False), args.runs, device)
            b_times, b_peak = timed(lambda: fwd_bwd(mode), args.runs, device)
            g1 = [g.clone() for g in fwd_bwd(mode)]
            g2 = fwd_bwd(mode)
            repeat = all(torch.equal(a, b) for a, b in zip(g1, g2))
            sync(device)
            for what, times, peak in (("forward", f_times, f_peak), ("forward+backward", b_times, b_peak)):
                doc["results"].append({
                    "shape": shape, "rows": layout.sequence_length, "impl": impl, "pass": what,
                    "median_s": statistics.median(times), "runs": len(times), "peak_mem_gib": peak,
                    "grad_repeat_equal": repeat if what != "forward" else None,
                })
            print(f"{shape} {impl}: fwd {statistics.median(f_times)*1e3:.2f} ms, fwd+bwd "
                  f"{statistics.median(b_times)*1e3:.2f} ms, gradients repeat bit-equal: {repeat}", flush=True)
        by = {(r["shape"], r["impl"], r["pass"]): r["median_s"] for r in doc["results"]}
        for what in ("forward", "forward+backward"):
            ratio = by[(shape, "h3lab-strict", what)] / by[(shape, "torch", what)]
            for r in doc["results"]:
                if (r["shape"], r["impl"], r["pass"]) == (shape, "h3lab-strict", what):
                    r["ratio_vs_torch"] = ratio
            print(f"{shape} strict/torch {what}: {ratio:.3f}", flush=True)
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
