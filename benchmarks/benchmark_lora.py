"""One LoRA training step of the full-size H3 DiT, strict against torch (`off`), at 512x512x22f (target: strict
<= 1.3x the torch step).

The released 33B DiT (seeded random bf16 weights, float32 heads as released) gets a rank-64 LoRA through peft
(`h3lab.training.add_lora`, alpha 64) on every attention and FFN projection of the 50 blocks and the 2 refiner blocks
(B factors random, so every factor has a gradient). One step = `compute_gradients` on one t2va clip request (its
sigma/noise drawn from its seed; gradient checkpointing on) + `StrictAdamW.step`, in each mode, the two modes'
calls interleaved: CUDA-event seconds per step (median of `--runs` after one warm-up each), peak memory, and whether
two gradient computations from the same weights give byte-equal LoRA gradients (strict: the contract; torch: reported
as it comes). The ratio strict / off is measured in the same run.

    python benchmarks/benchmark_lora.py --out benchmarks/results/lora.json     # one H200, ~2-3 minutes
    python benchmarks/benchmark_lora.py --tiny --out /tmp/lora.json             # CPU smoke (tiny config)
    python benchmarks/benchmark_lora.py --lean-compare --runtime-profile --out benchmarks/results/lora_lean.json

`--gc default,freeze` times each setting of Python's cyclic garbage collector in turn ("freeze": `gc.freeze()` after
the model is built, so a collection no longer walks the model's objects); every row reports the collector's seconds
per step (`gc.callbacks`) and its collections per generation.

`--lean-compare` times, interleaved in one process on the same weights, with the step graph off
(`step_graph.use_graphs(False)`: the launch path is what it measures), the strict step with the lean launch path
off ("h3lab-strict-triton-launch": every Triton launch through Triton's own `JITFunction.run`, every op validated
twice, `kernels/_launch.enabled(False)`), the strict step with it ("h3lab-strict") and torch ("h3lab-off"); it
reports the SHA-256 of the LoRA gradients of each (Triton's launch and the lean one must be equal), one strict step
run with every lean launch
verified against Triton's own lookup, the launcher's hits/misses per step, and with `--runtime-profile` each one's
launches, syncs and GPU busy/idle time.

`--step-graph` times, interleaved in one process on the same weights, the strict step with its
micro-batch eager ("h3lab-strict-eager": `step_graph.use_graphs(False)`, every kernel launched from Python), the
strict step as shipped ("h3lab-strict": the micro-batch replayed from a CUDA graph, `h3lab.training.step_graph`) and
torch ("h3lab-off"). Before timing it checks the bytes: the LoRA gradients' SHA-256 of `--check-steps` steps
(gradient, then a StrictAdamW update) taken eagerly and again, from the same factors restored in place, through the
graph (warm-up, capture, replays), step by step; how each graph step ran and the wall seconds of each checked step
(the capture's cost). With `--runtime-profile`, each one's launches, runtime calls, GPU busy and idle time.

`--gpu-memory GiB` trains under a budget for the frozen weights (`h3lab.components.streaming`: the blocks that fit
stay resident, the rest stream through two slots in the forward and in the backward's recomputation; the factors and
the optimiser state stay on the GPU). First, at `--compare-layers` blocks (a depth that fits resident), the strict
step resident and then the same model streamed under `--compare-gpu-memory`: the LoRA gradients' SHA-256 of each
(byte-equal is the contract), seconds per step of each (the ratio is streaming's cost at that depth), the peaks.
Then the full model streamed under `--gpu-memory` at each of `--budget-shapes`: seconds per strict step, the peak,
the plan (resident / streamed blocks, bytes moved per step) and the gradients' repeat.

    python benchmarks/benchmark_lora.py --gpu-memory 44 --compare-layers 16 --compare-gpu-memory 12 \
        --budget-shapes 512x512x22f,864x480x56f --out benchmarks/results/lora_gpu_memory.json    # one H100

`--fp32-variants` times the strict step under other float32 GEMM settings in turn (`kernels/gemm.py`, see
`fp32_variant`: "contract" as shipped, "fma64" the FMA 64x64x32 tiles without the narrow rule); the first listed is
reported as `ratio_strict_over_off`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import dataclasses
import statistics
import time
from pathlib import Path

import torch
from _common import header, kernel_profile, materialise, prepare, runtime_profile, sync, table, timed_interleaved, write

from benchmark_forward import SHAPES, init_random_  # noqa: E402 - the shapes and weight law of the forward benchmark

TINY_SHAPE = ("tiny-smoke", (1, 4, 4, 3, 4))  # 1 latent frame of 2x2 patches, 3 audio latents, 4 text rows
MODES = ("strict", "off")


def build(config, device: str, rank: int, seed: int):
    from h3lab.model import H3Transformer
    from h3lab.training import add_lora

    with torch.device("meta"):
        model = H3Transformer(config)  # released dtype policy: bf16 blocks, float32 projections in/out
    model = materialise(model, device)
    init_random_(model, seed)
    model.reset_buffers(device)
    add_lora(model, rank, float(rank), seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # peft starts B at zero; random B gives every factor a gradient
                p.copy_(torch.randn(p.shape, generator=gen, device=device).mul_(p.shape[1] ** -0.5))
    return model


class GcClock:
    """Seconds Python's cyclic garbage collector ran and collections per generation, while in `gc.callbacks`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._start = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1
            self._start = None


def host_profile(fn, device: str, top: int = 40) -> dict:
    """cProfile of one call of fn() (then a device sync): its wall seconds and the `top` functions by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    sync(device)
    start = time.perf_counter()
    profiler.runcall(fn)
    sync(device)
    wall = time.perf_counter() - start
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return {"wall_s": wall, "total_tottime_s": sum(v[2] for v in stats.stats.values()), "top": [
        {"function": f"{Path(f).name}:{line}:{name}", "calls": int(v[1]), "tottime_s": round(v[2], 4),
         "cumtime_s": round(v[3], 4)} for (f, line, name), v in rows]}


FP32_VARIANTS = ("contract", "ieee", "tf32x3", "fma64")


@contextlib.contextmanager
def fp32_variant(variant: str):
    """Run the strict float32 GEMMs as `variant` inside the block: "contract" (the tiles as shipped), "ieee" or
    "tf32x3" (the shipped tiles at that precision), "fma64" (64x64x32 FMA tiles without the narrow rule: no
    parallel chunks); "+nosplit" turns the narrow rule off."""
    from h3kernels import gemm

    base, _, flag = variant.partition("+")
    saved = (dict(gemm.LINEAR_TILES), dict(gemm.TREE_TILES), gemm.SPLIT_MAX_N)
    for tiles in (gemm.LINEAR_TILES, gemm.TREE_TILES):
        if base in ("ieee", "tf32x3"):
            tiles[torch.float32] = dataclasses.replace(tiles[torch.float32], precision=base)
        elif base == "fma64":
            tiles[torch.float32] = gemm.Tile(64, 64, 32, 8, 4, 3, persistent=True, tma=True, precision="ieee")
    if flag == "nosplit" or base == "fma64":
        gemm.SPLIT_MAX_N = 0
    from h3lab.execution import graphs
    from h3lab.training import step_graph

    # graphs replay the kernels they captured, whatever the tile tables say now: none may outlive a variant
    step_graph.GRAPHS.clear()
    graphs.CACHES["strict"].clear()
    try:
        yield
    finally:
        gemm.LINEAR_TILES.update(saved[0])
        gemm.TREE_TILES.update(saved[1])
        gemm.SPLIT_MAX_N = saved[2]
        step_graph.GRAPHS.clear()
        graphs.CACHES["strict"].clear()


def budget_run(args, config, device: str, doc: dict, tiny_shape: str | None) -> dict:
    """`--gpu-memory`: the byte and time check at `--compare-layers` resident vs streamed, then the full model under
    the budget at each `--budget-shapes` (module docstring). Each result row says its residency."""
    from h3lab.components.residency import GiB
    from h3lab.components.streaming import stream_blocks
    from h3lab.hashing import tensor_digest
    from h3lab.training import Objective, StrictAdamW, compute_gradients, step_graph, trainable_parameters

    objective = Objective()
    shapes = [tiny_shape] if tiny_shape else args.budget_shapes.split(",")
    bad = [s for s in shapes if not tiny_shape and s not in SHAPES]
    if bad:
        raise SystemExit(f"--budget-shapes {bad[0]!r}: must be benchmark_forward shapes")

    def steps(model, shape_name: str):
        params = trainable_parameters(model)
        layout, request = clip_request(config, TINY_SHAPE[1] if tiny_shape else SHAPES[shape_name], seed=5)
        optimizer = StrictAdamW(params, lr=1e-5, weight_decay=0.0)

        def gradient():
            return compute_gradients(model, [request], objective, mode="strict", gradient_checkpointing=True).gradient

        def step():
            optimizer.step(gradient())
        return layout, gradient, step

    def row(model, shape_name, layout, step, residency, **extra) -> dict:
        times, peak = timed_interleaved({"step": step}, args.runs, device)["step"]
        return {"shape": shape_name, "rows": layout.sequence_length, "impl": "h3lab-strict", "residency": residency,
                "median_s": statistics.median(times), "runs": len(times), "times_s": times,
                "peak_mem_gib": round(peak, 3) if peak == peak else None, **extra}

    def plan_record(streamer) -> dict:
        plan = streamer.plan
        return {"resident_units": len(plan.resident), "streamed_units": len(plan.streamed),
                "device_gib": round(plan.device_bytes / GiB, 3), "streamed_gib": round(plan.streamed_bytes / GiB, 3),
                "gpu_memory_gib": plan.gpu_memory_gib}

    out: dict = {"results": [], "gpu_memory_gib": args.gpu_memory}
    with step_graph.use_graphs(False):  # a streamed step is eager (hooks between kernels): compare like with like
        depth = 1 if tiny_shape else args.compare_layers
        model = build(dataclasses.replace(config, num_layers=depth), device, args.rank, seed=0)
        shape_name = shapes[0]
        layout, gradient, step = steps(model, shape_name)
        out["results"].append(row(model, shape_name, layout, step, "resident", layers=depth))
        # the optimiser moved the factors: measure both sides' gradients from the factors as they are now
        resident_sha = tensor_digest(gradient(), "sha256")
        streamer = stream_blocks(model, device, gpu_memory_gib=None if tiny_shape else args.compare_gpu_memory)
        streamed_sha = tensor_digest(gradient(), "sha256")
        out["results"].append(row(model, shape_name, layout, step, "streamed", layers=depth,
                                  plan=plan_record(streamer)))
        out["compare"] = {"layers": depth, "shape": shape_name, "grad_sha256_resident": resident_sha,
                          "grad_sha256_streamed": streamed_sha, "bytes_equal": resident_sha == streamed_sha,
                          "ratio_streamed_over_resident": out["results"][1]["median_s"] / out["results"][0]["median_s"]}
        print(f"depth {depth}: streamed / resident = {out['compare']['ratio_streamed_over_resident']:.3f}, "
              f"gradients byte-equal: {out['compare']['bytes_equal']}", flush=True)
        del model, streamer, gradient, step
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        doc.update(out)
        write(args.out, doc)

        model = build(config, device, args.rank, seed=0)
        streamer = stream_blocks(model, device, gpu_memory_gib=None if tiny_shape else args.gpu_memory)
        for shape_name in shapes:
            layout, gradient, step = steps(model, shape_name)
            a, b = tensor_digest(gradient(), "sha256"), tensor_digest(gradient(), "sha256")
            out["results"].append(row(model, shape_name, layout, step, "streamed", layers=config.num_layers,
                                      plan=plan_record(streamer), grad_repeat_equal=a == b))
            print(f"{shape_name} all {config.num_layers} blocks under {args.gpu_memory} GiB: "
                  f"{out['results'][-1]['median_s']:.3f} s/step, peak {out['results'][-1]['peak_mem_gib']} GiB",
                  flush=True)
            doc.update(out)
            write(args.out, doc)
    return out


def interleaved_rows(fns: dict, impls, flag: str, args, device: str, shape_name: str, rows: int,
                     extra=lambda impl: {}) -> list[dict]:
    """`fns` timed interleaved (`--runs` after one warm-up each); one result row per (impl, mode, on) of `impls`,
    `flag` naming the switch `on` is, then `extra(impl)`'s fields (read after the timing)."""
    timings = timed_interleaved(fns, args.runs, device)
    results = []
    for impl, mode, on in impls:
        times, peak = timings[impl]
        results.append({"shape": shape_name, "rows": rows, "impl": impl, "mode": mode, flag: on,
                        "median_s": statistics.median(times), "runs": len(times), "times_s": times,
                        "peak_mem_gib": round(peak, 3) if peak == peak else None, **extra(impl)})
    return results


LEAN_IMPLS = (("h3lab-strict-triton-launch", "strict", False), ("h3lab-strict", "strict", True),
              ("h3lab-off", "off", True))


def lean_compare(gradients, params, device: str, args, shape_name: str, rows: int, doc: dict) -> dict:
    """`--lean-compare`: strict through Triton's launch / strict lean / off, interleaved (module docstring). A
    failure of the lean path or of its verification is recorded (`lean_error`, `verify_error`) and the rest still
    measured; the JSON is written after the timings and again after the profiles."""
    from h3kernels import _launch
    from h3lab.hashing import tensor_digest
    from h3lab.training import StrictAdamW, step_graph

    def grad_sha(lean: bool, mode: str) -> str:
        with _launch.enabled(lean), step_graph.use_graphs(False):
            return tensor_digest(gradients(mode).gradient, "sha256")

    out: dict = {"lean_error": None, "verify_error": None}
    impls = list(LEAN_IMPLS)
    # gradient bytes before any optimiser step: Triton's launch vs lean (twice each: repeat), off once
    digests = {"h3lab-strict-triton-launch": [grad_sha(False, "strict"), grad_sha(False, "strict")]}
    try:
        digests["h3lab-strict"] = [grad_sha(True, "strict"), grad_sha(True, "strict")]
    except Exception as exc:  # noqa: BLE001 - recorded: the Triton-launch / off timings are still worth having
        out["lean_error"] = f"{type(exc).__name__}: {exc}"
        impls = [i for i in impls if i[0] != "h3lab-strict"]
    digests["h3lab-off"] = [grad_sha(True, "off")]
    sync(device)
    verified = None
    if device == "cuda" and out["lean_error"] is None:
        try:
            with _launch.verified(), step_graph.use_graphs(False):
                verified = tensor_digest(gradients("strict").gradient, "sha256")
        except Exception as exc:  # noqa: BLE001 - LeanLaunchError (a stale launcher) or another Triton interface
            out["verify_error"] = f"{type(exc).__name__}: {exc}"
    stats0 = dict(_launch.STATS)
    with _launch.enabled(True), step_graph.use_graphs(False):
        gradients("strict")
    per_step = {k: _launch.STATS[k] - stats0[k] for k in stats0}
    optimizers = {impl: StrictAdamW(params, lr=1e-5, weight_decay=0.0) for impl, _, _ in impls}

    def step(impl: str, mode: str, lean: bool):
        def run():
            with _launch.enabled(lean), step_graph.use_graphs(False):
                optimizers[impl].step(gradients(mode).gradient)
        return run

    fns = {impl: step(impl, mode, lean) for impl, mode, lean in impls}
    results = interleaved_rows(fns, impls, "lean_launch", args, device, shape_name, rows, lambda impl: {
        "grad_sha256": digests[impl][0], "grad_repeat_equal": len(set(digests[impl])) == 1})
    median = {r["impl"]: r["median_s"] for r in results}
    off, triton_launch, lean = median["h3lab-off"], median["h3lab-strict-triton-launch"], median.get("h3lab-strict")
    out.update({
        "results": results,
        "ratio_strict_over_off": lean / off if lean else None,
        "ratio_strict_triton_launch_over_off": triton_launch / off,
        "speedup_lean_over_triton_launch": triton_launch / lean if lean else None,
        "grad_bytes_equal_triton_launch_vs_lean": (
            digests["h3lab-strict-triton-launch"][0] == digests["h3lab-strict"][0]
            if "h3lab-strict" in digests else None),
        "grad_sha256_verified_step": verified,
        "verified_step_equal": verified == digests["h3lab-strict"][0] if verified is not None else None,
        "lean_launches_per_step": per_step,
    })
    doc.update(out)
    write(args.out, doc)
    if args.runtime_profile and device == "cuda":
        for entry, (impl, _, _) in zip(results, impls):
            rp = entry["runtime_profile"] = runtime_profile(fns[impl], no_grad=False)
            print(f"{impl} runtime: GPU busy {rp['gpu_busy_ms']:.0f} ms, idle {rp['gpu_idle_ms']:.0f} ms; " + ", ".join(
                f"{c['name']} x{c['calls']} {c['cpu_ms']:.0f} ms" for c in rp["runtime_calls"][:6]), flush=True)
    print(table(results, ["impl", "shape", "rows", "median_s", "peak_mem_gib", "grad_repeat_equal"]))
    print(f"strict / off = {out['ratio_strict_over_off']} (Triton's launch: {triton_launch / off:.3f}; target <= 1.3); "
          f"lean launches per step {per_step}; gradients Triton's launch == lean: "
          f"{out['grad_bytes_equal_triton_launch_vs_lean']}; verified step "
          f"equal: {out['verified_step_equal']}; errors: {out['lean_error']} / {out['verify_error']}", flush=True)
    return out


STEP_IMPLS = (("h3lab-strict-eager", "strict", False), ("h3lab-strict", "strict", True), ("h3lab-off", "off", True))


def first_host_sync(model, request, objective, params, device: str) -> str | None:
    """Where an eager strict micro-batch first synchronises with the host (what breaks a capture): the traceback's
    tail under `torch.cuda.set_sync_debug_mode("error")`, after a warm-up on the same device tensors (so the index
    caches are built, as before a capture); None if it never does."""
    import traceback

    from h3lab.training.step import _TrainContext, _micro_batch

    sample = request.sample(objective).to(device).canonical()
    with _TrainContext(model, "strict", True):
        _micro_batch(model, sample, objective, params, sample.model_kwargs(), None)
        sync(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            _micro_batch(model, sample, objective, params, sample.model_kwargs(), None)
        except RuntimeError:
            return traceback.format_exc()[-4000:]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return None


def adapter_switch_check(model, request, objective, device: str) -> dict:
    """GRPO's reference policy through strict forward graphs: no-grad strict forwards of one sample with the adapter
    on (warm-up, capture, replay), then with it off (`adapter_disabled`), against the eager forwards. The adapter-off
    forward must be another graph signature (peft's switch changes no tensor) and give the eager adapter-off bytes."""
    from h3lab.execution import graphs, runtime
    from h3lab.adapters.lora import adapter_disabled

    sample = request.sample(objective).to(device).canonical()
    kwargs = sample.model_kwargs()
    paths = {}
    with torch.no_grad(), runtime.use_mode("strict"):
        model.eval()
        for _ in range(3):
            on = model(**kwargs)
        paths["on"] = graphs.last_path("strict")
        with adapter_disabled(model):
            off = model(**kwargs)
            paths["off"] = graphs.last_path("strict")
            with graphs.use_graphs("strict", False):
                off_eager = model(**kwargs)
        with graphs.use_graphs("strict", False):
            on_eager = model(**kwargs)
    sync(device)
    same = lambda a, b: all(bool(torch.equal(x, y)) for x, y in zip(a, b))  # noqa: E731
    return {"paths": paths, "on_graph_equals_eager": same(on, on_eager), "off_equals_eager_off": same(off, off_eager),
            "off_differs_from_on": not same(off, on)}


def step_graph_compare(gradients, params, device: str, args, shape_name: str, rows: int, doc: dict,
                       model, request, objective) -> dict:
    """`--step-graph`: strict eager / strict through the step graph / off, interleaved, after the byte check over
    `--check-steps` optimiser steps (module docstring). A failed capture records where the eager micro-batch first
    synchronises (`first_host_sync`)."""
    from h3lab.hashing import tensor_digest
    from h3lab.training import StrictAdamW, step_graph

    def run_steps(graphs: bool) -> tuple[list[str], list[dict], list[float]]:
        optimizer = StrictAdamW(params, lr=1e-3, weight_decay=0.0)  # large enough to move bf16-visible factors
        shas, paths, seconds = [], [], []
        with step_graph.use_graphs(graphs):
            for _ in range(args.check_steps):
                sync(device)
                start = time.perf_counter()
                result = gradients("strict")
                optimizer.step(result.gradient)
                sync(device)
                seconds.append(round(time.perf_counter() - start, 4))
                shas.append(tensor_digest(result.gradient, "sha256"))
                paths.append(step_graph.last_path())
        return shas, paths, seconds

    start = [p.detach().clone() for _, p in params]

    def restore() -> None:  # in place: the graph reads the factors by address
        with torch.no_grad():
            for (_, p), s in zip(params, start):
                p.copy_(s)

    eager_shas, _, eager_seconds = run_steps(False)
    restore()
    graph_shas, graph_paths, graph_seconds = run_steps(True)
    restore()
    out: dict = {
        "check_steps": args.check_steps, "grad_sha256_eager_steps": eager_shas, "grad_sha256_graph_steps": graph_shas,
        "graph_paths": graph_paths, "grad_bytes_equal_graph_vs_eager": eager_shas == graph_shas,
        "check_step_seconds_eager": eager_seconds,  # wall seconds of each checked step (the graph's first two are
        "check_step_seconds_graph": graph_seconds,  # its warm-up and its capture, compile included at the start)
        "steps_differ": len(set(eager_shas)) == len(eager_shas),  # the updates moved the factors
    }
    print(f"step graph: gradients equal eager at every step: {out['grad_bytes_equal_graph_vs_eager']}; paths "
          f"{graph_paths}", flush=True)
    if device == "cuda" and any(p.get("reason", "").startswith("capture failed") for p in graph_paths):
        out["first_host_sync"] = first_host_sync(model, request, objective, params, device)
        print(f"first host sync of the eager micro-batch: {out['first_host_sync']}", flush=True)
        doc.update(out)
        write(args.out, doc)
    out["adapter_switch"] = adapter_switch_check(model, request, objective, device)
    print(f"adapter switch through strict forward graphs: {out['adapter_switch']}", flush=True)
    optimizers = {impl: StrictAdamW(params, lr=1e-5, weight_decay=0.0) for impl, _, _ in STEP_IMPLS}
    last = {}

    def step(impl: str, mode: str, graphs: bool):
        def run():
            with step_graph.use_graphs(graphs):
                optimizers[impl].step(gradients(mode).gradient)
                last[impl] = step_graph.last_path()
        return run

    fns = {impl: step(impl, mode, graphs) for impl, mode, graphs in STEP_IMPLS}
    results = interleaved_rows(fns, STEP_IMPLS, "step_graph", args, device, shape_name, rows,
                               lambda impl: {"last_path": last.get(impl)})
    median = {r["impl"]: r["median_s"] for r in results}
    off = median["h3lab-off"]
    out.update({"results": results, "ratio_strict_over_off": median["h3lab-strict"] / off,
                "ratio_strict_eager_over_off": median["h3lab-strict-eager"] / off,
                "speedup_graph_over_eager": median["h3lab-strict-eager"] / median["h3lab-strict"]})
    doc.update(out)
    write(args.out, doc)
    if args.runtime_profile and device == "cuda":
        for entry, (impl, _, _) in zip(results, STEP_IMPLS):
            rp = entry["runtime_profile"] = runtime_profile(fns[impl], no_grad=False)
            print(f"{impl} runtime: GPU busy {rp['gpu_busy_ms']:.0f} ms, idle {rp['gpu_idle_ms']:.0f} ms, "
                  f"{rp['kernels']} kernels; " + ", ".join(
                      f"{c['name']} x{c['calls']} {c['cpu_ms']:.0f} ms" for c in rp["runtime_calls"][:6]), flush=True)
    print(table(results, ["impl", "shape", "rows", "median_s", "peak_mem_gib"]))
    print(f"strict / off = {out['ratio_strict_over_off']:.3f} (eager micro-batch: "
          f"{out['ratio_strict_eager_over_off']:.3f}; target <= 1.3); graph vs eager gradients equal at every step: "
          f"{out['grad_bytes_equal_graph_vs_eager']}", flush=True)
    return out


def clip_request(config, shape, seed: int):
    from h3lab.run.layout import build_layout
    from h3lab.training import ClipRequest

    frames, lh, lw, audio, text = shape
    layout = build_layout("t2va", torch.ones(text, dtype=torch.int64), frames, lh, lw, audio,
                          patch_size=config.patch_size)
    gen = torch.Generator().manual_seed(seed)
    return layout, ClipRequest(
        layout, text=torch.randn(1, text, config.text_dim, generator=gen),
        video=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=gen),
        audio=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=gen), seed=seed)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (H3Config.tiny() with one block, Triton "
                        "interpreter)")
    parser.add_argument("--runs", type=int, default=3, help="timed steps per mode after one warm-up (default 3)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--shape", default="512x512x22f",
                        help="the t2va clip of the step, a benchmark_forward shape (default 512x512x22f, 2,066 rows)")
    parser.add_argument("--factor-dtypes", default="float32",
                        help="comma list of the LoRA factors' dtype to time in turn (float32 = h3lab's adapters; "
                             "bfloat16 = an experiment: the same factors cast to the base dtype, float32 masters in "
                             "StrictAdamW, to see what the float32 factor GEMMs cost)")
    parser.add_argument("--fp32-variants", default="contract",
                        help="comma list of strict float32 GEMM variants to time in turn: contract | ieee | tf32x3 "
                             "| fma64, each optionally +nosplit (default contract: the shipped tiles)")
    parser.add_argument("--gc", default="default",
                        help="comma list of garbage-collector settings to time in turn: default | freeze")
    parser.add_argument("--runtime-profile", action="store_true",
                        help="also record, for one step of each mode, the CUDA runtime calls (syncs, allocations, "
                             "launches), the GPU's idle time and its longest gaps (torch.profiler, CUDA only)")
    parser.add_argument("--host-profile", action="store_true",
                        help="also profile one step of each mode on the host (cProfile: the 40 functions of most own "
                             "time), to see where a host-bound step spends its Python time")
    parser.add_argument("--lean-compare", action="store_true",
                        help="time strict with the lean launch path off (Triton's own launch) and on, and off, "
                             "interleaved; gradient hashes, a verified step, launcher statistics (module docstring)")
    parser.add_argument("--step-graph", action="store_true",
                        help="time strict with its micro-batch eager and through the step graph, and off, "
                             "interleaved, after a step-by-step gradient byte check (module docstring)")
    parser.add_argument("--check-steps", type=int, default=4,
                        help="optimiser steps of the --step-graph byte check (default 4)")
    parser.add_argument("--profile", action="store_true",
                        help="also record each mode's GPU time per kernel (torch.profiler, one step, CUDA only)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                        help="train the full model under this budget for its frozen weights (module docstring)")
    parser.add_argument("--compare-layers", type=int, default=16,
                        help="with --gpu-memory: the depth of the resident-vs-streamed byte and time check")
    parser.add_argument("--compare-gpu-memory", type=float, default=12.0, metavar="GiB",
                        help="with --gpu-memory: the budget of the streamed side of that check (default 12)")
    parser.add_argument("--budget-shapes", default="512x512x22f",
                        help="with --gpu-memory: comma list of benchmark_forward shapes of the full-size steps")
    args = parser.parse_args(argv)
    if args.check_steps < 3:
        parser.error(f"--check-steps {args.check_steps}: must be >= 3 (warm-up, capture and at least one replay)")
    if args.shape not in SHAPES or args.shape.startswith("tiny"):
        served = ", ".join(name for name in SHAPES if not name.startswith("tiny"))
        parser.error(f"--shape {args.shape!r}: must be one of {served}")
    device = prepare(parser, cpu=args.tiny, flag="--tiny")

    from h3lab.config import H3Config
    from h3lab.training import Objective, StrictAdamW, compute_gradients, trainable_parameters

    # the smoke: the tiny config cut to one block and one refiner block (the interpreter runs every program in Python)
    config = dataclasses.replace(H3Config.tiny(), num_layers=1, num_refiner_layers=1) if args.tiny else H3Config.full()
    shape_name, shape = TINY_SHAPE if args.tiny else (args.shape, SHAPES[args.shape])
    model = build(config, device, args.rank, seed=0)
    params = trainable_parameters(model)
    layout, request = clip_request(config, shape, seed=5)
    objective = Objective()
    lora_numel = sum(p.numel() for _, p in params)
    doc = header("lora", __file__, argv, device, config={"hidden": config.hidden_size, "layers": config.num_layers},
                 lora={"rank": args.rank, "alpha": float(args.rank), "modules": len(params) // 2,
                       "parameters": lora_numel, "dtype": args.factor_dtypes, "gradient_checkpointing": True},
                 target_ratio=1.3)

    dtypes = args.factor_dtypes.split(",")
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad:
        parser.error(f"--factor-dtypes {bad[0]!r}: must be float32 or bfloat16")
    gc_modes = args.gc.split(",")
    if any(g not in ("default", "freeze") for g in gc_modes):
        parser.error(f"--gc {args.gc!r}: each must be default or freeze")
    variants = args.fp32_variants.split(",")
    bad = [v for v in variants if v.partition("+")[0] not in FP32_VARIANTS or v.partition("+")[2] not in ("", "nosplit")]
    if bad:
        parser.error(f"--fp32-variants {bad[0]!r}: must be one of {', '.join(FP32_VARIANTS)}, optionally +nosplit")

    def gradients(mode: str):
        return compute_gradients(model, [request], objective, mode=mode, gradient_checkpointing=True)

    if args.gpu_memory is not None:
        del model, params
        doc.update(budget_run(args, config, device, doc, shape_name if args.tiny else None))
        write(args.out, doc)
        return doc
    if args.step_graph:
        doc.update(step_graph_compare(gradients, params, device, args, shape_name, layout.sequence_length, doc,
                                      model, request, objective))
        write(args.out, doc)
        return doc
    if args.lean_compare:
        doc.update(lean_compare(gradients, params, device, args, shape_name, layout.sequence_length, doc))
        write(args.out, doc)
        return doc

    doc["ratios_strict_over_off"] = {}
    runs = [(d, v, g) for g in gc_modes for d in dtypes for v in variants]
    clock = GcClock()
    gc.callbacks.append(clock)
    for factor_dtype, variant, gc_mode in runs:
        gc.collect()
        if gc_mode == "freeze":
            gc.freeze()
        else:
            gc.unfreeze()
        with torch.no_grad():
            for _, p in params:
                p.data = p.data.to(getattr(torch, factor_dtype))
        optimizers = {m: StrictAdamW(params, lr=1e-5, weight_decay=0.0) for m in MODES}  # one per mode: a mode's
        # steps see only its own optimiser state; both move the same factors, which changes no timing

        gc_seconds: dict[str, list[float]] = {m: [] for m in MODES}
        gc_counts = {m: [0, 0, 0] for m in MODES}

        def step(mode: str):
            def run():
                seconds, counts = clock.seconds, list(clock.collections)
                result = gradients(mode)
                optimizers[mode].step(result.gradient)
                gc_seconds[mode].append(clock.seconds - seconds)
                gc_counts[mode] = [a + b - c for a, b, c in zip(gc_counts[mode], clock.collections, counts)]
            return run

        with fp32_variant(variant):
            repeat, calls = {}, {}
            for mode in MODES:  # byte-repeatability from the same weights, before any optimiser step
                a, b = gradients(mode), gradients(mode)
                repeat[mode] = bool(torch.equal(a.gradient, b.gradient))
                calls[mode] = a.trace.to_dict()
                sync(device)
            for m in MODES:
                gc_seconds[m].clear()
                gc_counts[m] = [0, 0, 0]
            timings = timed_interleaved({m: step(m) for m in MODES}, args.runs, device)
            entries = []
            for mode in MODES:
                times, peak = timings[mode]
                entries.append({
                    "shape": shape_name, "rows": layout.sequence_length, "impl": f"h3lab-{mode}",
                    "factor_dtype": factor_dtype, "fp32_variant": variant, "gc": gc_mode,
                    "gc_s_per_step": statistics.median(gc_seconds[mode][1:]),  # [0] is the warm-up
                    "gc_collections": gc_counts[mode],
                    "median_s": statistics.median(times), "runs": len(times), "times_s": times,
                    "peak_mem_gib": round(peak, 3) if peak == peak else None,
                    "grad_repeat_equal": repeat[mode], "non_strict_calls": calls[mode]["non_strict_calls"],
                    "op_calls": {op: sum(b.values()) for op, b in calls[mode]["ops"].items()},
                })
            if args.profile and device == "cuda":
                for entry, mode in zip(entries, MODES):
                    kernels = kernel_profile(step(mode), top=30, no_grad=False)
                    entry["kernel_profile"] = kernels
                    entry["kernel_ms_top30"] = round(sum(k["ms"] for k in kernels), 3)
                    print(f"{factor_dtype} {variant} {mode} top kernels: " + ", ".join(
                        f"{k['name'][:40]} {k['ms']:.1f} ms x{k['calls']}" for k in kernels[:8]), flush=True)
            if args.runtime_profile and device == "cuda":
                for entry, mode in zip(entries, MODES):
                    rp = entry["runtime_profile"] = runtime_profile(step(mode), no_grad=False)
                    print(f"{factor_dtype} {variant} {mode} runtime: GPU busy {rp['gpu_busy_ms']:.0f} ms, idle "
                          f"{rp['gpu_idle_ms']:.0f} ms; " + ", ".join(
                              f"{c['name']} x{c['calls']} {c['cpu_ms']:.0f} ms" for c in rp["runtime_calls"][:8])
                          + "; gaps " + ", ".join(f"{g['ms']:.1f} ms before {g['before'][:30]}"
                                                  for g in rp["largest_gaps"][:6]), flush=True)
            if args.host_profile:
                for entry, mode in zip(entries, MODES):
                    entry["host_profile"] = host_profile(step(mode), device)
                    print(f"{factor_dtype} {variant} {mode} host: " + ", ".join(
                        f"{h['function'][-50:]} {h['tottime_s']:.3f} s x{h['calls']}"
                        for h in entry["host_profile"]["top"][:12]), flush=True)
        doc["results"] += entries
        strict, off = (r["median_s"] for r in entries)
        key = "/".join(k for k, n in ((factor_dtype, len(dtypes)), (variant, len(variants)), (gc_mode, len(gc_modes)))
                       if n > 1 or k == factor_dtype)
        doc["ratios_strict_over_off"][key] = strict / off
        print(f"factors {factor_dtype}, fp32 {variant}, gc {gc_mode}: strict / off = {strict / off:.3f} "
              f"(target <= {doc['target_ratio']})", flush=True)
    gc.callbacks.remove(clock)
    gc.unfreeze()
    doc["ratio_strict_over_off"] = next(iter(doc["ratios_strict_over_off"].values()))  # the first listed
    print(table(doc["results"], ["impl", "factor_dtype", "fp32_variant", "gc", "gc_s_per_step", "shape", "rows", "median_s", "peak_mem_gib",
                                 "grad_repeat_equal"]))
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
