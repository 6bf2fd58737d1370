"""The ablation bench: the shared setting every row of the matrix perturbs (`Bench`), its seeded inputs
(`make_inputs`) and the process-wide cached tiny bench (`tiny_bench`). See `h3lab.research.ablation` for what the bench is:
the tiny snapshot's two variants, an fl2va layout with a first-frame anchor (23 rows), a 2-pass dual schedule,
seeded inputs; it caches the reference runs rows share."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..drift import Capture, Execution, capture
from ...hashing import model_fingerprint
from ...run import DenoiseInputs, RunSpec
from ...run.sampler import CONDITION_T, DualSchedule, draw_noise, noise_mix
from ...run.trajectory import TrajectoryRecorder


def _ones_tags(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.long)


@dataclass
class Bench:
    """The shared setting every row perturbs (see the module docstring). `parts` keeps the pieces the inputs were
    made from (anchor latents, noise seeds) so probes can rebuild them with one change."""

    model: Any
    variant: Any
    layout: Any
    schedule: DualSchedule
    inputs: DenoiseInputs
    parts: dict[str, Any]
    snapshot: Path | None = None
    cache: dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def tiny(cls, snapshot: str | Path | None = None, num_points: int = 3, seed: int = 0) -> "Bench":
        """The tiny bench: `snapshot` (default: the embedded tiny snapshot), `num_points` grid points
        (`num_points - 1` passes), `seed` for the inputs."""
        from ...checkpoint.tiny import default_snapshot
        from ...run.layout import build_layout
        from ...model import H3Transformer

        snap = Path(snapshot) if snapshot is not None else default_snapshot()
        model = H3Transformer.from_pretrained(snap, subfolder="transformer")
        variant = H3Transformer.from_pretrained(snap, subfolder="transformer_ref")
        layout = build_layout("fl2va", _ones_tags(5), 2, 4, 4, 3, anchors=("first",),
                              patch_size=model.config.patch_size)
        schedule = DualSchedule.build(num_points)
        parts = {"seed": seed}
        inputs = make_inputs(model.config, layout, schedule, seed, parts)
        return cls(model=model, variant=variant, layout=layout, schedule=schedule, inputs=inputs, parts=parts,
                   snapshot=snap)

    # ------------------------------------------------------------------------------------------------- arms
    def inputs_for(self, layout: Any = None, schedule: DualSchedule | None = None, **changes: Any) -> DenoiseInputs:
        """The bench inputs with a different layout and/or schedule (plan rebuilt from them) and field changes."""
        layout = layout if layout is not None else self.layout
        schedule = schedule if schedule is not None else self.schedule
        base = self.inputs
        if layout is not self.layout or schedule is not self.schedule:
            base = base.resealed(layout, schedule)
        return base.replace(**changes) if changes else base

    def spec(self, mode: str = "off") -> RunSpec:
        """The bench run in `mode`: its inputs, schedule and layout on the tiny `transformer/` (one object per mode,
        so a plain reference arm is recognised by identity)."""
        key = ("spec", mode)
        if key not in self.cache:
            self.cache[key] = RunSpec(self.inputs, self.schedule, mode=mode, variant="transformer",
                                      fingerprint=model_fingerprint(self.model), layout=self.layout)
        return self.cache[key]

    @property
    def models(self) -> dict[str, Any]:
        """The variants a factor may swap in (H16)."""
        return {"transformer": self.model, "transformer_ref": self.variant}

    def reference(self, mode: str, scope: str = "trajectory", label: str = "reference") -> Execution:
        return Execution(self.spec(mode), self.model, label=f"{label}:{mode}", models=self.models, scope=scope)

    def reference_capture(self, mode: str, scope: str = "trajectory", forward_pass: int = 0) -> Capture:
        """Cached capture of the reference arm (trajectory scope also records the `Trajectory`, see
        `reference_trajectory`). A forward-scope capture is cut from the trajectory capture of the same mode."""
        if scope == "forward":
            return self.reference_capture(mode).forward_view(forward_pass)
        key = ("capture", mode)
        if key not in self.cache:
            recorder = TrajectoryRecorder(keep=("latents", "velocities"), meta={"bench": "ablation.tiny"})
            ex = self.reference(mode).replace(recorder=recorder)
            self.cache[key] = capture(ex)
            self.cache[("trajectory", mode)] = recorder.finish()
        return self.cache[key]

    def reference_trajectory(self, mode: str):
        """The reference arm's recorded `Trajectory` in `mode` (latents and velocities kept), computed once."""
        self.reference_capture(mode)
        return self.cache[("trajectory", mode)]


def make_inputs(
    config: Any, layout: Any, schedule: DualSchedule, seed: int, parts: dict | None = None
) -> DenoiseInputs:
    """Seeded pre-encoded inputs for `layout`: text embeddings N(0,1) (1, L, text_dim); anchor latents x0 N(0,1)
    noise-mixed to t = CONDITION_T with their own noise draw (first on the request generator, as released); then the
    target video noise and the target audio noise in row layout. `parts` receives the anchor latents `x0`."""
    g = torch.Generator().manual_seed(seed)
    ncv = layout.num_condition_video_rows
    nv, na, nt = layout.video_indices.numel(), layout.audio_indices.numel(), layout.text_indices.numel()
    text = torch.randn(1, nt, config.text_dim, generator=g)
    x0 = torch.randn(1, ncv, config.video_patch_dim, generator=g)  # the anchor frame's VAE latents, as rows
    cond_noise = draw_noise((1, ncv, config.video_patch_dim), g)
    video_noise = draw_noise((1, nv - ncv, config.video_patch_dim), g)
    audio_noise = draw_noise((1, na, config.audio_in_channels), g)
    video = torch.cat([noise_mix(x0, cond_noise, CONDITION_T), video_noise], dim=1)
    if parts is not None:
        parts.update(x0=x0, cond_noise=cond_noise)
    seeds = {"request": seed}
    return DenoiseInputs.from_layout(layout, schedule, text, video, audio_noise, seeds)


@functools.lru_cache(maxsize=4)
def tiny_bench(snapshot: str | None = None, num_points: int = 3, seed: int = 0) -> Bench:
    """A process-wide cached `Bench.tiny(...)` (tests of drift, ablation and arms share one bench and its cached
    strict reference runs)."""
    return Bench.tiny(snapshot, num_points, seed)
