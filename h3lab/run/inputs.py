"""`DenoiseInputs`: the sealed tensors of a run -- everything the loop reads besides the model and the schedule.

Text embeddings (B, Nt, text_dim); initial video rows (B, Nv, video_patch_dim) and audio rows (B, Na,
audio_in_channels) float32 -- conditioning rows first, then the noise rows; the packed-layout index tensors; and the
per-pass row timestep plan `(timestep (T,) float32, timestep_indices (S,) int64)`. All of it is sealed with a run, so
a replay needs no layout builder, no text encoder and no VAE. `tensors()` / `meta()` are the sealed form (safetensors
keys + JSON), `from_tensors` reads it back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampler import DualSchedule
from .registry import RunSpecError


@dataclass(frozen=True, eq=False)
class DenoiseInputs:
    """Everything the loop reads besides the model and the schedule (see the module docstring). Frozen: a change is
    a new object (`replace`); the tensors are shared, not copied, and must not be written in place.

    text (B, Nt, text_dim); video (B, Nv, video_patch_dim) float32, conditioning rows first; audio (B, Na, C_audio)
    float32, reference rows first; position_ids (S, 3); token_tags, video/audio/text_indices int64; plan: per pass
    `(timestep (T,) float32, timestep_indices (S,) int64)`."""

    text: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    plan: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # a list is accepted and stored as a tuple
    num_condition_video_rows: int = 0
    num_condition_audio_rows: int = 0
    layout_sha256: str = ""
    seeds: dict = field(default_factory=dict)
    task: str = ""
    key_order: torch.Tensor | None = None  # (S,) canonical attention key order; None for a canonical layout

    _LAYOUT_KEYS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", tuple(tuple(p) for p in self.plan))
        for name in ("text", "video", "audio"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or x.ndim != 3:
                got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise RunSpecError(f"inputs.{name} is {got}: must be a (batch, rows, features) tensor")
        batches = {n: getattr(self, n).shape[0] for n in ("text", "video", "audio")}
        if len(set(batches.values())) != 1:
            raise RunSpecError(f"inputs batch sizes {batches}: text, video and audio must share one batch size")
        if not 0 <= self.num_condition_video_rows <= self.video.shape[1]:
            raise RunSpecError(
                f"num_condition_video_rows={self.num_condition_video_rows}: must be in [0, {self.video.shape[1]}]"
            )
        if not 0 <= self.num_condition_audio_rows <= self.audio.shape[1]:
            raise RunSpecError(
                f"num_condition_audio_rows={self.num_condition_audio_rows}: must be in [0, {self.audio.shape[1]}]"
            )
        if not self.plan:
            raise RunSpecError("inputs.plan is empty: one (timestep, timestep_indices) pair per pass is required")

    @property
    def batch_size(self) -> int:
        return self.video.shape[0]

    @property
    def num_passes(self) -> int:
        return len(self.plan)

    @property
    def seq_len(self) -> int:
        return self.position_ids.shape[0]

    @classmethod
    def from_layout(
        cls,
        layout: Any,
        schedule: DualSchedule,
        text: torch.Tensor,
        video: torch.Tensor,
        audio: torch.Tensor,
        seeds: dict | None = None,
    ) -> "DenoiseInputs":
        """Seal a `PackedLayout`'s tensors and its per-pass plan for `schedule` with the pre-encoded inputs.
        `video`/`audio` are the initial rows (B, N, C) (or (N, C), batch 1), conditioning rows first."""
        video = video if video.ndim == 3 else video[None]
        audio = audio if audio.ndim == 3 else audio[None]
        text = text if text.ndim == 3 else text[None]
        plan = [tuple(p) for p in layout.timestep_plan(schedule.video.timesteps, schedule.audio.timesteps)]
        return cls(
            text=text, video=video, audio=audio,
            position_ids=layout.position_ids, token_tags=layout.token_tags, video_indices=layout.video_indices,
            audio_indices=layout.audio_indices, text_indices=layout.text_indices, plan=plan,
            num_condition_video_rows=int(layout.num_condition_video_rows),
            num_condition_audio_rows=int(layout.num_condition_audio_rows),
            layout_sha256=layout.sha256(), seeds=dict(seeds or {}), task=str(getattr(layout, "task", "")),
            key_order=layout.key_order(),
        )

    def replace(self, **changes: Any) -> "DenoiseInputs":
        return dataclasses.replace(self, **changes)

    def resealed(self, layout: Any, schedule: DualSchedule) -> "DenoiseInputs":
        """The same text / video / audio rows and seeds sealed for another layout and/or schedule (index tensors
        and per-pass plan rebuilt), on this inputs' device."""
        out = self.from_layout(layout, schedule, self.text, self.video, self.audio, self.seeds)
        return out.to(self.video.device)

    def to(self, device: torch.device | str) -> "DenoiseInputs":
        mv = lambda x: x.to(device)  # noqa: E731
        return self.replace(
            text=mv(self.text), video=mv(self.video), audio=mv(self.audio), position_ids=mv(self.position_ids),
            token_tags=mv(self.token_tags), video_indices=mv(self.video_indices),
            audio_indices=mv(self.audio_indices), text_indices=mv(self.text_indices),
            plan=[(mv(t), mv(i)) for t, i in self.plan],
            key_order=None if self.key_order is None else mv(self.key_order),
        )

    def layout_kwargs(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self._LAYOUT_KEYS}

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor dict of everything sealed (safetensors keys)."""
        out = {"text": self.text, "video": self.video, "audio": self.audio, **self.layout_kwargs()}
        if self.key_order is not None:
            out["key_order"] = self.key_order
        for i, (t, idx) in enumerate(self.plan):
            out[f"plan.{i:04d}.timestep"] = t
            out[f"plan.{i:04d}.timestep_indices"] = idx
        return out

    def meta(self) -> dict[str, Any]:
        return {
            "num_condition_video_rows": self.num_condition_video_rows,
            "num_condition_audio_rows": self.num_condition_audio_rows,
            "layout_sha256": self.layout_sha256,
            "seeds": self.seeds,
            "task": self.task,
            "num_passes": self.num_passes,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "DenoiseInputs":
        n = int(meta["num_passes"])
        try:
            plan = [(tensors[f"plan.{i:04d}.timestep"], tensors[f"plan.{i:04d}.timestep_indices"]) for i in range(n)]
            return cls(
                text=tensors["text"], video=tensors["video"], audio=tensors["audio"],
                **{k: tensors[k] for k in cls._LAYOUT_KEYS}, plan=plan,
                num_condition_video_rows=int(meta["num_condition_video_rows"]),
                num_condition_audio_rows=int(meta["num_condition_audio_rows"]),
                layout_sha256=str(meta.get("layout_sha256", "")), seeds=dict(meta.get("seeds", {})),
                task=str(meta.get("task", "")), key_order=tensors.get("key_order"),
            )
        except KeyError as exc:
            raise RunSpecError(f"sealed inputs lack tensor {exc.args[0]!r}: the inputs file is incomplete") from None
