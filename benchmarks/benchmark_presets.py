"""Speed presets on one GPU: a 20-pass denoise at 512x512x22f and 864x480x56f with the full-size DiT
(seeded random weights) -- the full path, each preset alone, `--layers 45 --reuse 2` and
`--layers 45 --reuse 2 --token-reduction` -- timed, with peak memory and the final latents' relative L2 against the
full path of the same shape.

RANDOM WEIGHTS: the relative L2 says how far a preset moves the numbers of this random network; it says nothing
about image quality, which needs the released checkpoint (the seed's fox/surfer renders).

Runs in `strict` by default: the presets are sealed, strict-compatible transforms of a run, strict costs within ~7%
of `off` at these shapes (benchmarks/results/forward_strict.json), and a deterministic run makes the relative L2
the preset's effect alone (run-to-run noise is zero). `--mode off` for the production torch path.

Order (no reload needed): every shape's full / core-reuse / token-reduction runs first; then the 5 blocks layer
thinning drops are released (their weights leave the GPU: `h3lab.presets.release_dropped`) and the thinned runs
follow. Each run is preceded by a 1-pass warm-up of the same configuration (kernel compilation, allocator), then
timed once with CUDA events (one 20-pass denoise is 20 forwards); peak memory is `max_memory_allocated` over the
timed run (weights included). The RoPE adaptation applies only at 256x256, so it has no row at these shapes.

Writes one JSON (DESIGN.md "Evidence" schema) to --out. `--tiny` runs an 8-block H3Config.tiny() on the CPU in
`off` (the CI smoke test of this script).
"""

from __future__ import annotations

import argparse
import time

import torch

from _common import header, materialise, peak_mem_gib, prepare, rel_l2, sync, table, write
from benchmark_forward import init_random_, t2va_spec

# name: (preset settings, whole-velocity reuse); layer counts are the release's (45 of 50), scaled to other depths.
CONFIGS = {
    "full": ({}, 1),
    "layers-45": ({"layers": 45}, 1),
    "core-reuse-4": ({"core_reuse": 4}, 1),
    "token-reduction": ({"token_reduction": True}, 1),
    "layers-45+reuse-2": ({"layers": 45}, 2),
    "layers-45+reuse-2+token-reduction": ({"layers": 45, "token_reduction": True}, 2),
}


def build_model(config, device: str, seed: int):
    """The DiT with seeded random weights in the released dtypes, materialised on `device` without a float32 copy."""
    from h3lab.model import H3Transformer

    with torch.device("meta"):
        model = H3Transformer(config, dtype_policy="released")
    model = materialise(model, device)
    init_random_(model, seed)
    model.reset_buffers(device)
    return model.eval().requires_grad_(False)


def resident_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def run_config(model, base, preset: dict, reuse: int, device: str, warmup_passes: int = 1) -> dict:
    """One timed denoise of `base` with `preset` and `reuse`, after a short warm-up of the same configuration."""
    from h3lab.run import denoise

    spec = base.replace(preset=preset, reuse=reuse)
    warm = make_like(base, warmup_passes).replace(preset=preset, reuse=min(reuse, warmup_passes))
    with torch.no_grad():
        denoise(warm, model)
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    with torch.no_grad():
        video, audio = denoise(spec, model)
    if device == "cuda":
        end.record()
    sync(device)
    seconds = start.elapsed_time(end) / 1e3 if device == "cuda" else time.perf_counter() - t0
    peak = round(peak_mem_gib(device), 3) if device == "cuda" else None  # not measured on the CPU
    return {"seconds": seconds, "peak_mem_gib": peak, "video": video.float().cpu(),
            "audio": audio.float().cpu(), "preset": spec.preset}


def make_like(spec, passes: int):
    """`spec`'s inputs and layout on a shorter schedule (the warm-up)."""
    from h3lab.run.sampler import DualSchedule

    schedule = DualSchedule.from_passes(passes)
    return spec.replace(inputs=spec.inputs.resealed(spec.layout, schedule), schedule=schedule)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="512x512x22f,864x480x56f")
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--mode", choices=("strict", "off"), default=None, help="default strict (off with --tiny)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: an 8-block H3Config.tiny(), mode off")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")
    from h3lab import presets
    from h3lab.config import H3Config
    from h3lab.run.layout import pair_horizontal_tokens
    from h3lab.run.fields import thaw
    from h3lab.run.sampler import reuse_plan

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    mode = args.mode or ("off" if args.tiny else "strict")
    config = H3Config(**{**H3Config.tiny().to_diffusers(), "num_layers": 8}) if args.tiny else H3Config.full()
    shapes = ["tiny-64x64x22f"] if args.tiny else args.shapes.split(",")
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        ap.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    n_layers = round(config.num_layers * 45 / 50)

    t0 = time.perf_counter()
    model = build_model(config, device, seed=1234)
    sync(device)
    build_s = time.perf_counter() - t0
    blocks = presets.choose_blocks(model, n_layers) if n_layers < config.num_layers else tuple(range(n_layers))
    doc = header("presets", __file__, argv, device, mode=mode, passes=args.passes, layers=n_layers,
                 num_layers=config.num_layers, blocks=list(blocks),
                 dropped=list(presets.layer_thinning.dropped(config.num_layers, blocks)),
                 gate_scores={str(k): v for k, v in presets.gate_scores(model).items()},
                 build_s=round(build_s, 1), token_reduction_schedule=presets.DEFAULT_SCHEDULE,
                 note="random weights: latent_rel_l2 measures how far a preset moves this random network's "
                      "numbers, not image quality")
    specs = {s: t2va_spec(config, s, args.passes, mode, device) for s in shapes}
    full: dict[str, dict] = {}
    rows = []

    def run(name: str, shape: str) -> None:
        settings, reuse = CONFIGS[name]
        preset = {}
        if "layers" in settings:
            preset.update(layers=n_layers, blocks=list(blocks))
        if settings.get("core_reuse"):
            preset["core_reuse"] = settings["core_reuse"]
        if settings.get("token_reduction"):
            preset["token_reduction"] = True
        spec = specs[shape]
        got = run_config(model, spec, preset, reuse, device)
        if name == "full":
            full[shape] = got
        ref = full.get(shape)
        core = presets.core_plan(args.passes, preset.get("core_reuse", 1))
        evaluated = reuse_plan(args.passes, reuse)
        row = {
            "shape": shape, "rows": spec.inputs.seq_len, "impl": f"h3lab-{mode}", "config": name,
            "preset": {k: v for k, v in thaw(got["preset"]).items() if k != "blocks"}, "reuse": reuse,
            "median_s": round(got["seconds"], 4), "runs": 1, "peak_mem_gib": got["peak_mem_gib"],
            "resident_weights_gib": round(resident_bytes(model) / 2**30, 3),
            "resident_weight_bytes": resident_bytes(model),
            "forwards": sum(evaluated), "core_passes": sum(a and b for a, b in zip(evaluated, core)),
            "blocks_run": len(preset.get("blocks", range(config.num_layers))),
            "reduced_rows": pair_horizontal_tokens(spec.layout).num_rows if "token_reduction" in preset else None,
        }
        if ref is not None:
            row.update(speedup_vs_full=round(ref["seconds"] / got["seconds"], 3),
                       latent_rel_l2_video_vs_full=rel_l2(got["video"], ref["video"]),
                       latent_rel_l2_audio_vs_full=rel_l2(got["audio"], ref["audio"]))
        rows.append(row)
        print(f"{shape} {name}: {row['median_s']:.3f} s, peak {row['peak_mem_gib']} GiB", flush=True)

    thinned = [n for n in names if "layers" in CONFIGS[n][0]]
    for shape in shapes:
        for name in ["full"] + [n for n in names if n not in thinned and n != "full"]:
            run(name, shape)
    if thinned and n_layers < config.num_layers:
        presets.release_dropped(model, blocks)  # the dropped blocks' weights leave the device
        if device == "cuda":
            torch.cuda.empty_cache()
    for shape in shapes:
        for name in thinned:
            run(name, shape)
    doc["results"] = rows
    print(table(rows, ["shape", "config", "median_s", "speedup_vs_full", "peak_mem_gib",
                       "latent_rel_l2_video_vs_full", "latent_rel_l2_audio_vs_full"]))
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
