"""`--mode fast` on the embedded default (h3-shapes), end to end through `Session`: what it makes and what it costs.

    python benchmarks/benchmark_fast_default.py --out benchmarks/results/fast_default.json [--steps 20] [--cpu]

On CUDA: for each prompt (`make demo`'s and two more held-out ones, seed 42, 64x64x22f), an `off` and a `fast`
generation (the real FP8 path: `fast.prepare` at load, FP8 / cuDNN attention, CUDA graphs), then `Session.drift`
between them (what `!drift` prints) and each pass's video / audio latent relative L2 (fast vs off), and what
`h3lab.shapes.measure` reads from each decoded clip (colour, direction, tone, pan against the prompt). `--cpu` runs
the same under `fast.use_emulation()` (the float32 emulation of the quantised products: a smoke run of this script).
"""

from __future__ import annotations

import argparse
import contextlib
import time

from _common import header, prepare, rel_l2, write

PROMPTS = (("blue", "square", "right"), ("red", "circle", "left"), ("yellow", "triangle", "down"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cpu", action="store_true", help="CPU smoke run under fast.use_emulation()")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.cpu, flag="--cpu")
    from h3lab import Session
    from h3lab.execution import fast, whatran
    from h3lab.shapes import ClipSpec, matches, measure, prompt

    request = dict(width=64, height=64, frames=22, steps=args.steps, seed=42)
    doc = header("fast_default", __file__, argv, device, snapshot="embedded default (h3-shapes)", request=request)
    session = Session(None, device=device)
    session.keep = ("latents",)
    context = fast.use_emulation() if device == "cpu" else contextlib.nullcontext()
    with context:
        for colour, shape, direction in PROMPTS:
            text = prompt(ClipSpec(colour, shape, direction))
            row: dict = {"prompt": text}
            results = {}
            for mode in ("off", "fast"):
                start = time.perf_counter()
                result = results[mode] = session.generate(text, mode=mode, **request)
                seconds = time.perf_counter() - start
                m = measure(result.frames, result.audio.numpy(), result.sample_rate)
                row[mode] = {"trajectory_hash": result.trajectory_hash, "seconds": seconds,
                             "denoise_s": result.timings.get("denoise"),
                             "what_ran": whatran.what_ran(result.trajectory.manifest["trace"], mode),
                             "match": matches(m, colour, shape, direction), "measured": m.to_dict()}
            row["drift_lines"] = session.drift_lines(results["off"], results["fast"])
            off_kept, fast_kept = results["off"].trajectory.kept, results["fast"].trajectory.kept
            per_pass = []
            for i in range(args.steps):
                entry = {"pass": i}
                for kind in ("video", "audio"):
                    key = f"{kind}.{i:04d}"
                    entry[f"latent_{kind}_rel_l2"] = rel_l2(fast_kept[key], off_kept[key])
                per_pass.append(entry)
            row["per_pass"] = per_pass
            doc["results"].append(row)
            print(text, "| off", row["off"]["match"], "| fast", row["fast"]["match"], "|", row["fast"]["what_ran"])
            print("  ", row["drift_lines"][0])
            print("   last pass latent rel L2 video / audio:",
                  round(per_pass[-1]["latent_video_rel_l2"], 4), round(per_pass[-1]["latent_audio_rel_l2"], 4))
            write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
