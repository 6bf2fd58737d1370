"""Measurements of decoded media: what a clip shows and sounds like, read back with no model in the loop.

Contract (`measure(frames, audio, sample_rate)`; frames uint8 (F, H, W, 3), audio float (2, S) stereo):
- Background: the per-channel median colour over every pixel of the clip (the shape covers well under half the
  canvas). Foreground: pixels whose RGB distance from it exceeds `FG_DISTANCE`.
- `colour`: the `COLOURS` name nearest (RGB distance) to the mean foreground colour over the clip; None when the
  clip has no foreground pixel.
- `direction`: from the per-frame foreground centroids (frames with >= `MIN_FG_PIXELS` foreground pixels, at least
  3): the least-squares slopes of x and y against the frame index, times F - 1, give the displacement (dx, dy) in
  pixels; the larger component names it (left / right / up / down, image y downward) unless both are below
  `STILL_FRACTION` of the short edge: "still". None without a track.
- `frequency`: the peak of |rfft| of the Hann-windowed mono mix (L + R) between 50 Hz and 4 kHz; `tone`: the `TONES`
  word whose frequency is nearest in octaves; both None for a silent track (RMS below `SILENCE_RMS`).
- `pan_start`, `pan_end`: equal-power pan atan2(rms_R, rms_L) / (pi / 2) in [0, 1] (0 left, 1 right) over the
  first and last fifth of the track; `pan_direction`: "right" / "left" when pan_end - pan_start exceeds
  +/- `PAN_STILL`, else "still".
- `matches(m, colour, shape, direction)`: per attribute (`READS`, in that order), whether the measurement says what a
  prompt says: colour, direction, tone (the shape's pitch word) and pan (left / right for horizontal motion, still
  for vertical).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ..errors import ValidationError
from .clips import COLOURS, SAMPLE_RATE, TONES

FG_DISTANCE = 60.0
MIN_FG_PIXELS = 4
STILL_FRACTION = 0.1
SILENCE_RMS = 1e-3
PAN_STILL = 0.1
READS = ("colour", "direction", "tone", "pan")  # the attributes `matches` compares, in its order


@dataclass(frozen=True)
class Measurement:
    colour: str | None
    direction: str | None
    displacement: tuple[float, float] | None
    frequency: float | None
    tone: str | None
    pan_start: float | None
    pan_end: float | None
    pan_direction: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def _colour_and_track(frames: np.ndarray) -> tuple[str | None, str | None, tuple[float, float] | None]:
    x = frames.astype(np.float32)
    background = np.median(x.reshape(-1, 3), axis=0)
    fg = np.linalg.norm(x - background, axis=-1) > FG_DISTANCE  # (F, H, W)
    if not fg.any():
        return None, None, None
    mean = x[fg].mean(axis=0)
    names = list(COLOURS)
    colour = names[int(np.argmin([np.linalg.norm(mean - np.array(COLOURS[n], np.float32)) for n in names]))]
    ys, xs = np.mgrid[0:frames.shape[1], 0:frames.shape[2]]
    idx, cx, cy = [], [], []
    for k in range(frames.shape[0]):
        m = fg[k]
        if m.sum() >= MIN_FG_PIXELS:
            idx.append(k)
            cx.append(xs[m].mean())
            cy.append(ys[m].mean())
    if len(idx) < 3:
        return colour, None, None
    t = np.asarray(idx, np.float64)
    span = frames.shape[0] - 1
    dx = float(np.polyfit(t, cx, 1)[0] * span)
    dy = float(np.polyfit(t, cy, 1)[0] * span)
    still = STILL_FRACTION * min(frames.shape[1], frames.shape[2])
    if max(abs(dx), abs(dy)) < still:
        direction = "still"
    elif abs(dx) >= abs(dy):
        direction = "right" if dx > 0 else "left"
    else:
        direction = "down" if dy > 0 else "up"
    return colour, direction, (dx, dy)


def _pan(left: np.ndarray, right: np.ndarray) -> float:
    return float(math.atan2(np.sqrt(np.mean(right ** 2)), np.sqrt(np.mean(left ** 2))) / (math.pi / 2))


def _audio(audio: np.ndarray, sample_rate: int):
    a = audio.astype(np.float64)
    mono = a[0] + a[1]
    if np.sqrt(np.mean(a ** 2)) < SILENCE_RMS:
        return None, None, None, None, None
    spectrum = np.abs(np.fft.rfft(mono * np.hanning(mono.size)))
    freqs = np.fft.rfftfreq(mono.size, 1.0 / sample_rate)
    band = (freqs >= 50) & (freqs <= 4000)
    frequency = float(freqs[band][np.argmax(spectrum[band])])
    tone = min(TONES.values(), key=lambda wf: abs(math.log2(frequency / wf[1])))[0]
    fifth = max(a.shape[1] // 5, 1)
    start, end = _pan(a[0, :fifth], a[1, :fifth]), _pan(a[0, -fifth:], a[1, -fifth:])
    delta = end - start
    pan_direction = "right" if delta > PAN_STILL else "left" if delta < -PAN_STILL else "still"
    return frequency, tone, start, end, pan_direction


def measure(frames, audio, sample_rate: int = SAMPLE_RATE) -> Measurement:
    """Read colour, direction, tone and pan from decoded media (module docstring)."""
    frames = np.asarray(frames)
    audio = np.asarray(audio)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] < 1:
        raise ValidationError(f"frames {frames.dtype} {tuple(frames.shape)}: must be uint8 (frames, height, width, 3)")
    if audio.ndim != 2 or audio.shape[0] != 2 or audio.shape[1] < 16:
        raise ValidationError(f"audio shape {tuple(audio.shape)}: must be stereo (2, samples >= 16)")
    colour, direction, displacement = _colour_and_track(frames)
    return Measurement(colour, direction, displacement, *_audio(audio, sample_rate))


def matches(m: Measurement, colour: str, shape: str, direction: str) -> dict[str, bool]:
    """Per attribute, whether `m` says what the prompt of (colour, shape, direction) says (module docstring)."""
    pan_want = direction if direction in ("left", "right") else "still"
    return {"colour": m.colour == colour, "direction": m.direction == direction, "tone": m.tone == TONES[shape][0],
            "pan": m.pan_direction == pan_want}
