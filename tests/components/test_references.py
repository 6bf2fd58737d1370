"""Reference/anchor validation (seed README rules) and normalisation (bit-equal to Diffusers' Ref2VA setup step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import diffusers_oracle as oracle
from h3lab.components.references import (
    AudioRef,
    ImageRef,
    Keyframe,
    VideoRef,
    normalize_references,
    validate_conditioning,
    validate_references,
)
from h3lab.errors import H3Error, ValidationError

SR = 32000


def img(rng, h=32, w=48):
    return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)


def vid(rng, f=24, h=32, w=48):
    return rng.integers(0, 256, size=(f, h, w, 3), dtype=np.uint8)


def wav(rng, seconds, channels=2):
    return (rng.standard_normal((channels, int(round(seconds * SR)))) * 0.1).astype(np.float32)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert isinstance(err.value, H3Error) and "\n" not in msg
    return msg


@pytest.mark.parametrize("seconds", [2.0, 9.5, 15.0])
def test_audio_lengths_within_two_to_fifteen_seconds_pass(rng, seconds):
    validate_references([ImageRef(img(rng)), AudioRef(wav(rng, seconds))])


@pytest.mark.parametrize("seconds", [1.99, 0.5, 15.01, 40.0])
def test_audio_lengths_outside_two_to_fifteen_seconds_fail(rng, seconds):
    rule = r"reference 2 \[audio\] audio lasts .* each audio input must last 2-15 s"
    with pytest.raises(ValidationError, match=rule) as e:
        validate_references([ImageRef(img(rng)), AudioRef(wav(rng, seconds))])
    assert f"{seconds:.3f} s" in one_line(e)


def test_soundtracks_count_as_audio_inputs_and_share_the_budget(rng):
    frames = vid(rng)
    # Three audio inputs of 5 s: exactly the 15 s budget.
    validate_references(
        [VideoRef(frames, audio=wav(rng, 5)), AudioRef(wav(rng, 5)), VideoRef(frames, audio=wav(rng, 5))]
    )
    with pytest.raises(ValidationError, match="audio inputs last 15.200 s in total: at most 15 s") as e:
        validate_references([VideoRef(frames, audio=wav(rng, 7.6)), AudioRef(wav(rng, 7.6))])
    one_line(e)
    # A fourth audio input is refused even though only one is standalone (Diffusers would accept it).
    rule = r"4 audio inputs \(standalone audio, soundtracks and replacement audio\)"
    with pytest.raises(ValidationError, match=rule):
        validate_references(
            [VideoRef(frames, audio=wav(rng, 2)) for _ in range(3)] + [ImageRef(img(rng)), AudioRef(wav(rng, 2))]
        )
    # A soundtrack is measured at its own sample rate.
    with pytest.raises(ValidationError, match=r"reference 1 \[video \(clip.mp4\)\] audio lasts 1.000 s"):
        validate_references([VideoRef(frames, audio=wav(rng, 2), sample_rate=64000, source="clip.mp4")])


def test_reference_counts_and_standalone_audio(rng):
    with pytest.raises(ValidationError, match="no references"):
        validate_references([])
    with pytest.raises(ValidationError, match="standalone audio reference without an image or video reference"):
        validate_references([AudioRef(wav(rng, 3)), AudioRef(wav(rng, 3))])
    with pytest.raises(ValidationError, match="10 image references: at most 9"):
        validate_references([ImageRef(img(rng, 8, 8)) for _ in range(10)])
    with pytest.raises(ValidationError, match="4 video references: at most 3"):
        validate_references([VideoRef(vid(rng, 2, 8, 8)) for _ in range(4)])
    with pytest.raises(ValidationError, match="13 references: at most 12"):
        validate_references(
            [ImageRef(img(rng, 8, 8)) for _ in range(9)] + [VideoRef(vid(rng, 2, 8, 8)) for _ in range(3)]
            + [AudioRef(wav(rng, 2))]
        )
    with pytest.raises(ValidationError, match="reference 1 of type str"):
        validate_references(["cat.png"])


def test_anchors_and_references_cannot_be_mixed(rng):
    first, last = Keyframe(img(rng), "first"), Keyframe(img(rng), "last")
    validate_conditioning([first, last], [])
    validate_conditioning([], [ImageRef(img(rng))])
    rule = r"1 first/last anchor\(s\) and 1 reference\(s\): .* cannot be mixed"
    with pytest.raises(ValidationError, match=rule) as e:
        validate_conditioning([first], [ImageRef(img(rng))])
    one_line(e)
    with pytest.raises(ValidationError, match="at most one 'first' and one 'last'"):
        validate_conditioning([first, first], [])
    with pytest.raises(ValidationError, match="the first-frame anchor must come before the last"):
        validate_conditioning([last, first], [])


def test_bad_media_arrays(rng):
    with pytest.raises(ValidationError, match=r"image reference 'x.png' of shape \(4, 4\) dtype uint8"):
        ImageRef(np.zeros((4, 4), np.uint8), source="x.png")
    with pytest.raises(ValidationError, match=r"must be uint8 \(frames, height, width, 3\) RGB"):
        VideoRef(np.zeros((4, 4, 4, 3), np.float32))
    with pytest.raises(ValidationError, match="fps=0: must be a positive finite number"):
        VideoRef(vid(rng, 2, 8, 8), fps=0)
    with pytest.raises(ValidationError, match=r"of shape \(3, 100\) dtype float32: must be float \(1\|2, samples\)"):
        AudioRef(np.zeros((3, 100), np.float32))
    with pytest.raises(ValidationError, match="NaN or infinity"):
        AudioRef(np.full((2, 100), np.inf, np.float32))
    with pytest.raises(ValidationError, match="keyframe anchor 'middle'"):
        Keyframe(img(rng), "middle")


def test_normalisation_matches_released_setup_step(rng):
    from PIL import Image

    from diffusers.image_processor import VaeImageProcessor
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep
    from diffusers.modular_pipelines.minimax_h3.references import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    # Small canvases (the rules are the released ones, the sizes are not): 64 px image short edge, 64 px video canvas.
    sizes = dict(image_short_edge=64, canvas_short_edge=64, canvas_max_pixels=64 * 112)
    im_small, im_wide = img(rng, 40, 50), img(rng, 70, 150)  # upscaled / downscaled to a 64 px short edge
    v30 = vid(rng, 40, 36, 60)  # 30 fps -> 24 fps, resized up to the 64 px canvas of its own ratio
    v24 = vid(rng, 150, 64, 96)  # already on its canvas and grid: truncated to the 124 generated frames only
    mono, long_stereo = wav(rng, 3, channels=1), wav(rng, 6)
    ours = [
        ImageRef(im_small), VideoRef(v30, fps=30.0, audio=mono), AudioRef(long_stereo), VideoRef(v24), ImageRef(im_wide)
    ]
    out = normalize_references(ours, num_frames=124, **sizes)

    comps = oracle.components(image_processor=VaeImageProcessor(vae_scale_factor=16))
    comps.config.reference_image_short_edge, comps.config.canvas_short_edge = 64, 64
    comps.config.canvas_max_pixels = 64 * 112
    theirs = [
        MiniMaxH3ImageReference(image=Image.fromarray(im_small)),
        MiniMaxH3VideoReference(frames=v30, fps=30.0, audio=torch.from_numpy(mono), sample_rate=SR),
        MiniMaxH3AudioReference(audio=torch.from_numpy(long_stereo), sample_rate=SR),
        MiniMaxH3VideoReference(frames=v24, fps=24.0),
        MiniMaxH3ImageReference(image=Image.fromarray(im_wide)),
    ]
    state = oracle.run_block(
        MiniMaxH3Ref2VASetupStep(), comps, references=theirs, num_frames=124, height=32, width=32
    )
    ref = state.get("normalized_references")
    assert [r.kind for r in out] == [r.kind for r in ref] == ["image", "video", "audio", "video", "image"]
    # 40x50 -> 64x80 -> width rounds 2.5 -> 2 (half to even) multiples of 32: 64x64; 70x150 -> 64x128.
    assert out[0].image.shape == (64, 64, 3) and out[4].image.shape == (64, 128, 3)
    assert np.array_equal(out[0].image, np.asarray(ref[0].image))
    assert np.array_equal(out[4].image, np.asarray(ref[4].image))
    assert out[1].frames.shape == (32, 64, 96, 3) and np.array_equal(out[1].frames, ref[1].frames)
    assert out[3].frames.shape == (124, 64, 96, 3) and np.array_equal(out[3].frames, ref[3].frames)
    assert out[3].frames is not v24 and np.array_equal(out[3].frames, v24[:124])
    assert out[1].audio.shape == (2, mono.shape[1]) and np.array_equal(out[1].audio, ref[1].audio.numpy())
    assert out[2].audio.shape == (2, int(124 / 24 * SR)) and np.array_equal(out[2].audio, ref[2].audio.numpy())
    assert out[1].fps == 24.0 and all(r.sample_rate == SR for r in out if r.has_audio)


def test_normalisation_errors(rng):
    with pytest.raises(ValidationError, match=r"reference 1 \[image\] is 200x40: its aspect ratio must be within 1:4"):
        normalize_references([ImageRef(img(rng, 40, 200))], num_frames=124)
    with pytest.raises(ValidationError, match=r"reference 1 \[video\] has 12 frames at 24 fps: at least 13"):
        normalize_references([VideoRef(vid(rng, 12))], num_frames=124, canvas_short_edge=32, canvas_max_pixels=32 * 48)
    with pytest.raises(ValidationError, match=r"reference 2 \[audio\] sample rate 44100 Hz: must be 32000 Hz"):
        normalize_references(
            [ImageRef(img(rng)), AudioRef(wav(rng, 3), sample_rate=44100)], num_frames=124, image_short_edge=32
        )
    with pytest.raises(ValidationError, match="aspect ratio 250:50: must be within 1:4 and 4:1"):
        normalize_references([VideoRef(vid(rng, 20, 50, 250))], num_frames=124)
