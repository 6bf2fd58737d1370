"""The REPL's `!rollout G REWARD PROMPT`: each request's reward and advantage, and the ratio of every pass replayed
alone (exactly 1 here); bad arguments are one-line `H3Error`s before any model loads."""

import pytest

from h3lab.frontends import commands
from h3lab.errors import H3Error
from h3lab.app.session import Session


def test_rollout_command_reports_rewards_and_ratios(tiny_snapshot):
    state = commands.SessionState(Session(tiny_snapshot, device="cpu"))
    commands.run_line(state, "!size 64x64")
    commands.run_line(state, "!steps 2")
    commands.run_line(state, "!mode off")
    lines = commands.run_line(state, "!rollout 2 latent_mean a red fox in snow")
    assert lines[0].startswith("rollout flow_sde level 0.7, G=2") and "reward latent_mean" in lines[0]
    assert [ln.split(":")[0].strip() for ln in lines[1:3]] == ["request 0", "request 1"]
    signs = sorted(ln.split("advantage ")[1][0] for ln in lines[1:3])
    assert signs == ["+", "-"]  # a group of two: one above the mean, one below
    assert "8 (request, pass, modality): 8 exactly 1" in lines[3]


@pytest.mark.parametrize("line, message", [
    ("!rollout 2 latent_mean", "expects G REWARD PROMPT"),
    ("!rollout two latent_mean a fox", "expected G REWARD PROMPT"),
    ("!rollout 1 latent_mean a fox", "G=1: a group needs at least 2"),
    ("!rollout 2 shiny a fox", "reward 'shiny': not a shipped reward"),
])
def test_rollout_command_refusals(line, message):
    def no_session():
        raise AssertionError("a session was built")

    with pytest.raises(H3Error, match=message) as err:
        commands.run_line(commands.SessionState(no_session), line)
    assert "\n" not in str(err.value)
