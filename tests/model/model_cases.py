"""Shared builders for the model tests: tiny configs, seeded random weights, the Diffusers oracle and packed layouts
built by Diffusers' own layout steps (t2va and fl2va)."""

from __future__ import annotations


import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)

from h3lab import H3Config, H3Transformer
from h3lab.config import AUDIO, TEXT, VIDEO
from h3lab.model.random_init import random_state_dict  # noqa: F401 - the tests import it from here

# Structural variety: inner width != hidden (and one ==), partial and full rotary, 1-3 refiner layers, 0-3 blocks,
# different patches and channel counts.
CONFIGS = {
    "tiny": H3Config.tiny(),
    "h3d8": H3Config(
        num_attention_heads=3, attention_head_dim=8, hidden_size=20, num_layers=1, num_refiner_layers=1, ffn_dim=28,
        in_channels=2, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=12, freq_dim=10,
        time_embed_hidden_dim=18, time_embed_dim=14, rope_freq_dim=1,
    ),
    "h1d24": H3Config(
        num_attention_heads=1, attention_head_dim=24, hidden_size=24, num_layers=3, num_refiner_layers=3, ffn_dim=16,
        in_channels=3, audio_in_channels=4, patch_size=(1, 1, 2), text_dim=20, freq_dim=8,
        time_embed_hidden_dim=12, time_embed_dim=20, rope_freq_dim=4, rope_theta=500.0, norm_eps=1e-6,
        qk_norm_eps=1e-4, final_norm_eps=1e-3,
    ),
    "h4d6": H3Config(
        num_attention_heads=4, attention_head_dim=6, hidden_size=32, num_layers=0, num_refiner_layers=2, ffn_dim=36,
        in_channels=5, audio_in_channels=3, patch_size=(1, 2, 2), text_dim=8, freq_dim=6,
        time_embed_hidden_dim=10, time_embed_dim=8, rope_freq_dim=1,
    ),
}


def model_pair(config: H3Config, policy: str, seed: int, tmp_path) -> tuple[H3Transformer, MiniMaxH3Transformer3DModel]:
    """(ours, Diffusers) with identical weights. For `released` the Diffusers model goes through its own
    `save_pretrained` / `from_pretrained(torch_dtype=bfloat16)` (its `_keep_in_fp32_modules` behaviour), and ours
    loads Diffusers' resulting tensors; the per-parameter dtypes must agree."""
    state = random_state_dict(config, seed)
    ref = MiniMaxH3Transformer3DModel(**config.to_diffusers())
    ref.load_state_dict(state)
    if policy == "released":
        folder = tmp_path / f"diffusers-{seed}"
        ref.save_pretrained(folder, safe_serialization=True)
        ref = MiniMaxH3Transformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16, use_safetensors=True)
    ref.eval()
    ours = H3Transformer(config, dtype_policy=policy)
    ref_state = ref.state_dict()
    ours_dtypes = {k: v.dtype for k, v in ours.state_dict().items()}
    assert ours_dtypes == {k: v.dtype for k, v in ref_state.items()}
    ours.load_state_dict(ref_state)
    return ours, ref


def layout(task: str, num_text: int, frames: int, lat_h: int, lat_w: int, num_audio: int, patch, seed: int,
           anchors: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Layout tensors from Diffusers' `build_packed_sequence` (t2va: no anchors; fl2va: keyframe anchors). fl2va text
    carries vision-block rows tagged video, as the released prompt does."""
    g = torch.Generator().manual_seed(seed)
    tags = torch.full((num_text,), TEXT, dtype=torch.long)
    if task == "fl2va":
        start = int(torch.randint(0, num_text - 3, (1,), generator=g))
        tags[start:start + 3] = VIDEO
    position_ids, token_tags, video_idx, audio_idx, text_idx, n_cond_v, n_cond_a = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags, frames, lat_h, lat_w, num_audio, patch, 2, AUDIO, VIDEO, keyframe_anchors=anchors
        )
    )
    return {
        "position_ids": position_ids, "token_tags": token_tags, "video_indices": video_idx,
        "audio_indices": audio_idx, "text_indices": text_idx, "n_cond_video": n_cond_v, "n_cond_audio": n_cond_a,
    }


def row_timesteps(lay: dict, video_t: float, audio_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Diffusers' `build_row_timesteps` as the released step plan calls it (conditioning at max(t, 0.999))."""
    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        lay["video_indices"], lay["audio_indices"], lay["n_cond_video"], lay["n_cond_audio"],
        lay["text_indices"].numel(), video_t, audio_t, max(video_t, 0.999), 1.0,
    )


def forward_inputs(config: H3Config, lay: dict, timesteps: tuple[float, float], batch: int, seed: int,
                   text_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Keyword inputs of `forward` for one layout: fresh random rows (float32 latents, text in `text_dtype`)."""
    g = torch.Generator().manual_seed(seed)
    t, ti = row_timesteps(lay, *timesteps)
    nv, na, nt = lay["video_indices"].numel(), lay["audio_indices"].numel(), lay["text_indices"].numel()
    return {
        "hidden_states": torch.randn(batch, nv, config.video_patch_dim, generator=g),
        "audio_hidden_states": torch.randn(batch, na, config.audio_in_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, nt, config.text_dim, generator=g).to(text_dtype),
        "timestep": t,
        "timestep_indices": ti,
        "token_tags": lay["token_tags"],
        "position_ids": lay["position_ids"],
        "video_indices": lay["video_indices"],
        "audio_indices": lay["audio_indices"],
        "text_indices": lay["text_indices"],
    }


def weighted_loss(video: torch.Tensor, audio: torch.Tensor, seed: int) -> torch.Tensor:
    """A scalar that depends on every output value with fixed random weights (the gradient seed)."""
    g = torch.Generator().manual_seed(seed)
    wv = torch.randn(video.shape, generator=g)
    wa = torch.randn(audio.shape, generator=g)
    return (video * wv).sum() + (audio * wa).sum()


def small_case(config: H3Config, batch: int = 2, seed: int = 0, task: str = "fl2va",
               timesteps: tuple[float, float] = (0.42, 0.7), text_dtype: torch.dtype = torch.float32) -> dict:
    """One small fl2va (first + last keyframe) or t2va forward input set."""
    anchors = ("first", "last") if task == "fl2va" else ()
    lay = layout(task, 6, 3, 4, 4, 4, config.patch_size, seed, anchors)
    return forward_inputs(config, lay, timesteps, batch, seed + 1, text_dtype)
