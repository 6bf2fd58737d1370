"""`h3lab train grpo`: a table of bad arguments, each refused with exit 2 and one stderr line naming the value and
the rule, before any session or model loads and fast."""

from __future__ import annotations

import pytest

from cli_refusals import assert_each_refused
from h3lab.frontends import train
from h3lab.training.rewards import latent_mean, reward


def bad_reward(sample):  # a module:function reward for the table (never called: resolution only)
    return 0.0


def two_argument_reward(sample, other):  # a reward with the wrong signature: refused when resolved
    return 0.0


FLAKY = {"fail": False}


@reward(needs="latents")
def flaky_reward(sample):  # latent_mean, or a failure while FLAKY["fail"] (a reward server that is down)
    if FLAKY["fail"]:
        raise RuntimeError("reward server unreachable")
    return latent_mean(sample)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from h3lab.checkpoint.tiny import default_snapshot
    from h3lab.training.job import _check_targets, _snapshot_config
    from h3lab.adapters.lora import PROJECTIONS

    # outside the timed cases: the default snapshot built once into the cache, peft imported by a first target match
    _check_targets(PROJECTIONS, _snapshot_config(default_snapshot(), "transformer"))
    d = tmp_path_factory.mktemp("grpo-args")
    (d / "prompts.txt").write_text("# rollouts\na red fox in snow\n\na blue bird\n")
    (d / "empty.txt").write_text("# nothing\n\n")
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (d / "junk").mkdir()
    (d / "junk" / "x.txt").write_text("x")
    return d


def cases(d):
    p = ["--prompts", str(d / "prompts.txt")]
    r = ["--reward", "brightness"]
    o = ["--out", str(d / "fresh-out")]
    base = p + r + o
    return [
        ("no-prompts", r + o, "--prompts"),
        ("no-reward", p + o, "--reward"),
        ("prompts-missing", ["--prompts", str(d / "nope.txt")] + r + o, "no such file"),
        ("prompts-empty", ["--prompts", str(d / "empty.txt")] + r + o, "holds no prompt"),
        ("prompts-encoding", ["--prompts", str(d / "latin1.txt")] + r + o, "not UTF-8 text"),
        ("reward-unknown", p + ["--reward", "shiny"] + o, "reward 'shiny': not a shipped reward"),
        ("reward-module", p + ["--reward", "no_such_pkg_x:f"] + o, "cannot import module 'no_such_pkg_x'"),
        ("reward-attr", p + ["--reward", f"{__name__}:nope"] + o, "has no attribute 'nope'"),
        ("group", base + ["--group", "1"], "--group 1: must be an integer >= 2"),
        ("group-text", base + ["--group", "four"], "invalid int value: 'four'"),
        ("iterations", base + ["--iterations", "0"], "--iterations 0: must be an integer >= 1"),
        ("steps", base + ["--steps", "0"], "--steps 0: must be an integer >= 1"),
        ("stepper", base + ["--stepper", "ode"], "invalid choice: 'ode'"),
        ("level", base + ["--level", "-1"], "--level -1.0: must be a finite number > 0"),
        ("clip", base + ["--clip-range", "0"], "--clip-range 0.0: must be a finite number > 0"),
        ("beta", base + ["--beta", "-0.1"], "--beta -0.1: must be >= 0"),
        ("cap", base + ["--importance-cap", "0"], "--importance-cap 0.0: must be a finite number > 0"),
        ("epochs", base + ["--inner-epochs", "0"], "--inner-epochs 0: must be an integer >= 1"),
        ("passes", base + ["--passes", "some"], "--passes 'some': must be all, fraction:F"),
        ("passes-fraction", base + ["--passes", "fraction:2"], "pass fraction=2.0: must be <= 1.0"),
        ("passes-window", base + ["--passes", "window:1"], "--passes 'window:1'"),
        ("passes-window-steps", base + ["--passes", "window:2,4", "--steps", "4"],
         "window passes [4, 5]: not SDE passes of this rollout (4 passes"),
        ("level-cps", base + ["--stepper", "cps", "--level", "1.5"], "--level 1.5: must be in [0, 1] for stepper cps"),
        ("reward-signature", p + ["--reward", f"{__name__}:two_argument_reward"] + o,
         "two_argument_reward(sample, other) cannot take one argument; a reward is fn(sample) -> float"),
        ("rank", base + ["--rank", "0"], "--rank 0: must be an integer >= 1"),
        ("alpha", base + ["--alpha", "0"], "--alpha 0.0"),
        ("targets", base + ["--targets", "to_qq"], "LoRA target 'to_qq' matches no module"),
        ("lr", base + ["--lr", "0"], "--lr 0.0: must be a finite number > 0"),
        ("width", base + ["--width", "50"], "50"),
        ("snapshot", base + ["-d", str(d / "junk")], "not a MiniMax-H3 snapshot folder"),
        ("out-not-job", p + r + ["--out", str(d / "junk")], "is a folder of other files"),
        ("resume-nothing", base + ["--resume"], "holds no GRPO job"),
        ("unknown-flag", base + ["--groups", "4"], "unrecognized arguments: --groups"),
    ]


def test_bad_arguments_fail_fast_with_one_line(files, monkeypatch, capsys):
    assert_each_refused("grpo", cases(files), files / "fresh-out", monkeypatch, capsys)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    code = train.main(["grpo", "--prompts", str(files / "prompts.txt"), "--reward", "brightness", "--out",
                       str(files / "fresh-out"), "--device", "cpu"])
    assert code == 2 and "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_good_arguments_make_the_job(files):
    args = train.build_grpo_parser().parse_args(
        ["--prompts", str(files / "prompts.txt"), "--reward", f"{__name__}:bad_reward", "--out",
         str(files / "out2"), "--group", "3", "--passes", "window:1,2", "--beta", "0.04", "--mode", "off",
         "--importance-cap", "2"])
    job = train.grpo_job_from_args(args)
    assert job.prompt_list == ("a red fox in snow", "a blue bird")
    assert job.config.group == 3 and job.config.selection.kind == "window" and job.config.selection.size == 2
    assert job.config.beta == 0.04 and job.config.importance_cap == 2.0
    assert not (files / "out2").exists()


def grpo_argv(files, out, *extra):
    return ["--prompts", str(files / "prompts.txt"), "--group", "2", "--reward", "latent_mean", "--out", str(out),
            "--iterations", "2", "--steps", "2", "--width", "64", "--height", "64", "--frames", "22", "--mode", "off",
            "--rank", "2", "--lr", "1e-2", "--beta", "0.04", "--device", "cpu", *extra]


def test_grpo_job_end_to_end_and_resume(files, tiny_snapshot, tmp_path, capsys):
    from h3lab.app.session import Session
    from h3lab.training.grpo_job import run_grpo_job
    from h3lab.training.grpo_run import load, verify

    snap = ["-d", str(tiny_snapshot)]
    assert train.main(["grpo", *grpo_argv(files, tmp_path / "whole"), *snap]) == 0
    out = capsys.readouterr().out
    # 2 prompts x 2 members x 2 passes x 2 modalities, on-policy
    assert "trained 2 GRPO iterations" in out and "(16/16 exactly 1)" in out
    whole = load(tmp_path / "whole" / "run")
    assert len(whole.iterations) == 2 and whole.manifest["reward"] == "latent_mean"
    assert [len(it["rewards"]) for it in whole.iterations] == [4, 4]
    # finished: the per-iteration checkpoint is gone (run/ supersedes it) and --resume says the job is finished
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["adapter", "initial", "job.json", "run"]
    assert train.main(["grpo", *grpo_argv(files, tmp_path / "whole"), *snap, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is finished" in err[0], err

    job = train.grpo_job_from_args(train.build_grpo_parser().parse_args(grpo_argv(files, tmp_path / "cut") + snap))
    session = Session(job.snapshot, device="cpu")

    def stop(k, total, record):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_grpo_job(job, session, progress=stop)
    assert (tmp_path / "cut" / "checkpoint").is_dir()  # interrupted after iteration 0: its checkpoint is there
    code = train.main(["grpo", *grpo_argv(files, tmp_path / "cut"), *snap, "--resume", "--beta", "0.05"])
    assert code == 2 and "differs from the job" in capsys.readouterr().err
    assert train.main(["grpo", *grpo_argv(files, tmp_path / "cut"), *snap, "--resume"]) == 0
    resumed = load(tmp_path / "cut" / "run")
    assert not (tmp_path / "cut" / "checkpoint").exists()
    assert resumed.digest == whole.digest
    assert resumed.manifest["adapter"]["final_sha256"] == whole.manifest["adapter"]["final_sha256"]
    model = session.transformer("transformer")
    from h3lab.training import add_lora, remove_lora

    handle = add_lora(model, 2, None, seed=0)
    try:
        assert verify(resumed, model).ok
    finally:
        remove_lora(model, handle)
    from h3lab.frontends import cli

    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path / "cut")]) == 0  # the job folder: its run/, base and adapter rebuilt
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("GRPO run ") and "LoRA rank 2" in out[0] and out[1].startswith("OK"), out
    assert cli.main(["verify", str(tmp_path / "cut"), "--steps", "1"]) == 2
    assert "--steps: a GRPO run replays every iteration" in capsys.readouterr().err


def test_a_job_stopped_before_its_first_checkpoint_restarts_with_resume(files, tiny_snapshot, tmp_path, capsys):
    """The rule of every job folder: a job that fails before its first checkpoint (here its reward, at the first
    rollout) leaves job.json and initial/; a fresh run says to add --resume, and --resume starts it again from
    iteration 0 -- the run an uninterrupted job makes, verified from the console."""
    out = tmp_path / "flaky"
    argv = [*grpo_argv(files, out), "--reward", f"{__name__}:flaky_reward", "-d", str(tiny_snapshot)]
    FLAKY["fail"] = True
    try:
        assert train.main(["grpo", *argv]) == 2
    finally:
        FLAKY["fail"] = False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reward server unreachable" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["initial", "job.json"]
    assert train.main(["grpo", *argv]) == 2
    assert "stopped before its first checkpoint: add --resume to start it again" in capsys.readouterr().err
    assert train.main(["grpo", *argv, "--resume"]) == 0
    assert "trained 2 GRPO iterations" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "initial", "job.json", "run"]
    from h3lab.frontends import cli

    assert cli.main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("OK")
