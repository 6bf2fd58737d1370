"""The research views through the session and the command grammar on the embedded default (h3-shapes):
`Session.attention` on the last result, `!attention`, `Session.compare` (deterministic tables, matched seeds only,
setting sides), `!compare`, and their figures read as a person would."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from h3lab.frontends import commands
from h3lab.research import plots
from h3lab.errors import H3Error
from h3lab.app.session import Session

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
from figure_checks import assert_readable  # noqa: E402

PROMPT = "a blue square moves right, a middle tone"
GEN = dict(width=64, height=64, frames=22, steps=3, mode="off", seed=42)


@pytest.fixture(scope="module")
def session():
    return Session(device="cpu")


@pytest.fixture(scope="module")
def pair(session):
    return session.generate(PROMPT, **GEN), session.generate(PROMPT, **{**GEN, "reuse": 2})


def test_attention_of_the_last_result_reads_words_frames_and_audio_time(session, pair):
    view = session.attention(block=5, query="text")  # the last result: the reuse 2 run
    assert view.step == 2 and view.block == 5 and len(view.heads) == 4
    assert [label.split(":", 1)[1] for label in view.query_labels] == [
        "a", "blue", "square", "moves", "right", ",", "a", "middle", "tone"]
    assert view.key_kinds.count("video") == pair[1].layout.num_latent_frames
    w = view.weights.sum(-1)
    assert float((w - 1).abs().max()) < 1e-12
    fig = plots.attention_figure(session.attention(pair[0], 2, step=0))
    assert_readable(fig)
    assert_readable(plots.text_to_video(view))


def test_attention_command_writes_its_figure(session, pair, tmp_path):
    state = commands.SessionState(session=session, base_dir=tmp_path)
    state.results = list(pair)
    lines = commands.run_line(state, "!attention 3 0,2 pass 1 from video to audio frames.png")
    assert lines[0].startswith("attention block 3 pass 1, heads 0,2") and lines[-1].startswith("wrote ")
    assert (tmp_path / "frames.png").is_file()
    assert any("->" in line and "audio" in line for line in lines[1:-1])
    for bad, why in (("!attention", "BLOCK"), ("!attention 9", "blocks 0..5"), ("!attention 1 x-y", "heads"),
                     ("!attention 1 from nowhere", "'nowhere'"), ("!attention 1 pass 9", "passes 0..2")):
        with pytest.raises(H3Error, match=why):
            commands.run_line(state, bad)


def test_compare_tables_are_deterministic(session, pair):
    first = session.compare(*pair)
    again = session.compare(*pair)
    assert first.table() == again.table() and json.dumps(first.to_dict()) == json.dumps(again.to_dict())
    assert first.labels == ("A", "reuse 2") and first.first_drift is not None
    assert np.isfinite(first.psnr).all() and 0 < first.ssim.min() <= 1
    same = session.compare(pair[0], pair[0], drift=False)
    assert np.isinf(same.psnr).all() and same.ssim.tolist() == [1.0] * 22
    assert same.lsd_db == 0.0 and same.rms_ratio == 1.0
    assert same.reads[0]["match"] == {"colour": True, "direction": True, "tone": True, "pan": True}
    assert_readable(plots.compare_figure(first))


def test_compare_runs_setting_sides_on_one_seed(session):
    cmp = session.compare({}, {"reuse": 3}, settings=session.settings(PROMPT, **GEN), drift=False)
    assert cmp.seeds == (42, 42) and cmp.labels == ("A", "reuse=3")
    with pytest.raises(H3Error, match="matched-seed"):
        session.compare({}, {"seed": 7}, settings=session.settings(PROMPT, **GEN))
    a = cmp.results[0]
    b = session.generate(PROMPT, **{**GEN, "seed": 43})
    with pytest.raises(H3Error, match="seeds 42 vs 43"):
        session.compare(a, b)


def test_compare_command(session, pair, tmp_path):
    state = commands.SessionState(session=session, base_dir=tmp_path)
    with pytest.raises(H3Error, match="needs two generations"):
        commands.run_line(state, "!compare")
    state.results = list(pair)
    lines = commands.run_line(state, "!compare ab.png")
    assert lines[0] == "A/B A vs reuse 2, seed 42" and (tmp_path / "ab.png").is_file()
    assert any(line.strip().startswith("SSIM mean") for line in lines)


def test_block_map_and_blocks_figures_are_readable(session, pair):
    rows = [{"label": "baseline", "fractions": {"colour": 0.9, "direction": 1.0, "tone": 1.0, "pan": 1.0}},
            {"label": "block 3 out", "fractions": {"colour": 0.2, "direction": 0.5, "tone": 1.0, "pan": 0.0}}]
    assert_readable(plots.block_map_figure(rows, ("colour", "direction", "tone", "pan"), "a title"))
    views = [session.attention(pair[0], b, query="text") for b in (0, 5)]
    assert_readable(plots.attention_blocks(views, "text -> video"))
    with pytest.raises(H3Error, match="fractions"):
        plots.block_map_figure([{"label": "x", "fractions": {}}], ("colour",))


def test_attention_text_regions_by_word_or_by_token(session, pair):
    by_word = session.attention(pair[0], 1, step=0, query="text")
    by_token = session.attention(pair[0], 1, step=0, query="text", text="token")
    # This prompt's words are single tokens of the embedded vocabulary: the two tables are the same regions.
    assert by_word.query_labels == by_token.query_labels
    with pytest.raises(H3Error, match="text='letters'"):
        session.attention(pair[0], 1, text="letters")
