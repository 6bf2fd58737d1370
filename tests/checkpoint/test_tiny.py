"""The tiny snapshot: same seed -> same bytes (two builds in different folders), every component loads with its
Diffusers / transformers class (processor offline, without torchvision), forwards are finite and input-dependent,
and `random_snapshot()` (the cached random build) builds atomically into `$H3LAB_CACHE`, reuses a valid cache and rebuilds a corrupted one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from h3lab.checkpoint import tiny
from h3lab.config import H3Config
from h3lab.errors import CheckpointError


# The released float32 modules, spelled out here rather than imported, so the test checks the rule independently.
FP32 = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out")


def file_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def rebuilt_default(tiny_snapshot, tmp_path_factory):
    """Exercise `random_snapshot()` end to end in a private cache: (1) a verified cache is reused as is,
    (2) a corrupted one is rebuilt from scratch, in a fresh interpreter with a different PYTHONHASHSEED — which is
    also the second, independent seed-0 build that the determinism test compares with the session fixture."""
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("H3LAB_CACHE")
    os.environ["H3LAB_CACHE"] = str(cache)
    try:
        final = cache / f"{tiny.TINY_VERSION}-seed0"
        shutil.copytree(tiny_snapshot, final)
        marker = (final / "vae" / "config.json").stat().st_ino
        reused = tiny.random_snapshot()
        assert reused == final and (final / "vae" / "config.json").stat().st_ino == marker  # not rebuilt
        # Corrupt one weight byte: the manifest no longer verifies, so the next call rebuilds.
        shard = final / "transformer" / "diffusion_pytorch_model-00002-of-00003.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        assert not tiny.verify_snapshot(final)
        # Rebuild in a fresh interpreter with another hash seed: same bytes must not depend on the process.
        proc = subprocess.run(
            [sys.executable, "-c", "from h3lab.checkpoint.tiny import random_snapshot; print(random_snapshot())"],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "H3LAB_CACHE": str(cache), "PYTHONHASHSEED": "123", "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == str(final) and tiny.verify_snapshot(final)
        assert tiny.random_snapshot() == final  # and this process now reuses it
        assert sorted(p.name for p in cache.iterdir()) == [final.name]  # no temp or trash folders left behind
        yield final
    finally:
        if old is None:
            os.environ.pop("H3LAB_CACHE", None)
        else:
            os.environ["H3LAB_CACHE"] = old


def test_same_seed_same_bytes(tiny_snapshot, rebuilt_default):
    a, b = file_hashes(tiny_snapshot), file_hashes(rebuilt_default)
    assert a == b
    assert tiny_snapshot != rebuilt_default
    expected = {
        "model_index.json", "h3lab_manifest.json", "transformer/config.json", "transformer_ref/config.json",
        "transformer/diffusion_pytorch_model.safetensors.index.json", "vae/config.json", "audio_vae/config.json",
        "text_encoder/config.json", "text_encoder/model.safetensors", "tokenizer/tokenizer.json",
        "processor/processor_config.json", "scheduler/scheduler_config.json", "audio_scheduler/scheduler_config.json",
    }
    assert expected <= set(a)
    total = sum(p.stat().st_size for p in tiny_snapshot.rglob("*") if p.is_file())
    assert 1_000_000 < total < 5_000_000  # a few MB


def test_manifest_from_another_maker_is_not_trusted(tmp_path, tiny_snapshot):
    copy = shutil.copytree(tiny_snapshot, tmp_path / "snap")
    assert tiny.verify_snapshot(copy)
    assert tiny_snapshot.stat().st_mode & 0o777 == 0o755  # not left at mkdtemp's private 0700
    manifest = json.loads((copy / tiny.MANIFEST).read_text())
    manifest["maker"] = "0" * 64  # e.g. built by an older tiny.py or other library versions
    (copy / tiny.MANIFEST).write_text(json.dumps(manifest))
    assert not tiny.verify_snapshot(copy)
    assert tiny.verify_snapshot(tiny_snapshot)
    (copy / "extra.txt").write_text("x")
    assert not tiny.verify_snapshot(copy)


def test_seed_changes_weights_not_structure():
    from diffusers import MiniMaxH3Transformer3DModel

    def build(seed):
        return tiny.randomize_(MiniMaxH3Transformer3DModel(**H3Config.tiny().to_diffusers()), seed, "transformer")

    a, b, a2 = build(0).state_dict(), build(1).state_dict(), build(0).state_dict()
    assert all(torch.equal(a[k], a2[k]) for k in a)  # independent of the global RNG state
    assert all(not torch.equal(a[k], b[k]) for k in a)


def test_make_tiny_snapshot_refuses_non_empty_root(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("keep me")
    with pytest.raises(CheckpointError, match="exists and is not an empty folder"):
        tiny.make_tiny_snapshot(tmp_path / "x")
    with pytest.raises(CheckpointError, match="seed=-1"):
        tiny.make_tiny_snapshot(tmp_path / "y", seed=-1)
    assert (tmp_path / "x" / "file").read_text() == "keep me"


def test_model_index_and_schedulers(tiny_snapshot):
    from diffusers import MiniMaxH3Scheduler

    index = json.loads((tiny_snapshot / "model_index.json").read_text())
    assert index["transformer"] == index["transformer_ref"] == ["diffusers", "MiniMaxH3Transformer3DModel"]
    for name in ("text_encoder", "tokenizer", "processor", "vae", "audio_vae", "scheduler", "audio_scheduler"):
        assert (tiny_snapshot / name).is_dir() and name in index
    video = MiniMaxH3Scheduler.from_pretrained(tiny_snapshot, subfolder="scheduler")
    audio = MiniMaxH3Scheduler.from_pretrained(tiny_snapshot, subfolder="audio_scheduler")
    assert video.config.shift == 12.0 and audio.config.shift == 3.0


def test_transformers_load_with_released_dtypes(tiny_snapshot):
    from diffusers import MiniMaxH3Transformer3DModel

    for sub in ("transformer", "transformer_ref"):
        model = MiniMaxH3Transformer3DModel.from_pretrained(
            tiny_snapshot, subfolder=sub, torch_dtype=torch.bfloat16, use_safetensors=True
        )
        assert H3Config.from_dict(dict(model.config)) == H3Config.tiny()
        for name, p in model.named_parameters():
            fp32 = any(part in FP32 for part in name.split("."))
            assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), name
            assert p.float().std() > 0 or p.numel() == 1, name  # nothing left at a constant init


def test_video_vae_decode_depends_on_latents(tiny_snapshot):
    from diffusers import AutoencoderKLMiniMaxH3

    vae = AutoencoderKLMiniMaxH3.from_pretrained(tiny_snapshot, subfolder="vae", use_safetensors=True)
    assert vae.dtype == torch.float32 and vae.config.latent_channels == 4
    mean, std = vae.config.latents_mean, vae.config.latents_std
    assert len(mean) == len(std) == 4 and len(set(mean)) == 4 and min(std) > 0.4 and mean != [0.0] * 4
    g = torch.Generator().manual_seed(0)
    z1, z2 = torch.randn(2, 1, 4, 7, 2, 2, generator=g)  # 7 latent frames -> 22 pixel frames
    with torch.no_grad():
        x1, x2 = vae.decode(z1).sample, vae.decode(z2).sample
        post = vae.encode(x1[:, :, :5]).latent_dist
    assert x1.shape == (1, 3, 22, 32, 32) and torch.isfinite(x1).all()
    assert 0.1 < x1.std() < 2.0  # ImageNet-normalised pixels, mostly inside the [0, 1] pixel range
    assert (x1 - x2).abs().mean() > 0.1 * x1.std()  # the decoder output depends on the latents
    assert post.mean.shape == (1, 4, 2, 2, 2) and torch.isfinite(post.mean).all() and post.mean.std() > 0.05


def test_audio_vae_round_trip_is_not_saturated(tiny_snapshot):
    from diffusers import AutoencoderKLMiniMaxH3Audio

    vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(tiny_snapshot, subfolder="audio_vae", use_safetensors=True)
    assert vae.dtype == torch.float32 and vae.config.latent_channels == H3Config.tiny().audio_in_channels
    assert len(vae.config.latents_mean) == 8 and len(set(vae.config.latents_std)) == 8
    g = torch.Generator().manual_seed(1)
    wave = 0.3 * torch.randn(2, 1, 8000, generator=g)  # stereo as two mono batch items, 0.25 s at 32 kHz
    with torch.no_grad():
        lat = vae.encode(wave).latent_dist.mode()
        out = vae.decode(lat).sample
        other = vae.decode(torch.randn(lat.shape, generator=g)).sample
    assert lat.shape == (2, 8, 10) and torch.isfinite(lat).all() and lat.std() > 0.05
    assert out.shape == (2, 1, 8000) and torch.isfinite(out).all()
    assert (out.abs() > 0.999).float().mean() < 0.2  # not clamped flat
    assert out.std() > 0.05 and (out - other).abs().mean() > 0.05


def test_text_encoder_layer_50(tiny_snapshot):
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(tiny_snapshot / "tokenizer", local_files_only=True)
    model = Qwen3VLForConditionalGeneration.from_pretrained(
        tiny_snapshot / "text_encoder", dtype=torch.bfloat16, local_files_only=True
    )
    text = model.config.text_config
    assert text.num_hidden_layers == 51 and text.hidden_size == H3Config.tiny().text_dim
    assert model.dtype == torch.bfloat16

    def layer50(prompt):
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.model(
                input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True, use_cache=False
            )
        assert len(out.hidden_states) == 52
        return out.hidden_states[50]

    a, b = layer50("the cat and the owl"), layer50("a red fox in the snow")
    assert a.shape == (1, len(tok("the cat and the owl", add_special_tokens=False)["input_ids"]), 16)
    assert torch.isfinite(a).all() and a.float().std() > 0.1
    assert not torch.equal(a[0, :3], b[0, :3])


def test_tokenizer_and_processor_load_offline(tiny_snapshot):
    # This machine has no route to the Hub: passing here means the folders load from disk alone.
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2TokenizerFast, Qwen3VLProcessor

    from h3lab.checkpoint import load_processor

    tok = Qwen2TokenizerFast.from_pretrained(tiny_snapshot / "tokenizer", local_files_only=True)
    auto = AutoTokenizer.from_pretrained(tiny_snapshot / "tokenizer", local_files_only=True)
    assert auto.get_vocab() == tok.get_vocab()
    for special in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<|im_end|>"):
        ids = tok(special, add_special_tokens=False)["input_ids"]
        assert ids == [tok.convert_tokens_to_ids(special)] and ids[0] >= 256
    text = "The cat, 42 owls!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and len(ids) < len(text.encode())  # byte-level BPE with merges

    proc = load_processor(tiny_snapshot / "processor")
    assert type(proc) is Qwen3VLProcessor
    assert proc.tokenizer.get_vocab() == tok.get_vocab()
    assert proc.image_processor.patch_size == 16 and proc.image_processor.merge_size == 2
    assert proc.video_processor.temporal_patch_size == 2
    image = AutoImageProcessor.from_pretrained(tiny_snapshot / "processor", backend="pil", local_files_only=True)
    assert image.to_dict()["size"] == proc.image_processor.to_dict()["size"]

    # The image path the fl2va / ref2va text encoder step runs: pixels -> patches -> vision tokens.
    rgb = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    vision = proc.image_processor(images=[rgb], return_tensors="pt")
    grid = vision["image_grid_thw"]
    n_tokens = int(grid.prod()) // proc.image_processor.merge_size**2
    assert vision["pixel_values"].shape[0] == int(grid.prod()) and n_tokens > 0
    block = [proc.vision_start_token_id] + [proc.image_token_id] * n_tokens + [proc.vision_end_token_id]
    types = proc.create_mm_token_type_ids([ids + block])[0]
    assert list(types) == [0] * len(ids) + [0] + [1] * n_tokens + [0]

    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_snapshot / "text_encoder", dtype=torch.bfloat16)
    input_ids = torch.tensor([ids + block])
    with torch.no_grad():
        out = model.model(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            pixel_values=vision["pixel_values"].to(torch.bfloat16), image_grid_thw=grid,
            mm_token_type_ids=torch.tensor([types]), output_hidden_states=True, use_cache=False,
        )
    assert out.hidden_states[50].shape == (1, input_ids.shape[1], 16) and torch.isfinite(out.hidden_states[50]).all()
