"""03_ablation_matrix runs top to bottom in a fresh kernel, on a few rows of each kind: a strict invariance row, a
planted drift (the heatmap cell draws its report), a distributed row (A4: the CP refusal, on local gloo ranks)
and the last row. Every row's signature is checked in tests/research/test_ablation.py, so the notebook's job here is its
cells, its table and its figures."""

from __future__ import annotations

import re

from nb_helpers import execute, images, long_lines, stderr, text_of

ROWS = ["A0", "H2", "A4", "H-C7"]


def test_ablation_matrix_runs():
    nb = execute("03_ablation_matrix", row_names=ROWS)
    text = text_of(nb)
    assert "4 rows: 4 passed, failed [], not run []" in text
    for name in ROWS:
        assert re.search(rf"^{re.escape(name)} +(off|strict) +PASS ", text, re.M), name
    assert "H2 - one target video row tagged audio" in text  # the first drifting row is the one drawn in detail
    assert images(nb) == 2  # the table, one row's drift heatmaps
    assert long_lines(nb) == [] and stderr(nb) == []
