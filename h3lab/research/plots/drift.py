"""Drift figures: `drift_heatmaps` (step x layer, layer x packed row, log scale, first drift marked) and `drift_inputs`
(a `DriftReport` as their inputs).

The package docstring (`h3lab.research.plots`) is the contract of every figure."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure

from .figure import (
    COLOR_NAMES,
    DPI,
    EQUAL_COLOR,
    FIRST_DRIFT_COLOR,
    FONT_PT,
    MAX_HEIGHT_IN,
    MAX_WIDTH_IN,
    MISSING_COLOR,
    MODALITY_COLORS,
    PlotError,
    _array,
    _log_colorbar,
    _set_log_ticks,
    _wrap,
    finish,
    new_figure,
)
from .tables import _first_drift_text

# ==================================================================================================== drift
def row_modalities(row_labels: Sequence[str]) -> list[str]:
    """"12:video" -> "video" (the drift report's packed-row labels)."""
    out = []
    for label in row_labels:
        _, sep, modality = str(label).partition(":")
        out.append(modality if sep else "?")
    return out


def _bands(modalities: Sequence[str]) -> list[tuple[int, int, str]]:
    """Contiguous runs (start, stop, modality)."""
    runs: list[tuple[int, int, str]] = []
    for i, m in enumerate(modalities):
        if runs and runs[-1][2] == m:
            runs[-1] = (runs[-1][0], i + 1, m)
        else:
            runs.append((i, i + 1, m))
    return runs


def _nanmax(block: np.ndarray) -> np.ndarray:
    """Max over the last axis, NaN only where every value is NaN."""
    out = np.full(block.shape[:-1], np.nan)
    seen = ~np.isnan(block).all(axis=-1)
    out[seen] = np.nanmax(block[seen], axis=-1)
    return out


def bin_rows(matrix: np.ndarray, modalities: Sequence[str], max_columns: int) -> tuple[np.ndarray, list[str],
                                                                                      list[tuple[int, int]], int]:
    """(L, R) -> (L, B) with B <= max_columns plus about one per modality band: contiguous rows of one modality
    band in bins of `k` rows (the last bin of a band may be shorter), max per bin (NaN only where every row is NaN).
    Returns (binned matrix, modality per bin, packed-row range [start, stop) per bin, k); k = 1 leaves it as is."""
    rows = matrix.shape[1]
    k = max(1, math.ceil(rows / max_columns))
    if k == 1:
        return matrix, list(modalities), [(i, i + 1) for i in range(rows)], 1
    cols, mods, spans = [], [], []
    for start, stop, m in _bands(modalities):
        for b in range(start, stop, k):
            e = min(b + k, stop)
            cols.append(_nanmax(matrix[:, b:e]))
            mods.append(m)
            spans.append((b, e))
    return np.stack(cols, axis=1), mods, spans, k


def _log_norm(*arrays: np.ndarray) -> LogNorm:
    vals = np.concatenate([a[np.isfinite(a) & (a > 0)].ravel() for a in arrays])
    if vals.size == 0:
        return LogNorm(vmin=1e-8, vmax=1.0)
    lo, hi = float(vals.min()), float(vals.max())
    return LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10)


def _heat(ax, data: np.ndarray, norm: LogNorm, cmap):
    # Zeros (byte-equal) fall below vmin and take the "under" colour; NaN (not captured) is masked ("bad").
    shown = np.where(data == 0, norm.vmin * 1e-3, data)
    return ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")


def _drift_cmap():
    import matplotlib

    # viridis: no near-black top end (a large drift stays readable), and neither end is white or grey, which mean
    # byte-equal and not captured.
    return matplotlib.colormaps["viridis"].with_extremes(under=EQUAL_COLOR, bad=MISSING_COLOR)


def drift_state(step_layer: np.ndarray, layer_row: np.ndarray) -> str:
    """What the plotted points say as a whole: "byte-equal at every plotted point", "nothing comparable: ..." (every
    point NaN: no layer was captured by both runs -- different prompts or shapes), "byte-equal where both runs were
    captured ..." or "" (some drift)."""
    both = np.concatenate([step_layer.ravel(), layer_row.ravel()])
    finite = both[np.isfinite(both)]
    if finite.size == 0:
        return "nothing comparable: no plotted layer was captured by both runs (different prompts or shapes)"
    if np.any(finite != 0):
        return ""
    if finite.size < both.size:
        return "byte-equal where both runs were captured; grey: not captured by both"
    return "byte-equal at every plotted point"


def first_drift_layer(point: str | None, layer_labels: Sequence[str]) -> int | None:
    """The plotted layer column that holds a drift point (`blocks.3.q` -> `blocks.3`); a point outside every block
    goes to the first plotted layer at or after it in execution order (inputs, refiner, time and RoPE tables ->
    `pack`; the heads, outputs and Euler step -> the last layer). None without a point."""
    if not point:
        return None
    labels = list(layer_labels)
    for i, label in enumerate(labels):
        if point == label or point.startswith(label + "."):
            return i
    late = ("final", "video_head", "audio_head", "video_out", "audio_out", "scheduler.")
    return len(labels) - 1 if point.startswith(late) else 0


def _point_of(first: Any) -> tuple[str | None, int | None, int | None]:
    """(point, pass, packed row) of a DriftPoint, its dict, or None."""
    if first is None:
        return None, None, None
    get = first.get if isinstance(first, Mapping) else lambda k: getattr(first, k, None)
    return get("point"), get("step"), get("packed_row")


def drift_heatmaps(
    step_layer: Any,
    layer_row: Any,
    *,
    step_labels: Sequence[Any],
    layer_labels: Sequence[str],
    row_labels: Sequence[str],
    modalities: Sequence[str] | None = None,
    row_step: Any = None,
    first: Any = None,
    metric: str = "max |a-b|",
    title: str = "drift",
    max_row_columns: int = 160,
) -> Figure:
    """Two heatmaps on one log colour scale, each with its colorbar: step x layer (S, L) and, at one pass
    (`row_step`), layer x packed row (L, R) with the rows' modality bands (from `modalities`, else parsed from
    `row_labels`) above it; more than `max_row_columns` rows are binned within each band (max per bin, the rule in
    the axis label). `first` (a DriftPoint or its dict) is marked in the plotted layer that holds it.
    Axes: [step x layer, layer x row, modality band, colorbar of step x layer, colorbar of layer x row]."""
    sl, lr, mods = _checked_drift_matrices(step_layer, layer_row, step_labels, layer_labels, row_labels, modalities)
    norm = _log_norm(sl, lr)
    cmap = _drift_cmap()
    shown, bin_mods, spans, k = bin_rows(lr, mods, max_row_columns)
    layers, passes = len(layer_labels), len(step_labels)
    fig = new_figure(MAX_WIDTH_IN, min(MAX_HEIGHT_IN, max(4.4, 2.6 + 0.2 * max(layers, passes))))
    left = min(0.45, max(0.24, 0.06 * layers))  # the step x layer share of the width
    grid = fig.add_gridspec(2, 2, width_ratios=[left, 1 - left], height_ratios=[0.09, 1.0])
    ax_sl = fig.add_subplot(grid[1, 0])
    im = _step_layer_heat(ax_sl, sl, norm, cmap, step_labels, layer_labels, metric)
    ax_lr = fig.add_subplot(grid[1, 1])
    im_lr = _layer_row_heat(ax_lr, shown, norm, cmap, layer_labels, len(row_labels), k, spans)
    bands = _bands(bin_mods)
    for start, _stop, _m in bands[1:]:
        ax_lr.axvline(start - 0.5, color="black", linewidth=0.8)
    ax_band = fig.add_subplot(grid[0, 1], sharex=ax_lr)
    key = _modality_band(ax_band, bin_mods, row_step, metric)
    point, col = _mark_first_drift(ax_sl, ax_lr, first, step_labels, layer_labels, row_step, spans)
    colorbars = [_log_colorbar(fig, im, ax_sl, metric), _log_colorbar(fig, im_lr, ax_lr, metric)]
    legend = f"white: byte-equal (0), grey: not captured by both runs; band: modality of the rows ({key})"
    if col is not None:
        legend += f"; pink square: the first drift ({point}, in layer column {layer_labels[col]})"
    fig.supxlabel(_wrap(legend, 150), fontsize=FONT_PT)
    state = drift_state(sl, lr)
    fig.suptitle(_wrap(title + (f" -- {state}" if state else ""), 130), fontsize=10)
    _label_to_fit(fig, colorbars, ax_band, bands, len(bin_mods))
    return finish(fig)


def _checked_drift_matrices(step_layer, layer_row, step_labels, layer_labels, row_labels,
                            modalities) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The two matrices as 2-D arrays whose shapes match their labels, and one modality per packed row."""
    sl = _array(step_layer, "step x layer matrix", 2)
    lr = _array(layer_row, "layer x row matrix", 2)
    if sl.shape != (len(step_labels), len(layer_labels)):
        raise PlotError(f"step x layer matrix {sl.shape}: labels say ({len(step_labels)}, {len(layer_labels)})")
    if lr.shape != (len(layer_labels), len(row_labels)):
        raise PlotError(f"layer x row matrix {lr.shape}: labels say ({len(layer_labels)}, {len(row_labels)})")
    mods = list(modalities) if modalities is not None else row_modalities(row_labels)
    if len(mods) != lr.shape[1]:
        raise PlotError(f"{len(mods)} row modalities for {lr.shape[1]} packed rows")
    return sl, lr, mods


def _step_layer_heat(ax, sl: np.ndarray, norm, cmap, step_labels, layer_labels, metric: str):
    """The step x layer heatmap: one row per pass, one column per layer (block output)."""
    im = _heat(ax, sl, norm, cmap)
    # Labels number passes from 1 (the progress bar's count); the step indices themselves are 0-based.
    ax.set_yticks(range(len(step_labels)), [f"pass {s + 1}" if isinstance(s, numbers.Integral) else str(s)
                                            for s in step_labels], fontsize=FONT_PT)
    ax.set_xticks(range(len(layer_labels)), list(layer_labels), rotation=90, fontsize=FONT_PT)
    ax.set_xlabel("layer (block output)", fontsize=FONT_PT)
    ax.set_ylabel("denoising pass", fontsize=FONT_PT)
    ax.set_title(f"step x layer ({metric})", fontsize=9)
    return im


def _layer_row_heat(ax, shown: np.ndarray, norm, cmap, layer_labels, num_rows: int, k: int, spans):
    """The layer x packed row heatmap (rows binned by `k` within a band when k > 1, ticks in packed rows)."""
    im = _heat(ax, shown, norm, cmap)
    ax.set_yticks(range(len(layer_labels)), list(layer_labels), fontsize=FONT_PT)
    ax.set_ylabel("layer", fontsize=FONT_PT)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    binned = f";\nbins of {k} rows within a modality band, max per bin" if k > 1 else ""
    ax.set_xlabel(f"packed row ({num_rows} rows{binned})", fontsize=FONT_PT)
    if k > 1:  # x ticks in packed rows, at bin positions
        ticks = np.linspace(0, len(spans) - 1, min(6, len(spans))).round().astype(int)
        ax.set_xticks(ticks, [str(spans[t][0]) for t in ticks])
    return im


def _modality_band(ax, bin_mods: Sequence[str], row_step: Any, metric: str) -> str:
    """The categorical band of the columns' modalities above the layer x row heatmap; returns its colour key."""
    names = sorted(set(bin_mods), key=lambda m: list(MODALITY_COLORS).index(m) if m in MODALITY_COLORS else 99)
    codes = np.array([[names.index(m) for m in bin_mods]])
    band_im = ax.imshow(codes, cmap=ListedColormap([MODALITY_COLORS.get(m, "#000000") for m in names]),
                        vmin=-0.5, vmax=len(names) - 0.5, aspect="auto", interpolation="nearest")
    band_im.set_gid("modality-band")  # a categorical key, explained by the legend below, not a heatmap
    ax.set_yticks([])
    ax.tick_params(labelbottom=False, bottom=False)
    where = f" at pass {row_step + 1}" if isinstance(row_step, numbers.Integral) else ""
    ax.set_title(f"layer x packed row{where} ({metric})", fontsize=9)
    return ", ".join(f"{m} {COLOR_NAMES.get(MODALITY_COLORS.get(m, ''), 'black')}" for m in names)


def _mark_first_drift(ax_sl, ax_lr, first: Any, step_labels, layer_labels, row_step: Any,
                      spans) -> tuple[str | None, int | None]:
    """A square on the first drift in both heatmaps (the row one only at its pass); returns (point, layer column)."""
    point, step, packed_row = _point_of(first)
    col = first_drift_layer(point, layer_labels)
    if col is not None and step in list(step_labels):
        row = list(step_labels).index(step)
        ax_sl.plot([col], [row], marker="s", markersize=12, markerfacecolor="none", markeredgewidth=2,
                   color=FIRST_DRIFT_COLOR, linestyle="none")
        if packed_row is not None and step == row_step:
            b = next((i for i, (s0, s1) in enumerate(spans) if s0 <= packed_row < s1), None)
            if b is not None:
                ax_lr.plot([b], [col], marker="s", markersize=9, markerfacecolor="none", markeredgewidth=1.5,
                           color=FIRST_DRIFT_COLOR, linestyle="none")
    return point, col


def _label_to_fit(fig: Figure, colorbars, ax_band, bands, num_columns: int) -> None:
    """After the final layout: colorbar ticks and band labels sized by what fits on the page."""
    fig.canvas.draw()  # the final layout: band widths and colorbar lengths are known now
    renderer = fig.canvas.get_renderer()
    for cb in colorbars:  # one labelled tick per 0.3 in of colorbar at most
        _set_log_ticks(cb, max(2, int(cb.ax.get_window_extent(renderer).height / DPI / 0.3)))
    per_col = ax_band.get_window_extent(renderer).width / max(1, num_columns)
    for start, stop, m in bands:  # a label inside every band wide enough to hold it
        label = ax_band.text((start + stop - 1) / 2, 0, m, ha="center", va="center", fontsize=FONT_PT,
                             color="black", fontweight="bold")
        if label.get_window_extent(renderer).width + 6 > per_col * (stop - start):
            label.remove()


def drift_inputs(report: Any, step: int | None = None, metric: str = "max_abs") -> dict[str, Any]:
    """The keyword arguments of `drift_heatmaps` from a `drift.DriftReport` or its `to_dict()` (metric "max_abs" or
    "rel_l2"; a dict holds the layer x row matrices of its `matrix_step` only)."""
    if metric not in ("max_abs", "rel_l2"):
        raise PlotError(f"drift metric {metric!r}: must be 'max_abs' or 'rel_l2'")
    if isinstance(report, Mapping):
        s = report.get("matrix_step", 0)
        if step is not None and step != s:
            raise PlotError(f"step={step}: a drift report dict holds the layer x row matrix of step {s} (pass {s + 1}) "
                            "only")
        nan = lambda x: np.array(x, dtype=np.float64)  # noqa: E731 - None (JSON NaN) -> nan
        first = report.get("first")
        summary = (f"{report['label_a']} vs {report['label_b']}: " + (
            f"byte-equal at all {report.get('compared')} compared points" if report.get("equal")
            else f"first drift at {_first_drift_text(first)}"))
        return {
            "step_layer": nan(report[f"step_layer_{metric}"]), "layer_row": nan(report[f"layer_row_{metric}"]),
            "step_labels": list(report["step_labels"]), "layer_labels": list(report["layer_labels"]),
            "row_labels": list(report["row_labels"]), "row_step": s, "first": first,
            "metric": "max |a-b|" if metric == "max_abs" else "rel L2", "title": summary,
        }
    sl = report.step_layer_max_abs if metric == "max_abs" else report.step_layer_rel_l2
    s = report.matrix_step if step is None else step
    lr_abs, lr_rel = report.layer_row(s)
    return {
        "step_layer": sl,
        "layer_row": lr_abs if metric == "max_abs" else lr_rel,
        "step_labels": list(report.step_labels),
        "layer_labels": list(report.layer_labels),
        "row_labels": list(report.row_labels),
        "row_step": s,
        "first": report.first,
        "metric": "max |a-b|" if metric == "max_abs" else "rel L2",
        "title": report.summary(),
    }
