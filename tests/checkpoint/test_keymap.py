"""Original MiniMax / single-file / Diffusers layouts map to bytes equal to Diffusers'
`convert_minimax_h3_transformer_checkpoint_to_diffusers`, for both fused-QKV layouts, on random checkpoints written
to disk in the original layout; layout detection, overrides and the mapping errors."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import OTHER, original_state_dict, random_state_dict, write_diffusers_component, write_shards
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers
from safetensors.torch import load_file, save_file

from h3lab.checkpoint import keymap, load_state_dict
from h3lab.config import H3Config
from h3lab.errors import CheckpointError

CONFIGS = {"tiny": H3Config.tiny(), "other": OTHER}


def diffusers_reference(files, config: H3Config, qkv_layout: str) -> dict[str, torch.Tensor]:
    """Diffusers' own conversion of the original-layout files (read eagerly, merged)."""
    checkpoint = {}
    for f in files:
        checkpoint.update(load_file(str(f)))
    return convert_minimax_h3_transformer_checkpoint_to_diffusers(
        checkpoint, config=config.to_diffusers(), qkv_layout=qkv_layout
    )


def assert_same(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype, k
        assert torch.equal(ours[k], theirs[k]), k


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_minimax_shards_interleaved_equal_diffusers(tmp_path, name):
    config = CONFIGS[name]
    sd = random_state_dict(config, seed=11)
    original = original_state_dict(sd, config, "interleaved")
    files = write_shards(tmp_path / "mm", original, "model", 3, "model.safetensors.index.json")
    ours = load_state_dict(tmp_path / "mm")  # auto: original names in a folder -> minimax -> interleaved
    assert ours.layout == "minimax" and ours.qkv_layout == "interleaved"
    assert_same(ours, diffusers_reference(files, config, "interleaved"))
    assert_same(ours, sd)  # and the round trip through the original layout is exact
    # The same folder read as stacked is Diffusers' stacked conversion, and differs from the weights: the
    # override is honoured and the choice matters.
    stacked = load_state_dict(tmp_path / "mm", qkv_layout="stacked")
    assert_same(stacked, diffusers_reference(files, config, "stacked"))
    key = "transformer_blocks.0.attn.to_k.weight"
    assert not torch.equal(stacked[key], sd[key])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_single_file_stacked_equal_diffusers(tmp_path, name):
    config = CONFIGS[name]
    sd = random_state_dict(config, seed=12)
    path = tmp_path / "h3.safetensors"
    save_file(original_state_dict(sd, config, "stacked"), str(path))
    ours = load_state_dict(path)  # auto: a single file -> single_file -> stacked
    assert ours.layout == "single_file" and ours.qkv_layout == "stacked"
    assert_same(ours, diffusers_reference([path], config, "stacked"))
    assert_same(ours, sd)
    # Explicit layout / qkv overrides on the same file.
    assert_same(load_state_dict(path, layout="minimax", qkv_layout="stacked"), sd)
    assert_same(load_state_dict(path, qkv_layout="interleaved"), diffusers_reference([path], config, "interleaved"))


def test_interleaved_single_file_override(tmp_path):
    """A file merged by hand from the MiniMax shards (interleaved) loads with qkv_layout='interleaved'."""
    config = H3Config.tiny()
    sd = random_state_dict(config, seed=13)
    path = tmp_path / "merged.safetensors"
    save_file(original_state_dict(sd, config, "interleaved"), str(path))
    assert_same(load_state_dict(path, qkv_layout="interleaved"), sd)
    assert_same(load_state_dict(path, layout="minimax"), sd)


def test_stacked_split_is_a_view_of_the_mapped_file(tmp_path):
    config = H3Config.tiny()
    sd = random_state_dict(config, seed=14)
    path = tmp_path / "h3.safetensors"
    save_file(original_state_dict(sd, config, "stacked"), str(path))
    ours = load_state_dict(path)
    q, k, v = (ours[f"transformer_blocks.1.attn.to_{n}.weight"] for n in "qkv")
    # One storage (the fused tensor's), three row slices: no copy was made.
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.data_ptr() - q.data_ptr() == q.numel() * q.element_size()
    assert ours.sources["transformer_blocks.1.attn.to_k.weight"] == f"{path}:blocks.1.attn.qkv_proj.weight"


def test_diffusers_layout_passes_through(tmp_path):
    config = OTHER
    sd = random_state_dict(config, seed=15)
    folder = write_diffusers_component(tmp_path / "transformer", sd, config, shards=2)
    ours = load_state_dict(folder)
    assert ours.layout == "diffusers"
    assert_same(ours, sd)
    assert ours.sources["proj_in.weight"].endswith(".safetensors")


def test_rename_table():
    cases = {
        "blocks.7.attn.q_norm.weight": "transformer_blocks.7.attn.norm_q.weight",
        "blocks.0.attn.out_proj.weight": "transformer_blocks.0.attn.to_out.0.weight",
        "blocks.3.mlp.fc2.weight": "transformer_blocks.3.ff.net.2.weight",
        "blocks.3.adaln_proj.linear.bias": "transformer_blocks.3.adaln_proj.linear.bias",
        "token_refiner.blocks.1.mlp.fc1.weight": "token_refiner.refiner_blocks.1.ff.net.0.proj.weight",
        "token_refiner.blocks.0.attn.k_norm.weight": "token_refiner.refiner_blocks.0.attn.norm_k.weight",
        "token_refiner.final_norm.weight": "token_refiner.final_norm.weight",
        "video_patch_proj.bias": "proj_in.bias",
        "audio_patch_proj.weight": "audio_proj_in.weight",
        "condition_proj.weight": "context_embedder.weight",
        "time_embedder.proj_in.weight": "time_embedder.linear_1.weight",
        "time_embedder.proj_out.bias": "time_embedder.linear_2.bias",
        "final_layer.norm.weight": "norm_out.norm.weight",
        "final_layer.adaln_proj.linear.weight": "norm_out.linear.weight",
        "final_layer.video_out.weight": "proj_out.weight",
        "final_layer.audio_out.bias": "audio_proj_out.bias",
    }
    for old, new in cases.items():
        assert keymap.rename_original_key(old) == new


def test_pruned_checkpoint_is_refused(tmp_path):
    config = H3Config.tiny()
    original = original_state_dict(random_state_dict(config, seed=16), config, "stacked")
    original["adaln_t_table"] = torch.randn(3, 4)
    path = tmp_path / "pruned.safetensors"
    save_file(original, str(path))
    with pytest.raises(CheckpointError, match=r"pruned.safetensors: key 'adaln_t_table' .*pruned") as err:
        load_state_dict(path)
    assert "\n" not in str(err.value)


def test_layout_detection_errors(tmp_path):
    mixed = tmp_path / "mixed.safetensors"
    save_file({"transformer_blocks.0.norm1.weight": torch.ones(2), "blocks.0.norm1.weight": torch.ones(2)}, str(mixed))
    with pytest.raises(CheckpointError, match="both original MiniMax and Diffusers"):
        load_state_dict(mixed)
    alien = tmp_path / "alien.safetensors"
    save_file({"encoder.conv.weight": torch.ones(2)}, str(alien))
    with pytest.raises(CheckpointError, match="neither original MiniMax nor Diffusers"):
        load_state_dict(alien)
    with pytest.raises(CheckpointError, match="layout='nope'"):
        load_state_dict(alien, layout="nope")
    with pytest.raises(CheckpointError, match="qkv_layout='rows'"):
        load_state_dict(alien, qkv_layout="rows")
    with pytest.raises(CheckpointError, match="no fused QKV"):
        load_state_dict(alien, layout="diffusers", qkv_layout="stacked")


def test_interleaved_head_geometry_checked_against_config(tmp_path):
    config = H3Config.tiny()
    path = tmp_path / "h3.safetensors"
    save_file(original_state_dict(random_state_dict(config, seed=17), config, "interleaved"), str(path))
    with pytest.raises(CheckpointError, match=r"holds 2 heads x 16, config says 3 x 12"):
        load_state_dict(path, qkv_layout="interleaved", config=OTHER)
