"""The SDE steppers as sealed RunSpec choices (h3lab/stochastic/steppers.py) and their per-pass records in sealed
trajectories: parameters normalised and hashed, noise keyed by (seed, request, pass, modality), the recorded
log-density recomputed from the kept tensors, a MixGRPO window, seal / load / verify and tamper detection. `off` mode
on the tiny bench (the strict consistency gate is tests/stochastic/test_consistency.py)."""

import json

import pytest
import torch

from h3lab.run import trajectory as T
from h3lab.research.ablation import tiny_bench
from h3lab.hashing import json_sha256
from h3lab.run import RunSpec, RunSpecError
from h3lab.stochastic import pass_noise, transition_logprob, transition_mean_std
from stochastic_helpers import batched

PARAMS = {"level": 0.7, "seed": 5}


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return tiny_bench(str(tiny_snapshot), 4)  # 3 passes


def sde_spec(bench, stepper="flow_sde", params=PARAMS, size=1, mode="off"):
    spec = bench.spec(mode)
    inputs = spec.inputs if size == 1 else batched(spec.inputs, size)
    return spec.replace(inputs=inputs, stepper=stepper, stepper_params=params)


def test_params_are_normalised_sealed_and_hashed(bench):
    spec = sde_spec(bench)
    assert dict(spec.stepper_params["level"]) == {"video": 0.7, "audio": 0.7}
    assert spec.stepper_params["requests"] is None and spec.stepper_params["window"] is None
    d = spec.to_dict()
    assert d["stepper"] == "flow_sde" and d["stepper_params"]["seed"] == 5
    other = sde_spec(bench, params={**PARAMS, "seed": 6})
    assert other.sha256 != spec.sha256 and sde_spec(bench).sha256 == spec.sha256
    assert RunSpec.from_dict(d, spec.tensors()).sha256 == spec.sha256
    # an Euler spec's description has no stepper_params: specs sealed before them keep their sha256
    assert "stepper_params" not in bench.spec("off").to_dict()


@pytest.mark.parametrize("stepper, params, rule", [
    ("flow_sde", {"level": 0.7}, "'seed' is required"),
    ("flow_sde", {**PARAMS, "noise": 1}, "parameter 'noise'"),
    ("cps", {**PARAMS, "level": 1.5}, r"in \[0, 1\]"),
    ("dance_sde", {**PARAMS, "level": {"video": 0.3}}, "keys video and audio"),
    ("dance_sde", {**PARAMS, "level": 0}, "use stepper 'euler'"),
    ("flow_sde", {**PARAMS, "seed": -1}, "seed=-1"),
    ("flow_sde", {**PARAMS, "requests": [0, 0]}, "distinct"),
    ("flow_sde", {**PARAMS, "window": {"start": 2, "size": 2}}, "exceed the run's 3 passes"),
    ("flow_sde", {**PARAMS, "window": [0, 1]}, "window"),
    ("euler", {"level": 0.7}, "takes no parameters"),
])
def test_bad_params_raise_one_line_at_spec_construction(bench, stepper, params, rule):
    with pytest.raises(RunSpecError, match=rule) as err:
        sde_spec(bench, stepper, params)
    assert "\n" not in str(err.value)


def test_request_ids_must_match_the_batch(bench):
    with pytest.raises(RunSpecError, match="2 ids for a batch of 1"):
        sde_spec(bench, params={**PARAMS, "requests": [0, 1]})


@pytest.mark.parametrize("stepper", ["flow_sde", "dance_sde", "cps"])
def test_recorded_transition_is_recomputed_from_kept_tensors(bench, stepper):
    params = {"level": {"video": 0.7 if stepper != "dance_sde" else 0.3, "audio": 0.5}, "seed": 9,
              "requests": [4, 2]}
    spec = sde_spec(bench, stepper, params, size=2)
    traj = T.record(spec, bench.model, keep=("latents", "velocities", "noise"))
    inputs, kept = spec.inputs, traj.kept
    ncond = {"video": inputs.num_condition_video_rows, "audio": inputs.num_condition_audio_rows}
    n = spec.schedule.num_passes
    for i, step in enumerate(traj.steps):
        assert step[T.TRANSITION] == json_sha256(step["transition"])
        for m in ("video", "audio"):
            rec, c = step["transition"][m], ncond[m]
            grid = getattr(spec.schedule, m)
            assert rec["sigma"] == float(grid.sigmas[i]) and rec["sigma_next"] == float(grid.sigmas[i + 1])
            x = (getattr(inputs, m) if i == 0 else kept[f"{m}.{i - 1:04d}"])[:, c:]
            x_next, v = kept[f"{m}.{i:04d}"][:, c:], kept[f"velocity_{m}.{i:04d}"][:, c:].float()
            if stepper == "cps" and i == n - 1:  # the CPS step into sigma 0 is the Euler step
                assert not rec["sde"] and f"noise_{m}.{i:04d}" not in kept
                assert torch.equal(x_next, grid.step(i, x, v))
                continue
            assert rec["sde"] and [r["request"] for r in rec["requests"]] == [4, 2]
            noise = kept[f"noise_{m}.{i:04d}"]
            for b, r in enumerate((4, 2)):
                assert torch.equal(noise[b], pass_noise(9, r, i, m, x.shape[1:]))
            mean, std = transition_mean_std(stepper, x, v, rec["sigma"], rec["sigma_next"], rec["level"])
            assert torch.equal(x_next, mean + std * noise) and rec["std"] == float(std)
            logp_mean, logp_sum, _, _ = transition_logprob(stepper, rec["level"], x, v, x_next, rec["sigma"],
                                                           rec["sigma_next"])
            for b in range(2):
                assert rec["requests"][b]["logp_mean"] == float(logp_mean[b])
                assert rec["requests"][b]["logp_sum"] == float(logp_sum[b])
                assert torch.isfinite(logp_sum[b])


def test_mixgrpo_window_is_euler_outside(bench):
    spec = sde_spec(bench, params={**PARAMS, "window": {"start": 1, "size": 1}})
    traj = T.record(spec, bench.model, keep=("latents", "velocities"))
    nv = spec.inputs.num_condition_video_rows
    assert [s["transition"]["video"]["sde"] for s in traj.steps] == [False, True, False]
    assert [s["transition"]["audio"]["level"] for s in traj.steps] == [0.0, 0.7, 0.0]
    x, v = spec.inputs.video[:, nv:], traj.kept["velocity_video.0000"][:, nv:].float()
    assert torch.equal(traj.kept["video.0000"][:, nv:], spec.schedule.video.step(0, x, v))
    # passes before the window are the Euler run's bytes
    euler = T.record(bench.spec("off"), bench.model)
    assert euler.steps[0]["video"] == traj.steps[0]["video"] and euler.steps[1]["video"] != traj.steps[1]["video"]
    assert "transition" not in euler.steps[0]


def test_a_rollout_replays_byte_for_byte_and_verify_checks_the_logp(bench, tmp_path):
    spec = sde_spec(bench, "dance_sde", {"level": 0.3, "seed": 3}, size=2)
    traj = T.record(spec, bench.model)
    assert T.record(spec, bench.model).digest == traj.digest
    path = traj.seal(tmp_path / "run")
    loaded = T.load(path)
    assert loaded.spec.stepper == "dance_sde" and loaded.spec.sha256 == spec.sha256
    assert T.verify(path, bench.model).ok

    manifest = json.loads((path / T.MANIFEST).read_text())
    entry = manifest["steps"][1]
    entry["transition"]["audio"]["requests"][1]["logp_sum"] += 1.0
    (path / T.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(T.TrajectoryError, match="transition record does not match"):
        T.load(path)
    entry[T.TRANSITION] = json_sha256(entry["transition"])  # a careful forger re-seals every hash ...
    manifest["digest"] = T.digest_lines(manifest["steps"])
    (path / T.MANIFEST).write_text(json.dumps(manifest))
    report = T.verify(path, bench.model)  # ... and verify's recomputation still catches it
    assert not report.ok and report.first_step == 1
    assert report.field == "transition audio.requests[1].logp_sum", report.field


def test_noise_is_independent_of_batch_position(bench):
    """Request 7 alone and request 7 at position 1 of a batch of 2 draw the same noise on every pass."""
    alone = T.record(sde_spec(bench, params={**PARAMS, "requests": [7]}), bench.model, keep=("noise",))
    spec2 = sde_spec(bench, params={**PARAMS, "requests": [3, 7]}, size=2)
    pair = T.record(spec2, bench.model, keep=("noise",))
    for key, noise in alone.kept.items():
        assert torch.equal(pair.kept[key][1], noise[0]), key
