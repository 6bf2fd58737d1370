"""What the video and audio VAE wrappers share: loading a Diffusers autoencoder from a snapshot subfolder and reading
its per-channel latent statistics.

Contract
- `load_vae(vae_class, snapshot, subfolder, label, device, dtype)`: `<snapshot>/<subfolder>` must hold a
  `config.json` (else `CheckpointError`); loaded safetensors-only and offline, in `dtype` when given, moved to
  `device` when given.
- `latent_stats(cfg, label, latent_channels, shape)`: the config's `latents_mean` / `latents_std` lists as float32 CPU
  tensors viewed to `shape` (one -1 for the channel axis), exactly as the pipeline builds them; a missing list or one
  whose length is not `latent_channels` raises `CheckpointError` naming `label`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError


def load_vae(vae_class: Any, snapshot: str | Path, subfolder: str, label: str,
             device: str | torch.device | None, dtype: torch.dtype | None) -> torch.nn.Module:
    path = Path(snapshot) / subfolder
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{label} folder {str(path)!r} has no config.json")
    kwargs: dict[str, Any] = {"use_safetensors": True, "local_files_only": True}
    if dtype is not None:
        kwargs["torch_dtype"] = dtype
    vae = vae_class.from_pretrained(str(path), **kwargs)
    return vae.to(device) if device is not None else vae


def latent_stats(cfg: Any, label: str, latent_channels: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    if cfg.latents_mean is None or cfg.latents_std is None:
        raise CheckpointError(f"{label} config has no latents_mean/latents_std: the pipeline normalises with them")
    mean = torch.tensor(cfg.latents_mean).view(*shape)
    std = torch.tensor(cfg.latents_std).view(*shape)
    if mean.numel() != latent_channels or std.numel() != latent_channels:
        raise CheckpointError(
            f"{label} config latents_mean/std have {mean.numel()}/{std.numel()} values: "
            f"must have latent_channels={latent_channels}"
        )
    return mean, std
