"""One rank of the data-parallel test (spawned twice over gloo on the CPU): the sealed training runs of `CASES` with
`data_parallel=True`, and torch's usual data-parallel gradient (each rank one batched backward over its block, then an
all-reduce sum); writes its step records and tensors to `<out>/rank<r>.{json,safetensors}`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from training_cases import SMALL, batched_torch_gradient, build_model, make_clip, make_dataset, make_layout

from h3lab.training import Objective, OptimizerConfig, TrainConfig, rank_block, train

# name -> (mode, steps, global batch): 2 ranks x 2 requests (one tree node each), 1 + 2 requests (rank 1 sends two
# nodes), and strict with one request per rank.
CASES = {"aligned": ("off", 2, 4), "unaligned": ("off", 1, 3), "strict": ("strict", 1, 2)}
WEIGHT_SEED = 61
USUAL_SEEDS = (301, 302, 303, 304)  # four clips sharing one sigma draw (one batched forward per rank)


def config(name: str) -> TrainConfig:
    mode, steps, batch = CASES[name]
    return TrainConfig(steps=steps, batch_size=batch, seed=2, mode=mode, optim=OptimizerConfig(lr=1e-2, weight_decay=1e-2),
                       objective=Objective(audio_weight=0.5))


def usual_requests():
    layout = make_layout("fl2va")
    return [make_clip(SMALL, layout, seed=s, draw_seed=8) for s in USUAL_SEEDS]


def worker(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=world)
    try:
        records, tensors = {}, {}
        for name in CASES:
            model = build_model(SMALL, "released", WEIGHT_SEED)
            run = train(model, make_dataset(), config(name), data_parallel=True)
            records[name] = run.steps
            tensors.update({f"{name}.{n}": p.detach().clone() for n, p in model.named_parameters()})
        # torch's usual path: the mean over this rank's block, all-reduce sum, divided by the world size
        model = build_model(SMALL, "released", WEIGHT_SEED)
        requests = usual_requests()
        start, stop = rank_block(len(requests), rank, world)
        grad = batched_torch_gradient(model, requests[start:stop], Objective())
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        tensors["usual.gradient"] = grad / world
        Path(out, f"rank{rank}.json").write_text(json.dumps(records))
        save_file(tensors, str(Path(out, f"rank{rank}.safetensors")))
    finally:
        dist.destroy_process_group()
