"""A block map of the embedded default: knock out (or scale) each transformer block in turn and measure what the
decoded clips lose on the held-out prompts, plus the attention view of one held-out prompt at every block.

    python scripts/block_map.py [--snapshot DIR] [--seeds 42 43 44] [--steps 20] [--scale 0]
                                [--out benchmarks/results/block_map.json] [--figure docs/screenshots/block_map.png]
                                [--attention docs/screenshots/block_map_attention.png]
                                [--view docs/screenshots/attention_view.png]

- Configurations: the baseline, then each block b knocked out (`h3lab.research.views.knockout.knocked_out`: block b's output
  replaced by its input; with `--scale s` its residual contribution scaled by s instead). Each runs the 12 held-out
  prompts of `h3lab.shapes.held_out_combos()` under every `--seeds` seed (t2va, 64x64, 22 frames, mode off, the CPU;
  the settings of scripts/eval_shapes.py), each decoded clip measured (`h3lab.shapes.measure`) and compared with its
  prompt (`matches`): per configuration the fraction of runs whose clip still says each attribute (colour,
  direction, tone, pan) and all four, and the loss against the baseline.
- Attention: the held-out "a blue square moves right, a middle tone" (seed 42) once, then `Session.attention` at
  every block with the text rows as queries (last pass, all heads): each view's wall time (the re-run up to that
  pass plus the probe) and the probe's own time, and the three video frames each word attends to most.
- Output: JSON in the benchmarks schema (name, date, gpu, torch, triton, git_rev, command, results: one row per
  configuration), the block map figure (`plots.block_map_figure`), text -> video frames per block
  (`plots.attention_blocks`) and the full view of the last block (`plots.attention_figure`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "scripts")]

from _common import header, write  # noqa: E402
from eval_shapes import ATTRIBUTE_READS, GEN, _fractions  # noqa: E402

from h3lab.shapes import ClipSpec, held_out_combos, matches, measure, prompt  # noqa: E402

DEMO = (ClipSpec("blue", "square", "right"), 42)
COLUMNS = ATTRIBUTE_READS + ("all four",)


def run_config(session, model, block, scale, seeds, steps) -> tuple[list[dict], list[float]]:
    """Every held-out prompt under every seed with `block` knocked out (None: the baseline)."""
    from h3lab.research.views.knockout import knocked_out

    rows, seconds = [], []
    held = knocked_out(model, [block], scale) if block is not None else contextlib.nullcontext()
    with held:
        for colour, shape, direction in held_out_combos():
            spec = ClipSpec(colour, shape, direction)
            for seed in seeds:
                t = time.perf_counter()
                res = session.generate(prompt(spec), seed=seed, steps=steps, **GEN)
                seconds.append(time.perf_counter() - t)
                ok = matches(measure(res.frames, res.audio.numpy(), res.sample_rate), colour, shape, direction)
                rows.append({"prompt": prompt(spec), "seed": seed, "match": ok, "all": all(ok.values())})
    return rows, seconds


def attention_views(session, steps: int) -> tuple[list, list[dict], int]:
    res = session.generate(prompt(DEMO[0]), seed=DEMO[1], steps=steps, **GEN)
    views, notes = [], []
    for block in range(session.transformer().config.num_layers):
        t = time.perf_counter()
        view = session.attention(res, block, query="text")
        wall = time.perf_counter() - t
        frames = view.keys("video")
        top = {}
        for g, label in enumerate(view.query_labels):
            w = view.mean_heads()[g, frames]
            top[label.split(":", 1)[1]] = [view.key_labels[frames[j]] for j in w.argsort(descending=True)[:3].tolist()]
        views.append(view)
        notes.append({"block": block, "pass": view.step, "heads": len(view.heads), "query_rows": int(view.rows.sum()),
                      "keys": view.cost["keys"], "view_seconds": round(wall, 3),
                      "probe_seconds": round(view.cost["seconds"], 4), "top_frames_per_word": top})
        print(f"attention block {block}: {wall:.2f} s (probe {view.cost['seconds'] * 1e3:.1f} ms)", flush=True)
    return views, notes, res.layout.sequence_length


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--snapshot", default=None, help="snapshot (default: the embedded default)")
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--scale", type=float, default=0.0, help="0: knock each block out; else scale its contribution")
    p.add_argument("--blocks", type=int, nargs="+", default=None, help="blocks to map (default: every block)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "block_map.json"))
    p.add_argument("--figure", default=str(ROOT / "docs" / "screenshots" / "block_map.png"))
    p.add_argument("--attention", default=str(ROOT / "docs" / "screenshots" / "block_map_attention.png"))
    p.add_argument("--view", default=str(ROOT / "docs" / "screenshots" / "attention_view.png"))
    args = p.parse_args(argv)

    import torch

    from h3lab import Session
    from h3lab.research import plots

    torch.set_num_threads(2)
    session = Session(args.snapshot, device="cpu")
    model = session.transformer()
    blocks = args.blocks if args.blocks is not None else list(range(model.config.num_layers))
    doc = header("block_map", __file__, argv, "cpu", snapshot=session.model_name, held_out_prompts=12,
                 seeds=args.seeds, steps=args.steps, scale=args.scale)
    doc["command"] = " ".join(["python", "scripts/block_map.py", *(sys.argv[1:] if argv is None else argv)])
    base = None
    for block in [None] + blocks:
        clips, seconds = run_config(session, model, block, args.scale, args.seeds, args.steps)
        fractions = _fractions(clips, "")
        row = {"shape": "64x64x22f", "rows": None, "impl": "h3lab-off", "knocked_out": block, "scale": args.scale,
               "median_s": round(statistics.median(seconds), 3), "runs": len(clips), "peak_mem_gib": None,
               **fractions}
        base = base or row
        row.update({f"loss_{k}": round(base[f"fraction_{k}"] - row[f"fraction_{k}"], 4)
                    for k in ATTRIBUTE_READS + ("all_four",)})
        doc["results"].append(row)
        print(f"{'baseline' if block is None else f'block {block} out'}: "
              + ", ".join(f"{k} {row[f'fraction_{k}']:.3f}" for k in ATTRIBUTE_READS + ("all_four",)), flush=True)
    views, notes, rows = attention_views(session, args.steps)
    for r in doc["results"]:
        r["rows"] = rows
    doc["attention"] = {"prompt": prompt(DEMO[0]), "seed": DEMO[1], "query": "text", "views": notes,
                        "view_seconds_median": statistics.median(n["view_seconds"] for n in notes),
                        "probe_seconds_median": statistics.median(n["probe_seconds"] for n in notes)}
    figure_rows = [{"label": "baseline" if r["knocked_out"] is None else
                    f"block {r['knocked_out']} {'out' if args.scale == 0 else f'x{args.scale:g}'}",
                    "fractions": {c: r[f"fraction_{c.replace(' ', '_')}"] for c in COLUMNS}}
                   for r in doc["results"]]
    title = (f"h3-shapes held-out prompts x seeds {','.join(map(str, args.seeds))}: what each block carries "
             f"({doc['results'][0]['runs']} runs per row)")
    if args.figure:
        plots.save(plots.block_map_figure(figure_rows, COLUMNS, title), args.figure)
    if args.attention:
        plots.save(plots.attention_blocks(views, f"text -> video frames, {prompt(DEMO[0])!r}, seed {DEMO[1]}, "
                                                 f"pass {views[0].step + 1}"), args.attention)
    if args.view:
        plots.save(plots.attention_figure(session.attention(None, len(views) - 1)), args.view)
    write(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
