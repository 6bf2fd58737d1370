"""Streamed residency on a TP mesh (`ExecutionPlan(residency="streamed", mesh=...)`): the streamer runs after
`parallelize`, so each rank packs and streams only its TP shard. Two gloo ranks on the CPU, strict kernels under the
interpreter, the 12-head model of `dist_helpers` (its refiner block and 2 blocks are 3 streamed units through 2
slots): TP2 and TP2 + SP streamed are byte-equal to resident on the same mesh and to the one-process forward, and
each rank's streamed host bytes are its shard's (below the one-process model's). Refused with one line: streaming
with cp > 1 (`tests/components/test_execution.py`), parallelizing a streamed model, removing the plan of one."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import CONFIG, build_model, fl2va_forward

from h3lab.components import ExecutionPlan
from h3lab.components import streaming
from h3lab.distributed import DistributedError, init_mesh, parallelize, remove_plan
from h3lab.distributed.launch import spawn

CPU = torch.device("cpu")


def _streamed_ranks(rank: int, world: int) -> dict:
    out = {}
    for name, sp in (("tp2", False), ("tp2+sp", True)):
        model = build_model()
        plan = ExecutionPlan(CPU, "streamed", mesh=init_mesh(tp=2, sp=sp, device="cpu", config=CONFIG))
        plan.place(model, "transformer")
        streamer = streaming.streamer_of(model)
        out[f"{name}.streamed_units"] = ",".join(u.name for u in streamer.streamed)
        out[f"{name}.host_bytes"] = torch.tensor(sum(u.nbytes for u in streamer.streamed))
        video, audio, _ = fl2va_forward(model)
        out[f"{name}.streamed.video"], out[f"{name}.streamed.audio"] = video, audio
        plan.replace(residency="resident").place(model, "transformer")  # the same mesh, resident again
        out[f"{name}.resident_streamer"] = str(streaming.streamer_of(model))
        video, audio, _ = fl2va_forward(model)
        out[f"{name}.resident.video"], out[f"{name}.resident.audio"] = video, audio
    return out


def test_streamed_tp_equals_resident_and_one_process():
    ranks = spawn(_streamed_ranks, 2, timeout=900)
    one = build_model()
    video, audio, _ = fl2va_forward(one)
    whole = sum(u.nbytes for u in streaming.stream_blocks(one, CPU).streamed)
    for r, out in enumerate(ranks):
        for name in ("tp2", "tp2+sp"):
            assert out[f"{name}.streamed_units"] == "token_refiner.refiner_blocks.0,transformer_blocks.0,transformer_blocks.1"
            assert whole / 2 < int(out[f"{name}.host_bytes"]) < whole, "each rank streams only its shard"
            assert out[f"{name}.resident_streamer"] == "None"
            for how in ("streamed", "resident"):
                assert torch.equal(out[f"{name}.{how}.video"], video), f"rank {r} {name} {how}: video differs"
                assert torch.equal(out[f"{name}.{how}.audio"], audio), f"rank {r} {name} {how}: audio differs"


def test_a_streamed_model_is_not_parallelized_and_its_plan_not_removed():
    mesh = init_mesh(config=CONFIG)
    model = build_model(layers=1)
    streaming.stream_blocks(model, CPU)
    with pytest.raises(DistributedError, match="parallelize first, then stream") as exc:
        parallelize(model, mesh)
    assert "\n" not in str(exc.value)
    streaming.streamer_of(model).remove(restore=True)
    ExecutionPlan(CPU, "streamed", mesh=mesh).place(model, "transformer")  # the plan's order: parallelize, stream
    with pytest.raises(DistributedError, match="stop streaming first") as exc:
        remove_plan(model)
    assert "\n" not in str(exc.value)
