"""Conditioning against the released Diffusers blocks: keyframes onto the canvas, keyframe/reference VAE encodes,
condition augmentation and the order of the request generator's draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import diffusers_oracle as oracle
from h3lab.components.conditioning import (
    CONDITION_T,
    REFERENCE_AUDIO_T,
    augment_conditions,
    encode_keyframes,
    encode_references,
    prepare_keyframes,
    snap_down_frames,
)
from h3lab.components.references import AudioRef, ImageRef, VideoRef
from h3lab.components.video_vae import patchify
from h3lab.errors import ValidationError


def _resize_step(first, last, height, width):
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep

    comps = oracle.components(image_processor=VaeImageProcessor(vae_scale_factor=16))
    state = oracle.run_block(
        MiniMaxH3ResizeStep(), comps, height=height, width=width,
        image=None if first is None else Image.fromarray(first),
        last_image=None if last is None else Image.fromarray(last),
    )
    return state


@pytest.mark.parametrize(
    "first_hw, last_hw",
    [((45, 70), (50, 50)), ((32, 64), (33, 61)), (None, (41, 90)), ((90, 41), None), ((64, 96), (64, 96))],
)
def test_keyframes_match_released_resize_step(rng, first_hw, last_hw):
    first = None if first_hw is None else rng.integers(0, 256, size=(*first_hw, 3), dtype=np.uint8)
    last = None if last_hw is None else rng.integers(0, 256, size=(*last_hw, 3), dtype=np.uint8)
    keyframes = prepare_keyframes(first, last, 64, 96)
    state = _resize_step(first, last, 64, 96)
    assert [k.anchor for k in keyframes] == list(state.get("keyframe_anchors"))
    for ours, theirs in zip(keyframes, state.get("keyframes")):
        assert ours.image.shape == (64, 96, 3) and np.array_equal(ours.image, np.asarray(theirs))
    if first is not None and last is not None and last_hw != (64, 96):
        # The follower is cover-cropped, not stretched.
        stretched = np.asarray(Image.fromarray(last).resize((96, 64), Image.Resampling.LANCZOS))
        assert not np.array_equal(keyframes[1].image, stretched)


def test_fl2va_conditioning_end_to_end_matches_released(video_vae, rng):
    """Resize -> keyframe encode -> condition noise: the released blocks and ours give the same rows, and leave
    the request generator in the same state (the next draw, the video noise, is the same)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareConditionLatentsStep
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep
    from diffusers.schedulers import MiniMaxH3Scheduler

    first = rng.integers(0, 256, size=(40, 72, 3), dtype=np.uint8)
    last = rng.integers(0, 256, size=(70, 60, 3), dtype=np.uint8)
    seed = int(rng.integers(0, 2**31))

    keyframes = prepare_keyframes(first, last, 32, 64)
    latents = encode_keyframes(video_vae, keyframes)
    assert [z.shape for z in latents] == [(4, 1, 2, 4)] * 2
    gen = torch.Generator().manual_seed(seed)
    noised = augment_conditions(latents, gen)
    rows = torch.cat([patchify(z) for z in noised])

    state = _resize_step(first, last, 32, 64)
    comps = oracle.components(vae=video_vae.vae, scheduler=MiniMaxH3Scheduler())
    state = oracle.run_block(MiniMaxH3KeyframeVaeEncoderStep(), comps, keyframes=state.get("keyframes"))
    their_gen = torch.Generator().manual_seed(seed)
    state = oracle.run_block(
        MiniMaxH3PrepareConditionLatentsStep(), comps, generator=their_gen,
        condition_latents=state.get("condition_latents"), num_condition_video_rows=rows.shape[0],
    )
    assert torch.equal(rows, state.get("condition_rows"))
    assert torch.equal(torch.randn(5, generator=gen), torch.randn(5, generator=their_gen))


def test_augmentation_arithmetic_and_draw_order(rng):
    a = torch.from_numpy(rng.standard_normal((4, 1, 2, 3)).astype(np.float32))
    b = torch.from_numpy(rng.standard_normal((4, 7, 2, 2)).astype(np.float32))
    out = augment_conditions([a, b], torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    na, nb = torch.randn(a.shape, generator=g), torch.randn(b.shape, generator=g)  # one draw per condition, in order
    t = torch.tensor(CONDITION_T, dtype=torch.float32)
    assert torch.equal(out[0], t * a + (1 - t) * na) and torch.equal(out[1], t * b + (1 - t) * nb)
    assert not torch.equal(out[0], a)
    assert torch.equal(augment_conditions([a], torch.Generator().manual_seed(1), t=1.0)[0], a)
    with pytest.raises(ValidationError, match=r"condition t=1.5: must be within \[0, 1\]"):
        augment_conditions([a], torch.Generator(), t=1.5)


def test_reference_encodes_match_released(video_vae, audio_vae, rng):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    image = rng.integers(0, 256, size=(32, 64, 3), dtype=np.uint8)
    frames = rng.integers(0, 256, size=(30, 32, 48, 3), dtype=np.uint8)  # snapped down to 22 frames -> 7 latents
    sound, sound2 = (rng.standard_normal((2, 2, 20000)) * 0.2).astype(np.float32)
    ours = [ImageRef(image), VideoRef(frames, audio=sound), AudioRef(sound2)]
    encoded = encode_references(video_vae, audio_vae, ours)
    assert [z.shape for z in encoded.video] == [(4, 1, 2, 4), (4, 7, 2, 3)]
    assert [r.shape for r in encoded.audio] == [(2 * 25, 8), (2 * 25, 8)]

    theirs = [
        MiniMaxH3ImageReference(image=Image.fromarray(image)),
        MiniMaxH3VideoReference(frames=frames, fps=24.0, audio=torch.from_numpy(sound), sample_rate=32000),
        MiniMaxH3AudioReference(audio=torch.from_numpy(sound2), sample_rate=32000),
    ]
    state = oracle.run_block(
        MiniMaxH3Ref2VAReferenceEncoderStep(), oracle.components(vae=video_vae.vae, audio_vae=audio_vae.vae),
        normalized_references=theirs,
    )
    for ours_z, their_z in zip(encoded.video, state.get("condition_latents"), strict=True):
        assert torch.equal(ours_z, their_z[0])
    for ours_r, their_r in zip(encoded.audio, state.get("audio_condition_latents"), strict=True):
        assert torch.equal(ours_r, their_r)
    assert REFERENCE_AUDIO_T == 1.0  # reference audio rows are packed clean, never noised


def test_snap_down_and_keyframe_errors(rng):
    assert [snap_down_frames(n) for n in (13, 22, 30, 38, 39, 124, 130)] == [22, 22, 22, 22, 39, 124, 124]
    with pytest.raises(ValidationError, match="no keyframe"):
        prepare_keyframes(None, None, 32, 32)
    with pytest.raises(ValidationError, match="canvas 0x32: must be positive integers"):
        prepare_keyframes(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), None, 32, 0)
    with pytest.raises(ValidationError, match=r"first keyframe of shape \(8, 8\) dtype uint8"):
        prepare_keyframes(np.zeros((8, 8), np.uint8), None, 32, 32)
