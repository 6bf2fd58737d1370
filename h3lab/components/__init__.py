"""Real components of a MiniMax-H3 snapshot and the media they consume and produce.

- `text_encoder`: `TextEncoder` (Qwen3-VL, layer 50 pre-norm, the released presentation), `cache_key`.
- `video_vae`: `VideoVAE` (conditioning encode, decode to uint8 frames), `patchify` / `unpatchify`.
- `audio_vae`: `AudioVAE` (posterior-mean encode to channel-major rows, decode to a stereo waveform).
- `_vae_common`: the snapshot loading and latent-statistics reading both VAE wrappers share.
- `references`: `Keyframe`, `ImageRef`, `VideoRef`, `AudioRef`; validation and normalisation of a request's media.
- `conditioning`: keyframes onto the canvas, VAE encodes of anchors/references, condition augmentation.
- `media`: ffmpeg-backed MP4/WAV/PNG writers and video/audio/image readers, `probe`.

Names are imported lazily so `h3lab.components.media` alone never pulls in torch, transformers or diffusers.

May import: the foundations, `execution`, `checkpoint`, `run`, `model`, `presets`, `distributed`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TextEncoder": "text_encoder",
    "PromptEncoding": "text_encoder",
    "cache_key": "text_encoder",
    "VideoVAE": "video_vae",
    "patchify": "video_vae",
    "unpatchify": "video_vae",
    "AudioVAE": "audio_vae",
    "Keyframe": "references",
    "ImageRef": "references",
    "VideoRef": "references",
    "AudioRef": "references",
    "validate_references": "references",
    "validate_conditioning": "references",
    "normalize_references": "references",
    "prepare_keyframes": "conditioning",
    "encode_keyframes": "conditioning",
    "encode_references": "conditioning",
    "augment_conditions": "conditioning",
    "MediaError": "media",
    "ExecutionPlan": "execution",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'h3lab.components' has no attribute {name!r}")
