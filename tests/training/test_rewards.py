"""Rewards (`h3lab.training.rewards`): the shipped examples against hand-computed values on fresh random media,
resolution of NAME and module:function, and one-line refusals of a bad reward (NaN, wrong count, not a number)."""

import math

import numpy as np
import pytest
import torch
from PIL import Image

from h3lab.training.rewards import (
    REWARDS,
    Reward,
    RewardError,
    RewardSample,
    colour,
    dominant_pitch,
    pitch_near,
    resolve_reward,
    reward,
    score,
)


def sample(index=0, seed=0, **kw):
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 256, size=(3, 8, 12, 3), dtype=np.uint8)
    return RewardSample(prompt="p", seed=seed, index=index, frames=kw.pop("frames", frames),
                        latents=torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(seed)), **kw)


def test_frame_rewards_match_float64_formulas():
    s = sample(seed=3)
    f = s.frames.astype(np.float64)
    luma = (0.299 * f[..., 0] + 0.587 * f[..., 1] + 0.114 * f[..., 2]).mean() / 255
    assert score(REWARDS["brightness"], [s]).item() == pytest.approx(luma, rel=1e-12)
    red = (f[..., 0] - (f[..., 1] + f[..., 2]) / 2).mean() / 255
    assert score(REWARDS["redness"], [s]).item() == pytest.approx(red, rel=1e-12)
    assert score(colour(10, 20, 30), [s]).item() == pytest.approx(1 - np.abs(f - [10, 20, 30]).mean() / 255)
    white = sample(frames=np.full((1, 4, 4, 3), 255, np.uint8))
    assert score(REWARDS["brightness"], [white]).item() == pytest.approx(1.0)
    assert score(REWARDS["latent_mean"], [s]).item() == pytest.approx(float(s.latents.double().mean()))
    assert REWARDS["latent_mean"].needs == "latents"


def test_pitch_finds_the_tone_and_scores_octaves():
    sr, n = 8000, 8000
    t = torch.arange(n, dtype=torch.float64) / sr
    noise = 0.05 * torch.randn(2, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tone = (0.5 * torch.sin(2 * math.pi * 220.0 * t) + noise).float()
    assert dominant_pitch(tone, sr) == pytest.approx(220.0, abs=1.0)
    s = sample(audio=tone, sample_rate=sr)
    assert score(REWARDS["pitch"], [s]).item() == pytest.approx(-1.0, abs=0.01)  # one octave below A4
    assert score(pitch_near(220.0), [s]).item() == pytest.approx(0.0, abs=0.01)
    with pytest.raises(RewardError, match="has no decoded audio"):
        score(REWARDS["pitch"], [sample()])


def test_anchor_match(tmp_path):
    s = sample(seed=5)
    Image.fromarray(s.frames[0]).resize((24, 16)).save(tmp_path / "a.png")
    s = RewardSample("p", 0, 0, frames=s.frames, first=str(tmp_path / "a.png"))
    anchor = np.asarray(Image.open(tmp_path / "a.png").resize((12, 8), Image.Resampling.LANCZOS), np.float64)
    want = 1 - np.abs(s.frames[0].astype(np.float64) - anchor).mean() / 255
    assert score(REWARDS["anchor_match"], [s]).item() == pytest.approx(want, rel=1e-12)
    with pytest.raises(RewardError, match="no first-frame anchor"):
        score(REWARDS["anchor_match"], [sample()])


@reward(needs="latents", batched=True)
def batch_of_norms(samples):
    return [float(s.latents.norm()) for s in samples]


def test_resolution():
    assert resolve_reward("brightness") is REWARDS["brightness"]
    r = resolve_reward(f"{__name__}:batch_of_norms")
    assert (r.needs, r.batched) == ("latents", True)
    out = score(r, [sample(seed=1), sample(seed=2, index=1)])
    assert out.dtype == torch.float64 and out.shape == (2,)
    assert resolve_reward("h3lab.training.rewards:brightness").fn is REWARDS["brightness"].fn
    assert resolve_reward(lambda s: 1.0).needs == "decoded"
    for spec, msg in (("nope", "not a shipped reward"), ("no_such_mod_x:f", "cannot import module"),
                      ("h3lab.training.rewards:nope", "has no attribute"), ("a b:c", "NAME or package.module"),
                      ("h3lab.training.rewards:REWARDS", "must be a callable")):
        with pytest.raises(RewardError, match=msg) as err:
            resolve_reward(spec)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("fn, batched, msg", [
    (lambda s: float("nan"), False, "returned nan for request 1: must be finite"),
    (lambda s: math.inf, False, "must be finite"),
    (lambda s: True, False, "must be a real number"),
    (lambda s: "1", False, "must be a real number"),
    (lambda ss: [1.0], True, "returned 1 values for 2 requests"),
    (lambda ss: 1.0, True, "one value per request"),
    (lambda ss: [1.0, np.float32("nan")], True, "request 1: must be finite"),
])
def test_bad_reward_values_are_one_line(fn, batched, msg):
    bad = Reward("bad", fn if batched else (lambda s, fn=fn: fn(s) if s.index == 1 else 0.5), batched=batched)
    with pytest.raises(RewardError, match=msg) as err:
        score(bad, [sample(), sample(index=1)])
    assert "\n" not in str(err.value) and "'bad'" in str(err.value)


def test_tensor_and_numpy_values_accepted():
    r = Reward("t", lambda ss: [torch.tensor(0.25), np.float32(0.5)], batched=True)
    assert score(r, [sample(), sample(index=1)]).tolist() == [0.25, 0.5]
    with pytest.raises(RewardError, match="needs='x'"):
        Reward("x", lambda s: 0.0, needs="x")
    with pytest.raises(RewardError, match="three numbers"):
        colour(300, 0, 0)
