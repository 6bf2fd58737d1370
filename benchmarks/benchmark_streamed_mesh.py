"""Streamed residency on a TP mesh byte-equal to resident on that mesh and to one process, at H3Config.full() widths
(bytes only).

    torchrun --standalone --nproc-per-node 2 benchmarks/benchmark_streamed_mesh.py --out $OUT/streamed_mesh.json
    torchrun --standalone --nproc-per-node 4 benchmarks/benchmark_streamed_mesh.py --out $OUT/streamed_mesh_4.json
    torchrun --standalone --nproc-per-node 2 benchmarks/benchmark_streamed_mesh.py --tiny --out /tmp/sm.json  # CPU

The GPU form of `tests/distributed/test_streamed_mesh.py`. Every rank shares one GPU (`init_mesh(share_device=True)`,
gloo, the collectives' CUDA tensors staged through host memory: `mesh.shared_memory = False`). The model: the full
widths (5376 hidden, 56 x 128 heads, FFN 14336, the refiner) at `--layers` blocks (default 2), released dtypes,
counter-random weights (`shard_load.random_sharded_transformer`, seed 1234), one strict fl2va forward of 512 rows
(pass 0 of a 1-pass schedule). Rank 0 first runs the one-process resident forward (the reference: SHA-256 of the
video and audio velocities' bytes) and sums the whole model's streamed-unit bytes; then for each topology
(`--topologies`, default tp2,tp2+sp, plus tp4,tp4+sp when the launch is a multiple of 4 ranks; a topology smaller
than the launch runs as data-parallel replicas of it, each replica the same request) every rank builds the full
model in host memory (drawn on the GPU, moved to the host: what a checkpoint load hands over), places it with
`ExecutionPlan(cuda, "streamed", mesh=...)` (parallelize on the host, then each rank packs only its TP shard's blocks
into pinned host memory and streams them through 2 device slots on a side stream), runs the forward streamed twice
(cold: the shard's kernels compile, the first unit is copied on demand; warm: the first unit was prefetched after the
last one), then places the same model resident on the same mesh (`plan.replace(residency="resident")`) and runs it
once more.

Recorded per topology and rank: streamed (cold and warm) and resident video / audio byte-equal to one process, the
streamed units, the rank's streamed host bytes against the whole model's (each rank's must lie in (whole / tp, whole):
its shard plus the replicated norms and biases), whether every host buffer is pinned, the streamer's copies of the
forward (every unit copied in at least once, at least its host bytes moved), whether the resident placement dropped the
streamer, peak GPU memory (`max_memory_allocated` of the rank's process, reset before each forward: weights, slots and
activations) streamed vs resident, and the forward's wall time (bytes only: ranks time-sliced on one GPU, never
scaling). Streaming on CUDA needs pinned host memory, a side stream and the slots on the GPU: a placement that does not
give them raises one line naming the rank and topology. The JSON is rewritten after each topology, so a launch cut short
keeps what it finished; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import header, prepare, write  # noqa: E402

TOPOLOGIES = {"tp2": 2, "tp4": 4}
LABEL = "bytes only: every rank shares one GPU, collectives host-staged over gloo; times are not scaling"
SEED = 1234


def _topology(name: str, world: int) -> tuple[int, bool]:
    """(tp, sp) of a `--topologies` name: a `TOPOLOGIES` key, optionally with `+sp`; its tp must divide `world`."""
    base, plus, rest = name.partition("+")
    if base not in TOPOLOGIES or (plus and rest != "sp"):
        raise SystemExit(f"--topologies {name!r}: must be one of {', '.join(TOPOLOGIES)}, each optionally +sp "
                         "(streaming refuses cp > 1)")
    tp = TOPOLOGIES[base]
    if world % tp:
        raise SystemExit(f"--topologies {name!r}: tp {tp} does not divide the launch's {world} ranks "
                         f"(launch a multiple of {tp} with --nproc-per-node)")
    return tp, bool(plus)


def default_topologies(world: int) -> str:
    return "tp2,tp2+sp,tp4,tp4+sp" if world % 4 == 0 else "tp2,tp2+sp"


def digest(t) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes."""
    import torch

    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + raw).hexdigest()


def _inputs(config, tiny: bool, device):
    from h3lab.research.ablation import make_inputs
    from h3lab.run.layout import build_layout
    from h3lab.run.sampler import DualSchedule

    text, frames, lh, lw, audio = (5, 2, 4, 4, 3) if tiny else (48, 3, 16, 24, 40)
    layout = build_layout("fl2va", [1] * text, frames, lh, lw, audio, anchors=("first",),
                          patch_size=config.patch_size)
    return make_inputs(config, layout, DualSchedule.build(2), seed=3).to(device)


def _forward(model, x, dev):
    """One strict forward (pass 0): (video, audio, seconds, peak GiB of this process)."""
    import torch

    from h3lab.execution import runtime
    from h3lab.run import model_forward

    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with runtime.use_mode("strict"), torch.no_grad():
        video, audio = model_forward(model, x, x.video, x.audio, 0)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return video, audio, wall, torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")


def _unit_bytes(model) -> int:
    from h3lab.components import streaming

    return sum(streaming.unit_entries(module)[1] for _, module in streaming.block_units(model))


def _free(dev) -> None:
    import gc

    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def check_streamer(streamer, dev, units: list[str], where: str) -> bool:
    """The streamer the placement built streams every unit the way `dev` needs (CUDA: pinned host buffers, the side
    stream backend, the slots on the GPU); raises one line naming `where` otherwise. Returns whether every host
    buffer is pinned (False on the CPU, where nothing is)."""
    if streamer is None:
        raise RuntimeError(f"{where}: ExecutionPlan(residency='streamed', mesh=...).place left the model unstreamed")
    names = [u.name for u in streamer.streamed]
    if names != units:
        raise RuntimeError(f"{where}: streamed units {names}, expected every block unit {units}")
    pinned = all(u.host is not None and u.host.is_pinned() for u in streamer.streamed)
    if dev.type == "cuda":
        if not pinned:
            raise RuntimeError(f"{where}: the streamed units' host buffers are not pinned (CUDA streaming copies "
                               "from pinned memory on a side stream)")
        if streamer.backend.name != "cuda" or not streamer.slots or any(s.buffer.device.type != "cuda"
                                                                        for s in streamer.slots):
            raise RuntimeError(f"{where}: streamer backend {streamer.backend.name!r} with {len(streamer.slots)} "
                               "slot(s) off the GPU; CUDA streaming needs the side-stream backend and GPU slots")
    return pinned


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default=None, help="comma-separated tp2, tp4, each optionally +sp "
                    "(default: tp2,tp2+sp; with tp4,tp4+sp when the launch is a multiple of 4 ranks)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on H3Config.tiny() (gloo, interpreter)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        ap.error("launch with torch.distributed.run --nproc-per-node 2 (or 4): a mesh needs at least 2 ranks")
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: must be at least 1")
    names = (args.topologies or default_topologies(world)).split(",")
    topologies = {name: _topology(name, world) for name in names}  # checked before the process group starts
    device_name = prepare(ap, cpu=args.tiny, flag="--tiny")

    import torch
    import torch.distributed as dist

    from h3lab.components import ExecutionPlan, streaming
    from h3lab.config import H3Config
    from h3lab.distributed import init_mesh
    from h3lab.distributed.shard_load import random_sharded_transformer

    torch.backends.cuda.matmul.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    config = H3Config(**{**config.to_diffusers(), "num_layers": args.layers})
    dev = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    tp0, sp0 = topologies[names[0]]
    init_mesh(tp=tp0, sp=sp0, dp=world // tp0, device=dev, config=config, share_device=True)  # the process group
    rank = dist.get_rank()
    waiting = dist.new_group(backend="gloo", timeout=timedelta(hours=1))  # others wait for rank 0's reference
    x = _inputs(config, args.tiny, dev)
    rows = x.seq_len
    doc = header("streamed_mesh", __file__, argv, device_name, label=LABEL, world_size=world,
                 config={"hidden_size": config.hidden_size, "heads": config.num_attention_heads,
                         "ffn_dim": config.ffn_dim, "num_layers": config.num_layers,
                         "num_refiner_layers": config.num_refiner_layers, "dtype_policy": "released"},
                 request={"task": "fl2va", "rows": rows, "pass": 0, "mode": "strict"},
                 streaming={"slots": streaming.DEFAULT_SLOTS, "gpu_memory_gib": None,
                            "host_memory": "pinned" if dev.type == "cuda" else "plain (cpu)"},
                 weights=f"counter-random (h3lab.distributed.shard_load, seed {SEED}), the full model per rank in "
                         "host memory, sharded by parallelize, each rank's shard packed and streamed")

    def build(host: bool):
        model = random_sharded_transformer(config, None, SEED, device=dev)  # drawn where it is fast
        if host and dev.type != "cpu":
            model = model.to("cpu")  # the full weights in host memory, as a checkpoint load hands them over
            _free(dev)
        return model

    ref = [None]
    if rank == 0:
        model = build(host=False)
        video, audio, wall, peak = _forward(model, x, dev)
        units = [name for name, _ in streaming.block_units(model)]
        ref[0] = {"video": digest(video), "audio": digest(audio), "whole_host_bytes": _unit_bytes(model),
                  "units": units}
        doc["results"].append({"topology": "one process", "impl": "h3lab-strict-resident", "rows": rows,
                               "forward_s": wall, "peak_mem_gib": peak, "video_sha256": ref[0]["video"],
                               "audio_sha256": ref[0]["audio"], "whole_host_bytes": ref[0]["whole_host_bytes"],
                               "units": units})
        print(f"one process: forward {wall:.2f} s, peak {peak:.2f} GiB, {len(units)} units, "
              f"{ref[0]['whole_host_bytes'] / 2**20:.2f} MiB of blocks", flush=True)
        del model, video, audio
        _free(dev)
        write(args.out, doc)
    dist.broadcast_object_list(ref, src=0, group=waiting)
    ref = ref[0]
    whole = ref["whole_host_bytes"]

    failed = False
    for name in names:
        tp, sp = topologies[name]
        where = f"rank {rank} {name}"
        mesh = init_mesh(tp=tp, sp=sp, dp=world // tp, device=dev, config=config, share_device=True)
        mesh.shared_memory = False  # torch.distributed gloo with host-staged CUDA tensors, no mailbox
        model = build(host=True)
        plan = ExecutionPlan(dev, "streamed", mesh=mesh)
        try:
            plan.place(model, "transformer")
        except Exception as exc:  # noqa: BLE001 - re-raised as one line naming the rank and topology
            raise RuntimeError(f"{where}: streamed placement refused: {type(exc).__name__}: {exc}") from exc
        streamer = streaming.streamer_of(model)
        pinned = check_streamer(streamer, dev, ref["units"], where)
        host_bytes = sum(u.nbytes for u in streamer.streamed)
        mine = {"units": [u.name for u in streamer.streamed], "host_bytes": host_bytes, "pinned": pinned}
        for run in ("cold", "warm"):  # cold: the shard's kernels compile, unit 0 copied on demand; warm: prefetched
            streamer.begin_run()
            video, audio, wall, peak = _forward(model, x, dev)
            stats = streamer.end_run()
            mine[run] = {"video": digest(video) == ref["video"], "audio": digest(audio) == ref["audio"],
                         "copies": stats.copies, "on_demand": stats.on_demand, "bytes_moved": stats.bytes_moved,
                         "peak": peak, "seconds": wall}
        del video, audio, streamer
        plan.replace(residency="resident").place(model, "transformer")  # the same mesh, resident again
        mine["resident_streamer"] = streaming.streamer_of(model) is None
        _free(dev)
        video, audio, r_wall, r_peak = _forward(model, x, dev)
        mine.update(resident_video=digest(video) == ref["video"], resident_audio=digest(audio) == ref["audio"],
                    resident_peak=r_peak, resident_s=r_wall)
        del video, audio, model
        _free(dev)
        ranks: list = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank == 0:
            equal = all(r[run][k] for r in ranks for run in ("cold", "warm") for k in ("video", "audio")) and all(
                r["resident_video"] and r["resident_audio"] for r in ranks)
            below = all(whole / tp < r["host_bytes"] < whole for r in ranks)
            moved = all(r[run]["copies"] >= len(ref["units"]) and r[run]["bytes_moved"] >= r["host_bytes"]
                        for r in ranks for run in ("cold", "warm"))
            ok = equal and below and moved and all(r["resident_streamer"] for r in ranks)
            failed |= not ok
            doc["results"].append({
                "topology": name, "impl": f"h3lab-strict-streamed-{name}", "tp": tp, "sp": sp,
                "dp_replicas": mesh.dp, "world_size": world, "row_parallel": mesh.topology.strategy,
                "rows": rows, "transport": mesh.transport, "timing_label": LABEL,
                "streamed_video_equal_ranks": [r["warm"]["video"] for r in ranks],
                "streamed_audio_equal_ranks": [r["warm"]["audio"] for r in ranks],
                "streamed_cold_video_equal_ranks": [r["cold"]["video"] for r in ranks],
                "streamed_cold_audio_equal_ranks": [r["cold"]["audio"] for r in ranks],
                "resident_video_equal_ranks": [r["resident_video"] for r in ranks],
                "resident_audio_equal_ranks": [r["resident_audio"] for r in ranks],
                "bytes_equal": equal, "streamed_units_ranks": [r["units"] for r in ranks],
                "host_bytes_ranks": [r["host_bytes"] for r in ranks], "whole_host_bytes": whole,
                "host_fraction_ranks": [r["host_bytes"] / whole for r in ranks], "host_below_whole": below,
                "host_pinned_ranks": [r["pinned"] for r in ranks],
                "every_unit_streamed": moved,
                "resident_again_unstreamed_ranks": [r["resident_streamer"] for r in ranks],
                "stream_copies_ranks": [r["warm"]["copies"] for r in ranks],
                "stream_on_demand_ranks": [r["warm"]["on_demand"] for r in ranks],
                "stream_on_demand_cold_ranks": [r["cold"]["on_demand"] for r in ranks],
                "stream_bytes_moved_ranks": [r["warm"]["bytes_moved"] for r in ranks],
                "peak_mem_gib_streamed_ranks": [r["warm"]["peak"] for r in ranks],
                "peak_mem_gib_resident_ranks": [r["resident_peak"] for r in ranks],
                "forward_s_streamed_ranks": [r["warm"]["seconds"] for r in ranks],
                "forward_s_streamed_cold_ranks": [r["cold"]["seconds"] for r in ranks],
                "forward_s_resident_ranks": [r["resident_s"] for r in ranks], "ok": ok})
            print(f"{name}: bytes equal {equal} (streamed and resident, every rank), host bytes per rank "
                  f"{max(r['host_bytes'] for r in ranks) / whole:.3f} of the whole ({below}), pinned "
                  f"{all(r['pinned'] for r in ranks)}, peak streamed {max(r['warm']['peak'] for r in ranks):.2f} / "
                  f"resident {max(r['resident_peak'] for r in ranks):.2f} GiB, forward streamed "
                  f"{max(r['warm']['seconds'] for r in ranks):.2f} / resident "
                  f"{max(r['resident_s'] for r in ranks):.2f} s "
                  f"({LABEL})", flush=True)
            write(args.out, doc)
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        print("FAILED: a topology's bytes or host bytes differ from the contract (see the JSON)", flush=True)
        raise SystemExit(1)
    return doc


if __name__ == "__main__":
    main()
