"""The block map figure (`scripts/block_map.py`): what each block of a model carries, read from what the clips lose
when it is knocked out.

- `block_map_figure(rows, attributes, title)`: one row per configuration (the baseline first, then each block knocked
  out), one column per measured attribute; each cell the fraction of runs whose decoded clip still says what the
  prompt says, written in the cell, on one 0..1 colour scale with its colorbar. `rows` are dicts with `label` and
  `fractions` (attribute -> fraction in [0, 1]).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure

from .figure import FONT_PT, PlotError, finish, new_figure


def block_map_figure(rows: Sequence[dict[str, Any]], attributes: Sequence[str], title: str = "") -> Figure:
    """Configurations x attributes, match fractions (module docstring)."""
    if not rows or not attributes:
        raise PlotError("block_map_figure: needs at least one row and one attribute")
    try:
        m = np.array([[float(r["fractions"][a]) for a in attributes] for r in rows])
    except (KeyError, TypeError, ValueError) as err:
        raise PlotError(f"block_map_figure: every row needs fractions for {list(attributes)} ({err})") from None
    if not ((m >= 0) & (m <= 1)).all():
        raise PlotError("block_map_figure: fractions must lie in [0, 1]")
    fig = new_figure(1.6 + 1.15 * len(attributes), 1.2 + 0.42 * len(rows))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(m, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=FONT_PT,
                    color="black" if 0.25 < m[i, j] < 0.85 else "white")
    ax.set_xticks(range(len(attributes)), list(attributes), fontsize=FONT_PT)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=FONT_PT)
    ax.set_xlabel("attribute the decoded clip still says")
    if title:
        ax.set_title(title, fontsize=FONT_PT + 1)
    cb = fig.colorbar(im, ax=ax, fraction=0.08, pad=0.03, label="fraction of runs")
    cb.ax.tick_params(labelsize=FONT_PT)
    cb.ax.yaxis.label.set_size(FONT_PT)
    return finish(fig)
