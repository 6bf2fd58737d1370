"""`h3lab verify DIR`: a sealed trajectory replays from the console with nothing to guess (exit 0, OK); replayed on
another model it names the first difference (exit 1); a folder it cannot replay is one stderr line (exit 2).
Training and GRPO job folders are verified the same way in tests/training (test_train_front_end, test_train_grpo)."""

from __future__ import annotations

import json

import pytest

from h3lab.frontends import cli


@pytest.fixture(scope="module")
def sealed(session, tmp_path_factory):
    """A trajectory of the fixture session's snapshot, sealed, and that snapshot's path."""
    root = tmp_path_factory.mktemp("verify-cli")
    result = session.generate("a fox", width=64, height=64, frames=22, steps=2, mode="off", seed=3)
    return result.trajectory.seal(root / "traj"), session.path


def test_a_sealed_trajectory_verifies_from_the_console(sealed, capsys):
    path, snapshot = sealed
    assert cli.main(["verify", str(path), "-d", str(snapshot), "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"trajectory {path}: rebuilt ") and out[1].startswith("OK: 2/2 passes byte-equal"), out


def test_another_model_is_a_difference_with_exit_1(sealed, capsys):
    path, _ = sealed
    assert cli.main(["verify", str(path), "--device", "cpu"]) == 1  # the embedded default: other weights
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("DRIFT at pass 0") and "checkpoint fingerprint differs" in out[1], out


def test_what_cannot_be_replayed_is_one_line_with_exit_2(sealed, tmp_path, capsys):
    path, _ = sealed
    junk = tmp_path / "junk"
    junk.mkdir()
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "job.json").write_text("{}")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text(json.dumps({"format": "h3lab-dataset/1"}))
    cases = [
        ([str(tmp_path / "nope")], "not a folder"),
        ([str(junk)], "no readable manifest.json"),
        ([str(tmp_path / "job")], "a job folder without a sealed run/"),
        ([str(tmp_path / "other")], "manifest format 'h3lab-dataset/1' is none of"),
        ([str(path), "-d", str(junk)], str(junk)),
        ([str(path), "--steps", "two"], "invalid int value: 'two'"),
        ([], "the following arguments are required: DIR"),
    ]
    for argv, expected in cases:
        assert cli.main(["verify", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("h3lab verify: error: ") and expected in err[0], (argv, err)
