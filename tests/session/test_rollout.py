"""`Session.rollout` (h3lab/app/rollout.py) on the tiny snapshot, off mode: request order and seed derivation, one
batched trajectory per prompt or one per request, the per-pass log-densities sealed, replay and verify, decoding,
one-line errors before any work."""

import pytest
import torch

from h3lab.run import trajectory as T
from h3lab.errors import H3Error
from h3lab.app.rollout import request_seed
from h3lab.stochastic import pass_noise

SMALL = dict(width=64, height=64, frames=22, steps=2, mode="off")


@pytest.fixture(scope="module")
def rolled(session):
    return session.rollout(["a red ball", "a blue sky"], group=2, stepper="flow_sde", level=0.7, seed=3,
                           keep=("noise",), **SMALL)


def test_requests_come_in_prompt_member_order_with_derived_seeds(rolled):
    assert [(r.prompt_index, r.member, r.request) for r in rolled.requests] == [(0, 0, 0), (0, 1, 1), (1, 0, 2),
                                                                                (1, 1, 3)]
    assert [r.seed for r in rolled.requests] == [request_seed(3, k) for k in range(4)]
    assert len(set(r.seed for r in rolled.requests)) == 4
    assert len(rolled.trajectories) == 2 and [r.item for r in rolled.requests] == [0, 1, 0, 1]
    for p, traj in enumerate(rolled.trajectories):
        assert traj.inputs.batch_size == 2 and traj.spec.stepper == "flow_sde"
        assert list(traj.spec.stepper_params["requests"]) == [2 * p, 2 * p + 1]
        for step in traj.steps:
            for m in ("video", "audio"):
                assert step["transition"][m]["sde"]
                assert [q["request"] for q in step["transition"][m]["requests"]] == [2 * p, 2 * p + 1]
        # the noise of request 3, pass 1, audio is pass_noise(3, 3, 1, "audio")
    traj = rolled.trajectories[1]
    na = traj.inputs.num_condition_audio_rows
    noise = traj.kept["noise_audio.0001"][1]
    assert torch.equal(noise, pass_noise(3, 3, 1, "audio", tuple(traj.inputs.audio[1, na:].shape)))
    assert rolled.requests[0].latents.ndim == 4 and rolled.requests[0].frames is None


def test_unbatched_rollout_draws_the_same_requests(session, rolled):
    alone = session.rollout(["a red ball"], group=2, stepper="flow_sde", level=0.7, seed=3, batched=False,
                            keep=("noise",), **SMALL)
    assert len(alone.trajectories) == 2 and all(t.inputs.batch_size == 1 for t in alone.trajectories)
    batch = rolled.trajectories[0]
    for g, traj in enumerate(alone.trajectories):
        assert torch.equal(traj.inputs.video[0], batch.inputs.video[g])
        assert torch.equal(traj.inputs.audio[0], batch.inputs.audio[g])
        for key, noise in traj.kept.items():
            if key.startswith("noise_"):
                assert torch.equal(noise[0], batch.kept[key][g]), key


def test_rollout_replays_and_verifies(session, rolled, tmp_path):
    again = session.rollout(["a red ball", "a blue sky"], group=2, stepper="flow_sde", level=0.7, seed=3,
                            keep=("noise",), **SMALL)
    assert [t.digest for t in again.trajectories] == [t.digest for t in rolled.trajectories]
    path = rolled.trajectories[1].seal(tmp_path / "rollout")
    report = session.verify(path)
    assert report.ok, str(report)


def test_window_and_decode(session):
    out = session.rollout(["a red ball"], group=1, stepper="cps", level=0.5, seed=0, decode=True,
                          window={"start": 0, "size": 1}, **SMALL)
    steps = out.trajectories[0].steps
    assert [s["transition"]["video"]["sde"] for s in steps] == [True, False]
    req = out.requests[0]
    assert req.frames.dtype.name == "uint8" and req.frames.shape[0] == 22 and req.audio is not None


@pytest.mark.parametrize("kwargs, rule", [
    (dict(prompts=[], group=2), "non-empty list"),
    (dict(prompts="a red ball", group=2), "non-empty list"),
    (dict(prompts=["  "], group=2), "empty prompt"),
    (dict(prompts=["x"], group=0), "group=0"),
    (dict(prompts=["x"], group=2, stepper="euler"), "stochastic stepper"),
    (dict(prompts=["x"], group=2, level=-1.0), ">= 0"),
    (dict(prompts=["x"], group=2, seed=1.5), "seed=1.5"),
    (dict(prompts=["x"], group=2, width=50), "width=50"),
    (dict(prompts=["x"], group=2, keep=("everything",)), "keep="),
    (dict(prompts=["x"], group=2, mode="fast"), "needs the strict contract"),
])
def test_bad_rollout_raises_one_line_before_any_work(session, kwargs, rule):
    prompts = kwargs.pop("prompts")
    loaded = set(session.loaded)
    with pytest.raises(H3Error, match=rule) as err:
        session.rollout(prompts, **kwargs)
    assert "\n" not in str(err.value) and set(session.loaded) == loaded
