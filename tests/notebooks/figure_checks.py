"""Looking at a figure as a person would (imported by name: pytest puts this folder on sys.path): its PNG size, text
that can be read (no overlap, nothing cut off at the figure's edge, no tiny fonts) and a colorbar for every heatmap."""

from __future__ import annotations

import io

from matplotlib.image import AxesImage
from matplotlib.text import Text
from PIL import Image

from h3lab.research import plots

MAX_PX = (1000, 1400)  # width, height of a saved PNG


def png_size(fig) -> tuple[int, int]:
    with Image.open(io.BytesIO(plots.png_bytes(fig))) as img:
        return img.size


def draw(fig) -> None:
    """Lay the figure out and draw it on its canvas unless that canvas already shows its current state: matplotlib
    marks a figure `stale` when any artist changes (and after `savefig`, which draws at another dpi), so a figure
    is drawn again exactly when the previous drawing may differ; the checks below read one drawing, not one each."""
    if fig.stale:
        fig.canvas.draw()


def _ticks(axis, minor: bool = False) -> tuple[list[Text], list[Text]]:
    """(tick labels matplotlib draws, those it does not: ticks outside the view interval keep a label object)."""
    lo, hi = sorted(axis.get_view_interval())
    tol = 1e-9 * max(1.0, abs(hi - lo))
    drawn, hidden = [], []
    ticks = axis.get_minor_ticks() if minor else axis.get_major_ticks()
    locs = axis.get_minorticklocs() if minor else axis.get_majorticklocs()
    for tick, loc in zip(ticks, locs):
        labels = [t for t in (tick.label1, tick.label2) if t.get_visible() and t.get_text()]
        (drawn if lo - tol <= loc <= hi + tol else hidden).extend(labels)
    return drawn, hidden


def drawn_tick_labels(axis) -> list[Text]:
    return _ticks(axis)[0] + _ticks(axis, minor=True)[0]


def visible_texts(fig) -> list[Text]:
    """Every text artist of the figure that is drawn and says something (tick labels in view, titles, axis labels,
    annotations, legends, table cells, colorbar labels)."""
    draw(fig)
    hidden = {id(t) for ax in fig.axes for axis in (ax.xaxis, ax.yaxis) for minor in (False, True)
              for t in _ticks(axis, minor)[1]}
    return [t for t in fig.findobj(Text)
            if t.get_visible() and t.get_text().strip() and id(t) not in hidden and t.get_figure(root=True) is fig]


def tick_label_overlaps(fig) -> list[str]:
    """Pairs of tick labels of one axis (major and minor) whose boxes overlap on the canvas."""
    draw(fig)
    renderer = fig.canvas.get_renderer()
    found = []
    for ax in fig.axes:
        for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            labels = drawn_tick_labels(axis)
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
            for i, (ta, a) in enumerate(boxes):
                for tb, b in boxes[i + 1:]:
                    if plots._overlap(a, b):
                        found.append(f"{ax.get_label() or ax.get_title()!r} {name}: {ta!r} / {tb!r}")
    return found


def text_overlaps(fig) -> list[str]:
    """Pairs of visible texts anywhere in the figure whose boxes overlap (table cells are checked only against
    texts outside their table)."""
    draw(fig)
    renderer = fig.canvas.get_renderer()
    items = []
    for t in visible_texts(fig):
        owner = t.axes if t in {c.get_text() for ax in fig.axes for tab in ax.tables for c in tab.get_celld().values()} else None
        items.append((t, t.get_window_extent(renderer), owner))
    found = []
    for i, (ta, a, oa) in enumerate(items):
        for tb, b, ob in items[i + 1:]:
            if oa is not None and oa is ob:
                continue
            if plots._overlap(a, b, pad=1.0):
                found.append(f"{ta.get_text()[:40]!r} / {tb.get_text()[:40]!r}")
    return found


def cut_off(fig) -> list[str]:
    """Texts that reach outside the figure."""
    draw(fig)
    renderer = fig.canvas.get_renderer()
    w, h = fig.canvas.get_width_height()
    out = []
    for t in visible_texts(fig):
        b = t.get_window_extent(renderer)
        if b.x0 < -1 or b.y0 < -1 or b.x1 > w + 1 or b.y1 > h + 1:
            out.append(t.get_text()[:60])
    return out


def small_fonts(fig) -> list[str]:
    return [f"{t.get_text()[:30]!r} {t.get_fontsize():.1f} pt" for t in visible_texts(fig)
            if t.get_fontsize() < plots.MIN_FONT_PT]


def heatmaps_without_colorbar(fig) -> list[str]:
    """Colour-mapped images (2-D data, not the categorical modality band) that have no colorbar."""
    out = []
    for ax in fig.axes:
        for im in ax.get_children():
            if isinstance(im, AxesImage) and im.get_array().ndim == 2 and im.get_gid() != "modality-band":
                if im.colorbar is None:
                    out.append(ax.get_title() or ax.get_label())
    return out


def assert_readable(fig, max_px: tuple[int, int] = MAX_PX, texts: bool = True) -> None:
    """The figure as a person sees it: within `max_px`, every tick label apart, nothing cut off, fonts at least
    `plots.MIN_FONT_PT`, a colorbar per heatmap, and (with `texts`) no two texts of the figure on top of each other."""
    w, h = png_size(fig)
    assert w <= max_px[0] and h <= max_px[1], f"PNG {w}x{h} px exceeds {max_px}"
    for check in (tick_label_overlaps, cut_off, small_fonts, heatmaps_without_colorbar) + ((text_overlaps,) if texts else ()):
        found = check(fig)
        assert found == [], f"{check.__name__}: {found}"
