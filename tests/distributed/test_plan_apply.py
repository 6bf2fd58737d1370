"""The interpreted parallel plan: `apply_plan(model, mesh, TP_PLAN, CP_PLAN)` and its inverse `remove_plan`.

After apply + remove the model holds its original weights byte for byte, no hook of the plan is left on any module,
and its forward is byte-equal to a model never placed -- in one process (world size 1) and on two gloo ranks at
tp 2 with SP (weights sharded and gathered back, every CP-family entry interpreted as hooks). A plan entry naming no
module of the model is refused in one line and leaves the model unplaced, with its full weights. (The placed forward's
bytes are test_model_parallel.py's.) The hook view and the owner of a row read each hook point's `Sharded` layout
from the hook-point table (model/hooks.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_helpers import CONFIG, build_model, build_spec
from harness import run_ranks

from h3lab.execution import runtime
from h3lab.distributed import CP_PLAN, TP_PLAN, DistributedError, apply_plan, init_mesh, placement_of, remove_plan
from h3lab.distributed.placement import row_owner
from h3lab.distributed.plan import RowSplit
from h3lab.model.hooks import Sharded, sharded_layout
from h3lab.run import model_forward


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def _forward(model, spec, mode: str = "off"):
    x = spec.inputs
    with runtime.use_mode(mode), torch.no_grad():
        return model_forward(model, x, x.video, x.audio, 0)


def _same(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def test_apply_then_remove_in_one_process():
    spec = build_spec("t2va", passes=1)
    model = build_model()
    want = _forward(build_model(), spec)
    placement = apply_plan(model, init_mesh(config=CONFIG), TP_PLAN, CP_PLAN)
    assert placement_of(model) is placement and _hooks(model) == 2  # tp1 x cp1: the root hooks only
    remove_plan(model)
    assert placement_of(model) is None and _hooks(model) == 0
    assert _same(_forward(model, spec), want)
    with pytest.raises(DistributedError, match=r"^remove_plan: the H3Transformer has no placement"):
        remove_plan(model)


def test_layouts_come_from_the_hook_point_table():
    assert sharded_layout("blocks.1.q_rope") == Sharded("cp", "heads")
    assert sharded_layout("blocks.0.residual2") == Sharded("sp") and sharded_layout("refiner.0.q") == Sharded("all", 1)
    assert sharded_layout("scheduler.video") == Sharded()
    owner = row_owner({"tp": 2, "cp": 2, "sp": True}, "blocks.0.norm1", 18, 19)  # cp 1 holds rows [10, 19)
    assert (owner["ranks"], owner["cp"], owner["tp"], owner["local_row"]) == ([3], 1, 1, 3)
    owner = row_owner({"tp": 2, "cp": 2, "sp": True}, "blocks.0.q", 18, 19)  # a CP-level point: both TP ranks
    assert (owner["ranks"], owner["local_row"]) == ([2, 3], 8)


def _round_trip(rank: int, world: int) -> dict:
    spec = build_spec("t2va", passes=1)
    model = build_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    want = _forward(build_model(), spec)
    mesh = init_mesh(tp=2, sp=True, device="cpu", config=CONFIG)
    apply_plan(model, mesh, TP_PLAN, CP_PLAN)
    placed = _hooks(model)
    sharded = model.transformer_blocks[0].attn.to_q.weight.shape[0]
    remove_plan(model)
    info = {"placed_hooks": placed, "sharded_rows": sharded, "hooks_after": _hooks(model),
            "weights_back": all(torch.equal(v, original[k]) and v.dtype == original[k].dtype
                                for k, v in model.state_dict().items()),
            "forward_back": _same(_forward(model, spec), want)}
    bad = {**CP_PLAN, "transformer_blocks.*.nowhere": (RowSplit("x", 1, "sp", "a module the model lacks"),)}
    try:
        apply_plan(model, mesh, TP_PLAN, bad)
    except DistributedError as exc:
        info["refused"] = str(exc)
    info["after_refusal"] = [placement_of(model) is None, _hooks(model),
                             all(torch.equal(v, original[k]) for k, v in model.state_dict().items())]
    return {"info": json.dumps(info)}


def test_apply_then_remove_on_two_ranks_with_tp_and_sp():
    results = run_ranks(_round_trip, 2)
    for out in results:
        res = json.loads(out["info"])
        assert res["sharded_rows"] == CONFIG.num_attention_heads * CONFIG.attention_head_dim // 2
        assert res["placed_hooks"] > 2 and res["hooks_after"] == 0
        assert res["weights_back"] and res["forward_back"]
        assert res["refused"] == "plan entry 'transformer_blocks.*.nowhere' names no module of the model"
        assert res["after_refusal"] == [True, 0, True]
