"""Latent figures: the PCA-to-RGB basis, `latent_strip` (steps x latent frames, audio beside) and `norm_curves` (RMS per
step and modality).

The package docstring (`h3lab.research.plots`) is the contract of every figure."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from .figure import FONT_PT, MAX_WIDTH_IN, MODALITY_COLORS, PlotError, _array, finish, new_figure

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
    v, aud, labels = _checked_strip(video, audio, step_labels, basis_step)
    rows, rule = strip_rows(v.shape[0], max_rows, page)
    _, _, num_frames, h, w = v.shape
    frames = sorted(set(np.linspace(0, num_frames - 1, min(num_frames, max(1, max_frames))).round().astype(int)))
    gap = max(1, round(0.1 * max(h, w)))
    mosaic = _video_mosaic(v, rows, frames, pca_rgb_basis(v[basis_step]), gap)

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
    _draw_video_mosaic(ax, mosaic, [labels[r] for r in rows], frames, num_frames, h, w, gap)
    if aud is not None:
        _draw_audio_mosaic(fig, fig.add_subplot(grid[0, 1], sharey=None), aud, rows, basis_step)
    ax.set_title("video latents (PCA of the channels to RGB)", fontsize=9)
    fig.h3lab_rows = rows
    fig.suptitle(f"{title}: {rule}; one PCA basis from {labels[basis_step]}", fontsize=10)
    return fig  # no `finish`: rows of at least 0.32 in and tiles of at least 0.3 in keep every label apart


def _checked_strip(video: Any, audio: Any, step_labels: Sequence[str] | None,
                   basis_step: int) -> tuple[np.ndarray, np.ndarray | None, list[str]]:
    """(video (S, C, T, h, w), audio (S, 2A, Ca) or None, S step labels), with at least one step and a basis step
    among them."""
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
    return v, aud, labels


def _video_mosaic(v: np.ndarray, rows: list[int], frames: list[int], basis: PCABasis, gap: int) -> np.ndarray:
    """The drawn rows x frames as one RGBA image through `basis`; the gaps between tiles are transparent."""
    rgb = {r: pca_rgb(v[r], basis) for r in rows}
    mosaic = _mosaic([[rgb[r][f] for f in frames] for r in rows], gap)
    alpha = np.where(np.isnan(mosaic[..., :1]), 0.0, 1.0)  # gaps transparent (the white figure shows through)
    return np.concatenate([np.nan_to_num(mosaic), alpha], axis=-1)


def _draw_video_mosaic(ax, mosaic: np.ndarray, row_labels: list[str], frames: list[int], num_frames: int, h: int,
                       w: int, gap: int) -> None:
    """The video mosaic with a step label per row and a latent frame index per column (`ax.h3lab_tiles`)."""
    ax.imshow(mosaic, interpolation="nearest", aspect="auto")
    ax.h3lab_tiles = [[(r_i * (h + gap), c_i * (w + gap), h, w) for c_i in range(len(frames))]
                      for r_i in range(len(row_labels))]
    ax.set_yticks([i * (h + gap) + (h - 1) / 2 for i in range(len(row_labels))], row_labels, fontsize=FONT_PT)
    ax.set_xticks([i * (w + gap) + (w - 1) / 2 for i in range(len(frames))], [str(f) for f in frames],
                  fontsize=FONT_PT)
    frames_rule = f"{len(frames)} of {num_frames}, evenly spaced" if len(frames) < num_frames else f"all {num_frames}"
    ax.set_xlabel(f"latent frame ({frames_rule})", fontsize=FONT_PT)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _draw_audio_mosaic(fig: Figure, ax_a, aud: np.ndarray, rows: list[int], basis_step: int) -> None:
    """The drawn rows' audio latents (ch0 features above ch1, one diverging scale from the basis step) and their
    colorbar (`ax_a.h3lab_tiles`: one column per row)."""
    imgs = [audio_image(aud[r]) for r in rows]
    vmax = float(np.percentile(np.abs(audio_image(aud[basis_step])), 99)) or 1.0  # one scale for every row
    a_gap = max(1, round(0.1 * imgs[0].shape[0]))
    a_mosaic = _mosaic([[im[..., None]] for im in imgs], a_gap)[..., 0]
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
