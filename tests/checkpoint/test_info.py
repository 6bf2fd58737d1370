"""`snapshot_info` / `format_info` (`h3lab --info`): the report on the tiny snapshot, the content-hash scheme, and that
it reads headers plus 64-byte samples only — poisoned unsampled bytes leave the report unchanged, and a sparse
66 GB snapshot of the released 33B architecture is scanned in well under a second, reading a bounded byte count."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from ckpt_helpers import bytes_read, data_start, poison

from h3lab.checkpoint import component_hash, format_info, read_header, snapshot_info, tiny
from h3lab.checkpoint.info import SAMPLE_BYTES
from h3lab.config import H3Config
from h3lab.errors import CheckpointError


def stored_elements(module) -> int:
    return sum(t.numel() for t in module.state_dict().values())


def test_report_on_tiny_snapshot(tiny_snapshot):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    info = snapshot_info(tiny_snapshot, device="cpu")
    json.dumps(info)  # the --json form
    assert info["kind"] == "snapshot" and info["tiny"] == {"version": tiny.TINY_VERSION, "seed": 0}
    assert info["variants"]["transformer"] == {"present": True, "workflows": ["t2va", "fl2va"]}
    assert info["variants"]["transformer_ref"] == {"present": True, "workflows": ["ref2va"]}
    assert set(info["components"]) == {
        "transformer", "transformer_ref", "vae", "audio_vae", "text_encoder", "tokenizer", "processor", "scheduler",
        "audio_scheduler",
    }
    assert info["missing_components"] == [] and info["device"]["device"] == "cpu"
    cfg = info["config"]
    assert cfg["transformer"]["preset"] == cfg["transformer_ref"]["preset"] == "tiny" and cfg["variants_share_config"]
    assert cfg["transformer"]["fingerprint"] == H3Config.tiny().fingerprint()

    comps = info["components"]
    ref = MiniMaxH3Transformer3DModel.from_pretrained(
        tiny_snapshot, subfolder="transformer", torch_dtype=torch.bfloat16
    )
    assert comps["transformer"]["parameters"] == ref.num_parameters() == stored_elements(ref)
    vae = AutoencoderKLMiniMaxH3.from_pretrained(tiny_snapshot, subfolder="vae")
    audio = AutoencoderKLMiniMaxH3Audio.from_pretrained(tiny_snapshot, subfolder="audio_vae")
    assert comps["vae"]["parameters"] == stored_elements(vae)
    assert comps["audio_vae"]["parameters"] == stored_elements(audio)
    assert comps["transformer"]["sharded"] and comps["transformer"]["weight_files"] == 3

    t = comps["transformer"]
    assert t["dtype_policy"] == "released"
    assert t["groups"]["proj_in"]["dtypes"] == {"F32": 16 * 24 + 24}
    assert set(t["groups"]["transformer_blocks"]["dtypes"]) == {"BF16"}
    assert comps["vae"]["dtype_policy"] == comps["audio_vae"]["dtype_policy"] == "float32"
    assert comps["text_encoder"]["dtype_policy"] == "bfloat16"
    assert "parameters" not in comps["tokenizer"] and comps["scheduler"]["class"] == "MiniMaxH3Scheduler"

    # Hashes: per component, stable, and the two transformer variants (same architecture) differ.
    assert len({c["hash"] for c in comps.values()}) == len(comps)
    again = snapshot_info(tiny_snapshot, device="cpu")
    assert again["snapshot_hash"] == info["snapshot_hash"]
    assert comps["transformer"]["hash"] == component_hash(tiny_snapshot / "transformer")

    text = format_info(info)
    for needle in (
        "preset tiny", "transformer (t2va/fl2va): yes", "transformer_ref (ref2va): yes", "same config: yes",
        info["snapshot_hash"], "MiniMaxH3Transformer3DModel", "released", f"{t['parameters']:,}", "device       cpu",
    ):
        assert needle in text, needle


def test_component_folder_and_file_inputs(tiny_snapshot):
    comp = snapshot_info(tiny_snapshot / "transformer_ref", device="cpu")
    assert comp["kind"] == "component" and list(comp["components"]) == ["transformer_ref"]
    assert comp["config"]["transformer_ref"]["preset"] == "tiny"
    full = snapshot_info(tiny_snapshot, device="cpu")
    assert comp["components"]["transformer_ref"]["hash"] == full["components"]["transformer_ref"]["hash"]
    index = tiny_snapshot / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    by_index = snapshot_info(index, device="cpu")["components"]["transformer"]
    assert by_index["hash"] == full["components"]["transformer"]["hash"]
    one = snapshot_info(tiny_snapshot / "vae" / "diffusion_pytorch_model.safetensors", device="cpu")
    assert one["kind"] == "file"
    assert one["components"]["diffusion_pytorch_model"]["parameters"] == full["components"]["vae"]["parameters"]


def test_hash_ignores_location_and_sees_content(tmp_path, tiny_snapshot):
    copy = shutil.copytree(tiny_snapshot / "transformer", tmp_path / "transformer")
    original = component_hash(tiny_snapshot / "transformer")
    assert component_hash(copy) == original
    shard = copy / "diffusion_pytorch_model-00001-of-00003.safetensors"
    header = read_header(shard)
    # Pick a tensor bigger than 3 samples: its first bytes are not sampled, its middle bytes are.
    key, t = next((k, t) for k, t in header.tensors.items() if t.offsets[1] - t.offsets[0] >= 3 * SAMPLE_BYTES)
    base = data_start(shard)
    poison(shard, base + t.offsets[0], 8)  # unsampled bytes: the report cannot see them (by design)
    assert component_hash(copy) == original
    info = snapshot_info(copy, device="cpu")
    assert info["components"]["transformer"]["hash"] == original
    middle = base + t.offsets[0] + (t.offsets[1] - t.offsets[0]) // 2
    poison(shard, middle, 1)  # a sampled byte changes the hash
    assert component_hash(copy) != original
    (copy / "config.json").write_text((copy / "config.json").read_text().replace('"ffn_dim": 40', '"ffn_dim": 40 '))
    assert component_hash(copy) != original


def test_truncated_weight_file_is_reported(tmp_path, tiny_snapshot):
    copy = shutil.copytree(tiny_snapshot / "vae", tmp_path / "vae")
    shard = copy / "diffusion_pytorch_model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    pattern = r"diffusion_pytorch_model.safetensors: key '.*' ends at data byte .*\(truncated file\)"
    with pytest.raises(CheckpointError, match=pattern):
        snapshot_info(copy, device="cpu")


def test_sparse_full_size_snapshot_scans_fast_and_reads_little(sparse_full_snapshot):
    root, total = sparse_full_snapshot
    snapshot_info(root, device="cpu")  # warm imports (torch for the device report)
    headers = sum(len(read_header(p).raw) + 8 for p in (root / "transformer").glob("*.safetensors"))
    n_tensors = 1 + sum(len(read_header(p).tensors) for p in (root / "transformer").glob("*.safetensors"))
    small = sum(p.stat().st_size for p in root.rglob("*.json"))
    before, start = bytes_read(), time.perf_counter()
    info = snapshot_info(root, device="cpu")
    elapsed, read = time.perf_counter() - start, bytes_read() - before
    assert info["scan_s"] < 1.0 and elapsed < 2.0
    # Headers (read once to parse, once to hash), one 64-byte sample per tensor, the JSON files: ~1 MB of 66 GB.
    assert read < 2 * headers + n_tensors * SAMPLE_BYTES + 2 * small + 256 * 1024, read
    assert read < total / 10_000
    comp = info["components"]["transformer"]
    assert comp["parameters"] == 33_122_992_896 and comp["dtype_policy"] == "released"
    assert comp["bytes"] > 60 * 2**30 and comp["weight_files"] == 12
    assert info["config"]["transformer"]["preset"] == "full"
    assert info["variants"]["transformer_ref"]["present"] is False
    assert "preset full; 50 blocks, 2 refiner; 56x128 heads (inner 7168), hidden 5376" in format_info(info)


def test_bad_paths_and_devices(tmp_path, tiny_snapshot):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    for bad, pattern in (
        (tmp_path / "missing", "no such snapshot, component folder or weight file"),
        (tmp_path / "notes.txt", "not a snapshot root"),
        (tmp_path / "empty", "not a snapshot root"),
    ):
        with pytest.raises(CheckpointError, match=pattern) as exc:
            snapshot_info(bad, device="cpu")
        assert "\n" not in str(exc.value)
    with pytest.raises(CheckpointError, match="not a torch device string"):
        snapshot_info(tiny_snapshot, device="gpu-please")
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="CUDA is not available"):
            snapshot_info(tiny_snapshot, device="cuda")


def test_default_path_is_the_embedded_trained_snapshot(tmp_path, tiny_snapshot, monkeypatch):
    """No path: the embedded default (the shipped h3-shapes snapshot), not the random tiny one in the cache."""
    from h3lab.checkpoint import shipped

    monkeypatch.setenv("H3LAB_CACHE", str(tmp_path / "cache"))
    shutil.copytree(tiny_snapshot, tmp_path / "cache" / f"{tiny.TINY_VERSION}-seed0")
    info = snapshot_info(None, device="cpu")
    assert info["path"] == str(shipped.SHIPPED.resolve()) and info["path"] == str(tiny.default_snapshot().resolve())
