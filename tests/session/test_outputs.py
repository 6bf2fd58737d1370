"""Outputs of a generation: paths checked before any work (`io_utils.check_output_file` / `check_output_dir`), one
set written together -- every file to a temp first, all renamed only when all succeeded -- and errors that name the
user's path, never a temp file. Also: a cancel during the last pass stops before decoding."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from h3lab import io_utils
from h3lab.components import media
from h3lab.errors import OutputError
from h3lab.app.session import GenerationCancelled, check_outputs

SMALL = dict(width=64, height=64, frames=22, steps=2, mode="off")


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "path,suffixes,match",
    [
        ("out.avi", (".mp4",), "must end in .mp4"),
        ("/proc/x.mp4", (".mp4",), "folder '/proc' does not accept new files"),
        ("/proc/a/b/x.mp4", (".mp4",), "folder '/proc' does not accept new files"),
        ("FILE/x.mp4", (".mp4",), "is a file, so no folder can be created under it"),
        ("DIR.mp4", (".mp4",), "is an existing folder"),
        ("", (".mp4",), "must be a file or folder path"),
    ],
)
def test_check_output_file(tmp_path, path, suffixes, match):
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "DIR.mp4").mkdir()
    target = path.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path / "DIR"))
    before = listing(tmp_path)
    with pytest.raises(OutputError, match=match) as err:
        io_utils.check_output_file(target, suffixes, "output")
    assert "\n" not in str(err.value) and ".tmp" not in str(err.value) and ".h3lab-probe" not in str(err.value)
    assert listing(tmp_path) == before  # the writability probe leaves nothing


def test_check_output_dir_and_distinct(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        io_utils.check_output_dir(tmp_path / "f", "--frames-dir")
    with pytest.raises(OutputError, match="does not accept new files"):
        io_utils.check_output_dir("/proc/new/deeper", "--frames-dir")
    assert io_utils.check_output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # checking creates nothing
    with pytest.raises(OutputError, match="the same path as output"):
        check_outputs(tmp_path / "a.mp4", None, tmp_path / "a.mp4")
    paths = check_outputs(tmp_path / "a.mp4", tmp_path / "a.wav", tmp_path / "frames")
    assert paths == {"output": tmp_path / "a.mp4", "wav": tmp_path / "a.wav", "frames_dir": tmp_path / "frames"}


def test_write_all_then_rename_all(tmp_path, rng):
    (tmp_path / "old.bin").write_bytes(b"previous")

    def good(data):
        return lambda tmp: open(tmp, "wb").write(data)

    def broken(tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    items = [(tmp_path / "a.bin", good(b"a")), (tmp_path / "old.bin", good(b"new")), (tmp_path / "c.bin", broken)]
    with pytest.raises(OutputError, match=r"output '.*c\.bin': cannot write it \(No space left on device\)") as err:
        io_utils.atomic_write_all(items)
    assert ".tmp" not in str(err.value)
    assert listing(tmp_path) == ["old.bin"] and (tmp_path / "old.bin").read_bytes() == b"previous"
    written = io_utils.atomic_write_all(items[:2])
    assert written == [tmp_path / "a.bin", tmp_path / "old.bin"] and (tmp_path / "old.bin").read_bytes() == b"new"


def test_a_failing_generation_leaves_no_partial_outputs(session, tmp_path, monkeypatch):
    """The MP4 and the WAV are encoded but the frames fail: none of the three appears, no temp file is left."""
    real = media.png_frame_writers

    def failing(directory, frames, prefix="frame_"):
        items = real(directory, frames, prefix)

        def disk_full(tmp):
            raise OSError(28, "No space left on device", tmp)

        return items[:5] + [(items[5][0], disk_full)] + items[6:]

    monkeypatch.setattr(media, "png_frame_writers", failing)
    out = tmp_path / "out"
    with pytest.raises(OutputError) as err:
        session.generate("all or nothing", output=out / "v.mp4", wav=out / "v.wav", frames_dir=out / "frames",
                         **SMALL)
    message = str(err.value)
    assert "frame_00005.png" in message and "No space left on device" in message and ".tmp" not in message
    assert [p for p in listing(tmp_path) if not p.endswith(("out", "frames"))] == []  # folders at most, no files
    monkeypatch.setattr(media, "png_frame_writers", real)
    r = session.generate("all or nothing", output=out / "v.mp4", wav=out / "v.wav", frames_dir=out / "frames",
                         **SMALL)
    assert len(list((out / "frames").glob("*.png"))) == 22 and (out / "v.mp4").is_file() and (out / "v.wav").is_file()
    assert not [p for p in listing(tmp_path) if p.endswith(".tmp")]
    assert r.outputs == [(out / "v.mp4").resolve(), (out / "v.wav").resolve(), (out / "frames").resolve()]


def test_outputs_are_checked_before_any_work(session, tmp_path):
    before = (session.loaded, session.load_seconds, session.cache_info())
    with pytest.raises(OutputError, match="'/proc/x.wav': folder '/proc' does not accept new files"):
        session.generate("never run", wav="/proc/x.wav", **SMALL)
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(OutputError, match="exists and is not a folder"):
        session.generate("never run", frames_dir=tmp_path / "taken", **SMALL)
    assert (session.loaded, session.load_seconds, session.cache_info()) == before


def test_cancel_in_the_last_pass_stops_before_decoding(session, tmp_path):
    cancel = threading.Event()

    def progress(info):
        if info.step == info.total:
            cancel.set()

    with pytest.raises(GenerationCancelled, match="after pass 2 of 2, before decoding"):
        session.generate("stop late", progress=progress, cancel=cancel, output=tmp_path / "x.mp4", **SMALL)
    assert os.listdir(tmp_path) == []


def test_write_mp4_errors_name_the_target(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(media, "ffmpeg_exe", lambda: "/bin/false")
    with pytest.raises(media.MediaError, match=r"ffmpeg failed to encode MP4 '.*keep\.mp4'") as err:
        media.write_mp4(tmp_path / "keep.mp4", rng.integers(0, 255, (2, 32, 32, 3), dtype=np.uint8))
    assert ".tmp" not in str(err.value)


def test_auto_on_the_cpu_says_it_ran_torch(session, monkeypatch):
    """TRITON_INTERPRET=1 is exported (tests/conftest.py), yet auto runs the torch ops, and the summary line says so."""
    from h3lab.frontends import commands

    assert os.environ.get("TRITON_INTERPRET") == "1"
    auto = session.generate("what ran", **{**SMALL, "mode": "auto"})
    off = session.generate("what ran", **SMALL)
    assert auto.trajectory_hash == off.trajectory_hash  # the same arithmetic as off, not the interpreter's
    line = commands.what_ran(auto)
    assert line.startswith("ran auto → torch: 0 strict / ") and "in 2 forwards" in line
    assert "auto does not run Triton's interpreter" in line
    assert commands.what_ran(off).startswith("ran off: 0 strict / ")
