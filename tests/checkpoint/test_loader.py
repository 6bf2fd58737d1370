"""`load_transformer`: snapshot root / component / variant resolution for H3Transformer and Diffusers' class, equality
with Diffusers' own `from_pretrained`, the dtype policies, a forward of the loaded Diffusers model, every load error,
and host memory (one mapped copy, measured in a subprocess; a 66 GB sparse 33B checkpoint loads without reading)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_helpers import (
    copy_component, original_state_dict, proc_status, random_state_dict, write_diffusers_component, write_shards,
)
from diffusers import MiniMaxH3Transformer3DModel
from safetensors.torch import load_file, save_file

from h3lab.checkpoint import load_state_dict, load_transformer
from h3lab.config import H3Config
from h3lab.errors import CheckpointError
from h3lab.model import H3Transformer

HERE = Path(__file__).parent


def diffusers_reference(snapshot: Path, subfolder: str) -> MiniMaxH3Transformer3DModel:
    return MiniMaxH3Transformer3DModel.from_pretrained(
        snapshot, subfolder=subfolder, torch_dtype=torch.bfloat16, use_safetensors=True
    )


def assert_state_equal(model, ref) -> None:
    ours, theirs = model.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
    assert ours["proj_in.weight"].dtype == torch.float32
    assert ours["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16
    assert model.rope.inv_freq.dtype == torch.float32 and torch.equal(model.rope.inv_freq, ref.rope.inv_freq)


@pytest.mark.parametrize("cls", [MiniMaxH3Transformer3DModel, H3Transformer], ids=["diffusers", "h3lab"])
def test_load_variants_equal_diffusers_from_pretrained(tiny_snapshot, cls):
    ref = diffusers_reference(tiny_snapshot, "transformer")
    ref_ref = diffusers_reference(tiny_snapshot, "transformer_ref")
    assert_state_equal(load_transformer(cls, tiny_snapshot), ref)  # snapshot root -> transformer/
    assert_state_equal(load_transformer(cls, tiny_snapshot / "transformer"), ref)  # component folder
    for sub in ("transformer_ref", "ref2va"):
        assert_state_equal(load_transformer(cls, tiny_snapshot, subfolder=sub), ref_ref)
    assert not torch.equal(ref.proj_in.weight, ref_ref.proj_in.weight)  # the two variants really differ


def test_h3_from_pretrained_entry_point_and_fingerprint(tiny_snapshot):
    t2va = H3Transformer.from_pretrained(tiny_snapshot)
    ref2va = H3Transformer.from_pretrained(tiny_snapshot, subfolder="transformer_ref")
    assert t2va.fingerprint.startswith("transformer:") and ref2va.fingerprint.startswith("transformer_ref:")
    assert t2va.fingerprint.split(":")[1] != ref2va.fingerprint.split(":")[1]
    assert t2va.dtype_policy == "released" and not t2va.training


def tiny_inputs(config: H3Config, seed: int) -> dict[str, torch.Tensor]:
    """A small packed t2va-like document: [text 5 | audio 6 | video 8], two distinct timesteps."""
    g = torch.Generator().manual_seed(seed)
    n_text, n_audio, n_video = 5, 6, 8
    seq = n_text + n_audio + n_video
    tags = torch.tensor([1] * n_text + [2] * n_audio + [0] * n_video)
    return dict(
        hidden_states=torch.randn(1, n_video, config.video_patch_dim, generator=g),
        audio_hidden_states=torch.randn(1, n_audio, config.audio_in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, n_text, config.text_dim, generator=g).to(torch.bfloat16),
        timestep=torch.tensor([0.2, 0.55]),
        timestep_indices=torch.tensor([0] * n_text + [1] * n_audio + [0] * n_video),
        token_tags=tags,
        position_ids=torch.rand(seq, 3, generator=g, dtype=torch.float64) * 20,
        video_indices=torch.arange(n_text + n_audio, seq),
        audio_indices=torch.arange(n_text, n_text + n_audio),
        text_indices=torch.arange(n_text),
    )


def test_forward_of_loaded_diffusers_transformer(tiny_snapshot):
    ours = load_transformer(MiniMaxH3Transformer3DModel, tiny_snapshot)
    ref = diffusers_reference(tiny_snapshot, "transformer")
    config = H3Config.tiny()
    with torch.no_grad():
        a = ours(**tiny_inputs(config, 0), return_dict=False)
        b = ref(**tiny_inputs(config, 0), return_dict=False)
        c = ours(**tiny_inputs(config, 1), return_dict=False)
    for x, y, z in zip(a, b, c):
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
        assert torch.equal(x, y)  # same bytes as Diffusers' own load
        assert x.std() > 0.05 and not torch.equal(x, z)  # non-degenerate, input-dependent
    assert a[0].shape == (1, 8, config.video_patch_dim) and a[1].shape == (1, 6, config.audio_in_channels)


def test_float32_policy_casts(tiny_snapshot):
    ref = diffusers_reference(tiny_snapshot, "transformer")
    for cls in (MiniMaxH3Transformer3DModel, H3Transformer):
        model = load_transformer(cls, tiny_snapshot, dtype_policy="float32")
        for k, v in model.state_dict().items():
            assert v.dtype == torch.float32 and torch.equal(v, ref.state_dict()[k].float()), k


def file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of every file-backed mapping of this process (/proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, parts[5].strip()))
    return out


def test_loaded_weights_are_views_of_the_mapped_files(tiny_snapshot):
    """Every parameter of the loaded model lies inside a mapping of one of the component's shard files: assign=True
    put the memory-mapped tensors themselves into the model, nothing was copied to anonymous memory."""
    model = load_transformer(MiniMaxH3Transformer3DModel, tiny_snapshot)
    shards = {str(p.resolve()) for p in (tiny_snapshot / "transformer").glob("*.safetensors")}
    maps = [(a, b, path) for a, b, path in file_mappings() if path in shards]
    assert {path for _, _, path in maps} == shards
    for name, p in model.named_parameters():
        ptr = p.data_ptr()
        assert any(a <= ptr and ptr + p.numel() * p.element_size() <= b for a, b, _ in maps), name
    assert not any(a <= model.rope.inv_freq.data_ptr() < b for a, b, _ in maps)  # recomputed, not loaded


# ------------------------------------------------------------------------------------------------------ errors
@pytest.fixture()
def component(tmp_path, tiny_snapshot):
    """A writable copy of the tiny snapshot's sharded transformer/."""
    return copy_component(tiny_snapshot / "transformer", tmp_path / "transformer")


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg
    return msg


def test_error_missing_shard(component):
    (component / "diffusion_pytorch_model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError) as exc:
        load_transformer(H3Transformer, component)
    msg = one_line(exc)
    assert "diffusion_pytorch_model.safetensors.index.json" in msg
    assert "'diffusion_pytorch_model-00002-of-00003.safetensors'" in msg
    assert "(key '" in msg and "does not exist" in msg


def test_error_index_names_missing_file(component):
    index = component / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["norm_out.linear.weight"] = "elsewhere.safetensors"
    index.write_text(json.dumps(data))
    pattern = r"index.json: names shard 'elsewhere.safetensors' \(key 'norm_out.linear.weight'\)"
    with pytest.raises(CheckpointError, match=pattern):
        load_transformer(H3Transformer, component)


def test_error_index_and_shard_disagree(component):
    index = component / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["transformer_blocks.9.norm1.weight"] = "diffusion_pytorch_model-00001-of-00003.safetensors"
    index.write_text(json.dumps(data))
    pattern = r"00001-of-00003.safetensors: index .* puts key 'transformer_blocks.9.norm1.weight' in this shard"
    with pytest.raises(CheckpointError, match=pattern):
        load_transformer(H3Transformer, component)


def test_error_missing_shard_without_index(tmp_path):
    config = H3Config.tiny()
    original = original_state_dict(random_state_dict(config, 3), config, "interleaved")
    files = write_shards(tmp_path / "mm", original, "model", 3, None)
    files[1].unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003.safetensors: missing shard 2 of 3"):
        load_state_dict(tmp_path / "mm")


def rewrite(component: Path, key: str, value: torch.Tensor | None, new_key: str | None = None) -> Path:
    """Change one tensor of the shard holding `key` (None drops it; new_key adds another)."""
    index = component / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    shard = component / data["weight_map"][key]
    tensors = load_file(str(shard))
    if value is None:
        del tensors[key]
        del data["weight_map"][key]
    else:
        tensors[new_key or key] = value
        data["weight_map"][new_key or key] = shard.name
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index.write_text(json.dumps(data))
    return shard


def test_error_wrong_shape(component):
    shard = rewrite(component, "proj_out.bias", torch.randn(17))
    with pytest.raises(CheckpointError) as exc:
        load_transformer(MiniMaxH3Transformer3DModel, component)
    assert one_line(exc) == f"{shard}: key 'proj_out.bias' has shape [17], the config needs [16]"


def test_error_unknown_key(component):
    extra = torch.randn(3, dtype=torch.bfloat16)
    shard = rewrite(component, "norm_out.linear.bias", extra, new_key="norm_out.extra.bias")
    with pytest.raises(CheckpointError) as exc:
        load_transformer(H3Transformer, component)
    assert one_line(exc).startswith(f"{shard}: unknown key 'norm_out.extra.bias'")


def test_error_missing_key(component):
    rewrite(component, "norm_out.linear.bias", None)
    with pytest.raises(CheckpointError) as exc:
        load_transformer(H3Transformer, component)
    assert one_line(exc) == f"{component}: missing key 'norm_out.linear.bias' (no weight file stores it)"


def test_error_pruned_checkpoint_diffusers_layout(component):
    shard = rewrite(component, "norm_out.linear.bias", torch.randn(4, 12), new_key="adaln_t_table")
    with pytest.raises(CheckpointError, match=rf"^{shard}: key 'adaln_t_table' marks a pruned MiniMax-H3 checkpoint"):
        load_transformer(H3Transformer, component)


@pytest.mark.parametrize(
    "key, dtype, want",
    [
        ("proj_in.weight", torch.bfloat16, "float32"),
        ("transformer_blocks.1.ff.net.2.weight", torch.float32, "bfloat16"),
    ],
)
def test_error_wrong_dtype(component, key, dtype, want):
    stored = load_state_dict(component)[key]
    shard = rewrite(component, key, stored.to(dtype))
    with pytest.raises(CheckpointError) as exc:
        load_transformer(MiniMaxH3Transformer3DModel, component)
    msg = one_line(exc)
    assert msg.startswith(f"{shard}: key {key!r} is stored as {str(dtype)[6:]}, the released dtype policy needs {want}")
    # The float32 policy accepts it (and casts).
    model = load_transformer(MiniMaxH3Transformer3DModel, component, dtype_policy="float32")
    assert torch.equal(model.state_dict()[key], stored.to(dtype).float())


def test_error_integer_weights(component):
    shard = rewrite(component, "proj_in.bias", torch.arange(24, dtype=torch.int32))
    with pytest.raises(CheckpointError, match=rf"^{shard}: key 'proj_in.bias' is stored as int32"):
        load_transformer(H3Transformer, component, dtype_policy="float32")


def test_error_truncated_shard(component):
    shard = component / "diffusion_pytorch_model-00001-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    pattern = rf"^{shard}: key '.*' ends at data byte \d+ but the file holds \d+ data bytes \(truncated file\)$"
    with pytest.raises(CheckpointError, match=pattern):
        load_transformer(H3Transformer, component)


def test_error_duplicate_key_across_files(tmp_path):
    config = H3Config.tiny()
    sd = random_state_dict(config, 4)
    folder = tmp_path / "dup"
    folder.mkdir()
    save_file(sd, str(folder / "a.safetensors"))
    save_file({"proj_in.bias": sd["proj_in.bias"]}, str(folder / "b.safetensors"))
    with pytest.raises(CheckpointError, match=r"b.safetensors: key 'proj_in.bias' is also stored in .*a.safetensors"):
        load_state_dict(folder)


def test_error_paths_and_arguments(tmp_path, tiny_snapshot, component):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load_transformer(H3Transformer, tmp_path / "nowhere")
    pattern = r"snapshot has no component 'transformer_x' \(components present: audio_scheduler"
    with pytest.raises(CheckpointError, match=pattern):
        load_transformer(H3Transformer, tiny_snapshot, subfolder="transformer_x")
    with pytest.raises(CheckpointError, match="dtype_policy='fp8': must be one of released, float32"):
        load_transformer(H3Transformer, tiny_snapshot, dtype_policy="fp8")
    (component / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config.json: missing \(a component folder needs its config.json\)"):
        load_transformer(H3Transformer, component)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weight files"):
        load_state_dict(empty)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="header length .* does not fit the file size 64"):
        load_state_dict(junk)


def test_single_file_with_config_and_original_names(tmp_path):
    config = H3Config.tiny()
    sd = random_state_dict(config, 5)
    path = tmp_path / "h3-comfy.safetensors"
    save_file(original_state_dict(sd, config, "stacked"), str(path))
    model = load_transformer(H3Transformer, path, config=config)
    for k, v in sd.items():
        assert torch.equal(model.state_dict()[k], v), k
    # A bare file with no config.json beside it defaults to the released (full) architecture.
    pattern = r"key 'proj_in.weight' has shape \[24, 16\], the config needs \[5376, 96\]"
    with pytest.raises(CheckpointError, match=pattern):
        load_transformer(H3Transformer, path)


# ------------------------------------------------------------------------------------------------------ memory
MEM_CONFIG = H3Config(
    num_attention_heads=8, attention_head_dim=64, hidden_size=512, num_layers=4, num_refiner_layers=2, ffn_dim=1024,
    in_channels=16, audio_in_channels=32, text_dim=256, freq_dim=64, time_embed_hidden_dim=256, time_embed_dim=64,
    rope_freq_dim=4,
)
_MEASURE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from ckpt_helpers import proc_status
from h3lab.checkpoint import load_transformer
from h3lab.model import H3Transformer
from h3lab.config import H3Config
with torch.device("meta"):
    H3Transformer(H3Config.tiny())  # warm every import and code path first
out = {}
for name in sys.argv[2:]:
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    before = proc_status()
    model = load_transformer(H3Transformer, name)
    loaded = proc_status()
    with torch.no_grad():
        # Touch every weight page without allocating a temporary: a byte-view max reduces to one scalar.
        total = sum(int(p.view(torch.uint8).max()) for p in model.parameters())
    touched = proc_status()
    out[name] = {"before": before, "loaded": loaded, "touched": touched, "total": total}
    del model
print(json.dumps(out))
"""


def test_host_memory_stays_one_mapped_copy(tmp_path):
    """Measured: RSS of a fresh process around load_transformer + touching every weight, for a 36 MB bf16
    checkpoint in Diffusers layout and in MiniMax layout. Anonymous (non-file) memory grows by ~0 for the Diffusers
    layout and by about the bytes of the copied tensors (interleaved QKV + fc1) for MiniMax; peak RSS grows by about
    one copy of the weights (the mapped file pages) — never two."""
    sd = random_state_dict(MEM_CONFIG, 6)
    weight_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    copied = sum(  # tensors the MiniMax layout must copy: de-interleaved q/k/v and swapped fc1
        v.numel() * v.element_size()
        for k, v in sd.items()
        if k.endswith(("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight", "ff.net.0.proj.weight"))
    )
    diff_dir = write_diffusers_component(tmp_path / "diffusers", sd, MEM_CONFIG, shards=2)
    mm_dir = tmp_path / "minimax"
    write_shards(mm_dir, original_state_dict(sd, MEM_CONFIG, "interleaved"), "model", 2, "model.safetensors.index.json")
    (mm_dir / "config.json").write_text((diff_dir / "config.json").read_text())
    del sd
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(HERE), str(diff_dir), str(mm_dir)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert 30 * mib < weight_bytes < 40 * mib and copied > weight_bytes / 3
    d, m = res[str(diff_dir)], res[str(mm_dir)]
    # Diffusers layout: loading maps, copies nothing; touching pulls in ~one copy as file-backed pages.
    assert d["loaded"]["RssAnon"] - d["before"]["RssAnon"] < 4 * mib
    assert d["touched"]["RssAnon"] - d["before"]["RssAnon"] < 4 * mib
    assert d["touched"]["RssFile"] - d["before"]["RssFile"] > 0.9 * weight_bytes
    assert d["touched"]["VmHWM"] - d["before"]["VmRSS"] < 1.1 * weight_bytes + 4 * mib
    # MiniMax layout: the only anonymous memory is the regrouped QKV and swapped fc1 (one copy of those tensors).
    anon = m["touched"]["RssAnon"] - m["before"]["RssAnon"]
    assert 0.9 * copied < anon < copied + 4 * mib
    assert m["touched"]["VmHWM"] - m["before"]["VmRSS"] < weight_bytes + copied + 4 * mib
    assert d["total"] == m["total"]  # same weights either way


def test_full_size_sparse_checkpoint_loads_without_reading(sparse_full_snapshot):
    """The released 33B architecture (~66 GB of bf16/fp32 tensors, sparse on disk) loads through meta construction
    + mmap + assign in seconds, with no growth of anonymous memory: nothing is read or copied until used."""
    root, total = sparse_full_snapshot
    assert total > 60 * 2**30
    before = proc_status()
    start = time.perf_counter()
    model = load_transformer(H3Transformer, root)
    elapsed = time.perf_counter() - start
    after = proc_status()
    assert model.num_parameters() == 33_122_992_896
    assert model.proj_in.weight.dtype == torch.float32
    assert model.transformer_blocks[49].attn.to_q.weight.dtype == torch.bfloat16
    assert after["RssAnon"] - before["RssAnon"] < 256 * 2**20  # module objects only, vs 66 GB of weights
    assert after["RssFile"] - before["RssFile"] < 64 * 2**20
    assert elapsed < 60
    del model
