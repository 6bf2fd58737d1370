"""Table-like figures: `ablation_table` (the ablation matrix rows) and `sigma_grids` (both sigma grids and each pass's
step).

The package docstring (`h3lab.research.plots`) is the contract of every figure."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from .figure import (
    FAIL_COLOR,
    FONT_PT,
    MAX_WIDTH_IN,
    MODALITY_COLORS,
    NOT_RUN_COLOR,
    PASS_COLOR,
    PlotError,
    _array,
    _wrap,
    finish,
    new_figure,
)

# ================================================================================================= ablation
def _first_drift_text(fd: Any) -> str:
    if fd is None:
        return "-"
    if isinstance(fd, str):
        return fd
    if isinstance(fd, Mapping):
        step = fd.get("step")  # 0-based; shown from 1 like the progress bar, -1 is the scheduler's construction
        shown = (f"pass {step + 1}" if step >= 0 else "scheduler construction") if isinstance(step, int) else "pass ?"
        where = f"{shown} {fd.get('point')}"
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
