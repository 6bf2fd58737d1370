"""Conditioning media of one request: FL2VA keyframes and ordered Ref2VA references, their validation and their
normalisation onto the released model's rates and resolutions.

Types (all media in memory, numpy, CPU):
- `Keyframe(image uint8 (H, W, 3), anchor "first" | "last")` — already on the target canvas (`conditioning.py`).
- `ImageRef(image uint8 (H, W, 3))`, `VideoRef(frames uint8 (F, H, W, 3), fps, audio float32 (2|1, N) | None,
  sample_rate, audio_source)`, `AudioRef(audio float32 (2|1, N), sample_rate)`. The seed README's five user kinds
  map onto them:
  image -> ImageRef; silent video -> VideoRef(audio=None); video with its soundtrack / with a replacement file ->
  VideoRef(audio=...); standalone audio -> AudioRef. `source` is a free-form label (a path) for messages;
  `audio_source` labels a replacement soundtrack, so a rule its length breaks names that file, not the video.

Validation (`validate_references`, `validate_conditioning`) raises `ValidationError` with a one-line message. Where the
seed README and Diffusers disagree on a user-facing rule the **seed README rule stands** (DESIGN.md); each difference:
1. Audio length: every audio input must last 2-15 s (measured on the decoded input, before any truncation) and all
   audio inputs together at most 15 s. Diffusers has no minimum, no per-clip check and no total budget (it only
   truncates each clip to the generated duration).
2. Audio count: at most 3 audio inputs, where a video soundtrack or replacement audio counts as an audio input
   (the seed README counts "audio inputs"). Diffusers counts standalone `AudioRef`s only (soundtracks are free).
3. Unchanged from Diffusers (the seed README is silent or agrees): at most 9 images, 3 videos, 12 references;
   standalone audio needs an image or video reference; image ratio within 1:4..4:1.
4. FL2VA anchors and Ref2VA references cannot be mixed in one request (seed README; Diffusers selects ref2va and
   silently ignores the keyframes).

Normalisation (`normalize_references`) follows **Diffusers**, because it decides the tensors the model was trained on:
- Image: resized (PIL LANCZOS) so its short edge is `image_short_edge` (2048 released), upscaling allowed, no area cap,
  each axis rounded (half to even) to a multiple of 32. The seed README calls the reference canvas "down-only"; the
  released pipeline is not, and h3lab follows the released pipeline.
- Video: put on the 24 fps grid by whole-frame drop/duplicate (`media.resample_frame_indices`), truncated to the
  generated frame count, LANCZOS-resized up or down to the canvas of its own ratio (768 short edge, 1,032,192 px cap,
  multiples of 32). It must keep >= 13 frames (two frames sampled at 2 fps for the text encoder).
- Audio: must already be at 32 kHz (`media.read_audio` resamples with ffmpeg while decoding; Diffusers truncates at
  the source rate and resamples with torchaudio, which is not installed — so for non-32 kHz sources h3lab's samples
  differ from Diffusers'); truncated to the generated duration `int(num_frames / 24 * 32000)` samples; mono is
  duplicated to stereo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence, Union

import numpy as np

from ..errors import ValidationError
from .media import FPS, SAMPLE_RATE, resample_frame_indices

MAX_IMAGES, MAX_VIDEOS, MAX_REFERENCES = 9, 3, 12
MAX_AUDIO_INPUTS = 3  # seed README: every audio input, soundtracks included
MIN_AUDIO_SECONDS, MAX_AUDIO_SECONDS, MAX_TOTAL_AUDIO_SECONDS = 2.0, 15.0, 15.0
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
IMAGE_SHORT_EDGE = 2048
CANVAS_SHORT_EDGE, CANVAS_MAX_PIXELS, CANVAS_MULTIPLE = 768, 768 * 1344, 32
TEXT_SAMPLE_FPS, TEMPORAL_PATCH = 2.0, 2  # the text encoder reads a video reference at 2 fps, merged in pairs


# ------------------------------------------------------------------------------------------------ types
def _image(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.dtype != np.uint8 or arr.ndim != 3 or arr.shape[2] != 3 or min(arr.shape[:2]) < 1:
        raise ValidationError(f"{what} of shape {arr.shape} dtype {arr.dtype}: must be uint8 (height, width, 3) RGB")
    return np.ascontiguousarray(arr)


def _frames(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.dtype != np.uint8 or arr.ndim != 4 or arr.shape[3] != 3 or min(arr.shape[:3]) < 1:
        raise ValidationError(
            f"{what} of shape {arr.shape} dtype {arr.dtype}: must be uint8 (frames, height, width, 3) RGB"
        )
    return np.ascontiguousarray(arr)


def _waveform(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    if arr.ndim != 2 or arr.shape[0] not in (1, 2) or arr.shape[1] < 1 or not np.issubdtype(arr.dtype, np.floating):
        raise ValidationError(f"{what} of shape {arr.shape} dtype {arr.dtype}: must be float (1|2, samples) audio")
    if not np.isfinite(arr).all():
        raise ValidationError(f"{what} contains NaN or infinity: samples must be finite")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _rate(value: Any, what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValidationError(f"{what}={value!r}: must be a positive finite number")
    return value


@dataclass(frozen=True, eq=False)
class Keyframe:
    """One FL2VA anchor already on the target canvas."""

    image: np.ndarray  # uint8 (H, W, 3)
    anchor: str  # "first" | "last"

    def __post_init__(self) -> None:
        object.__setattr__(self, "image", _image(self.image, f"{self.anchor} keyframe"))
        if self.anchor not in ("first", "last"):
            raise ValidationError(f"keyframe anchor {self.anchor!r}: must be 'first' or 'last'")


@dataclass(frozen=True, eq=False)
class ImageRef:
    image: np.ndarray  # uint8 (H, W, 3)
    source: str = ""
    kind = "image"
    has_audio = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "image", _image(self.image, f"image reference {self.source!r}"))


@dataclass(frozen=True, eq=False)
class VideoRef:
    frames: np.ndarray  # uint8 (F, H, W, 3)
    fps: float = float(FPS)
    audio: np.ndarray | None = None  # float32 (1|2, N) soundtrack or replacement audio
    sample_rate: int = SAMPLE_RATE
    source: str = ""
    audio_source: str = ""  # the replacement soundtrack's file (video-audio references), for messages
    kind = "video"

    def __post_init__(self) -> None:
        object.__setattr__(self, "frames", _frames(self.frames, f"video reference {self.source!r}"))
        _rate(self.fps, f"video reference {self.source!r} fps")
        if self.audio is not None:
            object.__setattr__(self, "audio", _waveform(self.audio, f"audio of video reference {self.source!r}"))
            _rate(self.sample_rate, f"video reference {self.source!r} sample_rate")

    @property
    def has_audio(self) -> bool:
        return self.audio is not None


@dataclass(frozen=True, eq=False)
class AudioRef:
    audio: np.ndarray  # float32 (1|2, N)
    sample_rate: int = SAMPLE_RATE
    source: str = ""
    kind = "audio"
    has_audio = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "audio", _waveform(self.audio, f"audio reference {self.source!r}"))
        _rate(self.sample_rate, f"audio reference {self.source!r} sample_rate")


Reference = Union[ImageRef, VideoRef, AudioRef]


def _label(index: int, ref: Reference) -> str:
    src = f" ({ref.source})" if ref.source else ""
    return f"reference {index + 1} [{ref.kind}{src}]"


# ------------------------------------------------------------------------------------------------ validation
def validate_conditioning(anchors: Sequence[Keyframe], references: Sequence[Reference]) -> None:
    """Anchors (FL2VA) and references (Ref2VA) select different checkpoints and cannot be mixed."""
    if anchors and references:
        raise ValidationError(
            f"{len(anchors)} first/last anchor(s) and {len(references)} reference(s): FL2VA anchors and Ref2VA "
            "references cannot be mixed; clear one of them"
        )
    roles = [k.anchor for k in anchors]
    if len(anchors) > 2 or len(set(roles)) != len(roles):
        raise ValidationError(f"anchors {roles}: at most one 'first' and one 'last'")
    if roles == ["last", "first"]:
        raise ValidationError("anchors ['last', 'first']: the first-frame anchor must come before the last")


def validate_references(references: Sequence[Reference]) -> None:
    """The Ref2VA request rules (seed README where it differs from Diffusers; see the module docstring)."""
    if not references:
        raise ValidationError("no references: Ref2VA needs at least one image, video or audio reference")
    for i, ref in enumerate(references):
        if not isinstance(ref, (ImageRef, VideoRef, AudioRef)):
            raise ValidationError(
                f"reference {i + 1} of type {type(ref).__name__}: must be ImageRef, VideoRef or AudioRef"
            )
    kinds = [ref.kind for ref in references]
    for kind, limit in (("image", MAX_IMAGES), ("video", MAX_VIDEOS)):
        if kinds.count(kind) > limit:
            raise ValidationError(f"{kinds.count(kind)} {kind} references: at most {limit} are accepted")
    if len(references) > MAX_REFERENCES:
        raise ValidationError(f"{len(references)} references: at most {MAX_REFERENCES} are accepted in total")
    if "audio" in kinds and not ({"image", "video"} & set(kinds)):
        raise ValidationError(
            "standalone audio reference without an image or video reference: audio must accompany one"
        )
    audio_inputs = [(i, ref) for i, ref in enumerate(references) if ref.has_audio]
    if len(audio_inputs) > MAX_AUDIO_INPUTS:
        raise ValidationError(
            f"{len(audio_inputs)} audio inputs (standalone audio, soundtracks and replacement audio): at most "
            f"{MAX_AUDIO_INPUTS} are accepted"
        )
    total = 0.0
    for i, ref in audio_inputs:
        seconds = ref.audio.shape[1] / ref.sample_rate
        if not MIN_AUDIO_SECONDS <= seconds <= MAX_AUDIO_SECONDS:
            sound = f"replacement audio {ref.audio_source!r}" if getattr(ref, "audio_source", "") else "audio"
            raise ValidationError(
                f"{_label(i, ref)} {sound} lasts {seconds:.3f} s: each audio input must last "
                f"{MIN_AUDIO_SECONDS:g}-{MAX_AUDIO_SECONDS:g} s"
            )
        total += seconds
    if total > MAX_TOTAL_AUDIO_SECONDS:
        raise ValidationError(
            f"audio inputs last {total:.3f} s in total: at most {MAX_TOTAL_AUDIO_SECONDS:g} s are accepted"
        )


# ------------------------------------------------------------------------------------------------ normalisation
def canvas_for_ratio(
    width: float,
    height: float,
    short_edge: int = CANVAS_SHORT_EDGE,
    max_pixels: int = CANVAS_MAX_PIXELS,
    multiple: int = CANVAS_MULTIPLE,
) -> tuple[int, int]:
    """(height, width) of the released canvas rule for the ratio width:height (facts section 3), ValidationError if
    the ratio is outside 1:4..4:1. Delegates the arithmetic to Diffusers' `resolve_canvas_size`."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    if not (width > 0 and height > 0) or not MIN_ASPECT <= width / height <= MAX_ASPECT:
        raise ValidationError(f"aspect ratio {width}:{height}: must be within 1:4 and 4:1")
    return resolve_canvas_size(width, height, multiple, short_edge, max_pixels)


def _lanczos(image: np.ndarray, width: int, height: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize((width, height), Image.Resampling.LANCZOS))


def normalize_image(
    image: np.ndarray, short_edge: int = IMAGE_SHORT_EDGE, multiple: int = CANVAS_MULTIPLE, what: str = "image"
) -> np.ndarray:
    """Released image-reference geometry: short edge -> `short_edge` (up or down), axes rounded to `multiple`."""
    h, w = image.shape[:2]
    if w > 4 * h or h > 4 * w:
        raise ValidationError(f"{what} is {w}x{h}: its aspect ratio must be within 1:4 and 4:1")
    scale = short_edge / min(w, h)
    th = max(multiple, round(h * scale / multiple) * multiple)  # Python round: half to even, as released
    tw = max(multiple, round(w * scale / multiple) * multiple)
    return image if (th, tw) == (h, w) else _lanczos(image, tw, th)


def normalize_video(
    frames: np.ndarray,
    fps: float,
    num_frames: int,
    short_edge: int = CANVAS_SHORT_EDGE,
    max_pixels: int = CANVAS_MAX_PIXELS,
    multiple: int = CANVAS_MULTIPLE,
    what: str = "video",
) -> np.ndarray:
    """Released video-reference normalisation: 24 fps grid, truncate to `num_frames`, canvas of its own ratio."""
    frames = frames[resample_frame_indices(frames.shape[0], float(fps), float(FPS))][:num_frames]
    min_frames = round((TEMPORAL_PATCH - 1) * FPS / TEXT_SAMPLE_FPS) + 1
    if frames.shape[0] < min_frames:
        raise ValidationError(
            f"{what} has {frames.shape[0]} frames at {FPS} fps: at least {min_frames} ({min_frames / FPS:.2f} s) are "
            f"needed (the text encoder samples 2 frames at {TEXT_SAMPLE_FPS:g} fps)"
        )
    height, width = canvas_for_ratio(frames.shape[2], frames.shape[1], short_edge, max_pixels, multiple)
    if frames.shape[1:3] == (height, width):
        return frames
    return np.stack([_lanczos(f, width, height) for f in frames])


def normalize_audio(audio: np.ndarray, sample_rate: int, num_frames: int, what: str = "audio") -> np.ndarray:
    """Released soundtrack normalisation at 32 kHz: truncate to the generated duration, mono -> stereo."""
    if sample_rate != SAMPLE_RATE:
        raise ValidationError(
            f"{what} sample rate {sample_rate} Hz: must be {SAMPLE_RATE} Hz (decode it with media.read_audio, which "
            "resamples)"
        )
    audio = audio[:, : int(num_frames / FPS * sample_rate)]
    if audio.shape[0] == 1:
        audio = np.repeat(audio, 2, axis=0)
    return np.ascontiguousarray(audio, dtype=np.float32)


def normalize_references(
    references: Sequence[Reference],
    num_frames: int,
    image_short_edge: int = IMAGE_SHORT_EDGE,
    canvas_short_edge: int = CANVAS_SHORT_EDGE,
    canvas_max_pixels: int = CANVAS_MAX_PIXELS,
    multiple: int = CANVAS_MULTIPLE,
) -> list[Reference]:
    """Validate (`validate_references`) and return new references on the released rates and resolutions, in order.
    `num_frames` is the generated (17n+5-aligned) frame count."""
    validate_references(references)
    if not isinstance(num_frames, int) or num_frames < 1:
        raise ValidationError(f"num_frames={num_frames!r}: must be a positive integer")
    out: list[Reference] = []
    for i, ref in enumerate(references):
        what = _label(i, ref)
        audio = None
        if ref.has_audio:
            audio = normalize_audio(ref.audio, ref.sample_rate, num_frames, what)
        if isinstance(ref, ImageRef):
            out.append(replace(ref, image=normalize_image(ref.image, image_short_edge, multiple, what)))
        elif isinstance(ref, VideoRef):
            frames = normalize_video(
                ref.frames, ref.fps, num_frames, canvas_short_edge, canvas_max_pixels, multiple, what
            )
            out.append(replace(ref, frames=frames, fps=float(FPS), audio=audio, sample_rate=SAMPLE_RATE))
        else:
            out.append(replace(ref, audio=audio, sample_rate=SAMPLE_RATE))
    return out
