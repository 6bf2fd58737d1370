"""Experiment arms P/P, R/P, P/R, R/R on the tiny snapshot: R/R byte-equal at every pass (strict rollout vs strict
training recompute with autograd), P/P byte-equal on CPU, the mixed arms' drift localised to an operator and bounded
by the production path's own error against a float32 truth; the P side's scheduler and twin model."""

import pytest
import torch

from h3lab.execution import runtime
from h3lab.research.ablation import tiny_bench
from h3lab.research.arms import ARMS, ArmError, DiffusersStepper, diffusers_twin, run_arms
from h3lab.model import H3Transformer
from h3lab.run import ScheduleStepper, model_forward


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return tiny_bench(str(tiny_snapshot))


@pytest.fixture(scope="module")
def reports(bench):
    return run_arms(bench.model, bench.inputs, bench.schedule, r_trajectory=bench.reference_trajectory("strict"))


def test_rr_is_byte_equal_at_every_pass(reports, bench):
    rr = reports["R/R"]
    assert rr.byte_equal and rr.first_drift is None, rr.summary()
    assert [s["step"] for s in rr.velocity_drift] == list(range(bench.schedule.num_passes))
    for per_pass in rr.velocity_drift + rr.latent_drift:
        for m in ("video", "audio"):
            assert per_pass[m] == {"equal": True, "max_abs": 0.0, "rel_l2": 0.0}
    assert rr.rollout_digest == bench.reference_trajectory("strict").digest


def test_pp_is_byte_equal_on_cpu(reports):
    # Diffusers' forward without grad vs with autograd enabled, stepped by its own schedulers: torch on CPU repeats.
    assert reports["P/P"].byte_equal, reports["P/P"].summary()


def test_mixed_arms_drift_is_localised_and_bounded(reports, bench):
    points = {p.name for p in bench.model.hook_points()}
    for arm in ("R/P", "P/R"):
        r = reports[arm]
        assert not r.byte_equal and r.first_drift is not None
        assert r.first_drift["step"] == 0 and r.first_drift["field"].startswith("velocity_")
        assert r.first_drift["point"]["point"] in points and r.first_drift["point"]["step"] == 0
        assert set(r.seconds) == {"rollout", "training", "localise"}
    # pass 0 sees the same sealed inputs on every side: strict's error against the float32-policy truth is at most
    # twice torch's (both in the released bf16 policy), so the R/P gap is the production path's own size of error
    x = bench.inputs
    truth_model = H3Transformer(bench.model.config, dtype_policy="float32")
    truth_model.load_state_dict({k: v.float() for k, v in bench.model.state_dict().items()})
    with torch.no_grad(), runtime.use_mode("off"):
        truth = model_forward(truth_model, x, x.video, x.audio, 0)
        torch_out = model_forward(bench.model, x, x.video, x.audio, 0)
    strict_out = [bench.reference_trajectory("strict").kept[f"velocity_{m}.0000"] for m in ("video", "audio")]
    for t, p, r in zip(truth, torch_out, strict_out):
        err_p = (p.double() - t.double()).norm() / t.double().norm()
        err_r = (r.double() - t.double()).norm() / t.double().norm()
        assert 0 < err_r <= 2 * err_p, (float(err_r), float(err_p))
    assert min(reports["R/P"].velocity_drift[0][m]["rel_l2"] for m in ("video", "audio")) > 0


def test_diffusers_side_matches_h3lab_sampler_and_model(bench):
    g = torch.Generator().manual_seed(0)
    ours, theirs = ScheduleStepper(bench.schedule), DiffusersStepper(bench.schedule)
    for i in reversed(range(bench.schedule.num_passes)):  # any order: the Diffusers stepper is re-armed per call
        for m in ("video", "audio"):
            x, v = torch.randn(1, 7, 5, generator=g), torch.randn(1, 7, 5, generator=g)
            assert torch.equal(ours.step(m, i, x, v), theirs.step(m, i, x, v))
    twin = diffusers_twin(bench.model)
    x = bench.inputs
    with torch.no_grad(), runtime.use_mode("off"):
        a = model_forward(bench.model, x, x.video, x.audio, 1)
        b = model_forward(twin, x, x.video, x.audio, 1)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_bad_arm_names_raise(bench):
    with pytest.raises(ArmError, match="X/R"):
        run_arms(bench.model, bench.inputs, bench.schedule, arms=("X/R",))
    assert ARMS == ("P/P", "R/P", "P/R", "R/R")
