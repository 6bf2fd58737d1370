"""`Session.encode_clip` (`h3lab/app/clips_in.py`): an MP4 and its prompt -> one encoded t2va `ClipRequest`. One clip is
encoded (30 fps, 96x64, a different tone per channel) and its rows are checked against the components run by hand on
the 24 fps grid, the cover-cropped canvas and the cut audio track; the rules that refuse a clip are checked without
encoding anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h3lab.app.clips_in import HOP, check_clip, encode_clip, frames_at_24
from h3lab.components import media
from h3lab.errors import ValidationError
from h3lab.training.dataset import check_fits, load_dataset, save_dataset

SR = 32000


def tone(seconds: float, left: float, right: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.stack([np.sin(2 * np.pi * left * t), np.sin(2 * np.pi * right * t)])).astype(np.float32)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(7)
    frames = rng.integers(0, 256, (36, 64, 96, 3), dtype=np.uint8)  # 1.2 s at 30 fps -> 29 frames at 24 fps
    media.write_mp4(d / "wide30.mp4", frames, fps=30, audio=tone(1.2, 440, 880))
    media.write_mp4(d / "silent.mp4", frames[:24, :, :64], fps=24)
    media.write_mp4(d / "short.mp4", frames[:20, :, :64], fps=24, audio=tone(0.9, 300, 300))
    media.write_mp4(d / "shortaudio.mp4", frames[:24, :, :64], fps=24, audio=tone(0.5, 300, 300))
    media.write_mp4(d / "odd.mp4", frames[:24, :48, :80], fps=24, audio=tone(1.0, 300, 300))
    media.write_png_frames(d / "png", frames[:1])
    media.write_wav(d / "sound.wav", tone(1.0, 200, 200))
    return d


def test_encode_clip_rows_are_the_components_outputs(session, clips, tmp_path):
    path = clips / "wide30.mp4"
    plan = check_clip(session, path, "a red fox", width=64, height=64)
    assert frames_at_24(36, 30.0) == 29 and plan.settings.num_frames == 22 and plan.crop  # 17n+5 <= 29
    request = session.encode_clip(path, "a red fox", width=64, height=64, seed=5)
    s = plan.settings
    assert request.layout.task == "t2va" and request.seed == 5
    assert request.layout.num_condition_video_rows == 0 and request.layout.num_condition_audio_rows == 0
    # The video rows: frames on the 24 fps grid, the first 22, cover-cropped to 64x64, the released encode.
    source, fps = media.read_video(path)
    on_grid = source[media.resample_frame_indices(source.shape[0], fps, 24)][:22]
    assert on_grid.shape[0] == 22 and source.shape[0] == 36
    from h3lab.components.conditioning import _cover_crop
    from h3lab.components.video_vae import patchify

    cropped = np.stack([_cover_crop(f, 64, 64) for f in on_grid])
    latents = session.component("vae").encode_condition(cropped)
    assert torch.equal(request.video[0], patchify(latents, (1, 2, 2)))
    # The audio rows: the track cut at A*800 samples, channel-major (left rows first, then right).
    need = s.num_audio_latents * HOP
    track = media.read_audio(path)[:, :need]
    assert track.shape == (2, need)
    rows = session.component("audio_vae").encode(track)
    assert torch.equal(request.audio[0], rows)
    left = session.component("audio_vae").encode(np.repeat(track[:1], 2, axis=0))
    assert torch.equal(request.audio[0, : s.num_audio_latents], left[: s.num_audio_latents])
    assert not torch.equal(request.audio[0, s.num_audio_latents:], left[s.num_audio_latents:])  # 880 Hz on the right
    # The text rows: what a generation of that prompt encodes.
    assert torch.equal(request.text[0], session.component("text_encoder").encode("a red fox").embeds[0].cpu())
    # Ready for save_dataset: sealed, reloaded byte-equal, fits the snapshot's transformer.
    out = save_dataset(tmp_path / "ds", [request])
    (back,), _ = load_dataset(out)
    assert torch.equal(back.video, request.video) and torch.equal(back.audio, request.audio)
    check_fits([back], session.transformer().config)


def test_silent_clip_encodes_silence_only_when_allowed(session, clips):
    with pytest.raises(ValidationError, match="has no audio track"):
        check_clip(session, clips / "silent.mp4", "a fox")
    plan = check_clip(session, clips / "silent.mp4", "a fox", allow_silent=True)
    assert plan.audio == "silence" and plan.settings.canvas == (64, 64) and not plan.crop


@pytest.mark.parametrize("name, options, message", [
    ("short.mp4", {}, "has 20 frames at 24 fps (0.833 s); a training clip needs at least 22"),
    ("wide30.mp4", {"frames": 39}, "has 29 frames at 24 fps (1.208 s); frames=39 needs 39"),
    ("shortaudio.mp4", {}, "its audio track lasts 0.5"),
    ("odd.mp4", {}, "is 80x48, not a canvas (width=80: must be a multiple of 32); give a width and height"),
    ("wide30.mp4", {"width": 64}, "width=64, height=None: give both"),
    ("wide30.mp4", {"width": 100, "height": 64}, "width=100: must be a multiple of 32"),
    ("png/frame_00000.png", {}, "is an image, not a video"),
    ("sound.wav", {}, "is an audio file, not a video"),
    ("nope.mp4", {}, "no such file"),
    ("png", {}, "not a regular file"),
])
def test_clip_rules_refuse_before_encoding(session, clips, name, options, message, monkeypatch):
    monkeypatch.setattr(session, "component", lambda name: pytest.fail(f"{name} loaded for a refused clip"))
    with pytest.raises(ValidationError) as err:
        encode_clip(session, clips / name, "a fox", **options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_prompt_rules(session, clips):
    for prompt, message in (("   ", "empty prompt"), (7, "must be a string"), ("fox \udcff", "not UTF-8")):
        with pytest.raises(ValidationError, match=message):
            check_clip(session, clips / "wide30.mp4", prompt, width=64, height=64)
