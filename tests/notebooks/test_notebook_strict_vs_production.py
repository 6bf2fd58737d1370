"""02_strict_vs_production runs top to bottom in a fresh kernel, on the random 2-block tiny snapshot (its
`snapshot` parameter), a one-pass request (its `request` parameter: the smallest legal canvas and frame count, as the
default, with 1 pass instead of 2) and three of the four arms (`arm_names`: P/P and R/R, which the notebook checks,
and the mixed P/R, whose drift summary it prints; tests/research/test_arms.py checks all four): the same
generations, strict repeat, drift and arms (on the ablation bench's 2 passes) as on the trained default, several
times faster under the interpreter (01_quickstart runs the embedded default in a kernel)."""

from __future__ import annotations

from nb_helpers import execute, images, stderr, text_of


def test_strict_vs_production_runs(tiny_snapshot):
    request = dict(width=32, height=32, frames=22, steps=1, seed=7)
    nb = execute("02_strict_vs_production", snapshot=str(tiny_snapshot), request=request,
                 arm_names=("P/P", "P/R", "R/R"))
    text = text_of(nb)
    assert "strict repeat: byte-equal at every pass" in text
    assert text.count(" strict / 0 torch op calls in 1 forwards") == 2  # both strict runs took the injected request
    assert "production and strict digests equal: False" in text
    assert "first drift:" in text
    assert images(nb) == 2
    assert "strict: " in text and " strict / 0 torch op calls" in text and "off: 0 strict / " in text
    assert "R/R: byte-equal at every pass" in text and "P/P: byte-equal at every pass" in text
    assert "P/R: velocity rel L2 <= " in text and "R/P:" not in text
    # fast's cost, as !drift says it: on this 24-wide snapshot no projection is FP8-eligible (K, N multiples of 16),
    # so fast is byte-equal to production (tests/strict/test_fast_drift.py measures the drift on the default)
    assert " fast op calls in 1 forwards" in text and "vs fast:" in text and "byte-equal at all" in text
    assert "pass 0: video latent rel L2 fast vs production 0.0000" in text
    assert stderr(nb) == []
