"""Streamed residency on one GPU: the full-size DiT resident, streamed (every block through two GPU slots) and under a
40 GiB budget, with byte-equality of the outputs against resident.

One full-size `H3Transformer` with seeded random weights (no weights can be downloaded) is built on the GPU; for
each placement, applied to that one model in place (`h3lab.components.streaming.stream_blocks`), and each shape
(t2va layouts of `benchmark_forward.SHAPES`: 512x512x22f = 2,066 rows, 864x480x56f = 7,272 rows):

- after one warm-up, `--repeats` groups of `--runs` back-to-back forwards in `off` mode (as a denoise loop issues
  them: nothing synchronises between forwards), CUDA events around each group, the median seconds per forward, and,
  when streamed, the streamer's statistics per forward: bytes moved, copy seconds and throughput, the copy wait the
  compute stream was exposed to, hidden fraction = 1 - exposed / copy time, on-demand copies;
- the DiT's tensors on the GPU as planned (`dit_gpu_gib`: outside the blocks + resident blocks + slots) and the peak
  allocated memory over the forwards (`peak_mem_gib`, activations and inputs included);
- the copy floor: the bytes one forward moves / 55 GB/s (pinned host -> GPU, `results/copy_overlap.json`), and
  `time_vs_floor` = median time / floor (target <= 1.1 streamed); `ratio_vs_resident` (target <= 1.15 at 40 GiB);
- byte-equality of the velocities with the resident forward: `off` always, `strict` unless `--no-strict` (one
  forward per shape and placement; strict kernels compile on first use).

Placements: `resident`, `streamed` (all 52 blocks: 2 refiner + 50), `budget` (`--budget-gib` / `--gpu-memory`,
default 40). `--adaln tables`: every placement with the AdaLN weights in pinned host memory and only the tables on the
GPU (computed once per shape, before the forwards, as a run computes its passes'); the blocks stream without their
AdaLN weights (39% fewer bytes) and `dit_gpu_gib` counts the tables.
Expected on an H200: ~2-3 minutes (model build ~15 s, strict compile ~1 min, ~30 streamed forwards of ~1.2 s).

Run: python3 benchmarks/benchmark_streaming.py --out $OUT/streaming.json        (CPU smoke: --tiny)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from _common import ROOT, add_gpu_memory, header, materialise, prepare, write

COPY_GBPS = 55.0  # pinned host -> GPU on the H200 (benchmarks/results/copy_overlap.json, pinned_reused)


def copy_gbps() -> float:
    """The measured pinned copy bandwidth from copy_overlap.json, else COPY_GBPS."""
    path = ROOT / "benchmarks" / "results" / "copy_overlap.json"
    try:
        doc = json.loads(path.read_text())
        return next(float(r["copy_alone_gbps"]) for r in doc["results"] if r.get("impl") == "pinned_reused")
    except (OSError, ValueError, KeyError, StopIteration):
        return COPY_GBPS


def build_model(config, device, seed: int):
    """A full-size DiT on `device` in the released dtypes with seeded random weights (built on the meta device,
    materialised once: no float32 copy of the model ever exists)."""
    from benchmark_forward import init_random_

    from h3lab import H3Transformer

    with torch.device("meta"):
        model = H3Transformer(config)
    model = materialise(model, device)
    model.reset_buffers(device)
    init_random_(model, seed)
    model.fingerprint = f"random-seed{seed}"  # no weights digest needed: the bytes never change in this run
    return model.eval().requires_grad_(False)


def forward(model, inputs, mode: str):
    from h3lab.execution import runtime

    with runtime.use_mode(mode), torch.no_grad():
        return model(**inputs)


def measure(model, inputs, runs: int, repeats: int, device: str) -> dict:
    """One warm-up, then `repeats` groups of `runs` back-to-back forwards (off), as a denoise loop issues them (no
    synchronisation in between: the next forward's first block is copied during the last block of this one). Per
    group: seconds per forward (CUDA events around the group) and the streamer's statistics per forward."""
    from h3lab.components import streaming

    streamer = streaming.streamer_of(model)
    forward(model, inputs, "off")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, stats = [], []
    out = None
    for _ in range(repeats):
        if streamer is not None:
            streamer.begin_run()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(runs):
                out = forward(model, inputs, "off")
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / runs)
        else:
            t0 = time.perf_counter()
            for _ in range(runs):
                out = forward(model, inputs, "off")
            times.append((time.perf_counter() - t0) / runs)
        if streamer is not None:
            d = streamer.end_run().to_dict()
            stats.append({k: d[k] / runs for k in ("bytes_moved", "copies", "uses", "copy_seconds", "exposed_seconds")}
                         | {"hidden_fraction": d["hidden_fraction"], "on_demand": d["on_demand"]})
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    return {"times": times, "stats": stats, "peak": peak, "out": out}


def equal(a, b) -> bool:
    return all(bool(torch.equal(x, y)) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="512x512x22f,864x480x56f")
    ap.add_argument("--runs", type=int, default=2, help="back-to-back forwards per timed group")
    ap.add_argument("--repeats", type=int, default=3, help="timed groups per shape and placement (median)")
    ap.add_argument("--budget-gib", "--gpu-memory", dest="budget_gib", type=float, default=40.0,
                    help="GPU budget (GiB) of the `budget` placement")
    ap.add_argument("--adaln", choices=("resident", "tables"), default="resident",
                    help="tables: the AdaLN weights in pinned host memory, each shape's tables computed once ahead "
                         "(h3lab.components.adaln_host); the blocks stream without them")
    ap.add_argument("--no-strict", action="store_true", help="skip the strict byte-equality forwards")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on H3Config.tiny()")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")
    from benchmark_forward import make_inputs

    from h3lab.components import streaming
    from h3lab.config import H3Config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    shapes = ["tiny-64x64x22f"] if args.tiny else args.shapes.split(",")
    modes = ("off",) if args.no_strict else ("off", "strict")
    gbps = copy_gbps()

    t0 = time.time()
    model = build_model(config, device, seed=1234)
    print(f"built the DiT ({sum(p.numel() for p in model.parameters()) / 1e9:.3f} B params) in "
          f"{time.time() - t0:.1f} s", flush=True)
    inputs = {shape: make_inputs(config, shape, 1, device, seed=7) for shape in shapes}
    rows = 0
    if args.adaln == "tables":  # as a run does: the tables of its passes computed once, before the forwards
        from h3lab.components import adaln_host
        from h3lab.model.adaln_tables import tables_of

        adaln_host.keep_on_host(model, device)
        tables = tables_of(model)
        tables.prepare([inp["timestep"] for _, inp in inputs.values()])
        rows = tables.stats.rows
    budget = args.budget_gib
    if args.tiny:  # the tiny DiT fits any budget in GiB: one block more than the streamed minimum, to mix
        least = streaming.plan_for_model(model, adaln=args.adaln, table_rows=streaming.PLANNED_TABLE_ROWS)
        budget = (least.device_bytes + least.slot_bytes) / 2**30

    results, reference, conversions = [], {}, []
    for placement in ("resident", "streamed", "budget"):
        if placement != "resident":
            t1 = time.time()
            streaming.stream_blocks(model, device, gpu_memory_gib=budget if placement == "budget" else None)
            if device == "cuda":
                torch.cuda.synchronize()
            conversions.append({"to": placement, "seconds": time.time() - t1})
        plan = streaming.streamer_of(model).plan if placement != "resident" else None
        dit = plan or streaming.plan_for_model(model, adaln=args.adaln, table_rows=rows, streamed=False)
        for shape in shapes:
            layout, inp = inputs[shape]
            m = measure(model, inp, args.runs, args.repeats, device)
            med = statistics.median(m["times"])
            entry = {"shape": shape, "rows": layout.sequence_length, "impl": "h3lab-off", "residency": placement,
                     "adaln": args.adaln, "median_s": med, "runs": len(m["times"]), "times_s": m["times"],
                     "peak_mem_gib": m["peak"], "dit_gpu_gib": dit.device_bytes / 2**30}
            if placement == "resident":
                reference[shape] = {"off": m["out"], "time": med}
            else:
                entry["bytes_equal_resident"] = equal(m["out"], reference[shape]["off"])
                entry["ratio_vs_resident"] = med / reference[shape]["time"]
                per = m["stats"]
                moved = statistics.median(s["bytes_moved"] for s in per)
                copy_s = statistics.median(s["copy_seconds"] for s in per)
                floor = moved / (gbps * 1e9)
                entry.update({
                    "streamed_blocks": len(plan.streamed), "resident_blocks": len(plan.resident),
                    "slots": plan.slots, "bytes_per_forward": moved, "copy_s": copy_s,
                    "copy_gbps": moved / copy_s / 1e9 if copy_s else None,
                    "exposed_s": statistics.median(s["exposed_seconds"] for s in per),
                    "hidden_fraction": statistics.median(s["hidden_fraction"] for s in per),
                    "on_demand": [s["on_demand"] for s in per], "copy_floor_s": floor, "copy_floor_gbps": gbps,
                    "time_vs_floor": med / floor if floor else None,
                    "time_vs_measured_copy": med / copy_s if copy_s else None,
                })
            for mode in modes[1:]:
                out = forward(model, inp, mode)
                if placement == "resident":
                    reference[shape][mode] = out
                else:
                    entry[f"{mode}_bytes_equal_resident"] = equal(out, reference[shape][mode])
            results.append(entry)
            print(f"{shape} {placement}: median {med * 1e3:.1f} ms, DiT on GPU {entry['dit_gpu_gib']:.2f} GiB, "
                  f"peak {entry['peak_mem_gib']:.2f} GiB"
                  + (f", x{entry['ratio_vs_resident']:.2f} resident, x{entry['time_vs_floor']:.2f} floor, hidden "
                     f"{entry['hidden_fraction']:.2f}, equal {entry['bytes_equal_resident']}"
                     if placement != "resident" else ""), flush=True)

    doc = header("streaming" if not args.tiny else "streaming_tiny_smoke", __file__, argv, device,
                 config={"num_layers": config.num_layers, "hidden_size": config.hidden_size},
                 weights="random (seeded); one model, re-placed in place", budget_gib=budget,
                 conversions=conversions, copy_floor_gbps=gbps)
    doc["results"] = results
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
