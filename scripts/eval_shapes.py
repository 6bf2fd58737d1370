"""Measure the embedded default on prompts it never saw: what the decoded clips show and sound like.

    python scripts/eval_shapes.py [--snapshot DIR] [--seeds 42 43] [--steps 20] [--out benchmarks/results/shapes_eval.json]
                                  [--strip docs/screenshots/shapes_demo_strip.png] [--device cpu]

- Held-out set: the 12 (colour, shape, direction) triples of `h3lab.shapes.held_out_combos()`, whose prompts never
  appear in training, each generated (t2va, 64x64, 22 frames, `--steps` passes, mode off, on the CPU) under every
  `--seeds` seed. Each decoded clip is measured (`h3lab.shapes.measure`) and compared with its prompt
  (`matches`): colour, direction, tone, pan; a clip matches when all four hold. Reported: per-attribute and
  all-four fractions, and every clip's measurement.
- FL2VA: for each of the first `--fl2va` held-out triples, a fresh rendered clip (seed 1000) gives its first and last frames as anchors;
  the generated clip's first and last decoded frames are compared with them (PSNR in dB over uint8 RGB).
- `--strip`: a frame strip (frames 0, 5, 10, 16, 21 side by side, 3x nearest upscale) of `make demo`'s clip (the
  held-out "a blue square moves right, a middle tone", seed 42; docs/embedded-default.md shows it).
- Output JSON in the benchmarks schema (name, date, gpu, torch, triton, git_rev, command, results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from h3lab.shapes import READS, ClipSpec, held_out_combos, matches, measure, prompt, training_combos  # noqa: E402
from h3lab.shapes.clips import first_last  # noqa: E402
from h3lab.io_utils import atomic_write  # noqa: E402

GEN = dict(width=64, height=64, frames=22, mode="off")
STRIP_FRAMES = (0, 5, 10, 16, 21)
DEMO = (ClipSpec("blue", "square", "right"), 42)  # `make demo`'s prompt and seed: the strip's clip


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def strip(frames: np.ndarray, scale: int = 3) -> np.ndarray:
    tiles = [np.kron(frames[k], np.ones((scale, scale, 1), np.uint8)) for k in STRIP_FRAMES]
    gap = np.full((tiles[0].shape[0], 4, 3), 255, np.uint8)
    return np.concatenate([x for t in tiles for x in (t, gap)][:-1], axis=1)


def clip_row(session, split: str, combo: tuple[str, str, str], seed: int, steps: int, mode: str = "off") -> dict:
    """One clip of the protocol: the triple's prompt generated (t2va, `GEN`'s canvas) under `seed`, measured and
    compared with the prompt; its row (prompt, seed, split, per-attribute match, all four, measurement, seconds)."""
    colour, shape, direction = combo
    spec = ClipSpec(colour, shape, direction)
    t = time.time()
    res = session.generate(prompt(spec), seed=seed, steps=steps, **{**GEN, "mode": mode})
    m = measure(res.frames, res.audio.numpy(), res.sample_rate)
    ok = matches(m, colour, shape, direction)
    return {"prompt": prompt(spec), "seed": seed, "task": "t2va", "split": split, "match": ok, "all": all(ok.values()),
            "measured": m.to_dict(), "seconds": round(time.time() - t, 2)}


def fractions(rows: list[dict], prefix: str = "") -> dict:
    """{prefix + "fraction_<attribute>" / "fraction_all_four": share of `rows` that match}, {} for no rows."""
    if not rows:
        return {}
    out = {f"{prefix}fraction_{k}": round(sum(r["match"][k] for r in rows) / len(rows), 4) for k in READS}
    return {f"{prefix}runs": len(rows), f"{prefix}fraction_all_four": round(sum(r["all"] for r in rows) / len(rows), 4),
            **out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--snapshot", default=None, help="snapshot (default: the embedded default)")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fl2va", type=int, default=12, help="how many held-out triples also run as fl2va")
    p.add_argument("--training", type=int, default=0,
                   help="also run this many training triples (spread over the list, first seed): fitting vs generalising")
    p.add_argument("--device", default="cpu", help="where the session runs (the shipped numbers: cpu)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "shapes_eval.json"))
    p.add_argument("--strip", default=str(ROOT / "docs" / "screenshots" / "shapes_demo_strip.png"))
    args = p.parse_args(argv)

    import torch
    import triton
    from PIL import Image

    from h3lab import Session

    torch.set_num_threads(2)
    session = Session(args.snapshot, device=args.device)
    rows, t0 = [], time.time()
    train = training_combos()
    picks = [train[k] for k in np.linspace(0, len(train) - 1, args.training).round().astype(int)] if args.training else []
    jobs = [("held_out", combo, seed) for combo in held_out_combos() for seed in args.seeds]
    jobs += [("training", combo, args.seeds[0]) for combo in picks]
    for split, combo, seed in jobs:
        rows.append(clip_row(session, split, combo, seed, args.steps))
        m = rows[-1]["measured"]
        print(f"[{split}] {rows[-1]['prompt']!r} seed {seed}: {rows[-1]['match']} {m['colour']} {m['direction']} "
              f"{m['tone']} {m['pan_direction']}", flush=True)
    if args.strip:
        res = session.generate(prompt(DEMO[0]), seed=DEMO[1], steps=args.steps, **GEN)
        atomic_write(args.strip, lambda tmp: Image.fromarray(strip(res.frames)).save(tmp, format="PNG"))
    fl = []
    with tempfile.TemporaryDirectory() as tmp:
        for (colour, shape, direction) in held_out_combos()[:args.fl2va]:
            spec = ClipSpec(colour, shape, direction, seed=1000)
            first, last = first_last(spec)
            fp, lp = Path(tmp) / "first.png", Path(tmp) / "last.png"
            Image.fromarray(first).save(fp)
            Image.fromarray(last).save(lp)
            res = session.generate(prompt(spec), seed=args.seeds[0], steps=args.steps, first=str(fp), last=str(lp),
                                   **GEN)
            fl.append({"prompt": prompt(spec), "task": "fl2va", "psnr_first_db": round(psnr(res.frames[0], first), 2),
                       "psnr_last_db": round(psnr(res.frames[-1], last), 2),
                       "psnr_first_vs_background_db": round(psnr(np.full_like(first, 24), first), 2)})
            print(fl[-1], flush=True)
    held = [r for r in rows if r["split"] == "held_out"]
    summary = {
        "shape": "64x64x22f", "impl": "h3lab-off", "held_out_prompts": len(held_out_combos()),
        "seeds": args.seeds, "steps": args.steps, **fractions(held, ""),
        **fractions([r for r in rows if r["split"] == "training"], "training_"),
        "fl2va_psnr_first_db_mean": round(float(np.mean([r["psnr_first_db"] for r in fl])), 2),
        "fl2va_psnr_last_db_mean": round(float(np.mean([r["psnr_last_db"] for r in fl])), 2),
        "median_s": round(float(np.median([r["seconds"] for r in rows])), 2), "peak_mem_gib": None,
    }
    try:
        rev = os.environ.get("H3LAB_GIT_REV") or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = "unknown"
    report = {
        "name": "shapes_eval", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "none (CPU)",
        "torch": torch.__version__, "triton": triton.__version__, "git_rev": rev,
        "command": " ".join(["python", *sys.argv]), "snapshot": str(session.store.path) if hasattr(session, "store")
        else None, "results": [summary], "clips": rows, "fl2va": fl, "seconds": round(time.time() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
