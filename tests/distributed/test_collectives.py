"""Multi-process tests of the strict collectives: N gloo ranks on CPU (Triton interpreter), results compared with the
one-process strict kernels byte for byte.

- TP 2 and 4 ("k_chunks": 4 / 2 tree chunks per rank), TP 3 ("n_split", the TP7-on-7168 case on a tiny width:
  K 96 in 3 shards of 32 cuts the 12-wide tree chunks) and TP 4 with "n_split" asked for: the row-parallel tree equals `linear_tree` on the full K, on
  every rank, also with sequence-parallel output rows (uneven), in bf16 and in float32 (whose outputs are sensitive
  to the K order: the flat K loop differs from the tree on these inputs); column-parallel strict `linear` shards of q (heads),
  `ff.net.0.proj` ([value_r; gate_r], and the local strict SwiGLU on them) and the AdaLN table (6 x 3 blocks, with
  bias) equal the grouped slices of the full outputs, and `gather_columns` restores the full outputs.
- CP 2 and 3 over 19 rows (shards 10 + 9, 7 + 6 + 6): the Ulysses exchange round-trips exactly and hands each rank
  all rows of its heads; strict attention over the exchanged heads, with a random canonical `key_order` and without,
  equals one-process strict attention; hidden rows and every per-row metadata tensor co-shard, a strict AdaLN
  modulation on the shards gathers to the one-process bytes, and the same modulation with the metadata left
  unsharded (H17) does not; document metadata and cp > rows are refused.
- TP 2 x CP 2 + SP on four ranks: the mesh's groups are the declared ones; Ulysses inside the CP groups on
  TP-sharded heads and the tree inside the TP groups (to SP rows) reproduce the one-process bytes.
- Bad topologies on two ranks: world size, head count, SP without TP, ranks that disagree and mixed devices are
  refused with the same one-line error on every rank, and a valid mesh still works afterwards.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from dist_helpers import CONFIG, ROWS, permutation, randn
from harness import run_ranks

from h3kernels import attention as strict_attention
from h3kernels import gemm
from h3kernels.registry import STRICT_OPS
from h3lab import H3Config
from h3lab.distributed import (
    DistributedError,
    RowShards,
    TopologyError,
    begin_log,
    gather_columns,
    gather_rows,
    heads_to_rows,
    init_mesh,
    row_parallel_tree,
    rows_to_heads,
    scatter_rows,
    split_grouped,
    tree_strategy,
    ulysses_attention,
)
from h3lab.distributed.plan import column_groups, shard_tensor

SEQ = 5  # rows of the TP cases (SP shards 3 + 2, 2 + 1 + 1 + 1, 2 + 2 + 1)
O_PROJ = "transformer_blocks.0.attn.to_out.0"
COLUMN_CASES = {  # name: (module path, input seed/shape, weight shape, bias)
    "q": ("transformer_blocks.0.attn.to_q", (1, SEQ, CONFIG.hidden_size), (CONFIG.inner_dim, CONFIG.hidden_size), False),
    "ffn_up": ("transformer_blocks.0.ff.net.0.proj", (1, SEQ, CONFIG.hidden_size),
               (2 * CONFIG.ffn_dim, CONFIG.hidden_size), False),
    "adaln": ("transformer_blocks.0.adaln_proj.linear", (2, CONFIG.time_embed_dim),
              (CONFIG.adaln_dim, CONFIG.time_embed_dim), True),
}


def _tree_inputs(dtype):
    return randn(10, 1, SEQ, CONFIG.inner_dim, dtype=dtype), randn(11, CONFIG.hidden_size, CONFIG.inner_dim, dtype=dtype), \
        randn(12, CONFIG.hidden_size, dtype=dtype)


def _column_inputs(name: str):
    _, x_shape, w_shape, has_bias = COLUMN_CASES[name]
    seed = 20 + 3 * list(COLUMN_CASES).index(name)
    return randn(seed, *x_shape), randn(seed + 1, *w_shape), randn(seed + 2, w_shape[0]) if has_bias else None


def _row_parallel_shards(x, w, b, tp: int, r: int, row_parallel: str = "auto"):
    """Rank r's K columns of x and its plan shards of the O-projection weight and bias."""
    return (split_grouped(x, -1, 1, tp, r), shard_tensor(f"{O_PROJ}.weight", w, CONFIG, tp, r, row_parallel=row_parallel),
            shard_tensor(f"{O_PROJ}.bias", b, CONFIG, tp, r, row_parallel=row_parallel))


# ------------------------------------------------------------------------------------------ tensor parallel
def _case_tensor_parallel(rank: int, world: int, dtype_name: str, row_parallel: str) -> dict:
    dtype = getattr(torch, dtype_name)
    mesh = init_mesh(tp=world, sp=world > 1, device="cpu", config=CONFIG, row_parallel=row_parallel)
    sp_rows = mesh.sp_shards(SEQ) if world > 1 else RowShards(SEQ, 1, "tp")
    log = begin_log(mesh)
    out = {}
    with torch.no_grad():
        x_r, w_r, b_r = _row_parallel_shards(*_tree_inputs(dtype), world, rank, row_parallel)
        out["tree"] = row_parallel_tree(x_r, w_r, b_r, mesh, point="blocks.0.o_proj")
        out["tree_sp"] = row_parallel_tree(x_r, w_r, b_r, mesh, out_rows=sp_rows, point="blocks.0.o_proj")
        for name, (path, *_rest) in COLUMN_CASES.items():
            x, w, b = _column_inputs(name)
            w_r = shard_tensor(f"{path}.weight", w, CONFIG, world, rank)
            b_r = None if b is None else shard_tensor(f"{path}.bias", b, CONFIG, world, rank)
            y_r = gemm.linear(x, w_r, b_r)
            out[f"{name}_shard"] = y_r
            out[f"{name}_full"] = gather_columns(y_r, mesh, column_groups(path, w.shape[0], CONFIG), point=name)
            if name == "ffn_up":
                out["swiglu_shard"] = STRICT_OPS["swiglu"].run(y_r)
    out["log"] = log.to_json()
    return out


@pytest.mark.parametrize("world, dtype, row_parallel", [
    (1, "float32", "auto"), (2, "bfloat16", "auto"), (4, "bfloat16", "auto"), (3, "bfloat16", "auto"), (4, "float32", "auto"),
    (3, "float32", "auto"), (4, "float32", "n_split"),
])
def test_tensor_parallel_is_byte_equal_to_one_process(world, dtype, row_parallel):
    results = run_ranks(_case_tensor_parallel, world, dtype, row_parallel)
    x, w, b = _tree_inputs(getattr(torch, dtype))
    full = gemm.linear_tree(x, w, b)
    if dtype == "float32":  # float32 outputs show the K order (bf16 rounding hides it at these sizes)
        assert not torch.equal(gemm.linear(x, w, b), full)  # a flat K loop (or a plain sum) would be caught
    sp = RowShards(SEQ, world, "tp")
    columns = {}
    for name, (path, *_rest) in COLUMN_CASES.items():
        cx, cw, cb = _column_inputs(name)
        columns[name] = (gemm.linear(cx, cw, cb), column_groups(path, cw.shape[0], CONFIG))
    swiglu = STRICT_OPS["swiglu"].run(columns["ffn_up"][0])
    for r, res in enumerate(results):
        assert torch.equal(res["tree"], full), r
        assert torch.equal(res["tree_sp"], sp.take(full, r, 1)), r
        for name, (y, groups) in columns.items():
            assert torch.equal(res[f"{name}_shard"], split_grouped(y, -1, groups, world, r)), (name, r)
            assert torch.equal(res[f"{name}_full"], y), (name, r)
        assert torch.equal(res["swiglu_shard"], split_grouped(swiglu, -1, 1, world, r)), r  # matching value/gate
    records = json.loads(results[0]["log"])["records"]
    tree = [rec for rec in records if rec["name"] == "row_parallel_tree"]
    strategy = tree_strategy(world, row_parallel)
    assert [rec["detail"]["strategy"] for rec in tree] == [strategy, strategy]
    expect = (["all_gather + tree", "all_to_all + tree"] if strategy == "k_chunks" else
              ["all_gather(K) + linear_tree(N slice) + all_gather(N)",
               "all_gather(K) + linear_tree(N slice) + all_to_all(rows)"])
    if world == 1:  # a process group of one: the same calls, one kernel, nothing moved
        expect = ["linear_tree (tp 1, nothing moved)"] * 2
    assert [rec["algorithm"] for rec in tree] == expect
    transport = "gloo" if world > 1 else "none"
    assert all(rec["group_ranks"] == list(range(world)) and rec["transport"] == transport for rec in records)
    assert [rec["detail"]["groups"] for rec in records if rec["name"] == "gather_columns"] == [1, 2, 18]


# ----------------------------------------------------------------------------------------- context parallel
HEADS = 6
# Attention rows: more than one 128-key bf16 tile, so the visiting order changes bytes; 131 = 66 + 65 = 44 + 44 + 43.
ATT_ROWS = 131


def _qkv_and_order():
    q, k, v = (randn(40 + i, 1, ATT_ROWS, HEADS, CONFIG.attention_head_dim) for i in range(3))
    return q, k, v, permutation(43, ATT_ROWS)


def _metadata():
    """Packed hidden rows and every per-row metadata tensor (random, so no mix-up can pass)."""
    g = torch.Generator().manual_seed(50)
    return {
        "hidden_states": randn(51, 1, ROWS, CONFIG.hidden_size),
        "position_ids": torch.randn(ROWS, 3, generator=g, dtype=torch.float64),
        "token_tags": torch.randint(0, 3, (ROWS,), generator=g),
        "timestep_indices": torch.randint(0, 2, (ROWS,), generator=g),
        "adaln_indices": torch.randint(0, 6, (ROWS,), generator=g),
        "rope_cos": torch.randn(ROWS, 6, generator=g),
        "rope_sin": torch.randn(ROWS, 6, generator=g),
    }


def _modulation_tables():
    return randn(52, 6, CONFIG.hidden_size), randn(53, 6, CONFIG.hidden_size)


def _case_context_parallel(rank: int, world: int) -> dict:
    mesh = init_mesh(cp=world, device="cpu", config=CONFIG)
    rows, att_rows = mesh.row_shards(ROWS), mesh.row_shards(ATT_ROWS)
    q, k, v, order = _qkv_and_order()
    q_r, k_r, v_r = (att_rows.take(t, rank, 1) for t in (q, k, v))
    out = {}
    with torch.no_grad():
        heads = rows_to_heads(q_r, mesh, att_rows)
        out["heads"] = heads
        out["round_trip"] = heads_to_rows(heads, mesh, att_rows)
        out["attention"] = ulysses_attention(q_r, k_r, v_r, order, mesh, att_rows)
        out["attention_packed"] = ulysses_attention(q_r, k_r, v_r, None, mesh, att_rows)
        meta = _metadata()
        local = scatter_rows(meta, mesh, rows)
        out.update({f"local_{key}": t for key, t in local.items()})
        out["gathered_hidden"] = gather_rows(local["hidden_states"], mesh, rows)
        out["gathered_positions"] = gather_rows(local["position_ids"], mesh, rows, dim=0)
        scale, shift = _modulation_tables()
        modulate = STRICT_OPS["modulate"].run
        h = local["hidden_states"]
        out["modulated"] = gather_rows(modulate(h, scale, shift, local["adaln_indices"]), mesh, rows)
        stale = meta["adaln_indices"][: h.shape[1]]  # H17: hidden rows sharded, metadata not
        out["modulated_stale"] = gather_rows(modulate(h, scale, shift, stale), mesh, rows)
    for name, call in (("document", lambda: scatter_rows({"key_order": order}, mesh, rows)),
                       ("too_few_rows", lambda: mesh.row_shards(world - 1))):
        try:
            call()
            out[f"error_{name}"] = "accepted"
        except (DistributedError, TopologyError) as exc:
            out[f"error_{name}"] = str(exc)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_is_byte_equal_to_one_process(world):
    results = run_ranks(_case_context_parallel, world)
    q, k, v, order = _qkv_and_order()
    rows, att_rows = RowShards(ROWS, world), RowShards(ATT_ROWS, world)
    assert rows.sizes == ((10, 9) if world == 2 else (7, 6, 6))
    assert att_rows.sizes == ((66, 65) if world == 2 else (44, 44, 43))
    full = strict_attention.attention(q, k, v, order)
    packed = strict_attention.attention(q, k, v)
    assert not torch.equal(full, packed)  # the order matters, so passing it through is tested
    meta = _metadata()
    scale, shift = _modulation_tables()
    modulated = STRICT_OPS["modulate"].run(meta["hidden_states"], scale, shift, meta["adaln_indices"])
    per_head = HEADS // world
    for r, res in enumerate(results):
        assert torch.equal(res["heads"], q[:, :, r * per_head:(r + 1) * per_head]), r
        assert torch.equal(res["round_trip"], att_rows.take(q, r, 1)), r
        assert torch.equal(res["attention"], att_rows.take(full, r, 1)), r
        assert torch.equal(res["attention_packed"], att_rows.take(packed, r, 1)), r
        for key, t in meta.items():
            dim = 1 if key == "hidden_states" else 0
            assert torch.equal(res[f"local_{key}"], rows.take(t, r, dim)), (key, r)
        assert torch.equal(res["gathered_hidden"], meta["hidden_states"])
        assert torch.equal(res["gathered_positions"], meta["position_ids"])
        assert torch.equal(res["modulated"], modulated), r
        assert not torch.equal(res["modulated_stale"], modulated), r
        assert "'key_order' is document metadata" in res["error_document"]
        assert f"cp={world} is larger than the {world - 1} rows" in res["error_too_few_rows"]


# --------------------------------------------------------------------------------------- TP x CP (+ SP) mesh
def _case_tp_cp(rank: int, world: int) -> dict:
    mesh = init_mesh(tp=2, cp=2, sp=True, device="cpu", config=CONFIG)
    i, j = mesh.coords["cp"], mesh.coords["tp"]
    rows = mesh.row_shards(ATT_ROWS)
    order = _qkv_and_order()[3]
    q, k, v = (randn(60 + n, 1, ATT_ROWS, 2 * HEADS, CONFIG.attention_head_dim) for n in range(3))
    mine = [rows.take(t, i, 1)[:, :, j * HEADS:(j + 1) * HEADS] for t in (q, k, v)]  # my rows, my TP heads
    x_r, w_r, b_r = _row_parallel_shards(*_tree_inputs(torch.bfloat16), 2, j)
    with torch.no_grad():
        out = {
            "attention": ulysses_attention(*mine, order, mesh, rows),
            "tree_sp": row_parallel_tree(x_r, w_r, b_r, mesh, out_rows=mesh.sp_shards(SEQ)),
        }
    out["groups"] = json.dumps({"tp": mesh.group_ranks("tp"), "cp": mesh.group_ranks("cp"), "coords": [i, j]})
    return out


def test_tp2_cp2_sp_mesh_is_byte_equal_to_one_process():
    results = run_ranks(_case_tp_cp, 4)
    order = _qkv_and_order()[3]
    q, k, v = (randn(60 + n, 1, ATT_ROWS, 2 * HEADS, CONFIG.attention_head_dim) for n in range(3))
    full = strict_attention.attention(q, k, v, order)
    tree = gemm.linear_tree(*_tree_inputs(torch.bfloat16))
    rows, sp = RowShards(ATT_ROWS, 2), RowShards(SEQ, 2, "tp")
    for rank, res in enumerate(results):
        i, j = divmod(rank, 2)
        assert json.loads(res["groups"]) == {"tp": [2 * i, 2 * i + 1], "cp": [j, 2 + j], "coords": [i, j]}
        assert torch.equal(res["attention"], rows.take(full, i, 1)[:, :, j * HEADS:(j + 1) * HEADS]), rank
        assert torch.equal(res["tree_sp"], sp.take(tree, j, 1)), rank


# ----------------------------------------------------------------------------------------- bad topologies
def _case_bad_topologies(rank: int, world: int) -> dict:
    asks = {
        "world": {"tp": 4},
        "heads": {"tp": 2, "config": dataclasses.replace(CONFIG, num_attention_heads=3)},
        "released_tp3": {"tp": 3, "config": H3Config.full()},
        "sp": {"cp": 2, "sp": True},
        "disagree": {"tp": 2} if rank == 0 else {"cp": 2},
        "mixed": {"tp": 2, "device": "cpu" if rank == 0 else "cuda:0"},
    }
    out = {}
    for name, kwargs in asks.items():
        try:
            init_mesh(**kwargs)
            out[name] = "accepted"
        except TopologyError as exc:
            out[name] = str(exc)
    mesh = init_mesh(tp=2, device="cpu", config=CONFIG)  # refusals left nothing behind
    with torch.no_grad():
        out["after"] = gather_columns(torch.full((1, 2), float(rank)), mesh)
    return out


def test_bad_topologies_are_refused_identically_on_every_rank():
    if torch.cuda.is_available():
        pytest.skip("the mixed-device case assumes a CPU-only machine")
    results = run_ranks(_case_bad_topologies, 2)
    expect = {
        "world": "world size 2 != tp * cp = 4 * 1 = 4",
        "heads": "tp=2: must divide num_attention_heads=3 (this config admits tp in {1, 3})",
        "released_tp3": "tp=3: must divide num_attention_heads=56 (this config admits tp in {1, 2, 4, 7, 8, 14, 28, 56})",
        "sp": "sp=True with tp=1",
        "disagree": "ranks disagree on the topology: rank 0 asks tp=2 cp=1 sp=False row_parallel=auto, rank 1 asks "
                    "tp=1 cp=2 sp=False row_parallel=auto",
        "mixed": "mixed devices across ranks (rank 0 cpu, rank 1 cuda:0)",
    }
    for name, text in expect.items():
        messages = {res[name] for res in results}
        assert len(messages) == 1, (name, messages)  # the same verdict on every rank
        message = messages.pop()
        assert text in message and "\n" not in message, (name, message)
    for res in results:
        assert torch.equal(res["after"], torch.tensor([[0.0, 0.0, 1.0, 1.0]]))
