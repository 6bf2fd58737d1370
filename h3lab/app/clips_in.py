"""Clips in: an MP4 and its prompt -> one encoded `ClipRequest`, ready for `h3lab.training.save_dataset`.

Contract
- `check_clip(session, video, prompt, width=None, height=None, frames=None, allow_silent=False) -> ClipPlan`: every
  rule below checked by probing the file with ffmpeg (streams, size, rate, frame count: a stream-copy pass, no video
  decode) and decoding its audio track (to measure it), plus the prompt (`settings.check_prompt`, the tokenizer's
  context through `Session.check_prompt_length`). No model loads and nothing is encoded; each failure is one
  `ValidationError` line naming the file (or the prompt) and the rule.
- `encode_clip(session, video, prompt, ...) -> ClipRequest` (what `Session.encode_clip` runs): `check_clip`, then
  the decode and the three encoders, each through the session's components (loaded on first use, released after
  their phase under phased residency):
  text   the prompt as a t2va generation encodes it (its encode phase, `phases.encode`, cached in the session by
         content);
  video  `VideoVAE.encode_condition`: the released conditioning encode (posterior sampled under its own seed 42,
         fp16-rounded, normalised), so a clip's rows are the bytes an anchor of the same frames would get; patchified
         with the snapshot transformer's patch;
  audio  `AudioVAE.encode` of the clip's own audio track: posterior mean, normalised, channel-major rows
         `[left t0..tA-1, right t0..tA-1]` -- the row order of a generation's audio noise;
  layout the t2va `PackedLayout` of that geometry (no conditioning rows). `seed` (default 0) is the request's draw
  seed and `weight` its loss weight; `h3lab train` re-seeds every request per step anyway.

Rules (the snapshot fixes no clip geometry; a clip is put on a legal one, or refused):
- frame rate: any; the frames are put on the 24 fps grid exactly as the released pipeline does for video references
  (`media.resample_frame_indices`: source frames dropped or repeated whole, no blending).
- length: `frames=None` takes the longest 17n+5 frame count (at most 362) the 24 fps clip holds and drops the tail;
  `frames=N` snaps N up to 17n+5 (`settings.resolve_frames`) and takes the clip's first F frames. A clip with fewer
  24 fps frames than that (or than 22, 0.917 s) is refused.
- size: without `width`/`height` the clip's displayed size (after rotation) is the canvas, which must satisfy the
  canvas rules (`settings.check_size`: multiples of 32, 768*1344 pixels at most, aspect 1:4..4:1) -- else refused,
  naming the size and the rule, with the hint to give both. With `width` and `height` every frame is scaled to cover
  the canvas and centre-cropped (LANCZOS; the arithmetic of a cover-cropped last anchor).
- audio: the first audio track, decoded to 32 kHz stereo (`media.read_audio`: resampled, mono duplicated), cut at
  A*800 samples, A = round(F / 24 * 40) audio latents per channel (what a generation of F frames makes). A track
  shorter than that by more than 800 samples (one audio latent, 25 ms) is refused; a shorter shortfall (AAC frame
  padding) is zero-padded. A file without an audio track is refused -- H3 learns picture and sound together --
  unless `allow_silent`, which encodes silence (zeros) for it, so the adapter learns silence for that clip.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ValidationError
from ..schema.generation_settings import AUDIO_SAMPLE_RATE, FPS, MAX_FRAMES, MIN_FRAMES, GenerationSettings, check_prompt, check_size
from ..schema.generation_settings import resolve_frames, snap_frames

HOP = 800  # audio VAE samples per latent at 32 kHz (40 latents/s)


@dataclass(frozen=True)
class ClipPlan:
    """What `encode_clip` will do with one file (module docstring), from the probe alone."""

    path: Path
    source_size: tuple[int, int]  # (width, height) as displayed
    source_fps: float
    source_frames: int  # frames of the first video stream
    settings: GenerationSettings  # prompt, canvas and F frames: the clip's geometry
    audio: str  # "track" | "silence"
    audio_samples: int  # samples of the 32 kHz track (0 for silence)

    @property
    def crop(self) -> bool:
        return self.source_size != self.settings.canvas

    def describe(self) -> str:
        s = self.settings
        w, h = self.source_size
        size = f"{w}x{h} -> {s.width}x{s.height} (scaled, centre-cropped)" if self.crop else f"{s.width}x{s.height}"
        return (f"{self.path.name}: {self.source_frames} frames at {self.source_fps:g} fps -> {s.num_frames} at {FPS}, "
                f"{size}, audio {'silence' if self.audio == 'silence' else 'track'}")


def frames_at_24(count: int, fps: float) -> int:
    """Frames a clip of `count` frames at `fps` has on the 24 fps grid (`media.resample_frame_indices`)."""
    from ..components.media import resample_frame_indices

    return int(resample_frame_indices(count, fps, FPS).size)


def _length(where: str, held: int, frames: Any) -> int:
    if frames is None:
        if held < MIN_FRAMES:
            raise ValidationError(f"{where}: has {held} frames at {FPS} fps ({held / FPS:.3f} s); a training clip "
                                  f"needs at least {MIN_FRAMES} ({MIN_FRAMES / FPS:.3f} s)")
        n = min(held, MAX_FRAMES)
        return n if snap_frames(n) == n else snap_frames(n) - 17  # the longest 17n+5 not above n
    wanted, _ = resolve_frames(frames, None)
    if held < wanted:
        raise ValidationError(f"{where}: has {held} frames at {FPS} fps ({held / FPS:.3f} s); frames={frames} needs "
                              f"{wanted} ({wanted / FPS:.3f} s)")
    return wanted


def _canvas(where: str, source: tuple[int, int], width: Any, height: Any) -> tuple[int, int]:
    if (width is None) != (height is None):
        raise ValidationError(f"width={width!r}, height={height!r}: give both (scale and centre-crop every clip to "
                              "that canvas) or neither (each clip keeps its own size)")
    if width is not None:
        return check_size(width, height)
    try:
        return check_size(*source)
    except ValidationError as err:
        raise ValidationError(f"{where}: is {source[0]}x{source[1]}, not a canvas ({err}); give a width and height "
                              "to scale and centre-crop it") from None


def check_clip(session: Any, video: str | os.PathLike, prompt: Any, width: Any = None, height: Any = None,
               frames: Any = None, allow_silent: bool = False) -> ClipPlan:
    """Every rule of one clip, without loading a model or encoding anything (module docstring)."""
    from ..components import media

    path = Path(video)
    where = f"video {str(video)!r}"
    if not path.is_file():
        raise ValidationError(f"{where}: {'no such file' if not path.exists() else 'not a regular file'}")
    info = media.probe(path, count_frames=True)
    if info.truncated:
        raise ValidationError(f"{where}: is truncated ({info.truncated}); re-export or re-download it")
    stream = info.video
    if info.is_image or stream is None:
        kind = {"image": "an image", "audio": "an audio file"}.get(info.kind, "a file without a video stream")
        raise ValidationError(f"{where}: is {kind}, not a video")
    if not stream.fps or not stream.width or not stream.height or not info.frame_count:
        raise ValidationError(f"{where}: ffmpeg reports no frame rate, size or frame count for its video stream")
    source = (stream.width, stream.height)
    if round(stream.rotation / 90.0) % 2:  # ffmpeg autorotates a quarter-turned stream on decode
        source = (stream.height, stream.width)
    canvas = _canvas(where, source, width, height)
    count = _length(where, frames_at_24(info.frame_count, stream.fps), frames)
    check_prompt(prompt)
    session.check_prompt_length(prompt)
    settings = GenerationSettings(prompt=prompt, width=canvas[0], height=canvas[1], frames=count, mode="off")
    need = settings.num_audio_latents * HOP
    if info.audio is None:
        if not allow_silent:
            raise ValidationError(f"{where}: has no audio track; H3 learns picture and sound together (give clips "
                                  "with a soundtrack, or --allow-silent / allow_silent=True to encode silence)")
        return ClipPlan(path, source, float(stream.fps), int(info.frame_count), settings, "silence", 0)
    samples = media.read_audio(path, max_seconds=need / AUDIO_SAMPLE_RATE + 1.0).shape[1]
    if samples < need - HOP:
        raise ValidationError(f"{where}: its audio track lasts {samples / AUDIO_SAMPLE_RATE:.3f} s, shorter than the "
                              f"{count} frames it trains ({need / AUDIO_SAMPLE_RATE:.3f} s of sound)")
    return ClipPlan(path, source, float(stream.fps), int(info.frame_count), settings, "track", samples)


def read_clip(plan: ClipPlan) -> tuple[np.ndarray, np.ndarray]:
    """The clip's uint8 (F, H, W, 3) frames on the canvas at 24 fps and float32 (2, A*800) audio at 32 kHz."""
    from ..components import media
    from ..components.conditioning import _cover_crop

    s = plan.settings
    bound = math.ceil(s.num_frames * plan.source_fps / FPS) + 2
    frames, _ = media.read_video(plan.path, max_frames=min(bound, plan.source_frames), target_fps=FPS)
    if frames.shape[0] < s.num_frames:
        raise ValidationError(f"video {str(plan.path)!r}: decoded {frames.shape[0]} frames at {FPS} fps; its probe "
                              f"promised {s.num_frames}")
    frames = frames[: s.num_frames]
    width, height = s.canvas
    if frames.shape[1:3] != (height, width):
        frames = np.stack([_cover_crop(f, width, height) for f in frames])
    need = s.num_audio_latents * HOP
    audio = np.zeros((2, need), dtype=np.float32)
    if plan.audio == "track":
        track = media.read_audio(plan.path, max_seconds=need / AUDIO_SAMPLE_RATE + 1.0)[:, :need]
        audio[:, : track.shape[1]] = track
    return np.ascontiguousarray(frames), audio


def encode_clip(session: Any, video: str | os.PathLike, prompt: Any, width: Any = None, height: Any = None,
                frames: Any = None, allow_silent: bool = False, seed: int = 0, weight: float = 1.0,
                plan: ClipPlan | None = None):
    """One encoded t2va `ClipRequest` of `video` and `prompt` (module docstring). `plan`: a `check_clip` result
    for the same arguments (the CLI checks every file first), else it is made here."""
    from . import phases, pipeline
    from ..components.video_vae import patchify
    from ..training import ClipRequest

    plan = plan or check_clip(session, video, prompt, width, height, frames, allow_silent)
    s = plan.settings
    pixels, waveform = read_clip(plan)
    empty = pipeline.Media([], [])
    encoded = phases.encode(session, [(s, empty)])[0]  # the text phase of a generation (no conditions to encode)
    latents = session.component("vae").encode_condition(pixels)  # (C, T, h, w) float32 CPU
    rows = session.component("audio_vae").encode(waveform)  # (2A, C) float32 CPU
    session.phase_done("vae", "audio_vae")
    if latents.shape[1] != s.num_latent_frames or rows.shape[0] != 2 * s.num_audio_latents:
        raise ValidationError(f"video {str(plan.path)!r}: encoded to {latents.shape[1]} latent frames and "
                              f"{rows.shape[0] // 2} audio latents; {s.num_frames} frames need "
                              f"{s.num_latent_frames} and {s.num_audio_latents}")
    config = session.store.component_config(pipeline.variant_for(s.task))
    patch = tuple(config.get("patch_size", (1, 2, 2)))
    layout = pipeline.build_layout(s, empty, encoded.text, encoded.cond, patch)
    return ClipRequest(layout, text=encoded.text.embeds.detach().cpu(), video=patchify(latents, patch)[None],
                       audio=rows[None].contiguous(), seed=seed, weight=weight)
