"""`!plot KIND PATH.png`: the REPL/replay front door to `h3lab.research.plots` — parse errors are one line, and after real
generations the written PNGs hold the figure the plot function draws."""

import pytest
from PIL import Image

from h3lab.frontends import commands
from h3lab.frontends.commands import CommandError, parse


@pytest.mark.parametrize(
    "line, match",
    [("!plot", "expects KIND PATH"), ("!plot latents", "expects KIND PATH"), ("!plot pie x.png", "pie")],
)
def test_plot_parse_errors(line, match):
    with pytest.raises(CommandError, match=match):
        parse(line)


def test_plot_after_generations_writes_pngs(state, tmp_path):
    state.get_session().keep = ("latents", "velocities")
    commands.run_line(state, "a red fox")
    commands.run_line(state, "!seed 7")
    commands.run_line(state, "a red fox")
    for kind in ("sigmas", "latents", "norms"):
        out = tmp_path / f"{kind}.png"
        lines = commands.run_line(state, f"!plot {kind} {out}")
        assert lines == [f"wrote {out}"]
        with Image.open(out) as img:
            assert img.format == "PNG" and img.width > 100 and img.height > 100
    with pytest.raises(CommandError, match="must end in .png|png"):
        commands.run_line(state, f"!plot sigmas {tmp_path / 'x.jpg'}")
