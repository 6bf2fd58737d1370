"""Train/rollout (RFC section 1, arms of section 6.4) with a backward actually taken: the velocity inside the strict
training step equals the strict rollout's at every pass of a recorded trajectory (R/R), byte for byte, while the step
differentiates it; the mixed arm P/R (the torch `off` step, bit-equal to Diffusers on CPU, over the strict rollout)
drifts from the first pass, and P/P (the `off` step over Diffusers' own rollout) repeats it. (R/P with a backward
would cost two more strict backwards here; `tests/research/test_arms.py` shows R/P's forward drift.)"""

import pytest
import torch

from h3lab.research.ablation import tiny_bench
from h3lab.research.arms import rollout, sides
from h3lab.training import Objective, compute_gradients, rollout_requests
from h3lab.training.step import split_flat, trainable_parameters


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return tiny_bench(str(tiny_snapshot))


def step_velocities(bench, trajectory, mode):
    requests = rollout_requests(trajectory, weight=0.8)
    before = {n: p.detach().clone() for n, p in bench.model.named_parameters()}
    result = compute_gradients(bench.model, requests, Objective(), mode=mode, keep=True)
    assert all(torch.equal(before[n], p) for n, p in bench.model.named_parameters()), "the step changed weights"
    return result


def first_drift(result, trajectory):
    for i, (vv, va) in enumerate(result.velocities):
        for m, v in (("video", vv), ("audio", va)):
            if not torch.equal(v, trajectory.kept[f"velocity_{m}.{i:04d}"]):
                return i, m
    return None


def test_rr_step_velocity_equals_rollout_at_every_pass(bench):
    traj = bench.reference_trajectory("strict")
    result = step_velocities(bench, traj, "strict")
    assert len(result.velocities) == traj.inputs.num_passes == 2
    assert first_drift(result, traj) is None
    # a backward was taken through the strict kernels: every parameter got a finite, non-zero gradient
    for rg in result.request_gradients:
        for name, g in split_flat(rg.gradient, trainable_parameters(bench.model)).items():
            assert torch.isfinite(g).all() and g.abs().max() > 0, name
    summary = result.trace.to_dict()
    assert summary["forwards"] == 2 and summary["non_strict_calls"] == 0
    assert all(set(b) == {"strict"} for b in summary["ops"].values())


def test_mixed_and_production_arms(bench):
    strict_traj = bench.reference_trajectory("strict")
    assert first_drift(step_velocities(bench, strict_traj, "off"), strict_traj) == (0, "video")  # P/R
    p_traj = rollout(sides(bench.model)["P"], bench.inputs, bench.schedule)
    assert first_drift(step_velocities(bench, p_traj, "off"), p_traj) is None  # P/P: torch repeats on CPU
