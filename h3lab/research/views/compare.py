"""Matched-seed A/B numbers of two decoded clips: per-frame PSNR and SSIM, the audio's log-spectral distance and RMS
ratio, the h3-shapes attribute reads, and the first drift between the two runs -- one table, deterministic.

Contract
--------
Every number is computed on the CPU in float64 with numpy, in a fixed order, from the decoded media alone (uint8
frames (F, H, W, 3), float audio (2, N)), so the same two clips give the same table bytes on every call.

- `frame_psnr(a, b) -> (F,)`: 10 log10(255^2 / MSE) over a frame's pixels and channels; +inf for equal frames.
- `frame_ssim(a, b) -> (F,)`: SSIM (Wang et al. 2004) per RGB channel with an 11-tap Gaussian window (sigma 1.5;
  the largest odd size <= min(H, W) on smaller frames), valid positions only, K1 = 0.01, K2 = 0.03, L = 255,
  averaged over positions and channels; 1 for equal frames.
- `spectrogram(audio, n_fft=1024, hop=256) -> (T, n_fft/2 + 1)`: power of the Hann-windowed STFT of the mono mix
  (L + R) / 2, frames without padding; `spectrogram_db` the same in dB, floored 100 dB below its peak.
- `log_spectral_distance(a, b) -> dB`: per channel, the STFT powers P_a, P_b (as above, per channel), each floored
  at `POWER_FLOOR` times the pair's peak power; the distance is the mean over frames of
  sqrt(mean over bins of (10 log10(P_a / P_b))^2), averaged over the two channels. 0 for equal audio.
- `rms_ratio(a, b) -> float`: RMS(b) / RMS(a) over both channels (1 for equal audio; inf when a is silent and b not,
  1 when both are).
- `shapes_reads(frames, audio, rate, prompt)`: `h3lab.shapes.measure` of the clip and, when the prompt is an h3-shapes
  prompt ("a <colour> <shape> moves <direction>, a <tone> tone"), which attributes match it (`matches`); else None.
- `compare_results(a, b, labels=("A", "B"), drift=None) -> Comparison`: the numbers of two results (objects with
  `frames`, `audio`, `sample_rate`, `settings.prompt`, `seed`); clips of different frame counts or sizes, or of
  different sample rates, are refused in one line. `drift` is a report with `summary()` and `first` (the session's
  `drift(a, b)`), recorded as its summary line.
- `Comparison.table()` rows (metric, A, B, A vs B); `lines()` the REPL's text; `to_dict()` JSON (inf written as
  "inf").
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ...errors import ValidationError
from ...shapes import COLOURS, DIRECTIONS, SHAPES, TONES, matches, measure

POWER_FLOOR = 1e-10  # relative to the pair's peak STFT power (-100 dB): silence compares as silence
SSIM_K1, SSIM_K2, SSIM_L = 0.01, 0.03, 255.0
_SHAPES_PROMPT = re.compile(rf"a ({'|'.join(COLOURS)}) ({'|'.join(SHAPES)}) moves ({'|'.join(DIRECTIONS)}), "
                            rf"a ({'|'.join(t for t, _ in TONES.values())}) tone")


class CompareError(ValidationError):
    """Two clips cannot be compared (one line naming what differs)."""


def _frames(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.ndim != 4 or a.shape[-1] != 3:
        raise CompareError(f"frames {a.shape} vs {b.shape}: A/B needs two clips of one size and length "
                           "(F, H, W, 3)")
    return a.astype(np.float64), b.astype(np.float64)


def frame_psnr(a: Any, b: Any) -> np.ndarray:
    """(F,) PSNR in dB per frame (module docstring)."""
    x, y = _frames(a, b)
    mse = ((x - y) ** 2).reshape(x.shape[0], -1).mean(axis=1)
    with np.errstate(divide="ignore"):
        return np.where(mse == 0, np.inf, 10 * np.log10(SSIM_L ** 2 / np.where(mse == 0, 1.0, mse)))


def _gaussian(size: int, sigma: float = 1.5) -> np.ndarray:
    r = np.arange(size, dtype=np.float64) - (size - 1) / 2
    w = np.exp(-(r ** 2) / (2 * sigma ** 2))
    return w / w.sum()


def _filter(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Separable valid-mode filter over axes 1, 2 of (F, H, W, C)."""
    n = w.size
    x = np.lib.stride_tricks.sliding_window_view(x, n, axis=1) @ w
    return np.lib.stride_tricks.sliding_window_view(x, n, axis=2) @ w


def frame_ssim(a: Any, b: Any) -> np.ndarray:
    """(F,) SSIM per frame (module docstring)."""
    x, y = _frames(a, b)
    size = min(11, x.shape[1], x.shape[2])
    size -= 1 - size % 2
    w = _gaussian(size)
    c1, c2 = (SSIM_K1 * SSIM_L) ** 2, (SSIM_K2 * SSIM_L) ** 2
    mx, my = _filter(x, w), _filter(y, w)
    vx = _filter(x * x, w) - mx * mx
    vy = _filter(y * y, w) - my * my
    cxy = _filter(x * y, w) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    return s.reshape(s.shape[0], -1).mean(axis=1)


def _stft_power(x: np.ndarray, n_fft: int, hop: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.size < n_fft:
        x = np.pad(x, (0, n_fft - x.size))
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop] * np.hanning(n_fft)
    return np.abs(np.fft.rfft(frames, axis=1)) ** 2


def _audio(a: Any) -> np.ndarray:
    a = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != 2:
        raise CompareError(f"audio shape {a.shape}: must be stereo (2, samples)")
    return a


def spectrogram(audio: Any, n_fft: int = 1024, hop: int = 256) -> np.ndarray:
    """(T, n_fft/2 + 1) STFT power of the mono mix (module docstring)."""
    a = _audio(audio)
    return _stft_power((a[0] + a[1]) / 2, n_fft, hop)


def spectrogram_db(audio: Any, floor_db: float = -100.0) -> np.ndarray:
    """`spectrogram` in dB, floored `floor_db` below its peak (for figures)."""
    p = spectrogram(audio)
    peak = max(float(p.max()), 1e-300)
    return 10 * np.log10(np.maximum(p, peak * 10 ** (floor_db / 10)))


def log_spectral_distance(a: Any, b: Any, n_fft: int = 1024, hop: int = 256) -> float:
    """Log-spectral distance in dB (module docstring)."""
    x, y = _audio(a), _audio(b)
    if x.shape != y.shape:
        raise CompareError(f"audio {x.shape} vs {y.shape}: A/B needs two tracks of one length")
    out = []
    for ch in range(2):
        pa, pb = _stft_power(x[ch], n_fft, hop), _stft_power(y[ch], n_fft, hop)
        floor = POWER_FLOOR * max(float(pa.max()), float(pb.max()), 1e-300)
        # A difference of logs, not the log of a ratio: exactly antisymmetric, so the distance is symmetric.
        d = 10 * (np.log10(np.maximum(pa, floor)) - np.log10(np.maximum(pb, floor)))
        out.append(float(np.sqrt((d ** 2).mean(axis=1)).mean()))
    return float(np.mean(out))


def rms_ratio(a: Any, b: Any) -> float:
    """RMS(b) / RMS(a) over both channels (module docstring)."""
    ra, rb = float(np.sqrt((_audio(a) ** 2).mean())), float(np.sqrt((_audio(b) ** 2).mean()))
    if ra == 0:
        return 1.0 if rb == 0 else math.inf
    return rb / ra


def shapes_reads(frames: Any, audio: Any, rate: int, prompt: str) -> dict[str, Any]:
    """{"measured": Measurement dict, "match": per attribute or None} (module docstring)."""
    m = measure(np.asarray(frames), _audio(audio).astype(np.float32), rate)
    found = _SHAPES_PROMPT.fullmatch(prompt.strip()) if isinstance(prompt, str) else None
    match = None
    if found is not None:
        colour, shape, direction, _tone = found.groups()
        match = matches(m, colour, shape, direction)
    return {"measured": m.to_dict(), "match": match}


@dataclass
class Comparison:
    """Two clips on one seed, side by side (module docstring). `frames` / `audio`: the decoded media (for figures);
    `psnr`, `ssim` (F,); `lsd_db`, `rms_ratio`; `reads` per side; `drift`: the first-drift summary line or None."""

    labels: tuple[str, str]
    seeds: tuple[int, int]
    prompts: tuple[str, str]
    psnr: np.ndarray
    ssim: np.ndarray
    lsd_db: float
    rms_ratio: float
    reads: tuple[dict, dict]
    sample_rate: int
    drift: str | None = None
    first_drift: str | None = None
    frames: tuple[Any, Any] = field(default=(None, None), repr=False)
    audio: tuple[Any, Any] = field(default=(None, None), repr=False)
    results: tuple[Any, Any] = field(default=(None, None), repr=False)  # the two results compared
    spectrograms: tuple[Any, Any] = field(default=(None, None), repr=False)  # (T, bins) dB, `spectrogram_db`
    spectrogram_seconds: float = 0.0  # the tracks' length

    def table(self) -> list[tuple[str, str, str, str]]:
        """(metric, A, B, A vs B) rows: a side's own reads fill A and B, a number of the pair fills "A vs B"."""
        fin = self.psnr[np.isfinite(self.psnr)]
        psnr_mean = "inf (equal)" if fin.size == 0 else f"{fin.mean():.2f} dB" + (
            f" ({self.psnr.size - fin.size} equal frames)" if fin.size < self.psnr.size else "")
        rows = [("seed", str(self.seeds[0]), str(self.seeds[1]), "")]
        if self.prompts[0] != self.prompts[1]:
            rows.append(("prompt", self.prompts[0], self.prompts[1], ""))
        for attr in ("colour", "direction", "tone", "pan_direction"):
            cells = []
            for side in self.reads:
                got = side["measured"].get(attr)
                ok = None if side["match"] is None else side["match"]["pan" if attr == "pan_direction" else attr]
                cells.append(f"{got}" + ("" if ok is None else " ok" if ok else " MISS"))
            rows.append((attr.replace("_direction", ""), *cells, ""))
        rows += [(name, "", "", value) for name, value in (
            ("PSNR mean", psnr_mean), ("PSNR min", _num(self.psnr.min(), "dB")),
            ("SSIM mean", f"{self.ssim.mean():.4f}"), ("SSIM min", f"{self.ssim.min():.4f}"),
            ("audio log-spectral distance", f"{self.lsd_db:.3f} dB"),
            ("audio RMS ratio B/A", _num(self.rms_ratio, "")))]
        if self.drift is not None:
            rows.append(("first drift", "", "", self.first_drift or "none (byte-equal)"))
        return rows

    def lines(self) -> list[str]:
        rows = self.table()
        w = max(len(r[0]) for r in rows)
        wa = max([len(self.labels[0])] + [len(r[1]) for r in rows])
        out = [f"A/B {self.labels[0]} vs {self.labels[1]}, seed {self.seeds[0]}",
               f"  {'':<{w}}  {self.labels[0]:<{wa}}  {self.labels[1]}"]
        for name, a, b, pair in rows:
            out.append(f"  {name:<{w}}  {a:<{wa}}  {b}" if not pair else f"  {name:<{w}}  {pair}")
        if self.drift is not None:
            out.append(f"  {self.drift}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"labels": list(self.labels), "seeds": list(self.seeds), "prompts": list(self.prompts),
                "psnr_db": [_json(v) for v in self.psnr], "ssim": [float(v) for v in self.ssim],
                "lsd_db": self.lsd_db, "rms_ratio": _json(self.rms_ratio), "reads": list(self.reads),
                "drift": self.drift, "first_drift": self.first_drift, "table": [list(r) for r in self.table()]}


def _num(v: float, unit: str) -> str:
    return "inf" if math.isinf(v) else f"{v:.3f}{' ' + unit if unit else ''}"


def _json(v: float) -> float | str:
    return "inf" if math.isinf(v) else float(v)


def compare_results(a: Any, b: Any, labels: Sequence[str] = ("A", "B"), drift: Any = None) -> Comparison:
    """The `Comparison` of two results (module docstring)."""
    if a.sample_rate != b.sample_rate:
        raise CompareError(f"sample rates {a.sample_rate} vs {b.sample_rate}: A/B needs one rate")
    psnr, ssim = frame_psnr(a.frames, b.frames), frame_ssim(a.frames, b.frames)
    reads = tuple(shapes_reads(r.frames, r.audio, r.sample_rate, r.settings.prompt) for r in (a, b))
    first = None if drift is None or getattr(drift, "first", None) is None else str(drift.first)
    return Comparison(labels=(str(labels[0]), str(labels[1])), seeds=(int(a.seed), int(b.seed)),
                      prompts=(a.settings.prompt, b.settings.prompt), psnr=psnr, ssim=ssim,
                      lsd_db=log_spectral_distance(a.audio, b.audio), rms_ratio=rms_ratio(a.audio, b.audio),
                      reads=reads, sample_rate=int(a.sample_rate),
                      drift=None if drift is None else drift.summary(), first_drift=first,
                      frames=(a.frames, b.frames), audio=(a.audio, b.audio), results=(a, b),
                      spectrograms=(spectrogram_db(a.audio), spectrogram_db(b.audio)),
                      spectrogram_seconds=_audio(a.audio).shape[1] / float(a.sample_rate))
