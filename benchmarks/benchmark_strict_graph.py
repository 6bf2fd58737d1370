"""Strict forwards with and without CUDA graphs against Diffusers, interleaved in one process (h3lab/execution/graphs.py).

Models: Diffusers' `MiniMaxH3Transformer3DModel` with seeded random weights and `H3Transformer` sharing the same
parameter tensors (benchmark_forward.py), all 50 blocks, batch 1, t2va at 512x512x22f (2,066 rows) and 864x480x56f
(7,272 rows) by default. Impls:
  diffusers            the Diffusers forward (the baseline of every ratio);
  h3lab-strict         the eager strict forward (`graphs.use_graphs("strict", False)`): strict without graphs;
  h3lab-strict-graph   the strict forward as shipped (graphs on): the first call runs eager, the second captures
                       (`capture_call_s`), every timed call must be a replay.
Per shape: one warm-up of each impl (two for the graph: eager, then capture), then `--runs` rounds of the three in
turn, each call timed alone (synchronised before and after), median seconds, ratio to Diffusers and TFLOP/s of the
model's matmul FLOPs. Checks, each a failure of the graph row when false (the script exits 1 after writing the JSON):
- every timed graph call was a replay (`graph_path`; an "eager" path carries its reason);
- the graph's output bytes equal the eager strict forward's on the same inputs (`bytes_equal_strict_eager`), and on
  fresh inputs of the same layout (another seed: the float inputs are copied into the graph's buffers):
  `bytes_equal_strict_eager_fresh_inputs`;
- at 512x512x22f (seed 7) the eager strict bytes equal the committed hash (`benchmark_every_length.COMMITTED`)
  (`equal_committed`).
`--tiny` runs it all on H3Config.tiny() on the CPU (strict through Triton's interpreter) as a smoke test of the script:
there the graph impl is eager ("inputs not on a CUDA device"), which the dry run records and does not fail on.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from _common import header, peak_mem_gib, prepare, sync, write
from benchmark_every_length import COMMITTED, matmul_flops
from benchmark_forward import build_diffusers, build_h3lab_shared, make_inputs, output_sha256

IMPLS = ("diffusers", "h3lab-strict", "h3lab-strict-graph")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="512x512x22f,864x480x56f")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on H3Config.tiny()")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs {args.runs}: must be at least 1")
    device = prepare(ap, cpu=args.tiny, flag="--tiny")
    from h3lab.execution import graphs, runtime
    from h3lab.config import H3Config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    shapes = ["tiny-64x64x22f"] if args.tiny else args.shapes.split(",")
    doc = header("strict_graph" if not args.tiny else "strict_graph_tiny_smoke", __file__, argv, device,
                 config={"num_layers": config.num_layers, "hidden_size": config.hidden_size,
                         "heads": config.num_attention_heads, "ffn_dim": config.ffn_dim},
                 weights="random (seeded), shared storage between Diffusers and h3lab", failures=[])
    t0 = time.time()
    dm = build_diffusers(config, device, seed=1234)
    hm = build_h3lab_shared(config, dm, device)
    sync(device)
    doc["build_s"] = time.time() - t0
    print(f"built in {doc['build_s']:.1f}s", flush=True)

    def strict(inputs, on: bool):
        with runtime.use_mode("strict"), torch.no_grad(), graphs.use_graphs("strict", on):
            out = hm(**inputs)
        return out, graphs.last_path("strict")

    def dif(inputs):
        with torch.no_grad():
            return dm(**inputs, return_dict=False)

    def fail(entry: dict, what: str) -> None:
        entry.setdefault("failures", []).append(what)
        doc["failures"].append(f"{entry['shape']} {entry['impl']}: {what}")
        print(f"FAIL {entry['shape']} {entry['impl']}: {what}", flush=True)

    def timed(fn):
        sync(device)
        start = time.perf_counter()
        out = fn()
        sync(device)
        return out, time.perf_counter() - start

    for shape in shapes:
        layout, inputs = make_inputs(config, shape, 1, device, seed=7)
        rows = layout.sequence_length
        fns = {"diffusers": lambda: (dif(inputs), None),
               "h3lab-strict": lambda: strict(inputs, False),
               "h3lab-strict-graph": lambda: strict(inputs, True)}
        graphs.CACHES["strict"].clear()  # one shape's graph at a time (its memory pool goes with it)
        outs, warm, first, capture = {}, {}, {}, {}
        for impl, fn in fns.items():  # warm-up: compilation; the graph's first call is its eager warm-up
            (outs[impl], first[impl]), warm[impl] = timed(fn)
        first_path = first["h3lab-strict-graph"]
        (outs["h3lab-strict-graph"], capture["path"]), capture["s"] = timed(fns["h3lab-strict-graph"])
        times, paths, peaks = {i: [] for i in fns}, [], {}
        for _ in range(args.runs):
            for impl, fn in fns.items():
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                (out, path), t = timed(fn)
                times[impl].append(t)
                peaks[impl] = max(peaks.get(impl, 0.0), peak_mem_gib(device))
                outs[impl] = out
                if impl == "h3lab-strict-graph":
                    paths.append(path)
        trace = runtime.last_trace()  # the last graph call's: the captured forward's trace, graph = the replay
        eager, graph = outs["h3lab-strict"], outs["h3lab-strict-graph"]
        _, fresh = make_inputs(config, shape, 1, device, seed=8)  # another request, the same layout
        fresh_graph, fresh_path = strict(fresh, True)
        fresh_eager, _ = strict(fresh, False)
        flops = matmul_flops(config, rows, config.num_layers)
        base = statistics.median(times["diffusers"])
        for impl in fns:
            med = statistics.median(times[impl])
            v, a = outs[impl]
            entry = {"shape": shape, "rows": rows, "impl": impl, "layers": config.num_layers, "batch": 1,
                     "timing": "interleaved", "whole_model": True, "median_s": med, "times_s": times[impl],
                     "runs": len(times[impl]), "warmup_s": warm[impl], "peak_mem_gib": peaks[impl],
                     "tflops": flops / med / 1e12, "output_sha256": output_sha256(v, a)}
            if impl != "diffusers":
                entry["ratio_vs_diffusers"] = med / base
                entry["speedup_vs_diffusers"] = base / med
            if impl == "h3lab-strict" and shape == "512x512x22f" and not args.tiny:
                entry["equal_committed"] = entry["output_sha256"] == COMMITTED["h3lab-strict"]
                if not entry["equal_committed"]:
                    fail(entry, f"eager strict sha {entry['output_sha256'][:16]} != committed")
            if impl == "h3lab-strict-graph":
                entry.update(first_call_path=first_path, capture_call_s=capture["s"], capture_path=capture["path"],
                             graph_path=paths[-1], replays=sum(p.get("cuda_graph") == "replay" for p in paths),
                             ratio_vs_strict_eager=med / statistics.median(times["h3lab-strict"]),
                             bytes_equal_strict_eager=bool(torch.equal(v, eager[0]) and torch.equal(a, eager[1])),
                             bytes_equal_strict_eager_fresh_inputs=bool(
                                 torch.equal(fresh_graph[0], fresh_eager[0]) and torch.equal(fresh_graph[1], fresh_eager[1])),
                             fresh_inputs_path=fresh_path, trace_graph=trace.graph if trace is not None else None,
                             trace_fallbacks=len(trace.fallbacks) if trace is not None else None)
                if not entry["bytes_equal_strict_eager"]:
                    fail(entry, "graph output bytes differ from the eager strict forward's")
                if not entry["bytes_equal_strict_eager_fresh_inputs"]:
                    fail(entry, "graph output bytes on fresh inputs differ from the eager strict forward's")
                if device == "cuda":
                    if capture["path"].get("cuda_graph") != "captured":
                        fail(entry, f"second call was not a capture: {capture['path']}")
                    bad = [p for p in paths + [fresh_path] if p.get("cuda_graph") != "replay"]
                    if bad:
                        fail(entry, f"timed calls not replays: {bad[0]}")
                    if trace is None or trace.graph is None or trace.graph.get("cuda_graph") != "replay":
                        fail(entry, f"the trace does not say replay: {trace.graph if trace else None}")
            doc["results"].append(entry)
            print(f"{shape} rows={rows} {impl}: {med:.4f}s {entry['tflops']:.0f} TFLOP/s"
                  + (f" x{entry['ratio_vs_diffusers']:.3f} of diffusers" if "ratio_vs_diffusers" in entry else "")
                  + (f" bytes_equal={entry['bytes_equal_strict_eager']} path={entry['graph_path']}"
                     if impl == "h3lab-strict-graph" else ""), flush=True)
        write(args.out, doc)
        del outs, eager, graph, fresh, fresh_graph, fresh_eager
    graphs.CACHES["strict"].clear()
    write(args.out, doc)
    if doc["failures"]:
        print(f"{len(doc['failures'])} failure(s): {doc['failures']}", flush=True)
        sys.exit(1)
    return doc


if __name__ == "__main__":
    main()
