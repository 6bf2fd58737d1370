"""VideoVAE against the released Diffusers blocks: conditioning encode, decode to uint8, patchify/unpatchify, tiling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import diffusers_oracle as oracle
from h3lab.components.video_vae import VideoVAE, patchify, unpatchify
from h3lab.errors import ValidationError


def test_patchify_matches_diffusers_pack_and_unpack(rng):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep

    c, t, h, w = 4, 3, 4, 6
    latents = torch.from_numpy(rng.standard_normal((c, t, h, w)).astype(np.float32))
    rows = patchify(latents)
    assert rows.shape == (t * (h // 2) * (w // 2), c * 4)
    assert torch.equal(rows, patchify_video_latents(latents[None], (1, 2, 2)))
    # Frame-major, then row-major: row k of frame f, patch (i, j) holds latents[:, f, 2i:2i+2, 2j:2j+2] in (c, ph, pw).
    f, i, j = 2, 1, 2
    assert torch.equal(rows[f * 6 + i * 3 + j], latents[:, f, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2].reshape(-1))
    assert torch.equal(unpatchify(rows, t, h, w), latents)

    # The after-denoise step drops conditioning rows and unpacks the rest: our unpatchify of the same rows agrees.
    cond = torch.from_numpy(rng.standard_normal((5, c * 4)).astype(np.float32))
    audio = torch.from_numpy(rng.standard_normal((2 * 7, 8)).astype(np.float32))
    comps = oracle.components(vae_latent_channels=c)
    state = oracle.run_block(
        MiniMaxH3AfterDenoiseStep(), comps, latents=torch.cat([cond, rows]), audio_latents=audio,
        num_condition_video_rows=5, num_condition_audio_rows=0, num_latent_frames=t, latent_height=h,
        latent_width=w, num_audio_latents=7,
    )
    assert torch.equal(state.get("latents")[0], unpatchify(rows, t, h, w))


def test_patchify_rejects_bad_shapes():
    with pytest.raises(ValidationError, match=r"latents shape \(4, 3, 5, 6\): \(T, H, W\) must be divisible"):
        patchify(torch.zeros(4, 3, 5, 6))
    with pytest.raises(ValidationError, match=r"rows shape \(5, 16\): a 3x4x6 latent grid"):
        unpatchify(torch.zeros(5, 16), 3, 4, 6)


@pytest.mark.parametrize("num_frames, latent_frames", [(1, 1), (22, 7)])
def test_encode_condition_matches_released(video_vae, rng, num_frames, latent_frames):
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    frames = rng.integers(0, 256, size=(num_frames, 32, 48, 3), dtype=np.uint8)
    mine = video_vae.encode_condition(frames)
    assert mine.shape == (4, latent_frames, 2, 3) and mine.dtype == torch.float32 and mine.device.type == "cpu"
    assert video_vae.latent_frames(num_frames) == latent_frames
    pixels = torch.from_numpy(frames).permute(3, 0, 1, 2)[None]
    theirs = encode_vae_condition(video_vae.vae, pixels, oracle.components().pixel_mean, oracle.components().pixel_std)
    assert torch.equal(mine, theirs[0])
    # Sampled (not the mean), fp16-rounded before normalisation.
    z = mine * video_vae.latents_std[0] + video_vae.latents_mean[0]
    assert torch.allclose(z, z.half().float(), rtol=0, atol=1e-6)
    if num_frames == 1:
        assert torch.equal(video_vae.encode_condition(frames), mine)  # its own generator: repeatable
    assert video_vae.latent_frames(39) == 12 and video_vae.latent_frames(124) == 37


def test_keyframe_encode_step_matches(video_vae, rng):
    from PIL import Image

    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3KeyframeVaeEncoderStep

    images = [rng.integers(0, 256, size=(32, 64, 3), dtype=np.uint8) for _ in range(2)]
    state = oracle.run_block(
        MiniMaxH3KeyframeVaeEncoderStep(), oracle.components(vae=video_vae.vae),
        keyframes=[Image.fromarray(i) for i in images],
    )
    for theirs, image in zip(state.get("condition_latents"), images):
        assert torch.equal(video_vae.encode_condition(image[None]), theirs[0])


def test_decode_matches_released_decode_step(video_vae, rng):
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep
    from diffusers.video_processor import VideoProcessor

    latents = torch.from_numpy(rng.standard_normal((4, 7, 2, 3)).astype(np.float32))
    frames = video_vae.decode(latents)
    assert frames.shape == (22, 32, 48, 3) and frames.dtype == np.uint8
    processor = VideoProcessor(vae_scale_factor=16, do_normalize=False)
    comps = oracle.components(vae=video_vae.vae, video_processor=processor)
    state = oracle.run_block(MiniMaxH3VideoDecodeStep(), comps, latents=latents[None], output_type="pil")
    theirs = np.stack([np.asarray(im) for im in state.get("videos")[0]])
    assert np.array_equal(frames, theirs)
    assert frames.std() > 5  # a real picture, not a constant


@pytest.mark.parametrize("t", [1, 2])
def test_decode_refuses_latent_lengths_the_vae_cannot_decode(video_vae, t):
    z = torch.randn(4, t, 2, 3)
    assert video_vae.min_decode_frames == 3
    with pytest.raises(ValidationError, match=f"latent frames {t}: the released video VAE cannot decode fewer than 3"):
        video_vae.decode(z)
    with pytest.raises(ValueError, match="non-empty list"):  # the refusal guards a real failure (empty torch.cat)
        video_vae.vae.decode(z[None])
    with pytest.raises(ValidationError, match=r"latents shape \(3, 7, 2, 3\): decode takes \(4, frames"):
        video_vae.decode(torch.zeros(3, 7, 2, 3))


def test_tiling_is_on_by_default(component_snapshot, video_vae, rng):
    from diffusers import AutoencoderKLMiniMaxH3

    assert video_vae.vae.use_tiling
    wide = rng.integers(0, 256, size=(1, 32, 320, 3), dtype=np.uint8)  # 320 px > one 256 px tile
    untiled = VideoVAE.from_pretrained(component_snapshot, tiling=False)
    assert not untiled.vae.use_tiling
    tiled_z, untiled_z = video_vae.encode_condition(wide), untiled.encode_condition(wide)
    assert tiled_z.shape == untiled_z.shape == (4, 1, 2, 20) and not torch.equal(tiled_z, untiled_z)
    fresh = AutoencoderKLMiniMaxH3.from_pretrained(str(component_snapshot / "vae"), use_safetensors=True)
    assert fresh.use_tiling  # the released default we keep


def test_encode_condition_rejects_bad_frames(video_vae):
    with pytest.raises(ValidationError, match="must be uint8"):
        video_vae.encode_condition(np.zeros((1, 32, 32, 3), np.float32))
    with pytest.raises(ValidationError, match=r"frames shape \(32, 32, 3\)"):
        video_vae.encode_condition(np.zeros((32, 32, 3), np.uint8))
    with pytest.raises(ValidationError, match="frame size 40x32: must be a multiple of the VAE ratio 16"):
        video_vae.encode_condition(np.zeros((1, 32, 40, 3), np.uint8))


def test_bfloat16_load_keeps_released_fp32_modules(component_snapshot, rng):
    vae = VideoVAE.from_pretrained(component_snapshot, dtype=torch.bfloat16)
    assert next(vae.vae.encoder.parameters()).dtype == torch.float32
    assert vae.vae.decoder.proj_in.weight.dtype == torch.bfloat16
    frames = vae.decode(torch.from_numpy(rng.standard_normal((4, 3, 2, 2)).astype(np.float32)))
    assert frames.shape == (9, 32, 32, 3) and frames.dtype == np.uint8
