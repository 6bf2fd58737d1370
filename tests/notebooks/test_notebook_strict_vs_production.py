"""02_strict_vs_production runs top to bottom in a fresh kernel."""

from __future__ import annotations

from nb_helpers import execute, images, stderr, text_of


def test_strict_vs_production_runs():
    nb = execute("02_strict_vs_production")
    text = text_of(nb)
    assert "strict repeat: byte-equal at every pass" in text
    assert "first drift:" in text
    assert images(nb) == 2
    assert "strict: " in text and " strict / 0 torch op calls" in text and "off: 0 strict / " in text
    assert stderr(nb) == []
