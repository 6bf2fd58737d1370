"""What `h3lab --info` reports beyond the snapshot's headers: one transformer forward of the snapshot's own geometry.

Contract
- `one_forward_report(path, device=None) -> dict`: loads `path`'s `transformer/` as an `H3Transformer` on `device`
  (default cuda when available, else cpu), runs one no-grad forward over a small random t2va layout (8 text rows,
  2x4x4 latent video, 4 audio rows; inputs from a fixed generator) in the current runtime mode and returns
  `{"variant", "mode", "rows", "device", "video_out", "audio_out", "seconds"}` (shapes as lists; JSON-ready).
- `info_report(path=None, device=None, forward=True) -> dict`: `checkpoint.info.snapshot_info(path, device)` plus,
  with `forward`, that forward under the key "forward". `path=None` is the embedded tiny snapshot.

The model work of `--info` lives here so that the CLI only prints (front ends render; see docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import info as ckpt_info


def one_forward_report(path: str | os.PathLike, device: str | None = None) -> dict[str, Any]:
    """H3Transformer forward on a small random t2va layout of the snapshot's own geometry: shapes and time."""
    from ..run.layout import build_layout
    from ..model import H3Transformer
    from ..execution.runtime import current_mode

    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = H3Transformer.from_pretrained(Path(path), subfolder="transformer", device=dev)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    tags = torch.ones(8, dtype=torch.long)
    layout = build_layout("t2va", tags, 2, 4, 4, 4)
    x = torch.randn(1, layout.video_indices.numel(), cfg.video_patch_dim, generator=g)
    a = torch.randn(1, layout.audio_indices.numel(), cfg.audio_in_channels, generator=g)
    text = torch.randn(1, 8, cfg.text_dim, generator=g)
    t, idx = layout.row_timesteps(0.25, 0.5)
    with torch.no_grad():
        t0 = time.perf_counter()
        video, audio = model(
            hidden_states=x.to(dev), audio_hidden_states=a.to(dev), encoder_hidden_states=text.to(dev),
            timestep=t.to(dev), timestep_indices=idx.to(dev), **layout.model_inputs(dev),
        )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
    return {
        "variant": "transformer", "mode": current_mode(), "rows": layout.sequence_length, "device": str(dev),
        "video_out": list(video.shape), "audio_out": list(audio.shape), "seconds": seconds,
    }


def info_report(path: str | os.PathLike | None = None, device: str | None = None, forward: bool = True
                ) -> dict[str, Any]:
    """The `--info` report: the snapshot fingerprint and, with `forward`, one transformer forward ("forward")."""
    if path is None:
        from ..checkpoint.tiny import default_snapshot

        path = default_snapshot()
    report = ckpt_info.snapshot_info(path, device)
    if forward:
        report["forward"] = one_forward_report(path, device)
    return report
