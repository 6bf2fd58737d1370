"""What one generation of a `Session` hands back: `GenerationResult`, the per-pass `StepInfo` of its progress callback,
the phases its timings name (`PHASES`) and `GenerationCancelled`.

Contract
- `StepInfo(step, total, video_t, audio_t, evaluated, seconds)`: pass `step` (1-based) of `total` just completed, its
  two modality times, whether the model ran (False: a reused velocity) and the pass's own wall time.
- `GenerationResult`: the settings and seed, the frames (uint8 (F, H, W, 3)), the stereo audio (float32 (2, S)) at
  `sample_rate`, the packed layout, the final normalised latents (video (C, T, h, w), audio rows (2A, C)), the recorded
  trajectory and its digest, the timings per phase (seconds; "load" and "cache_lookup" beside `PHASES`), what came
  from the conditioning caches, the peak memory and how it was measured, the last forward's trace, the written
  outputs, the transformer forwards run, the `RunSpec` that ran (`arm`) and a streamed run's copy statistics.
  `timing_lines()` is the `--profile` table, `to_dict()` a JSON-ready summary without tensors.
- `GenerationCancelled` (an `H3Error`): the front end set the cancel event; the generation stopped between two passes
  (or after the last one, before decoding) and the session is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import H3Error
from ..schema.generation_settings import FPS, GenerationSettings

PHASES = ("text_encode", "condition_encode", "denoise", "decode_video", "decode_audio", "write")


class GenerationCancelled(H3Error):
    """The front end set the cancel event; the generation stopped between two passes."""


@dataclass(frozen=True)
class StepInfo:
    step: int  # 1-based pass number just completed
    total: int
    video_t: float
    audio_t: float
    evaluated: bool  # the model ran (False: reused velocity)
    seconds: float  # wall time of this pass


@dataclass
class GenerationResult:
    settings: GenerationSettings
    seed: int
    frames: np.ndarray  # uint8 (F, H, W, 3) at the output size
    audio: torch.Tensor  # float32 (2, S) stereo, in [-1, 1]
    sample_rate: int
    layout: Any  # h3lab.run.layout.PackedLayout
    latents: torch.Tensor  # final target video latents, normalised, (C, T, h, w) float32 CPU
    audio_latents: torch.Tensor  # final target audio rows, normalised, (2A, C) float32 CPU
    trajectory: Any  # the recorder the loop fed
    trajectory_hash: str
    timings: dict[str, float]
    cached: dict[str, bool]
    peak_memory: int  # bytes
    memory_kind: str
    trace: Any = None  # runtime Trace of the last forward
    outputs: list[Path] = field(default_factory=list)
    evaluations: int = 0  # transformer forwards run
    arm: Any = field(default=None, repr=False)  # the `RunSpec` that ran (= trajectory.spec): `Session.drift`
    streaming: Any = None  # components.streaming.StreamStats of a streamed run (bytes moved, wait not hidden)

    @property
    def total_seconds(self) -> float:
        return sum(self.timings.values())

    @property
    def duration(self) -> float:
        return self.frames.shape[0] / FPS

    def timing_lines(self) -> list[str]:
        lines = []
        for phase in ("load", "cache_lookup") + PHASES:
            if phase == "cache_lookup" and phase not in self.timings:
                continue
            value = self.timings.get(phase, 0.0)
            note = ""
            if phase == "text_encode" and self.cached.get("text"):
                note = " (cached)"
            if phase == "condition_encode" and self.cached.get("conditions"):
                note = " (cached)"
            lines.append(f"  {phase:<16} {value:8.3f} s{note}")
        lines.append(f"  {'total':<16} {self.total_seconds:8.3f} s")
        lines.append(f"  peak memory      {self.peak_memory / 2**20:8.1f} MiB ({self.memory_kind})")
        lines.append(f"  forwards         {self.evaluations:8d}")
        if self.streaming is not None:
            lines += self.streaming.lines()
        return lines

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {
            "settings": self.settings.to_dict(),
            "seed": self.seed,
            "frames": list(self.frames.shape),
            "audio": list(self.audio.shape),
            "sample_rate": self.sample_rate,
            "trajectory_hash": self.trajectory_hash,
            "trajectory_format": self.trajectory.manifest.get("format"),
            "timings": dict(self.timings),
            "cached": dict(self.cached),
            "peak_memory_bytes": self.peak_memory,
            "memory_kind": self.memory_kind,
            "evaluations": self.evaluations,
            "outputs": [str(p) for p in self.outputs],
            "streaming": None if self.streaming is None else self.streaming.to_dict(),
        }
