"""Shared by every figure of `h3lab.research.plots`: sizes and fonts, colours, `PlotError`, `new_figure`, `png_bytes`, `save`,
tick thinning (`finish`) and the log colorbars.

The package docstring (`h3lab.research.plots`) is the contract of every figure."""

from __future__ import annotations

import io
import math
import os
import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ...errors import H3Error
from ...io_utils import atomic_write

DPI = 100
MAX_WIDTH_IN, MAX_HEIGHT_IN = 10.0, 14.0  # 1000 x 1400 px at DPI: a notebook cell's width, never a 11,770 px strip
MIN_FONT_PT = 7.0  # 9.7 px at DPI
FONT_PT = 8.0  # tick labels, table cells, band labels
MODALITY_COLORS = {"text": "#9e9e9e", "video": "#1f77b4", "audio": "#ff7f0e"}
COLOR_NAMES = {"#9e9e9e": "grey", "#1f77b4": "blue", "#ff7f0e": "orange"}
PASS_COLOR, FAIL_COLOR, NOT_RUN_COLOR = "#c8e6c9", "#ffcdd2", "#eeeeee"
EQUAL_COLOR, MISSING_COLOR = "white", "#bdbdbd"
FIRST_DRIFT_COLOR = "#e91e63"
BENCHMARK_KEYS = ("name", "date", "gpu", "torch", "triton", "git_rev", "command", "results")
BENCHMARK_RESULT_KEYS = ("shape", "rows", "impl", "median_s", "runs", "peak_mem_gib")
# One colour per implementation in every benchmark figure; others take the next free tab10 colour by name.
IMPL_COLORS = {"diffusers": "#7f7f7f", "torch": "#8c564b", "h3lab-off": "#1f77b4", "h3lab-strict": "#ff7f0e",
               "h3lab-fast": "#2ca02c", "h3lab-audit": "#9467bd"}
BASELINE_IMPLS = ("diffusers", "torch", "h3lab-off")  # the first one a benchmark file has is its baseline


class PlotError(H3Error):
    """A figure cannot be drawn from what it was given (shape, missing tensors, unknown kind)."""


# ================================================================================================== figures
def new_figure(width: float, height: float) -> Figure:
    """A Figure with its own Agg canvas (no pyplot), clamped to `MAX_WIDTH_IN` x `MAX_HEIGHT_IN`."""
    fig = Figure(figsize=(min(width, MAX_WIDTH_IN), min(height, MAX_HEIGHT_IN)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Figure, dpi: int = DPI) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save(fig: Figure, path: str | os.PathLike, dpi: int = DPI) -> Path:
    """Write `fig` as a PNG at `path` atomically (temp file in the target folder, fsync, rename)."""
    p = Path(path).expanduser()
    if p.suffix.lower() != ".png":
        raise PlotError(f"plot path {str(path)!r}: must end in .png")
    if p.exists() and p.is_dir():
        raise PlotError(f"plot path {str(path)!r}: is a directory")
    return atomic_write(p, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))


def _array(x: Any, name: str, ndim: int) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != ndim:
        raise PlotError(f"{name} has shape {a.shape}: expected {ndim} axes")
    return a


def _wrap(text: Any, width: int) -> str:
    return "\n".join(textwrap.wrap(str(text), width)) or "-"


def _overlap(a, b, pad: float = 0.5) -> bool:
    return a.x0 < b.x1 - pad and b.x0 < a.x1 - pad and a.y0 < b.y1 - pad and b.y0 < a.y1 - pad


def overlapping_labels(labels: Sequence[Any], renderer: Any) -> bool:
    """True when two of the visible, non-empty text artists `labels` overlap on the canvas."""
    boxes = [t.get_window_extent(renderer) for t in labels if t.get_visible() and t.get_text()]
    return any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _thin_ticks(fig: Figure) -> None:
    """Category axes (fixed ticks with fixed labels) whose labels overlap keep every k-th label, the smallest k that
    separates them; the axis label says "1 label in k shown". Numeric axes use matplotlib's own locators."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":  # colorbars choose their own ticks (`_set_log_ticks`)
            continue
        for axis, setter, label_getter, label_setter in (
            (ax.xaxis, ax.set_xticks, ax.get_xlabel, ax.set_xlabel),
            (ax.yaxis, ax.set_yticks, ax.get_ylabel, ax.set_ylabel),
        ):
            if type(axis.get_major_locator()).__name__ != "FixedLocator":
                continue
            locs = list(axis.get_majorticklocs())
            texts = axis.get_majorticklabels()
            if len(locs) < 2 or not overlapping_labels(texts, renderer):
                continue
            names = [t.get_text() for t in texts]
            props = {"fontsize": texts[0].get_fontsize(), "rotation": texts[0].get_rotation(),
                     "ha": texts[0].get_ha()}
            # First guess: the largest label (plus 2 px) over the spacing of the ticks on the canvas.
            boxes = [t.get_window_extent(renderer) for t in texts]
            along = [b.width if axis is ax.xaxis else b.height for b in boxes]
            span = ax.get_window_extent(renderer).width if axis is ax.xaxis else ax.get_window_extent(renderer).height
            lo, hi = axis.get_view_interval()
            spacing = span * abs(locs[1] - locs[0]) / max(abs(hi - lo), 1e-12)
            step = min(len(locs), max(2, math.ceil((max(along) + 2) / max(spacing, 1e-6))))
            while True:
                setter(locs[::step], names[::step], **props)
                fig.canvas.draw()
                if step >= len(locs) or not overlapping_labels(axis.get_majorticklabels(), renderer):
                    break
                step += 1
            label_setter(f"{label_getter()} (1 label in {step} shown)".strip())


def finish(fig: Figure) -> Figure:
    """The last step of every figure function: thin overlapping category labels (`_thin_ticks`)."""
    _thin_ticks(fig)
    return fig


def log_ticks(vmin: float, vmax: float, most: int = 7) -> list[float]:
    """Ticks for a log axis over [vmin, vmax], 2 to `most` of them: 1, 2, 5 x 10^k, else 1 and 5, else decades
    (then every other decade, ...), else an even thinning of 1, 2, 5; the two ends when no round value lies inside."""
    lo, hi = math.floor(math.log10(vmin)), math.ceil(math.log10(vmax))
    inside = lambda ts: [t for t in ts if vmin * (1 - 1e-9) <= t <= vmax * (1 + 1e-9)]  # noqa: E731
    dense = inside([m * 10.0**k for k in range(lo, hi + 1) for m in (1, 2, 5)])
    choices = [dense, inside([m * 10.0**k for k in range(lo, hi + 1) for m in (1, 5)])]
    choices += [inside([10.0**k for k in range(lo, hi + 1, step)]) for step in range(1, hi - lo + 2)]
    for ticks in choices:
        if 2 <= len(ticks) <= most:
            return ticks
    if len(dense) >= 2:
        return [dense[i] for i in sorted(set(np.linspace(0, len(dense) - 1, max(2, most)).round().astype(int)))]
    return [vmin, vmax]


def _tick_text(x: float) -> str:
    m, e = f"{x:.1e}".split("e")
    m = m.rstrip("0").rstrip(".")
    return f"{m}e{int(e)}"


def _set_log_ticks(cb: Any, most: int = 7) -> None:
    from matplotlib.ticker import FixedLocator

    cb.ax.yaxis.set_major_locator(FixedLocator(log_ticks(cb.norm.vmin, cb.norm.vmax, most)))


def _log_colorbar(fig: Figure, mappable: Any, ax: Any, label: str) -> Any:
    """A colorbar of a log-scale heatmap labelled at `log_ticks` ("2e-3"), no labelled minor ticks to collide."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    cb = fig.colorbar(mappable, ax=ax, extend="min", label=label, fraction=0.06, pad=0.02, aspect=30)
    _set_log_ticks(cb)
    cb.ax.yaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _tick_text(x)))
    cb.ax.yaxis.set_minor_formatter(NullFormatter())
    cb.ax.tick_params(labelsize=FONT_PT)
    cb.ax.yaxis.label.set_size(FONT_PT)
    return cb
