"""`h3lab train nft` and the reward flags both RL front ends share: bad arguments refused in one line before any model
loads; an end-to-end DiffusionNFT job on the released Euler step with a weighted-sum reward, verified and resumed;
a GRPO job scored by a reward server on loopback whose failure mid-run fails the iteration in one line, keeps the
checkpoint before it, and resumes to the uninterrupted run's digest."""

from __future__ import annotations

import threading

import pytest

from cli_refusals import assert_each_refused
from h3lab.frontends import train
from h3lab.training.reward_server import make_server
from h3lab.training.rewards import REWARDS, Reward

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from h3lab.checkpoint.tiny import default_snapshot
    from h3lab.training.job import _check_targets, _snapshot_config
    from h3lab.adapters.lora import PROJECTIONS

    _check_targets(PROJECTIONS, _snapshot_config(default_snapshot(), "transformer"))
    d = tmp_path_factory.mktemp("nft-args")
    (d / "prompts.txt").write_text("a red circle moves left, a high tone\na blue square moves up, a middle tone\n")
    return d


def cases(d):
    p, o = ["--prompts", str(d / "prompts.txt")], ["--out", str(d / "fresh-out")]
    base = p + ["--reward", "prompt_match"] + o
    dead = "http://127.0.0.1:9/score"  # the discard port: nothing listens there
    return [
        ("no-reward", p + o, "--reward NAME or --reward-server URL: give exactly one"),
        ("both", base + ["--reward-server", dead], "give exactly one"),
        ("bad-sum", p + ["--reward", "prompt_match:1,"] + o, "--reward 'prompt_match:1,': part 2"),
        ("bad-url", p + ["--reward-server", "ftp://x/score"] + o, "--reward-server 'ftp://x/score': must be http"),
        ("dead-server", p + ["--reward-server", dead] + o, f"--reward-server {dead}: no server answers"),
        ("timeout", p + ["--reward-server", dead, "--reward-timeout", "0"] + o, "--reward-timeout 0.0"),
        ("retries", p + ["--reward-server", dead, "--reward-retries", "-1"] + o, "--reward-retries -1"),
        ("stepper", base + ["--stepper", "ddim"], "invalid choice: 'ddim'"),
        ("level-euler", base + ["--level", "0.5"], "--level 0.5: the released ODE step (kind 'euler') has no noise level"),
        ("level-sde", base + ["--stepper", "cps", "--level", "-1"], "--level -1.0: must be a finite number > 0"),
        ("beta", base + ["--nft-beta", "0"], "--nft-beta 0.0: must be a finite number > 0"),
        ("ref-kl", base + ["--ref-kl", "-1"], "--ref-kl -1.0: must be a finite number >= 0"),
        ("draws", base + ["--draws", "0"], "--draws 0: must be an integer >= 1"),
        ("old-batch", base + ["--old-batch", "all"], "invalid choice: 'all'"),
        ("group", base + ["--group", "1"], "--group 1: must be an integer >= 2"),
        ("lr", base + ["--lr", "0"], "--lr 0.0: must be a finite number > 0"),
        ("weights", base + ["--video-weight", "0", "--audio-weight", "0"],
         "--video-weight 0.0: with an audio weight of 0 too: at least one modality must be weighted"),
        ("grpo-flag", base + ["--passes", "all"], "unrecognized arguments: --passes"),
        ("resume-nothing", base + ["--resume"], "holds no DiffusionNFT job"),
    ]


def test_bad_arguments_fail_fast_with_one_line(files, monkeypatch, capsys):
    assert_each_refused("nft", cases(files), files / "fresh-out", monkeypatch, capsys)
    code = train.main(["grpo", "--prompts", str(files / "prompts.txt"), "--reward", "brightness", "--reward-server",
                       "http://127.0.0.1:9/score", "--out", str(files / "fresh-out")])
    assert code == 2 and "give exactly one" in capsys.readouterr().err


def nft_argv(files, out, *extra):
    return ["nft", "--prompts", str(files / "prompts.txt"), "--group", "2",
            "--reward", "prompt_match:1.0,brightness:0.5",
            "--out", str(out), "--iterations", "2", "--steps", "2", "--width", "64", "--height", "64", "--frames",
            "22", "--mode", "off", "--rank", "2", "--lr", "1e-2", "--draws", "2", "--device", "cpu", *extra]


def test_nft_job_end_to_end_verify_and_resume(files, tiny_snapshot, tmp_path, capsys):
    from h3lab.app.session import Session
    from h3lab.training import add_lora, remove_lora
    from h3lab.training.nft import load, run_nft_job, verify

    snap = ["-d", str(tiny_snapshot)]
    assert train.main([*nft_argv(files, tmp_path / "whole"), *snap]) == 0
    out, err = capsys.readouterr()
    assert "trained 2 DiffusionNFT iterations" in out and "16/16 byte-equal" in out, out
    assert "(prompt_match " in err and ", brightness " in err  # the parts in the progress line
    whole = load(tmp_path / "whole" / "run")
    assert whole.manifest["reward"] == "prompt_match:1.0,brightness:0.5"
    assert [p["name"] for p in whole.iterations[0]["reward_parts"]] == ["prompt_match", "brightness"]
    assert whole.iterations[0]["origin"]["kind"] == "euler" and len(whole.iterations[0]["items"]) == 8
    assert sorted(p.name for p in (tmp_path / "whole").iterdir()) == ["adapter", "initial", "job.json", "run"]

    job = train.nft_job_from_args(train.build_nft_parser().parse_args(nft_argv(files, tmp_path / "cut")[1:] + snap))
    session = Session(job.snapshot, device="cpu")

    def stop(k, total, record):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_nft_job(job, session, progress=stop)
    assert train.main([*nft_argv(files, tmp_path / "cut"), *snap, "--resume"]) == 0
    resumed = load(tmp_path / "cut" / "run")
    assert resumed.digest == whole.digest
    model = session.transformer("transformer")
    handle = add_lora(model, 2, None, seed=0)
    try:
        assert verify(resumed, model).ok
    finally:
        remove_lora(model, handle)


class Serving:
    """A reward server in a thread that fails every call after the first `healthy` ones (HTTP 500)."""

    def __init__(self, healthy: int | None = None, port: int = 0):
        self.calls, self.audio = 0, []

        def fn(samples):
            self.calls += 1
            self.audio += [s.audio is not None and s.audio.shape[0] == 2 for s in samples]
            if healthy is not None and self.calls > healthy:
                raise RuntimeError("the reward model crashed")
            return [REWARDS["brightness"].fn(s) for s in samples]

        self.server = make_server(Reward("brightness", fn, batched=True), port=port)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def grpo_server_argv(files, out, url, *extra):
    return ["grpo", "--prompts", str(files / "prompts.txt"), "--group", "2", "--reward-server", url,
            "--reward-retries", "0", "--out", str(out), "--iterations", "3", "--steps", "2", "--width", "64",
            "--height", "64", "--frames", "22", "--mode", "off", "--rank", "2", "--lr", "1e-2", "--device", "cpu",
            *extra]


def test_a_reward_server_failing_mid_run_leaves_the_job_resumable(files, tiny_snapshot, tmp_path, capsys):
    from h3lab.training.grpo_run import load

    snap = ["-d", str(tiny_snapshot)]
    with Serving() as good:
        assert train.main([*grpo_server_argv(files, tmp_path / "whole", good.server.url), *snap]) == 0
        assert good.calls == 3 and good.audio and all(good.audio)  # every request reached the reward with its audio
    capsys.readouterr()
    whole = load(tmp_path / "whole" / "run")
    assert whole.manifest["reward"].startswith("http://127.0.0.1:")

    with Serving(healthy=2) as flaky:
        code = train.main([*grpo_server_argv(files, tmp_path / "cut", flaky.server.url), *snap])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len([ln for ln in err if "error" in ln]) == 1, err
    assert "HTTP 500 (reward 'brightness' failed: RuntimeError: the reward model crashed)" in err[-1], err[-1]
    checkpoint = load(tmp_path / "cut" / "checkpoint")  # after iteration 1, intact
    assert len(checkpoint.iterations) == 2 and not (tmp_path / "cut" / "run").exists()
    with Serving(port=flaky.server.server_address[1]) as good:  # the job's URL, served again
        assert train.main([*grpo_server_argv(files, tmp_path / "cut", good.server.url), *snap, "--resume"]) == 0
        assert good.calls == 1
    assert load(tmp_path / "cut" / "run").digest == whole.digest
