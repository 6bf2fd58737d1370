"""Strict training with sequence parallelism and with TP's `n_split` row-parallel form (`h3lab.distributed.autograd`,
`tp_autograd`): gloo ranks on the CPU, strict kernels under the interpreter.

SP cuts the residual stream of each CP shard over its TP ranks; its collectives carry a declared backward: the
block-0 SP cut all-gathers the rows' gradients, the SP row gathers before attention / the FFN and at the output
take the rank's slice of the replicated gradient (never a reduce-scatter), the row-parallel layer that returns SP
rows gathers dY's rows before its one-process dX, and a row-parallel layer's LoRA B runs on the CP shard's rows and
keeps the rank's (its backward all-gathers their gradient).

- TP2 + SP (`k_chunks`) and TP2 `n_split` + SP in one launch of two ranks, on the 4-head config of
  `test_mesh_training.py` over its 15-row fl2va layout (SP shards 8 + 7), LoRA on every block and refiner
  projection: the loss and every LoRA gradient on both ranks byte-equal to the one-process strict step, with the
  SP backward gathers in the collective log.
- An unusual config (6 heads of 8, hidden 24, FFN 24, 2 blocks) at TP3 + SP: `auto` picks `n_split`
  at tp 3, 17 ref2va rows cut 6 + 6 + 5, batch of one request: every gradient byte-equal to one process."""

from __future__ import annotations

import torch
from lora_cases import lora_model
from training_cases import SMALL, make_clip

from h3lab import H3Config
from h3lab.distributed.launch import spawn
from h3lab.run.layout import Reference, build_layout
from h3lab.training import Objective, compute_gradients, trainable_parameters
from h3lab.training.step import split_flat

TINY = H3Config(**{**SMALL.to_diffusers(), "num_attention_heads": 4})  # test_mesh_training.py's 4-head config
ODD = H3Config(**{**SMALL.to_diffusers(), "num_attention_heads": 6, "hidden_size": 24, "ffn_dim": 24, "num_layers": 2})
OBJECTIVE = Objective(audio_weight=0.5)
CASES = {"tp2+sp": {"tp": 2, "sp": True}, "tp2.n_split+sp": {"tp": 2, "sp": True, "row_parallel": "n_split"}}


def _request(config: H3Config):
    p = config.patch_size
    if config is TINY:  # fl2va, 15 rows: 3 text, a first-frame anchor and one target frame on 2x2, 3 audio latents
        layout = build_layout("fl2va", [1] * 3, 2, 4, 4, 3, anchors=("first",), patch_size=p)
    else:  # ref2va, 17 rows: an image and an audio reference
        layout = build_layout("ref2va", [1] * 3, 1, 2, 4, 3, references=(Reference.image(2, 4), Reference.audio(2)),
                              patch_size=p)
    return make_clip(config, layout, seed=23)


def _one(config: H3Config):
    model = lora_model(config=config)
    result = compute_gradients(model, [_request(config)], OBJECTIVE, mode="strict")
    return model, result


def _step(config: H3Config, **topology) -> dict:
    from h3lab.distributed import init_mesh, parallelize, placement_of

    model = lora_model(config=config)
    placement = parallelize(model, init_mesh(config=config, **topology))
    result = compute_gradients(model, [_request(config)], OBJECTIVE, mode="strict")
    records = placement_of(model)._log.records
    backward = sorted({f"{r.name}[{r.dim}]: {r.point}" for r in records if "(backward)" in r.point})
    return {"gradient": result.gradient, "loss": result.loss, "backward": "|".join(backward),
            "strategy": placement.topology.strategy}


def _tiny_ranks(rank: int, world: int) -> dict:
    out = {}
    for case, topology in CASES.items():
        out.update({f"{case}.{k}": v for k, v in _step(TINY, **topology).items()})
    return out


def _odd_ranks(rank: int, world: int) -> dict:
    return _step(ODD, tp=3, sp=True)


def _check(out: dict, model, want, rank: int, case: str) -> None:
    params = trainable_parameters(model)
    assert torch.equal(out["loss"], want.loss), f"rank {rank} {case}: loss differs from one process"
    got, flat = split_flat(out["gradient"], params), split_flat(want.gradient, params)
    for name in flat:
        assert torch.equal(got[name], flat[name]), f"rank {rank} {case}: {name} differs from one process"
        assert flat[name].abs().max() > 0, name  # a backward reached every factor


def test_tp2_sp_and_n_split_lora_steps_equal_one_process():
    ranks = spawn(_tiny_ranks, 2, timeout=900)
    model, want = _one(TINY)
    for r, out in enumerate(ranks):
        for case in CASES:
            got = {k[len(case) + 1:]: v for k, v in out.items() if k.startswith(case + ".")}
            _check(got, model, want, r, case)
            assert got["strategy"] == ("n_split" if "n_split" in case else "k_chunks")
            backward = got["backward"]
            for point in ("gather_rows[tp]: transformer_blocks.0 (backward)",  # the block-0 SP cut
                          "gather_rows[tp]: blocks.0.o_proj (backward)",  # dY's SP rows, row-parallel base
                          "gather_rows[tp]: blocks.0.o_proj.lora_b (backward)"):  # the B factor's SP rows
                assert point in backward, (case, point, backward)
            assert "gather_columns[tp]: blocks.0.q (backward)" in backward


def test_tp3_sp_n_split_on_an_unusual_config_equals_one_process():
    ranks = spawn(_odd_ranks, 3, timeout=900)
    model, want = _one(ODD)
    for r, out in enumerate(ranks):
        assert out["strategy"] == "n_split"
        _check(out, model, want, r, "tp3+sp")
        assert "gather_rows[tp]: blocks.1.ffn_down (backward)" in out["backward"]
