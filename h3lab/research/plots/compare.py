"""The figure of a matched-seed A/B (`Session.compare` -> `h3lab.research.views.compare.Comparison`): it reads the comparison's
documented attributes only (labels, frames, spectrograms, psnr, ssim, table) and does no model work.

- `compare_figure(comparison)`: A's and B's frames (at most five, evenly spaced, first and last kept) and |A - B| as
  three strips; both spectrograms (dB, one colour scale, time in seconds); PSNR (dB) and SSIM per frame (equal frames
  drawn at the top of the PSNR axis and said in the legend); the table of `Comparison.table()`. |A - B| is scaled by
  the largest gain that keeps it in 0..255 (said in its title); the spectrograms show the band holding 99.9 % of the
  pair's power (at least 2 kHz).
"""

from __future__ import annotations

from typing import Any, Sequence

from matplotlib.figure import Figure

import numpy as np

from .figure import FONT_PT, PlotError, finish, new_figure


def _strip(frames: np.ndarray, picks: Sequence[int]) -> np.ndarray:
    gap = np.full((frames.shape[1], 2, 3), 255, np.uint8)
    return np.concatenate([x for k in picks for x in (frames[k], gap)][:-1], axis=1)


def _frames_rows(fig: Any, grid: Any, comparison: Any, a: np.ndarray, b: np.ndarray) -> None:
    picks = sorted(set(np.linspace(0, a.shape[0] - 1, min(5, a.shape[0])).round().astype(int).tolist()))
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    gain = 255 // max(int(diff.max()), 1)
    diff = (diff * gain).astype(np.uint8)
    names = tuple(label if label == side else f"{side}: {label}" for side, label in zip("AB", comparison.labels)) + (
        "|A - B|" + (f" x {gain}" if gain > 1 else ""),)
    for row, (img, name) in enumerate(zip((a, b, diff), names)):
        ax = fig.add_subplot(grid[row, :])
        ax.imshow(_strip(img, picks), interpolation="nearest")
        ax.set_title(f"{name} - frames {', '.join(map(str, picks))}", fontsize=FONT_PT + 1)
        ax.set_axis_off()


def _spectrograms(fig: Any, grid: Any, comparison: Any) -> None:
    specs = [np.asarray(s, dtype=np.float64) for s in comparison.spectrograms]
    lo, hi = min(float(s.min()) for s in specs), max(float(s.max()) for s in specs)
    seconds, nyquist = comparison.spectrogram_seconds, comparison.sample_rate / 2000
    # Show the band holding 99.9 % of the pair's power (at least 2 kHz): a tone at 440 Hz is not a line at 16 kHz.
    power = sum((10 ** (s / 10)).sum(axis=0) for s in specs)
    top_bin = int(np.searchsorted(np.cumsum(power) / power.sum(), 0.999)) + 1
    top = min(nyquist, max(2.0, np.ceil(nyquist * top_bin / power.size)))
    for col, (spec, name) in enumerate(zip(specs, ("A", "B"))):
        ax = fig.add_subplot(grid[3, col])
        im = ax.imshow(spec.T, origin="lower", aspect="auto", cmap="viridis", vmin=max(lo, hi - 100), vmax=hi,
                       extent=(0, seconds, 0, nyquist))
        ax.set_ylim(0, top)
        ax.set_title(f"{name} spectrogram", fontsize=FONT_PT + 1)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("kHz")
        ax.tick_params(labelsize=FONT_PT)
        cb = fig.colorbar(im, ax=ax, fraction=0.06, pad=0.02, aspect=20, label="power (dB)")
        cb.ax.tick_params(labelsize=FONT_PT)
        cb.ax.yaxis.label.set_size(FONT_PT)


def _curves(fig: Any, grid: Any, comparison: Any) -> None:
    psnr = np.asarray(comparison.psnr, dtype=np.float64)
    fin = psnr[np.isfinite(psnr)]
    top = (fin.max() + 5) if fin.size else 60.0
    ax = fig.add_subplot(grid[4, 0])
    x = np.arange(psnr.size)
    ax.plot(x[np.isfinite(psnr)], fin, "o-", ms=3, label="PSNR")
    if fin.size < psnr.size:
        ax.plot(x[~np.isfinite(psnr)], np.full(psnr.size - fin.size, top), "^", ms=4, label="equal frame")
    ax.set_xlabel("frame")
    ax.set_ylabel("PSNR (dB)")
    ax.legend(fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)
    ax2 = fig.add_subplot(grid[4, 1])
    ax2.plot(x, np.asarray(comparison.ssim), "o-", ms=3, color="#2ca02c")
    ax2.set_xlabel("frame")
    ax2.set_ylabel("SSIM")
    ax2.tick_params(labelsize=FONT_PT)


def compare_figure(comparison: Any) -> Figure:
    """The A/B figure (module docstring)."""
    a, b = comparison.frames
    if a is None or b is None or np.asarray(a).ndim != 4:
        raise PlotError("compare_figure: the comparison carries no frames")
    fig = new_figure(10.0, 12.5)
    grid = fig.add_gridspec(6, 2, height_ratios=[1, 1, 1, 1.3, 1.2, 2.0])
    _frames_rows(fig, grid, comparison, np.asarray(a), np.asarray(b))
    _spectrograms(fig, grid, comparison)
    _curves(fig, grid, comparison)
    ax = fig.add_subplot(grid[5, :])
    ax.set_axis_off()
    rows = [list(r) for r in comparison.table()]
    cells = [[c if len(c) <= 56 else c[:55] + "…" for c in r] for r in rows]
    table = ax.table(cellText=cells, colLabels=["", "A", "B", "A vs B"], loc="upper center", cellLoc="left",
                     colWidths=[0.22, 0.18, 0.18, 0.42])
    table.auto_set_font_size(False)
    table.set_fontsize(FONT_PT)
    fig.suptitle(f"A/B on seed {comparison.seeds[0]}", fontsize=FONT_PT + 2)
    return finish(fig)
