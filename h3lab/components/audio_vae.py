"""`AudioVAE`: the released audio autoencoder (`AutoencoderKLMiniMaxH3Audio` from a snapshot's `audio_vae/`) with the
pipeline's stereo row layout and latent normalisation.

Contract
- The VAE is mono at 32 kHz with a hop of 800 samples (40 latents/s). Stereo rides as two batch items.
- `encode(waveform (2, S) float32 at 32 kHz) -> rows (2A, C)` float32 on the CPU: the waveform is right-padded to a
  multiple of 800 by the VAE, the posterior **mean** (`mode()`) is taken (never sampled, as released), normalised
  `(z - latents_mean) / latents_std` per channel and laid out channel-major: rows `[ch0 t0..tA-1, ch1 t0..tA-1]`.
  This is Diffusers' reference-soundtrack encode (`MiniMaxH3Ref2VAReferenceEncoderStep`) bit for bit.
- `decode(rows (2A, C)) -> (2, A*800)` float32 in [-1, 1] on the CPU: rows are unpacked channel-major, de-normalised
  `z * std + mean` and decoded (the decoder clamps to [-1, 1]); Diffusers' after-denoise unpack + audio decode step.
- `rows_to_latents` / `latents_to_rows` convert between (2A, C) rows and the (2, C, A) batch the VAE takes.
- Device/dtype: the module lives on `device`; Diffusers keeps every audio-VAE module in float32 whatever `dtype` says.
- Threads: on the CPU, `encode` and `decode` run with one torch thread (`one_thread`, restored after). torch's CPU
  convolutions split their reductions by thread count, so the MP4's audio bytes changed with the number of threads
  (torchrun vs one process; measured: 1 vs 2 threads give other decoded bytes); the video VAE's do not. One
  thread is what a replay uses, so a sealed digest does not depend on the thread count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import contextlib
from typing import Iterator

import numpy as np
import torch

from ..errors import ValidationError
from ._vae_common import latent_stats, load_vae

CHANNELS = 2


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """One torch thread for the duration on a CPU device (module docstring); nothing on accelerators."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def latents_to_rows(latents: torch.Tensor) -> torch.Tensor:
    """(2, C, A) -> (2A, C) channel-major rows."""
    if latents.ndim != 3 or latents.shape[0] != CHANNELS:
        raise ValidationError(f"audio latents shape {tuple(latents.shape)}: must be (2, channels, latents)")
    return latents.transpose(1, 2).reshape(-1, latents.shape[1]).contiguous()


def rows_to_latents(rows: torch.Tensor) -> torch.Tensor:
    """(2A, C) channel-major rows -> (2, C, A), the exact inverse of `latents_to_rows`."""
    if rows.ndim != 2 or rows.shape[0] % CHANNELS or rows.shape[0] == 0:
        raise ValidationError(f"audio rows shape {tuple(rows.shape)}: must be (2*latents, channels) with latents >= 1")
    return rows.reshape(CHANNELS, rows.shape[0] // CHANNELS, rows.shape[1]).permute(0, 2, 1).contiguous()


class AudioVAE:
    """The released audio VAE with the pipeline's conventions (see module docstring)."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae.eval().requires_grad_(False)
        cfg = vae.config
        self.sample_rate = int(cfg.sampling_rate)
        self.hop_length = int(vae.hop_length)
        self.latent_channels = int(cfg.latent_channels)
        # (1, 1, C) float32 CPU statistics for (batch, time, channel) latents, as the pipeline builds them.
        self.latents_mean, self.latents_std = latent_stats(cfg, "audio_vae", self.latent_channels, (1, 1, -1))

    @classmethod
    def from_pretrained(
        cls,
        snapshot: str | Path,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        subfolder: str = "audio_vae",
    ) -> "AudioVAE":
        """Load `<snapshot>/<subfolder>` (safetensors only, offline)."""
        from diffusers import AutoencoderKLMiniMaxH3Audio

        return cls(load_vae(AutoencoderKLMiniMaxH3Audio, snapshot, subfolder, "audio VAE", device, dtype))

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    def num_latents(self, num_samples: int) -> int:
        """Latents per channel for `num_samples` samples (the VAE right-pads to whole hops)."""
        return -(-num_samples // self.hop_length)

    @torch.no_grad()
    def encode(self, waveform: Any) -> torch.Tensor:
        """float32 (2, S) at the VAE rate -> normalised (2A, C) rows on the CPU (posterior mean)."""
        x = waveform
        if isinstance(x, np.ndarray):  # np.require copies only a read-only or non-contiguous array
            x = torch.from_numpy(np.require(x, requirements=["C", "W"]))
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValidationError(f"waveform of type {type(waveform).__name__}: must be a floating point array")
        if x.ndim != 2 or x.shape[0] != CHANNELS or x.shape[1] < 1:
            raise ValidationError(f"waveform shape {tuple(x.shape)}: must be (2, samples>=1) stereo")
        with one_thread(self.device):
            posterior = self.vae.encode(x.to(self.device)[:, None], return_dict=False)[0]  # batch = stereo channel
        z = posterior.mode().float().cpu().transpose(1, 2)  # (2, A, C)
        z = (z - self.latents_mean) / self.latents_std
        return z.reshape(-1, self.latent_channels)  # (2A, C), channel-major

    @torch.no_grad()
    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Normalised (2A, C) rows -> float32 (2, A*hop) waveform in [-1, 1] on the CPU."""
        if rows.ndim != 2 or rows.shape[1] != self.latent_channels:
            raise ValidationError(
                f"audio rows shape {tuple(rows.shape)}: must be (2*latents, {self.latent_channels})"
            )
        device = self.device
        z = rows_to_latents(rows.to(device, torch.float32))  # (2, C, A)
        z = z * self.latents_std.view(1, -1, 1).to(device) + self.latents_mean.view(1, -1, 1).to(device)
        with one_thread(device):
            audio = self.vae.decode(z, return_dict=False)[0]  # (2, 1, S)
        return audio.float()[:, 0].cpu()
