"""AudioVAE against the released Diffusers blocks: posterior-mean encode to channel-major rows, decode to stereo."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import diffusers_oracle as oracle
from h3lab.components.audio_vae import AudioVAE, latents_to_rows, rows_to_latents
from h3lab.errors import ValidationError


def test_rows_are_channel_major(rng):
    latents = torch.from_numpy(rng.standard_normal((2, 8, 5)).astype(np.float32))
    rows = latents_to_rows(latents)
    assert rows.shape == (10, 8)
    assert torch.equal(rows[:5], latents[0].T) and torch.equal(rows[5:], latents[1].T)  # [ch0 t0..t4, ch1 t0..t4]
    assert torch.equal(rows_to_latents(rows), latents)


def test_encode_matches_released_reference_encoder(audio_vae, rng):
    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3Ref2VAReferenceEncoderStep
    from diffusers.modular_pipelines.minimax_h3.references import MiniMaxH3AudioReference

    samples = 32000 + int(rng.integers(1, 799))  # not a whole number of hops: the VAE right-pads
    wave = (rng.standard_normal((2, samples)) * 0.2).astype(np.float32)
    rows = audio_vae.encode(wave)
    a = audio_vae.num_latents(samples)
    assert a == 41 and rows.shape == (2 * a, 8) and rows.dtype == torch.float32
    comps = oracle.components(vae=None, audio_vae=audio_vae.vae)
    state = oracle.run_block(
        MiniMaxH3Ref2VAReferenceEncoderStep(), comps,
        normalized_references=[MiniMaxH3AudioReference(audio=torch.from_numpy(wave), sample_rate=32000)],
    )
    assert state.get("condition_latents") == []
    assert torch.equal(rows, state.get("audio_condition_latents")[0])
    # The posterior mean, normalised: channel 1 alone encodes to the second half of the rows.
    alone = audio_vae.encode(np.stack([wave[1], wave[0]]))
    assert torch.equal(alone[:a], rows[a:]) and torch.equal(alone[a:], rows[:a])


def test_decode_matches_released_after_denoise_and_decode(audio_vae, rng):
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AfterDenoiseStep, MiniMaxH3AudioDecodeStep

    a = 6
    rows = torch.from_numpy(rng.standard_normal((2 * a, 8)).astype(np.float32))
    wave = audio_vae.decode(rows)
    assert wave.shape == (2, a * 800) and wave.dtype == torch.float32
    assert wave.abs().max() <= 1.0 and wave.std() > 1e-3
    comps = oracle.components(audio_vae=audio_vae.vae, vae_latent_channels=4)
    ref = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32))  # reference rows the step drops
    state = oracle.run_block(
        MiniMaxH3AfterDenoiseStep(), comps, latents=torch.zeros(4, 16), audio_latents=torch.cat([ref, rows]),
        num_condition_video_rows=0, num_condition_audio_rows=4, num_latent_frames=1, latent_height=4,
        latent_width=4, num_audio_latents=a,
    )
    state = oracle.run_block(MiniMaxH3AudioDecodeStep(), comps, audio_latents=state.get("audio_latents"))
    assert torch.equal(wave, state.get("audio")[0])


def test_bad_inputs(audio_vae):
    with pytest.raises(ValidationError, match=r"waveform shape \(1, 100\): must be \(2, samples>=1\) stereo"):
        audio_vae.encode(np.zeros((1, 100), np.float32))
    with pytest.raises(ValidationError, match="must be a floating point array"):
        audio_vae.encode(np.zeros((2, 100), np.int16))
    with pytest.raises(ValidationError, match=r"audio rows shape \(6, 7\): must be \(2\*latents, 8\)"):
        audio_vae.decode(torch.zeros(6, 7))
    with pytest.raises(ValidationError, match=r"audio rows shape \(5, 8\): must be \(2\*latents, channels\)"):
        audio_vae.decode(torch.zeros(5, 8))


def test_fp32_kept_under_bfloat16_load(component_snapshot):
    vae = AudioVAE.from_pretrained(component_snapshot, dtype=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in vae.vae.parameters())


def test_audio_bytes_do_not_depend_on_the_thread_count(audio_vae):
    """The MP4's audio would change with the CPU thread count (torch's conv reductions split by thread), so
    encode and decode run single-threaded on the CPU, and the caller's thread count is restored."""
    assert audio_vae.device.type == "cpu"  # the fixture's device: the thread count is a CPU matter
    g = torch.Generator().manual_seed(11)
    rows = torch.randn(2 * 37, audio_vae.latent_channels, generator=g)
    wave = (torch.rand(2, 800 * 21, generator=g) * 2 - 1) * 0.5
    before = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out[n] = (audio_vae.decode(rows), audio_vae.encode(wave))
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)
    for n in (2, 3):
        assert torch.equal(out[n][0], out[1][0]) and torch.equal(out[n][1], out[1][1]), n
