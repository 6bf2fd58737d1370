"""Generation settings and every geometry / duration / conditioning-structure rule a request must satisfy.

`GenerationSettings` is frozen: a front end changes a setting with `settings.replace(**changes)`, which builds and
validates a new object, so a rejected change leaves the old settings in place (session state is never half-updated).
Every rule raises `ValidationError` (an `H3Error`) with one line naming the value and the rule.

Rules (the seed README's user-facing contract; where it and the released Diffusers pipeline disagree, the seed wins
and the difference is written here):

- width / height: multiples of 32 (VAE x16 times patch x2), at least 32, width*height <= 768*1344, aspect ratio
  between 1:4 and 4:1. The released pipeline *resolves* a canvas from a ratio; h3lab takes the size as given.
- render_width / render_height: set together, multiples of 32, at least 32, the same aspect ratio as the output
  (rw*h == rh*w exactly), and not larger than it. The model and both VAEs run on the render canvas; decoded frames
  are upscaled to the output size.
- frames: snapped *up* to the next 17n+5 with n >= 1 (22, 39, 56, ... ; the video VAE encodes 17-frame clips into 5
  latents and drops 3 once) and the snap is reported. seconds: converted at 24 fps, rounded up to a whole frame,
  then snapped the same way. frames and seconds are mutually exclusive. At most 362 frames (15.08 s), the seed's
  limit; the released pipeline rejects 362 and requires >= 5 s. A length you choose below 5 s gets a notice, not
  an error; the default length (22 frames) gets none.
- steps: N denoising passes (1..1000), i.e. N + 1 sigma grid points including the terminal 0 (Diffusers'
  `num_inference_steps` counts grid points, so its 50 is 49 passes).
- reuse: whole-velocity reuse interval (1 = every pass evaluates the model), at most `steps`.
- anchors (`first`, `last`) select fl2va; references select ref2va on `transformer_ref/`; the two cannot be mixed.
  References keep request order. At most 9 images, 3 videos, 3 audio inputs (the seed counts every audio-bearing
  reference -- a video's soundtrack too -- where Diffusers counts only standalone audio), 12 in total; standalone
  audio needs an image or video reference. The per-clip 2-15 s and 15 s total audio limits need the decoded media:
  `h3lab.components.references.validate_references` checks them, and the session runs it (through
  `Session.check_request`) before encoding anything.

Latent geometry (facts brief section 3): latent frames = (F - 5) / 17 * 5 + 2, latent H, W = H / 16, W / 16 of the
render canvas, audio latents per channel = round(F / 24 * 40).
"""

from __future__ import annotations

import dataclasses
import math
import os
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import ValidationError
from ..presets.rules import check_settings as check_preset_settings
from ..execution.runtime import MODES

FPS = 24
CANVAS_MULTIPLE = 32  # VAE spatial ratio 16 x transformer patch width 2
VAE_SPATIAL_RATIO = 16
MAX_AREA = 768 * 1344  # 1,032,192 pixels, the released 768p budget
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5  # video VAE clip_length, tokens kept per clip
MIN_FRAMES = FRAMES_PER_CHUNK + LATENTS_PER_CHUNK  # 22: n >= 1
MAX_FRAMES = 362  # 17*21+5 = 15.083 s, the seed's longest shape
RELEASED_MIN_SECONDS = 5.0
AUDIO_LATENTS_PER_SECOND = 40
AUDIO_SAMPLE_RATE = 32000
MAX_STEPS = 1000
MAX_SEED = 2**63 - 1

# Reference limits (seed README; Diffusers' Ref2VA setup step for images / videos / total).
MAX_IMAGES, MAX_VIDEOS, MAX_AUDIO_INPUTS, MAX_REFERENCES = 9, 3, 3, 12

# Reference kinds, by the CLI flag / REPL command that adds them.
REFERENCE_KINDS = {
    "image": "ref-image",  # an image: <Picture i>, video rows
    "video": "ref-video",  # a video with its embedded soundtrack: <Video k> + <Audio j>
    "silent-video": "ref-silent-video",  # a video, soundtrack ignored
    "video-audio": "ref-video-audio",  # a video with a replacement audio file
    "audio": "ref-audio",  # standalone audio: <Audio j>
}

DEFAULT_WIDTH = DEFAULT_HEIGHT = 512  # the seed's validated development canvas
DEFAULT_FRAMES = 22  # the seed's fast preset (0.917 s)
DEFAULT_STEPS = 20
DEFAULT_SEED = 42
DEFAULT_MODE = "auto"  # strict where a kernel serves the call, the torch op otherwise (recorded in the trace)


# ------------------------------------------------------------------------------------------------- paths
def check_path(path: Any, what: str = "path") -> str:
    """A user-supplied input file: it must exist, be a regular file and be readable. Returns it as a string."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValidationError(f"{what}={path!r}: must be a file path")
    p = Path(path).expanduser()
    if not p.exists():
        raise ValidationError(f"{what}={str(path)!r}: no such file")
    if not p.is_file():
        raise ValidationError(f"{what}={str(path)!r}: not a regular file")
    if not os.access(p, os.R_OK):
        raise ValidationError(f"{what}={str(path)!r}: not readable")
    return str(p)


def is_blank(text: str) -> bool:
    """No visible character: only whitespace (NBSP included) and invisible format characters (Unicode category Cf:
    zero-width space, zero-width (non-)joiner, word joiner, BOM) -- one rule for both kinds of invisible text."""
    return all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in text)


def check_prompt(prompt: Any) -> str:
    """A prompt to generate from: UTF-8 text with a visible character in it (`is_blank`)."""
    if not isinstance(prompt, str):
        raise ValidationError(f"prompt={prompt!r}: must be a string")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(prompt[err.start])
        what = (f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF  # an undecodable byte (surrogateescape)
                else f"lone surrogate U+{code:04X}")
        raise ValidationError(f"prompt: {what} at character {err.start + 1} is not UTF-8 text; give the prompt as "
                              "UTF-8") from None
    if is_blank(prompt):
        raise ValidationError(f"prompt={prompt!r}: empty prompt (blank, only whitespace or invisible characters), "
                              "describe the clip to generate")
    return prompt


# --------------------------------------------------------------------------------------------- geometry
def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValidationError(f"{name}={value!r}: must be an integer")
    return value


def check_size(width: Any, height: Any, prefix: str = "") -> tuple[int, int]:
    """Output canvas rules: multiples of 32, >= 32, area <= 768*1344, aspect 1:4..4:1."""
    w, h = _int(width, f"{prefix}width"), _int(height, f"{prefix}height")
    for name, v in ((f"{prefix}width", w), (f"{prefix}height", h)):
        if v < CANVAS_MULTIPLE:
            raise ValidationError(f"{name}={v}: must be at least {CANVAS_MULTIPLE}")
        if v % CANVAS_MULTIPLE:
            raise ValidationError(f"{name}={v}: must be a multiple of {CANVAS_MULTIPLE}")
    if w * h > MAX_AREA:
        raise ValidationError(f"size {w}x{h}: area {w * h} exceeds 768*1344 = {MAX_AREA} pixels")
    if not MIN_ASPECT <= w / h <= MAX_ASPECT:
        raise ValidationError(f"size {w}x{h}: aspect ratio {w / h:.4g} is outside 1:4..4:1")
    return w, h


def check_render_size(render_width: Any, render_height: Any, width: int, height: int) -> tuple[int, int] | None:
    """Internal canvas rules: both or neither, multiples of 32, same aspect as the output, not larger than it."""
    if render_width is None and render_height is None:
        return None
    if render_width is None or render_height is None:
        given = "render_width" if render_height is None else "render_height"
        missing = "render_height" if render_height is None else "render_width"
        value = render_width if render_height is None else render_height
        raise ValidationError(f"{given}={value!r} without {missing}: set both or neither")
    rw, rh = _int(render_width, "render_width"), _int(render_height, "render_height")
    for name, v in (("render_width", rw), ("render_height", rh)):
        if v < CANVAS_MULTIPLE:
            raise ValidationError(f"{name}={v}: must be at least {CANVAS_MULTIPLE}")
        if v % CANVAS_MULTIPLE:
            raise ValidationError(f"{name}={v}: must be a multiple of {CANVAS_MULTIPLE}")
    if rw * height != rh * width:
        raise ValidationError(f"render size {rw}x{rh}: aspect ratio differs from the output size {width}x{height}")
    if rw > width or rh > height:
        raise ValidationError(f"render size {rw}x{rh}: larger than the output size {width}x{height}")
    return rw, rh


def snap_frames(frames: int) -> int:
    """The smallest legal frame count 17n + 5 (n >= 1) that is >= `frames`."""
    if frames <= MIN_FRAMES:
        return MIN_FRAMES
    n = math.ceil((frames - LATENTS_PER_CHUNK) / FRAMES_PER_CHUNK)
    return FRAMES_PER_CHUNK * n + LATENTS_PER_CHUNK


def seconds_to_frames(seconds: float) -> int:
    """Whole frames at 24 fps covering `seconds` (rounded up; 1e-9 absorbs float noise such as 0.9166.. * 24)."""
    return max(1, math.ceil(seconds * FPS - 1e-9))


def resolve_frames(frames: Any, seconds: Any) -> tuple[int, list[str]]:
    """(legal frame count, notices). frames and seconds are mutually exclusive; neither means the default."""
    notices: list[str] = []
    if frames is not None and seconds is not None:
        raise ValidationError(f"frames={frames!r} and seconds={seconds!r}: give one or the other, not both")
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
            raise ValidationError(f"seconds={seconds!r}: must be a finite number")
        if seconds <= 0:
            raise ValidationError(f"seconds={seconds!r}: must be positive")
        requested = seconds_to_frames(float(seconds))
        snapped = snap_frames(requested)
        if snapped > MAX_FRAMES:
            raise ValidationError(
                f"seconds={seconds:g}: {requested} frames at {FPS} fps round up to {snapped}, above the "
                f"{MAX_FRAMES}-frame ({MAX_FRAMES / FPS:.3f} s) maximum"
            )
        notices.append(f"seconds={seconds:g} -> {snapped} frames ({snapped / FPS:.3f} s at {FPS} fps, 17n+5)")
    else:
        requested = DEFAULT_FRAMES if frames is None else _int(frames, "frames")
        if requested < 1:
            raise ValidationError(f"frames={requested}: must be at least 1")
        snapped = snap_frames(requested)
        if snapped > MAX_FRAMES:
            raise ValidationError(
                f"frames={requested}: snaps up to {snapped}, above the {MAX_FRAMES}-frame "
                f"({MAX_FRAMES / FPS:.3f} s) maximum"
            )
        if snapped != requested:
            notices.append(f"frames={requested} snapped up to {snapped} (frame counts are 17n+5, n >= 1)")
    if (frames is not None or seconds is not None) and snapped / FPS < RELEASED_MIN_SECONDS:
        # only for a length the user chose: the default (22 frames, a quick look) is documented, not news each time
        notices.append(
            f"notice: {snapped} frames = {snapped / FPS:.3f} s is below the released {RELEASED_MIN_SECONDS:g} s "
            "minimum; generating anyway"
        )
    return snapped, notices


def latent_frames(frames: int) -> int:
    """Video latent frames of a legal frame count: (F - 5) / 17 * 5 + 2."""
    if frames % FRAMES_PER_CHUNK != LATENTS_PER_CHUNK:
        raise ValidationError(f"frames={frames}: not of the form 17n+5")
    return (frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def audio_latents(frames: int) -> int:
    """Audio latents per channel for F video frames: round(F / 24 * 40) (Diffusers' expression, 40 latents/s)."""
    return int(round(frames / FPS * AUDIO_LATENTS_PER_SECOND))


# ------------------------------------------------------------------------------------------- references
@dataclass(frozen=True)
class Reference:
    """One ordered Ref2VA reference. `audio` is the replacement soundtrack of a "video-audio" reference."""

    kind: str
    path: str
    audio: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in REFERENCE_KINDS:
            raise ValidationError(f"reference kind {self.kind!r}: must be one of {', '.join(REFERENCE_KINDS)}")
        if (self.kind == "video-audio") != (self.audio is not None):
            raise ValidationError(
                f"reference {self.kind} {self.path!r}: a replacement audio file goes with video-audio references only"
            )

    @property
    def is_visual(self) -> bool:
        return self.kind != "audio"

    @property
    def has_audio(self) -> bool:
        """Carries audio into the model (a soundtrack, a replacement track or a standalone clip)."""
        return self.kind in ("video", "video-audio", "audio")

    @property
    def media_kind(self) -> str:
        """The Diffusers reference kind: image, video or audio."""
        return {"image": "image", "audio": "audio"}.get(self.kind, "video")

    @property
    def audio_path(self) -> str | None:
        """The file the audio of this reference is read from."""
        if self.kind == "video-audio":
            return self.audio
        return self.path if self.kind in ("video", "audio") else None

    def checked(self) -> "Reference":
        """The same reference with its files validated (exists, regular, readable)."""
        flag = "--" + REFERENCE_KINDS[self.kind]
        path = check_path(self.path, flag)
        audio = check_path(self.audio, f"{flag} audio") if self.audio is not None else None
        return Reference(self.kind, path, audio)

    def describe(self) -> str:
        return f"{self.kind} {self.path}" + (f" + {self.audio}" if self.audio else "")


def check_references(references: Iterable[Reference]) -> tuple[Reference, ...]:
    """Structural Ref2VA rules (counts, standalone-audio pairing), checked before any file is read. The same rules
    and the audio durations are checked again on the decoded media by `components.references`."""
    refs = tuple(references)
    for r in refs:
        if not isinstance(r, Reference):
            raise ValidationError(f"reference {r!r}: must be an h3lab.schema.generation_settings.Reference")
    images = sum(r.kind == "image" for r in refs)
    videos = sum(r.kind in ("video", "silent-video", "video-audio") for r in refs)
    audio_inputs = sum(r.has_audio for r in refs)
    if len(refs) > MAX_REFERENCES:
        raise ValidationError(f"{len(refs)} references: at most {MAX_REFERENCES} are accepted")
    if images > MAX_IMAGES:
        raise ValidationError(f"{images} image references: at most {MAX_IMAGES} are accepted")
    if videos > MAX_VIDEOS:
        raise ValidationError(f"{videos} video references: at most {MAX_VIDEOS} are accepted")
    if audio_inputs > MAX_AUDIO_INPUTS:
        raise ValidationError(
            f"{audio_inputs} audio inputs: at most {MAX_AUDIO_INPUTS} are accepted (soundtracks count)"
        )
    if any(r.kind == "audio" for r in refs) and not any(r.is_visual for r in refs):
        raise ValidationError("standalone audio reference: must be combined with an image or video reference")
    return refs


# ------------------------------------------------------------------------------------------------ settings
def _is_extra(name: str) -> bool:
    from . import SETTINGS

    declared = SETTINGS.get(name)
    return declared is not None and declared.target == "generation"


def _check_extras(settings: "GenerationSettings", notices: list[str]) -> tuple[tuple[str, Any], ...]:
    """The schema-declared settings' values, each checked by its declaration (`Setting.check_extra`); a value equal
    to its default is dropped, so settings that differ only by a default compare (and hash) equal."""
    from . import SETTINGS

    out = []
    for name, value in dict(settings.extras).items():
        declared = SETTINGS.get(name)
        if declared is None or declared.target != "generation":
            raise ValidationError(f"unknown setting(s) {name}")
        value, more = declared.check_extra(value, settings)
        notices += more
        if value != declared.default:
            out.append((name, value))
    return tuple(sorted(out))


@dataclass(frozen=True)
class GenerationSettings:
    """One generation request. Construction validates every rule; derived geometry is exposed as properties."""

    prompt: str = ""
    seed: int = DEFAULT_SEED
    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    render_width: int | None = None
    render_height: int | None = None
    frames: int | None = None  # requested frame count (snapped), exclusive with seconds
    seconds: float | None = None  # requested duration, exclusive with frames
    steps: int = DEFAULT_STEPS  # denoising passes; the sigma grid has steps + 1 points
    mode: str = DEFAULT_MODE
    first: str | None = None  # fl2va first-frame anchor (stretched onto the canvas)
    last: str | None = None  # fl2va last-frame anchor (cover-cropped when a first anchor is set)
    references: tuple[Reference, ...] = ()
    reuse: int = 1
    ablations: tuple[str, ...] = ()  # ablation factors switched on, sorted
    # Speed presets (h3lab.presets; rules in h3lab/presets/rules.py): blocks to run (None: all), core-reuse interval,
    # token reduction, and the released RoPE coordinates at 256x256 (instead of the automatic halving).
    layers: int | None = None
    core_reuse: int = 1
    token_reduction: bool = False
    reference_rope: bool = False
    # Settings declared only in the schema (h3lab.schema): sorted (name, value) pairs of the ones set to a value other
    # than their default; read them as attributes (`settings.noise_level`), set them with `replace(noise_level=...)`.
    extras: tuple[tuple[str, Any], ...] = ()
    # Resolved in __post_init__.
    num_frames: int = field(init=False, default=0)
    notices: tuple[str, ...] = field(init=False, default=(), compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str):
            raise ValidationError(f"prompt={self.prompt!r}: must be a string")
        seed = _int(self.seed, "seed")
        if not 0 <= seed <= MAX_SEED:
            raise ValidationError(f"seed={seed}: must be between 0 and 2**63-1")
        width, height = check_size(self.width, self.height)
        render = check_render_size(self.render_width, self.render_height, width, height)
        num_frames, notices = resolve_frames(self.frames, self.seconds)
        steps = _int(self.steps, "steps")
        if not 1 <= steps <= MAX_STEPS:
            raise ValidationError(f"steps={steps}: must be between 1 and {MAX_STEPS} denoising passes")
        reuse = _int(self.reuse, "reuse")
        if not 1 <= reuse <= steps:
            raise ValidationError(f"reuse={reuse}: must be between 1 and steps={steps}")
        if self.mode not in MODES:
            raise ValidationError(f"mode={self.mode!r}: must be one of {', '.join(MODES)}")
        refs = check_references(self.references)
        if refs and (self.first is not None or self.last is not None):
            raise ValidationError("first/last-frame anchors and references: cannot be mixed (fl2va or ref2va)")
        for name in ("first", "last"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ValidationError(f"{name}={value!r}: must be an image path")
        ablations = tuple(sorted(set(self.ablations)))
        object.__setattr__(self, "reuse", reuse)
        notices += check_preset_settings(self)
        for name, value in (
            ("seed", seed), ("width", width), ("height", height), ("steps", steps), ("reuse", reuse),
            ("references", refs), ("ablations", ablations), ("num_frames", num_frames), ("notices", tuple(notices)),
        ):
            object.__setattr__(self, name, value)
        if render is not None:
            object.__setattr__(self, "render_width", render[0])
            object.__setattr__(self, "render_height", render[1])
        for name in ("first", "last"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))
        if self.extras:  # last: a declared rule sees the normalised settings
            more: list[str] = []
            object.__setattr__(self, "extras", _check_extras(self, more))
            object.__setattr__(self, "notices", self.notices + tuple(more))

    def __getattr__(self, name: str) -> Any:
        """A setting declared only in the schema: its value here, or its declared default."""
        if name.startswith("_") or name == "extras":
            raise AttributeError(name)
        from . import SETTINGS

        declared = SETTINGS.get(name)
        if declared is None or declared.target != "generation":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return dict(self.extras).get(name, declared.default)

    # ------------------------------------------------------------------------------------------ changes
    def with_notices(self, *lines: str) -> "GenerationSettings":
        """The same settings carrying `lines` (empty ones dropped) after their own notices."""
        lines = tuple(line for line in lines if line)
        if not lines:
            return self
        out = dataclasses.replace(self)
        object.__setattr__(out, "notices", out.notices + lines)
        return out

    def replace(self, **changes: Any) -> "GenerationSettings":
        """A validated copy with `changes`; setting frames clears seconds and vice versa. A setting declared only in
        the schema is one of the changes too (it goes into `extras`)."""
        own = {f.name for f in dataclasses.fields(self) if f.init}
        extra = {name: changes.pop(name) for name in list(changes) if name not in own and _is_extra(name)}
        unknown = sorted(set(changes) - own)
        if unknown:
            raise ValidationError(f"unknown setting(s) {', '.join(unknown)}")
        if extra:
            changes["extras"] = tuple(sorted({**dict(changes.get("extras", self.extras)), **extra}.items()))
        if "frames" in changes and changes["frames"] is not None and "seconds" not in changes:
            changes["seconds"] = None
        if "seconds" in changes and changes["seconds"] is not None and "frames" not in changes:
            changes["frames"] = None
        if "width" in changes or "height" in changes:
            # A new output size drops an internal canvas that no longer fits, unless one is given with it.
            if "render_width" not in changes and "render_height" not in changes and self.render_width is not None:
                changes["render_width"] = changes["render_height"] = None
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        return GenerationSettings(**{**current, **changes})

    def checked_paths(self) -> "GenerationSettings":
        """The same settings with every input file validated (exists, regular file, readable)."""
        first = check_path(self.first, "--first-frame") if self.first is not None else None
        last = check_path(self.last, "--last-frame") if self.last is not None else None
        refs = tuple(r.checked() for r in self.references)
        return self.replace(first=first, last=last, references=refs)

    # ------------------------------------------------------------------------------------------ derived
    @property
    def task(self) -> str:
        if self.references:
            return "ref2va"
        if self.first is not None or self.last is not None:
            return "fl2va"
        return "t2va"

    @property
    def anchors(self) -> tuple[tuple[str, str], ...]:
        """(which, path) in packed order: first then last."""
        return tuple((name, getattr(self, name)) for name in ("first", "last") if getattr(self, name) is not None)

    @property
    def canvas(self) -> tuple[int, int]:
        """(width, height) the model and both VAEs run on: the render size when set, else the output size."""
        if self.render_width is not None:
            return self.render_width, self.render_height
        return self.width, self.height

    @property
    def num_latent_frames(self) -> int:
        return latent_frames(self.num_frames)

    @property
    def latent_height(self) -> int:
        return self.canvas[1] // VAE_SPATIAL_RATIO

    @property
    def latent_width(self) -> int:
        return self.canvas[0] // VAE_SPATIAL_RATIO

    @property
    def num_audio_latents(self) -> int:
        return audio_latents(self.num_frames)

    @property
    def num_points(self) -> int:
        """Sigma grid points including the terminal 0 (= Diffusers' num_inference_steps)."""
        return self.steps + 1

    @property
    def preset_notices(self) -> list[str]:
        """The speed presets' notices for these settings (the seed's warnings: `presets.rules.check_settings`)."""
        return check_preset_settings(self)

    @property
    def duration(self) -> float:
        return self.num_frames / FPS

    def summary(self) -> str:
        size = f"{self.width}x{self.height}"
        if self.render_width is not None:
            size += f" (render {self.render_width}x{self.render_height})"
        return (
            f"{self.task} seed {self.seed}, {size}, {self.num_frames} frames ({self.duration:.3f} s), "
            f"{self.steps} steps, mode {self.mode}" + "".join(f", {part}" for part in self.declared_parts())
        )

    def declared_parts(self) -> list[str]:
        """The summary parts of the schema-declared settings that differ from their defaults ("stepper cps",
        "level 0.5", ...), in declaration order."""
        from . import SETTINGS

        parts = [s.summary(getattr(self, s.name)) for s in SETTINGS.of("generation") if s.summary is not None]
        return [part for part in parts if part]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("notices", "extras")}
        out.update(self.extras)
        out["references"] = [dataclasses.asdict(r) for r in self.references]
        out["ablations"] = list(self.ablations)
        out["task"] = self.task
        return out
