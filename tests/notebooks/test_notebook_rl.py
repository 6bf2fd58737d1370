"""05_reward_weighted_update and 06_grpo run top to bottom in a fresh kernel (06: GRPO with prompt_match on the
embedded default, and the committed quick runs' learning curves)."""

from __future__ import annotations

from nb_helpers import execute, images, long_lines, stderr, text_of


def test_reward_weighted_update_runs():
    nb = execute("05_reward_weighted_update")
    text = text_of(nb)
    assert "8 requests" in text and "no transition log-probabilities" in text
    assert "trajectory hash differs" in text and "verify: OK: 2/2 passes byte-equal" in text


def test_grpo_runs_with_the_prompt_following_reward():
    nb = execute("06_grpo")
    text = text_of(nb)
    # 3 prompts x G = 4 x 3 window passes x 2 modalities, on-policy
    assert "iteration 0: mean reward" in text and "(72/72 exactly 1)" in text
    assert "verify: OK: 2/2 GRPO iterations byte-equal" in text
    assert "grpo: mean reward" in text and "nft: mean reward" in text  # the committed quick runs' curves
    assert images(nb) == 1 and stderr(nb) == [] and long_lines(nb) == []
