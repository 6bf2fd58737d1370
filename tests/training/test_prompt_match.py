"""`prompt_match` (the h3-shapes prompt-following reward) and weighted sums of rewards: rendered clips of fresh
random (colour, shape, direction) triples score 1 against their own prompt and lose exactly the attributes another
prompt says otherwise; a sum is the weighted float64 sum of its parts in order, each part recorded; every bad
spelling or prompt is one line naming it."""

import numpy as np
import pytest
import torch

from h3lab.shapes import COLOURS, DIRECTIONS, SHAPES, ClipSpec, prompt, read_prompt, render_clip
from h3lab.errors import ValidationError
from h3lab.training.rewards import (REWARDS, RewardError, RewardSample, prompt_match, resolve_reward, score,
                                    score_parts)


def clip_sample(spec: ClipSpec, text: str, index: int = 0, audio: bool = True) -> RewardSample:
    frames, wave = render_clip(spec)
    return RewardSample(prompt=text, seed=spec.seed, index=index, frames=frames,
                        audio=torch.from_numpy(wave) if audio else None)


def random_specs(n: int, seed: int) -> list[ClipSpec]:
    rng = np.random.default_rng(seed)
    return [ClipSpec(str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES)), str(rng.choice(list(DIRECTIONS))),
                     seed=int(rng.integers(1 << 30))) for _ in range(n)]


def test_a_clip_matches_its_own_prompt_on_every_attribute():
    specs = random_specs(4, seed=11)
    samples = [clip_sample(s, prompt(s), i) for i, s in enumerate(specs)]
    assert score(REWARDS["prompt_match"], samples).tolist() == [1.0] * 4
    for name in ("prompt_match_video", "prompt_match_audio", "colour_match", "direction_match", "tone_match",
                 "pan_match"):
        assert score(REWARDS[name], samples).tolist() == [1.0] * 4, name


def test_another_prompt_loses_exactly_what_it_says_otherwise():
    spec = random_specs(1, seed=12)[0]
    colour = next(c for c in COLOURS if c != spec.colour)
    other = ClipSpec(colour, spec.shape, spec.direction)
    s = clip_sample(spec, prompt(other))
    assert score(REWARDS["prompt_match"], [s]).item() == 0.75
    assert score(REWARDS["colour_match"], [s]).item() == 0.0
    assert score(REWARDS["prompt_match_video"], [s]).item() == 0.5
    assert score(REWARDS["prompt_match_audio"], [s]).item() == 1.0
    # moving right, said left: direction and pan both wrong; colour and tone right
    right = ClipSpec(spec.colour, spec.shape, "right", seed=spec.seed)
    said = prompt(ClipSpec(spec.colour, spec.shape, "left"))
    assert score(prompt_match(), [clip_sample(right, said)]).item() == 0.5
    assert score(prompt_match(("direction", "pan")), [clip_sample(right, said)]).item() == 0.0
    # a shape with another pitch: only the tone differs (the square sounds middle, the circle high)
    sq = ClipSpec(spec.colour, "square", spec.direction, seed=spec.seed)
    assert score(REWARDS["tone_match"], [clip_sample(sq, prompt(ClipSpec(spec.colour, "circle", spec.direction)))]
                 ).item() == 0.0


def test_video_parts_need_no_audio_and_audio_parts_refuse_without_it():
    spec = random_specs(1, seed=13)[0]
    silent = clip_sample(spec, prompt(spec), audio=False)
    assert score(REWARDS["prompt_match_video"], [silent]).item() == 1.0
    with pytest.raises(RewardError, match="request 0 has no decoded audio") as err:
        score(REWARDS["prompt_match"], [silent])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("a red fox in snow", "not a shapes prompt"),
    ("a purple circle moves left, a high tone", "not a shapes prompt"),
    ("a red circle moves left, a low tone", "a circle sounds a high tone, not low"),
    ("", "not a shapes prompt"),
])
def test_a_prompt_the_reader_cannot_parse_is_refused_naming_it(text, message):
    spec = random_specs(1, seed=14)[0]
    with pytest.raises(RewardError, match=message) as err:
        score(REWARDS["prompt_match"], [clip_sample(spec, text, index=3)])
    assert "\n" not in str(err.value) and repr(text) in str(err.value) and "request 3" in str(err.value)


def test_read_prompt_is_the_inverse_of_prompt():
    for spec in random_specs(6, seed=15):
        assert read_prompt(prompt(spec)) == (spec.colour, spec.shape, spec.direction)
        assert read_prompt("  " + prompt(spec).upper() + ". ") == (spec.colour, spec.shape, spec.direction)
    with pytest.raises(ValidationError, match="not a shapes prompt"):
        read_prompt("a red circle moves left")
    with pytest.raises(RewardError, match="distinct names among colour, direction, tone, pan"):
        prompt_match(("shape",))


def test_a_weighted_sum_is_the_float64_sum_of_its_parts_in_order():
    specs = random_specs(3, seed=16)
    samples = [clip_sample(s, prompt(ClipSpec("red", s.shape, s.direction)), i) for i, s in enumerate(specs)]
    mix = resolve_reward("prompt_match:1.0, brightness:0.1,redness:-0.25")
    assert mix.name == "prompt_match:1.0,brightness:0.1,redness:-0.25" and mix.needs == "decoded"
    total, parts = score_parts(mix, samples)
    pm, br, rd = (score(REWARDS[n], samples) for n in ("prompt_match", "brightness", "redness"))
    assert torch.equal(total, ((torch.zeros(3, dtype=torch.float64) + 1.0 * pm) + 0.1 * br) + -0.25 * rd)
    assert torch.equal(score(mix, samples), total)
    assert [p["name"] for p in parts] == ["prompt_match", "brightness", "redness"]
    assert [p["weight"] for p in parts] == [1.0, 0.1, -0.25]
    assert parts[1]["values"] == br.tolist() and parts[1]["mean"] == float(br.mean())
    # one name stays the plain reward: no parts, the same object as before
    assert resolve_reward("prompt_match") is REWARDS["prompt_match"]
    assert score_parts(REWARDS["brightness"], samples)[1] == []
    one = resolve_reward("prompt_match:1.0")
    assert torch.equal(score(one, samples), pm) and len(one.parts) == 1
    assert resolve_reward("latent_mean:2").needs == "latents"


@pytest.mark.parametrize("spec, message", [
    ("prompt_match:1.0,", "part 2 '': must be NAME:WEIGHT"),
    ("prompt_match:1.0,brightness", "part 2 'brightness': must be NAME:WEIGHT"),
    ("prompt_match:nan", "weight 'nan' must be a finite non-zero number"),
    ("prompt_match:0", "weight '0' must be a finite non-zero number"),
    ("prompt_match:1,prompt_match:2", "'prompt_match' appears twice"),
    ("prompt_match:1:2", "must be NAME:WEIGHT"),
    ("shiny:1,brightness:1", "part 1: reward 'shiny': not a shipped reward"),
    ("http://127.0.0.1:9/score:1,brightness:1", "a reward server scores alone"),
])
def test_bad_sums_are_one_line_naming_the_flag_and_the_rule(spec, message):
    with pytest.raises(RewardError, match=message) as err:
        resolve_reward(spec)
    assert "\n" not in str(err.value) and str(err.value).startswith(f"--reward {spec!r}")
