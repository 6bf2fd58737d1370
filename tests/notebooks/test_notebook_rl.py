"""05_reward_weighted_update and 06_grpo run top to bottom in a fresh kernel."""

from __future__ import annotations

from nb_helpers import execute, images, long_lines, stderr, text_of


def test_reward_weighted_update_runs():
    nb = execute("05_reward_weighted_update")
    text = text_of(nb)
    assert "8 requests" in text and "no transition log-probabilities" in text
    assert "trajectory hash differs" in text and "verify: OK: 2/2 passes byte-equal" in text


def test_grpo_runs():
    nb = execute("06_grpo")
    text = text_of(nb)
    assert "iteration 0: on-policy ratio - 1 in [0, 0] (8/8 exactly 1)" in text
    assert "verify: OK: 3/3 GRPO iterations byte-equal" in text
    assert images(nb) == 1 and stderr(nb) == [] and long_lines(nb) == []
