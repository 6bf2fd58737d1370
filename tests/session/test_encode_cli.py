"""`h3lab encode`'s bad inputs: a table of arguments, manifests and clips, each refused with exit 2 and one stderr
line per bad row or clip naming the value and the rule -- all of them before anything is encoded, no model loaded,
nothing written -- plus `--help`. The good path is the README's own-clips block (`test_own_clips.py`)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from h3lab.frontends import cli
from h3lab.components import media
from h3lab.components.store import ComponentStore

LIMIT_S = 5.0
PREFIX = "h3lab encode: error: "


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    d = tmp_path_factory.mktemp("encode-bad")
    v = d / "clips"
    v.mkdir()
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (24, 64, 64, 3), dtype=np.uint8)
    t = np.arange(32000) / 32000
    sound = (0.3 * np.stack([np.sin(2 * np.pi * 440 * t)] * 2)).astype(np.float32)
    media.write_mp4(v / "good.mp4", frames, fps=24, audio=sound)
    media.write_mp4(v / "good2.mp4", frames[::-1].copy(), fps=24, audio=sound)
    media.write_mp4(v / "silent.mp4", frames, fps=24)
    media.write_mp4(v / "short.mp4", frames[:12], fps=24, audio=sound[:, :16000])
    media.write_mp4(v / "odd.mp4", frames[:, :48, :48].copy(), fps=24, audio=sound)
    data = (v / "good.mp4").read_bytes()
    (v / "cut.mp4").write_bytes(data[: len(data) // 2])
    media.write_png_frames(v / "png", frames[:1])
    (v / "sub").mkdir()
    os.symlink(d / "outside.mp4", v / "link.mp4")
    media.write_mp4(d / "outside.mp4", frames, fps=24, audio=sound)
    (d / "junk").mkdir()
    (d / "junk" / "x.txt").write_text("x")
    return d


def write(d, name: str, text: str | bytes) -> str:
    path = d / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def run(argv, capsys):
    t0 = time.perf_counter()
    code = cli.main(["encode", *argv])
    out = capsys.readouterr()
    return code, out.err.strip().splitlines(), out.out, time.perf_counter() - t0


def cases(d):
    v = str(d / "clips")
    m = write(d, "m.csv", "file_name,prompt\ngood.mp4,a red fox\n")
    o = ["-o", str(d / "fresh")]
    base = ["--videos", v, "--manifest", m, *o]

    def rows(name, text, *extra):
        return ["--videos", v, "--manifest", write(d, name, text), *o, *extra]

    return [
        ("no-videos", ["--manifest", m, *o], ["the following arguments are required: --videos"]),
        ("videos-missing", ["--videos", str(d / "nope"), "--manifest", m, *o], ["--videos", "no such folder"]),
        ("manifest-suffix", rows("m.txt", "x"), ["must be a .csv or .jsonl file"]),
        ("manifest-missing", ["--videos", v, "--manifest", str(d / "nope.csv"), *o], ["nope.csv'", "no such file"]),
        ("manifest-empty", rows("empty.csv", ""), ["is empty (a header row"]),
        ("manifest-no-rows", rows("header.csv", "file_name,prompt\n"), ["has no rows"]),
        ("no-prompt-column", rows("np.csv", "file_name,title\ngood.mp4,x\n"),
         ["the prompt column must be exactly one of prompt, caption, text; it has none (columns: 'file_name', 'title')"]),
        ("two-clip-columns", rows("two.csv", "file_name,video,prompt\ngood.mp4,good.mp4,x\n"),
         ["the clip column must be exactly one of file_name, video, path; it has 2 (file_name, video)"]),
        ("extra-field", rows("extra.csv", "file_name,prompt\ngood.mp4,a fox,more\n"), ["line 2: more fields"]),
        ("jsonl-bad-line", rows("bad.jsonl", '{"video": "good.mp4", "prompt": "x"}\n{"video": \n'),
         ["bad.jsonl' line 2: not JSON"]),
        ("jsonl-not-object", rows("list.jsonl", '["good.mp4", "x"]\n'), ["line 1: must be a JSON object, not list"]),
        ("jsonl-prompt-type", rows("num.jsonl", '{"video": "good.mp4", "caption": 7}\n'),
         ["num.jsonl line 1: caption: prompt=7: must be a string"]),
        ("file-missing", rows("miss.csv", "file_name,prompt\nnope.mp4,x\n"),
         ["miss.csv line 2: file_name='nope.mp4': no such file in --videos"]),
        ("file-empty", rows("fe.csv", "file_name,prompt\n,x\n"), ["fe.csv line 2: file_name='': must name a clip"]),
        ("file-dir", rows("dir.csv", "file_name,prompt\nsub,x\n"), ["file_name='sub': not a regular file"]),
        ("escape-dotdot", rows("esc.csv", "file_name,prompt\n../outside.mp4,x\n"), ["'../outside.mp4': escapes --videos"]),
        ("escape-absolute", rows("abs.csv", f"file_name,prompt\n{d / 'outside.mp4'},x\n"), ["escapes --videos"]),
        ("escape-symlink", rows("sym.csv", "file_name,prompt\nlink.mp4,x\n"), ["'link.mp4': escapes --videos"]),
        ("duplicate", rows("dup.csv", "file_name,prompt\ngood.mp4,a\n./good.mp4,b\n"),
         ["dup.csv line 3: file_name='./good.mp4': the same clip as line 2"]),
        ("prompt-blank", rows("pb.csv", "file_name,prompt\ngood.mp4,   \n"), ["pb.csv line 2: prompt: prompt='   ': empty"]),
        ("prompt-zero-width", rows("zw.csv", "file_name,prompt\ngood.mp4,\u200b\u200b\n"), ["zw.csv line 2", "empty prompt"]),
        ("prompt-missing", rows("pm.csv", "file_name,prompt\ngood.mp4\n"), ["pm.csv line 2: no prompt"]),
        ("prompt-not-utf8", rows("u8.csv", b"file_name,prompt\ngood.mp4,fox \xed\xa0\x80 \xff\n"),
         ["u8.csv line 2: prompt: prompt: byte 0xed at character 5 is not UTF-8 text"]),
        ("clip-image", rows("img.csv", "file_name,prompt\npng/frame_00000.png,x\n"), ["line 2: video", "is an image, not a video"]),
        ("clip-truncated", rows("cut.csv", "file_name,prompt\ncut.mp4,x\n"), ["cut.mp4'", "truncated"]),
        ("clip-silent", rows("sil.csv", "file_name,prompt\nsilent.mp4,x\n"), ["silent.mp4': has no audio track"]),
        ("clip-short", rows("sh.csv", "file_name,prompt\nshort.mp4,x\n"), ["short.mp4': has 12 frames at 24 fps"]),
        ("clip-size", rows("sz.csv", "file_name,prompt\nodd.mp4,x\n"), ["is 48x48, not a canvas", "give a width"]),
        ("clip-frames", base + ["--frames", "39"], ["has 24 frames at 24 fps (1.000 s); frames=39 needs 39"]),
        ("width-alone", base + ["--width", "64"], ["--width 64 --height None: give both or neither"]),
        ("width-rule", base + ["--width", "70", "--height", "64"], ["width=70: must be a multiple of 32"]),
        ("frames-text", base + ["--frames", "many"], ["invalid int value: 'many'"]),
        ("out-is-file", ["--videos", v, "--manifest", m, "-o", str(d / "junk" / "x.txt")], ["x.txt"]),
        ("out-not-dataset", ["--videos", v, "--manifest", m, "-o", str(d / "junk")],
         ["is a folder that is not a sealed clip dataset"]),
        ("device", base + ["--device", "cuda"], ["cuda"]),
        ("snapshot", base + ["-d", str(d / "junk")], [f"error: snapshot '{d / 'junk'}' has no tokenizer/ folder"]),
        ("unknown-flag", base + ["--fps", "30"], ["unrecognized arguments: --fps"]),
        # Several bad rows: each named on its own line, the good ones not.
        ("several", rows("many.csv", "file_name,prompt\ngood.mp4,a fox\nnope.mp4,x\nsilent.mp4,y\ngood2.mp4,\n"),
         ["many.csv line 3: file_name='nope.mp4'", "many.csv line 5: prompt", "many.csv line 4: video"]),
    ]


def test_bad_inputs_are_named_before_any_encoding(d, tiny_snapshot, monkeypatch, capsys):
    def tripwire(self, name):
        raise AssertionError(f"{name} was loaded for a refused encode")

    monkeypatch.setattr(ComponentStore, "load", tripwire)
    for name, argv, messages in cases(d):
        if name == "device" and torch.cuda.is_available():
            continue
        if "-d" not in argv:
            argv = argv + ["-d", str(tiny_snapshot)]
        code, err, out, took = run(argv, capsys)
        assert code == 2, (name, err)
        assert err and all(line.startswith(PREFIX) for line in err), (name, err)
        assert len(err) == (3 if name == "several" else 1), (name, err)
        for message in messages:
            assert any(message in line for line in err), (name, message, err)
        assert "Traceback" not in "\n".join(err) and not out, (name, err)
        assert took < LIMIT_S, (name, took)
        assert not (d / "fresh").exists(), name


def test_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["encode", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--videos", "--manifest", "--out", "--width", "--frames", "--allow-silent"):
        assert flag in text


def test_progress_bar_draws_on_a_terminal_only():
    import io

    from h3lab.frontends.encode import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = Progress(stream, width=4)
        bar(1, 2, "a.mp4")
        bar(2, 2, "b.mp4")
    lines = tty.getvalue().split("\r")[1:]
    assert lines[0].startswith("encode [##..] 1/2 a.mp4 ") and lines[1].startswith("encode [####] 2/2 b.mp4 ")
    assert tty.getvalue().endswith("s/clip   \n") and pipe.getvalue() == ""
