"""03_ablation_matrix runs top to bottom in a fresh kernel."""

from __future__ import annotations

from nb_helpers import execute, images, long_lines, stderr, text_of


def test_ablation_matrix_runs():
    nb = execute("03_ablation_matrix")
    text = text_of(nb)
    assert "rows:" in text and "H-C7" in text
    assert images(nb) == 2  # the table, one row's drift heatmaps
    assert long_lines(nb) == [] and stderr(nb) == []
