"""Speed presets' quality on the trained embedded default (h3-shapes): SSIM of each preset's decoded frames against
the 50-pass reference of the same prompt and seed.

    python benchmarks/benchmark_preset_quality.py [--snapshot DIR] [--device cpu|cuda] [--prompts N] [--seed 42]
                                                  [--out benchmarks/results/preset_quality.json] [--dry-run]

- Prompts: the first `--prompts` held-out prompts of `h3lab.shapes` (t2va, 64x64x22f, mode off). Each runs once at
  `--steps 50` (the slow reference of docs/presets.md's table) and once per `CONFIGS` entry; every run decodes
  through the session (`Session.generate`), so the frames compared are what a user gets.
- SSIM (`ssim`): Wang et al. 2004 on the luma (BT.601) of uint8 frames, an 11x11 Gaussian window (sigma 1.5),
  C1 = (0.01 * 255)^2, C2 = (0.03 * 255)^2, valid positions only, averaged over pixels and then frames; reported per
  config as the mean over prompts (and per prompt). 1.0 = the reference's frames.
- Also per config: how many prompts' decoded clips still say all four attributes (`h3lab.shapes.measure` /
  `matches`: colour, direction, tone, pan; the 50-pass reference's count is the `reference` row), and the mean wall
  seconds of one generate call (decode included) on `--device`.
- `--dry-run`: 2 prompts' worth of structure at 3/6 passes on the random tiny snapshot (the CI smoke run).
- Output JSON in the benchmarks schema (DESIGN.md "Evidence").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bootstrap, header, table, write  # noqa: E402

REFERENCE_STEPS = 50
# name: generate overrides (docs/presets.md: the balanced and aggressive columns that a 6-block model takes).
CONFIGS = {
    "steps-20 (CLI default)": {"steps": 20},
    "steps-7": {"steps": 7},
    "steps-4": {"steps": 4},
    "reuse-2": {"steps": 20, "reuse": 2},
    "reuse-3": {"steps": 20, "reuse": 3},
    "layers-5": {"steps": 20, "layers": 5},
    "core-reuse-4": {"steps": 20, "core_reuse": 4},
    "core-reuse-6": {"steps": 20, "core_reuse": 6},
    "token-reduction": {"steps": 20, "token_reduction": True},
    "layers-5+reuse-2+token-reduction": {"steps": 20, "layers": 5, "reuse": 2, "token_reduction": True},
}
GEN = dict(width=64, height=64, frames=22, mode="off")


def _gaussian(size: int = 11, sigma: float = 1.5) -> np.ndarray:
    x = np.arange(size, dtype=np.float64) - (size - 1) / 2
    g = np.exp(-x ** 2 / (2 * sigma ** 2))
    return g / g.sum()


def _filter(img: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Separable 'valid' filtering of (F, H, W) float64 by the 1-D window `g` along H and W."""
    k = g.size
    rows = sum(g[i] * img[:, i:img.shape[1] - k + 1 + i, :] for i in range(k))
    return sum(g[i] * rows[:, :, i:img.shape[2] - k + 1 + i] for i in range(k))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of two uint8 (F, H, W, 3) clips on their luma (module docstring)."""
    if a.shape != b.shape or a.ndim != 4 or a.shape[-1] != 3:
        raise ValueError(f"clips {a.shape} and {b.shape}: must be equal (frames, height, width, 3)")
    w = np.array([0.299, 0.587, 0.114])
    x, y = a.astype(np.float64) @ w, b.astype(np.float64) @ w
    g = _gaussian()
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = _filter(x, g), _filter(y, g)
    sxx = _filter(x * x, g) - mx * mx
    syy = _filter(y * y, g) - my * my
    sxy = _filter(x * y, g) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return float(s.mean(axis=(1, 2)).mean())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--snapshot", default=None, help="snapshot (default: the embedded default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompts", type=int, default=12, help="first N held-out prompts (12: all of them)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default=None, help="JSON results path")
    p.add_argument("--dry-run", action="store_true", help="random tiny snapshot, 2 prompts, 3/6 passes")
    args = p.parse_args(argv)
    bootstrap(cpu=args.device == "cpu")
    import torch

    from h3lab import Session
    from h3lab.shapes import ClipSpec, held_out_combos, matches, measure, prompt

    if args.device == "cpu":
        torch.set_num_threads(2)
    snapshot = args.snapshot
    ref_steps, configs = REFERENCE_STEPS, CONFIGS
    if args.dry_run:
        from h3lab.checkpoint.tiny import random_snapshot

        snapshot, ref_steps, args.prompts = random_snapshot(), 6, 2
        configs = {"steps-3": {"steps": 3}, "reuse-2": {"steps": 6, "reuse": 2}}
    session = Session(snapshot, device=args.device)
    doc = header("preset_quality", __file__, argv if argv is not None else sys.argv[1:], args.device,
                 snapshot=str(snapshot) if snapshot else "embedded default", reference_steps=ref_steps,
                 shape="64x64x22f", seed=args.seed)
    combos = {prompt(ClipSpec(*c)): c for c in held_out_combos()[:args.prompts]}
    prompts = list(combos)

    def says_all_four(text, result) -> bool:
        colour, shape, direction = combos[text]
        m = measure(result.frames, result.audio.numpy(), result.sample_rate)
        return all(matches(m, colour, shape, direction).values())

    ref_results = {text: session.generate(text, seed=args.seed, steps=ref_steps, **GEN) for text in prompts}
    refs = {text: r.frames for text, r in ref_results.items()}
    ref_all_four = sum(says_all_four(text, r) for text, r in ref_results.items())
    doc["results"].append({"config": "reference", "settings": {"steps": ref_steps}, "ssim_vs_reference": 1.0,
                           "ssim_min": 1.0, "all_four": ref_all_four, "prompts": prompts})
    for name, overrides in configs.items():
        scores, secs, all_four = [], [], 0
        for text in prompts:
            t = time.perf_counter()
            result = session.generate(text, seed=args.seed, **{**GEN, **overrides})
            secs.append(time.perf_counter() - t)
            scores.append(ssim(result.frames, refs[text]))
            all_four += says_all_four(text, result)
        doc["results"].append({"config": name, "settings": overrides, "ssim_vs_reference": round(float(np.mean(scores)), 4),
                               "ssim_min": round(float(np.min(scores)), 4), "per_prompt": [round(s, 4) for s in scores],
                               "all_four": all_four,
                               "mean_s": round(float(np.mean(secs)), 3), "prompts": prompts})
        print(f"{name}: SSIM {np.mean(scores):.4f} (min {np.min(scores):.4f}), all four {all_four}/{len(prompts)}, "
              f"{np.mean(secs):.2f} s", flush=True)
    print(table(doc["results"], ["config", "ssim_vs_reference", "ssim_min", "all_four", "mean_s"]))
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
