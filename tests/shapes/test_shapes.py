"""The procedural clips and the measurements: the measurements read every generator clip's own ground truth, and
they can fail (an altered clip reads differently)."""

import numpy as np
import pytest

from h3lab.errors import ValidationError
from h3lab.shapes import (ATTRIBUTES, COLOURS, DIRECTIONS, SHAPES, ClipSpec, first_last, held_out_combos, matches,
                          measure, partial_prompt, prompt, reference_image, render_clip, training_combos)
from h3lab.shapes.clips import BACKGROUND


def test_split_partitions_every_triple_and_keeps_every_value_in_training():
    train, held = training_combos(), held_out_combos()
    assert len(train) == 48 and len(held) == 12 and not set(train) & set(held)
    assert len(set(train) | set(held)) == len(COLOURS) * len(SHAPES) * len(DIRECTIONS)
    for i, values in enumerate((COLOURS, SHAPES, DIRECTIONS)):
        assert {k[i] for k in train} == set(values)


def test_clips_are_seeded_and_shaped():
    spec = ClipSpec("red", "circle", "left", seed=3)
    f1, a1 = render_clip(spec)
    f2, a2 = render_clip(ClipSpec("red", "circle", "left", seed=3))
    f3, _ = render_clip(ClipSpec("red", "circle", "left", seed=4))
    assert f1.shape == (22, 64, 64, 3) and f1.dtype == np.uint8 and a1.shape == (2, 29600) and a1.dtype == np.float32
    assert np.array_equal(f1, f2) and np.array_equal(a1, a2) and not np.array_equal(f1, f3)
    assert prompt(spec) == "a red circle moves left, a high tone"
    first, last = first_last(spec)
    assert np.array_equal(first, f1[0]) and np.array_equal(last, f1[-1])
    ref = reference_image("blue", "square")
    assert ref.shape == (64, 64, 3) and (ref == np.array(COLOURS["blue"], np.uint8)).all(-1).sum() > 200
    assert (ref[0, 0] == np.array(BACKGROUND, np.uint8)).all()


@pytest.mark.parametrize("combo", held_out_combos()[:6] + training_combos()[::8])
def test_measurements_read_the_generators_ground_truth(combo):
    colour, shape, direction = combo
    spec = ClipSpec(colour, shape, direction, seed=7)
    m = measure(*render_clip(spec))
    assert matches(m, colour, shape, direction) == {"colour": True, "direction": True, "tone": True, "pan": True}
    assert abs(m.frequency - spec.frequency) < 5  # the FFT bin is 32000 / 29600 ~ 1.1 Hz wide
    (x0, _), (x1, _), _, _ = spec.path()
    assert abs(m.pan_start - np.clip(x0 / 64, 0, 1)) < 0.1 and abs(m.pan_end - np.clip(x1 / 64, 0, 1)) < 0.1


def test_measurements_can_fail():
    frames, audio = render_clip(ClipSpec("green", "triangle", "right", seed=1))
    assert not matches(measure(frames[::-1], audio[::-1, ::-1]), "green", "triangle", "right")["direction"]
    swapped = measure(frames[..., ::-1].copy(), audio[::-1].copy())  # RGB -> BGR, left <-> right channels
    ok = matches(swapped, "green", "triangle", "right")
    assert ok["colour"] is True and ok["pan"] is False  # green stays green under BGR; the pan flips
    red = measure(*render_clip(ClipSpec("red", "square", "up", seed=1)))
    assert matches(red, "blue", "circle", "down") == {"colour": False, "direction": False, "tone": False, "pan": True}
    blank = measure(np.full((22, 64, 64, 3), 24, np.uint8), np.zeros((2, 29600), np.float32))
    assert (blank.colour, blank.direction, blank.tone, blank.pan_direction) == (None, None, None, None)


def test_partial_prompts_say_only_what_they_keep():
    spec = ClipSpec("yellow", "triangle", "up")
    assert partial_prompt(spec, ATTRIBUTES) == prompt(spec) == "a yellow triangle moves up, a low tone"
    assert partial_prompt(spec, ("direction", "colour")) == "a yellow shape moves up"
    assert partial_prompt(spec, ("shape",)) == "a triangle moves, a low tone"
    assert partial_prompt(spec, ()) == "a shape moves"
    words = {k: {getattr(spec, k), spec.tone} if k == "shape" else {getattr(spec, k)} for k in ATTRIBUTES}
    for keep in ((), ("colour",), ("shape", "direction")):
        said = set(partial_prompt(spec, keep).replace(",", "").split())
        for k in ATTRIBUTES:
            assert (words[k] <= said) == (k in keep), (keep, k)
    for keep, text in ((("size",), "keep=\\('size',\\)"), (("shape", "shape"), "distinct")):
        with pytest.raises(ValidationError, match=text):
            partial_prompt(spec, keep)


def test_bad_inputs_are_one_line_errors():
    for kwargs, text in ((dict(colour="teal"), "colour='teal'"), (dict(shape="star"), "shape='star'"),
                         (dict(direction="in"), "direction='in'"), (dict(seed=-1), "seed=-1"),
                         (dict(width=8), "both edges")):
        args = {"colour": "red", "shape": "circle", "direction": "left", **kwargs}
        with pytest.raises(ValidationError, match=text):
            ClipSpec(**args)
    with pytest.raises(ValidationError, match="uint8"):
        measure(np.zeros((2, 8, 8, 3), np.float32), np.zeros((2, 100)))
    with pytest.raises(ValidationError, match="stereo"):
        measure(np.zeros((2, 8, 8, 3), np.uint8), np.zeros((100,)))
