"""The README's own-clips block (its "Train a LoRA" example), end to end: two short MP4s with sound and a CSV made
here, then the block's three commands exactly as written (`h3lab encode`, `h3lab train`, a generation with `--lora`), in-process through
the console entry point, on the embedded tiny snapshot (`H3LAB_CACHE` pointed at the test's seed-0 snapshot)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np

from h3lab.frontends import cli
from h3lab.checkpoint.tiny import TINY_VERSION
from h3lab.components import media
from h3lab.training.dataset import load_dataset

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_commands() -> list[list[str]]:
    block = re.search(r"<!-- own-clips -->\n```sh\n(.*?)```\n<!-- /own-clips -->", README.read_text(), re.S)
    assert block, "README lost its own-clips block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def make_clips(folder: Path) -> None:
    folder.mkdir()
    rng = np.random.default_rng(3)
    t = np.arange(32000) / 32000
    for i, (name, pitch) in enumerate((("fox_01.mp4", 330.0), ("fox_02.mp4", 550.0))):
        frames = rng.integers(0, 256, (24, 64, 64, 3), dtype=np.uint8)
        audio = 0.3 * np.stack([np.sin(2 * np.pi * pitch * t), np.sin(2 * np.pi * pitch * 1.5 * t)])
        media.write_mp4(folder / name, frames, fps=24, audio=audio.astype(np.float32))
    (folder / "metadata.csv").write_text('file_name,prompt\nfox_01.mp4,a red fox runs through snow\n'
                                         'fox_02.mp4,"a red fox, close up, barking"\n')


def test_readme_own_clips_commands_run_as_written(tiny_snapshot, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(tiny_snapshot, cache / f"{TINY_VERSION}-seed0")
    monkeypatch.setenv("H3LAB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    make_clips(tmp_path / "clips")
    commands = readme_commands()
    assert [c[:2] for c in commands] == [["h3lab", "encode"], ["h3lab", "train"], ["h3lab", "-p"]]
    outputs = []
    for argv in commands:
        code = cli.main(argv[1:])
        out = capsys.readouterr()
        assert code == 0, (argv, out.err)
        outputs.append(out.out)
    requests, digest = load_dataset(tmp_path / "data" / "fox")
    assert len(requests) == 2 and digest in outputs[0] and "encoded 2 clips" in outputs[0]
    assert all(r.layout.task == "t2va" for r in requests)
    trained = re.search(r"adapter ([0-9a-f]{64}) in ", outputs[1])
    assert "trained 2 steps" in outputs[1] and trained, outputs[1]
    adapter = json.loads((tmp_path / "runs" / "fox" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4
    # The generation ran with that adapter (its sha256 in the "ran" line) and wrote the MP4.
    assert f"with LoRA adapter x1 (sha256 {trained.group(1)[:12]})" in outputs[2], outputs[2]
    assert media.probe(tmp_path / "fox.mp4", count_frames=False).audio is not None
