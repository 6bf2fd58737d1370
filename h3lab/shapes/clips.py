"""Procedural clips: one coloured shape moving in a direction over a plain background, with a stereo tone.

Contract
- A clip is named by a `ClipSpec` (colour, shape, direction, seed, canvas width/height, frames). Everything is drawn
  from `numpy.random.default_rng([seed, colour, shape, direction])` indices, so the same spec gives the same bytes on
  every machine (no downloads, no global RNG).
- Video: uint8 (F, H, W, 3). The background is the plain `BACKGROUND` colour; the shape (`SHAPES`: circle, square,
  triangle, radius ~0.16 of the short edge) is filled with its `COLOURS` entry, edges anti-aliased by 4x4
  supersampling. Its centre moves linearly over the clip by ~0.45 of the canvas in `DIRECTIONS` (left, right, up,
  down; image y grows downward, so "up" decreases y), starting near the centre (seeded jitter of a few pixels).
- Audio: float32 (2, S) at `SAMPLE_RATE` 32 kHz, S = round(F / 24 * 40) * 800 (the audio VAE's latents per channel
  times its hop, so the waveform is exactly what the pipeline decodes for F frames). A sine whose pitch follows the
  shape (`TONES`: circle high 880 Hz, square middle 440 Hz, triangle low 220 Hz) at amplitude `AMPLITUDE`, seeded
  phase, 5 ms fades; equal-power pan that follows the shape's horizontal position x (pan = x / W clipped to [0, 1]:
  left gain cos(pan pi/2), right gain sin(pan pi/2)), interpolated per sample along the same path as the video.
- `prompt(spec)` says it: "a red circle moves left, a high tone"; `read_prompt(text)` reads such a prompt back to its
  (colour, shape, direction) (surrounding blanks, a final "." and letter case aside, the words must be the template's
  and the tone the shape's; anything else is a one-line `ValidationError` naming the prompt).
  `partial_prompt(spec, keep)` says only the attributes in `keep` (a subset of `ATTRIBUTES`), the rest left generic
  ("a circle moves", "a red shape moves left");
  the shape carries its tone. Training on partial prompts (scripts/train_shapes.py `--partial-variants`) lets each
  word be learned on its own, so a held-out mix of words is a mix of what each word means.
- `first_last(spec)` are the clip's first and last frames (FL2VA anchors); `reference_image(colour, shape)` is a still
  of the shape centred on the canvas (Ref2VA reference), from the same renderer.
- Split: `training_combos()` / `held_out_combos()` partition the 5 x 3 x 4 = 60 (colour, shape, direction) triples;
  the 12 held-out triples (one colour per shape-direction pair) never appear in training prompts, while every
  colour, shape and direction value does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from ..errors import ValidationError

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 80, 235),
    "yellow": (235, 215, 40),
    "white": (235, 235, 235),
}
SHAPES = ("circle", "square", "triangle")
TONES = {"circle": ("high", 880.0), "square": ("middle", 440.0), "triangle": ("low", 220.0)}
DIRECTIONS = {"left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0)}
BACKGROUND = (24, 24, 24)
FPS = 24
SAMPLE_RATE = 32000
HOP = 800  # audio VAE samples per latent (40 latents/s at 32 kHz)
AUDIO_LATENTS_PER_SECOND = 40
AMPLITUDE = 0.4
SUPERSAMPLE = 4


@dataclass(frozen=True)
class ClipSpec:
    """One procedural clip (module docstring)."""

    colour: str
    shape: str
    direction: str
    seed: int = 0
    width: int = 64
    height: int = 64
    frames: int = 22

    def __post_init__(self) -> None:
        for name, value, allowed in (("colour", self.colour, COLOURS), ("shape", self.shape, SHAPES),
                                     ("direction", self.direction, DIRECTIONS)):
            if value not in allowed:
                raise ValidationError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
        for name in ("seed", "width", "height", "frames"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValidationError(f"ClipSpec.{name}={value!r}: must be an integer >= {0 if name == 'seed' else 1}")
        if min(self.width, self.height) < 16:
            raise ValidationError(f"canvas {self.width}x{self.height}: both edges must be >= 16 pixels")

    @property
    def tone(self) -> str:
        return TONES[self.shape][0]

    @property
    def frequency(self) -> float:
        return TONES[self.shape][1]

    @property
    def num_samples(self) -> int:
        return round(self.frames / FPS * AUDIO_LATENTS_PER_SECOND) * HOP

    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, list(COLOURS).index(self.colour), SHAPES.index(self.shape),
                                      list(DIRECTIONS).index(self.direction)])

    def path(self) -> tuple[tuple[float, float], tuple[float, float], float, float]:
        """((x0, y0), (x1, y1), radius, phase): start and end centre in pixels, the shape radius, the tone phase."""
        rng = self._rng()
        short = min(self.width, self.height)
        jitter = rng.uniform(-0.08, 0.08, size=2) * short
        travel = (0.45 + rng.uniform(-0.05, 0.05)) * short
        radius = (0.16 + rng.uniform(-0.02, 0.02)) * short
        phase = float(rng.uniform(0, 2 * math.pi))
        dx, dy = DIRECTIONS[self.direction]
        cx, cy = self.width / 2 + jitter[0], self.height / 2 + jitter[1]
        start = (cx - dx * travel / 2, cy - dy * travel / 2)
        end = (cx + dx * travel / 2, cy + dy * travel / 2)
        return start, end, float(radius), phase


ATTRIBUTES = ("colour", "shape", "direction")


PROMPT_FORM = "a <colour> <shape> moves <direction>, a <tone> tone"  # the training template, in words
PROMPT_EXAMPLE = "a blue square moves right, a middle tone"


def prompt(spec: ClipSpec) -> str:
    return f"a {spec.colour} {spec.shape} moves {spec.direction}, a {spec.tone} tone"


def read_prompt(text: str) -> tuple[str, str, str]:
    """(colour, shape, direction) of a `prompt(spec)` text (module docstring)."""
    words = " ".join(str(text).strip().rstrip(".").lower().split())
    found = _PROMPT.fullmatch(words)
    rule = ("must read 'a COLOUR SHAPE moves DIRECTION, a TONE tone' with a colour of " + ", ".join(COLOURS) +
            ", a shape of " + ", ".join(SHAPES) + ", a direction of " + ", ".join(DIRECTIONS))
    if found is None or found["colour"] not in COLOURS or found["shape"] not in SHAPES or (
            found["direction"] not in DIRECTIONS):
        raise ValidationError(f"prompt {text!r}: not a shapes prompt: {rule}")
    if found["tone"] != TONES[found["shape"]][0]:
        raise ValidationError(f"prompt {text!r}: a {found['shape']} sounds a {TONES[found['shape']][0]} tone, not "
                              f"{found['tone']}")
    return found["colour"], found["shape"], found["direction"]


_PROMPT = re.compile(r"a (?P<colour>[a-z]+) (?P<shape>[a-z]+) moves (?P<direction>[a-z]+), a (?P<tone>[a-z]+) tone")


def partial_prompt(spec: ClipSpec, keep) -> str:
    """The prompt saying only the attributes in `keep` (module docstring); all three give `prompt(spec)`."""
    keep = tuple(keep)
    bad = [k for k in keep if k not in ATTRIBUTES]
    if bad or len(set(keep)) != len(keep):
        raise ValidationError(f"keep={keep!r}: must be distinct names among {', '.join(ATTRIBUTES)}")
    colour = f"{spec.colour} " if "colour" in keep else ""
    shape = spec.shape if "shape" in keep else "shape"
    direction = f" {spec.direction}" if "direction" in keep else ""
    tone = f", a {spec.tone} tone" if "shape" in keep else ""
    return f"a {colour}{shape} moves{direction}{tone}"


def _coverage(shape: str, cx: float, cy: float, r: float, width: int, height: int) -> np.ndarray:
    """(H, W) float32 in [0, 1]: the fraction of each pixel inside the shape (4x4 supersampled)."""
    s = SUPERSAMPLE
    ys = (np.arange(height * s, dtype=np.float64) + 0.5) / s
    xs = (np.arange(width * s, dtype=np.float64) + 0.5) / s
    x, y = np.meshgrid(xs - cx, ys - cy)
    if shape == "circle":
        inside = x * x + y * y <= r * r
    elif shape == "square":
        half = r * 0.886  # the square of the circle's area
        inside = (np.abs(x) <= half) & (np.abs(y) <= half)
    else:  # upward equilateral triangle inscribed in a circle of radius 1.2 r (about the circle's area)
        R = 1.2 * r
        inside = (y <= R / 2) & (y >= -R + np.sqrt(3) * np.abs(x))
    return inside.reshape(height, s, width, s).mean(axis=(1, 3)).astype(np.float32)


def _draw(shape: str, colour: str, cx: float, cy: float, r: float, width: int, height: int) -> np.ndarray:
    cov = _coverage(shape, cx, cy, r, width, height)[..., None]
    fg, bg = np.array(COLOURS[colour], np.float32), np.array(BACKGROUND, np.float32)
    return np.rint(cov * fg + (1 - cov) * bg).astype(np.uint8)


def render_frames(spec: ClipSpec) -> np.ndarray:
    """uint8 (F, H, W, 3) (module docstring)."""
    (x0, y0), (x1, y1), r, _ = spec.path()
    out = np.empty((spec.frames, spec.height, spec.width, 3), np.uint8)
    for k in range(spec.frames):
        a = k / max(spec.frames - 1, 1)
        out[k] = _draw(spec.shape, spec.colour, x0 + a * (x1 - x0), y0 + a * (y1 - y0), r, spec.width, spec.height)
    return out


def render_audio(spec: ClipSpec) -> np.ndarray:
    """float32 (2, S) stereo at 32 kHz (module docstring)."""
    (x0, _), (x1, _), _, phase = spec.path()
    n = spec.num_samples
    t = np.arange(n, dtype=np.float64) / SAMPLE_RATE
    duration = (spec.frames - 1) / FPS  # the path ends on the last frame's time
    a = np.clip(t / duration, 0.0, 1.0) if duration > 0 else np.zeros_like(t)
    pan = np.clip((x0 + a * (x1 - x0)) / spec.width, 0.0, 1.0)
    tone = AMPLITUDE * np.sin(2 * math.pi * spec.frequency * t + phase)
    fade = np.minimum(1.0, np.minimum(t, t[-1] - t) / 0.005)
    tone *= fade
    return np.stack([tone * np.cos(pan * math.pi / 2), tone * np.sin(pan * math.pi / 2)]).astype(np.float32)


def render_clip(spec: ClipSpec) -> tuple[np.ndarray, np.ndarray]:
    """(frames uint8 (F, H, W, 3), audio float32 (2, S))."""
    return render_frames(spec), render_audio(spec)


def first_last(spec: ClipSpec) -> tuple[np.ndarray, np.ndarray]:
    """The clip's first and last frames, uint8 (H, W, 3) each (FL2VA anchors)."""
    frames = render_frames(spec)
    return frames[0], frames[-1]


def reference_image(colour: str, shape: str, width: int = 64, height: int = 64) -> np.ndarray:
    """uint8 (H, W, 3): the shape centred on the canvas at the nominal radius (a Ref2VA reference image)."""
    ClipSpec(colour, shape, "left", width=width, height=height)  # validates the names and the canvas
    return _draw(shape, colour, width / 2, height / 2, 0.16 * min(width, height), width, height)


def _combos() -> list[tuple[str, str, str]]:
    return [(c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS]


def _held(combo: tuple[str, str, str]) -> bool:
    c, s, d = combo
    return (list(COLOURS).index(c) + 2 * SHAPES.index(s) + list(DIRECTIONS).index(d)) % len(COLOURS) == 0


def training_combos() -> list[tuple[str, str, str]]:
    """The 48 (colour, shape, direction) triples training prompts use."""
    return [k for k in _combos() if not _held(k)]


def held_out_combos() -> list[tuple[str, str, str]]:
    """The 12 triples never used in training (one colour per shape-direction pair)."""
    return [k for k in _combos() if _held(k)]
