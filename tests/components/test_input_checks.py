"""Inputs probed before use: what a file is (image vs video vs audio), whether it is complete (MP4 packets past the
end, a cut index, a WAV data chunk shorter than its header), each error naming the file that is wrong; the
replacement soundtrack of a video reference named in its own errors; the prompt bound of the text encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from h3lab.components import media
from h3lab.components.media import MediaError
from h3lab.components.references import ImageRef, VideoRef, validate_references
from h3lab.components.text_encoder import PromptBound, check_token_count, token_limit
from h3lab.errors import CheckpointError, ValidationError


@pytest.fixture
def clip(tmp_path, rng):
    """A 2 s video with sound (faststart MP4, as h3lab writes), random content."""
    frames = rng.integers(0, 255, (48, 32, 32, 3), dtype=np.uint8)
    t = np.arange(64000) / 32000
    audio = np.stack([np.sin(2 * np.pi * rng.uniform(200, 800) * t)] * 2).astype(np.float32) * 0.3
    return media.write_mp4(tmp_path / "clip.mp4", frames, fps=24, audio=audio)


def _wav(path, seconds, rng):
    return media.write_wav(path, rng.uniform(-0.5, 0.5, (2, int(32000 * seconds))).astype(np.float32))


def test_complete_files_are_not_flagged(clip, tmp_path, rng):
    info = media.probe(clip)
    assert info.kind == "video" and not info.is_image and info.truncated == ""
    assert media.probe(_wav(tmp_path / "a.wav", 1.0, rng)).truncated == ""
    assert media.check_video(clip, "--ref-video", needs_audio=True).video.fps == 24.0
    assert media.check_audio_file(clip, "--ref-audio").audio.sample_rate == 32000


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
def test_a_cut_mp4_is_truncated_not_short(clip, tmp_path, fraction):
    data = clip.read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[: int(len(data) * fraction)])
    assert "runs past the end of the file" in media.probe(cut).truncated
    for check in (lambda: media.check_video(cut, "--ref-silent-video"), lambda: media.read_video(cut),
                  lambda: media.read_audio(cut), lambda: media.check_audio_file(cut, "--ref-audio")):
        with pytest.raises(MediaError, match=r"'.*cut\.mp4'.*is truncated") as err:
            check()
        assert "\n" not in str(err.value)


def test_an_mp4_cut_inside_its_index(clip, tmp_path):
    data = clip.read_bytes()
    (tmp_path / "index.mp4").write_bytes(data[:1000])
    (tmp_path / "header.mp4").write_bytes(data[:40])
    # Depending on where the index breaks ffmpeg refuses the file or sees part of it: truncated either way.
    with pytest.raises(MediaError, match=r"index\.mp4'(:)? is (a )?truncated"):
        media.check_video(tmp_path / "index.mp4", "--ref-video")
    with pytest.raises(MediaError, match=r"header\.mp4': is truncated \(an MP4 header with no stream index"):
        media.check_video(tmp_path / "header.mp4", "--ref-video")


def test_a_wav_shorter_than_its_header(tmp_path, rng):
    data = _wav(tmp_path / "full.wav", 3.0, rng).read_bytes()
    (tmp_path / "cut.wav").write_bytes(data[: len(data) // 2])
    why = media.probe(tmp_path / "cut.wav").truncated
    assert why.startswith(f"its header declares {3 * 32000 * 2 * 4:,} bytes of samples")
    with pytest.raises(MediaError, match=r"--ref-audio '.*cut\.wav': is truncated"):
        media.check_audio_file(tmp_path / "cut.wav", "--ref-audio")


def test_kinds_are_named(clip, tmp_path, rng):
    from PIL import Image

    png = tmp_path / "still.png"
    Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(png)
    wav = _wav(tmp_path / "sound.wav", 1.0, rng)
    silent = media.write_mp4(tmp_path / "silent.mp4", rng.integers(0, 255, (5, 32, 32, 3), dtype=np.uint8))
    assert media.probe(png).is_image and media.probe(png).kind == "image"
    with pytest.raises(MediaError, match=r"--ref-video '.*still\.png': is a PNG image, not a video"):
        media.check_video(png, "--ref-video")
    with pytest.raises(MediaError, match=r"'.*sound\.wav': is an audio file \(wav\), not a video"):
        media.check_video(wav, "--ref-video")
    with pytest.raises(MediaError, match=r"silent\.mp4': has no audio stream \(use --ref-silent-video"):
        media.check_video(silent, "--ref-video", needs_audio=True)
    with pytest.raises(MediaError, match=r"still\.png': is a PNG image, which has no audio stream"):
        media.check_audio_file(png, "--ref-audio")
    with pytest.raises(MediaError, match=r"clip\.mp4' is not an image PIL can decode \(it is a video; use --ref-video"):
        media.read_image(clip)
    with pytest.raises(MediaError, match=r"sound\.wav' is not an image PIL can decode \(it is an audio file"):
        media.read_image(wav)
    data = png.read_bytes()
    (tmp_path / "half.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(MediaError, match=r"half\.png' is a truncated image"):
        media.read_image(tmp_path / "half.png")
    (tmp_path / "words.png").write_bytes(b"words, not pixels\n" * 8)
    with pytest.raises(MediaError, match=r"words\.png' is not an image PIL can decode \(its bytes are not an image"):
        media.read_image(tmp_path / "words.png")


def test_ffmpeg_binary_is_checked(monkeypatch, tmp_path):
    assert media.check_ffmpeg()
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-ffmpeg"))
    with pytest.raises(MediaError, match=r"IMAGEIO_FFMPEG_EXE='.*no-ffmpeg': not an executable file"):
        media.check_ffmpeg()


def test_replacement_audio_is_named_in_its_own_errors(rng):
    frames = rng.integers(0, 255, (30, 32, 32, 3), dtype=np.uint8)
    audio = rng.uniform(-0.5, 0.5, (2, 32000)).astype(np.float32)  # 1 s: below the 2 s minimum
    ref = VideoRef(frames, audio=audio, source="clip.mp4", audio_source="short.wav")
    with pytest.raises(ValidationError, match=r"reference 1 \[video \(clip.mp4\)\] replacement audio 'short.wav' "
                                              r"lasts 1.000 s: each audio input must last 2-15 s"):
        validate_references([ref])
    own = VideoRef(frames, audio=audio, source="clip.mp4")
    with pytest.raises(ValidationError, match=r"\[video \(clip.mp4\)\] audio lasts 1.000 s"):
        validate_references([own, ImageRef(frames[0])])


# ------------------------------------------------------------------------------------------------ prompt bound
def test_token_limit_is_the_encoders_context(component_snapshot, tmp_path):
    cfg = json.loads((component_snapshot / "text_encoder" / "config.json").read_text())
    assert token_limit(component_snapshot) == cfg["text_config"]["max_position_embeddings"]
    (tmp_path / "text_encoder").mkdir()
    (tmp_path / "text_encoder" / "config.json").write_text('{"text_config": {}}')
    with pytest.raises(CheckpointError, match="does not state text_config.max_position_embeddings"):
        token_limit(tmp_path)


def test_prompt_bound_counts_what_the_tokenizer_gives(component_snapshot, text_encoder, rng):
    bound = PromptBound.from_pretrained(component_snapshot)
    alphabet = list("abc XYZ é 日本\n\t🙂") + ["<|vision_start|>", "<Picture 1>: ", "seconds>"]
    for _ in range(50):
        prompt = "".join(rng.choice(alphabet) for _ in range(int(rng.integers(0, 80))))
        assert bound.count(prompt) == len(text_encoder.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    limit = bound.limit
    assert bound.check("a" * limit) == limit  # at the limit: accepted (one byte-level token per 'a')
    with pytest.raises(ValidationError, match=f"prompt of {limit + 1:,} characters: {limit + 1:,} tokens, above "
                                              f"the text encoder's {limit:,}-token context") as err:
        bound.check("a" * (limit + 1))
    assert "does not truncate" in str(err.value) and "\n" not in str(err.value)


def test_encoder_refuses_an_overlong_presentation(text_encoder, rng):
    """The whole presentation -- labels and vision blocks included -- is bounded before the encoder runs."""
    from h3lab.components.references import Keyframe

    limit = text_encoder.max_tokens
    anchor = Keyframe(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), "first")
    ids, _, _ = text_encoder.present("x", [anchor])
    extra = len(ids) - 1
    text_encoder.present("a" * (limit - extra), [anchor])  # exactly at the limit
    with pytest.raises(ValidationError, match=f"{limit + 1:,} tokens \\({extra:,} of them for the anchors"):
        text_encoder.present("a" * (limit - extra + 1), [anchor])


def test_check_token_count():
    check_token_count(10, 10, "x" * 10)
    with pytest.raises(ValidationError, match="11 tokens, above the text encoder's 10-token context"):
        check_token_count(11, 10, "x" * 11)
