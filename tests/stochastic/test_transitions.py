"""The stochastic transition contract (h3lab/stochastic/transitions.py) against float64 references written from the
papers' formulas in the SD3 convention (x0_hat = x - sigma * v_sd3) with H3's velocity mapped in (v_sd3 = -v)."""

import hashlib
import math

import pytest
import torch

from h3lab.run.sampler import DualSchedule
from h3lab.stochastic import (SDE_KINDS, TransitionError, gaussian_logprob, noise_seed, pass_noise,
                              transition_logprob, transition_mean_std, tree_sum)

LEVELS = {"flow_sde": 0.7, "dance_sde": 0.3, "cps": 0.6}


# ---------------------------------------------------------------- float64 references, paper form, SD3 convention
def ref_flow_sde(x, v_sd3, s, s_next, a, sigma_max):
    """Flow-GRPO's sde_step_with_logprob ('sde'): sigma_max = the grid's sigmas[1]."""
    dt = s_next - s
    std_dev_t = math.sqrt(s / (1 - (sigma_max if s == 1 else s))) * a
    mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v_sd3 * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    return mean, std_dev_t * math.sqrt(-dt)


def ref_dance_sde(x, v_sd3, s, s_next, eta):
    """DanceGRPO's flux_step with sde_solver."""
    dsigma = s_next - s
    x0 = x - s * v_sd3
    score = -(x - x0 * (1 - s)) / s**2
    mean = x + dsigma * v_sd3 + (-0.5 * eta**2 * score) * dsigma
    return mean, eta * math.sqrt(s - s_next)


def ref_cps(x, v_sd3, s, s_next, a):
    """Coefficient-preserving sampling."""
    std = s_next * math.sin(a * math.pi / 2)
    x0 = x - s * v_sd3
    eps = x + v_sd3 * (1 - s)
    return x0 * (1 - s_next) + eps * math.sqrt(max(s_next**2 - std**2, 0.0)), std


def reference(kind, x, v, s, s_next, level, sigma_max):
    x64, v_sd3 = x.double(), -v.double()  # H3's data-ward velocity is minus SD3's
    if kind == "flow_sde":
        return ref_flow_sde(x64, v_sd3, s, s_next, level, sigma_max)
    if kind == "dance_sde":
        return ref_dance_sde(x64, v_sd3, s, s_next, level)
    return ref_cps(x64, v_sd3, s, s_next, level)


def ref_logprob(x_next, mean, std):
    d = x_next.double() - mean.double()
    std = float(std)
    lp = -(d**2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    lp = lp.reshape(lp.shape[0], -1)
    return lp.mean(1), lp.sum(1)


def grid(modality):
    sched = getattr(DualSchedule.from_passes(5), modality)
    return [(i, float(sched.sigmas[i]), float(sched.sigmas[i + 1])) for i in range(sched.num_passes)], sched


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32)


# ------------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("kind", SDE_KINDS)
@pytest.mark.parametrize("modality", ["video", "audio"])
def test_mean_std_match_the_papers_formulas_in_h3_convention(kind, modality):
    steps, sched = grid(modality)
    sigma_max = float(sched.sigmas[1])
    eps32 = 2.0**-24
    for i, s, s_next in steps:
        x, v = rand(2, 6, 8, seed=i), rand(2, 6, 8, seed=100 + i)
        mean, std = transition_mean_std(kind, x, v, s, s_next, LEVELS[kind])
        ref_mean, ref_std = reference(kind, x, v, s, s_next, LEVELS[kind], sigma_max)
        assert mean.dtype == torch.float32 and std.dtype == torch.float32 and std.ndim == 0
        assert abs(float(std) - ref_std) <= eps32 * ref_std + 1e-30
        # float32 rounding of ~8 ops on terms of size at most |x| + |v| + |mean| (coefficients <= 1)
        bound = 16 * eps32 * ((x.abs() + v.abs()).double() + ref_mean.abs())
        err = (mean.double() - ref_mean).abs()
        assert bool((err <= bound).all()), f"pass {i}: max error {float(err.max()):.3g}"


def test_sign_convention_denoises_towards_x0_hat():
    """A one-pass flow_sde step from the data estimate of an exact v moves the mean to x0_hat (H3: x0 = x + s v)."""
    x0, noise = rand(1, 4, 8, seed=1), rand(1, 4, 8, seed=2)
    s = 0.5
    x = (1 - s) * x0 + s * noise
    v = x0 - noise  # H3's data-ward velocity
    for kind in SDE_KINDS:
        mean, std = transition_mean_std(kind, x, v, s, 0.0, LEVELS[kind])
        # into sigma 0, mean + std * eps must be a sample around x0 (CPS: exactly x0)
        assert float((mean - x0).abs().max()) < (1e-5 if kind == "cps" else 3.0), kind
    mean, _ = transition_mean_std("cps", x, v, s, 0.0, 0.5)
    assert torch.allclose(mean, x0, atol=1e-6)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_level_zero_is_the_released_euler_step_bytes(kind):
    for modality in ("video", "audio"):
        steps, sched = grid(modality)
        for i, s, s_next in steps:
            x, v = rand(3, 5, 7, seed=i), rand(3, 5, 7, seed=50 + i)
            mean, std = transition_mean_std(kind, x, v, sched.sigmas[i], sched.sigmas[i + 1], 0.0)
            assert torch.equal(mean, sched.step(i, x, v)), (modality, i)
            assert float(std) == 0.0


def test_cps_last_pass_is_deterministic_euler():
    _, sched = grid("video")
    i = sched.num_passes - 1
    x, v = rand(1, 3, 4), rand(1, 3, 4, seed=1)
    mean, std = transition_mean_std("cps", x, v, sched.sigmas[i], sched.sigmas[i + 1], 0.8)
    assert float(std) == 0.0 and torch.equal(mean, sched.step(i, x, v))
    with pytest.raises(TransitionError, match="deterministic"):
        gaussian_logprob(mean, mean, std)


@pytest.mark.parametrize("call, rule", [
    (lambda x: transition_mean_std("ode", x, x, 0.5, 0.4, 0.7), "must be one of"),
    (lambda x: transition_mean_std("flow_sde", x, x, 0.5, 0.4, -0.1), ">= 0"),
    (lambda x: transition_mean_std("cps", x, x, 0.5, 0.4, 1.5), r"in \[0, 1\]"),
    (lambda x: transition_mean_std("dance_sde", x, x, 0.5, 0.4, float("nan")), "finite"),
    (lambda x: transition_mean_std("dance_sde", x, x, 0.5, 0.4, True), "finite"),
    (lambda x: transition_mean_std("flow_sde", x, x, 0.4, 0.5, 0.7), "sigma_next < sigma"),
    (lambda x: transition_mean_std("flow_sde", x, x[:, :1], 0.5, 0.4, 0.7), "one shape"),
    (lambda x: gaussian_logprob(x, x, torch.tensor([1.0, 2.0, 3.0])), "one value per pass"),
    (lambda x: gaussian_logprob(x, x, -1.0), "> 0"),
    (lambda x: pass_noise(0, -1, 0, "video", (2,)), "request=-1"),
    (lambda x: pass_noise(0, 0, 0, "text", (2,)), "modality='text'"),
    (lambda x: pass_noise(0, 0, 0, "video", (2, -1)), "shape entry"),
])
def test_bad_input_raises_one_line(call, rule):
    with pytest.raises(TransitionError, match=rule) as err:
        call(rand(2, 3, 4))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", SDE_KINDS)
def test_logprob_of_a_sample_is_finite_and_matches_float64(kind):
    steps, _ = grid("audio")
    for i, s, s_next in steps[:-1]:  # the last CPS pass has no density
        x, v = rand(2, 9, 16, seed=i), rand(2, 9, 16, seed=20 + i)
        mean, std = transition_mean_std(kind, x, v, s, s_next, LEVELS[kind])
        x_next = mean + std * torch.stack([pass_noise(7, r, i, "audio", (9, 16)) for r in range(2)])
        logp_mean, logp_sum, mean2, std2 = transition_logprob(kind, LEVELS[kind], x, v, x_next, s, s_next)
        assert torch.equal(mean2, mean) and torch.equal(std2, std)
        assert logp_mean.dtype == torch.float32 and logp_mean.shape == (2,)
        assert bool(torch.isfinite(logp_sum).all())
        ref_mean, ref_sum = ref_logprob(x_next, mean, std)
        tol = 2.0**-23
        assert bool(((logp_sum.double() - ref_sum).abs() <= tol * ref_sum.abs() + 1e-6).all())
        assert bool(((logp_mean.double() - ref_mean).abs() <= tol * ref_mean.abs() + 1e-9).all())


def test_logprob_is_batch_invariant_bytes():
    x, v = rand(5, 33, 12, seed=3), rand(5, 33, 12, seed=4)
    mean, std = transition_mean_std("flow_sde", x, v, 0.8, 0.7, 0.7)
    x_next = mean + std * rand(5, 33, 12, seed=5)
    batch_mean, batch_sum = gaussian_logprob(x_next, mean, std)
    order = [3, 0, 4, 1, 2]
    perm_mean, perm_sum = gaussian_logprob(x_next[order], mean[order], std)
    for b in range(5):
        m1, s1 = gaussian_logprob(x_next[b:b + 1].clone(), mean[b:b + 1].clone(), std)
        assert torch.equal(m1[0], batch_mean[b]) and torch.equal(s1[0], batch_sum[b])
        assert torch.equal(perm_sum[order.index(b)], batch_sum[b])
        alone, _ = transition_mean_std("flow_sde", x[b:b + 1], v[b:b + 1], 0.8, 0.7, 0.7)
        assert torch.equal(alone[0], mean[b])


def test_tree_sum_is_the_declared_pairwise_tree():
    values = rand(3, 37, seed=9).double()

    def declared(row):  # element j plus element j + width / 2, zero-padded to a power of two
        row = list(row) + [0.0] * ((1 << (len(row) - 1).bit_length()) - len(row))
        while len(row) > 1:
            half = len(row) // 2
            row = [row[j] + row[j + half] for j in range(half)]
        return row[0]

    got = tree_sum(values)
    for b in range(3):
        assert float(got[b]) == declared(values[b].tolist())
        assert abs(float(got[b]) - math.fsum(values[b].tolist())) < 1e-12


def test_logprob_gradient_in_mean():
    x_next, mean = rand(2, 4, 5, seed=1), rand(2, 4, 5, seed=2).requires_grad_(True)
    _, logp_sum = gaussian_logprob(x_next, mean, 0.5)
    logp_sum.sum().backward()
    assert torch.allclose(mean.grad, (x_next - mean.detach()) / 0.25, rtol=1e-6, atol=1e-6)


def test_pass_noise_is_keyed_by_seed_request_pass_modality():
    key = "h3lab-pass-noise/1|11|2|3|audio"  # the declared derivation, re-done here
    expected = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
    assert noise_seed(11, 2, 3, "audio") == expected
    a = pass_noise(11, 2, 3, "audio", (4, 6))
    g = torch.Generator().manual_seed(expected)
    assert a.dtype == torch.float32 and a.device.type == "cpu"
    assert torch.equal(a, torch.randn((4, 6), generator=g))
    assert torch.equal(a, pass_noise(11, 2, 3, "audio", [4, 6]))
    for other in [(12, 2, 3, "audio"), (11, 3, 3, "audio"), (11, 2, 4, "audio"), (11, 2, 3, "video")]:
        assert not torch.equal(a, pass_noise(*other, (4, 6)))
