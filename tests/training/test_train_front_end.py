"""`h3lab train`: a table of bad arguments, each refused with exit 2, one stderr line naming the value and the rule,
before any model loads and fast; a LoRA fine-tune on a sealed clip dataset run uninterrupted and, in another folder,
interrupted after a checkpoint and resumed -- byte-equal adapter, step records, run digest and weights; and a
reward-weighted update over sealed rollouts through `h3lab train` (the console dispatch)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from training_cases import make_clip, make_layout

from h3lab import H3Config
from h3lab.frontends import cli, train
from h3lab.app.session import Session
from h3lab.training import load, read_adapter, verify
from h3lab.training.dataset import save_dataset
from pathlib import Path

from h3lab.training.job import CHECKPOINTS, latest_checkpoint, load_model, run_job

TINY = H3Config.tiny()
LIMIT_S = 5.0


class Tripwire(BaseException):
    """Raised if a bad argument got as far as loading a model."""


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_snapshot):
    d = tmp_path_factory.mktemp("train-data")
    layout = make_layout("fl2va")
    save_dataset(d / "clips", [make_clip(TINY, layout, seed=s) for s in (1, 2, 3)])
    from training_cases import SMALL

    save_dataset(d / "wide", [make_clip(SMALL, layout, seed=1)])  # rows of another model's widths
    session = Session(tiny_snapshot, device="cpu")
    gen = dict(width=64, height=64, frames=22, steps=2, mode="off")
    session.generate("a red fox", seed=1, **gen).trajectory.seal(d / "nokeep")
    session.keep = ("latents",)
    for seed in (1, 2):
        session.generate("a red fox", seed=seed, **gen).trajectory.seal(d / f"rollout{seed}")
    (d / "junk").mkdir()
    (d / "junk" / "x.txt").write_text("x")
    return d


def run(argv, capsys) -> tuple[int, list[str], str]:
    code = train.main(argv)
    out = capsys.readouterr()
    return code, out.err.strip().splitlines(), out.out


def bad_cases(d, snap):
    c = ["--clips", str(d / "clips")]
    o = ["--out", str(d / "fresh-out")]
    return [
        ("no-out", c, "--out"),
        ("no-data", o, "give the data once"),
        ("both-data", c + o + ["--rollout", str(d / "rollout1"), "1"], "not both"),
        ("clips-missing", ["--clips", str(d / "nope")] + o, "is not a sealed clip dataset"),
        ("clips-not-dataset", ["--clips", str(d / "junk")] + o, "manifest.json is missing"),
        ("clips-wrong-width", ["--clips", str(d / "wide")] + o, "rows are 12 wide; this transformer takes 16"),
        ("rollout-missing", ["--rollout", str(d / "nope"), "1"] + o, "--rollout"),
        ("rollout-reward", ["--rollout", str(d / "rollout1"), "good"] + o, "reward 'good': must be a number"),
        ("rollout-reward-inf", ["--rollout", str(d / "rollout1"), "inf"] + o, "must be a finite number"),
        ("rollout-no-latents", ["--rollout", str(d / "nokeep"), "1"] + o, "lacks kept latents"),
        ("rank", c + o + ["--rank", "0"], "--rank 0: must be an integer >= 1"),
        ("rank-text", c + o + ["--rank", "two"], "invalid int value: 'two'"),
        ("alpha", c + o + ["--alpha", "-1"], "--alpha -1.0: must be a finite number > 0"),
        ("targets", c + o + ["--targets", "to_q,to_qq"], "LoRA target 'to_qq' matches no module"),
        ("targets-empty", c + o + ["--targets", "to_q,"], "LoRA target ''"),
        ("targets-norm", c + o + ["--targets", "norm1"], "LoRA wraps projections"),
        ("steps", c + o + ["--steps", "0"], "--steps 0: must be an integer >= 1"),
        ("batch", c + o + ["--batch-size", "0"], "--batch-size 0: must be an integer >= 1"),
        ("lr", c + o + ["--lr", "0"], "--lr 0.0: must be a finite number > 0"),
        ("weight-decay", c + o + ["--weight-decay", "-1"], "--weight-decay -1.0: must be a finite number >= 0"),
        ("objective", c + o + ["--video-weight", "0", "--audio-weight", "0"], "at least one modality"),
        ("mode", c + o + ["--mode", "fast-ish"], "invalid choice: 'fast-ish'"),
        ("checkpoint-every", c + o + ["--checkpoint-every", "0"], "--checkpoint-every 0: must be an integer >= 1"),
        ("lora-seed", c + o + ["--lora-seed", "-2"], "--lora-seed -2: must be an integer >= 0"),
        ("variant", c + o + ["--variant", "transformer_x"], "--variant 'transformer_x'"),
        ("device", c + o + ["--device", "cuda"], "cuda"),
        ("snapshot", c + o + ["-d", str(d / "junk")], "not a MiniMax-H3 snapshot folder"),
        ("out-is-file", c + ["--out", str(d / "junk" / "x.txt")], "x.txt"),
        ("out-not-job", c + ["--out", str(d / "junk")], "is a folder of other files"),
        ("resume-nothing", c + o + ["--resume"], "holds no training job"),
        ("unknown-flag", c + o + ["--lora-rank", "4"], "unrecognized arguments: --lora-rank"),
    ]


def test_bad_arguments_fail_fast_with_one_line(data, tiny_snapshot, monkeypatch, capsys):
    import h3lab.training.job as job_module

    def tripwire(*a, **k):
        raise Tripwire("a model was loaded")

    monkeypatch.setattr(job_module, "load_model", tripwire)
    for name, argv, message in bad_cases(data, tiny_snapshot):
        if name == "device" and torch.cuda.is_available():
            continue
        t0 = time.perf_counter()
        code, err, out = run(argv + ["--mode", "off"] if "--mode" not in argv else argv, capsys)
        took = time.perf_counter() - t0
        assert code == 2, (name, err)
        assert len(err) == 1 and err[0].startswith("h3lab train: error: "), (name, err)
        assert message in err[0], (name, err[0])
        assert "Traceback" not in err[0] and "Error:" not in err[0].removeprefix("h3lab train: error:"), err[0]
        assert took < LIMIT_S, (name, took)
        assert not (data / "fresh-out").exists(), name
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code, err, _ = run(["--clips", str(data / "clips"), "--out", str(data / "fresh-out"), "--device", "cpu"], capsys)
    assert code == 2 and "TRITON_INTERPRET=1" in err[0]  # strict (the default) on the CPU needs the interpreter


def job_argv(data, out, *extra):
    return ["--clips", str(data / "clips"), "--out", str(out), "--rank", "2", "--alpha", "4", "--steps", "4",
            "--batch-size", "2", "--lr", "1e-2", "--checkpoint-every", "2", "--mode", "off", "--seed", "3",
            "--device", "cpu", *extra]


def test_resume_is_byte_equal_to_an_uninterrupted_run(data, tmp_path, capsys):
    code, err, out = run(job_argv(data, tmp_path / "whole"), capsys)
    assert code == 0, err
    assert "trained 4 steps" in out and "sealed run in" in out
    whole = tmp_path / "whole"
    assert sorted(p.name for p in whole.iterdir()) == ["adapter", "checkpoints", "initial", "job.json", "run"]
    assert [p.name for p in (whole / CHECKPOINTS).iterdir()] == ["step-000004"]  # the final step; older removed

    # interrupted after step 3 (the checkpoint of step 2 is on disk), then resumed with the same arguments
    parsed = train.build_parser().parse_args(job_argv(data, tmp_path / "cut"))
    job = train.job_from_args(parsed)

    def stop(step, total, record):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(job, load_model(job), progress=stop)
    assert latest_checkpoint(tmp_path / "cut").name == "step-000002" and not (tmp_path / "cut" / "adapter").exists()
    code, err, _ = run(job_argv(data, tmp_path / "cut", "--resume"), capsys)
    assert code == 0, err

    a, b = load(whole / "run"), load(tmp_path / "cut" / "run")
    assert a.digest == b.digest and a.steps == b.steps and len(a.steps) == 4
    assert a.manifest["adapter"] == b.manifest["adapter"]
    assert a.manifest["adapter"]["final_sha256"] == read_adapter(whole / "adapter").sha256
    assert a.manifest["adapter"]["initial_sha256"] != a.manifest["adapter"]["final_sha256"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (whole / "adapter" / name).read_bytes() == (tmp_path / "cut" / "adapter" / name).read_bytes()
    assert set(a.weights) == set(b.weights) and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert a.manifest["trace"] == b.manifest["trace"] and a.manifest["trace"]["forwards"] == 8

    # the sealed run verifies on a model carrying the job's adapter
    from h3lab.training import add_lora

    model = load_model(job)
    add_lora(model, 2, 4.0)
    assert verify(whole / "run", model).ok
    # ... and from the console, nothing to guess: the job folder names its run, the run its base and adapter
    assert cli.main(["verify", str(whole)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"training run {whole / 'run'}: rebuilt ") and "LoRA rank 2 on" in out[0], out
    assert out[1].startswith("OK"), out
    assert cli.main(["verify", str(whole / "run"), "--steps", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("OK")

    # resuming with other arguments is refused, naming what differs
    code, err, _ = run(job_argv(data, tmp_path / "cut", "--resume", "--lr", "2e-2"), capsys)
    assert code == 2 and "finished" in err[0]  # a finished job says so first
    shutil.rmtree(tmp_path / "cut" / "run")
    code, err, _ = run(job_argv(data, tmp_path / "cut", "--resume", "--lr", "2e-2", "--steps", "6"), capsys)
    assert code == 2 and "config.lr 0.02 vs 0.01" in err[0] and "config.steps 6 vs 4" in err[0], err[0]


def test_reward_weighted_update_through_the_console(data, tmp_path, capsys):
    out = tmp_path / "rl"
    argv = ["train", "--rollout", str(data / "rollout1"), "1.0", "--rollout", str(data / "rollout2"), "-1.0",
            "--out", str(out), "--rank", "2", "--steps", "1", "--batch-size", "4", "--lr", "1e-3", "--mode", "off",
            "--device", "cpu"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    run_ = load(out / "run")
    assert len(run_.dataset) == 4 and [r.weight for r in run_.dataset] == [1.0, 1.0, -1.0, -1.0]
    assert all(r.origin["kind"] == "rollout" for r in run_.dataset)
    assert not any("log_prob" in k or "logprob" in k for k in json.dumps(run_.manifest).split('"'))
    assert os.path.isdir(out / "adapter")



# ------------------------------------------------------------------------------------------------------------ faults
@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted job's sealed run digest and adapter bytes."""
    out = tmp_path_factory.mktemp("reference") / "job"
    assert train.main(job_argv(data, out)) == 0
    return load(out / "run").digest, (out / "adapter" / "adapter_model.safetensors").read_bytes()


def _finished_like(out, reference):
    assert load(out / "run").digest == reference[0]
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == reference[1]


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_leaves_a_job_that_resumes(data, tmp_path, capsys, monkeypatch, reference):
    """A disk full before the first checkpoint (a 16 KiB tmpfs where root may mount one, else a simulated ENOSPC
    from the adapter writer): the error names the path; the folder holds job.json; a rerun says --resume, and
    --resume (with room again) restarts it cleanly from step 0 to the uninterrupted run's bytes."""
    import errno

    import h3lab.training.job as job_module

    disk = tmp_path / "disk"
    mounted = _mount_tmpfs(disk, "16k")
    out = disk / "job"
    try:
        if not mounted:
            real = job_module.save_adapter

            def full(model, path):
                raise OSError(errno.ENOSPC, "No space left on device", str(Path(path) / "adapter_model.safetensors"))

            monkeypatch.setattr(job_module, "save_adapter", full)
        code, err, _ = run(job_argv(data, out), capsys)
        assert code == 2 and len(err) == 1 and str(out) in err[0] and "No space left on device" in err[0], err
        assert (out / "job.json").is_file() and latest_checkpoint(out) is None
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        else:
            monkeypatch.setattr(job_module, "save_adapter", real)
        code, err, _ = run(job_argv(data, out), capsys)
        assert code == 2 and "add --resume" in err[0]
        code, err, _ = run(job_argv(data, out, "--resume"), capsys)
        assert code == 0, err
        _finished_like(out, reference)
        code, err, _ = run(job_argv(data, out, "--resume"), capsys)
        assert code == 2 and "is finished" in err[0] and str(out) in err[0]
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=False)


KILL_MID_STEP = """
import os, signal, sys
import h3lab.training.step as step_module
import h3lab.training.run as run_module
from h3lab.frontends import train
calls = [0]
real = run_module.compute_gradients
def killing(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 4:  # inside step 4 (of 4): after step 2's checkpoint and step 3
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
run_module.compute_gradients = killing
sys.exit(train.main(sys.argv[1:]))
"""


def test_sigkill_mid_step_then_resume(data, tmp_path, capsys, reference):
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KILL_MID_STEP, *job_argv(data, out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert latest_checkpoint(out).name == "step-000002" and not (out / "run").exists()
    code, err, _ = run(job_argv(data, out, "--resume"), capsys)
    assert code == 0, err
    _finished_like(out, reference)


def test_a_corrupted_checkpoint_is_refused_naming_it(data, tmp_path, capsys, reference):
    out = tmp_path / "corrupt"
    assert train.main(job_argv(data, out)) == 0
    shutil.rmtree(out / "run")  # as if killed after the final checkpoint, before sealing
    ckpt = latest_checkpoint(out)
    assert ckpt.name == "step-000004"
    saved = (ckpt / "optimizer.safetensors").read_bytes()
    (ckpt / "optimizer.safetensors").write_bytes(saved[: len(saved) // 2])
    code, err, _ = run(job_argv(data, out, "--resume"), capsys)
    assert code == 2 and len(err) == 1 and str(ckpt / "optimizer.safetensors") in err[0] and "unreadable" in err[0]
    assert "remove that checkpoint folder" in err[0]
    (ckpt / "optimizer.safetensors").write_bytes(saved)
    state = json.loads((ckpt / "state.json").read_text())
    state["records"][-1]["optimizer"] = "0" * 64  # valid JSON, not what the optimiser state hashes to
    (ckpt / "state.json").write_text(json.dumps(state))
    code, err, _ = run(job_argv(data, out, "--resume"), capsys)
    assert code == 2 and str(ckpt) in err[0] and "does not match" in err[0], err
    shutil.rmtree(ckpt)  # the remedy: resume from the start
    code, err, _ = run(job_argv(data, out, "--resume"), capsys)
    assert code == 0, err
    _finished_like(out, reference)


@pytest.mark.parametrize("parser", ["train", "grpo", "verify"])
def test_every_flag_has_help_and_says_its_default(parser):
    """`h3lab train --help` (and `train grpo`, `verify`): every flag explains itself and shows its default; the
    training help points at `train grpo` and at `h3lab verify`."""
    from h3lab.frontends import verify as verify_front_end

    p = {"train": train.build_parser, "grpo": train.build_grpo_parser, "verify": verify_front_end.build_parser}[parser]()
    for action in p._actions:
        assert action.help, action.dest
        shown = p._get_formatter()._get_help_string(action)
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS) and not action.required:
            assert "default" in shown, (action.dest, shown)
    if parser == "train":
        text = p.format_help()
        assert "h3lab train grpo --help" in text and "h3lab verify" in text
