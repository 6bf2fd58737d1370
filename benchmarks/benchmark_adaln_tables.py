"""AdaLN tables on one GPU: the released DiT with its AdaLN weights in pinned host memory and only the tables of a
generation's schedule on the GPU -- the tables' bytes, their batch invariance at full width, strict t2va at the
longest lengths against Diffusers with its own CPU offload, and the DiT bytes on the card.

One full-size `H3Transformer` with seeded random weights (`benchmark_forward.init_random_`, seed 1234; no weights
can be downloaded) is allocated once on the GPU in the released dtypes (`_common.materialise`), then placed with
`--adaln tables` (`h3lab.components.adaln_host.keep_on_host`: 24.2 GiB of AdaLN weights to pinned host memory) and,
with `--gpu-memory GiB`, its blocks streamed under that budget. Sections (`--sections`, in order; the JSON is
rewritten after each, a section that raises is recorded as an error and the run goes on):

1. `tables`: the 50 passes of a t2va schedule (`DualSchedule.from_passes(50)`, the released shifts; each pass's
   distinct timesteps from the layout) -- strict: the tables of all passes in one GEMM per block (2688 -> 96768,
   every block) against the same tables computed one pass at a time and two passes at a time: byte-equal, block by
   block (`equal_one_at_a_time`, `equal_two_at_a_time`); the seconds of the one pass over the AdaLN weights, its
   copy throughput, the table bytes and rows. `off` computes one call per pass (its own rule) and is timed too.
2. `t2va`: per shape (`--shapes`, default 1344x768x124f and 1344x768x362f; all 50 blocks), strict forwards under
   the tables placement: the first call (compiles) and `--runs` timed calls (CUDA events), the peak allocated
   memory, the DiT bytes on the GPU as planned (`dit_gpu_gib`: weights + tables) and as allocated after placing
   (`allocated_gib`), the output hash. Where the resident DiT fits beside the activations (`--resident-check`,
   default the first shape) the AdaLN weights go back to the GPU for one strict forward: `bytes_equal_resident`.
3. `diffusers`: the model moved to host memory and Diffusers' `MiniMaxH3Transformer3DModel` built on the same bytes
   (no copy), run with its own CPU offload (`--diffusers-offload`: `group` = `apply_group_offloading`, block level,
   one block per group, CUDA stream, low_cpu_mem_usage; `model` = the whole transformer onloaded per forward, as
   `enable_model_cpu_offload`): time per forward at each shape, the peak, and strict's relative L2 against it.
   Each result says which offload ran.

Expected wall time on one H100 80 GB (H200 measurements scaled by ~1.35): build and placement ~1 min, strict
compile ~1 min, `tables` ~1.5 min (one strict pass over 24 GiB of AdaLN weights ~0.5 s, 75 single/paired passes),
`t2va` ~1 min at 124f (3 forwards of ~9 s, one resident) and ~2 min at 362f (2 forwards of ~55 s), `diffusers`
~3-4 min (one forward per shape plus a warm-up at 124f; its copies are not overlapped). Split the run if one call is
limited to 10 minutes: `--sections tables,t2va` then `--sections diffusers` (two files).

Run: python benchmarks/benchmark_adaln_tables.py --out $OUT/adaln_tables.json          (CPU smoke: --tiny)
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback

import torch

from _common import add_gpu_memory, call_seconds, header, materialise, peak_mem_gib, prepare, rel_l2, sync, write
from benchmark_forward import SHAPES, init_random_, make_inputs, output_sha256

GiB = 2**30
SCHEDULE_SHAPE = "512x512x22f"  # the layout whose rows give each pass's distinct timesteps (t2va: any length)


def build(config, device: str, seed: int):
    """The DiT with seeded random weights, allocated once in the released dtypes."""
    from h3lab import H3Transformer

    with torch.device("meta"):
        model = H3Transformer(config)
    model = materialise(model, device)
    init_random_(model, seed)
    model.reset_buffers(device)
    model.fingerprint = f"random-seed{seed}"
    return model.eval().requires_grad_(False)


def schedule_groups(config, passes: int, device: str, tiny: bool) -> list[torch.Tensor]:
    """The (T,) timestep tensor of every pass of a t2va generation (what its tables are computed for)."""
    from h3lab.run.sampler import DualSchedule

    layout, _ = make_inputs(config, "tiny-64x64x22f" if tiny else SCHEDULE_SHAPE, 1, "cpu", seed=0)
    schedule = DualSchedule.from_passes(passes)
    return [t.to(device) for t, _ in layout.timestep_plan(schedule.video.timesteps, schedule.audio.timesteps)]


def forward(model, inputs, mode: str):
    from h3lab.execution import runtime

    with runtime.use_mode(mode), torch.no_grad():
        return model(**inputs)


def timed_first_and_runs(fn, runs: int, device: str) -> tuple[float, list[float]]:
    """Seconds of the first call and of `runs` later calls (CUDA events; perf_counter on the CPU)."""
    first = call_seconds(fn, device)
    return first, [call_seconds(fn, device) for _ in range(runs)]


# ------------------------------------------------------------------------------------------------- sections
def section_tables(model, groups, device: str) -> list[dict]:
    """All passes at once vs one and two at a time (strict), and off's per-pass rule (see the module docstring)."""
    from h3lab.execution import runtime
    from h3lab.model.adaln_tables import AdaLNTables, tables_of

    source = tables_of(model).source
    out = []
    for mode in ("strict", "off"):
        with runtime.use_mode(mode):
            sync(device)
            copied = source.copied_bytes
            t0 = time.perf_counter()
            once = AdaLNTables(model, source).prepare(groups)
            sync(device)
            seconds = time.perf_counter() - t0
            moved = source.copied_bytes - copied
            entry = {"section": "tables", "shape": f"t2va schedule, {len(groups)} passes", "impl": f"h3lab-{mode}",
                     "mode": mode, "passes": len(groups), "rows": sum(g.numel() for g in groups),
                     "median_s": seconds, "runs": 1, "peak_mem_gib": peak_mem_gib(device), "blocks": len(once.tables),
                     "width": f"{model.config.time_embed_dim}->{model.config.adaln_dim}",
                     "table_bytes": sum(t.numel() * t.element_size() for t in once.tables.values()),
                     "prepare_s": seconds, "prepare_s_per_pass": seconds / len(groups), "adaln_bytes_moved": moved,
                     "copy_gbps": moved / seconds / 1e9 if seconds else None}
            if mode == "strict":
                entry["equal_one_at_a_time"] = _equal_split(model, source, once, groups, 1)
                entry["equal_two_at_a_time"] = _equal_split(model, source, once, groups, 2)
        out.append(entry)
        print(f"tables {mode}: {entry['rows']} rows x {entry['blocks']} blocks in {seconds:.2f} s "
              f"({entry['table_bytes'] / GiB:.2f} GiB)" + (f", one at a time equal {entry['equal_one_at_a_time']}, "
              f"two at a time equal {entry['equal_two_at_a_time']}" if mode == "strict" else ""), flush=True)
    return out


def _equal_split(model, source, once, groups, k: int) -> bool:
    """The tables of `groups` computed k passes at a time equal the rows of the all-at-once batch, block by block."""
    from h3lab.model.adaln_tables import AdaLNTables

    equal = True
    for start in range(0, len(groups), k):
        part = AdaLNTables(model, source).prepare(groups[start: start + k])
        first = once.groups[start].offset
        rows = sum(g.numel() for g in groups[start: start + k])
        for i, table in part.tables.items():
            equal &= bool(torch.equal(table, once.tables[i][first: first + rows]))
    return equal


def section_t2va(model, config, shapes, runs: dict, device: str, resident_check: set, plan_for,
                 outputs: dict) -> list[dict]:
    """Strict forwards under the tables placement (module docstring); each shape's velocities go to `outputs`
    (float32 host copies, for the diffusers section)."""
    from h3lab.components import adaln_host
    from h3lab.model.adaln_tables import tables_of

    out = []
    for shape in shapes:
        layout, inputs = make_inputs(config, shape, 1, device, seed=7)
        tables = tables_of(model)
        batch = tables.prepare([inputs["timestep"]])  # a run prepares all its passes at once (section `tables`)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        result = {}
        first, times = timed_first_and_runs(lambda: result.update(out=forward(model, inputs, "strict")),
                                            runs.get(shape, 1), device)
        plan = plan_for(model, layout)
        entry = {"section": "t2va", "shape": shape, "rows": layout.sequence_length, "impl": "h3lab-strict",
                 "adaln": "tables", "layers": config.num_layers, "first_call_s": first,
                 "median_s": statistics.median(times) if times else first, "runs": len(times), "times_s": times,
                 "peak_mem_gib": peak_mem_gib(device), "dit_gpu_gib": plan.device_bytes / GiB,
                 "table_gib": plan.tables.table_bytes / GiB if plan.tables else 0.0,
                 "allocated_gib": torch.cuda.memory_allocated() / GiB if device == "cuda" else None,
                 "sha256": output_sha256(*result["out"]), "served": tables.stats.served}
        tables.drop(batch)
        outputs[shape] = tuple(o.float().cpu() for o in result["out"])
        if shape in resident_check:
            source = adaln_host.source_of(model)
            adaln_host.release(model, restore=True)  # AdaLN weights back on the GPU: the resident forward
            entry["bytes_equal_resident"] = output_sha256(*forward(model, inputs, "strict")) == entry["sha256"]
            adaln_host.keep_on_host(model, device if source is None else source.device)
        out.append(entry)
        print(f"{shape} strict tables: first {first:.2f} s, median {entry['median_s']:.2f} s, DiT on GPU "
              f"{entry['dit_gpu_gib']:.2f} GiB, peak {entry['peak_mem_gib']:.2f} GiB"
              + (f", equal resident {entry['bytes_equal_resident']}" if "bytes_equal_resident" in entry else ""),
              flush=True)
        del inputs, result
    return out


def host_state(holder: dict) -> tuple[dict, torch.Tensor]:
    """The model's state dict in host memory (its AdaLN weights already are: the same tensors) and its `inv_freq`;
    the model is dropped from `holder` and its GPU memory freed."""
    from h3lab.components import adaln_host

    model = holder.pop("model")
    adaln_host.release(model, restore=False)  # the AdaLN weights stay in (pinned) host memory, served to nobody
    state = {k: (v if v.device.type == "cpu" else v.to("cpu")) for k, v in model.state_dict().items()}
    inv_freq = model.rope.inv_freq.to("cpu")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return state, inv_freq


def section_diffusers(holder: dict, config, shapes, runs: dict, device: str, offload: str, strict_out: dict
                      ) -> list[dict]:
    """Diffusers on the same bytes with its own CPU offload (module docstring)."""
    from diffusers import MiniMaxH3Transformer3DModel

    state, inv_freq = host_state(holder)
    with torch.device("meta"):
        dm = MiniMaxH3Transformer3DModel(**config.to_diffusers())
    dm.load_state_dict(state, strict=True, assign=True)  # the same host tensors, no copy
    dm.rope.inv_freq = inv_freq
    dm = dm.eval().requires_grad_(False)
    how = "none (CPU)"
    if device == "cuda" and offload == "group":
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(dm, onload_device=torch.device("cuda"), offload_type="block_level",
                               num_blocks_per_group=1, use_stream=True, low_cpu_mem_usage=True)
        how = "group offloading: block_level, 1 block per group, CUDA stream, low_cpu_mem_usage"
    elif device == "cuda":
        how = "model offload: the whole transformer onloaded per forward, offloaded after"
    out = []
    for shape in shapes:
        layout, inputs = make_inputs(config, shape, 1, device, seed=7)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result = {}

        def call():
            if device == "cuda" and offload == "model":
                dm.to("cuda")
            with torch.no_grad():
                result["out"] = dm(**inputs, return_dict=False)
            if device == "cuda" and offload == "model":
                dm.to("cpu")

        first, times = timed_first_and_runs(call, runs.get(shape, 1), device)
        entry = {"section": "diffusers", "shape": shape, "rows": layout.sequence_length, "impl": "diffusers",
                 "offload": how, "layers": config.num_layers, "first_call_s": first,
                 "median_s": statistics.median(times) if times else first, "runs": len(times), "times_s": times,
                 "peak_mem_gib": peak_mem_gib(device)}
        if shape in strict_out:
            entry["strict_rel_l2_vs_diffusers"] = rel_l2(strict_out[shape], tuple(o.float() for o in result["out"]))
        out.append(entry)
        print(f"{shape} diffusers ({how}): first {first:.2f} s, median {entry['median_s']:.2f} s, peak "
              f"{entry['peak_mem_gib']:.2f} GiB", flush=True)
    return out


# ------------------------------------------------------------------------------------------------- main
def _runs(text: str) -> dict:
    return {k: int(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="tables,t2va,diffusers")
    ap.add_argument("--shapes", default="1344x768x124f,1344x768x362f")
    ap.add_argument("--runs", default="1344x768x124f=2,1344x768x362f=1", help="timed calls per shape after the first")
    ap.add_argument("--passes", type=int, default=None,
                    help="passes of the schedule whose tables are computed (default 50; 4 with --tiny)")
    ap.add_argument("--resident-check", default="1344x768x124f",
                    help="shapes whose tables forward is compared with the AdaLN-resident forward (needs the whole "
                         "DiT and the activations on the GPU)")
    ap.add_argument("--diffusers-offload", choices=("group", "model"), default="group")
    add_gpu_memory(ap)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on H3Config.tiny()")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = prepare(ap, cpu=args.tiny, flag="--tiny")

    from h3lab.components import adaln_host, streaming
    from h3lab.components.execution import ExecutionPlan
    from h3lab.config import H3Config

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    shapes = ["tiny-64x64x22f"] if args.tiny else args.shapes.split(",")
    runs = {"tiny-64x64x22f": 1} if args.tiny else _runs(args.runs)
    resident_check = set(shapes) if args.tiny else set(filter(None, args.resident_check.split(",")))
    execution = ExecutionPlan(device, residency="streamed" if args.gpu_memory else "resident",
                              gpu_memory=args.gpu_memory, adaln="tables")

    def plan_for(model, layout):
        rows = sum(g.numel() for g in groups)
        return execution.streaming_plan(model, table_rows=rows)

    t0 = time.time()
    model = build(config, device, seed=1234)
    execution.place(model, "transformer")
    sync(device)
    placed = time.time() - t0
    streamer = streaming.streamer_of(model)
    print(f"built and placed the DiT in {placed:.1f} s: AdaLN weights "
          f"{adaln_host.source_of(model).host_bytes / GiB:.2f} GiB in host memory"
          + (f", {streamer.plan.describe()}" if streamer is not None else ""), flush=True)
    groups = schedule_groups(config, args.passes or (4 if args.tiny else 50), device, args.tiny)
    doc = header("adaln_tables" if not args.tiny else "adaln_tables_tiny_smoke", __file__, argv, device,
                 config={"num_layers": config.num_layers, "hidden_size": config.hidden_size},
                 weights="random (seeded 1234, released dtypes, allocated once)",
                 placement=execution.residency_value(), build_and_place_s=placed,
                 host_adaln_gib=adaln_host.source_of(model).host_bytes / GiB)
    strict_out: dict = {}
    holder = {"model": model}
    del model
    for name in args.sections.split(","):
        try:
            if name == "tables":
                doc["results"] += section_tables(holder["model"], groups, device)
            elif name == "t2va":
                doc["results"] += section_t2va(holder["model"], config, shapes, runs, device, resident_check,
                                               plan_for, strict_out)
            elif name == "diffusers":  # last: the model leaves the GPU
                doc["results"] += section_diffusers(holder, config, shapes, runs, device, args.diffusers_offload,
                                                    strict_out)
            else:
                raise ValueError(f"unknown section {name!r}")
        except Exception as err:  # noqa: BLE001 - recorded, the next section runs
            traceback.print_exc()
            doc["results"].append({"section": name, "error": f"{type(err).__name__}: {err}"})
        write(args.out, doc)
    return doc


if __name__ == "__main__":
    main()
