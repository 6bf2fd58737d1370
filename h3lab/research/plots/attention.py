"""Figures of attention views (`Session.attention` -> `h3lab.research.views.attention.AttentionMap`). They read the view's
documented attributes only (block, step, heads, labels, kinds, times, weights) and do no model work.

- `attention_heatmap(view, keys=None, head=None)`: query regions x key regions (`keys`: indices of the key columns
  shown; the mass on every other region is one "other" column, so each row still sums to 1), mean over the chosen
  heads or one `head`; linear colour scale from 0 with its colorbar.
- `text_to_video(view)`: the text rows (tokens) x the target video's latent frames: which words steer which frames.
- `video_audio(view)`: video frames -> audio over time and audio time -> video frames, both axes in seconds (the
  layout's rotary clock, 40 units per second), so attention that follows the clock sits on the diagonal.
- `attention_figure(view, keys=None)`: the heatmap and, where the view has those queries and keys, the two above.
- `attention_blocks(views)`: text -> video frames for several blocks side by side on one colour scale (the block
  map).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure

from .figure import FONT_PT, PlotError, finish, new_figure

UNITS_PER_SECOND = 40.0  # the layout's rotary clock: 5/3 units per pixel frame at 24 fps
CMAP = "magma"


def _weights(view: Any, head: int | None) -> np.ndarray:
    w = view.weights.numpy() if hasattr(view.weights, "numpy") else np.asarray(view.weights)
    if w.ndim != 3:
        raise PlotError(f"attention weights of shape {w.shape}: expected (query regions, heads, key regions)")
    if head is None:
        return w.mean(axis=1)
    if head not in view.heads:
        raise PlotError(f"head {head}: the view holds heads {list(view.heads)}")
    return w[:, list(view.heads).index(head)]


def _short(label: str) -> str:
    return label.split(":", 1)[1] if label.startswith("t") and ":" in label else label


def _heat(fig: Figure, ax: Any, m: np.ndarray, rows: Sequence[str], cols: Sequence[str], title: str,
          vmax: float | None = None) -> None:
    im = ax.imshow(m, aspect="auto", cmap=CMAP, vmin=0.0, vmax=vmax or max(float(m.max()), 1e-12),
                   interpolation="nearest")
    ax.set_yticks(range(len(rows)), [_short(r) for r in rows], fontsize=FONT_PT)
    ax.set_xticks(range(len(cols)), [_short(c) for c in cols], fontsize=FONT_PT, rotation=90)
    ax.set_title(title, fontsize=FONT_PT + 1)
    cb = fig.colorbar(im, ax=ax, fraction=0.06, pad=0.02, aspect=30, label="attention mass")
    cb.ax.tick_params(labelsize=FONT_PT)
    cb.ax.yaxis.label.set_size(FONT_PT)


def _title(view: Any, what: str) -> str:
    heads = "all heads" if len(view.heads) > 6 else "heads " + ",".join(map(str, view.heads))
    return f"{what} - block {view.block}, pass {view.step + 1}, {heads}"


def _pick(view: Any, query_kinds: Sequence[str], key_kinds: Sequence[str]) -> tuple[list[int], list[int]]:
    q = [g for g, k in enumerate(view.query_kinds) if k in query_kinds]
    k = [g for g, kk in enumerate(view.key_kinds) if kk in key_kinds]
    return q, k


def attention_heatmap(view: Any, keys: Sequence[int] | None = None, head: int | None = None,
                      fig: Figure | None = None, ax: Any = None) -> Figure:
    """Query regions x key regions (module docstring)."""
    w = _weights(view, head)
    cols = list(range(w.shape[1])) if keys is None else list(keys)
    labels = [view.key_labels[c] for c in cols]
    m = w[:, cols]
    if keys is not None:
        m = np.concatenate([m, (w.sum(axis=1) - m.sum(axis=1))[:, None]], axis=1)
        labels.append("other")
    if fig is None:
        fig = new_figure(2.5 + 0.16 * len(labels), 1.8 + 0.16 * len(view.query_labels))
        ax = fig.add_subplot(1, 1, 1)
    _heat(fig, ax, m, view.query_labels, labels, _title(view, "query region -> key region"))
    ax.set_xlabel("key region")
    ax.set_ylabel("query region")
    return finish(fig)


def _text_video(fig: Figure, ax: Any, view: Any) -> bool:
    q, k = _pick(view, ("text",), ("video",))
    if not q or not k:
        return False
    w = _weights(view, None)[np.ix_(q, k)]
    _heat(fig, ax, w, [view.query_labels[g] for g in q], [view.key_labels[g] for g in k],
          _title(view, "text -> video frames"))
    ax.set_xlabel("target latent frame")
    ax.set_ylabel("text token")
    return True


def text_to_video(view: Any) -> Figure:
    """Text tokens x target video latent frames (module docstring)."""
    fig = new_figure(6.0, 4.0)
    if not _text_video(fig, fig.add_subplot(1, 1, 1), view):
        raise PlotError("text -> video needs a view with text query regions and video key regions (query text)")
    return finish(fig)


def _seconds(times: Any, idx: Sequence[int]) -> np.ndarray:
    t = np.asarray(times.tolist() if hasattr(times, "tolist") else times, dtype=np.float64)[list(idx)]
    return t / UNITS_PER_SECOND


def _timed(fig: Figure, ax: Any, view: Any, src: str, dst: str) -> bool:
    q, k = _pick(view, (src,), (dst,))
    if not q or not k:
        return False
    w = _weights(view, None)[np.ix_(q, k)]
    tq, tk = _seconds(view.query_times, q), _seconds(view.key_times, k)
    t0 = min(tq.min(), tk.min())
    extent = (tk[0] - t0, tk[-1] - t0, tq[-1] - t0, tq[0] - t0) if len(k) > 1 and len(q) > 1 else None
    im = ax.imshow(w, aspect="auto", cmap=CMAP, vmin=0.0, vmax=max(float(w.max()), 1e-12), extent=extent,
                   interpolation="nearest")
    ax.set_xlabel(f"{dst} key time (s)")
    ax.set_ylabel(f"{src} query time (s)")
    ax.set_title(_title(view, f"{src} -> {dst}"), fontsize=FONT_PT + 1)
    ax.tick_params(labelsize=FONT_PT)
    cb = fig.colorbar(im, ax=ax, fraction=0.06, pad=0.02, aspect=30, label="attention mass")
    cb.ax.tick_params(labelsize=FONT_PT)
    cb.ax.yaxis.label.set_size(FONT_PT)
    return True


def video_audio(view: Any) -> Figure:
    """Video frames -> audio time and audio time -> video frames, in seconds (module docstring)."""
    fig = new_figure(9.0, 3.8)
    drawn = [_timed(fig, fig.add_subplot(1, 2, i + 1), view, src, dst)
             for i, (src, dst) in enumerate((("video", "audio"), ("audio", "video")))]
    if not any(drawn):
        raise PlotError("video <-> audio needs a view with video and audio query and key regions")
    for ax, ok in zip(fig.axes[:2], drawn):
        if not ok:
            ax.set_axis_off()
    return finish(fig)


def attention_figure(view: Any, keys: Sequence[int] | None = None) -> Figure:
    """The region heatmap, and text -> video and video <-> audio where the view has them (module docstring)."""
    has = lambda src, dst: bool(_pick(view, (src,), (dst,))[0] and _pick(view, (src,), (dst,))[1])  # noqa: E731
    panels = [("heat",)] + [(s, d) for s, d in (("text", "video"), ("video", "audio"), ("audio", "video"))
                             if has(s, d)]
    fig = new_figure(10.0, 3.6 * len(panels))
    axes = [fig.add_subplot(len(panels), 1, i + 1) for i in range(len(panels))]
    for ax, panel in zip(axes, panels):
        if panel == ("heat",):
            attention_heatmap(view, keys=keys, fig=fig, ax=ax)
        elif panel == ("text", "video"):
            _text_video(fig, ax, view)
        else:
            _timed(fig, ax, view, *panel)
    return finish(fig)


def attention_blocks(views: Sequence[Any], title: str = "") -> Figure:
    """Text tokens -> video frames per block, side by side on one colour scale (module docstring)."""
    views = list(views)
    if not views:
        raise PlotError("attention_blocks: no views")
    cols = min(3, len(views))
    rows = -(-len(views) // cols)
    fig = new_figure(10.0, 2.8 * rows + 0.4)
    vmax = 0.0
    for v in views:
        q, k = _pick(v, ("text",), ("video",))
        if not q or not k:
            raise PlotError(f"block {v.block}: the view has no text query regions or no video key regions")
        vmax = max(vmax, float(_weights(v, None)[np.ix_(q, k)].max()))
    for i, v in enumerate(views):
        ax = fig.add_subplot(rows, cols, i + 1)
        q, k = _pick(v, ("text",), ("video",))
        _heat(fig, ax, _weights(v, None)[np.ix_(q, k)], [v.query_labels[g] for g in q],
              [v.key_labels[g].replace("frame", "f") for g in k], f"block {v.block}", vmax=vmax)
    if title:
        fig.suptitle(title, fontsize=FONT_PT + 2)
    return finish(fig)
