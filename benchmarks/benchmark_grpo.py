"""One GRPO iteration of the full-size H3 DiT (seeded random weights, rank-64 LoRA), strict against torch (`off`), at
512x512x22f with G = 4: seconds per rollout pass and per training pass, peak memory, and the on-policy ratio
exp(logp_train - logp_rollout) of every (request, pass, modality) at the first inner epoch.

The rollout is one prompt's G requests batched through the one loop on the `flow_sde` stepper (Flow-GRPO, a = 0.7;
`trajectory.record`, latents kept): per pass one no-grad forward over all G, each request's seeded noise and its
float32 log-density in the trajectory, the requests placed in the batch in the order 2, 3, 0, 1 (a request's
position is not its identity). Training
is `grpo_step.grpo_iteration`: every (request, pass) item alone (batch 1, gradient checkpointing on, LoRA
trainable), one inner epoch, one StrictAdamW step. Strict is the contract (ratio exactly 1.0 everywhere); `off` reports
its deviation (min / max / mean of ratio - 1) next to Diffusers' numbers on the same model
(`docs/reference/rl_anchors.md`).

    python benchmarks/benchmark_grpo.py --out benchmarks/results/grpo.json        # one H200
    python benchmarks/benchmark_grpo.py --tiny --out /tmp/grpo.json                # CPU dry run (tiny config)

`--layers N` keeps the first N of the 50 blocks (recorded in the JSON); `--passes` SDE passes of a `--passes`-pass
grid (the first passes of a real schedule: sigma 1 -> ...).

Times: every rollout pass (callback to callback) and every training pass (one item's `request_gradient`: forward +
backward, timed by wrapping it, device-synchronised) are recorded; the medians `rollout_pass_median_s` and
`train_pass_median_s` leave out the first pass of each (its kernels' JIT compile and warm-up, recorded apart as
`rollout_first_pass_s` / `train_first_pass_s`); `train_pass_s` is the mean of all items (the first included).

    python benchmarks/benchmark_grpo.py --passes 3 --out benchmarks/results/grpo_50_blocks.json   # all 50 blocks

`--gpu-memory GiB` streams the frozen weights under that budget (`h3lab.components.streaming`: the blocks that fit
stay resident, the rest pass through two slots in the rollout, the training forward and its backward's
recomputation; the factors and the optimiser state stay on the GPU); the plan is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from _common import header, peak_mem_gib, prepare, sync, table, write

from benchmark_forward import SHAPES  # noqa: E402 - the forward benchmark's shapes
from benchmark_lora import build  # noqa: E402 - full-size random weights + rank-r LoRA (random B)

TINY_SHAPE = ("tiny-smoke", (1, 4, 4, 3, 4))
MODES = ("strict", "off")


def batch_order(group: int) -> list[int]:
    """The request at each batch position: the group rotated by two (G = 4: 2, 3, 0, 1)."""
    return [(j + 2) % group for j in range(group)]


def group_inputs(config, shape, group: int, passes: int, device: str, seed: int):
    """t2va inputs of one prompt: shared text, each request its own initial noise; the DualSchedule of `passes`."""
    from h3lab.run.layout import build_layout
    from h3lab.run import DenoiseInputs
    from h3lab.run.sampler import DualSchedule

    frames, lh, lw, audio, text = shape
    layout = build_layout("t2va", torch.ones(text, dtype=torch.int64), frames, lh, lw, audio,
                          patch_size=config.patch_size)
    schedule = DualSchedule.from_passes(passes)
    gen = torch.Generator().manual_seed(seed)
    nv, na = layout.video_indices.numel(), layout.audio_indices.numel()
    inputs = DenoiseInputs.from_layout(
        layout, schedule, text=torch.randn(1, text, config.text_dim, generator=gen).expand(group, -1, -1).contiguous(),
        video=torch.randn(group, nv, config.video_patch_dim, generator=gen),
        audio=torch.randn(group, na, config.audio_in_channels, generator=gen), seeds={"noise": seed})
    return layout, schedule, inputs.to(device)


def rollout(model, layout, inputs, schedule, mode: str, level: float, seed: int, device: str):
    """The batched SDE rollout through the one loop (`RunSpec(stepper="flow_sde")`, `trajectory.record`, latents
    kept); seconds per pass (callback to callback, the recorder's hashing included)."""
    from h3lab.hashing import model_fingerprint
    from h3lab.run import RunSpec
    from h3lab.run.trajectory import record

    spec = RunSpec(inputs, schedule, mode=mode, layout=layout, fingerprint=model_fingerprint(model),
                   stepper="flow_sde", stepper_params={"level": level, "seed": seed,
                                                       "requests": batch_order(inputs.batch_size)})
    stamps = []

    def tick(_):
        sync(device)
        stamps.append(time.perf_counter())

    sync(device)
    start = time.perf_counter()
    trajectory = record(spec, model, keep=("latents",), callback=tick)
    seconds = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
    return trajectory, seconds


@contextlib.contextmanager
def timed_items(seconds: list[float], device: str):
    """Append the device-synchronised seconds of every `request_gradient` call (one training pass: one item's forward
    + backward) that `grpo_step.grpo_iteration` makes inside the `with`."""
    from h3lab.training import grpo_step

    inner = grpo_step.request_gradient

    def timed(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        sync(device)
        seconds.append(time.perf_counter() - t0)
        return out

    grpo_step.request_gradient = timed
    try:
        yield
    finally:
        grpo_step.request_gradient = inner


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run (H3Config.tiny(), one block, Triton "
                        "interpreter)")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N blocks (default: all)")
    parser.add_argument("--passes", type=int, default=2, help="SDE passes of the rollout (default 2)")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--level", type=float, default=0.7, help="Flow-GRPO noise level a")
    parser.add_argument("--modes", default="strict,off", help="comma list of modes to run (default strict,off)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                        help="budget for the frozen weights on the GPU; the rest streams (default: all resident)")
    args = parser.parse_args(argv)
    device = prepare(parser, cpu=args.tiny, flag="--tiny")
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: each must be one of {', '.join(MODES)}")

    from h3lab.config import H3Config
    from h3lab.training import trainable_parameters
    from h3lab.training.grpo import ratio_stats
    from h3lab.training.grpo_step import GrpoConfig, batch_from_trajectories, grpo_iteration
    from h3lab.training.optim_config import OptimizerConfig

    config = dataclasses.replace(H3Config.tiny(), num_layers=1, num_refiner_layers=1) if args.tiny else H3Config.full()
    full_layers = config.num_layers
    if args.layers is not None:
        config = dataclasses.replace(config, num_layers=args.layers)
    shape_name, shape = TINY_SHAPE if args.tiny else ("512x512x22f", SHAPES["512x512x22f"])
    t0 = time.perf_counter()
    model = build(config, device, args.rank, seed=0)
    residency = {}
    if args.gpu_memory is not None:
        from h3lab.components.residency import GiB
        from h3lab.components.streaming import stream_blocks

        plan = stream_blocks(model, device, gpu_memory_gib=None if args.tiny else args.gpu_memory).plan
        residency = {"policy": "streamed", "gpu_memory_gib": args.gpu_memory, "streamed_units": len(plan.streamed),
                     "resident_units": len(plan.resident), "device_gib": round(plan.device_bytes / GiB, 3)}
    build_s = time.perf_counter() - t0
    params = trainable_parameters(model)
    initial = {n: p.detach().clone() for n, p in params}
    layout, schedule, inputs = group_inputs(config, shape, args.group, args.passes, device, seed=3)
    doc = header("grpo", __file__, argv, device,
                 config={"hidden": config.hidden_size, "layers": config.num_layers, "released_layers": full_layers},
                 lora={"rank": args.rank, "alpha": float(args.rank), "parameters": sum(p.numel() for _, p in params)},
                 grpo={"kind": "flow_sde", "level": args.level, "group": args.group, "passes": args.passes,
                       "batch_order": batch_order(args.group), "gradient_checkpointing": True, "inner_epochs": 1},
                 build_s=round(build_s, 1), residency=residency,
                 reference={"source": "docs/reference/rl_anchors.md (H200, Diffusers, ratio - 1)",
                            "t2va 1344x768x39f": {"video": -9.0e-6, "audio": -9.1e-5},
                            "fl2va 512x512x56f": {"video": 0.0, "audio": -1.5e-5}})
    rewards = torch.randn(args.group, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    for mode in modes:
        with torch.no_grad():
            for n, p in params:
                p.copy_(initial[n])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trajectory, rollout_s = rollout(model, layout, inputs, schedule, mode, args.level, 11, device)
        rollout_peak = peak_mem_gib(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        batch = batch_from_trajectories([trajectory], "flow_sde", rewards)
        cfg = GrpoConfig(group=args.group, level=args.level, mode=mode, gradient_checkpointing=True,
                         optim=OptimizerConfig(lr=1e-5))
        optimizer = cfg.optimizer(params)
        item_s: list[float] = []
        sync(device)
        t1 = time.perf_counter()
        with timed_items(item_s, device):
            record = grpo_iteration(model, batch, cfg, optimizer)
        sync(device)
        items = len(record["items"])
        train_s = (time.perf_counter() - t1) / items
        warm_rollout = rollout_s[1:] or rollout_s
        warm_train = item_s[1:] or item_s
        epoch = record["epochs"][0]
        per_modality = {m: ratio_stats([torch.tensor(it[m]["ratio"], dtype=torch.float32) for it in epoch["items"]])
                        for m in ("video", "audio")}
        entry = {"shape": shape_name, "rows": layout.sequence_length, "impl": f"h3lab-{mode}",
                 "median_s": statistics.median(warm_rollout), "runs": len(warm_rollout),
                 "median_excludes": "the first rollout pass and the first training pass (JIT compile, warm-up)",
                 "rollout_pass_s": rollout_s, "rollout_pass_median_s": statistics.median(warm_rollout),
                 "rollout_first_pass_s": rollout_s[0],
                 "train_pass_s": train_s, "train_item_s": item_s, "train_pass_median_s": statistics.median(warm_train),
                 "train_first_pass_s": item_s[0] if item_s else None,
                 "train_items": items, "peak_mem_gib": round(peak_mem_gib(device), 3),
                 "rollout_peak_mem_gib": round(rollout_peak, 3), "ratio": epoch["ratio"],
                 "ratio_by_modality": per_modality, "clipped": epoch["clipped"],
                 "ratios": [[it["request"], it["pass"], it["video"]["ratio"], it["audio"]["ratio"]]
                            for it in epoch["items"]]}
        doc["results"].append(entry)
        write(args.out, doc)  # after every mode: a run cut short keeps what it measured
        print(f"{mode}: rollout pass {entry['rollout_pass_median_s']:.3f} s (first {rollout_s[0]:.1f} s), training "
              f"pass {entry['train_pass_median_s']:.3f} s (first {entry['train_first_pass_s']:.1f} s), peak "
              f"{entry['peak_mem_gib']:.1f} GiB, ratio-1 {per_modality}", flush=True)
    print(table(doc["results"], ["impl", "shape", "rows", "rollout_pass_median_s", "train_pass_median_s",
                                 "peak_mem_gib"]))
    write(args.out, doc)
    return doc


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
