"""Bad inputs fail before the work: every case runs the CLI and asserts exit status 2, exactly one stderr line that
names the offending value and the rule (no traceback, no exception class name), nothing written anywhere under the
working folder or the media folder, no model loaded and no REPL started, and the time before the error (< 5 s).

Most cases run in-process (`cli.main` with captured output, `Session.component` and the REPL replaced by tripwires);
the ones that need an environment variable or the console script's exit status run as subprocesses."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from h3lab.frontends import cli
from h3lab.components import media
from h3lab.app.session import Session
from session_helpers import ASSETS, subprocess_env

LIMIT_S = 5.0
CLASS_NAME = re.compile(r"\b[A-Z][A-Za-z]*(Error|Exception|Interrupt)\b")


class Tripwire(BaseException):
    """Raised where a bad input must never get to (a model load, the REPL); not an Exception, so the CLI's
    one-line handler cannot swallow it."""


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Good, bad and lying media, written once."""
    d = tmp_path_factory.mktemp("media")
    clip = (ASSETS / "clip.mp4").read_bytes()
    (d / "clip.mp4").write_bytes(clip)
    (d / "first.png").write_bytes((ASSETS / "first.png").read_bytes())
    (d / "trunc30.mp4").write_bytes(clip[: int(len(clip) * 0.3)])  # cut mid-stream: packets past the end
    (d / "trunc80.mp4").write_bytes(clip[: int(len(clip) * 0.8)])
    (d / "cut.mp4").write_bytes(clip[:1000])  # the index itself is cut
    (d / "header.mp4").write_bytes(clip[:40])  # 'ftyp' and nothing after it
    (d / "junk.mp4").write_bytes(b"this is not a video at all\n" * 20)
    png = (ASSETS / "first.png").read_bytes()
    (d / "trunc.png").write_bytes(png[: len(png) // 2])
    (d / "text.png").write_bytes(b"not an image\n" * 10)
    rng = np.random.default_rng(7)
    frames = rng.integers(0, 255, (30, 32, 32, 3), dtype=np.uint8)
    media.write_mp4(d / "silent.mp4", frames, fps=24)  # no audio stream
    from PIL import Image

    Image.fromarray(rng.integers(0, 255, (32, 288, 3), dtype=np.uint8)).save(d / "wide.png")  # 9:1

    def wav(name, seconds):
        t = np.arange(int(32000 * seconds)) / 32000
        media.write_wav(d / name, np.stack([np.sin(2 * np.pi * 330 * t)] * 2).astype(np.float32) * 0.3)

    wav("short.wav", 1.0)
    wav("tone.wav", 3.0)
    wav("long.wav", 16.0)
    data = (d / "tone.wav").read_bytes()
    (d / "trunc.wav").write_bytes(data[: len(data) // 3])  # the data chunk is shorter than its header says
    (d / "afile").write_text("a file, not a folder\n")
    (d / "adir").mkdir()
    (d / "adir.wav").mkdir()
    (d / "folder.mp4").mkdir()
    (d / "empty-snapshot").mkdir()
    (d / "bad-utf8.h3").write_bytes(b"!size 64x64\n!seed 3\nhello \xff world\n")
    (d / "typo.h3").write_text("!size 64x64\n!steps 2\n!mode off\n!nosuch 3\na fox\n")
    (d / "badarg.h3").write_text("!size 64\na fox\n")
    (d / "expect-first.h3").write_text("# expect 00ff\na fox\n")
    (d / "good.h3").write_text("!size 64x64\na fox\n")
    # the whole replay is validated before its first generation
    (d / "late-size.h3").write_text("!size 64x64\n!steps 1\n!mode off\na fox\n# expect[cpu_avx2] " + "0" * 64
                                    + "\n!size 100x100\na fox\n")
    (d / "late-first.h3").write_text("!size 64x64\n!steps 1\n!mode off\na fox\n!first /nope.png\na fox\n")
    (d / "late-strict-size.h3").write_text("!size 64x64\na fox\n!seconds 99\n")
    (d / "expect-nothex.h3").write_text("!size 64x64\na fox\n# expect[cpu_avx2] nothex\n")
    (d / "expect-short.h3").write_text("!size 64x64\na fox\n# expect " + "ab" * 16 + "\n")
    (d / "empty.h3").write_text("")
    (d / "expect-before.h3").write_text("# expect " + "a" * 64 + "\na fox\n")
    (d / "no-generation.h3").write_text("# only comments\n!size 64x64\n!steps 2\n")
    return d


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder below `root` (hidden ones too) -> (size, mtime_ns)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if p.is_file() else 0, st.st_mtime_ns)
    return out


@pytest.fixture
def no_work(monkeypatch):
    """Tripwires: any component load or a started REPL ends the test."""
    loads: list[str] = []

    def load(self, name):
        loads.append(name)
        raise Tripwire(f"model {name!r} loaded")

    def repl(*args, **kwargs):
        raise Tripwire("the REPL started")

    monkeypatch.setattr(Session, "component", load)
    import h3lab.frontends.repl

    monkeypatch.setattr(h3lab.frontends.repl, "run_repl", repl)
    return loads


def run_in_process(argv, cwd, capsys, monkeypatch):
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    t0 = time.perf_counter()
    rc = cli.main(argv)
    seconds = time.perf_counter() - t0
    cap = capsys.readouterr()
    return rc, cap.out, cap.err, seconds


def assert_one_line(rc, out, err, seconds, value, rule, as_json=False, limit=LIMIT_S):
    assert rc == 2, (rc, out, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and not CLASS_NAME.search(err), err
    if as_json:
        report = json.loads(err)
        assert report["exit"] == 2
        message = report["error"]
    else:
        assert err.startswith("h3lab: error: "), err
        message = err[len("h3lab: error: "):]
    assert value in message, f"value {value!r} not named in: {message}"
    assert rule in message, f"rule {rule!r} not stated in: {message}"
    assert out == "", out
    assert seconds < limit, f"{seconds:.2f} s before the error (limit {limit:.2f} s)"
    return message


# ------------------------------------------------------------------------------------------------ the cases
# (id, argv, value named, rule stated). Tokens: SNAP (the tiny snapshot), M/ (the media folder). Every case gets
# `-d SNAP` unless it names -d itself or is marked NO_D.
NO_D = "NO_D"
CASES = [
    # usage and flags that the chosen action would silently ignore
    ("bogus-flag", ["--bogus"], "--bogus", "unrecognized arguments"),
    ("width-not-int", ["-p", "x", "--width", "abc"], "'abc'", "invalid int value"),
    ("frames-and-seconds", ["-p", "x", "--frames", "3", "--seconds", "2"], "--seconds", "not allowed with"),
    ("mode-choice", ["-p", "x", "--mode", "turbo"], "'turbo'", "invalid choice"),
    ("residency-choice", ["-p", "x", "--residency", "cloud"], "'cloud'", "invalid choice"),
    ("prompt-missing-value", ["-p"], "-p", "expected one argument"),
    ("ref-video-audio-one-path", ["-p", "x", "--ref-video-audio", "M/clip.mp4"], "--ref-video-audio",
     "expected 2 arguments"),
    ("update-without-replay", ["--update"], "--update", "only goes with --replay"),
    ("prompt-with-replay", ["-p", "fox", "--replay", "M/good.h3"], "-p with --replay", "takes its prompts"),
    ("width-with-replay", ["--replay", "M/good.h3", "--width", "64"], "--width", "takes its prompts"),
    ("output-with-replay", ["--replay", "M/good.h3", "-o", "x.mp4"], "-o", "takes its prompts"),
    ("prompt-with-info", ["--info", "-p", "x"], "-p with --info", "only reports the snapshot"),
    ("output-with-info", ["--info", "-o", "x.mp4"], "-o with --info", "only reports the snapshot"),
    ("show-with-info", ["--info", "--show"], "--show with --info", "only reports the snapshot"),
    ("output-in-repl", ["-o", "x.mp4"], "-o with the interactive session", "numbers its videos"),
    ("wav-in-repl", ["--wav", "x.wav"], "--wav with the interactive session", "numbers its videos"),
    ("json-in-repl", ["--json"], "--json with the interactive session", "go with -p"),
    ("session-dir-without-show", ["-p", "x", "--session-dir", "d"], "--session-dir 'd'", "without --show"),
    # settings
    ("width-multiple", ["-p", "x", "--width", "50"], "width=50", "multiple of 32"),
    ("width-small", ["-p", "x", "--width", "0"], "width=0", "at least 32"),
    ("height-multiple", ["-p", "x", "--height", "33"], "height=33", "multiple of 32"),
    ("area", ["-p", "x", "--width", "2048", "--height", "1024"], "2048x1024", "exceeds 768*1344"),
    ("aspect", ["-p", "x", "--width", "32", "--height", "256"], "32x256", "outside 1:4..4:1"),
    ("frames-max", ["-p", "x", "--frames", "400"], "frames=400", "362-frame"),
    ("frames-zero", ["-p", "x", "--frames", "0"], "frames=0", "at least 1"),
    ("seconds-negative", ["-p", "x", "--seconds", "-1"], "seconds=-1", "must be positive"),
    ("seconds-max", ["-p", "x", "--seconds", "20"], "seconds=20", "362-frame"),
    ("seconds-nan", ["-p", "x", "--seconds", "nan"], "seconds=nan", "finite number"),
    ("steps-zero", ["-p", "x", "--steps", "0"], "steps=0", "between 1 and 1000"),
    ("steps-max", ["-p", "x", "--steps", "1001"], "steps=1001", "between 1 and 1000"),
    ("seed-negative", ["-p", "x", "--seed", "-1"], "seed=-1", "between 0 and 2**63-1"),
    ("reuse-zero", ["-p", "x", "--reuse", "0"], "reuse=0", "between 1 and steps"),
    ("reuse-above-steps", ["-p", "x", "--reuse", "5", "--steps", "2"], "reuse=5", "between 1 and steps=2"),
    # speed presets (h3lab.presets): the tiny snapshot's DiT has 2 blocks; its depth is read from its config
    ("layers-range", ["-p", "x", "--layers", "1"], "layers=1", "between 2 and 2 for this 2-block transformer"),
    ("layers-repl", ["--layers", "0"], "layers=0", "must be a positive integer"),
    ("core-reuse-max", ["-p", "x", "--core-reuse", "7"], "core_reuse=7", "between 1 and 6"),
    ("core-reuse-with-reuse", ["-p", "x", "--core-reuse", "2", "--reuse", "2"], "core_reuse=2 with reuse=2",
     "mutually exclusive"),
    ("token-reduction-256", ["-p", "x", "--token-reduction", "--width", "256", "--height", "256"],
     "token_reduction at 256x256", "refused"),
    ("token-reduction-shallow", ["-p", "x", "--token-reduction"], "token_reduction",
     "this transformer has 2 blocks"),
    ("zoom-without-show", ["-p", "x", "--zoom", "2"], "--zoom 2 without --show", "sizes the --show previews"),
    ("zoom-range", ["-p", "x", "--show", "--zoom", "9"], "--zoom=9", "between 1 and 8"),
    ("zoom-replay", ["--replay", "M/good.h3", "--zoom", "2"], "--zoom", "a replay takes its prompts"),
    ("render-one-side", ["-p", "x", "--render-width", "64"], "render_width=64", "set both or neither"),
    ("render-aspect", ["-p", "x", "--render-width", "64", "--render-height", "32"], "64x32", "aspect ratio differs"),
    ("render-larger", ["-p", "x", "--render-width", "1024", "--render-height", "1024"], "1024x1024", "larger than"),
    ("render-multiple", ["-p", "x", "--render-width", "48", "--render-height", "48"], "render_width=48",
     "multiple of 32"),
    ("settings-in-repl", ["--width", "50"], "width=50", "multiple of 32"),
    # the prompt
    ("prompt-empty", ["-p", ""], "prompt=''", "empty prompt"),
    ("prompt-blank", ["-p", "   "], "prompt='   '", "only whitespace"),
    ("prompt-tab-newline", ["-p", "\t\n"], "prompt='\\t\\n'", "only whitespace"),
    ("prompt-100k-chars", ["-p", "x" * 100_000, "-o", ""], "100,000 characters", "4,096-token context"),
    ("prompt-many-words", ["-p", "snow " * 3000, "-o", ""], "12,001 tokens", "does not truncate"),
    # outputs, checked before any model
    ("mp4-suffix", ["-p", "x", "-o", "out.avi"], "'out.avi'", "must end in .mp4"),
    ("mp4-proc", ["-p", "x", "-o", "/proc/x.mp4"], "'/proc/x.mp4'", "does not accept new files"),
    ("mp4-is-folder", ["-p", "x", "-o", "M/folder.mp4"], "folder.mp4'", "is an existing folder"),
    ("mp4-no-suffix", ["-p", "x", "-o", "M/adir"], "adir'", "must end in .mp4"),
    ("mp4-under-file", ["-p", "x", "-o", "M/afile/x.mp4"], "afile/x.mp4'", "is a file, so no folder"),
    ("wav-suffix", ["-p", "x", "--wav", "x.mp3"], "'x.mp3'", "must end in .wav"),
    ("wav-proc", ["-p", "x", "--wav", "/proc/x.wav"], "'/proc/x.wav'", "does not accept new files"),
    ("wav-is-folder", ["-p", "x", "--wav", "M/adir.wav"], "adir.wav'", "is an existing folder"),
    ("wav-same-as-output", ["-p", "x", "-o", "a.mp4", "--wav", "a.mp4"], "'a.mp4'", "must end in .wav"),
    ("frames-dir-is-file", ["-p", "x", "--frames-dir", "M/afile"], "afile'", "exists and is not a folder"),
    ("frames-dir-proc", ["-p", "x", "--frames-dir", "/proc/frames"], "'/proc/frames'", "does not accept new files"),
    ("frames-dir-under-file", ["-p", "x", "--frames-dir", "M/afile/sub"], "afile/sub'", "is a file, so no folder"),
    ("frames-dir-same-as-output", ["-p", "x", "-o", "same.mp4", "--frames-dir", "same.mp4"], "'same.mp4'",
     "same path as output"),
    ("show-previews-proc", ["-p", "x", "--show", "--session-dir", "/proc/s"], "/proc/s/previews",
     "does not accept new files"),
    ("repl-session-dir-file", ["--session-dir", "M/afile"], "afile'", "exists and is not a folder"),
    ("repl-session-dir-proc", ["--session-dir", "/proc/sess"], "'/proc/sess'", "does not accept new files"),
    ("replay-session-dir-proc", ["--replay", "M/good.h3", "--session-dir", "/proc/sess"], "'/proc/sess'",
     "does not accept new files"),
    ("replay-update-folder", ["--replay", "M/adir", "--update"], "adir'", "is an existing folder"),
    # the device
    ("device-cuda", ["-p", "x", "--device", "cuda"], "device='cuda'", "no CUDA"),
    ("device-cuda-1", ["-p", "x", "--device", "cuda:1"], "device='cuda:1'", "no CUDA"),
    ("device-mps", ["-p", "x", "--device", "mps"], "device='mps'", "runs on cpu or cuda"),
    ("device-name", ["-p", "x", "--device", "banana"], "device='banana'", "not a device name"),
    ("device-info", ["--info", "--device", "cuda"], "device='cuda'", "no CUDA"),
    ("device-repl", ["--device", "cuda"], "device='cuda'", "no CUDA"),
    # the snapshot
    ("snapshot-missing", [NO_D, "-d", "/nonexistent/snapshot", "-p", "x"], "'/nonexistent/snapshot'",
     "not a directory"),
    ("snapshot-is-file", [NO_D, "-d", "M/afile", "-p", "x"], "afile'", "not a directory"),
    ("snapshot-empty", [NO_D, "-d", "M/empty-snapshot", "-p", "x"], "empty-snapshot'", "has no tokenizer/ folder"),
    # anchors
    ("first-missing", ["-p", "x", "--first-frame", "missing.png"], "'missing.png'", "no such file"),
    ("first-folder", ["-p", "x", "--first-frame", "M/adir"], "adir'", "not a regular file"),
    ("first-is-video", ["-p", "x", "--first-frame", "M/clip.mp4"], "clip.mp4'", "it is a video"),
    ("first-truncated", ["-p", "x", "--first-frame", "M/trunc.png"], "trunc.png'", "truncated image"),
    ("first-not-image", ["-p", "x", "--first-frame", "M/text.png"], "text.png'", "not an image format"),
    ("last-is-audio", ["-p", "x", "--last-frame", "M/tone.wav"], "tone.wav'", "it is an audio file"),
    ("anchor-and-ref", ["-p", "x", "--first-frame", "M/first.png", "--ref-image", "M/first.png"], "anchors",
     "cannot be mixed"),
    # references
    ("ref-image-is-video", ["-p", "x", "--ref-image", "M/clip.mp4"], "clip.mp4'", "not an image"),
    ("ref-image-missing", ["-p", "x", "--ref-image", "nope.png"], "'nope.png'", "no such file"),
    ("ref-image-aspect", ["-p", "x", "--ref-image", "M/wide.png"], "wide.png", "within 1:4 and 4:1"),
    ("ref-video-is-image", ["-p", "x", "--ref-video", "M/first.png"], "first.png'", "not a video"),
    ("ref-video-silent", ["-p", "x", "--ref-video", "M/silent.mp4"], "silent.mp4'", "has no audio stream"),
    ("ref-video-truncated", ["-p", "x", "--ref-video", "M/trunc80.mp4"], "trunc80.mp4'", "is truncated"),
    ("ref-silent-truncated", ["-p", "x", "--ref-silent-video", "M/trunc30.mp4"], "trunc30.mp4'", "is truncated"),
    ("ref-silent-is-audio", ["-p", "x", "--ref-silent-video", "M/tone.wav"], "tone.wav'", "not a video"),
    ("ref-video-index-cut", ["-p", "x", "--ref-video", "M/cut.mp4"], "cut.mp4'", "truncated or unfinished MP4"),
    ("ref-video-header-only", ["-p", "x", "--ref-video", "M/header.mp4"], "header.mp4'", "is truncated"),
    ("ref-video-junk", ["-p", "x", "--ref-video", "M/junk.mp4"], "junk.mp4'", "not a media file"),
    ("ref-video-audio-short-wav", ["-p", "x", "--ref-video-audio", "M/clip.mp4", "M/short.wav"], "short.wav'",
     "must last 2-15 s"),
    ("ref-video-audio-image", ["-p", "x", "--ref-video-audio", "M/clip.mp4", "M/first.png"], "first.png'",
     "no audio stream"),
    ("ref-video-audio-truncated", ["-p", "x", "--ref-video-audio", "M/clip.mp4", "M/trunc.wav"], "trunc.wav'",
     "is truncated"),
    ("ref-audio-alone", ["-p", "x", "--ref-audio", "M/tone.wav"], "standalone audio", "image or video reference"),
    ("ref-audio-short", ["-p", "x", "--ref-image", "M/first.png", "--ref-audio", "M/short.wav"], "1.000 s",
     "must last 2-15 s"),
    ("ref-audio-long", ["-p", "x", "--ref-image", "M/first.png", "--ref-audio", "M/long.wav"], "16.000 s",
     "must last 2-15 s"),
    ("ref-audio-is-image", ["-p", "x", "--ref-image", "M/first.png", "--ref-audio", "M/first.png"], "first.png'",
     "no audio stream"),
    ("ref-audio-truncated", ["-p", "x", "--ref-image", "M/first.png", "--ref-audio", "M/trunc.wav"], "trunc.wav'",
     "is truncated"),
    ("ref-images-count", ["-p", "x", *["--ref-image", "M/first.png"] * 10], "10 image references", "at most 9"),
    ("ref-videos-count", ["-p", "x", *["--ref-silent-video", "M/clip.mp4"] * 4], "4 video references",
     "at most 3"),
    ("ref-audio-inputs-count", ["-p", "x", "--ref-image", "M/first.png", *["--ref-audio", "M/tone.wav"] * 4],
     "4 audio inputs", "at most 3"),
    # invisible and undecodable prompts, streaming flags that change nothing on a CPU
    ("prompt-invalid-utf8", ["-p", "fox \udced\udca0\udc80 \udcff"], "byte 0xed at character 5", "not UTF-8"),
    ("prompt-zero-width-only", ["-p", "\u200b\u200b\ufeff"], "prompt=", "empty prompt"),
    ("prompt-nbsp-only", ["-p", "\u00a0 \u00a0"], "prompt=", "empty prompt"),
    ("residency-streamed-cpu", ["-p", "x", "--residency", "streamed", "--device", "cpu"], "--residency streamed",
     "on the cpu"),
    ("gpu-memory-cpu", ["-p", "x", "--gpu-memory", "8", "--device", "cpu"], "--gpu-memory 8", "on the cpu"),
    # replays
    ("replay-missing", ["--replay", "missing.h3"], "'missing.h3'", "No such file"),
    ("replay-folder", ["--replay", "M/adir"], "adir'", "Is a directory"),
    ("replay-bad-utf8", ["--replay", "M/bad-utf8.h3"], "bad-utf8.h3:3", "byte 0xff at column 7 is not UTF-8"),
    ("replay-typo-parsed-first", ["--replay", "M/typo.h3"], "typo.h3:4", "unknown command !nosuch"),
    ("replay-bad-argument", ["--replay", "M/badarg.h3"], "badarg.h3:1", "WIDTHxHEIGHT"),
    ("replay-expect-first", ["--replay", "M/expect-first.h3"], "expect-first.h3:1", "64 lowercase hex digits"),
    ("replay-expect-before-generation", ["--replay", "M/expect-before.h3"], "expect-before.h3:1",
     "without a generation line"),
    ("replay-late-size", ["--replay", "M/late-size.h3"], "late-size.h3:6", "width=100"),
    ("replay-late-first", ["--replay", "M/late-first.h3"], "late-first.h3:5", "/nope.png"),
    ("replay-late-seconds", ["--replay", "M/late-strict-size.h3"], "late-strict-size.h3:3", "seconds=99"),
    ("replay-expect-nothex", ["--replay", "M/expect-nothex.h3"], "expect-nothex.h3:3", "64 lowercase hex digits"),
    ("replay-expect-short", ["--replay", "M/expect-short.h3"], "expect-short.h3:3", "64 lowercase hex digits"),
    ("replay-empty", ["--replay", "M/empty.h3"], "empty.h3", "no generation line"),
    ("replay-no-generation", ["--replay", "M/no-generation.h3"], "no-generation.h3", "no generation line"),
    ("allow-unchecked-without-replay", ["-p", "x", "--allow-unchecked"], "--allow-unchecked",
     "only goes with --replay"),
    # --keep / --trajectory (rollouts from the CLI); `h3lab encode`'s table is test_encode_cli.py
    ("keep-unknown", ["-p", "x", "--keep", "latent", "--trajectory", "t"], "--keep 'latent'",
     "must be latents, velocities, noise or several of them"),
    ("keep-empty-entry", ["-p", "x", "--keep", "latents,", "--trajectory", "t"], "--keep 'latents,'", "must be"),
    ("keep-without-trajectory", ["-p", "x", "--keep", "latents"], "--keep latents", "give --trajectory DIR"),
    ("trajectory-suffix", ["-p", "x", "--trajectory", "t.json"], "--trajectory 't.json'",
     "a sealed trajectory is a folder"),
    ("trajectory-is-output", ["-p", "x", "--trajectory", "same", "--frames-dir", "same"], "--trajectory 'same'",
     "name the same path"),
    ("trajectory-in-repl", ["--trajectory", "t"], "--trajectory", "the REPL seals with !trajectory save PATH"),
    ("keep-with-replay", ["--replay", "missing.h3", "--keep", "latents"], "--keep", "a replay takes"),
    ("keep-unknown-repl", ["--keep", "all"], "--keep 'all'", "must be latents"),
]
JSON_CASES = ["width-multiple", "mp4-proc", "prompt-blank", "ref-video-truncated", "bogus-flag", "device-cuda"]


def _argv(case_argv, files, snapshot):
    argv = [a.replace("M/", f"{files}/") for a in case_argv]
    if argv and argv[0] == NO_D:
        return argv[1:]
    return ["-d", str(snapshot), *argv]


def test_enough_cases():
    assert len(CASES) + len(SUBPROCESS_CASES) >= 80
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,argv,value,rule", CASES, ids=[c[0] for c in CASES])
def test_bad_input(name, argv, value, rule, files, snapshot, tmp_path, capsys, monkeypatch, no_work):
    before, media_before = tree(tmp_path), tree(files)
    rc, out, err, seconds = run_in_process(_argv(argv, files, snapshot), tmp_path, capsys, monkeypatch)
    assert_one_line(rc, out, err, seconds, value.replace("M/", f"{files}/"), rule, as_json="--json" in argv)
    assert no_work == []
    assert tree(tmp_path) == before and tree(files) == media_before  # nothing written, no temp file left


@pytest.mark.parametrize("name", JSON_CASES)
def test_json_errors_are_json(name, files, snapshot, tmp_path, capsys, monkeypatch, no_work):
    _, argv, value, rule = next(c for c in CASES if c[0] == name)
    argv = [*_argv(argv, files, snapshot), "--json"]
    if "-p" not in argv:  # --json belongs to -p / --info; keep the case's own error first
        argv = [*argv, "-p", "x"]
    rc, out, err, seconds = run_in_process(argv, tmp_path, capsys, monkeypatch)
    assert_one_line(rc, out, err, seconds, value, rule, as_json=True)


# ------------------------------------------------------------------------------------------------ subprocesses
@pytest.fixture(scope="module")
def startup_s() -> float:
    """What a child process spends before h3lab can say anything: the interpreter and the imports of the CLI and
    the session (torch). A subprocess case gets LIMIT_S on top of it (the machine may be shared and loaded)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import h3lab.frontends.cli, h3lab.app.session"], env=subprocess_env(), check=True,
                   timeout=120)
    return time.perf_counter() - t0


def _console(*args, env=None, cwd=None):
    h3lab = Path(sys.executable).with_name("h3lab")
    t0 = time.perf_counter()
    proc = subprocess.run([str(h3lab), *args], capture_output=True, text=True, env=env or subprocess_env(), cwd=cwd,
                          timeout=120)
    return proc.returncode, proc.stdout, proc.stderr, time.perf_counter() - t0


SUBPROCESS_CASES = [
    ("cache-proc", {"H3LAB_CACHE": "/proc/nocache"}, ["-p", "x"], "H3LAB_CACHE '/proc/nocache'",
     "does not accept new files"),
    ("cache-is-file", {"H3LAB_CACHE": "M/afile"}, ["-p", "x"], "afile'", "exists and is not a folder"),
    ("cache-under-file", {"H3LAB_CACHE": "M/afile/cache"}, ["-p", "x"], "afile/cache'", "is a file"),
    ("ffmpeg-missing", {"IMAGEIO_FFMPEG_EXE": "/nonexistent/ffmpeg"}, ["-d", "SNAP", "-p", "x"],
     "IMAGEIO_FFMPEG_EXE='/nonexistent/ffmpeg'", "not an executable file"),
    ("console-bogus", {}, ["--bogus"], "--bogus", "unrecognized arguments"),
    ("console-device", {}, ["-d", "SNAP", "-p", "x", "--device", "cuda"], "device='cuda'", "no CUDA"),
    # strict on a CPU without Triton's interpreter is refused with the flags, not at the first kernel
    ("strict-cpu-no-interpreter", {}, ["-d", "SNAP", "-p", "x", "--mode", "strict", "--device", "cpu"],
     "--mode strict on the cpu", "export TRITON_INTERPRET=1 before starting h3lab"),
    ("strict-cpu-repl-no-interpreter", {}, ["-d", "SNAP", "--mode", "strict", "--device", "cpu"],
     "--mode strict on the cpu", "export TRITON_INTERPRET=1 before starting h3lab"),
]


@pytest.mark.parametrize("name,env,argv,value,rule", SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_bad_environment_in_a_subprocess(name, env, argv, value, rule, files, snapshot, tmp_path, startup_s):
    env = {k: v.replace("M/", f"{files}/") for k, v in env.items()}
    argv = [a.replace("SNAP", str(snapshot)) for a in argv]
    before, media_before = tree(tmp_path), tree(files)
    rc, out, err, seconds = _console(*argv, env=subprocess_env(**env), cwd=tmp_path)
    assert_one_line(rc, out, err, seconds, value.replace("M/", f"{files}/"), rule, limit=LIMIT_S + startup_s)
    assert tree(tmp_path) == before and tree(files) == media_before


def test_json_error_from_the_console_script(tmp_path, startup_s):
    rc, out, err, seconds = _console("-p", "x", "--json", "--width", "50", cwd=tmp_path)
    assert_one_line(rc, out, err, seconds, "width=50", "multiple of 32", as_json=True, limit=LIMIT_S + startup_s)


def test_strict_on_a_cpu_without_the_interpreter_is_refused_before_any_work(snapshot, monkeypatch, no_work):
    """In-process: `!mode strict` refuses (settings unchanged) on a started CPU session, and a
    session given strict refuses `generate` and `check_request` before any component loads."""
    from h3lab.frontends import commands
    from h3lab.errors import ValidationError

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    session = Session(snapshot, device="cpu")
    state = commands.SessionState(session=session)
    before = state.settings
    with pytest.raises(ValidationError, match="!mode strict on the cpu: .*export TRITON_INTERPRET=1") as err:
        commands.run_line(state, "!mode strict")
    assert state.settings is before and "\n" not in str(err.value)
    assert commands.run_line(state, "!mode off")[0] == "mode off"
    for call in (lambda: session.generate("a fox", mode="strict", width=64, height=64, steps=1),
                 lambda: session.check_request(session.settings("a fox", mode="strict"))):
        with pytest.raises(ValidationError, match="mode strict on the cpu"):
            call()
    assert no_work == []
