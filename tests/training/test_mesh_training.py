"""Strict training on a CP (Ulysses) and a TP mesh (`h3lab.distributed.autograd`, `tp_autograd`): two gloo ranks on
the CPU, strict kernels under the interpreter.

- A LoRA step (every attention and FFN projection, in the block and the token refiner) on a 4-head config the other
  tests do not use, over a 15-row layout (CP2 shards 8 + 7): the loss and every LoRA gradient on both ranks are
  byte-equal to the one-process strict step; and DP2 x CP2 (4 ranks, one request per replica, the data-parallel
  tree over the DP group): the batch loss, the batch gradient and every request's digest equal one process's. TP2 on
  the same config and layout: every LoRA gradient byte-equal (the frozen base's dX from the gathered dY and weight).
- The weight-gradient rule at tensor level: the gathered-rows form equals the one-process kernel's dW / dB / dX; the
  rank-partials form (each rank's own rows, summed in rank order) does not -- the test that can fail. TP's dX rule
  likewise: the gathered form equals the kernel's backward, rank partials summed do not.
- Refusals: a trainable parameter whose gradient reduces over the split rows outside a block projection, and
  gradient checkpointing, are refused on every rank alike with one line.

The CP2 step, the TP2 step and the tensor-level rule (with the refusals) run in one launch of two ranks, one after
the other (each on its own mesh and model); each test checks its own part."""

from __future__ import annotations

import pytest
import torch
from lora_cases import lora_model
from rank_cases import of_case, prefixed
from training_cases import SMALL, make_clip

from h3lab import H3Config
from h3lab.execution import runtime
from h3lab.distributed.launch import spawn
from h3lab.run.layout import build_layout
from h3lab.training import Objective, compute_gradients, trainable_parameters
from h3lab.training.step import split_flat

CONFIG = H3Config(**{**SMALL.to_diffusers(), "num_attention_heads": 4})  # 4 x 8 = 32 inner, hidden 28, 1 block
OBJECTIVE = Objective(audio_weight=0.5)


def _layout():
    """fl2va, 15 rows: 3 text, a first-frame anchor and one target frame on a 2x2 grid, 3 audio latents."""
    return build_layout("fl2va", [1] * 3, 2, 4, 4, 3, anchors=("first",), patch_size=CONFIG.patch_size)


def _request(seed: int = 17):
    return make_clip(CONFIG, _layout(), seed=seed)


SEEDS = (17, 18)


@pytest.fixture(scope="module")
def one():
    """The one-process strict step over both requests (request 0 alone is the CP2 case's)."""
    model = lora_model(config=CONFIG)
    return model, compute_gradients(model, [_request(s) for s in SEEDS], OBJECTIVE, mode="strict", keep=True)


def _two_ranks(rank: int, world: int) -> dict:
    """The 2-rank cases in one launch: the CP2 step, the TP2 step, the weight rule and refusals (keys prefixed)."""
    out = {}
    for case, fn in (("cp", _cp_step), ("tp", _tp_step), ("rule", _weight_rule)):
        out.update(prefixed(case, fn(rank, world)))
    return out


@pytest.fixture(scope="module")
def two_ranks():
    ranks = spawn(_two_ranks, 2, timeout=1800)
    return lambda case: of_case(ranks, case)


def _cp_step(rank: int, world: int) -> dict:
    from h3lab.distributed import init_mesh, parallelize, placement_of

    model = lora_model(config=CONFIG)
    parallelize(model, init_mesh(cp=2, config=CONFIG))
    result = compute_gradients(model, [_request()], OBJECTIVE, mode="strict")
    log = placement_of(model)._log
    algorithms = sorted({f"{r.name}: {r.point}" for r in log.records if "(backward)" in r.point
                         or "(weight gradient)" in r.point})
    return {"gradient": result.gradient, "loss": result.loss, "backward": "|".join(algorithms)}


def test_cp2_lora_step_equals_one_process(one, two_ranks):
    ranks = two_ranks("cp")
    model, batch = one
    one = batch.request_gradients[0]
    params = trainable_parameters(model)
    assert any(n.startswith("token_refiner.") for n, _ in params) and any(".to_out.0." in n for n, _ in params)
    for r, out in enumerate(ranks):
        assert torch.equal(out["loss"], one.loss), f"rank {r}: loss differs from one process"
        got, want = split_flat(out["gradient"], params), split_flat(one.gradient, params)
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {r}: {name} differs from one process"
            assert got[name].abs().max() > 0, name  # a backward reached every factor
        backward = out["backward"]
        assert "gather_rows: transformer_blocks.0 (backward)" in backward  # the block-0 cut's gradient gather
        assert "heads_to_rows: blocks.0.attention (backward)" in backward  # Ulysses' inverse exchange
        assert "gather_rows: blocks.0.q.lora_a (weight gradient)" in backward


def _tp_step(rank: int, world: int) -> dict:
    from h3lab.distributed import init_mesh, parallelize, placement_of

    model = lora_model(config=CONFIG)
    placement = parallelize(model, init_mesh(tp=2, config=CONFIG))
    result = compute_gradients(model, [_request()], OBJECTIVE, mode="strict")
    log = placement_of(model)._log
    algorithms = sorted({f"{r.name}: {r.point}" for r in log.records if "(backward)" in r.point})
    shapes = {n: list(p.shape) for n, p in model.named_parameters() if n.endswith("to_q.base_layer.weight")}
    out = {"gradient": result.gradient, "loss": result.loss, "backward": "|".join(algorithms),
           "shapes": repr(sorted(shapes.items())), "points": repr(sorted(placement.tp_points.items()))}
    return out  # TP2 + SP training: test_mesh_training_sp.py


def test_tp2_lora_step_equals_one_process(one, two_ranks):
    """TP2 (4 heads, 2 a rank; to_q 16 of 32 rows, the SwiGLU [value; gate] halves, the row-parallel tree's 4 of 8
    chunks): every LoRA factor's gradient on both ranks equals one process's, with the declared backward gathers."""
    ranks = two_ranks("tp")
    model, batch = one
    want = split_flat(batch.request_gradients[0].gradient, trainable_parameters(model))
    for r, out in enumerate(ranks):
        assert "[16, 28]" in out["shapes"]  # the base weights hold the rank's shard
        assert "('blocks.0.ffn_up', ('col', 2))" in out["points"] and "('blocks.0.o_proj', ('row', 1))" in out["points"]
        assert torch.equal(out["loss"], batch.request_gradients[0].loss), f"rank {r}: loss differs from one process"
        got = split_flat(out["gradient"], trainable_parameters(model))
        for name in want:
            assert torch.equal(got[name], want[name]), f"rank {r}: {name} differs from one process"
        backward = out["backward"]
        for point in ("blocks.0.q (backward)", "blocks.0.q.lora_b (backward)", "blocks.0.ffn_up (backward)",
                      "refiner.0.ffn_up.lora_b (backward)"):
            assert f"gather_columns: {point}" in backward, point


def test_tp_column_gradient_gathers_and_rank_partials_differ():
    """The TP rule at tensor level (one process, no ranks): dX of a column-parallel layer as `tp_autograd` forms it
    (the gathered dY and weight, `linear(dY, W^T)`) equals the strict kernel's own backward; the reduce-scatter form
    (each rank's dY_r @ W_r, summed in rank order) does not."""
    from h3lab.distributed import tp_autograd

    g = torch.Generator().manual_seed(5)
    x, w, dy = torch.randn(1, 37, 48, generator=g), torch.randn(256, 48, generator=g), torch.randn(1, 37, 256, generator=g)
    with runtime.use_mode("strict"):
        leaf = x.clone().requires_grad_()
        runtime.mode_op("linear")(leaf, w).backward(dy)
        assert torch.equal(tp_autograd._dx("strict", dy, w, x.dtype), leaf.grad)
        halves = [tp_autograd._dx("strict", dy[..., i * 128:(i + 1) * 128], w[i * 128:(i + 1) * 128], x.dtype)
                  for i in (0, 1)]
        assert not torch.equal(halves[0] + halves[1], leaf.grad)


def _dp_cp_step(rank: int, world: int) -> dict:
    from h3lab.distributed import init_mesh, parallelize
    from h3lab.training import data_parallel_gradients

    model = lora_model(config=CONFIG)
    mesh = init_mesh(cp=2, dp=2, config=CONFIG)
    parallelize(model, mesh)
    result = data_parallel_gradients(model, [_request(s) for s in SEEDS], OBJECTIVE, group=mesh.dp_group,
                                     mode="strict")
    return {"gradient": result.gradient, "loss": result.loss, "digests": "|".join(result.request_digests),
            "groups": f"{mesh.group_ranks('cp')} dp {mesh.dp_rank}"}


def test_dp2_x_cp2_lora_step_equals_one_process(one):
    ranks = spawn(_dp_cp_step, 4, timeout=1200)
    _, batch = one
    for r, out in enumerate(ranks):
        assert out["groups"] == f"{[0, 1] if r < 2 else [2, 3]} dp {r // 2}"
        assert out["digests"] == "|".join(batch.request_digests), f"rank {r}: a request's gradient differs"
        assert torch.equal(out["loss"], batch.loss), f"rank {r}: batch loss differs from one process"
        assert torch.equal(out["gradient"], batch.gradient), f"rank {r}: batch gradient differs from one process"


# --------------------------------------------------------------------------------------- tensor-level rule
ROWS, K, N = 203, 40, 16  # 203 rows: CP2 shards 102 + 101, several 32-row dW tiles on each side


def _weight_rule(rank: int, world: int) -> dict:
    from h3lab.distributed import autograd as mesh_autograd
    from h3lab.distributed import init_mesh
    from h3lab.model import layers

    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(1, ROWS, K, generator=g), torch.randn(1, ROWS, N, generator=g)
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    out = {}
    with runtime.use_mode("strict"):
        ref = [t.clone().requires_grad_() for t in (x, w, b)]
        runtime.mode_op("linear")(*ref).backward(dy)  # the one-process kernel's backward
        mesh = init_mesh(cp=2)
        rows = mesh.row_shards(ROWS)
        part = mesh.local_rank("cp")
        for form in mesh_autograd.WEIGHT_GRADS:
            leaves = [rows.take(x, part, 1).contiguous().requires_grad_(), w.clone().requires_grad_(),
                      b.clone().requires_grad_()]
            ops = runtime.ops("cpu")
            y = mesh_autograd.linear("linear", ops, "blocks.0.q.lora_a", *leaves, mesh, rows, form)
            y.backward(rows.take(dy, part, 1))
            for name, leaf, truth in zip(("dx", "dw", "db"), leaves, (rows.take(ref[0].grad, part, 1), ref[1].grad,
                                                                        ref[2].grad)):
                out[f"{form}.{name}"] = torch.tensor(torch.equal(leaf.grad, truth))
        # refusals, on every rank alike: a norm weight trains outside a block projection; checkpointing
        from h3lab.distributed import parallelize

        model = lora_model(config=CONFIG)
        parallelize(model, mesh)
        sample = _request().sample(OBJECTIVE)
        for case in ("norm", "checkpointing"):
            if case == "norm":
                model.transformer_blocks[0].norm1.weight.requires_grad_(True)
            else:
                model.transformer_blocks[0].norm1.weight.requires_grad_(False)
                model.gradient_checkpointing = True
            try:
                model(**sample.canonical().model_kwargs())
                out[case] = "ran"
            except Exception as exc:  # noqa: BLE001 - the message is what the test reads
                out[case] = str(exc)
        model.gradient_checkpointing = False
    return out


def test_weight_gradient_gathers_rows_and_rank_partials_differ(two_ranks):
    ranks = two_ranks("rule")
    for r, out in enumerate(ranks):
        for name in ("dx", "dw", "db"):
            assert bool(out[f"gather.{name}"]), f"rank {r}: gathered-rows {name} differs from one process"
        assert bool(out["rank_partials.dx"]), "dX is row-invariant: the rank's rows alone give it"
        assert not bool(out["rank_partials.dw"]), f"rank {r}: rank partials summed in rank order equal one process"
        assert not bool(out["rank_partials.db"]), f"rank {r}: rank partials of dB equal one process"
        assert "trainable parameter 'transformer_blocks.0.norm1.weight' has no declared mesh gradient" in out["norm"]
        assert "gradient checkpointing recomputes blocks outside the sharded forward" in out["checkpointing"]
        for case in ("norm", "checkpointing"):
            assert out[case] == ranks[0][case] and "\n" not in out[case]


def test_data_parallel_degree_is_checked_with_one_line():
    from h3lab.distributed import TopologyError, init_mesh

    for dp, said in ((2, "world size 1 != dp * tp * cp = 2 * 1 * 1 = 2"), (0, "dp=0: must be a positive integer")):
        with pytest.raises(TopologyError) as exc:
            init_mesh(cp=1, dp=dp)
        assert str(exc.value) == said
