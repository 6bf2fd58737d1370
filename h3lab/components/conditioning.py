"""Conditioning latents of one request: FL2VA keyframes onto the canvas, VAE encodes of anchors and references, and
the condition augmentation, exactly as the released pipeline does them.

Contract
- `prepare_keyframes(first, last, height, width) -> [Keyframe]` (packed order: first, then last). The first keyframe
  is *stretched* onto the canvas (PIL LANCZOS); when both are given the last is *cover-cropped*: scale =
  max(W/w, H/h), size = (max(W, round(w*scale)), max(H, round(h*scale))), LANCZOS, crop at ((sw-W)//2, (sh-H)//2);
  a lone last keyframe is stretched. An image already at the canvas size is used as is.
- `encode_keyframes(vae, keyframes) -> [(C, 1, h, w)]`: one latent frame per keyframe (`VideoVAE.encode_condition`:
  posterior sampled under seed 42, fp16-rounded, normalised).
- `encode_references(vae, audio_vae, references) -> ReferenceLatents(video=[(C, T, h, w)], audio=[(2A, C)])`, both in
  request order: images encode to 1 latent frame; videos are snapped *down* to 17n+5 frames (minimum 22) first;
  an audio-bearing reference's waveform encodes to normalised posterior-mean rows (`AudioVAE.encode`).
- `augment_conditions(latents, generator, t=0.999) -> [(C, T, h, w)]`: x = t*x0 + (1-t)*noise with one float32
  `randn` draw of the condition's shape per condition, in order, from the request generator (on the generator's
  device, then moved) — the draws precede the video and audio noise of the request. The draw and the mix are
  `h3lab.run.sampler.draw_noise` / `noise_mix`; the result is bit-equal to Diffusers' `randn_tensor` +
  `MiniMaxH3Scheduler.scale_noise`.
- Reference audio rows are **not** noised: they are packed clean and held at t = 1.0 (`REFERENCE_AUDIO_T`), as the
  released pipeline does (facts section 6). The seed README says its runtime mixes 0.999 clean + 0.001 noise for
  reference audio; h3lab keeps the released tensors because the model was trained with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import ValidationError
from ..run.sampler import draw_noise, noise_mix
from .audio_vae import AudioVAE
from .references import AudioRef, ImageRef, Keyframe, Reference, VideoRef, _image
from .video_vae import VideoVAE

CONDITION_T = 0.999  # visual conditions (keyframes, image/video references) are held at t = 0.999
REFERENCE_AUDIO_T = 1.0  # reference soundtracks are clean


def _lanczos(image: np.ndarray, width: int, height: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS))


def _cover_crop(image: np.ndarray, width: int, height: int) -> np.ndarray:
    h, w = image.shape[:2]
    scale = max(width / w, height / h)
    sw, sh = max(width, round(w * scale)), max(height, round(h * scale))
    left, top = max(0, (sw - width) // 2), max(0, (sh - height) // 2)
    return np.ascontiguousarray(_lanczos(image, sw, sh)[top : top + height, left : left + width])


def prepare_keyframes(first: Any | None, last: Any | None, height: int, width: int) -> list[Keyframe]:
    """FL2VA keyframes on a (height, width) canvas, in packed order (see module docstring)."""
    if first is None and last is None:
        raise ValidationError("no keyframe: FL2VA needs a first and/or a last frame image")
    if not all(isinstance(v, int) and v > 0 for v in (height, width)):
        raise ValidationError(f"canvas {width}x{height}: must be positive integers")
    out = []
    for role, image in (("first", first), ("last", last)):
        if image is None:
            continue
        image = _image(image, f"{role} keyframe")
        if image.shape[:2] != (height, width):
            image = _lanczos(image, width, height) if not out else _cover_crop(image, width, height)
        out.append(Keyframe(image, role))
    return out


def encode_keyframes(vae: VideoVAE, keyframes: Sequence[Keyframe]) -> list[torch.Tensor]:
    """[(C, 1, h, w)] normalised conditioning latents, one per keyframe, in packed order."""
    return [vae.encode_condition(k.image[None]) for k in keyframes]


@dataclass(frozen=True, eq=False)
class ReferenceLatents:
    video: list[torch.Tensor]  # (C, T, h, w) per image/video reference, request order
    audio: list[torch.Tensor]  # (2A, C) clean rows per audio-bearing reference, request order


def snap_down_frames(num_frames: int, clip_length: int = 17, latents_per_chunk: int = 5) -> int:
    """Largest 17n+5 (n >= 1) not above `num_frames`, and 22 below it (the VAE then pads the clip)."""
    return max(1, (num_frames - latents_per_chunk) // clip_length) * clip_length + latents_per_chunk


def encode_references(vae: VideoVAE, audio_vae: AudioVAE, references: Sequence[Reference]) -> ReferenceLatents:
    """VAE encodes of normalised references (see module docstring)."""
    video, audio = [], []
    for ref in references:
        if isinstance(ref, ImageRef):
            video.append(vae.encode_condition(ref.image[None]))
        elif isinstance(ref, VideoRef):
            n = snap_down_frames(ref.frames.shape[0], vae.clip_length, vae.latents_per_chunk)
            video.append(vae.encode_condition(ref.frames[:n]))
        elif not isinstance(ref, AudioRef):
            raise ValidationError(f"reference of type {type(ref).__name__}: must be ImageRef, VideoRef or AudioRef")
        if ref.has_audio:
            if ref.audio.shape[0] != 2:
                raise ValidationError(f"reference audio shape {ref.audio.shape}: normalise it to stereo first")
            audio.append(audio_vae.encode(ref.audio))
    return ReferenceLatents(video, audio)


def augment_conditions(
    latents: Sequence[torch.Tensor], generator: torch.Generator, t: float = CONDITION_T
) -> list[torch.Tensor]:
    """x = t*x0 + (1-t)*noise per condition, one float32 draw each from `generator`, in order."""
    if not 0.0 <= t <= 1.0:
        raise ValidationError(f"condition t={t!r}: must be within [0, 1]")
    out = []
    for x0 in latents:
        x0 = x0.to(torch.float32)
        noise = draw_noise(x0.shape, generator, x0.device)  # float32, drawn on the generator's device
        out.append(noise_mix(x0, noise, t))  # float32 t: t*x0 + (1-t)*noise
    return out
