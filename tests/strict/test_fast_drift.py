"""What `--mode fast` costs, read the way researchers read it (`Session.drift`, what `!drift` prints): on the trained
embedded default (64 wide, so its projections are FP8-eligible) under `fast.use_emulation()` -- the float32
emulation of the same e4m3 quantised products, the CPU stand-in for the H200 kernels -- fast drifts from `off`, the
first drift is the first quantised projection of the first pass, and the per-pass latent distance is small but
not zero. On the H200 the same comparison over 20 passes is benchmark_every_length.py's `drift` section."""

from __future__ import annotations

import pytest
import torch

from h3lab import Session
from h3lab.execution import fast, runtime

PROMPT = "a blue square moves right, a middle tone"
REQUEST = dict(width=64, height=64, frames=22, steps=3, seed=42)


@pytest.fixture(scope="module")
def runs():
    session = Session(None, device="cpu")
    session.keep = ("latents",)
    off = session.generate(PROMPT, mode="off", **REQUEST)
    with fast.use_emulation():
        quick = session.generate(PROMPT, mode="fast", **REQUEST)
        lines = session.drift_lines(off, quick)
    return off, quick, lines


def test_fast_drifts_from_off_at_the_first_quantised_projection(runs):
    off, quick, lines = runs
    assert off.trajectory_hash != quick.trajectory_hash
    assert lines[0].startswith(f"off:{off.trajectory_hash[:12]} vs fast:{quick.trajectory_hash[:12]}: first drift at "
                               "pass 1 text_proj_in (op linear), packed row 0 (text)"), lines
    assert any(line.startswith("first drift inside a block: pass 1 blocks.0.") for line in lines), lines
    trace = quick.trajectory.manifest["trace"]
    assert trace["mode"] == "fast" and trace["non_strict_calls"] > 0, trace


def test_fast_latents_stay_close_to_off(runs):
    off, quick, _ = runs
    for i in range(REQUEST["steps"]):
        a, b = (r.trajectory.kept[f"video.{i:04d}"].float() for r in (off, quick))
        rel = float((a - b).norm() / a.norm())
        assert 0.0 < rel < 0.1, (i, rel)


def test_fast_without_emulation_refuses_the_cpu_and_leaves_the_session_usable():
    session = Session(None, device="cpu")
    with pytest.raises(runtime.FastModeError) as info:
        session.generate(PROMPT, mode="fast", **REQUEST)
    assert "\n" not in str(info.value) and "CUDA" in str(info.value)
    assert session.generate(PROMPT, mode="off", **{**REQUEST, "steps": 1}).trajectory_hash
    assert torch.get_default_dtype() == torch.float32
