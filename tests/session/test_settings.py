"""Every geometry / duration / conditioning-structure rule of `h3lab.schema.generation_settings` (no model, no media)."""

import math

import pytest

from h3lab.errors import H3Error, ValidationError
from h3lab.schema.generation_settings import (
    MAX_FRAMES,
    GenerationSettings,
    Reference,
    audio_latents,
    check_references,
    latent_frames,
    resolve_frames,
    snap_frames,
)


def settings(**kw):
    return GenerationSettings(prompt="a fox", **kw)


def rejects(match, **kw):
    with pytest.raises(ValidationError, match=match) as info:
        settings(**kw)
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, H3Error)
    return message


# ------------------------------------------------------------------------------------------------ size
@pytest.mark.parametrize("w,h", [(64, 64), (32, 128), (128, 32), (1344, 768), (768, 1344), (1024, 768), (32, 32)])
def test_legal_sizes(w, h):
    s = settings(width=w, height=h)
    assert (s.width, s.height) == (w, h)
    assert (s.latent_width, s.latent_height) == (w // 16, h // 16)


def test_size_multiple_of_32():
    assert "width=50" in rejects("multiple of 32", width=50)
    assert "height=100" in rejects("multiple of 32", height=100)


def test_size_at_least_32():
    assert "width=0" in rejects("at least 32", width=0)
    rejects("at least 32", height=-32)


def test_size_area_cap():
    # 1376x768 is a multiple of 32 with a legal aspect but 1,056,768 px > 768*1344.
    assert "1056768" in rejects("exceeds 768\\*1344", width=1376, height=768)


def test_size_aspect_limits():
    rejects("aspect ratio", width=160, height=32)  # 5:1
    rejects("aspect ratio", width=32, height=160)  # 1:5
    settings(width=128, height=32)  # 4:1 exactly is legal


def test_size_must_be_integer():
    rejects("must be an integer", width="64")
    rejects("must be an integer", height=64.5)


# ------------------------------------------------------------------------------------------------ render size
def test_render_size_rules():
    s = settings(width=128, height=64, render_width=64, render_height=32)
    assert s.canvas == (64, 32) and (s.latent_width, s.latent_height) == (4, 2)
    assert "without render_height" in rejects("set both or neither", width=128, height=64, render_width=64)
    assert "without render_width" in rejects("set both or neither", width=128, height=64, render_height=32)
    rejects("multiple of 32", width=128, height=128, render_width=48, render_height=48)
    rejects("aspect ratio differs", width=128, height=64, render_width=64, render_height=64)
    rejects("larger than the output", width=64, height=64, render_width=128, render_height=128)
    rejects("at least 32", width=64, height=64, render_width=0, render_height=0)


def test_new_size_drops_render_size_it_no_longer_fits():
    s = settings(width=128, height=128, render_width=64, render_height=64)
    t = s.replace(width=64, height=32)
    assert t.render_width is None and t.canvas == (64, 32)


# ------------------------------------------------------------------------------------------------ frames
@pytest.mark.parametrize(
    "requested,snapped", [(1, 22), (5, 22), (22, 22), (23, 39), (39, 39), (40, 56), (124, 124), (345, 345), (362, 362)]
)
def test_frames_snap_up_to_17n_plus_5(requested, snapped):
    assert snap_frames(requested) == snapped
    s = settings(frames=requested)
    assert s.num_frames == snapped and (snapped - 5) % 17 == 0
    reported = any(f"snapped up to {snapped}" in n for n in s.notices)
    assert reported == (requested != snapped)


def test_frames_maximum_362():
    assert settings(frames=MAX_FRAMES).num_frames == 362
    assert "snaps up to 379" in rejects("362-frame", frames=363)
    rejects("362-frame", frames=1000)


def test_frames_positive_and_integer():
    rejects("at least 1", frames=0)
    rejects("must be an integer", frames="22")


@pytest.mark.parametrize("seconds,frames", [(10, 243), (2, 56), (0.9166666666666666, 22), (1.0, 39), (15.0, 362),
                                            (5.0, 124), (0.01, 22)])
def test_seconds_round_up_to_next_legal_count(seconds, frames):
    s = settings(seconds=seconds)
    assert s.num_frames == frames
    assert any(f"-> {frames} frames" in n for n in s.notices)


def test_seconds_rules():
    rejects("362-frame", seconds=15.1)
    rejects("must be positive", seconds=0)
    rejects("must be positive", seconds=-1.0)
    rejects("finite", seconds=math.inf)
    rejects("finite", seconds=math.nan)


def test_frames_and_seconds_are_mutually_exclusive():
    rejects("one or the other", frames=22, seconds=1.0)
    # replace() switches between them instead of combining
    s = settings(frames=39).replace(seconds=2.0)
    assert s.frames is None and s.num_frames == 56
    t = s.replace(frames=22)
    assert t.seconds is None and t.num_frames == 22


def test_below_released_five_seconds_is_a_notice_not_an_error():
    short = settings(frames=22)
    assert any("below the released 5 s" in n for n in short.notices)
    long = settings(frames=124)
    assert not any("below the released" in n for n in long.notices)
    frames, notices = resolve_frames(None, 4.0)  # 96 frames -> 107 = 4.458 s
    assert frames == 107 and any("below the released" in n for n in notices)
    frames, notices = resolve_frames(None, 4.9)  # 118 frames -> 124 = 5.167 s: at or above 5 s after snapping
    assert frames == 124 and not any("below the released" in n for n in notices)
    # the default length (22 frames) is not news on every generation
    frames, notices = resolve_frames(None, None)
    assert frames == 22 and notices == [] and settings().notices == ()


def test_latent_geometry():
    for f, lf, a in [(22, 7, 37), (124, 37, 207), (243, 72, 405), (345, 102, 575), (362, 107, 603)]:
        assert latent_frames(f) == lf and audio_latents(f) == a
        s = settings(frames=f)
        assert (s.num_latent_frames, s.num_audio_latents) == (lf, a)
    with pytest.raises(ValidationError, match="17n\\+5"):
        latent_frames(23)


# ------------------------------------------------------------------------------------------------ steps, seed, mode
def test_steps_are_denoising_passes():
    s = settings(steps=20)
    assert s.num_points == 21
    rejects("between 1 and 1000", steps=0)
    rejects("between 1 and 1000", steps=1001)
    rejects("must be an integer", steps=2.5)


def test_reuse_rules():
    assert settings(steps=20, reuse=2).reuse == 2
    rejects("reuse=0", reuse=0)
    rejects("between 1 and steps=3", steps=3, reuse=4)


def test_seed_and_mode():
    assert settings().seed == 42
    rejects("seed=-1", seed=-1)
    rejects("seed=", seed=2**63)
    rejects("must be an integer", seed=True)
    rejects("mode='turbo'", mode="turbo")
    for mode in ("strict", "audit", "auto", "off"):
        assert settings(mode=mode).mode == mode


def test_unknown_setting_in_replace():
    with pytest.raises(ValidationError, match="unknown setting"):
        settings().replace(guidance=3.0)


# ------------------------------------------------------------------------------------ conditioning structure
def ref(kind, path="x", audio=None):
    return Reference(kind, path, audio)


def test_task_selection():
    assert settings().task == "t2va"
    assert settings(first="a.png").task == "fl2va"
    assert settings(last="b.png").task == "fl2va"
    assert settings(references=(ref("image"),)).task == "ref2va"


def test_anchors_and_references_cannot_be_mixed():
    rejects("cannot be mixed", first="a.png", references=(ref("image"),))
    rejects("cannot be mixed", last="a.png", references=(ref("video"),))


def test_reference_limits():
    check_references([ref("image")] * 9)
    with pytest.raises(ValidationError, match="9 are accepted"):
        check_references([ref("image")] * 10)
    with pytest.raises(ValidationError, match="video references: at most 3"):
        check_references([ref("video"), ref("silent-video"), ref("video-audio", audio="a"), ref("silent-video")])
    with pytest.raises(ValidationError, match="audio inputs: at most 3"):
        check_references([ref("image"), ref("audio"), ref("audio"), ref("video")] + [ref("audio")])
    check_references([ref("image"), ref("audio"), ref("audio"), ref("video")])  # 3 audio inputs are legal
    with pytest.raises(ValidationError, match="4 audio inputs"):  # a soundtrack counts as an audio input
        check_references([ref("audio"), ref("audio"), ref("video"), ref("video-audio", audio="a")])
    with pytest.raises(ValidationError, match="at most 12"):
        check_references([ref("image")] * 9 + [ref("silent-video")] * 3 + [ref("audio")])


def test_standalone_audio_needs_a_visual_reference():
    with pytest.raises(ValidationError, match="image or video reference"):
        check_references([ref("audio")])
    check_references([ref("audio"), ref("silent-video")])


def test_reference_kinds():
    with pytest.raises(ValidationError, match="reference kind 'sound'"):
        Reference("sound", "x")
    with pytest.raises(ValidationError, match="replacement audio"):
        Reference("video", "x", "y")
    with pytest.raises(ValidationError, match="replacement audio"):
        Reference("video-audio", "x")
    assert Reference("video-audio", "v", "a").audio_path == "a"
    assert Reference("video", "v").audio_path == "v" and Reference("silent-video", "v").audio_path is None


def test_paths_are_checked(tmp_path):
    good = tmp_path / "a.png"
    good.write_bytes(b"x")
    s = settings(first=str(good)).checked_paths()
    assert s.first == str(good)
    with pytest.raises(ValidationError, match="no such file"):
        settings(first=str(tmp_path / "missing.png")).checked_paths()
    with pytest.raises(ValidationError, match="not a regular file"):
        settings(references=(ref("image", str(tmp_path)),)).checked_paths()


def test_settings_are_frozen():
    s = settings()
    with pytest.raises(AttributeError):
        s.width = 128  # type: ignore[misc]


def test_readme_preset_table_cli_default_column_is_the_cli_default():
    """docs/presets.md's "CLI default" column says what runs without preset flags."""
    from session_helpers import REPO

    rows = {}
    for line in (REPO / "docs" / "presets.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] in ("Denoising passes", "Whole denoiser reuse", "Active DiT blocks",
                                            "Core residual reuse", "Token reduction", "Internal canvas"):
            rows[cells[0]] = cells[1]
    d = settings()
    assert rows["Denoising passes"] == f"`--steps {d.steps}`"
    assert rows["Whole denoiser reuse"] == "off (`--reuse 1`)" and d.reuse == 1
    assert rows["Active DiT blocks"] == "every block" and d.layers is None
    assert rows["Core residual reuse"] == "off (`--core-reuse 1`)" and d.core_reuse == 1
    assert rows["Token reduction"] == "off" and not d.token_reduction
    assert rows["Internal canvas"] == "output size" and d.render_width is None
