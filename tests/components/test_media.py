"""Media I/O: MP4 (H.264 + AAC 32 kHz stereo) round trips with stream checks, WAV/PNG/image readers and writers,
resampling, atomic writes, pipes only, and clear errors on bad inputs."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from h3lab.components import media
from h3lab.components.media import MediaError
from h3lab.errors import H3Error


def moving_frames(rng, f=30, h=64, w=96) -> np.ndarray:
    """Smooth random-coloured frames with a square moving one pixel row per frame (codec-friendly, all distinct)."""
    y, x = np.mgrid[0:h, 0:w]
    base = rng.integers(40, 120, size=3)
    out = np.empty((f, h, w, 3), np.uint8)
    for i in range(f):
        img = np.stack([x + base[0], y + base[1], np.full_like(x, base[2])], -1)
        r = (i * 2) % (h - 16)
        img[r : r + 16, 8 + 2 * i : 24 + 2 * i] = (250, 240, 30)
        out[i] = np.clip(img, 0, 255)
    return out


def tone(freqs=(440.0, 660.0), seconds=1.25, rate=32000, amp=(0.5, 0.3), phase=(0.0, 0.0)) -> np.ndarray:
    t = np.arange(int(round(seconds * rate))) / rate
    return np.stack([a * np.sin(2 * np.pi * f * t + p) for f, a, p in zip(freqs, amp, phase)]).astype(np.float32)


def peak_hz(channel: np.ndarray, rate: int = 32000) -> float:
    spec = np.abs(np.fft.rfft(channel * np.hanning(channel.size)))
    return float(spec.argmax() * rate / channel.size)


def test_mp4_round_trip_streams_frames_and_audio(tmp_path, rng):
    frames = moving_frames(rng)
    audio = tone(phase=tuple(rng.uniform(0, 6.28, 2)))
    out = media.write_mp4(tmp_path / "clip.mp4", frames, fps=24, audio=audio)
    assert out == tmp_path / "clip.mp4" and sorted(os.listdir(tmp_path)) == ["clip.mp4"]  # no temp left behind

    info = media.probe(out)
    assert (info.video.codec, info.video.pix_fmt, info.video.width, info.video.height) == ("h264", "yuv420p", 96, 64)
    assert info.video.fps == 24.0 and info.frame_count == 30
    assert (info.audio.codec, info.audio.sample_rate, info.audio.channels) == ("aac", 32000, 2)

    decoded, fps = media.read_video(out)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8 and fps == 24.0
    # Lossy, but in order: every decoded frame is closer to its own source frame than to any other one, and at
    # crf 18 ("visually lossless") the mean error on smooth content stays within a few of 255 levels.
    err = np.abs(decoded[:, None].astype(np.int16) - frames[None].astype(np.int16)).mean(axis=(2, 3, 4))
    assert (err.argmin(axis=1) == np.arange(30)).all()
    assert err.diagonal().max() < 3.0

    sound = media.read_audio(out)
    assert sound.shape[0] == 2 and sound.dtype == np.float32
    # AAC frames are 1024 samples: the decode covers the input and adds at most one frame of padding.
    assert audio.shape[1] <= sound.shape[1] <= audio.shape[1] + 1024
    n = audio.shape[1]
    assert peak_hz(sound[0, :n]) == pytest.approx(440, abs=2) and peak_hz(sound[1, :n]) == pytest.approx(660, abs=2)
    # Channels stay apart and levels are kept (AAC at 192 kb/s: a few percent).
    corr = np.corrcoef(sound[0, 2048 : n - 2048], audio[0, 2048 : n - 2048])[0, 1]
    assert corr > 0.99
    assert np.std(sound[1, :n]) == pytest.approx(np.std(audio[1]), rel=0.05)


def test_mp4_without_audio_and_pipes_only(tmp_path, rng, monkeypatch):
    seen = []
    real = subprocess.Popen

    def spy(cmd, *args, **kwargs):
        seen.append((list(cmd), kwargs.get("pass_fds", ())))
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", spy)
    media.write_mp4(tmp_path / "silent.mp4", moving_frames(rng, f=5), fps=24)
    media.write_mp4(tmp_path / "loud.mp4", moving_frames(rng, f=5), fps=24, audio=tone(seconds=0.3))
    (silent_cmd, silent_fds), (loud_cmd, loud_fds) = seen
    inputs = lambda cmd: [cmd[i + 1] for i, a in enumerate(cmd) if a == "-i"]  # noqa: E731
    assert inputs(silent_cmd) == ["pipe:0"] and silent_fds == ()
    assert inputs(loud_cmd) == ["pipe:0", f"pipe:{loud_fds[0]}"] and len(loud_fds) == 1
    assert media.probe(tmp_path / "silent.mp4").audio is None
    assert media.probe(tmp_path / "silent.mp4").frame_count == 5
    with pytest.raises(MediaError, match="has no audio stream"):
        media.read_audio(tmp_path / "silent.mp4")


def test_mp4_failed_encode_keeps_previous_file(tmp_path, rng, monkeypatch):
    target = tmp_path / "keep.mp4"
    target.write_bytes(b"previous")
    false = shutil.which("false")
    monkeypatch.setattr(media, "ffmpeg_exe", lambda: false)
    with pytest.raises(MediaError, match="ffmpeg failed to encode"):
        media.write_mp4(target, moving_frames(rng, f=3), audio=tone(seconds=0.2))
    assert target.read_bytes() == b"previous" and sorted(os.listdir(tmp_path)) == ["keep.mp4"]


@pytest.mark.parametrize(
    "frames, audio, match",
    [
        (np.zeros((2, 33, 64, 3), np.uint8), None, r"frame size 64x33: H\.264 yuv420p needs even width and height"),
        (np.zeros((2, 32, 32, 3), np.float32), None, "dtype float32: must be uint8"),
        (np.zeros((32, 32, 3), np.uint8), None, r"shape \(32, 32, 3\): must be \(frames>=1, height, width, 3\)"),
        (np.zeros((2, 32, 32, 3), np.uint8), np.zeros((3, 100), np.float32), r"shape \(3, 100\): must be \(2, "),
        (np.zeros((2, 32, 32, 3), np.uint8), np.full((2, 10), np.nan, np.float32), "NaN or infinity"),
    ],
)
def test_mp4_bad_inputs(tmp_path, frames, audio, match):
    with pytest.raises(MediaError, match=match) as err:
        media.write_mp4(tmp_path / "x.mp4", frames, audio=audio)
    assert isinstance(err.value, H3Error) and "\n" not in str(err.value)
    assert os.listdir(tmp_path) == []


def test_wav_round_trip_is_exact_and_mono_is_duplicated(tmp_path, rng):
    audio = rng.uniform(-1, 1, size=(2, 12345)).astype(np.float32)
    media.write_wav(tmp_path / "a.wav", audio)
    info = media.probe(tmp_path / "a.wav")
    assert (info.audio.codec, info.audio.sample_rate, info.audio.channels) == ("pcm_f32le", 32000, 2)
    assert np.array_equal(media.read_audio(tmp_path / "a.wav"), audio)

    mono = rng.uniform(-1, 1, size=(1, 5000)).astype(np.float32)
    media.write_wav(tmp_path / "m.wav", mono)
    back = media.read_audio(tmp_path / "m.wav")
    assert back.shape == (2, 5000) and np.array_equal(back[0], mono[0]) and np.array_equal(back[1], mono[0])


def test_read_audio_resamples_to_32k(tmp_path, rng):
    f0, f1 = rng.uniform(300, 500), rng.uniform(900, 1200)
    audio = tone((f0, f1), seconds=1.0, rate=44100, amp=(0.4, 0.4))
    media.write_wav(tmp_path / "hi.wav", audio, sample_rate=44100)
    back = media.read_audio(tmp_path / "hi.wav")
    assert back.shape[0] == 2 and abs(back.shape[1] - 32000) <= 1
    assert peak_hz(back[0]) == pytest.approx(f0, abs=2) and peak_hz(back[1]) == pytest.approx(f1, abs=2)
    short = media.read_audio(tmp_path / "hi.wav", max_seconds=0.5)
    assert abs(short.shape[1] - 16000) <= 1


@pytest.mark.parametrize("fps", [30, 20, 25])
def test_read_video_resamples_to_24fps(tmp_path, fps):
    n = 20
    # Frame i is a flat grey 10*i + 20: identifiable after lossy coding.
    frames = np.repeat((np.arange(n, dtype=np.uint8) * 10 + 20)[:, None, None, None], 32 * 32 * 3).reshape(n, 32, 32, 3)
    media.write_mp4(tmp_path / "v.mp4", frames, fps=fps)
    native, native_fps = media.read_video(tmp_path / "v.mp4")
    assert native.shape[0] == n and native_fps == fps
    resampled, out_fps = media.read_video(tmp_path / "v.mp4", target_fps=24)
    idx = np.abs(resampled.mean(axis=(1, 2, 3))[:, None] - frames.mean(axis=(1, 2, 3))[None]).argmin(axis=1)
    assert out_fps == 24.0 and np.array_equal(idx, media.resample_frame_indices(n, fps, 24))
    assert resampled.shape[0] == int(np.floor(n * 24 / fps + 0.5))
    limited, _ = media.read_video(tmp_path / "v.mp4", max_frames=7)
    assert limited.shape[0] == 7


def test_read_video_applies_display_rotation(tmp_path, rng):
    media.write_mp4(tmp_path / "v.mp4", moving_frames(rng, f=4), fps=24)
    # Tag the same bitstream with a 90 degree display matrix (stream copy, no re-encode).
    subprocess.run(
        [media.ffmpeg_exe(), "-loglevel", "error", "-display_rotation", "90", "-i", str(tmp_path / "v.mp4"),
         "-c", "copy", str(tmp_path / "r.mp4")],
        check=True,
    )
    assert media.probe(tmp_path / "r.mp4").video.rotation == 90.0
    upright, _ = media.read_video(tmp_path / "v.mp4")
    turned, _ = media.read_video(tmp_path / "r.mp4")
    assert turned.shape == (4, 96, 64, 3) and np.array_equal(turned, np.rot90(upright, k=1, axes=(1, 2)))


def test_resample_frame_indices_matches_released_rule():
    from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3Ref2VASetupStep

    for n, fps in [(50, 30.0), (31, 29.97), (17, 12.5), (40, 60.0), (24, 24.0)]:
        # Frame i is encoded in its pixel value; frames are already at the canvas of their ratio (32x32 with a 32 px
        # short edge), so the released normalisation does only the frame resampling.
        frames = np.repeat(np.arange(n, dtype=np.uint8)[:, None, None, None], 32 * 32 * 3).reshape(n, 32, 32, 3)
        out = MiniMaxH3Ref2VASetupStep._normalize_video_condition(frames, fps, 10_000, 32, 32, 32 * 32, 24.0)
        assert np.array_equal(out[:, 0, 0, 0], media.resample_frame_indices(n, fps, 24.0))


def test_png_frames_and_read_image(tmp_path, rng):
    frames = rng.integers(0, 256, size=(3, 20, 30, 3), dtype=np.uint8)
    paths = media.write_png_frames(tmp_path / "frames", frames)
    assert [p.name for p in paths] == ["frame_00000.png", "frame_00001.png", "frame_00002.png"]
    assert sorted(os.listdir(tmp_path / "frames")) == [p.name for p in paths]
    for p, f in zip(paths, frames):
        assert np.array_equal(media.read_image(p), f)


def test_read_image_modes_and_orientation(tmp_path, rng):
    from PIL import Image

    rgba = rng.integers(0, 256, size=(10, 14, 4), dtype=np.uint8)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    assert np.array_equal(media.read_image(tmp_path / "a.png"), rgba[..., :3])
    grey = rng.integers(0, 256, size=(10, 14), dtype=np.uint8)
    Image.fromarray(grey, "L").save(tmp_path / "g.png")
    assert np.array_equal(media.read_image(tmp_path / "g.png"), np.repeat(grey[..., None], 3, axis=2))
    # EXIF orientation 6 (rotate 90 degrees clockwise to display) is applied, as diffusers' load_image does.
    img = rng.integers(0, 256, size=(10, 14, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(img).save(tmp_path / "r.png", exif=exif)
    assert np.array_equal(media.read_image(tmp_path / "r.png"), np.rot90(img, k=-1))


def test_missing_and_unreadable_files(tmp_path):
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"this is not a video at all" * 10)
    for fn in (media.probe, media.read_video, media.read_audio, media.read_image):
        with pytest.raises(MediaError, match="does not exist"):
            fn(tmp_path / "nope.mp4")
        with pytest.raises(MediaError, match="is not a regular file"):
            fn(tmp_path)
    with pytest.raises(MediaError, match="is not a media file ffmpeg can read"):
        media.probe(junk)
    with pytest.raises(MediaError, match="is not an image PIL can decode"):
        media.read_image(junk)
    media.write_wav(tmp_path / "s.wav", tone(seconds=0.1))
    with pytest.raises(MediaError, match="has no video stream"):
        media.read_video(tmp_path / "s.wav")
    with pytest.raises(MediaError, match="must be a positive integer"):
        media.read_video(tmp_path / "s.wav", max_frames=0)
    with pytest.raises(MediaError, match="frames directory .* is not a directory"):
        media.write_png_frames(tmp_path / "s.wav", np.zeros((1, 2, 2, 3), np.uint8))
