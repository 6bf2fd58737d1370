"""Figures of h3lab: pure matplotlib functions that return `matplotlib.figure.Figure`s. No pyplot: every figure is a
`Figure` with its own Agg canvas, so nothing registers in pyplot's global figure list, any thread may draw, and the
caller decides what happens to it (`save`, `png_bytes`, or display in a notebook after `%matplotlib inline`).

Figure functions take documented plain inputs (numpy arrays or tensors + labels), never model internals:

- `latent_strip(video (S, C, T, h, w), audio (S, 2A, Ca) | None, step_labels)`: rows = denoising steps, columns =
  latent frames, each frame a PCA-to-RGB of its C channels (24 released, 4 tiny) through ONE basis fitted on
  `basis_step` (default the last row), so a colour means the same latent direction in every row; then the audio
  latents as an image over time (rows: channel-0 features above channel-1 features; shared symmetric colour scale).
- `norm_curves({"latent/video": (S,), "velocity/audio": (S',), ...}, step_labels)`: RMS per step and modality.
- `drift_heatmaps(step_layer (S, L), layer_row (L, R), step_labels, layer_labels, row_labels)`: log-scale heatmaps
  of a drift metric, step x layer and layer x packed row, with the packed rows' modality bands marked above the
  second (row labels "12:video" carry the modality). Exactly 0 (byte-equal) is white, NaN (not captured) grey.
- `ablation_table(rows)`: the ablation matrix as a table, one row per dict with `name`, `expected`, `observed`,
  `first_drift` (a `DriftPoint.to_dict()`, text or None) and `passed` (True / False / None); rows are coloured
  green (passed), red (failed) or grey (not run).
- `sigma_grids(video_sigmas, audio_sigmas)`: both grids over the grid index, and the sigma step of every pass.
- `benchmark_summary(docs)`: median seconds per shape and implementation of each benchmark JSON document (the
  DESIGN "Evidence" schema); `load_benchmarks(folder)` reads a results folder and lists the files it skipped.

Adapters turn h3lab objects into those inputs: `latent_steps(result | trajectory)`, `step_norms(...)` (they need the
per-step tensors kept: `Session.keep = ("latents", "velocities")` before generating), `drift_inputs(report)`.

`PLOTS` is what the REPL's `!plot KIND PATH` and the widgets call. Uniform calling convention:

    fig = PLOTS[kind](source, session=None)
    save(fig, path)

`source` is either the front end's recent generations (a list of `GenerationResult`, oldest first, as in
`commands.SessionState.results`) or the kind's own object:

    latents   a GenerationResult or Trajectory (the newest of a list)
    norms     a GenerationResult or Trajectory (the newest of a list)
    drift     a DriftReport, or a list of at least two results: `session.drift(results[-2], results[-1])` is run
              (needs `session`; minutes on a big model)
    ablation  the row dicts of `ablation.run_matrix()`; for a list of results (or None) the matrix is run on the
              session's snapshot (needs `session`; slow)
    sigmas    a DualSchedule, a GenerationResult / Trajectory (its schedule), or a list of results (the newest);
              an int N builds the N-pass grids with the session's shifts (the released ones without a session)

Every bad input raises `PlotError` (an `H3Error`) with one line naming the value and the rule.
"""

from __future__ import annotations

import io
import json
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

MODALITY_COLORS = {"text": "#9e9e9e", "video": "#1f77b4", "audio": "#ff7f0e"}
PASS_COLOR, FAIL_COLOR, NOT_RUN_COLOR = "#c8e6c9", "#ffcdd2", "#eeeeee"
EQUAL_COLOR, MISSING_COLOR = "white", "#bdbdbd"
BENCHMARK_KEYS = ("name", "date", "gpu", "torch", "triton", "git_rev", "command", "results")
BENCHMARK_RESULT_KEYS = ("shape", "rows", "impl", "median_s", "runs", "peak_mem_gib")


class PlotError(H3Error):
    """A figure cannot be drawn from what it was given (shape, missing tensors, unknown kind)."""


def new_figure(width: float, height: float) -> Figure:
    """A Figure with its own Agg canvas (no pyplot)."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def save(fig: Figure, path: str | os.PathLike, dpi: int = 100) -> Path:
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
def latent_strip(
    video: Any,
    audio: Any = None,
    *,
    step_labels: Sequence[str] | None = None,
    basis_step: int = -1,
    max_frames: int = 12,
    title: str = "per-step latents",
) -> Figure:
    """Rows = steps, columns = latent frames (PCA-to-RGB, one basis fitted on row `basis_step`) + the audio latents.

    video: (S, C, T, h, w); audio: (S, 2A, Ca) rows or None. At most `max_frames` evenly spaced frames are drawn
    (column titles give the frame index). Returns a figure with S * (frames + audio) image axes."""
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
    _, _, num_frames, h, w = v.shape
    frames = sorted(set(np.linspace(0, num_frames - 1, min(num_frames, max(1, max_frames))).round().astype(int)))
    basis = pca_rgb_basis(v[basis_step])
    audio_imgs = [audio_image(a) for a in aud] if aud is not None else []
    if audio_imgs:
        ref = audio_imgs[basis_step]
        vmax = float(np.percentile(np.abs(ref), 99)) or 1.0  # one symmetric scale for every row
    cols = len(frames) + (1 if audio_imgs else 0)
    audio_ratio = max(2.0, len(frames) / 2) if audio_imgs else 0.0
    ratios = [1.0] * len(frames) + ([audio_ratio] if audio_imgs else [])
    fig = new_figure(1.1 * sum(ratios) + 1.2, 1.1 * steps * max(h / w, 0.5) + 0.8)
    grid = fig.add_gridspec(steps, cols, width_ratios=ratios)
    for s in range(steps):
        rgb = pca_rgb(v[s], basis)
        for j, f in enumerate(frames):
            ax = fig.add_subplot(grid[s, j])
            ax.imshow(rgb[f], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if s == 0:
                ax.set_title(f"frame {f}", fontsize=8)
            if j == 0:
                ax.set_ylabel(labels[s], fontsize=8)
        if audio_imgs:
            ax = fig.add_subplot(grid[s, cols - 1])
            ax.imshow(audio_imgs[s], cmap="RdBu_r", vmin=-vmax, vmax=vmax, aspect="auto", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if s == 0:
                ax.set_title("audio (ch0 | ch1) over time", fontsize=8)
    which = labels[basis_step]
    fig.suptitle(f"{title} (PCA basis from {which})", fontsize=10)
    return fig


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
            ax.set_xticks(np.arange(longest), list(step_labels), rotation=30, fontsize=7)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return fig


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


def drift_heatmaps(
    step_layer: Any,
    layer_row: Any,
    *,
    step_labels: Sequence[Any],
    layer_labels: Sequence[str],
    row_labels: Sequence[str],
    modalities: Sequence[str] | None = None,
    row_step: Any = None,
    metric: str = "max |a-b|",
    title: str = "drift",
) -> Figure:
    """Two heatmaps on one log colour scale: step x layer (S, L) and, at one pass (`row_step`), layer x packed row
    (L, R), with the rows' modality bands (from `modalities`, else parsed from `row_labels`) drawn above it.
    Axes: [step x layer, layer x row, modality band, colour bar]."""
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
    rows = len(row_labels)
    fig = new_figure(max(9.0, 4.0 + 0.06 * rows), max(3.2, 1.2 + 0.28 * max(len(layer_labels), len(step_labels))))
    grid = fig.add_gridspec(2, 3, width_ratios=[1.0, max(1.6, rows / 40), 0.06], height_ratios=[0.07, 1.0])
    ax_sl = fig.add_subplot(grid[1, 0])
    im = _heat(ax_sl, sl, norm, cmap)
    ax_sl.set_yticks(range(len(step_labels)), [f"pass {s}" for s in step_labels], fontsize=8)
    ax_sl.set_xticks(range(len(layer_labels)), list(layer_labels), rotation=60, fontsize=7)
    ax_sl.set_xlabel("layer")
    ax_sl.set_ylabel("denoising pass")
    ax_sl.set_title(f"step x layer ({metric})", fontsize=9)

    ax_lr = fig.add_subplot(grid[1, 1])
    _heat(ax_lr, lr, norm, cmap)
    ax_lr.set_yticks(range(len(layer_labels)), list(layer_labels), fontsize=7)
    ax_lr.set_xlabel("packed row")
    bands = _bands(mods)
    for start, _stop, _m in bands[1:]:
        ax_lr.axvline(start - 0.5, color="black", linewidth=0.8)

    ax_band = fig.add_subplot(grid[0, 1], sharex=ax_lr)
    names = sorted(set(mods), key=lambda m: list(MODALITY_COLORS).index(m) if m in MODALITY_COLORS else 99)
    codes = np.array([[names.index(m) for m in mods]])
    ax_band.imshow(codes, cmap=ListedColormap([MODALITY_COLORS.get(m, "#000000") for m in names]),
                   vmin=-0.5, vmax=len(names) - 0.5, aspect="auto", interpolation="nearest")
    for start, stop, m in bands:
        ax_band.text((start + stop - 1) / 2, 0, m, ha="center", va="center", fontsize=7, color="white")
    ax_band.set_yticks([])
    ax_band.tick_params(labelbottom=False, bottom=False)
    where = f" at pass {row_step}" if row_step is not None else ""
    ax_band.set_title(f"layer x packed row{where} ({metric}); band: modality of each row", fontsize=9)

    ax_cb = fig.add_subplot(grid[1, 2])
    fig.colorbar(im, cax=ax_cb, extend="min", label=metric)
    fig.supxlabel("white: byte-equal (0), grey: not captured by both arms", fontsize=8)
    state = "byte-equal everywhere" if not np.any(np.nan_to_num(sl) > 0) and not np.any(np.nan_to_num(lr) > 0) else ""
    fig.suptitle(_wrap(title + (f" - {state}" if state else ""), 120), fontsize=10)
    return fig


def _drift_cmap():
    import matplotlib

    return matplotlib.colormaps["magma_r"].with_extremes(under=EQUAL_COLOR, bad=MISSING_COLOR)


def drift_inputs(report: Any, step: int | None = None, metric: str = "max_abs") -> dict[str, Any]:
    """The keyword arguments of `drift_heatmaps` from a `drift.DriftReport` (metric "max_abs" or "rel_l2")."""
    if metric not in ("max_abs", "rel_l2"):
        raise PlotError(f"drift metric {metric!r}: must be 'max_abs' or 'rel_l2'")
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


def _wrap(text: Any, width: int) -> str:
    return "\n".join(textwrap.wrap(str(text), width)) or "-"


def _row_get(row: Any, key: str, default: Any = None) -> Any:
    return row.get(key, default) if isinstance(row, Mapping) else getattr(row, key, default)


ABLATION_COLUMNS = ("row", "mode", "expected", "observed", "first drift", "result")


def ablation_table(rows: Sequence[Any], *, title: str = "ablation matrix") -> Figure:
    """The matrix as a table (columns `ABLATION_COLUMNS`); every cell of a row is coloured by `passed`: green
    `PASS_COLOR` (True), red `FAIL_COLOR` (False), grey `NOT_RUN_COLOR` (None: not run)."""
    if not rows:
        raise PlotError("no ablation rows to draw")
    widths = (5, 6, 34, 54, 28, 7)
    text, colours, heights = [], [], []
    for r in rows:
        for key in ("name", "expected", "observed", "passed"):
            if isinstance(r, Mapping) and key not in r:
                raise PlotError(f"ablation row {r.get('name', r)!r}: lacks {key!r}")
        passed = _row_get(r, "passed")
        result = {True: "PASS", False: "FAIL", None: "not run"}.get(passed, str(passed))
        cells = [_row_get(r, "name"), _row_get(r, "mode", "-"), _row_get(r, "expected"), _row_get(r, "observed"),
                 _first_drift_text(_row_get(r, "first_drift")), result]
        wrapped = [_wrap(c, w) for c, w in zip(cells, widths)]
        text.append(wrapped)
        colour = {True: PASS_COLOR, False: FAIL_COLOR}.get(passed, NOT_RUN_COLOR)
        colours.append([colour] * len(cells))
        heights.append(max(c.count("\n") + 1 for c in wrapped))
    line_h = 0.16
    total_lines = sum(heights) + 1
    fig = new_figure(14.0, 0.6 + line_h * total_lines * 1.15)
    ax = fig.add_subplot(1, 1, 1)
    ax.axis("off")
    table = ax.table(cellText=text, colLabels=list(ABLATION_COLUMNS), cellColours=colours, loc="upper center",
                     cellLoc="left", colWidths=[w / sum(widths) for w in widths])
    table.auto_set_font_size(False)
    table.set_fontsize(7)
    unit = 1.0 / total_lines
    for (r, _c), cell in table.get_celld().items():
        cell.set_height(unit * (1 if r == 0 else heights[r - 1]))
        if r == 0:
            cell.set_text_props(weight="bold")
    passed = sum(_row_get(r, "passed") is True for r in rows)
    failed = sum(_row_get(r, "passed") is False for r in rows)
    fig.suptitle(f"{title}: {passed} passed, {failed} failed, {len(rows) - passed - failed} not run", fontsize=10)
    return fig


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
    ax.legend(fontsize=8)
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
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return fig


# =============================================================================================== benchmarks
def load_benchmarks(folder: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """Read every `*.json` in `folder` (sorted by name). Returns (documents that follow the schema, one line per
    skipped file or result entry). A missing or empty folder gives ([], [...]): never an error. Result entries with
    an `error` instead of timings are kept (drawn as failures)."""
    root = Path(folder)
    if not root.is_dir():
        return [], [f"{root}: no such folder (no benchmark results yet)"]
    docs, problems = [], []
    for path in sorted(root.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            problems.append(f"{path.name}: not readable JSON ({err})")
            continue
        if not isinstance(doc, dict):
            problems.append(f"{path.name}: top level is {type(doc).__name__}, not an object")
            continue
        missing = [k for k in BENCHMARK_KEYS if k not in doc]
        if missing or not isinstance(doc.get("results"), list):
            problems.append(f"{path.name}: lacks {', '.join(missing) or 'a results list'}")
            continue
        kept = []
        for i, entry in enumerate(doc["results"]):
            need = ("shape", "impl", "error") if isinstance(entry, dict) and "error" in entry else BENCHMARK_RESULT_KEYS
            lacking = [k for k in need if not isinstance(entry, dict) or k not in entry]
            if lacking:
                problems.append(f"{path.name}: results[{i}] lacks {', '.join(lacking)}")
                continue
            kept.append(entry)
        docs.append({**doc, "results": kept, "file": path.name})
    if not docs and not problems:
        problems.append(f"{root}: no *.json results yet")
    return docs, problems


def _group_key(entry: Mapping[str, Any]) -> str:
    extra = [str(entry[k]) for k in ("proj", "op", "pass") if k in entry]
    return " ".join([str(entry["shape"])] + extra)


def benchmark_summary(docs: Sequence[Mapping[str, Any]], *, title: str = "benchmarks") -> Figure:
    """One axes per document: grouped bars of `median_s` per (shape [proj op pass]) and implementation, log scale;
    failed entries are marked "x" at the axis bottom. With no documents, one axes that says so."""
    if not docs:
        fig = new_figure(6.0, 2.0)
        ax = fig.add_subplot(1, 1, 1)
        ax.axis("off")
        ax.text(0.5, 0.5, "no benchmark results yet", ha="center", va="center", fontsize=11)
        fig.suptitle(title, fontsize=10)
        return fig
    fig = new_figure(11.0, 3.6 * len(docs))
    for d, doc in enumerate(docs):
        ax = fig.add_subplot(len(docs), 1, d + 1)
        groups = list(dict.fromkeys(_group_key(e) for e in doc["results"]))
        impls = list(dict.fromkeys(str(e["impl"]) for e in doc["results"]))
        width = 0.8 / max(1, len(impls))
        for k, impl in enumerate(impls):
            xs, ys, fails = [], [], []
            for e in doc["results"]:
                if str(e["impl"]) != impl:
                    continue
                x = groups.index(_group_key(e)) - 0.4 + width * (k + 0.5)
                if "error" in e or not isinstance(e.get("median_s"), (int, float)):
                    fails.append(x)
                else:
                    xs.append(x)
                    ys.append(float(e["median_s"]))
            ax.bar(xs, ys, width=width, label=impl)
            if fails:
                ax.plot(fails, [0.0] * len(fails), "x", color="red", transform=ax.get_xaxis_transform(),
                        label=f"{impl} failed")
        if any(isinstance(e.get("median_s"), (int, float)) and e["median_s"] > 0 for e in doc["results"]):
            ax.set_yscale("log")
        ax.set_xticks(range(len(groups)), groups, rotation=20, fontsize=7, ha="right")
        ax.set_ylabel("median s")
        ax.set_title(f"{doc['name']} - {doc['gpu']} - torch {doc['torch']} triton {doc['triton']} - "
                     f"{doc['git_rev']} - {doc['date']}", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    return fig


def benchmark_rows(docs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Flat rows (benchmark, shape, impl, median_s, ratio, peak GiB, error) for a text table."""
    out = []
    for doc in docs:
        base: dict[str, float] = {}
        for e in doc["results"]:
            if e.get("impl") == "diffusers" and isinstance(e.get("median_s"), (int, float)):
                base[_group_key(e)] = float(e["median_s"])
        for e in doc["results"]:
            med = e.get("median_s")
            ref = base.get(_group_key(e))
            out.append({
                "benchmark": doc["name"], "case": _group_key(e), "impl": e["impl"], "median_s": med,
                "vs_diffusers": (med / ref) if isinstance(med, (int, float)) and ref else None,
                "peak_mem_gib": e.get("peak_mem_gib"), "error": e.get("error"),
            })
    return out


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
        if len(source) < 2:
            raise PlotError(f"!plot drift: needs two generations, have {len(source)}")
        if session is None:
            raise PlotError("!plot drift of two results: needs the session to re-run them")
        source = session.drift(source[-2], source[-1])
    if not hasattr(source, "step_layer_max_abs"):
        raise PlotError(f"{type(source).__name__}: expected a DriftReport or two results")
    return drift_heatmaps(**drift_inputs(source))


def _plot_ablation(source: Any, session: Any = None) -> Figure:
    rows = isinstance(source, (list, tuple)) and bool(source) and all(
        isinstance(r, Mapping) or hasattr(r, "passed") for r in source
    )
    if not rows:  # the front end's results (or nothing): run the matrix on the session's snapshot
        from . import ablation

        bench = ablation.tiny_bench(str(session.path)) if session is not None else ablation.tiny_bench()
        source = ablation.run_matrix(bench)
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
