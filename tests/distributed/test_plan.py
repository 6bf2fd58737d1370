"""One-process tests of `h3lab.distributed`: the plan covers every parameter of the model exactly once, weight
sharding reassembles the original bytes for TP 1-4 (k_chunks and n_split), the grouped layouts are the ones the
styles promise, row shards are uneven without padding, topology rules refuse with one line, and a world-size-1 mesh
runs the collectives' code path with the one-process bytes."""

from __future__ import annotations

import re

import pytest
import torch
from dist_helpers import CONFIG, ROWS, randn

from h3kernels import gemm
from h3lab import H3Config, H3Transformer
from h3lab.distributed import (
    CP_PLAN,
    TP_PLAN,
    DistributedError,
    RowShards,
    Topology,
    TopologyError,
    begin_log,
    cat_grouped,
    check_config,
    gather_columns,
    gather_rows,
    init_mesh,
    row_parallel_tree,
    rows_to_heads,
    shard_parameters_,
    shard_state_dict,
    split_grouped,
    supported_tp,
    unshard_state_dict,
)
from h3lab.distributed.plan import column_groups, plan_entry
from h3lab.model import random_state_dict


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def _released_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights in the released dtypes (bf16 blocks, float32 modules)."""
    model = H3Transformer(CONFIG)
    model.load_state_dict(random_state_dict(CONFIG, seed))
    return model.state_dict()


# ---------------------------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("config", [CONFIG, H3Config.full()], ids=["dist12", "full"])
def test_every_parameter_has_exactly_one_plan_entry(config):
    with torch.device("meta"):
        keys = list(H3Transformer(config).state_dict())
    styles = {key: plan_entry(key)[1].style for key in keys}
    assert styles["transformer_blocks.0.attn.to_q.weight"] == "colwise_heads"
    assert styles["transformer_blocks.1.ff.net.0.proj.weight"] == "colwise_swiglu"
    assert styles["transformer_blocks.1.ff.net.2.weight"] == "rowwise_tree"
    assert styles["transformer_blocks.0.attn.to_out.0.weight"] == "rowwise_tree"
    assert styles["transformer_blocks.0.adaln_proj.linear.bias"] == "colwise_adaln"
    assert styles["token_refiner.refiner_blocks.0.attn.to_k.weight"] == "colwise_heads"
    assert styles["transformer_blocks.0.attn.norm_q.weight"] == "replicated"
    assert styles["proj_out.weight"] == "replicated"
    assert all(entry.reason for entry in TP_PLAN.values())


def test_a_parameter_outside_the_plan_is_refused():
    with pytest.raises(DistributedError) as exc:
        plan_entry("transformer_blocks.0.attn.to_x.weight")
    assert "no plan entry" in _one_line(exc)
    overlapping = {**TP_PLAN, "transformer_blocks.0.attn.to_q": TP_PLAN["proj_in"]}
    with pytest.raises(DistributedError) as exc:
        plan_entry("transformer_blocks.0.attn.to_q.weight", overlapping)
    assert "2 plan entries" in _one_line(exc)


def test_cp_plan_names_modules_of_the_model():
    names = [name for name, _ in H3Transformer(CONFIG).named_modules()]
    for pattern in CP_PLAN:
        regex = pattern.replace(".", r"\.").replace("*", r"\d+")
        assert any(re.fullmatch(regex, n) for n in names), pattern


# --------------------------------------------------------------------------------------------- weight shards
@pytest.mark.parametrize("tp, row_parallel", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (4, "n_split")])
def test_shards_reassemble_the_original_bytes(tp, row_parallel):
    sd = _released_state_dict()
    shards = [shard_state_dict(sd, CONFIG, tp, r, row_parallel=row_parallel) for r in range(tp)]
    full = unshard_state_dict(shards, CONFIG, row_parallel=row_parallel)
    assert list(full) == list(sd)
    for key, value in sd.items():
        assert full[key].dtype == value.dtype and torch.equal(full[key], value), key
    if tp == 1:
        assert all(shards[0][k] is sd[k] for k in sd)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_shards_follow_their_styles(tp):
    sd, c = _released_state_dict(), CONFIG
    blk = "transformer_blocks.1."
    for r in range(tp):
        sh = shard_state_dict(sd, c, tp, r)
        heads = c.num_attention_heads // tp * c.attention_head_dim
        assert torch.equal(sh[blk + "attn.to_v.weight"], sd[blk + "attn.to_v.weight"][r * heads:(r + 1) * heads])
        f = c.ffn_dim // tp
        value, gate = sd[blk + "ff.net.0.proj.weight"].chunk(2)
        expect = torch.cat([value[r * f:(r + 1) * f], gate[r * f:(r + 1) * f]])
        assert torch.equal(sh[blk + "ff.net.0.proj.weight"], expect)  # [value_r; gate_r]
        h = c.hidden_size // tp
        for name, groups in (("adaln_proj.linear", 18), ):
            for param in ("weight", "bias"):
                full = sd[blk + f"{name}.{param}"].unflatten(0, (groups, c.hidden_size))
                got = sh[blk + f"{name}.{param}"].unflatten(0, (groups, h))
                assert torch.equal(got, full[:, r * h:(r + 1) * h]), param  # 6 tensors x 3 modalities kept
        shift, scale = sd["norm_out.linear.bias"].chunk(2)
        assert torch.equal(sh["norm_out.linear.bias"], torch.cat([shift[r * h:(r + 1) * h], scale[r * h:(r + 1) * h]]))
        w = sd[blk + "ff.net.2.weight"]
        if tp in (2, 4):  # k_chunks: K columns, whole tree chunks
            k = c.ffn_dim // tp
            assert torch.equal(sh[blk + "ff.net.2.weight"], w[:, r * k:(r + 1) * k])
            assert (k // (c.ffn_dim // gemm.TREE_CHUNKS)) == gemm.TREE_CHUNKS // tp
        else:  # n_split: output rows
            assert torch.equal(sh[blk + "ff.net.2.weight"], w[r * h:(r + 1) * h])
        assert sh["proj_out.weight"] is sd["proj_out.weight"]
        assert sh[blk + "attn.norm_k.weight"] is sd[blk + "attn.norm_k.weight"]


def test_column_groups_follow_the_plan():
    assert column_groups("transformer_blocks.0.attn.to_q", CONFIG.inner_dim, CONFIG) == 1
    assert column_groups("transformer_blocks.0.ff.net.0.proj", 2 * CONFIG.ffn_dim, CONFIG) == 2
    assert column_groups("transformer_blocks.0.adaln_proj.linear", CONFIG.adaln_dim, CONFIG) == 18
    assert column_groups("norm_out.linear", 2 * CONFIG.hidden_size, CONFIG) == 2
    with pytest.raises(DistributedError):
        column_groups("transformer_blocks.0.ff.net.2", CONFIG.hidden_size, CONFIG)


def test_unshard_refuses_replicated_tensors_that_differ():
    sd = _released_state_dict()
    shards = [shard_state_dict(sd, CONFIG, 2, r) for r in range(2)]
    shards[1] = {**shards[1], "proj_in.bias": shards[1]["proj_in.bias"] + 1}
    with pytest.raises(DistributedError) as exc:
        unshard_state_dict(shards, CONFIG)
    assert "proj_in.bias" in _one_line(exc) and "rank 1" in str(exc.value)


def test_shard_parameters_in_place_keeps_the_parameter_objects():
    sd = _released_state_dict()
    model = H3Transformer(CONFIG)
    model.load_state_dict(sd)
    before = {n: p for n, p in model.named_parameters()}
    split = shard_parameters_(model, CONFIG, 4, 3)
    expect = shard_state_dict(sd, CONFIG, 4, 3)
    assert "transformer_blocks.0.attn.to_q.weight" in split and "proj_in.weight" not in split
    for name, param in model.named_parameters():
        assert param is before[name] and torch.equal(param.data, expect[name]), name
    assert model.rope.inv_freq.dtype == torch.float32  # buffers untouched


def test_bad_tp_for_the_weights_is_refused():
    sd = _released_state_dict()
    with pytest.raises(TopologyError) as exc:
        shard_state_dict(sd, CONFIG, 5, 0)
    assert "tp=5: must divide num_attention_heads=12" in _one_line(exc)
    with pytest.raises(DistributedError) as exc:
        shard_state_dict(sd, CONFIG, 2, 2)
    assert "rank=2" in _one_line(exc)
    with pytest.raises(TopologyError) as exc:
        shard_state_dict(sd, CONFIG, 3, 0, row_parallel="k_chunks")
    assert "row_parallel='k_chunks' at tp=3: tp must divide the 8 tree chunks" in _one_line(exc)


# ------------------------------------------------------------------------------------------------ index maths
def test_row_shards_are_uneven_contiguous_and_name_owners():
    rows = RowShards(ROWS, 3)
    assert rows.sizes == (7, 6, 6) and rows.offsets == (0, 7, 13)
    assert RowShards(ROWS, 2).sizes == (10, 9)
    assert [rows.owner(r) for r in (0, 6, 7, 18)] == [(0, 0), (0, 6), (1, 0), (2, 5)]
    x = randn(1, 2, ROWS, 4)
    assert torch.equal(torch.cat(rows.split(x, 1), dim=1), x)
    assert torch.equal(rows.take(x, 2, 1), x[:, 13:])
    with pytest.raises(TopologyError) as exc:
        RowShards(2, 3)
    assert "cp=3 is larger than the 2 rows" in _one_line(exc)
    with pytest.raises(DistributedError):
        rows.owner(19)
    with pytest.raises(DistributedError):
        rows.take(x, 0, 2)  # dim 2 does not hold the rows


@pytest.mark.parametrize("groups, parts", [(1, 4), (2, 3), (18, 2)])
def test_grouped_split_and_cat_are_inverse(groups, parts):
    t = randn(2, groups * parts * 2, 5, dtype=torch.float32)
    pieces = [split_grouped(t, 0, groups, parts, i) for i in range(parts)]
    assert all(p.shape == (groups * 2, 5) for p in pieces)
    assert torch.equal(pieces[1].unflatten(0, (groups, 2)), t.unflatten(0, (groups, parts, 2))[:, 1])
    assert torch.equal(cat_grouped(pieces, 0, groups), t)
    with pytest.raises(DistributedError):
        split_grouped(t, 0, groups, parts * 3, 0)


# -------------------------------------------------------------------------------------------------- topologies
def test_topology_rules_for_the_released_model():
    full = H3Config.full()
    assert supported_tp(full)[:5] == (1, 2, 4, 7, 8)
    for tp, cp in ((1, 1), (2, 1), (4, 2), (7, 1), (8, 1), (1, 8), (2, 4)):
        check_config(Topology(tp, cp), full)
    with pytest.raises(TopologyError) as exc:
        check_config(Topology(3, 1), full)
    assert _one_line(exc).startswith("tp=3: must divide num_attention_heads=56")
    with pytest.raises(TopologyError) as exc:
        check_config(Topology(8, 2), full)
    assert "cp=2: must divide the 7 heads of one tp rank" in _one_line(exc)
    with pytest.raises(TopologyError) as exc:
        check_config(Topology(4, 2), CONFIG)
    assert "cp=2: must divide the 3 heads" in _one_line(exc)


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 2}, "world size 1 != tp * cp = 2 * 1 = 2"),
    ({"cp": 0}, "cp=0: must be a positive integer"),
    ({"sp": True}, "sp=True with tp=1"),
    ({"device": "meta"}, "device meta: must be cpu or cuda"),
    ({"device": "cuda:0"}, "CUDA is not available"),
    ({"row_parallel": "ring"}, "row_parallel='ring': must be one of ('auto', 'k_chunks', 'n_split')"),
])
def test_init_mesh_refuses_bad_topologies_without_a_process_group(kwargs, message):
    if kwargs.get("device") == "cuda:0" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TopologyError) as exc:
        init_mesh(**kwargs)
    assert message in _one_line(exc)


def test_world_size_one_runs_the_same_code_path():
    """No process group: every collective is the local identity, the arithmetic the same kernels, the bytes
    one-process bytes, and the log says nothing was moved."""
    mesh = init_mesh(config=CONFIG)
    assert mesh.group("tp") is None and mesh.coords == {"cp": 0, "tp": 0} and mesh.group_ranks("cp") == [0]
    log = begin_log(mesh)
    x, w, b = randn(1, 1, 5, 96), randn(2, 24, 96), randn(3, 24)
    with torch.no_grad():
        assert torch.equal(row_parallel_tree(x, w, b, mesh), gemm.linear_tree(x, w, b))
        q = randn(4, 1, ROWS, 6, 8)
        rows = mesh.row_shards(ROWS)
        assert torch.equal(rows_to_heads(q, mesh, rows), q)
        assert torch.equal(gather_rows(q, mesh, rows), q)
        assert torch.equal(gather_columns(x, mesh, groups=2), x)
    assert [r.transport for r in log.records] == ["none"] * 4
    assert log.records[0].algorithm == "linear_tree (tp 1, nothing moved)"
    assert log.to_dict()["mesh"]["topology"]["world_size"] == 1


def test_collectives_are_forward_only():
    mesh = init_mesh()
    x = randn(1, 1, 5, 96, dtype=torch.float32).requires_grad_()
    with pytest.raises(DistributedError) as exc:
        row_parallel_tree(x, randn(2, 24, 96, dtype=torch.float32), None, mesh)
    assert "forward-only" in _one_line(exc)


def test_row_parallel_weight_of_the_wrong_layout_is_refused():
    mesh = init_mesh()
    with pytest.raises(DistributedError) as exc:
        row_parallel_tree(randn(1, 1, 5, 96), randn(2, 24, 48), None, mesh)
    assert "k_chunks" in _one_line(exc)
