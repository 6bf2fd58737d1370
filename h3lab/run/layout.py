"""Packed layouts of MiniMax-H3: which row of the one packed sequence holds what, where it sits on the (t, h, w)
rotary grid, which modality tag and timestep it carries, and the index tensors that scatter the three input
streams into the sequence and select the two outputs back.

Contract: for t2va and fl2va (anchors "first", "last", "first"+"last") `build_layout` is bit-equal (positions,
tags, indices, counts) to Diffusers' `MiniMaxH3PrepareLayoutStep.build_packed_sequence`; for ref2va to
`MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence`; `PackedLayout.row_timesteps` to
`MiniMaxH3SetTimestepsStep.build_row_timesteps` (which ends in `torch.unique(sorted=True, return_inverse=True)`).

Canonical row order (facts §2):
  t2va / fl2va   [text | anchor blocks, in anchor order | target audio ch0, ch1 | target video]
  ref2va         [text | one block per reference, in request order | target audio ch0, ch1 | target video]
                 image -> its video rows; audio -> its audio rows; video -> its soundtrack rows (if any), then its
                 video rows.
Video rows are frame-major then row-major over the (1, 2, 2)-patch grid; audio rows are channel-major.
`video_indices` lists conditioning/reference video rows first, then target rows; `audio_indices` reference rows
first, then target rows; `text_indices` = arange(L). Tags: video 0, text 1, audio 2; text rows keep their given tag
(a Qwen vision block's rows are 0).

Positions (float64 as built; the model casts): text t = row, h = w = 0. The media clock starts at L (t2va/fl2va) or
at L advanced by each reference block (image +1, audio +A, video +max(A_soundtrack, sequential sum of its frame
spans)). Latent frame k sits at origin + 5/3 * sum of the pattern (1,4,4,4,4) over the frames before k. Anchor
"first" sits at the origin, "last" at origin + (pairwise numpy sum of all frame spans) - 5/3, the last pixel frame.
Spatial axes: n = dim // patch points `linspace(left, left + r, n, endpoint=False) * 32` (numpy), r = dim /
sqrt(H*W), left = (1 - r)/2, per block on its own grid. Audio: t = origin + arange(A), h = 0, w = the first (ch0) or
last (ch1) width coordinate of its block's grid (the target's for target and standalone audio, the video's own for
a soundtrack). The two different summation orders are the reference's and are kept on purpose.

Timesteps per row (`row_timesteps(video_t, audio_t)`): target video and text rows video_t; target audio audio_t;
conditioning/reference video rows max(video_t, 0.999); reference audio rows 1.0 (clean).

Identity and permutations: every row carries its block, its offset in the block, its timestep kind and its
canonical packed row, so `row_table()` can say what each row is after any permutation. `permute(perm)` is the
gather `new_row[i] = old_row[perm[i]]` applied to every per-row tensor, with the index tensors remapped
(`inv[idx]`), so each stream keeps its row order: the model's packed-row intermediates permute by `perm` and its
selected video/audio outputs are unchanged (H-C3). `permute(perm, leave_behind=name)` leaves one or more of
`PERMUTABLE` unpermuted — an illegal, inconsistent layout for the H1 probe (`left_behind` records it).
`canonical_order()` is the gather that restores canonical order: `layout.permute(layout.canonical_order())`.

A layout is immutable by contract: its tensors are CPU tensors that callers must not modify in place (copy first);
`sha256()` hashes every tensor's bytes plus the scalar description, and `to_json()` / `from_json()` round-trip it
exactly (float64 written as shortest-repr floats).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ..config import AUDIO, TEXT, VIDEO
from ..errors import ValidationError

TASKS = ("t2va", "fl2va", "ref2va")
ANCHOR_SETS = (("first",), ("last",), ("first", "last"))
REFERENCE_KINDS = ("image", "video", "audio")
PATCH_SIZE = (1, 2, 2)
AUDIO_CHANNELS = 2  # stereo, packed channel-major
# Timestep of conditioning video rows is max(video_t, CONDITION_VIDEO_T); reference audio rows are clean.
CONDITION_VIDEO_T = 0.999
REFERENCE_AUDIO_T = 1.0
# Rotary clock: one latent frame spans 5/3 * (1, 4, 4, 4, 4)[k % 5] units (5/3 per pixel frame, 40 units/s).
ROPE_FRAME_UNITS = 5.0 / 3.0
ROPE_FRAME_PATTERN = (1, 4, 4, 4, 4)
ROPE_SPATIAL_SCALE = 32

# Per-row timestep kinds (`row_time_kinds`) and the row roles of the row table.
TIME_VIDEO, TIME_AUDIO, TIME_CONDITION, TIME_REFERENCE_AUDIO = 0, 1, 2, 3
TIME_KIND_NAMES = ("video_t", "audio_t", "cond_video_t", "ref_audio_t")
ROLES = ("text", "cond", "ref", "target")
STREAMS = ("text", "video", "audio")
# Metadata `permute(..., leave_behind=...)` can leave unpermuted; "timestep" is the per-row timestep kind.
PERMUTABLE = ("position_ids", "token_tags", "timestep", "video_indices", "audio_indices", "text_indices")

FORMAT = "h3lab.packed_layout/1"


class LayoutError(ValidationError):
    """A layout request or layout file breaks a rule; the message names the value and the rule."""


# ----------------------------------------------------------------------------------------------- references
def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise LayoutError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)


@dataclass(frozen=True)
class Reference:
    """One ref2va reference, as the layout sees it (latent units, not pixels).

    image: one latent frame on a (latent_height, latent_width) grid.
    video: `latent_frames` frames on its own grid, plus an optional soundtrack of `audio_latents` per channel (0: none).
    audio: `audio_latents` per channel, on the target's width grid.
    Build them with `Reference.image(h, w)`, `Reference.video(f, h, w, soundtrack_latents=0)`, `Reference.audio(a)`."""

    kind: str
    latent_frames: int = 0
    latent_height: int = 0
    latent_width: int = 0
    audio_latents: int = 0

    def __post_init__(self) -> None:
        if self.kind not in REFERENCE_KINDS:
            raise LayoutError(f"reference kind {self.kind!r}: must be one of {REFERENCE_KINDS}")
        if self.kind == "audio":
            _positive("audio reference audio_latents", self.audio_latents)
            if self.latent_frames or self.latent_height or self.latent_width:
                raise LayoutError(f"audio reference {self}: has no video grid (frames/height/width must be 0)")
            return
        if self.kind == "image" and self.latent_frames != 1:
            raise LayoutError(f"image reference latent_frames={self.latent_frames!r}: an image is one latent frame")
        if self.kind == "image" and self.audio_latents:
            raise LayoutError(f"image reference audio_latents={self.audio_latents!r}: an image has no audio")
        _positive(f"{self.kind} reference latent_frames", self.latent_frames)
        _positive(f"{self.kind} reference audio_latents", self.audio_latents, 0)
        _positive(f"{self.kind} reference latent_height", self.latent_height)
        _positive(f"{self.kind} reference latent_width", self.latent_width)

    @classmethod
    def image(cls, latent_height: int, latent_width: int) -> "Reference":
        return cls("image", 1, latent_height, latent_width, 0)

    @classmethod
    def video(cls, latent_frames: int, latent_height: int, latent_width: int, soundtrack_latents: int = 0):
        return cls("video", latent_frames, latent_height, latent_width, soundtrack_latents)

    @classmethod
    def audio(cls, audio_latents: int) -> "Reference":
        return cls("audio", 0, 0, 0, audio_latents)

    @property
    def has_audio(self) -> bool:
        return self.audio_latents > 0

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "latent_frames": self.latent_frames,
            "latent_height": self.latent_height,
            "latent_width": self.latent_width,
            "audio_latents": self.audio_latents,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Reference":
        return cls(**{k: data[k] for k in ("kind", "latent_frames", "latent_height", "latent_width", "audio_latents")})


@dataclass(frozen=True)
class Block:
    """A contiguous run of rows in canonical order: the text, an anchor, one part of a reference, or a target.
    Video blocks have `frames x grid_h x grid_w` rows (frame-major, row-major); audio blocks `2 x audio_latents`
    rows (channel-major); the text block `num_rows` rows."""

    label: str  # "text", "anchor0:first", "ref1:soundtrack", "ref1:video", "target:audio", "target:video", ...
    role: str  # one of ROLES
    stream: str  # one of STREAMS: which input tensor the rows come from
    start: int  # canonical first row
    num_rows: int
    time_kind: int  # one of the TIME_* kinds
    frames: int = 0
    grid_h: int = 0
    grid_w: int = 0
    audio_latents: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


# -------------------------------------------------------------------------------------------- grid helpers
def _check_grid(what: str, latent_height, latent_width, patch_size) -> None:
    axes = (("latent_height", latent_height, patch_size[1]), ("latent_width", latent_width, patch_size[2]))
    for name, dim, patch in axes:
        _positive(f"{what} {name}", dim)
        if dim % patch:
            raise LayoutError(f"{what} {name}={dim}: must be a multiple of the patch {patch} (VAE latents are even)")


def _frame_grid(latent_height: int, latent_width: int, patch_size) -> tuple[torch.Tensor, torch.Tensor]:
    """((grid_h*grid_w, 2) float64 (h, w) coordinates of one frame, row-major; the (grid_w,) width axis)."""
    sqrt_area = np.sqrt(latent_height * latent_width)

    def axis(dim: int, patch: int) -> torch.Tensor:
        # numpy's endpoint-free linspace (start + arange(n) * step), not torch.linspace: the released grid is numpy's.
        ratio = dim / sqrt_area
        left = (1.0 - ratio) / 2.0
        return torch.from_numpy(np.linspace(left, left + ratio, dim // patch, endpoint=False) * ROPE_SPATIAL_SCALE)

    h_axis, w_axis = axis(latent_height, patch_size[1]), axis(latent_width, patch_size[2])
    hh, ww = torch.meshgrid(h_axis, w_axis, indexing="ij")
    return torch.stack([hh.reshape(-1), ww.reshape(-1)], dim=-1), w_axis


def _frame_spans(num_frames: int) -> list[float]:
    """Rotary units each latent frame spans: 5/3 * (1, 4, 4, 4, 4)[k % 5], as python (float64) values."""
    return [ROPE_FRAME_UNITS * ROPE_FRAME_PATTERN[k % len(ROPE_FRAME_PATTERN)] for k in range(num_frames)]


def _frame_times(num_frames: int, origin: float) -> torch.Tensor:
    """(num_frames,) float64 rotary time of every latent frame: origin + exclusive cumulative span (torch cumsum)."""
    spans = torch.tensor(_frame_spans(num_frames), dtype=torch.float64)
    return origin + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])


def _last_anchor_time(num_frames: int, origin: float) -> float:
    """The "last" keyframe sits on the last pixel frame: origin + (numpy pairwise sum of all spans) - 5/3."""
    return origin + float(np.asarray(_frame_spans(num_frames), dtype=np.float64).sum()) - ROPE_FRAME_UNITS


def _video_span(num_frames: int) -> float:
    """Rotary time a video reference advances the clock by: its spans summed sequentially in float64."""
    total = 0
    for span in _frame_spans(num_frames):
        total = total + span
    return float(total)


# --------------------------------------------------------------------------------------------- the layout
_TENSOR_FIELDS = (
    "position_ids",
    "token_tags",
    "video_indices",
    "audio_indices",
    "text_indices",
    "row_time_kinds",
    "row_blocks",
    "row_offsets",
    "canonical_rows",
)
_PER_ROW = ("position_ids", "token_tags", "row_time_kinds", "row_blocks", "row_offsets", "canonical_rows")
_LEAVE_BEHIND_FIELD = {
    "position_ids": "position_ids",
    "token_tags": "token_tags",
    "timestep": "row_time_kinds",
    "video_indices": "video_indices",
    "audio_indices": "audio_indices",
    "text_indices": "text_indices",
}


def timesteps_of_kinds(kinds: torch.Tensor, video_t: float | torch.Tensor, audio_t: float | torch.Tensor):
    """`PackedLayout.row_timesteps` from per-row timestep kinds (S,) int64 (`TIME_VIDEO` .. `TIME_REFERENCE_AUDIO`)."""
    video_t, audio_t = float(video_t), float(audio_t)
    # Each value is a python float rounded once to float32, as Diffusers writes them into its float32 row tensor.
    values = torch.tensor([video_t, audio_t, max(video_t, CONDITION_VIDEO_T), REFERENCE_AUDIO_T], dtype=torch.float32)
    return torch.unique(values[kinds], sorted=True, return_inverse=True)


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """One packed sequence of S rows. Model inputs: `position_ids` (S, 3) float64, `token_tags` (S,) int64,
    `video_indices` (Nv,), `audio_indices` (Na,), `text_indices` (L,) int64, and per step the pair returned by
    `row_timesteps(video_t, audio_t)`. Identity metadata (not model inputs): `row_time_kinds`, `row_blocks`
    (index into `blocks`), `row_offsets` (row within its block), `canonical_rows` (canonical packed row), all (S,)
    int64. Build with `build_layout(...)`; never construct by hand."""

    task: str
    anchors: tuple[str, ...]
    references: tuple[Reference, ...]
    num_latent_frames: int
    latent_height: int
    latent_width: int
    num_audio_latents: int
    patch_size: tuple[int, int, int]
    blocks: tuple[Block, ...]
    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    row_time_kinds: torch.Tensor
    row_blocks: torch.Tensor
    row_offsets: torch.Tensor
    canonical_rows: torch.Tensor
    left_behind: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        self._check_structure()

    # ---------------------------------------------------------------------------------------------- geometry
    @property
    def sequence_length(self) -> int:
        return self.position_ids.shape[0]

    @property
    def num_text_tokens(self) -> int:
        return self.text_indices.numel()

    @property
    def grid(self) -> tuple[int, int]:
        """Target (grid_h, grid_w) patch grid of one latent frame."""
        return self.latent_height // self.patch_size[1], self.latent_width // self.patch_size[2]

    @property
    def rows_per_frame(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_condition_video_rows(self) -> int:
        """Leading rows of `video_indices` that are anchors / references (never stepped by the sampler)."""
        return sum(b.num_rows for b in self.blocks if b.stream == "video" and b.role != "target")

    @property
    def num_condition_audio_rows(self) -> int:
        """Leading rows of `audio_indices` that are reference audio (never stepped by the sampler)."""
        return sum(b.num_rows for b in self.blocks if b.stream == "audio" and b.role != "target")

    @property
    def num_target_video_rows(self) -> int:
        return self.num_latent_frames * self.rows_per_frame

    @property
    def num_target_audio_rows(self) -> int:
        return self.num_audio_latents * AUDIO_CHANNELS

    @property
    def is_consistent(self) -> bool:
        """False after an illegal permutation (some metadata left behind)."""
        return not self.left_behind

    @property
    def is_canonical(self) -> bool:
        return self.is_consistent and torch.equal(self.canonical_rows, torch.arange(self.sequence_length))

    def geometry(self) -> dict:
        return {
            "task": self.task,
            "num_text_tokens": self.num_text_tokens,
            "num_latent_frames": self.num_latent_frames,
            "latent_height": self.latent_height,
            "latent_width": self.latent_width,
            "num_audio_latents": self.num_audio_latents,
            "patch_size": list(self.patch_size),
            "grid": list(self.grid),
            "sequence_length": self.sequence_length,
            "num_condition_video_rows": self.num_condition_video_rows,
            "num_condition_audio_rows": self.num_condition_audio_rows,
        }

    def model_inputs(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The transformer's structural keyword arguments (timestep pair excluded), copied to `device`."""
        names = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")
        return {n: getattr(self, n).to(device, copy=True) for n in names}

    # --------------------------------------------------------------------------------------------- timesteps
    def row_timesteps(self, video_t: float | torch.Tensor, audio_t: float | torch.Tensor):
        """(unique_t (T,) float32 sorted, timestep_indices (S,) int64) for one pass: every row's timestep from its
        kind (see module docstring), reduced with `torch.unique(sorted=True, return_inverse=True)`."""
        return timesteps_of_kinds(self.row_time_kinds, video_t, audio_t)

    def timestep_plan(self, video_timesteps: torch.Tensor, audio_timesteps: torch.Tensor) -> list:
        """`row_timesteps` for every pass of a `DualSchedule` (its `video.timesteps`, `audio.timesteps`)."""
        if len(video_timesteps) != len(audio_timesteps):
            raise LayoutError(
                f"{len(video_timesteps)} video vs {len(audio_timesteps)} audio timesteps: the schedules must pass "
                "together"
            )
        return [self.row_timesteps(v, a) for v, a in zip(video_timesteps.tolist(), audio_timesteps.tolist())]

    # ------------------------------------------------------------------------------------------ row identity
    def row_table(self, video_t: float | None = None, audio_t: float | None = None) -> list[dict]:
        """One dict per packed row, in current packed order:
        row, canonical_row, stream (input tensor), tag, role, block (label), time_kind, t, h, w, frame/y/x (video
        blocks) or channel/latent (audio blocks), source (index into the stream's input rows: the k with
        `<stream>_indices[k] == row`), selection (index into the video/audio output, None for text), and with
        video_t and audio_t given, timestep_index into that pass's unique timesteps. On an inconsistent layout
        source/selection follow the (possibly stale) index tensors."""
        S = self.sequence_length
        source = torch.full((S,), -1, dtype=torch.long)
        stream_of: list[str | None] = [None] * S  # None: no index tensor addresses the row (stale indices only)
        for name, idx in (("text", self.text_indices), ("video", self.video_indices), ("audio", self.audio_indices)):
            source[idx] = torch.arange(idx.numel())
            for r in idx.tolist():
                stream_of[r] = name
        tsteps = None
        if video_t is not None or audio_t is not None:
            if video_t is None or audio_t is None:
                raise LayoutError("row_table: give both video_t and audio_t, or neither")
            tsteps = self.row_timesteps(video_t, audio_t)[1].tolist()
        pos = self.position_ids.tolist()
        tags, kinds = self.token_tags.tolist(), self.row_time_kinds.tolist()
        blocks, offsets, canon = self.row_blocks.tolist(), self.row_offsets.tolist(), self.canonical_rows.tolist()
        table = []
        for r in range(S):
            block, off = self.blocks[blocks[r]], offsets[r]
            entry = {
                "row": r,
                "canonical_row": canon[r],
                "stream": stream_of[r],
                "tag": tags[r],
                "role": block.role,
                "block": block.label,
                "time_kind": TIME_KIND_NAMES[kinds[r]],
                "t": pos[r][0],
                "h": pos[r][1],
                "w": pos[r][2],
                "frame": None,
                "y": None,
                "x": None,
                "channel": None,
                "latent": None,
                "source": int(source[r]) if stream_of[r] is not None else None,
                "selection": int(source[r]) if stream_of[r] in ("video", "audio") else None,
            }
            if block.stream == "video":
                per_frame = block.grid_h * block.grid_w
                entry.update(frame=off // per_frame, y=(off % per_frame) // block.grid_w, x=off % block.grid_w)
            elif block.stream == "audio":
                entry.update(channel=off // block.audio_latents, latent=off % block.audio_latents)
            if tsteps is not None:
                entry["timestep_index"] = tsteps[r]
            table.append(entry)
        return table

    # ---------------------------------------------------------------------------------------- permutations
    def canonical_order(self) -> torch.Tensor:
        """(S,) int64 gather that restores canonical order (identity for a freshly built layout):
        `layout.permute(order)` is canonical and `packed_tensor[..., order, :]` maps packed rows back."""
        return torch.argsort(self.canonical_rows)

    def key_order(self) -> torch.Tensor | None:
        """The attention key order the model needs for this layout: None for a layout in canonical order (packed
        order is canonical), else `canonical_order()` — keys visited canonically make a consistent permutation
        permute the outputs byte for byte (H-C3)."""
        return None if self.is_canonical else self.canonical_order()

    def permute(self, perm, leave_behind: str | Iterable[str] = ()) -> "PackedLayout":
        """New layout with row i = old row perm[i]. Legal (default): every per-row tensor gathered by perm and the
        index tensors remapped, so the streams keep their row order. `leave_behind`: names from `PERMUTABLE`
        kept as they were, giving an inconsistent layout (H1 probe)."""
        S = self.sequence_length
        perm = torch.as_tensor(perm)
        if perm.dtype not in (torch.int32, torch.int64) or perm.shape != (S,):
            raise LayoutError(f"perm of shape {tuple(perm.shape)} and dtype {perm.dtype}: must be ({S},) integers")
        perm = perm.to(torch.long).cpu()
        if not torch.equal(torch.sort(perm).values, torch.arange(S)):
            raise LayoutError(f"perm: must hold every row 0..{S - 1} exactly once")
        names = (leave_behind,) if isinstance(leave_behind, str) else tuple(leave_behind)
        for name in names:
            if name not in PERMUTABLE:
                raise LayoutError(f"leave_behind={name!r}: must be one of {PERMUTABLE}")
        kept = {_LEAVE_BEHIND_FIELD[n] for n in names}
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(S)
        updates = {}
        for name in _TENSOR_FIELDS:
            value = getattr(self, name)
            if name in kept:
                updates[name] = value.clone()
            elif name in _PER_ROW:
                updates[name] = value[perm]
            else:
                updates[name] = inv[value]
        left = tuple(sorted(set(self.left_behind) | set(names)))
        return _replace(self, left_behind=left, **updates)

    # ---------------------------------------------------------------------------------- hashing, (de)serialising
    def _description(self) -> dict:
        return {
            "format": FORMAT,
            "task": self.task,
            "anchors": list(self.anchors),
            "references": [r.to_dict() for r in self.references],
            "num_latent_frames": self.num_latent_frames,
            "latent_height": self.latent_height,
            "latent_width": self.latent_width,
            "num_audio_latents": self.num_audio_latents,
            "patch_size": list(self.patch_size),
            "blocks": [b.to_dict() for b in self.blocks],
            "left_behind": list(self.left_behind),
        }

    def sha256(self) -> str:
        """SHA-256 over the scalar description (sorted-key JSON) and, per tensor in a fixed order, its name, dtype,
        shape and little-endian bytes. Equal hashes <=> equal layouts."""
        h = hashlib.sha256(json.dumps(self._description(), sort_keys=True).encode())
        for name in _TENSOR_FIELDS:
            t = getattr(self, name).contiguous()
            h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()

    def to_dict(self) -> dict:
        out = self._description()
        out["tensors"] = {name: getattr(self, name).tolist() for name in _TENSOR_FIELDS}
        out["sha256"] = self.sha256()
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "PackedLayout":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise LayoutError(f"layout format {got!r}: expected {FORMAT!r}")
        try:
            tensors = data["tensors"]
            layout = cls(
                task=data["task"],
                anchors=tuple(data["anchors"]),
                references=tuple(Reference.from_dict(r) for r in data["references"]),
                num_latent_frames=data["num_latent_frames"],
                latent_height=data["latent_height"],
                latent_width=data["latent_width"],
                num_audio_latents=data["num_audio_latents"],
                patch_size=tuple(data["patch_size"]),
                blocks=tuple(Block(**b) for b in data["blocks"]),
                left_behind=tuple(data["left_behind"]),
                **{
                    name: torch.tensor(tensors[name], dtype=torch.float64 if name == "position_ids" else torch.long)
                    for name in _TENSOR_FIELDS
                },
            )
        except (KeyError, TypeError) as err:
            raise LayoutError(f"layout file: missing or malformed field ({err})") from None
        if layout.sha256() != data.get("sha256"):
            raise LayoutError(f"layout sha256 {data.get('sha256')!r}: the content hashes to {layout.sha256()}")
        return layout

    @classmethod
    def from_json(cls, text: str) -> "PackedLayout":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise LayoutError(f"layout JSON: not valid JSON ({err})") from None
        return cls.from_dict(data)

    def __eq__(self, other) -> bool:
        if not isinstance(other, PackedLayout):
            return NotImplemented
        return self._description() == other._description() and all(
            getattr(self, n).dtype == getattr(other, n).dtype and torch.equal(getattr(self, n), getattr(other, n))
            for n in _TENSOR_FIELDS
        )

    def __hash__(self) -> int:
        return hash(self.sha256())

    def __repr__(self) -> str:
        return (
            f"PackedLayout(task={self.task!r}, rows={self.sequence_length}, text={self.num_text_tokens}, "
            f"video={self.video_indices.numel()} ({self.num_condition_video_rows} cond), "
            f"audio={self.audio_indices.numel()} ({self.num_condition_audio_rows} ref), "
            f"anchors={self.anchors}, references={len(self.references)}, left_behind={self.left_behind})"
        )

    def _check_structure(self) -> None:
        S = self.position_ids.shape[0] if self.position_ids.ndim == 2 else -1
        if self.position_ids.shape != (S, 3) or self.position_ids.dtype != torch.float64:
            shape, dtype = tuple(self.position_ids.shape), self.position_ids.dtype
            raise LayoutError(f"position_ids {shape} {dtype}: must be (S, 3) float64")
        for name in _TENSOR_FIELDS[1:]:
            t = getattr(self, name)
            if t.dtype != torch.long or t.ndim != 1 or t.device.type != "cpu":
                raise LayoutError(f"{name} {tuple(t.shape)} {t.dtype} on {t.device}: must be 1-D int64 on the CPU")
            if name in _PER_ROW and t.numel() != S:
                raise LayoutError(f"{name} has {t.numel()} rows: the layout has {S}")
        for name in ("text_indices", "video_indices", "audio_indices"):
            idx = getattr(self, name)
            if idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < S):
                raise LayoutError(f"{name}: values must lie in [0, {S})")
        # A consistent layout partitions the rows among the streams; a stale index tensor (leave_behind) need not.
        index_stale = {"text_indices", "video_indices", "audio_indices"} & set(self.left_behind)
        rows = torch.cat([self.text_indices, self.video_indices, self.audio_indices])
        if not index_stale and not torch.equal(torch.sort(rows).values, torch.arange(S)):
            raise LayoutError("text/video/audio indices: together must hold every packed row exactly once")
        if sum(b.num_rows for b in self.blocks) != S:
            raise LayoutError(f"blocks cover {sum(b.num_rows for b in self.blocks)} rows: the layout has {S}")
        for name in self.left_behind:
            if name not in PERMUTABLE:
                raise LayoutError(f"left_behind={name!r}: must be one of {PERMUTABLE}")


def _replace(layout: PackedLayout, **changes) -> PackedLayout:
    fields = {name: getattr(layout, name) for name in layout.__dataclass_fields__}
    fields.update(changes)
    return PackedLayout(**fields)


# ------------------------------------------------------------------------------------------------ builder
def _check_tags(text_token_tags) -> torch.Tensor:
    tags = torch.as_tensor(text_token_tags)
    if tags.ndim != 1 or tags.numel() == 0:
        raise LayoutError(f"text_token_tags of shape {tuple(tags.shape)}: must be 1-D with at least one text row")
    if tags.dtype.is_floating_point or tags.dtype.is_complex or tags.dtype == torch.bool:
        raise LayoutError(f"text_token_tags dtype {tags.dtype}: must be integers ({VIDEO} vision block, {TEXT} text)")
    bad = tags[(tags != VIDEO) & (tags != TEXT)]
    if bad.numel():
        raise LayoutError(
            f"text_token_tags value {int(bad[0])}: text rows are tagged {TEXT} (text) or {VIDEO} (vision block)"
        )
    return tags.to(device="cpu", dtype=torch.long)


def _check_anchors(task: str, anchors) -> tuple[str, ...]:
    anchors = (anchors,) if isinstance(anchors, str) else tuple(anchors)
    if task != "fl2va":
        if anchors:
            raise LayoutError(f"anchors={anchors}: only fl2va takes keyframe anchors, not {task}")
        return ()
    if anchors not in ANCHOR_SETS:
        raise LayoutError(f"anchors={anchors}: fl2va needs one of {ANCHOR_SETS}")
    return anchors


def _check_references(task: str, references) -> tuple[Reference, ...]:
    references = tuple(references)
    if task != "ref2va":
        if references:
            raise LayoutError(f"{len(references)} references: only ref2va takes references, not {task}")
        return ()
    if not references:
        raise LayoutError("references=(): ref2va needs at least one reference (without any it is t2va)")
    for i, ref in enumerate(references):
        if not isinstance(ref, Reference):
            raise LayoutError(f"references[{i}]={ref!r}: must be an h3lab.run.layout.Reference")
    return references


def build_layout(
    task: str,
    text_token_tags,
    num_latent_frames: int,
    latent_height: int,
    latent_width: int,
    num_audio_latents: int,
    anchors: str | Sequence[str] = (),
    references: Sequence[Reference] = (),
    patch_size: tuple[int, int, int] = PATCH_SIZE,
) -> PackedLayout:
    """The canonical packed layout of one request (see the module docstring for the rules).

    task: "t2va" | "fl2va" | "ref2va". text_token_tags: (L,) ints, 1 text / 0 vision-block rows. num_latent_frames,
    latent_height, latent_width: the target video latent grid (VAE latent units; height/width multiples of the
    patch). num_audio_latents: target audio latents per channel. anchors (fl2va only): ("first",), ("last",) or
    ("first", "last"). references (ref2va only, at least one): `Reference`s in request order. patch_size: the
    transformer's (1, ph, pw) patch."""
    if task not in TASKS:
        raise LayoutError(f"task={task!r}: must be one of {TASKS}")
    patch_size = tuple(int(p) for p in patch_size)
    if len(patch_size) != 3 or patch_size[0] != 1 or min(patch_size) < 1:
        raise LayoutError(f"patch_size={patch_size}: must be (1, ph, pw) with ph, pw >= 1")
    tags = _check_tags(text_token_tags)
    anchors = _check_anchors(task, anchors)
    references = _check_references(task, references)
    for ref in references:
        if ref.kind != "audio":
            _check_grid(f"{ref.kind} reference", ref.latent_height, ref.latent_width, patch_size)
    num_latent_frames = _positive("num_latent_frames", num_latent_frames)
    num_audio_latents = _positive("num_audio_latents", num_audio_latents)
    _check_grid("target", latent_height, latent_width, patch_size)
    latent_height, latent_width = int(latent_height), int(latent_width)

    parts = _Parts(patch_size)
    parts.text(tags.numel())
    origin = parts.conditioning(float(tags.numel()), anchors, references, num_latent_frames, latent_height,
                                latent_width)
    _, target_w_axis = _frame_grid(latent_height, latent_width, patch_size)
    parts.audio("target:audio", "target", num_audio_latents, origin, target_w_axis)
    parts.video("target:video", "target", latent_height, latent_width, _frame_times(num_latent_frames, origin))
    # Every conditioning/reference block precedes the targets in packed order, so "blocks in packed order" is
    # "conditioning first, then target" for both streams.
    return PackedLayout(
        task=task,
        anchors=anchors,
        references=references,
        num_latent_frames=num_latent_frames,
        latent_height=latent_height,
        latent_width=latent_width,
        num_audio_latents=num_audio_latents,
        patch_size=patch_size,
        **parts.rows(tags),
    )


class _Parts:
    """The blocks of one request in packed order, each (Block fields without start, (rows, 3) float64 positions);
    `rows` turns them into the layout's blocks and row tables."""

    def __init__(self, patch_size: tuple[int, int, int]):
        self.patch_size = patch_size
        self.parts: list[tuple[dict, torch.Tensor]] = []

    def text(self, L: int) -> None:
        text_pos = torch.zeros(L, 3, dtype=torch.float64)
        text_pos[:, 0] = torch.arange(L, dtype=torch.float64)
        self.parts.append((dict(label="text", role="text", stream="text", time_kind=TIME_VIDEO), text_pos))

    def video(self, label: str, role: str, h: int, w: int, times: torch.Tensor) -> None:
        # times: (frames,) float64 rotary time per latent frame; rows frame-major, then the frame's (h, w) grid.
        grid, _ = _frame_grid(h, w, self.patch_size)  # (rows_per_frame, 2)
        pos = torch.empty(times.numel(), grid.shape[0], 3, dtype=torch.float64)
        pos[:, :, 0] = times[:, None]
        pos[:, :, 1:] = grid[None]
        kind = TIME_VIDEO if role == "target" else TIME_CONDITION
        info = dict(label=label, role=role, stream="video", time_kind=kind, frames=times.numel(),
                    grid_h=h // self.patch_size[1], grid_w=w // self.patch_size[2])
        self.parts.append((info, pos.reshape(-1, 3)))

    def audio(self, label: str, role: str, latents: int, origin: float, w_axis: torch.Tensor) -> None:
        # (2 * latents, 3): channel-major; t = origin + latent index, h = 0, w = an end of the block's width axis.
        pos = torch.zeros(AUDIO_CHANNELS, latents, 3, dtype=torch.float64)
        pos[:, :, 0] = origin + torch.arange(latents, dtype=torch.float64)
        pos[0, :, 2] = float(w_axis[0])  # ch0 on the first width coordinate, ch1 on the last
        pos[1, :, 2] = float(w_axis[-1])
        kind = TIME_AUDIO if role == "target" else TIME_REFERENCE_AUDIO
        info = dict(label=label, role=role, stream="audio", time_kind=kind, audio_latents=latents)
        self.parts.append((info, pos.reshape(-1, 3)))

    def conditioning(self, origin: float, anchors: tuple[str, ...], references: tuple[Reference, ...],
                     num_latent_frames: int, latent_height: int, latent_width: int) -> float:
        """The anchors, then the references in request order, from rotary time `origin`; returns the targets'."""
        one_frame = lambda t: torch.tensor([t], dtype=torch.float64)  # noqa: E731
        for i, anchor in enumerate(anchors):
            t = origin if anchor == "first" else _last_anchor_time(num_latent_frames, origin)
            self.video(f"anchor{i}:{anchor}", "cond", latent_height, latent_width, one_frame(t))
        _, target_w_axis = _frame_grid(latent_height, latent_width, self.patch_size)
        for i, ref in enumerate(references):
            if ref.kind == "image":
                self.video(f"ref{i}:image", "ref", ref.latent_height, ref.latent_width, one_frame(origin))
                origin += 1.0  # an image takes one integer rotary slot
            elif ref.kind == "audio":
                self.audio(f"ref{i}:audio", "ref", ref.audio_latents, origin, target_w_axis)
                origin += float(ref.audio_latents)
            else:
                # The soundtrack precedes its video rows, shares their origin and sits on the video's own width axis.
                if ref.has_audio:
                    _, ref_w_axis = _frame_grid(ref.latent_height, ref.latent_width, self.patch_size)
                    self.audio(f"ref{i}:soundtrack", "ref", ref.audio_latents, origin, ref_w_axis)
                times = _frame_times(ref.latent_frames, origin)
                self.video(f"ref{i}:video", "ref", ref.latent_height, ref.latent_width, times)
                origin += max(float(ref.audio_latents), _video_span(ref.latent_frames))
        return origin

    def rows(self, tags: torch.Tensor) -> dict[str, Any]:
        """The layout's blocks (rows in list order), positions and per-row tables (tags, time kinds, block, offset,
        the three streams' packed indices, the identity canonical order)."""
        blocks, start = [], 0
        for info, pos in self.parts:
            blocks.append(Block(start=start, num_rows=pos.shape[0], **info))
            start += pos.shape[0]
        S = start
        token_tags = torch.empty(S, dtype=torch.long)
        row_time_kinds = torch.empty(S, dtype=torch.long)
        row_blocks = torch.empty(S, dtype=torch.long)
        row_offsets = torch.empty(S, dtype=torch.long)
        stream_rows: dict[str, list[torch.Tensor]] = {"text": [], "video": [], "audio": []}
        for b_index, b in enumerate(blocks):
            rows = torch.arange(b.start, b.start + b.num_rows)
            token_tags[rows] = tags if b.stream == "text" else (VIDEO if b.stream == "video" else AUDIO)
            row_time_kinds[rows] = b.time_kind
            row_blocks[rows] = b_index
            row_offsets[rows] = torch.arange(b.num_rows)
            stream_rows[b.stream].append(rows)
        return dict(
            blocks=tuple(blocks),
            position_ids=torch.cat([pos for _, pos in self.parts]),
            token_tags=token_tags,
            video_indices=torch.cat(stream_rows["video"]),
            audio_indices=torch.cat(stream_rows["audio"]),
            text_indices=torch.cat(stream_rows["text"]),
            row_time_kinds=row_time_kinds,
            row_blocks=row_blocks,
            row_offsets=row_offsets,
            canonical_rows=torch.arange(S),
        )


# ------------------------------------------------------------------------------------ token reduction (pairs)
@dataclass(frozen=True, eq=False)
class TokenPairs:
    """The horizontal-pair reduction of a layout (the token-reduction preset's layout transform, `h3lab.presets`).

    Every pair of horizontally adjacent target-video tokens of one frame row, (x = 2j, 2j + 1), becomes one reduced
    row; an odd grid width leaves its last column a singleton. Every other row -- text, target audio, anchors,
    references -- is its own reduced row, unchanged. `layout` is the reduced `PackedLayout`: R rows with their
    per-row tables (positions = the mean of the members' positions, float64; tags, timestep kinds, blocks and
    offsets of the first member; the target video block re-gridded to ceil(grid_w / 2) columns; reduced canonical
    numbering), so `layout.key_order()` and `layout.row_timesteps(...)` work on it as on any layout. A reduced row
    sits in packed order where its first member sat (the members are ordered by packed row).

    members (R, 2) int64   the full packed rows of each reduced row (a singleton lists its row twice)
    paired  (R,) bool      True for a true pair
    inverse (S,) int64     the reduced row of each full packed row

    Pairs share block, tag and timestep kind by construction, so a pair's AdaLN row is its first member's. A
    consistent permutation of the full layout gives a consistent permutation of the reduced one (pairs are defined
    by row identity, not packed position)."""

    layout: PackedLayout
    members: torch.Tensor
    paired: torch.Tensor
    inverse: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.members.shape[0]

    @property
    def num_pairs(self) -> int:
        return int(self.paired.sum())


def pair_horizontal_tokens(layout: PackedLayout) -> TokenPairs:
    """The `TokenPairs` of a consistent layout (see `TokenPairs`)."""
    if not layout.is_consistent:
        raise LayoutError(f"pair_horizontal_tokens: the layout left {list(layout.left_behind)} behind (inconsistent)")
    S = layout.sequence_length
    target = next((b for b in layout.blocks if b.role == "target" and b.stream == "video"), None)
    if target is None:  # pragma: no cover - every builder adds a target video block
        raise LayoutError("pair_horizontal_tokens: the layout has no target video block")
    t_index = layout.blocks.index(target)
    gw = target.grid_w
    gw2 = (gw + 1) // 2
    per_frame, per_frame2 = target.grid_h * gw, target.grid_h * gw2
    in_target = layout.row_blocks == t_index  # (S,) bool
    off = layout.row_offsets
    # Group key of every full row: target video rows (block, frame, y, x // 2); any other row its canonical row.
    frame, rem = off // per_frame, off % per_frame
    y, x = rem // gw, rem % gw
    new_offset = torch.where(in_target, frame * per_frame2 + y * gw2 + x // 2, off)
    key = torch.where(in_target, S + new_offset, layout.canonical_rows)  # disjoint ranges: 0..S-1 and S..
    # Reduced rows in packed order of their first member; `inverse` by grouping on the key.
    _, group = torch.unique(key, return_inverse=True)  # group id per full row (ordered by key)
    num_groups = int(group.max()) + 1
    first = torch.full((num_groups,), S, dtype=torch.long).scatter_reduce(0, group, torch.arange(S), "amin")
    last = torch.full((num_groups,), -1, dtype=torch.long).scatter_reduce(0, group, torch.arange(S), "amax")
    order = torch.argsort(first)  # reduced row r = group order[r]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(num_groups)
    members = torch.stack([first[order], last[order]], dim=1)  # (R, 2) packed rows, lower first
    paired = members[:, 0] != members[:, 1]
    inverse = rank[group]
    m0 = members[:, 0]

    # Reduced canonical numbering: by the smallest canonical row of each reduced row.
    canon_min = torch.full((num_groups,), S, dtype=torch.long).scatter_reduce(0, inverse, layout.canonical_rows, "amin")
    canonical_rows = torch.empty_like(canon_min)
    canonical_rows[torch.argsort(canon_min)] = torch.arange(num_groups)

    def stream_rows(idx: torch.Tensor) -> torch.Tensor:
        # The stream keeps its order; a pair's two entries are consecutive in the video stream (row-major frames).
        return torch.unique_consecutive(inverse[idx])

    blocks, start = [], 0
    for b in layout.blocks:  # canonical order; only the target video block changes size
        if b is target:
            b = Block(**{**b.to_dict(), "num_rows": target.frames * per_frame2, "grid_w": gw2})
        blocks.append(Block(**{**b.to_dict(), "start": start}))
        start += b.num_rows
    reduced = _replace(
        layout,
        latent_width=gw2 * layout.patch_size[2],
        blocks=tuple(blocks),
        position_ids=(layout.position_ids[members[:, 0]] + layout.position_ids[members[:, 1]]) / 2,
        token_tags=layout.token_tags[m0],
        video_indices=stream_rows(layout.video_indices),
        audio_indices=stream_rows(layout.audio_indices),
        text_indices=stream_rows(layout.text_indices),
        row_time_kinds=layout.row_time_kinds[m0],
        row_blocks=layout.row_blocks[m0],
        row_offsets=new_offset[m0],
        canonical_rows=canonical_rows,
    )
    return TokenPairs(reduced, members, paired, inverse)
