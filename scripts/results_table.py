"""The README's table of headline measurements, generated from the result files in `benchmarks/results/`.

    python scripts/results_table.py            # rewrite README.md's block between the results markers
    python scripts/results_table.py --check    # exit 1 (and say so) when the README's block is not the table

Each row reads one named JSON file (the schema of docs/DESIGN.md, "Evidence") and says which file and revision it
came from, so the README's numbers and the files cannot drift apart: `tests/foundation/test_results_table.py` asserts
that the README's block is exactly `render()`. A row whose file or key is missing raises naming it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
HEADER = ("| measured (H200 unless stated; random full-size weights on the GPU) | h3lab | baseline | source |\n"
          "|---|---|---|---|")


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))


def source(name: str, doc: dict) -> str:
    """`file`, rev: the file and the revision its run measured (the first word of `git_rev`, 7 characters)."""
    return f"`{name}`, rev {str(doc['git_rev']).split()[0][:7]}"


def one(rows: list[dict], **match) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise KeyError(f"{len(found)} result rows match {match}")
    return found[0]


def forward() -> list[tuple[str, str, str, str]]:
    """One forward at each released length: strict (CUDA graphs where they apply) and fast against Diffusers."""
    name = "forward_every_length.json"
    doc = load(name)
    out = []
    for shape in dict.fromkeys(r["shape"] for r in doc["results"]):
        base = one(doc["results"], shape=shape, impl="diffusers")
        strict = one(doc["results"], shape=shape, impl="h3lab-strict-graph")
        fast = one(doc["results"], shape=shape, impl="h3lab-fast")
        what = f"one forward, {shape.replace('x', '×')} ({base['rows']:,} rows, {base['layers']} blocks)"
        ours = (f"strict {strict['median_s']:.3f} s (**{strict['ratio_vs_diffusers']:.3f}×**); "
                f"fast {fast['median_s']:.3f} s ({fast['speedup_vs_diffusers']:.2f}× faster)")
        out.append((what, ours, f"Diffusers {base['median_s']:.3f} s", source(name, doc)))
    return out


def lora_step() -> list[tuple[str, str, str, str]]:
    name = "lora_step_graph.json"
    doc = load(name)
    strict, off = one(doc["results"], impl="h3lab-strict"), one(doc["results"], impl="h3lab-off")
    what = (f"one strict LoRA training step, {strict['shape'].replace('x', '×')}, rank {doc['lora']['rank']} on "
            f"{doc['lora']['modules']} projections (micro-batch from a CUDA graph)")
    ours = f"{strict['median_s']:.3f} s (**{doc['ratio_strict_over_off']:.3f}×**)"
    return [(what, ours, f"torch (`off`) {off['median_s']:.3f} s", source(name, doc))]


def grpo() -> list[tuple[str, str, str, str]]:
    name = "grpo_50_blocks.json"
    doc = load(name)
    strict, off = one(doc["results"], impl="h3lab-strict"), one(doc["results"], impl="h3lab-off")
    what = (f"GRPO on-policy ratio, {doc['config']['layers']} blocks: (request, pass, modality) items whose "
            "ratio is exactly 1")
    ours = f"strict **{strict['ratio']['exactly_one']} of {strict['ratio']['count']}**"
    spread = off["ratio"]["max_abs"]
    base = f"off {off['ratio']['exactly_one']} of {off['ratio']['count']} (max \\|ratio − 1\\| {spread:.1e})"
    return [(what, ours, base, source(name, doc))]


def streaming() -> list[tuple[str, str, str, str]]:
    name = "streaming.json"
    doc = load(name)
    rows = [r for r in doc["results"] if r["shape"] == "512x512x22f"]
    resident = one(rows, residency="resident")
    streamed = min((r for r in rows if r["residency"] != "resident"), key=lambda r: r["dit_gpu_gib"])
    what = "streamed residency, 512×512×22f forward: DiT weights on the GPU, time (bytes equal resident)"
    ours = (f"{streamed['dit_gpu_gib']:.2f} GiB, {streamed['median_s']:.3f} s "
            f"({streamed['median_s'] / streamed['copy_floor_s']:.2f}× the copy floor)")
    base = f"resident {resident['dit_gpu_gib']:.1f} GiB, {resident['median_s']:.3f} s"
    if not streamed["bytes_equal_resident"]:
        raise ValueError(f"{name}: the streamed row's bytes differ from resident")
    return [(what, ours, base, source(name, doc))]


def shared_device() -> list[tuple[str, str, str, str]]:
    name = "distributed_shared_device_full_depth.json"
    doc = load(name)
    placed = [r for r in doc["results"] if "bytes_equal_tp1" in r]
    equal = sum(r["bytes_equal_tp1"] is True for r in placed)
    shapes = " and ".join(s.replace("x", "×") for s in dict.fromkeys(r["shape"] for r in placed))
    what = f"strict TP / CP / SP forwards at 50 blocks on shared-device ranks (bytes only), {shapes}"
    ours = f"**{equal} of {len(placed)}** topologies byte-equal to one GPU"
    return [(what, ours, "the one-process strict forward", source(name, doc))]


def shapes_eval() -> list[tuple[str, str, str, str]]:
    name = "shapes_eval.json"
    doc = load(name)
    (row,) = doc["results"]
    what = (f"embedded default on a 2-core CPU: decoded clips showing all four prompted attributes, "
            f"{row['held_out_prompts']} held-out prompts × {len(row['seeds'])} seeds")
    ours = f"**{round(row['fraction_all_four'] * row['runs'])} of {row['runs']}** ({row['fraction_all_four']:.1%})"
    base = (f"training prompts {round(row['training_fraction_all_four'] * row['training_runs'])} of "
            f"{row['training_runs']}")
    return [(what, ours, base, source(name, doc))]


def quickstart() -> list[tuple[str, str, str, str]]:
    name = "quickstart_cpu.json"
    doc = load(name)
    demo = next(r for r in doc["results"] if r["impl"].startswith("make demo "))
    strict = next(r for r in doc["results"] if r["impl"].startswith("make demo-strict"))
    what = "`make demo` / `make demo-strict` wall time on a 2-core CPU (64×64, 22 frames)"
    ours = f"{demo['median_s']:.1f} s / {strict['median_s']:.1f} s"
    return [(what, ours, "—", source(name, doc))]


ROWS = (forward, lora_step, grpo, streaming, shared_device, shapes_eval, quickstart)


def render() -> str:
    """The table, between (and including) the markers."""
    lines = [BEGIN, HEADER]
    for build in ROWS:
        lines += ["| " + " | ".join(cells) + " |" for cells in build()]
    return "\n".join(lines + [END])


def readme_block(text: str) -> str:
    """The README's block between (and including) the markers; ValueError when they are missing."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return text[start:end + len(END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the block differs")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    old, new = readme_block(text), render()
    if args.check:
        if old != new:
            print("README.md's results table differs from benchmarks/results/: run python scripts/results_table.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(text.replace(old, new), encoding="utf-8")
    print("README.md: results table " + ("unchanged" if old == new else "rewritten"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
