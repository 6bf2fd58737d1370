"""Run the released Diffusers MiniMax-H3 blocks directly, as oracles: a block is called with a plain namespace
holding exactly the components and pipeline properties it reads, and a `PipelineState` holding its inputs."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import SimpleNamespace
from typing import Any

import torch


def components(**parts: Any) -> SimpleNamespace:
    """The pipeline properties every MiniMax-H3 block reads (released values, from `modular_pipeline.py`), plus
    `parts` (text_encoder, tokenizer, processor, vae, audio_vae, image_processor, video_processor, scheduler, ...)."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as P

    base = dict(
        _execution_device=torch.device("cpu"),
        text_encoder_layer=50,
        text_tag=1,
        video_tag=0,
        audio_tag=2,
        fps=24,
        min_duration=5.0,
        max_duration=15.0,
        audio_channels=2,
        pixel_mean=P.pixel_mean.fget(None),
        pixel_std=P.pixel_std.fget(None),
        keyframe_encode_seed=42,
        keyframe_noise_aug=0.999,
        canvas_multiple=32,
        patch_size=(1, 2, 2),
        vae_frames_per_chunk=17,
        vae_latents_per_chunk=5,
        audio_sampling_rate=32000,
        config=SimpleNamespace(canvas_short_edge=768, canvas_max_pixels=768 * 1344, reference_image_short_edge=2048),
    )
    if parts.get("vae") is not None:
        base["vae_latent_channels"] = parts["vae"].config.latent_channels
    if parts.get("audio_vae") is not None:
        base["audio_latent_channels"] = parts["audio_vae"].config.latent_channels
    base.update(parts)
    return SimpleNamespace(**base)


def run_block(block: Any, comps: SimpleNamespace, **inputs: Any) -> Any:
    """Call one Diffusers block; returns the `PipelineState` after it ran."""
    from diffusers.modular_pipelines.modular_pipeline import PipelineState

    state = PipelineState()
    for key, value in inputs.items():
        state.set(key, value)
    block(comps, state)
    return state


def transformers_video_module() -> Any:
    """transformers' `video_processing_qwen3_vl` module loaded from its file. The package attribute raises without
    torchvision, but the module's pure functions (`smart_resize`, `Qwen3VLVideoProcessor.patchify`) run without it."""
    import transformers.models.qwen3_vl as pkg

    name = "transformers.models.qwen3_vl._h3lab_video_oracle"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(pkg.__file__), "video_processing_qwen3_vl.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
