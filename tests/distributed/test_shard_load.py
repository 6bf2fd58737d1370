"""Ranks that hold only their shard (`h3lab.distributed.shard_load`): the counter-random init's rank slice equals the
slice of the full tensor; `load_shard_state_dict` reads from the Diffusers, MiniMax-original (interleaved QKV, fc1
[gate; value], two shard files + index) and single-file (stacked QKV) layouts exactly the tensors `shard_state_dict`
cuts from the fully loaded checkpoint, for TP 2, 3, 4 (k_chunks / n_split); a model that loaded only its shard runs
on 2 gloo ranks byte-equal to the one-process model with the one-process fingerprint; refusals are one line."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import CONFIG, build_layout
from harness import run_ranks
from safetensors.torch import save_file

from h3lab.checkpoint import keymap, load_state_dict
from h3lab.checkpoint.loader import released_dtype
from h3lab.distributed import DistributedError, init_mesh, parallelize
from h3lab.distributed.plan import shard_state_dict
from h3lab.distributed.shard_load import (
    load_shard_state_dict,
    load_sharded_transformer,
    random_shard_state_dict,
    random_sharded_transformer,
    shard_nbytes,
)
from h3lab.errors import CheckpointError

CASES = [(2, "auto"), (2, "n_split"), (3, "auto"), (4, "auto")]


def _released(sd: dict) -> dict:
    return {k: v.to(released_dtype(k)).contiguous() for k, v in sd.items()}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The 12-head config's counter-random weights written in the three layouts; returns {layout: path}."""
    import json

    root = tmp_path_factory.mktemp("shards")
    sd = _released(random_shard_state_dict(CONFIG, 11, dtype_policy="float32"))
    cfg = json.dumps({"_class_name": "MiniMaxH3Transformer3DModel", **CONFIG.to_diffusers()})
    diff = root / "diffusers"
    diff.mkdir()
    (diff / "config.json").write_text(cfg)
    save_file(sd, str(diff / "diffusion_pytorch_model.safetensors"))
    original = root / "minimax"
    original.mkdir()
    (original / "config.json").write_text(cfg)
    mapped = {k: v.contiguous() for k, v in keymap.diffusers_to_original(sd, "interleaved", 12).items()}
    keys = list(mapped)
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [keys[: len(keys) // 2], keys[len(keys) // 2:]]
    for name, part in zip(names, halves):
        save_file({k: mapped[k] for k in part}, str(original / name))
    index = {"metadata": {}, "weight_map": {k: names[i] for i, part in enumerate(halves) for k in part}}
    (original / "model.safetensors.index.json").write_text(json.dumps(index))
    single = root / "single.safetensors"
    save_file({k: v.contiguous() for k, v in keymap.diffusers_to_original(sd, "stacked", 12).items()}, str(single))
    return {"diffusers": diff, "minimax": original, "single_file": single}


def test_counter_random_rank_slice_equals_the_full_tensors_slice():
    full = random_shard_state_dict(CONFIG, 7)
    assert all(v.dtype == released_dtype(k) for k, v in full.items())
    w = full["transformer_blocks.0.attn.to_q.weight"].float()
    assert abs(float(w.mean())) < 0.05 and 0.9 < float(w.std()) * 24 ** 0.5 < 1.1  # N-like scale 1/sqrt(fan_in)
    assert not torch.equal(random_shard_state_dict(CONFIG, 8)["proj_in.weight"], full["proj_in.weight"])
    for tp, rp in CASES:
        for rank in range(tp):
            got = random_shard_state_dict(CONFIG, 7, tp, rank, rp)
            want = shard_state_dict(full, CONFIG, tp, rank, row_parallel=rp)
            assert got.keys() == want.keys()
            for key in want:
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (tp, rp, rank, key)
    assert shard_nbytes(CONFIG, 2, 0) < shard_nbytes(CONFIG, 1) == sum(v.numel() * v.element_size()
                                                                        for v in full.values())


@pytest.mark.parametrize("layout", ["diffusers", "minimax", "single_file"])
def test_each_rank_reads_its_slice_of_every_layout(layouts, layout):
    path = layouts[layout]
    full = load_state_dict(path)
    assert full.layout == layout
    for tp, rp in CASES:
        for rank in range(tp):
            got = load_shard_state_dict(path, CONFIG, tp, rank, rp)
            want = shard_state_dict(dict(full), CONFIG, tp, rank, row_parallel=rp)
            assert set(got) == set(want) and got.layout == layout
            for key in want:
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (layout, tp, rank, key)
    assert load_shard_state_dict(path, CONFIG, 2, 1, dtype_policy="float32")["proj_in.weight"].dtype == torch.float32


def _sharded_forward(rank: int, world: int, path: str) -> dict:
    from h3lab.execution import runtime
    from h3lab.research.ablation import make_inputs
    from h3lab.run import model_forward
    from h3lab.run.sampler import DualSchedule

    mesh = init_mesh(tp=2, device="cpu", config=CONFIG)
    model = load_sharded_transformer(path, mesh)
    rows = model.transformer_blocks[0].attn.to_q.weight.shape[0]
    parallelize(model, mesh)
    layout = build_layout("fl2va")
    x = make_inputs(CONFIG, layout, DualSchedule.build(2), seed=3)
    with runtime.use_mode("strict"), torch.no_grad():
        video, audio = model_forward(model, x, x.video, x.audio, 0)
    return {"video": video, "audio": audio, "fingerprint": model.fingerprint, "rows": str(rows)}


def test_a_model_holding_only_its_shard_runs_byte_equal_to_one_process(layouts):
    from h3lab import H3Transformer
    from h3lab.execution import runtime
    from h3lab.research.ablation import make_inputs
    from h3lab.run import model_forward
    from h3lab.run.sampler import DualSchedule

    path = layouts["minimax"]
    results = run_ranks(_sharded_forward, 2, str(path), timeout=240)
    one = H3Transformer.from_pretrained(path)
    x = make_inputs(CONFIG, build_layout("fl2va"), DualSchedule.build(2), seed=3)
    with runtime.use_mode("strict"), torch.no_grad():
        video, audio = model_forward(one, x, x.video, x.audio, 0)
    for res in results:
        assert res["rows"] == "48" and res["fingerprint"] == one.fingerprint  # 6 of 12 heads x 8; the checkpoint's id
        assert torch.equal(res["video"], video) and torch.equal(res["audio"], audio)


def test_refusals(layouts, tmp_path):
    mesh = init_mesh(tp=1, device="cpu")
    model = random_sharded_transformer(CONFIG, None, seed=1)
    assert model.h3lab_shard is None and model.fingerprint == "random-counter:1"
    model.h3lab_shard = (2, 0, "k_chunks")  # a rank-0 tp2 shard offered to a one-rank mesh
    with pytest.raises(DistributedError, match=r"holds the shard \(tp, rank, strategy\) = \(2, 0, 'k_chunks'\)"):
        parallelize(model, mesh)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((layouts["diffusers"] / "config.json").read_text())
    sd = load_state_dict(layouts["diffusers"])
    save_file({k: v.contiguous() for k, v in sd.items() if k != "norm_out.linear.bias"},
              str(broken / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing key 'norm_out.linear.bias'"):
        load_shard_state_dict(broken, CONFIG, 2, 0)
    with pytest.raises(DistributedError, match=r"rank=2: must be an integer in \[0, 2\)"):
        load_shard_state_dict(layouts["diffusers"], CONFIG, 2, 2)
