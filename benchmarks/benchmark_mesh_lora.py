"""The mesh LoRA step's gradients byte-equal to one process, at H3Config.full() widths (bytes only).

    torchrun --standalone --nproc-per-node 4 benchmarks/benchmark_mesh_lora.py --out $OUT/mesh_lora_step.json
    torchrun --standalone --nproc-per-node 4 benchmarks/benchmark_mesh_lora.py --topologies tp2+sp,tp2xcp2+sp,tp4+sp \
        --out $OUT/mesh_lora_step_sp.json                                                     # sequence parallel
    torchrun --standalone --nproc-per-node 4 benchmarks/benchmark_mesh_lora.py --tiny --out /tmp/m.json   # CPU dry run

Every rank shares one GPU (`init_mesh(share_device=True)`, gloo, the collectives' CUDA tensors staged through host
memory: `mesh.shared_memory = False`, so bytes move through torch.distributed alone). The model: the full widths
(5376 hidden, 56 x 128 heads, FFN 14336, the refiner) at `--layers` blocks (default 2), released dtypes,
counter-random weights (`shard_load.random_sharded_transformer`, seed 1234), a rank-16 LoRA on every attention and
FFN projection (peft's A init, B drawn N(0, 0.02^2) so every factor has a gradient), one fl2va request. Rank 0 first
runs the one-process strict step (loss and flat float32 gradient over all LoRA factors); then for each topology
(`--topologies`, default tp2, cp2, tp2xcp2; any of `TOPOLOGIES`, each with `+sp` for sequence parallel over its TP
group, e.g. tp2+sp, tp2xcp2+sp, tp4+sp; a topology smaller than the launch runs as data-parallel replicas of it,
each replica the same request) every rank builds the model, parallelizes it, runs the same step, and the table
records per rank: loss and gradient byte-equal to the one-process step, peak GPU memory (`max_memory_allocated` of
the rank's process), the step's wall time (bytes only: ranks time-sliced on one GPU, never scaling). The JSON is
rewritten after each topology, so a launch cut short keeps what it finished.
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

TOPOLOGIES = {"cp2": (1, 2), "tp2": (2, 1), "tp2xcp2": (2, 2), "cp4": (1, 4), "tp4": (4, 1)}
LABEL = ("bytes only: every rank shares one GPU, collectives host-staged over gloo; times are not scaling")


def _topology(name: str) -> tuple[int, int, bool]:
    """(tp, cp, sp) of a `--topologies` name: a `TOPOLOGIES` key, optionally with `+sp`."""
    base, plus, rest = name.partition("+")
    if base not in TOPOLOGIES or (plus and rest != "sp"):
        raise SystemExit(f"--topologies {name!r}: must be one of {', '.join(TOPOLOGIES)}, each optionally +sp")
    return (*TOPOLOGIES[base], bool(plus))


def _digest(t) -> str:
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def _request(config, tiny: bool, device):
    import torch

    from h3lab.run.layout import build_layout
    from h3lab.training import ClipRequest

    text, frames, lh, lw, audio = (5, 2, 4, 4, 3) if tiny else (48, 3, 16, 24, 40)
    layout = build_layout("fl2va", [1] * text, frames, lh, lw, audio, anchors=("first",),
                          patch_size=config.patch_size)
    g = torch.Generator().manual_seed(7)
    return ClipRequest(
        layout,
        text=torch.randn(1, layout.num_text_tokens, config.text_dim, generator=g),
        video=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g),
        audio=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
        seed=11,
    )


def _model(config, device, rank_lora: int):
    import torch

    from h3lab.distributed.shard_load import random_sharded_transformer
    from h3lab.training import add_lora

    model = random_sharded_transformer(config, None, 1234, device=device)
    add_lora(model, rank_lora, float(rank_lora), seed=5)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.device))
    return model


def _step(model, request):
    from h3lab.training import Objective, compute_gradients

    return compute_gradients(model, [request], Objective(audio_weight=0.5), mode="strict")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topologies", default="tp2,cp2,tp2xcp2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run on H3Config.tiny() (gloo, interpreter)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device_name = prepare(ap, cpu=args.tiny, flag="--tiny")

    import torch
    import torch.distributed as dist

    from h3lab.config import H3Config
    from h3lab.distributed import init_mesh, parallelize
    from h3lab.training import trainable_parameters

    torch.backends.cuda.matmul.allow_tf32 = False
    config = H3Config.tiny() if args.tiny else H3Config.full()
    config = H3Config(**{**config.to_diffusers(), "num_layers": args.layers})
    dev = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    names = args.topologies.split(",")
    topologies = {name: _topology(name) for name in names}  # every name checked before the process group starts
    first = topologies[names[0]]
    init_mesh(tp=first[0], cp=first[1], sp=first[2], dp=world // (first[0] * first[1]), device=dev, config=config,
              share_device=True)  # starts the gloo process group
    rank = dist.get_rank()
    waiting = dist.new_group(backend="gloo", timeout=timedelta(hours=1))  # others wait for rank 0's reference
    request = _request(config, args.tiny, dev)
    doc = header("mesh_lora_step", __file__, argv, device_name, label=LABEL, world_size=world,
                 config={"hidden_size": config.hidden_size, "heads": config.num_attention_heads,
                         "ffn_dim": config.ffn_dim, "num_layers": config.num_layers,
                         "num_refiner_layers": config.num_refiner_layers, "dtype_policy": "released"},
                 lora={"rank": args.lora_rank, "alpha": float(args.lora_rank), "targets": "every attention and FFN "
                       "projection (blocks and refiner)", "b_init": "N(0, 0.02^2), seed 9"},
                 request={"task": "fl2va", "rows": request.layout.sequence_length},
                 weights="counter-random (h3lab.distributed.shard_load, seed 1234), full model per rank, sharded "
                         "in place by parallelize")

    def peak() -> float:
        return torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")

    ref = [None]
    if rank == 0:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        model = _model(config, dev, args.lora_rank)
        t0 = time.time()
        one = _step(model, request)
        wall = time.time() - t0
        n = len(trainable_parameters(model))
        ref[0] = {"loss": _digest(one.loss), "gradient": _digest(one.gradient), "factors": n,
                  "nonzero": bool((one.gradient != 0).any())}
        doc["results"].append({"topology": "one process", "impl": "h3lab-strict", "rows": request.layout.sequence_length,
                               "step_s": wall, "peak_mem_gib": peak(), "loss_sha256": ref[0]["loss"],
                               "gradient_sha256": ref[0]["gradient"], "lora_factors": n})
        print(f"one process: step {wall:.2f} s, peak {peak():.2f} GiB, {n} factors", flush=True)
        del model, one
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        write(args.out, doc)
    dist.broadcast_object_list(ref, src=0, group=waiting)
    ref = ref[0]

    for name in names:
        tp, cp, sp = topologies[name]
        mesh = init_mesh(tp=tp, cp=cp, sp=sp, dp=world // (tp * cp), device=dev, config=config, share_device=True)
        mesh.shared_memory = False  # torch.distributed gloo with host-staged CUDA tensors, no mailbox
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        model = _model(config, dev, args.lora_rank)
        parallelize(model, mesh)
        t0 = time.time()
        result = _step(model, request)
        wall = time.time() - t0
        mine = {"loss": _digest(result.loss) == ref["loss"], "gradient": _digest(result.gradient) == ref["gradient"],
                "peak": peak(), "step_s": wall}
        ranks: list = [None] * world
        dist.all_gather_object(ranks, mine)
        del model, result
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            doc["results"].append({
                "topology": name, "impl": f"h3lab-strict-{name}", "dp_replicas": mesh.dp, "world_size": world,
                "sp": sp, "row_parallel": mesh.topology.strategy,
                "rows": request.layout.sequence_length, "transport": mesh.transport, "timing_label": LABEL,
                "loss_equal_ranks": [r["loss"] for r in ranks], "gradient_equal_ranks": [r["gradient"] for r in ranks],
                "bytes_equal": all(r["loss"] and r["gradient"] for r in ranks),
                "peak_mem_gib_ranks": [r["peak"] for r in ranks], "step_s_ranks": [r["step_s"] for r in ranks]})
            print(f"{name}: bytes equal {doc['results'][-1]['bytes_equal']}, peak "
                  f"{max(r['peak'] for r in ranks):.2f} GiB, step {max(r['step_s'] for r in ranks):.2f} s", flush=True)
            write(args.out, doc)
    dist.barrier()
    dist.destroy_process_group()
    return doc


if __name__ == "__main__":
    main()
