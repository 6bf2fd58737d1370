"""Figures of h3lab: pure matplotlib functions that return `matplotlib.figure.Figure`s. No pyplot: every figure is a
`Figure` with its own Agg canvas, so nothing registers in pyplot's global figure list, any thread may draw, and the
caller decides what happens to it (`save`, `png_bytes`, or display in a notebook after `%matplotlib inline`).

Every figure is sized for a notebook cell and a PNG: at most `MAX_WIDTH_IN` x `MAX_HEIGHT_IN` inches (1000 x 1400 px
at the `DPI` of `save`/`png_bytes`), no text below `MIN_FONT_PT` (9.7 px at that DPI), labelled axes, one colorbar per
heatmap. Category tick labels that would overlap are thinned to every k-th one and the axis label says so; long series
are subsampled or paginated and the figure says by which rule.

Figure functions take documented plain inputs (numpy arrays or tensors + labels, reports, row dicts), never a model:

- `latent_strip(video (S, C, T, h, w), audio (S, 2A, Ca) | None, step_labels)`: one mosaic, rows = denoising steps
  (at most `max_rows`: evenly spaced with the first and last kept, or one `page`), columns = latent frames (at most
  `max_frames`, evenly spaced), each frame a PCA-to-RGB of its C channels (24 released, 4 tiny) through ONE basis
  fitted on `basis_step` (default the last step), so a colour means the same latent direction in every row; beside it
  the audio latents of the same rows as an image over time (channel-0 features above channel-1 features) on one
  symmetric colour scale with its colorbar.
- `norm_curves({"latent/video": (S,), "velocity/audio": (S',), ...}, step_labels)`: RMS per step and modality.
- `drift_heatmaps(step_layer (S, L), layer_row (L, R), step_labels, layer_labels, row_labels, first=...)`: log-scale
  heatmaps of a drift metric, step x layer and layer x packed row (rows binned, max per bin, when there are more than
  `max_row_columns`), each with its colorbar, the packed rows' modality bands above the second, the first drift marked
  in the plotted layer that holds it. Exactly 0 (byte-equal) is white, NaN (not captured by both runs) grey; a title
  tells "byte-equal" apart from "nothing comparable" (different prompts or shapes: every plotted point NaN).
- `ablation_table(rows)`: the ablation matrix as a table, one row per dict with `name`, `expected`, `observed`,
  `first_drift` (a `DriftPoint.to_dict()`, text or None) and `passed` (True / False / None); rows are coloured
  green (passed), red (failed) or grey (not run).
- `sigma_grids(video_sigmas, audio_sigmas)`: both grids over the grid index, and the sigma step of every pass.
- `benchmark_summary(docs)` (one ratio bar per benchmark file: median and range over its cases, time relative to the
  file's baseline implementation measured in the same run) and `benchmark_figure(doc)` (one file: per case and
  implementation the time relative to the baseline, or absolute seconds where the file has none, on a linear axis
  from 0, the seconds written on each bar); one colour per implementation in every figure (`impl_colors`).
  `load_benchmarks(folder)` reads a results folder (the DESIGN "Evidence" schema) and reports one problem per skipped
  file; `skipped_line(problems)` says it in one line.

Adapters turn h3lab objects into those inputs: `latent_steps(result | trajectory)`, `step_norms(...)` (they need the
per-step tensors kept: `Session.keep = ("latents", "velocities")` before generating), `drift_inputs(report)`.

`PLOTS` maps a kind to a renderer of the kind's data (no model work):

    latents   a GenerationResult or Trajectory (the newest of a list)
    norms     a GenerationResult or Trajectory (the newest of a list)
    drift     a DriftReport (or its `to_dict()`)
    ablation  the row dicts of `ablation.run_matrix()`
    sigmas    a DualSchedule, a GenerationResult / Trajectory (its schedule), or a list of results (the newest);
              an int N builds the N-pass grids with the session's shifts (the released ones without a session)

`plot(kind, source, session)` is what `!plot KIND PATH` calls; for drift and ablation the command handler computes the
data first (`session.drift(...)`, the ablation rows) and passes the report / rows: the renderers do no model work.

Every bad input raises `PlotError` (an `H3Error`) with one line naming the value and the rule.
"""

from __future__ import annotations

import io
import json
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap, LogNorm
from matplotlib.figure import Figure

from .errors import H3Error
from .io_utils import atomic_write

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


# ============================================================================================== PCA to RGB
@dataclass(frozen=True)
class PCABasis:
    """Three principal directions of latent channels: `mean` (C,), `components` (3, C), display range `lo`, `hi`
    (3,) = 1st and 99th percentile of the projections of the latents the basis was fitted on."""

    mean: np.ndarray
    components: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


def pca_rgb_basis(latents: Any) -> PCABasis:
    """Fit the basis on latents (C, T, h, w): every (frame, y, x) position is one C-vector sample. Signs are fixed
    (largest-magnitude loading positive) so the same latents always give the same colours."""
    x = _array(latents, "latents", 4)
    c = x.shape[0]
    samples = x.reshape(c, -1).T  # (N, C)
    mean = samples.mean(axis=0)
    centred = samples - mean
    _, _, vt = np.linalg.svd(centred, full_matrices=False)  # rows of vt: principal directions, by variance
    comps = np.zeros((3, c))
    k = min(3, vt.shape[0])
    comps[:k] = vt[:k]
    for i in range(k):
        j = int(np.argmax(np.abs(comps[i])))
        if comps[i, j] < 0:
            comps[i] = -comps[i]
    proj = centred @ comps.T  # (N, 3)
    lo, hi = np.percentile(proj, 1, axis=0), np.percentile(proj, 99, axis=0)
    hi = np.where(hi - lo > 1e-12, hi, lo + 1.0)  # a flat direction maps to one colour, not a division by 0
    return PCABasis(mean, comps, lo, hi)


def pca_rgb(latents: Any, basis: PCABasis) -> np.ndarray:
    """Latents (C, T, h, w) -> RGB (T, h, w, 3) in [0, 1] through `basis` (clipped outside its display range)."""
    x = _array(latents, "latents", 4)
    if x.shape[0] != basis.mean.shape[0]:
        raise PlotError(f"latents have {x.shape[0]} channels: the PCA basis was fitted on {basis.mean.shape[0]}")
    c, t, h, w = x.shape
    samples = x.reshape(c, -1).T - basis.mean  # (T*h*w, C)
    rgb = (samples @ basis.components.T - basis.lo) / (basis.hi - basis.lo)
    return np.clip(rgb, 0.0, 1.0).reshape(t, h, w, 3)


def audio_image(rows: Any) -> np.ndarray:
    """Audio latent rows (2A, Ca), channel-major (rows [0, A) channel 0, [A, 2A) channel 1) -> image (2Ca, A):
    time on x, channel-0 features above channel-1 features."""
    a = _array(rows, "audio rows", 2)
    if a.shape[0] % 2:
        raise PlotError(f"audio rows {a.shape}: the row count must be even (two stereo channels)")
    half = a.shape[0] // 2
    return np.concatenate([a[:half].T, a[half:].T], axis=0)


# ============================================================================================ latent strip
def strip_rows(steps: int, max_rows: int, page: int | None = None) -> tuple[list[int], str]:
    """(row indices, the rule in words) for a strip of `steps` rows: all of them when they fit; else, without `page`,
    `max_rows` evenly spaced rows with the first and last kept; with `page` (0-based), rows page*max_rows ... ."""
    if max_rows < 1:
        raise PlotError(f"max_rows={max_rows}: must be at least 1")
    if page is not None:
        pages = math.ceil(steps / max_rows)
        if not 0 <= page < pages:
            raise PlotError(f"page={page}: the {steps} rows make {pages} page(s) of {max_rows} (0-based)")
        rows = list(range(page * max_rows, min(steps, (page + 1) * max_rows)))
        return rows, f"rows {rows[0] + 1}-{rows[-1] + 1} of {steps} (page {page + 1} of {pages})"
    if steps <= max_rows:
        return list(range(steps)), f"all {steps} rows"
    rows = sorted(set(np.linspace(0, steps - 1, max_rows).round().astype(int).tolist()))
    return rows, f"{len(rows)} of {steps} rows, evenly spaced (first and last kept)"


def _mosaic(tiles: list[list[np.ndarray]], gap: int) -> np.ndarray:
    """Row-major tiles (each (h, w, ch)) into one (R*h + gaps, C*w + gaps, ch) array; gaps are NaN."""
    h, w, ch = tiles[0][0].shape
    rows, cols = len(tiles), len(tiles[0])
    out = np.full((rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap, ch), np.nan)
    for r, row in enumerate(tiles):
        for c, tile in enumerate(row):
            out[r * (h + gap): r * (h + gap) + h, c * (w + gap): c * (w + gap) + w] = tile
    return out


def latent_strip(
    video: Any,
    audio: Any = None,
    *,
    step_labels: Sequence[str] | None = None,
    basis_step: int = -1,
    max_frames: int = 12,
    max_rows: int = 8,
    page: int | None = None,
    title: str = "per-step latents",
) -> Figure:
    """Rows = steps (`strip_rows`), columns = latent frames (PCA-to-RGB through one basis fitted on step `basis_step`
    of all S steps) + the audio latents of the same rows with a colorbar.

    video: (S, C, T, h, w); audio: (S, 2A, Ca) rows or None. At most `max_frames` evenly spaced frames are drawn.
    Axes: [video mosaic, audio mosaic, audio colorbar] (the last two only with audio). `fig.h3lab_rows` lists the
    drawn step indices; `ax.h3lab_tiles[r][c]` is the pixel box (y, x, h, w) of drawn row r, frame c in a mosaic
    axes' image (one column in the audio one); gaps between tiles are transparent (video) or NaN (audio)."""
    v = _array(video, "video latents", 5)
    steps = v.shape[0]
    if steps == 0:
        raise PlotError("video latents have 0 steps: nothing to draw")
    labels = list(step_labels) if step_labels is not None else [f"step {i}" for i in range(steps)]
    if len(labels) != steps:
        raise PlotError(f"{len(labels)} step labels for {steps} steps")
    aud = None
    if audio is not None:
        aud = _array(audio, "audio latents", 3)
        if aud.shape[0] != steps:
            raise PlotError(f"audio latents have {aud.shape[0]} steps, video latents {steps}")
    if not -steps <= basis_step < steps:
        raise PlotError(f"basis_step={basis_step}: must index one of the {steps} steps")
    rows, rule = strip_rows(steps, max_rows, page)
    _, _, num_frames, h, w = v.shape
    frames = sorted(set(np.linspace(0, num_frames - 1, min(num_frames, max(1, max_frames))).round().astype(int)))
    basis = pca_rgb_basis(v[basis_step])
    gap = max(1, round(0.1 * max(h, w)))

    rgb = {r: pca_rgb(v[r], basis) for r in rows}
    mosaic = _mosaic([[rgb[r][f] for f in frames] for r in rows], gap)
    alpha = np.where(np.isnan(mosaic[..., :1]), 0.0, 1.0)  # gaps transparent (the white figure shows through)
    mosaic = np.concatenate([np.nan_to_num(mosaic), alpha], axis=-1)

    # Size: frame tiles of at most 0.9 in, rows of at least 0.32 in (one line of row label), the audio panel ~30 %.
    audio_w = 3.0 if aud is not None else 0.0
    tile_w = min(0.9, max(0.3, (MAX_WIDTH_IN - 1.9 - audio_w) / len(frames)))
    row_h = max(0.32, tile_w * h / w)
    width = 1.9 + tile_w * len(frames) + audio_w
    height = 1.3 + row_h * len(rows)
    fig = new_figure(width, height)
    if aud is not None:
        grid = fig.add_gridspec(1, 2, width_ratios=[tile_w * len(frames), audio_w])
        ax = fig.add_subplot(grid[0, 0])
    else:
        ax = fig.add_subplot(1, 1, 1)
    ax.imshow(mosaic, interpolation="nearest", aspect="auto")
    ax.h3lab_tiles = [[(r_i * (h + gap), c_i * (w + gap), h, w) for c_i in range(len(frames))]
                      for r_i in range(len(rows))]
    ax.set_yticks([i * (h + gap) + (h - 1) / 2 for i in range(len(rows))], [labels[r] for r in rows],
                  fontsize=FONT_PT)
    ax.set_xticks([i * (w + gap) + (w - 1) / 2 for i in range(len(frames))], [str(f) for f in frames],
                  fontsize=FONT_PT)
    frames_rule = f"{len(frames)} of {num_frames}, evenly spaced" if len(frames) < num_frames else f"all {num_frames}"
    ax.set_xlabel(f"latent frame ({frames_rule})", fontsize=FONT_PT)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)

    if aud is not None:
        imgs = [audio_image(aud[r]) for r in rows]
        vmax = float(np.percentile(np.abs(audio_image(aud[basis_step])), 99)) or 1.0  # one scale for every row
        a_gap = max(1, round(0.1 * imgs[0].shape[0]))
        a_mosaic = _mosaic([[im[..., None]] for im in imgs], a_gap)[..., 0]
        ax_a = fig.add_subplot(grid[0, 1], sharey=None)
        import matplotlib

        cmap = matplotlib.colormaps["RdBu_r"].with_extremes(bad="white")
        im = ax_a.imshow(np.ma.masked_invalid(a_mosaic), cmap=cmap, vmin=-vmax, vmax=vmax, aspect="auto",
                         interpolation="nearest")
        ca = imgs[0].shape[0]
        ax_a.h3lab_tiles = [[(i * (ca + a_gap), 0, ca, imgs[0].shape[1])] for i in range(len(rows))]
        ax_a.set_yticks([i * (ca + a_gap) + (ca - 1) / 2 for i in range(len(rows))], [""] * len(rows))
        for i in range(len(rows)):  # the ch0 | ch1 boundary inside every row
            ax_a.axhline(i * (ca + a_gap) + ca / 2 - 0.5, color="black", linewidth=0.5, linestyle=":")
        ax_a.set_xlabel(f"audio latent index ({imgs[0].shape[1]} per row, 40 per second)", fontsize=FONT_PT)
        ax_a.set_ylabel("ch0 features | ch1 features, per row", fontsize=FONT_PT)
        ax_a.tick_params(labelsize=FONT_PT, length=2)
        cb = fig.colorbar(im, ax=ax_a, fraction=0.08, pad=0.02)
        cb.set_label("audio latent value", fontsize=FONT_PT)
        cb.ax.tick_params(labelsize=FONT_PT)
        ax_a.set_title("audio latents", fontsize=9)
    ax.set_title("video latents (PCA of the channels to RGB)", fontsize=9)
    fig.h3lab_rows = rows
    fig.suptitle(f"{title}: {rule}; one PCA basis from {labels[basis_step]}", fontsize=10)
    return fig  # no `finish`: rows of at least 0.32 in and tiles of at least 0.3 in keep every label apart


# ==================================================================================================== norms
def norm_curves(
    norms: Mapping[str, Any], *, step_labels: Sequence[str] | None = None, title: str = "RMS per step"
) -> Figure:
    """Line plots of per-step norms. Keys are "latent/<modality>" and "velocity/<modality>" (1-D arrays over
    steps; latents may carry one more point than velocities, the initial noise). One axes per kind, one line per
    modality. `step_labels` label the x axis of the longest series."""
    kinds: dict[str, dict[str, np.ndarray]] = {}
    for key, values in norms.items():
        kind, _, modality = key.partition("/")
        if kind not in ("latent", "velocity") or not modality:
            raise PlotError(f"norm series {key!r}: keys must be 'latent/<modality>' or 'velocity/<modality>'")
        kinds.setdefault(kind, {})[modality] = _array(values, key, 1)
    if not kinds:
        raise PlotError("no norm series given")
    order = [k for k in ("latent", "velocity") if k in kinds]
    fig = new_figure(5.0 * len(order), 3.4)
    longest = max(len(a) for series in kinds.values() for a in series.values())
    for i, kind in enumerate(order):
        ax = fig.add_subplot(1, len(order), i + 1)
        for modality, values in kinds[kind].items():
            # Velocities exist from the first pass on: align their x with the latents after that pass.
            x = np.arange(longest - len(values), longest)
            ax.plot(x, values, marker="o", label=modality, color=MODALITY_COLORS.get(modality))
        ax.set_title(f"{kind} RMS", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("RMS")
        if step_labels is not None:
            if len(step_labels) != longest:
                raise PlotError(f"{len(step_labels)} step labels for {longest} steps")
            ax.set_xticks(np.arange(longest), list(step_labels), rotation=30, fontsize=FONT_PT, ha="right")
        ax.legend(fontsize=FONT_PT)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return finish(fig)


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
    sl = _array(step_layer, "step x layer matrix", 2)
    lr = _array(layer_row, "layer x row matrix", 2)
    if sl.shape != (len(step_labels), len(layer_labels)):
        raise PlotError(f"step x layer matrix {sl.shape}: labels say ({len(step_labels)}, {len(layer_labels)})")
    if lr.shape != (len(layer_labels), len(row_labels)):
        raise PlotError(f"layer x row matrix {lr.shape}: labels say ({len(layer_labels)}, {len(row_labels)})")
    mods = list(modalities) if modalities is not None else row_modalities(row_labels)
    if len(mods) != lr.shape[1]:
        raise PlotError(f"{len(mods)} row modalities for {lr.shape[1]} packed rows")
    norm = _log_norm(sl, lr)
    cmap = _drift_cmap()
    shown, bin_mods, spans, k = bin_rows(lr, mods, max_row_columns)
    layers, passes = len(layer_labels), len(step_labels)
    fig = new_figure(MAX_WIDTH_IN, min(MAX_HEIGHT_IN, max(4.4, 2.6 + 0.2 * max(layers, passes))))
    left = min(0.45, max(0.24, 0.06 * layers))  # the step x layer share of the width
    grid = fig.add_gridspec(2, 2, width_ratios=[left, 1 - left], height_ratios=[0.09, 1.0])
    ax_sl = fig.add_subplot(grid[1, 0])
    im = _heat(ax_sl, sl, norm, cmap)
    ax_sl.set_yticks(range(passes), [f"pass {s}" for s in step_labels], fontsize=FONT_PT)
    ax_sl.set_xticks(range(layers), list(layer_labels), rotation=90, fontsize=FONT_PT)
    ax_sl.set_xlabel("layer (block output)", fontsize=FONT_PT)
    ax_sl.set_ylabel("denoising pass", fontsize=FONT_PT)
    ax_sl.set_title(f"step x layer ({metric})", fontsize=9)

    ax_lr = fig.add_subplot(grid[1, 1])
    im_lr = _heat(ax_lr, shown, norm, cmap)
    ax_lr.set_yticks(range(layers), list(layer_labels), fontsize=FONT_PT)
    ax_lr.set_ylabel("layer", fontsize=FONT_PT)
    ax_lr.tick_params(axis="x", labelsize=FONT_PT)
    binned = f";\nbins of {k} rows within a modality band, max per bin" if k > 1 else ""
    ax_lr.set_xlabel(f"packed row ({len(row_labels)} rows{binned})", fontsize=FONT_PT)
    if k > 1:  # x ticks in packed rows, at bin positions
        ticks = np.linspace(0, len(spans) - 1, min(6, len(spans))).round().astype(int)
        ax_lr.set_xticks(ticks, [str(spans[t][0]) for t in ticks])
    bands = _bands(bin_mods)
    for start, _stop, _m in bands[1:]:
        ax_lr.axvline(start - 0.5, color="black", linewidth=0.8)

    ax_band = fig.add_subplot(grid[0, 1], sharex=ax_lr)
    names = sorted(set(bin_mods), key=lambda m: list(MODALITY_COLORS).index(m) if m in MODALITY_COLORS else 99)
    codes = np.array([[names.index(m) for m in bin_mods]])
    band_im = ax_band.imshow(codes, cmap=ListedColormap([MODALITY_COLORS.get(m, "#000000") for m in names]),
                             vmin=-0.5, vmax=len(names) - 0.5, aspect="auto", interpolation="nearest")
    band_im.set_gid("modality-band")  # a categorical key, explained by the legend below, not a heatmap
    ax_band.set_yticks([])
    ax_band.tick_params(labelbottom=False, bottom=False)
    where = f" at pass {row_step}" if row_step is not None else ""
    key = ", ".join(f"{m} {COLOR_NAMES.get(MODALITY_COLORS.get(m, ''), 'black')}" for m in names)
    ax_band.set_title(f"layer x packed row{where} ({metric})", fontsize=9)

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
    colorbars = [_log_colorbar(fig, im, ax_sl, metric), _log_colorbar(fig, im_lr, ax_lr, metric)]
    legend = f"white: byte-equal (0), grey: not captured by both runs; band: modality of the rows ({key})"
    if col is not None:
        legend += f"; pink square: the first drift ({point}, in layer column {layer_labels[col]})"
    fig.supxlabel(_wrap(legend, 150), fontsize=FONT_PT)
    state = drift_state(sl, lr)
    fig.suptitle(_wrap(title + (f" -- {state}" if state else ""), 130), fontsize=10)

    fig.canvas.draw()  # the final layout: band widths and colorbar lengths are known now
    renderer = fig.canvas.get_renderer()
    for cb in colorbars:  # one labelled tick per 0.3 in of colorbar at most
        _set_log_ticks(cb, max(2, int(cb.ax.get_window_extent(renderer).height / DPI / 0.3)))
    per_col = ax_band.get_window_extent(renderer).width / max(1, len(bin_mods))
    for start, stop, m in bands:  # a label inside every band wide enough to hold it
        label = ax_band.text((start + stop - 1) / 2, 0, m, ha="center", va="center", fontsize=FONT_PT,
                             color="black", fontweight="bold")
        if label.get_window_extent(renderer).width + 6 > per_col * (stop - start):
            label.remove()
    return finish(fig)


def drift_inputs(report: Any, step: int | None = None, metric: str = "max_abs") -> dict[str, Any]:
    """The keyword arguments of `drift_heatmaps` from a `drift.DriftReport` or its `to_dict()` (metric "max_abs" or
    "rel_l2"; a dict holds the layer x row matrices of its `matrix_step` only)."""
    if metric not in ("max_abs", "rel_l2"):
        raise PlotError(f"drift metric {metric!r}: must be 'max_abs' or 'rel_l2'")
    if isinstance(report, Mapping):
        s = report.get("matrix_step", 0)
        if step is not None and step != s:
            raise PlotError(f"step={step}: a drift report dict holds the layer x row matrix of pass {s} only")
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


# ================================================================================================= ablation
def _first_drift_text(fd: Any) -> str:
    if fd is None:
        return "-"
    if isinstance(fd, str):
        return fd
    if isinstance(fd, Mapping):
        where = f"pass {fd.get('step')} {fd.get('point')}"
        if fd.get("packed_row") is not None:
            where += f" row {fd['packed_row']} ({fd.get('modality')})"
        elif fd.get("table_row") is not None:
            where += f" table row {fd['table_row']} ({fd.get('modality')})"
        return where
    return str(fd)


def _row_get(row: Any, key: str, default: Any = None) -> Any:
    return row.get(key, default) if isinstance(row, Mapping) else getattr(row, key, default)


ABLATION_COLUMNS = ("row", "mode", "expected", "observed", "first drift", "result")
ABLATION_WRAP = (5, 6, 30, 58, 26, 7)  # characters per line of each column


def ablation_table(rows: Sequence[Any], *, title: str = "ablation matrix") -> Figure:
    """The matrix as a table (columns `ABLATION_COLUMNS`, text at `FONT_PT`, wrapped to `ABLATION_WRAP` characters);
    every cell of a row is coloured by `passed`: green `PASS_COLOR` (True), red `FAIL_COLOR` (False), grey
    `NOT_RUN_COLOR` (None: not run)."""
    if not rows:
        raise PlotError("no ablation rows to draw")
    text, colours, heights = [], [], []
    for r in rows:
        for key in ("name", "expected", "observed", "passed"):
            if isinstance(r, Mapping) and key not in r:
                raise PlotError(f"ablation row {r.get('name', r)!r}: lacks {key!r}")
        passed = _row_get(r, "passed")
        result = {True: "PASS", False: "FAIL", None: "not run"}.get(passed, str(passed))
        cells = [_row_get(r, "name"), _row_get(r, "mode", "-"), _row_get(r, "expected"), _row_get(r, "observed"),
                 _first_drift_text(_row_get(r, "first_drift")), result]
        wrapped = [_wrap(c, w) for c, w in zip(cells, ABLATION_WRAP)]
        text.append(wrapped)
        colour = {True: PASS_COLOR, False: FAIL_COLOR}.get(passed, NOT_RUN_COLOR)
        colours.append([colour] * len(cells))
        heights.append(max(c.count("\n") + 1 for c in wrapped))
    line_in = FONT_PT * 1.45 / 72  # one text line with its leading, inches
    pad_in = 0.06  # above and below the text of a cell
    total_in = sum(h * line_in + 2 * pad_in for h in [1] + heights)
    fig = new_figure(MAX_WIDTH_IN, total_in + 0.55)
    fig.get_layout_engine().set(h_pad=0.02, w_pad=0.02)
    ax = fig.add_subplot(1, 1, 1)
    ax.axis("off")
    table = ax.table(cellText=text, colLabels=list(ABLATION_COLUMNS), cellColours=colours, loc="upper center",
                     cellLoc="left", colWidths=[w / sum(ABLATION_WRAP) for w in ABLATION_WRAP], bbox=[0, 0, 1, 1])
    table.auto_set_font_size(False)
    table.set_fontsize(FONT_PT)
    for (r, _c), cell in table.get_celld().items():
        lines = 1 if r == 0 else heights[r - 1]
        cell.set_height((lines * line_in + 2 * pad_in) / total_in)
        cell.PAD = 0.02
        if r == 0:
            cell.set_text_props(weight="bold")
    passed = sum(_row_get(r, "passed") is True for r in rows)
    failed = sum(_row_get(r, "passed") is False for r in rows)
    fig.suptitle(f"{title}: {passed} passed, {failed} failed, {len(rows) - passed - failed} not run", fontsize=10)
    return finish(fig)


# =================================================================================================== sigmas
def sigma_grids(
    video_sigmas: Any,
    audio_sigmas: Any,
    *,
    video_shift: float | None = None,
    audio_shift: float | None = None,
    title: str = "sigma grids",
) -> Figure:
    """Axes [grids, steps]: sigma over the grid index for both schedules; and the sigma each pass removes
    (sigma_i - sigma_{i+1}) as grouped bars."""
    v = _array(video_sigmas, "video sigmas", 1)
    a = _array(audio_sigmas, "audio sigmas", 1)
    if len(v) < 2 or len(a) < 2:
        raise PlotError(f"sigma grids of {len(v)} and {len(a)} points: need at least 2 each")
    vl = "video" + (f" (shift {video_shift:g})" if video_shift is not None else "")
    al = "audio" + (f" (shift {audio_shift:g})" if audio_shift is not None else "")
    fig = new_figure(10.0, 3.6)
    ax = fig.add_subplot(1, 2, 1)
    ax.plot(np.arange(len(v)), v, marker="o", label=vl, color=MODALITY_COLORS["video"])
    ax.plot(np.arange(len(a)), a, marker="s", label=al, color=MODALITY_COLORS["audio"])
    ax.set_xticks(np.arange(max(len(v), len(a))))
    ax.set_xlabel("grid point")
    ax.set_ylabel("sigma")
    ax.set_title(f"{len(v)} grid points, {len(v) - 1} passes", fontsize=9)
    ax.legend(fontsize=FONT_PT)
    ax.grid(alpha=0.3)
    ax2 = fig.add_subplot(1, 2, 2)
    dv, da = v[:-1] - v[1:], a[:-1] - a[1:]
    x = np.arange(max(len(dv), len(da)))
    ax2.bar(x[: len(dv)] - 0.2, dv, width=0.4, label=vl, color=MODALITY_COLORS["video"])
    ax2.bar(x[: len(da)] + 0.2, da, width=0.4, label=al, color=MODALITY_COLORS["audio"])
    ax2.set_xticks(x)
    ax2.set_xlabel("pass")
    ax2.set_ylabel("sigma_i - sigma_i+1")
    ax2.set_title("sigma removed per pass", fontsize=9)
    ax2.legend(fontsize=FONT_PT)
    fig.suptitle(title, fontsize=10)
    return finish(fig)


# =============================================================================================== benchmarks
def load_benchmarks(folder: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """Read every `*.json` in `folder` (sorted by name). Returns (documents that follow the schema, with the result
    entries that do; one line per file that was skipped or partly skipped: "NAME: why", e.g. "x.json: 84 results
    lack shape, impl"). A document none of whose results follows the schema is skipped whole. A missing or empty folder gives ([], [one line]): never an error.
    Result entries with an `error` instead of timings are kept (drawn as failures)."""
    root = Path(folder)
    if not root.is_dir():
        return [], [f"{root}: no such folder (no benchmark results yet)"]
    docs, problems = [], []
    for path in sorted(root.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            problems.append(f"{path.name}: not readable JSON ({str(err).splitlines()[0]})")
            continue
        if not isinstance(doc, dict):
            problems.append(f"{path.name}: top level is {type(doc).__name__}, not an object")
            continue
        missing = [k for k in BENCHMARK_KEYS if k not in doc]
        if missing or not isinstance(doc.get("results"), list):
            problems.append(f"{path.name}: lacks {', '.join(missing) or 'a results list'}")
            continue
        kept, lacking_keys = [], {}
        for entry in doc["results"]:
            need = ("shape", "impl", "error") if isinstance(entry, dict) and "error" in entry else BENCHMARK_RESULT_KEYS
            lacking = [k for k in need if not isinstance(entry, dict) or k not in entry]
            if lacking:
                for k in lacking:
                    lacking_keys[k] = lacking_keys.get(k, 0) + 1
                continue
            kept.append(entry)
        total = len(doc["results"])
        if total and len(kept) < total:
            what = f"{total} results" if not kept else f"{total - len(kept)} of {total} results"
            problems.append(f"{path.name}: {what} lack {', '.join(lacking_keys)}")
        if kept or not total:
            docs.append({**doc, "results": kept, "file": path.name})
    if not docs and not problems:
        problems.append(f"{root}: no *.json results yet")
    return docs, problems


def skipped_line(problems: Sequence[str]) -> str:
    """The problems of `load_benchmarks` in one line ("" when none)."""
    if not problems:
        return ""
    return "skipped (not in the DESIGN schema): " + "; ".join(problems)


_CASE_KEYS = ("proj", "op", "product", "case", "pass", "what", "metric", "rows", "factor_dtype", "fp32_variant", "gc",
              "precision", "split")  # `backend` goes with the impl


def case_labels(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """One label per result entry that tells the cases of a file apart: the shape plus every descriptive key
    (`_CASE_KEYS`; `rows` as "N rows") whose value varies within the file, a repeated value said once; entries of
    one implementation that would still share a label get " #2", " #3", ..."""
    varying = [k for k in _CASE_KEYS if len({str(e.get(k)) for e in results}) > 1]
    labels = []
    for e in results:
        parts = [str(e["shape"])] if "shape" in e else []
        for k in varying:
            value = f"{e.get(k)} rows" if k == "rows" else str(e.get(k, "-"))
            if k == "split" and k in e:
                value = "split" if e[k] else "one program"
            if value not in parts:
                parts.append(value)
        labels.append(" ".join(parts) or "?")
    seen: dict[tuple[str, str], int] = {}
    out = []
    for label, e in zip(labels, results):
        key = (label, str(e.get("impl")))
        seen[key] = seen.get(key, 0) + 1
        out.append(label if seen[key] == 1 else f"{label} #{seen[key]}")
    return out


def impl_colors(docs: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """implementation -> colour, the same in every benchmark figure (`IMPL_COLORS`, then tab10 by name)."""
    import matplotlib

    impls = sorted({str(e["impl"]) for d in docs for e in d["results"]})
    free = [c for c in (matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab10"].colors)
            if c not in IMPL_COLORS.values()]
    out, i = {}, 0
    for impl in impls:
        if impl in IMPL_COLORS:
            out[impl] = IMPL_COLORS[impl]
        else:
            out[impl] = free[i % len(free)]
            i += 1
    return out


def baseline_impl(doc: Mapping[str, Any]) -> str | None:
    """The implementation a file's times are divided by: the first of `BASELINE_IMPLS` it has that timed a case
    another implementation timed too, else None (then its figure shows seconds). None for a document labelled
    "bytes only" (shared-device ranks: its times are host-staged, never scaling)."""
    if str(doc.get("label", "")).startswith("bytes only"):  # shared-device runs: times are never a ratio
        return None
    results = doc["results"]
    cases: dict[str, set[str]] = {}
    for label, e in zip(case_labels(results), results):
        if _median(e) is not None:
            cases.setdefault(str(e["impl"]), set()).add(label.split(" #")[0])
    for base in BASELINE_IMPLS:
        if base in cases and any(cases[base] & c for impl, c in cases.items() if impl != base):
            return base
    return None


def _median(e: Mapping[str, Any]) -> float | None:
    m = e.get("median_s")
    return float(m) if isinstance(m, (int, float)) and not isinstance(m, bool) and math.isfinite(m) else None


def benchmark_rows(docs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows (benchmark, file, case, impl, median_s, baseline, ratio = median / the baseline's median of the same
    case in the same file, vs_diffusers, peak GiB, error) for a text table; a value that does not exist is None."""
    out = []
    for doc in docs:
        labels = case_labels(doc["results"])
        base_impl = baseline_impl(doc)
        base: dict[str, float] = {}
        for label, e in zip(labels, doc["results"]):
            if str(e["impl"]) == base_impl and _median(e) is not None:
                base.setdefault(label.split(" #")[0], _median(e))
        for label, e in zip(labels, doc["results"]):
            med = _median(e)
            ref = base.get(label.split(" #")[0])
            ratio = med / ref if med is not None and ref else None
            peak = e.get("peak_mem_gib")
            out.append({
                "benchmark": doc["name"], "file": doc.get("file", ""), "case": label, "impl": e["impl"],
                "median_s": med, "baseline": base_impl, "ratio": ratio,
                "vs_diffusers": ratio if base_impl == "diffusers" else None,
                "peak_mem_gib": float(peak) if isinstance(peak, (int, float)) and math.isfinite(peak) else None,
                "error": e.get("error"),
            })
    return out


def _seconds(x: float) -> str:
    return f"{x * 1e3:.3g} ms" if x < 1 else f"{x:.3g} s"


def benchmark_figure(doc: Mapping[str, Any], *, colors: Mapping[str, str] | None = None,
                     max_cases: int = 48, page: int = 0) -> Figure:
    """One benchmark file: a horizontal bar per (case, implementation). With a baseline (`baseline_impl`) the bar is
    time / the baseline's time of the same case, measured in the same run (a line at 1); without one it is the
    median time in seconds. Both on a linear axis from 0; every bar is labelled with its seconds; failed entries are
    marked "x" at 0. More than `max_cases` cases are split into pages (`page`, 0-based; the title says which)."""
    colors = dict(colors or impl_colors([doc]))
    rows = benchmark_rows([doc])
    base = baseline_impl(doc)
    cases = list(dict.fromkeys(r["case"].split(" #")[0] if base else r["case"] for r in rows))
    pages = max(1, math.ceil(len(cases) / max_cases))
    if not 0 <= page < pages:
        raise PlotError(f"page={page}: {doc.get('file', doc['name'])} has {pages} page(s) of {max_cases} cases")
    cases = cases[page * max_cases:(page + 1) * max_cases]
    impls = [i for i in dict.fromkeys(str(r["impl"]) for r in rows) if i != base]
    if base is None:
        impls = list(dict.fromkeys(str(r["impl"]) for r in rows))
    case_of = (lambda r: r["case"].split(" #")[0]) if base else (lambda r: r["case"])
    per_case = {c: [i for i in impls if any(case_of(r) == c and str(r["impl"]) == i for r in rows)] for c in cases}
    widest = max(len(v) for v in per_case.values())
    fig = new_figure(MAX_WIDTH_IN, 1.4 + 0.26 * len(cases) * max(1, widest) ** 0.6)
    ax = fig.add_subplot(1, 1, 1)
    top = 0.0
    for impl in impls:
        ys, xs, hs, texts, fails = [], [], [], [], []
        for r in rows:
            case = case_of(r)
            if str(r["impl"]) != impl or case not in cases:
                continue
            present = per_case[case]  # bars of the implementations this case has, side by side
            bar_h = 0.8 / len(present)
            y = cases.index(case) - 0.4 + bar_h * (present.index(impl) + 0.5)
            value = r["ratio"] if base else r["median_s"]
            if r["error"] or value is None:
                fails.append(y)
                continue
            ys.append(y)
            xs.append(value)
            hs.append(bar_h)
            texts.append(f"{value:.3g}x ({_seconds(r['median_s'])})" if base else _seconds(value))
        ax.barh(ys, xs, height=hs, color=colors[impl], label=impl)
        for y, x, t in zip(ys, xs, texts):
            ax.text(x, y, " " + t, va="center", ha="left", fontsize=FONT_PT)
        if fails:
            ax.plot([0.0] * len(fails), fails, "x", color="red", markersize=7, label=f"{impl} failed")
        top = max([top] + xs)
    if base:
        ax.axvline(1.0, color=colors.get(base, "black"), linewidth=1.2, linestyle="--", label=f"{base} = 1")
        ax.set_xlabel(f"time / {base} time of the same case, same run (linear, from 0)", fontsize=FONT_PT)
    else:
        ax.set_xlabel("median time, seconds (linear, from 0)", fontsize=FONT_PT)
    ax.set_xlim(0, max(top, 1.0 if base else 0.0) * 1.35 or 1.0)  # room for the bar labels
    ax.set_yticks(range(len(cases)), cases, fontsize=FONT_PT)
    ax.set_ylim(len(cases) - 0.5, -0.5)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=FONT_PT, loc="lower right")
    part = f" (page {page + 1} of {pages})" if pages > 1 else ""
    bytes_only = " - BYTES ONLY (shared device), not scaling" if str(doc.get("label", "")).startswith(
        "bytes only") else ""
    fig.suptitle(_wrap(f"{doc['name']} ({doc.get('file', '')}){part}{bytes_only} - {doc['gpu']} - "
                       f"torch {doc['torch']} triton {doc['triton']} - rev {str(doc['git_rev'])[:10]} - "
                       f"{doc['date']}", 120), fontsize=9)
    return finish(fig)


def benchmark_figures(docs: Sequence[Mapping[str, Any]], max_cases: int = 48) -> list[Figure]:
    """`benchmark_figure` of every document (every page), one colour per implementation across all of them."""
    colors = impl_colors(docs)
    out = []
    for doc in docs:
        cases = len(set(r["case"].split(" #")[0] for r in benchmark_rows([doc])))
        for page in range(max(1, math.ceil(cases / max_cases))):
            out.append(benchmark_figure(doc, colors=colors, max_cases=max_cases, page=page))
    return out


def benchmark_summary(docs: Sequence[Mapping[str, Any]], *, title: str = "benchmarks") -> Figure:
    """One row per (benchmark file, implementation other than the file's baseline): the median over the file's cases
    of time / baseline time of the same case (same run), a line from the smallest to the largest ratio, on a linear
    axis from 0 with a line at 1. Files without a baseline are listed by name below the axes. With no documents, one
    axes that says so."""
    if not docs:
        fig = new_figure(6.0, 2.0)
        ax = fig.add_subplot(1, 1, 1)
        ax.axis("off")
        ax.text(0.5, 0.5, "no benchmark results yet", ha="center", va="center", fontsize=11)
        fig.suptitle(title, fontsize=10)
        return fig
    colors = impl_colors(docs)
    entries, no_base = [], []
    for doc in docs:
        base = baseline_impl(doc)
        rows = benchmark_rows([doc])
        if base is None:
            no_base.append(doc.get("file", doc["name"]))
            continue
        for impl in dict.fromkeys(str(r["impl"]) for r in rows):
            ratios = [r["ratio"] for r in rows if str(r["impl"]) == impl and r["ratio"] is not None]
            if impl != base and ratios:
                entries.append((f"{doc['name']} ({doc.get('file', '')}) vs {base}", impl, ratios))
    fig = new_figure(MAX_WIDTH_IN, 1.6 + 0.3 * max(1, len(entries)))
    ax = fig.add_subplot(1, 1, 1)
    labels = []
    for y, (label, impl, ratios) in enumerate(entries):
        med = float(np.median(ratios))
        ax.barh([y], [med], color=colors[impl], height=0.7, label=impl if impl not in ax.get_legend_handles_labels()[1] else None)
        ax.plot([min(ratios), max(ratios)], [y, y], color="black", linewidth=1)
        ax.text(max(ratios), y, f"  median {med:.3g}x over {len(ratios)} case(s), {min(ratios):.3g}-{max(ratios):.3g}",
                va="center", fontsize=FONT_PT)
        labels.append(label)
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks(range(len(labels)), labels, fontsize=FONT_PT)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    top = max([1.0] + [max(r) for _, _, r in entries])
    ax.set_xlim(0, top * 1.6)
    ax.set_xlabel("time / baseline time of the same case, same run (bar: median over cases, line: range; 1 = baseline)",
                  fontsize=FONT_PT)
    ax.tick_params(axis="x", labelsize=FONT_PT)
    ax.grid(alpha=0.3, axis="x")
    if entries:
        ax.legend(fontsize=FONT_PT, loc="lower right")
    if no_base:
        fig.supxlabel(_wrap("no baseline implementation (absolute times in their own figures): " + ", ".join(no_base),
                            110), fontsize=FONT_PT)
    fig.suptitle(title, fontsize=10)
    return finish(fig)


# ================================================================================================ adapters
@dataclass(frozen=True)
class LatentSteps:
    """Per-step target latents of one run: video (S, C, T, h, w), audio (S, 2A, Ca) float32 numpy, labels (S,)."""

    video: np.ndarray
    audio: np.ndarray | None
    step_labels: list[str]


def _newest(source: Any, what: str) -> Any:
    if isinstance(source, (list, tuple)):
        if not source:
            raise PlotError(f"!plot {what}: no generation yet")
        return source[-1]
    return source


def _trajectory(source: Any) -> Any:
    traj = getattr(source, "trajectory", None)
    if traj is not None:
        return traj
    if hasattr(source, "manifest") and hasattr(source, "kept"):
        return source
    raise PlotError(f"{type(source).__name__}: expected a GenerationResult or a Trajectory")


def _geometry(source: Any, traj: Any) -> tuple[int, int, int, tuple[int, int, int]]:
    """(latent frames, latent height, latent width, patch size) of the target video."""
    s = getattr(source, "settings", None)
    layout = getattr(source, "layout", None)
    if s is not None and layout is not None:
        return s.num_latent_frames, s.latent_height, s.latent_width, tuple(layout.patch_size)
    from .settings import VAE_SPATIAL_RATIO, latent_frames

    meta = traj.manifest.get("meta", {}).get("settings")
    cfg = traj.manifest.get("checkpoint", {}).get("config", {})
    if not meta or "patch_size" not in cfg:
        raise PlotError("trajectory manifest lacks the request settings or the model's patch size: cannot unpack rows")
    width, height = meta["canvas"]
    return (latent_frames(int(meta["num_frames"])), height // VAE_SPATIAL_RATIO, width // VAE_SPATIAL_RATIO,
            tuple(cfg["patch_size"]))


def _kept(traj: Any, prefix: str, steps: int) -> list:
    keys = [f"{prefix}.{i:04d}" for i in range(steps)]
    missing = [k for k in keys if k not in traj.kept]
    if missing:
        raise PlotError(
            f"the trajectory kept no {prefix!r} tensors for pass(es) {', '.join(k.split('.')[-1] for k in missing[:4])}: "
            "set Session.keep = ('latents', 'velocities') before generating"
        )
    return [traj.kept[k] for k in keys]


def latent_steps(source: Any, include_initial: bool = True) -> LatentSteps:
    """Target video latents (unpacked to (C, T, h, w)) and target audio rows after every pass of a result or
    trajectory that kept its latents; with `include_initial` the sealed initial noise comes first ("noise")."""
    from .components.video_vae import unpatchify

    source = _newest(source, "latents")
    traj = _trajectory(source)
    steps = traj.steps
    frames, lh, lw, patch = _geometry(source, traj)
    nv, na = traj.inputs.num_condition_video_rows, traj.inputs.num_condition_audio_rows
    video = _kept(traj, "video", len(steps))
    audio = _kept(traj, "audio", len(steps))
    sigmas = traj.schedule.video.sigmas.tolist()  # latents after pass i sit at sigma_{i+1}
    labels = [f"pass {s['index']} (sigma {sigmas[s['index'] + 1]:.3f})" for s in steps]
    if include_initial:
        video = [traj.inputs.video] + video
        audio = [traj.inputs.audio] + audio
        labels = ["noise"] + labels
    v = np.stack([unpatchify(x[0, nv:].float().cpu(), frames, lh, lw, patch).numpy() for x in video])
    a = np.stack([x[0, na:].float().cpu().numpy() for x in audio])
    return LatentSteps(v, a, labels)


def step_norms(source: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    """({"latent/video", "latent/audio", "velocity/video", "velocity/audio"} -> RMS per step over the target rows,
    step labels of the latent series: "noise", "pass 0", ... (latents after each pass; velocities of each pass))."""
    source = _newest(source, "norms")
    traj = _trajectory(source)
    n = len(traj.steps)
    nv, na = traj.inputs.num_condition_video_rows, traj.inputs.num_condition_audio_rows

    def rms(xs, skip):
        return np.array([float(x[0, skip:].double().pow(2).mean().sqrt()) for x in xs])

    norms = {
        "latent/video": rms([traj.inputs.video] + _kept(traj, "video", n), nv),
        "latent/audio": rms([traj.inputs.audio] + _kept(traj, "audio", n), na),
        "velocity/video": rms(_kept(traj, "velocity_video", n), nv),
        "velocity/audio": rms(_kept(traj, "velocity_audio", n), na),
    }
    return norms, ["noise"] + [f"pass {i}" for i in range(n)]


# =================================================================================================== PLOTS
def _plot_latents(source: Any, session: Any = None) -> Figure:
    steps = latent_steps(source)
    return latent_strip(steps.video, steps.audio, step_labels=steps.step_labels)


def _plot_norms(source: Any, session: Any = None) -> Figure:
    norms, labels = step_norms(source)
    return norm_curves(norms, step_labels=labels)


def _plot_drift(source: Any, session: Any = None) -> Figure:
    if isinstance(source, (list, tuple)):
        raise PlotError("!plot drift renders a DriftReport: compute it with session.drift(a, b) and pass it")
    if not (hasattr(source, "step_layer_max_abs") or isinstance(source, Mapping) and "step_layer_max_abs" in source):
        raise PlotError(f"{type(source).__name__}: expected a DriftReport (or its to_dict())")
    return drift_heatmaps(**drift_inputs(source))


def _is_ablation_rows(source: Any) -> bool:
    return isinstance(source, (list, tuple)) and bool(source) and all(
        isinstance(r, Mapping) and "passed" in r or hasattr(r, "passed") for r in source)


def _plot_ablation(source: Any, session: Any = None) -> Figure:
    if not _is_ablation_rows(source):
        raise PlotError("!plot ablation renders the rows of ablation.run_matrix(): run the matrix and pass its rows")
    return ablation_table(source)


def _plot_sigmas(source: Any, session: Any = None) -> Figure:
    from .sampler import AUDIO_SHIFT, VIDEO_SHIFT, DualSchedule

    if isinstance(source, (list, tuple)):
        source = _newest(source, "sigmas")
    if isinstance(source, int) and not isinstance(source, bool):
        vs = getattr(session, "video_shift", VIDEO_SHIFT)
        as_ = getattr(session, "audio_shift", AUDIO_SHIFT)
        source = DualSchedule.from_passes(source, vs, as_)
    elif not isinstance(source, DualSchedule):
        source = _trajectory(source).schedule
    return sigma_grids(source.video.sigmas, source.audio.sigmas, video_shift=source.video.shift,
                       audio_shift=source.audio.shift, title=f"sigma grids ({source.num_passes} passes)")


PLOTS: dict[str, Callable[..., Figure]] = {
    "latents": _plot_latents,
    "norms": _plot_norms,
    "drift": _plot_drift,
    "ablation": _plot_ablation,
    "sigmas": _plot_sigmas,
}


def plot(kind: str, source: Any, session: Any = None) -> Figure:
    """`PLOTS[kind](source, session)` with a one-line error for an unknown kind."""
    fn = PLOTS.get(kind)
    if fn is None:
        raise PlotError(f"plot kind {kind!r}: must be one of {', '.join(PLOTS)}")
    return fn(source, session)
