"""The one-shot CLI: end to end on a fresh machine (embedded tiny snapshot built on first use) producing an MP4 whose
streams and frame count are checked; flags, ordered references, -o '', --info, and one-line errors with exit 2."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from h3lab.frontends import cli
from h3lab.components import media
from h3lab.app.session import StepInfo
from session_helpers import ASSETS, subprocess_env

SMALL = ["--width", "64", "--height", "64", "--frames", "22", "--steps", "2", "--mode", "off"]


def test_end_to_end_on_a_fresh_machine(tmp_path):
    """`h3lab -p PROMPT -o out.mp4` with no -d and an empty cache: runs on the shipped default snapshot (nothing is
    built into the cache), generates."""
    h3lab = Path(sys.executable).with_name("h3lab")
    cache = tmp_path / "cache"
    cmd = [str(h3lab), "-p", "a red fox walks through snow", "-o", "fox.mp4", *SMALL, "--frames-dir", "frames",
           "--wav", "fox.wav", "--json"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(H3LAB_CACHE=str(cache)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    report = json.loads(proc.stdout)
    assert not cache.exists() or not any(cache.iterdir())  # the default ships in the package: nothing built
    assert report["frames"] == [22, 64, 64, 3] and report["audio"] == [2, 29600] and report["seed"] == 42
    assert len(report["trajectory_hash"]) == 64 and report["cached"]["text"] is False
    assert {"text_encode", "denoise", "decode_video", "decode_audio", "write"} <= set(report["timings"])

    info = media.probe(tmp_path / "fox.mp4")
    video, audio = info.video, info.audio
    assert (video.codec, video.width, video.height, video.fps) == ("h264", 64, 64, 24.0)
    assert info.frame_count == 22
    assert (audio.codec, audio.sample_rate, audio.channels) == ("aac", 32000, 2)
    frames, _ = media.read_video(tmp_path / "fox.mp4")
    assert frames.shape == (22, 64, 64, 3) and frames.std() > 0
    pngs = sorted((tmp_path / "frames").glob("*.png"))
    assert len(pngs) == 22
    wav = media.read_audio(tmp_path / "fox.wav")
    assert wav.shape == (2, 29600) and np.abs(wav).max() > 0


def test_no_mp4_with_empty_output_and_text_report(snapshot, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["-d", str(snapshot), "-p", "frames only", "-o", "", *SMALL, "--frames-dir", "f", "--profile",
                   "--first-frame", str(ASSETS / "first.png")])
    out = capsys.readouterr().out
    assert rc == 0
    assert not list(tmp_path.glob("*.mp4")) and len(list((tmp_path / "f").glob("*.png"))) == 22
    assert "fl2va 64x64 22f 2 steps seed 42 mode off" in out and "peak memory" in out and "text_encode" in out
    assert f"wrote {tmp_path / 'f'}" in out


def test_reference_flags_keep_command_line_order():
    args = cli.build_parser().parse_args([
        "-p", "x", "--ref-image", "a.png", "--ref-audio", "b.wav", "--ref-video-audio", "v.mp4", "w.wav",
        "--ref-silent-video", "s.mp4", "--ref-image", "c.png", "--ref-video", "d.mp4",
    ])
    s = cli.settings_from_args(args)
    assert [(r.kind, r.path, r.audio) for r in s.references] == [
        ("image", "a.png", None), ("audio", "b.wav", None), ("video-audio", "v.mp4", "w.wav"),
        ("silent-video", "s.mp4", None), ("image", "c.png", None), ("video", "d.mp4", None),
    ]
    assert s.task == "ref2va" and s.seed == 42 and s.steps == 20


def test_flags_map_onto_settings():
    args = cli.build_parser().parse_args(["-p", "x", "--width", "128", "--height", "64", "--render-width", "64",
                                          "--render-height", "32", "--seconds", "2", "--steps", "4", "--seed", "7",
                                          "--mode", "strict", "--reuse", "2"])
    s = cli.settings_from_args(args)
    assert (s.width, s.height, s.canvas, s.num_frames, s.steps, s.seed, s.mode, s.reuse) == (
        128, 64, (64, 32), 56, 4, 7, "strict", 2)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["-p", "x", "--width", "50"], "width=50: must be a multiple of 32"),
        (["-p", "x", "--frames", "3", "--seconds", "2"], "not allowed with argument"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["-p", "x", "--render-width", "64"], "set both or neither"),
        (["-p", "x", "--frames", "400"], "362-frame"),
        (["-p", "x", "--mode", "turbo"], "invalid choice: 'turbo'"),
        (["-p", "x", "--first-frame", "missing.png"], "no such file"),
        (["-p", "x", "--first-frame", "FIRST", "--ref-image", "FIRST"], "cannot be mixed"),
        (["--update"], "--update only goes with --replay"),
        (["-d", "/nonexistent/snapshot", "-p", "x"], "not a directory"),
        (["-p", "x", "-o", "out.avi"], "must end in .mp4"),
        (["-p", "x", "--ref-audio", "AUDIO"], "image or video reference"),
    ],
)
def test_errors_are_one_line_exit_2(argv, match, snapshot, capsys):
    argv = [a.replace("FIRST", str(ASSETS / "first.png")).replace("AUDIO", str(ASSETS / "tone.wav")) for a in argv]
    if "-d" not in argv:
        argv = ["-d", str(snapshot), *argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("h3lab: error: ") and match in err
    assert "Traceback" not in err


def test_info_text_and_json(snapshot, capsys):
    assert cli.main(["--info", "-d", str(snapshot)]) == 0
    out = capsys.readouterr().out
    assert "transformer_ref" in out and "one forward (transformer, off," in out
    assert cli.main(["--info", "--json", "-d", str(snapshot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["forward"]["video_out"][0] == 1 and report["forward"]["seconds"] > 0


def test_info_report_is_the_snapshot_report_plus_one_forward(snapshot):
    """`--info`'s model work lives in `h3lab.research.diagnostics` (the CLI only prints it)."""
    from h3lab.research import diagnostics
    from h3lab.checkpoint.info import snapshot_info
    from h3lab.config import H3Config
    from h3lab.execution.runtime import MODES

    report = diagnostics.info_report(snapshot, "cpu")
    forward = report.pop("forward")
    cfg = H3Config.tiny()
    # 8 text rows + 2x(4/2)x(4/2) video rows + 2 channels x 4 audio latents
    assert forward["rows"] == 24 and forward["device"] == "cpu" and forward["mode"] in MODES
    assert forward["video_out"] == [1, 8, cfg.video_patch_dim] and forward["audio_out"] == [1, 8, cfg.audio_in_channels]
    assert forward["seconds"] > 0
    plain = snapshot_info(snapshot, "cpu")
    assert {k: v for k, v in report.items() if k != "scan_s"} == {k: v for k, v in plain.items() if k != "scan_s"}
    assert "forward" not in diagnostics.info_report(snapshot, "cpu", forward=False)


def test_progress_bar_draws_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    stream = Tty()
    bar = cli.ProgressBar(stream, width=10)
    bar(StepInfo(1, 2, 0.1, 0.2, True, 0.5))
    bar(StepInfo(2, 2, 0.5, 0.6, False, 0.5))
    text = stream.getvalue()
    assert "\rdenoise [#####.....] 1/2" in text and "2/2" in text and "(reused)" in text and text.endswith("\n")
    quiet = io.StringIO()
    cli.ProgressBar(quiet)(StepInfo(1, 2, 0.1, 0.2, True, 0.5))
    assert quiet.getvalue() == ""


def test_python_module_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "h3lab.frontends.cli", "--width", "33", "-p", "x"], cwd=tmp_path,
                          env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == "h3lab: error: width=33: must be a multiple of 32\n"
