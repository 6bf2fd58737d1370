"""`VideoVAE`: the released video autoencoder (`AutoencoderKLMiniMaxH3` from a snapshot's `vae/`) with the exact
pixel/latent conventions of the released pipeline, plus the row packing the transformer consumes.

Contract
- Pixels are uint8 RGB `(F, H, W, 3)` on both sides. The VAE sees ImageNet-normalised [0, 1] RGB:
  `(x/255 - (0.485, 0.456, 0.406)) / (0.229, 0.224, 0.225)`, and returns that space.
- `encode_condition(frames)` is the released conditioning encode (Diffusers `encode_vae_condition`): the posterior is
  **sampled** under its own CPU generator seeded 42 (independent of the request), rounded to float16, moved to the
  CPU in float32 and normalised `(z - latents_mean) / latents_std`. One frame takes the spatial-only path (1 latent
  frame); `17n + 5` frames give `5n + 2` latent frames. Returns float32 `(C, T, h, w)` on the CPU.
- `decode(latents)` takes normalised float32 `(C, T, h, w)`, computes `z * latents_std + latents_mean`, decodes,
  de-normalises `x * std + mean`, clamps to [0, 1] and rounds `x * 255` half-to-even to uint8 — the arithmetic of
  Diffusers' decode step followed by its `output_type="pil"` conversion. Returns numpy uint8 `(F, H, W, 3)`.
  The released VAE cannot decode fewer than `tokens_chunk_size - token_drop + 1` = 3 latent frames (its chunked
  decode then has no chunk and concatenates an empty list; measured for 1 and 2 frames, facts section 5 names only 1),
  so those are refused with a `ValidationError` before the VAE runs.
- Tiling is on by default, as released (256 px tiles, >= 64 px overlap); `tiling=False` disables it.
- `patchify(latents (C, T, H, W)) -> rows (T/pt * H/ph * W/pw, C*pt*ph*pw)`, frame-major then row-major, each row
  ordered (c, pt, ph, pw) — bit-identical to Diffusers' `patchify_video_latents` and inverted exactly by `unpatchify`
  (Diffusers' after-denoise unpack). Pure permutations: no arithmetic.
- Device/dtype: the module lives on `device` in the snapshot's stored dtype unless `dtype` is given (Diffusers keeps
  the encoder and the listed norms in float32 either way). Inputs are moved to the module's device; outputs land on
  the CPU.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ValidationError
from ._vae_common import latent_stats, load_vae

PIXEL_MEAN = (0.485, 0.456, 0.406)
PIXEL_STD = (0.229, 0.224, 0.225)
ENCODE_SEED = 42
PATCH_SIZE = (1, 2, 2)


def patchify(latents: torch.Tensor, patch_size: tuple[int, int, int] = PATCH_SIZE) -> torch.Tensor:
    """(C, T, H, W) -> (rows, C*pt*ph*pw); rows frame-major, then latent row, then latent column."""
    if latents.ndim != 4:
        raise ValidationError(f"latents shape {tuple(latents.shape)}: patchify takes (channels, frames, height, width)")
    pt, ph, pw = patch_size
    c, t, h, w = latents.shape
    if t % pt or h % ph or w % pw:
        raise ValidationError(
            f"latents shape {tuple(latents.shape)}: (T, H, W) must be divisible by patch {patch_size}"
        )
    x = latents.reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(1, 3, 5, 0, 2, 4, 6)  # (T', H', W', C, pt, ph, pw)
    return x.reshape(-1, c * pt * ph * pw).contiguous()


def unpatchify(
    rows: torch.Tensor, frames: int, height: int, width: int, patch_size: tuple[int, int, int] = PATCH_SIZE
) -> torch.Tensor:
    """(rows, C*pt*ph*pw) -> (C, frames, height, width); the exact inverse of `patchify` (height/width are latent)."""
    pt, ph, pw = patch_size
    if frames % pt or height % ph or width % pw:
        raise ValidationError(f"latent grid {frames}x{height}x{width}: must be divisible by patch {patch_size}")
    n = (frames // pt) * (height // ph) * (width // pw)
    if rows.ndim != 2 or rows.shape[0] != n or rows.shape[1] % (pt * ph * pw):
        raise ValidationError(
            f"rows shape {tuple(rows.shape)}: a {frames}x{height}x{width} latent grid with patch {patch_size} "
            f"needs ({n}, C*{pt * ph * pw})"
        )
    c = rows.shape[1] // (pt * ph * pw)
    x = rows.reshape(frames // pt, height // ph, width // pw, c, pt, ph, pw)
    x = x.permute(3, 0, 4, 1, 5, 2, 6)  # (C, T', pt, H', ph, W', pw)
    return x.reshape(c, frames, height, width).contiguous()


def _frames_tensor(frames: Any) -> torch.Tensor:
    """uint8 (F, H, W, 3) numpy/torch -> uint8 torch (F, H, W, 3), or ValidationError."""
    # np.require copies only a read-only (e.g. PIL-backed) or non-contiguous array: torch.from_numpy needs writable.
    x = torch.from_numpy(np.require(frames, requirements=["C", "W"])) if isinstance(frames, np.ndarray) else frames
    if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8:
        raise ValidationError(f"frames of type {type(frames).__name__}/{getattr(frames, 'dtype', None)}: must be uint8")
    if x.ndim != 4 or x.shape[-1] != 3 or x.shape[0] < 1:
        raise ValidationError(f"frames shape {tuple(x.shape)}: must be (frames>=1, height, width, 3)")
    return x


class VideoVAE:
    """The released video VAE with the pipeline's conventions (see module docstring)."""

    def __init__(self, vae: torch.nn.Module, tiling: bool = True):
        self.vae = vae.eval().requires_grad_(False)
        if tiling:
            self.vae.enable_tiling()
        else:
            self.vae.disable_tiling()
        cfg = vae.config
        self.latent_channels = int(cfg.latent_channels)
        self.spatial_ratio = int(vae.spatial_compression_ratio)
        self.clip_length = int(cfg.clip_length)  # 17 pixel frames per encoder chunk
        self.latents_per_chunk = int(vae.tokens_chunk_size)  # 5 latent frames per chunk
        drop = int(cfg.token_drop)
        # _decode makes ceil((T + drop) / chunk) - 1 chunks when drop > 0: none below this many latent frames.
        self.min_decode_frames = self.latents_per_chunk - drop + 1 if drop > 0 else 1
        # (1, C, 1, 1, 1) float32 CPU statistics, exactly as the pipeline builds them from the config lists.
        self.latents_mean, self.latents_std = latent_stats(cfg, "vae", self.latent_channels, (1, -1, 1, 1, 1))

    @classmethod
    def from_pretrained(
        cls,
        snapshot: str | Path,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        subfolder: str = "vae",
        tiling: bool = True,
    ) -> "VideoVAE":
        """Load `<snapshot>/<subfolder>` (safetensors only, offline)."""
        from diffusers import AutoencoderKLMiniMaxH3

        return cls(load_vae(AutoencoderKLMiniMaxH3, snapshot, subfolder, "video VAE", device, dtype), tiling=tiling)

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    # ------------------------------------------------------------------------------------------ geometry
    def latent_frames(self, num_frames: int) -> int:
        """Latent frames the encoder makes of `num_frames` pixel frames (1 -> 1, 17n+5 -> 5n+2)."""
        if num_frames == 1:
            return 1
        chunks = math.ceil(num_frames / self.clip_length)
        return chunks * self.latents_per_chunk - int(self.vae.config.token_drop)

    # ------------------------------------------------------------------------------------------ encode
    @torch.no_grad()
    def encode_condition(self, frames: Any, seed: int = ENCODE_SEED) -> torch.Tensor:
        """uint8 (F, H, W, 3) -> normalised float32 (C, T, H/16, W/16) on the CPU (released conditioning encode)."""
        x = _frames_tensor(frames)
        _, h, w, _ = x.shape
        if h % self.spatial_ratio or w % self.spatial_ratio:
            raise ValidationError(f"frame size {w}x{h}: must be a multiple of the VAE ratio {self.spatial_ratio}")
        device = self.device
        pixels = x.to(device).permute(3, 0, 1, 2)[None]  # (1, 3, F, H, W) uint8
        mean = torch.tensor(PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
        pixels = (pixels.to(torch.float32).div(255.0) - mean) / std
        posterior = self.vae.encode(pixels, return_dict=False)[0]
        # Own generator, seeded independently of the request: the same frame always encodes to the same anchor.
        z = posterior.sample(generator=torch.Generator().manual_seed(seed))
        z = z.to(torch.float16).float().cpu()  # fp16 rounding is part of the released recipe
        return ((z - self.latents_mean) / self.latents_std)[0]

    # ------------------------------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Normalised (C, T, h, w) -> numpy uint8 (F, H, W, 3); T >= `min_decode_frames` (3 as released)."""
        if latents.ndim != 4 or latents.shape[0] != self.latent_channels:
            raise ValidationError(
                f"latents shape {tuple(latents.shape)}: decode takes ({self.latent_channels}, frames, height, width)"
            )
        if latents.shape[1] < self.min_decode_frames:
            raise ValidationError(
                f"latent frames {latents.shape[1]}: the released video VAE cannot decode fewer than "
                f"{self.min_decode_frames} latent frames"
            )
        device = self.device
        z = latents[None].to(device, torch.float32)
        z = z * self.latents_std.to(device) + self.latents_mean.to(device)
        video = self.vae.decode(z, return_dict=False)[0]  # (1, 3, F, H, W) ImageNet-normalised
        mean = torch.tensor(PIXEL_MEAN, device=device).view(1, -1, 1, 1, 1)
        std = torch.tensor(PIXEL_STD, device=device).view(1, -1, 1, 1, 1)
        video = (video.float() * std + mean).clamp(0, 1)
        # Diffusers' "pil" conversion: numpy float32 (x * 255).round() (half to even) then uint8.
        video = (video[0].permute(1, 2, 3, 0).cpu() * 255).round().to(torch.uint8)
        return video.numpy()
