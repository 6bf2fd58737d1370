"""Adapters from h3lab objects to the figures' plain inputs: `latent_steps(result | trajectory)`, `step_norms(...)`.

The package docstring (`h3lab.research.plots`) is the contract of every figure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .figure import PlotError

# ================================================================================================ adapters
@dataclass(frozen=True)
class LatentSteps:
    """Per-step target latents of one run: video (S, C, T, h, w), audio (S, 2A, Ca) float32 numpy, labels (S,)."""

    video: np.ndarray
    audio: np.ndarray | None
    step_labels: list[str]


def _newest(source: Any, what: str) -> Any:
    if isinstance(source, (list, tuple)):
        if not source:
            raise PlotError(f"!plot {what}: no generation yet")
        return source[-1]
    return source


def _trajectory(source: Any) -> Any:
    traj = getattr(source, "trajectory", None)
    if traj is not None:
        return traj
    if hasattr(source, "manifest") and hasattr(source, "kept"):
        return source
    raise PlotError(f"{type(source).__name__}: expected a GenerationResult or a Trajectory")


def _geometry(source: Any, traj: Any) -> tuple[int, int, int, tuple[int, int, int]]:
    """(latent frames, latent height, latent width, patch size) of the target video."""
    s = getattr(source, "settings", None)
    layout = getattr(source, "layout", None)
    if s is not None and layout is not None:
        return s.num_latent_frames, s.latent_height, s.latent_width, tuple(layout.patch_size)
    from ...schema.generation_settings import VAE_SPATIAL_RATIO, latent_frames

    meta = traj.manifest.get("meta", {}).get("settings")
    cfg = traj.manifest.get("checkpoint", {}).get("config", {})
    if not meta or "patch_size" not in cfg:
        raise PlotError("trajectory manifest lacks the request settings or the model's patch size: cannot unpack rows")
    width, height = meta["canvas"]
    return (latent_frames(int(meta["num_frames"])), height // VAE_SPATIAL_RATIO, width // VAE_SPATIAL_RATIO,
            tuple(cfg["patch_size"]))


def _kept(traj: Any, prefix: str, steps: int) -> list:
    keys = [f"{prefix}.{i:04d}" for i in range(steps)]
    missing = [k for k in keys if k not in traj.kept]
    if missing:
        raise PlotError(
            f"the trajectory kept no {prefix!r} tensors for pass(es) {', '.join(k.split('.')[-1] for k in missing[:4])}: "
            "set Session.keep = ('latents', 'velocities') before generating"
        )
    return [traj.kept[k] for k in keys]


def latent_steps(source: Any, include_initial: bool = True) -> LatentSteps:
    """Target video latents (unpacked to (C, T, h, w)) and target audio rows after every pass of a result or
    trajectory that kept its latents; with `include_initial` the sealed initial noise comes first ("noise")."""
    from ...components.video_vae import unpatchify

    source = _newest(source, "latents")
    traj = _trajectory(source)
    steps = traj.steps
    frames, lh, lw, patch = _geometry(source, traj)
    nv, na = traj.inputs.num_condition_video_rows, traj.inputs.num_condition_audio_rows
    video = _kept(traj, "video", len(steps))
    audio = _kept(traj, "audio", len(steps))
    sigmas = traj.schedule.video.sigmas.tolist()  # latents after pass i sit at sigma_{i+1}
    labels = [f"pass {s['index']} (sigma {sigmas[s['index'] + 1]:.3f})" for s in steps]
    if include_initial:
        video = [traj.inputs.video] + video
        audio = [traj.inputs.audio] + audio
        labels = ["noise"] + labels
    v = np.stack([unpatchify(x[0, nv:].float().cpu(), frames, lh, lw, patch).numpy() for x in video])
    a = np.stack([x[0, na:].float().cpu().numpy() for x in audio])
    return LatentSteps(v, a, labels)


def step_norms(source: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    """({"latent/video", "latent/audio", "velocity/video", "velocity/audio"} -> RMS per step over the target rows,
    step labels of the latent series: "noise", "pass 0", ... (latents after each pass; velocities of each pass))."""
    source = _newest(source, "norms")
    traj = _trajectory(source)
    n = len(traj.steps)
    nv, na = traj.inputs.num_condition_video_rows, traj.inputs.num_condition_audio_rows

    def rms(xs, skip):
        return np.array([float(x[0, skip:].double().pow(2).mean().sqrt()) for x in xs])

    norms = {
        "latent/video": rms([traj.inputs.video] + _kept(traj, "video", n), nv),
        "latent/audio": rms([traj.inputs.audio] + _kept(traj, "audio", n), na),
        "velocity/video": rms(_kept(traj, "velocity_video", n), nv),
        "velocity/audio": rms(_kept(traj, "velocity_audio", n), na),
    }
    return norms, ["noise"] + [f"pass {i}" for i in range(n)]
