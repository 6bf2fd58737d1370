"""`--keep latents`: a one-shot generation sealing its trajectory with the latents rollouts need
(`--trajectory DIR`), and `!trajectory save PATH --keep latents` in the REPL after a hashes-only generation (its run
spec re-run, the digest checked). Both trajectories then serve `h3lab train --rollout` (`rollout_dataset`)."""

from __future__ import annotations

import pytest

from h3lab.frontends import cli, commands
from h3lab.errors import CommandError
from h3lab.app.session import Session
from h3lab.run.trajectory import TrajectoryError, check_keep, kept_kinds, load
from h3lab.training.dataset import rollout_dataset

GEN = ["--width", "64", "--height", "64", "--frames", "22", "--steps", "2", "--mode", "off", "--seed", "3"]


def test_check_keep(snapshot):
    assert check_keep("velocities,latents") == ("latents", "velocities") and check_keep(()) == ()
    for bad in ("latent", "", "latents,,noise"):
        with pytest.raises(TrajectoryError, match="must be latents, velocities, noise"):
            check_keep(bad, "--keep")
    with pytest.raises(TrajectoryError):
        Session(snapshot, device="cpu", keep="everything")
    assert commands.parse("!trajectory save t --keep velocities,latents").args == ("save", "t", ("latents", "velocities"))
    assert commands.parse("!trajectory save t").args == ("save", "t")
    with pytest.raises(CommandError, match="expects save|verify PATH"):
        commands.parse("!trajectory verify t --keep latents")


def test_one_shot_keep_latents_seals_a_rollout(snapshot, tmp_path, capsys):
    code = cli.main(["-d", str(snapshot), "-p", "a red fox", *GEN, "-o", "", "--keep", "latents",
                     "--trajectory", str(tmp_path / "traj")])
    out = capsys.readouterr().out
    assert code == 0, out
    trajectory = load(tmp_path / "traj")
    assert kept_kinds(trajectory) == ("latents",) and f"sealed in {tmp_path / 'traj'} with its latents" in out
    requests, _ = rollout_dataset([(tmp_path / "traj", 0.5)])
    assert len(requests) == 2  # one per pass


def test_repl_trajectory_save_keep_reruns_once_with_the_same_digest(state, tmp_path):
    state.base_dir = tmp_path
    commands.run_line(state, "a fox to keep")
    digest = state.last.trajectory_hash
    assert kept_kinds(state.last.trajectory) == ()
    with pytest.raises(CommandError, match="--keep 'all': must be latents"):
        commands.run_line(state, "!trajectory save a --keep all")
    lines = commands.run_line(state, "!trajectory save a --keep latents")
    assert lines[0].startswith("re-ran the last generation's run spec") and digest in lines[1]
    sealed = load(tmp_path / "a")
    assert sealed.digest == digest and kept_kinds(sealed) == ("latents",)
    assert commands.run_line(state, "!trajectory save b --keep latents") == [
        f"trajectory {digest} sealed in {tmp_path / 'b'}"]  # kept now: no second re-run
    requests, _ = rollout_dataset([(tmp_path / "b", -1.0)])
    assert requests
