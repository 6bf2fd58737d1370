"""The GRPO pieces (`h3lab.training.grpo`) against independent float64 references on fresh random inputs:
group advantages, the clipped surrogate and its clip mask, truncated importance weights, the reference KL against
the closed-form Gaussian KL, pass selection (all, seeded fraction, window) and its refusals."""

import math

import pytest
import torch

from h3lab.training import TrainingError
from h3lab.training.grpo import (
    ADVANTAGE_EPS,
    PassSelection,
    clipped_surrogate,
    group_advantages,
    ratio_of,
    ratio_stats,
    reference_kl,
    truncated_weight,
)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_group_advantages_match_a_python_reference():
    r = torch.randn(12, generator=gen(0), dtype=torch.float64) * 3 + 1
    got = group_advantages(r, group=4)
    for p in range(3):
        vals = [float(x) for x in r[4 * p:4 * p + 4]]
        m = sum(vals) / 4
        s = math.sqrt(sum((v - m) ** 2 for v in vals) / 4)
        for j, v in enumerate(vals):
            assert got[4 * p + j].item() == pytest.approx((v - m) / (s + ADVANTAGE_EPS), rel=1e-12)
    assert got.dtype == torch.float64
    same = group_advantages(torch.full((4,), 0.3), 4)
    assert torch.equal(same, torch.zeros(4, dtype=torch.float64))
    clipped = group_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), 4, eps=1e-9, clip=1.5)
    assert clipped.max().item() == 1.5 and clipped.min().item() == pytest.approx(-1 / math.sqrt(3))
    for bad, msg in ((dict(rewards=torch.zeros(5), group=4), "must be \\(prompts \\* group"),
                     (dict(rewards=torch.zeros(4), group=1), "group=1"),
                     (dict(rewards=torch.tensor([0.0, float("nan")]), group=2), "NaN"),
                     (dict(rewards=torch.zeros(4), group=4, eps=0.0), "advantage eps=0.0")):
        with pytest.raises(TrainingError, match=msg):
            group_advantages(**bad)


def test_clipped_surrogate_and_mask():
    lt = torch.randn(64, generator=gen(1)) * 1e-3
    lo = torch.randn(64, generator=gen(2)) * 1e-3
    adv = torch.randn(64, generator=gen(3), dtype=torch.float64)
    ratio = ratio_of(lt, lo)
    loss, mask = clipped_surrogate(ratio, adv, 1e-4)
    for i in range(64):
        r, a = math.exp(float(lt[i]) - float(lo[i])), float(adv[i])
        want = max(-a * r, -a * min(max(r, 1 - 1e-4), 1 + 1e-4))
        assert loss[i].item() == pytest.approx(want, rel=1e-5)
        assert bool(mask[i]) == (-a * min(max(r, 1 - 1e-4), 1 + 1e-4) > -a * r + 1e-12 * abs(a))
    assert 0 < int(mask.sum()) < 64  # with |ratio - 1| ~ 1e-3 the clip engages on some entries
    # at ratio 1 nothing clips and the gradient is -A
    r1 = torch.ones(8, requires_grad=True)
    a = torch.randn(8, generator=gen(4), dtype=torch.float64)
    loss, mask = clipped_surrogate(r1, a, 1e-4)
    loss.sum().backward()
    assert not mask.any() and torch.equal(r1.grad, (-a).float())


def test_truncated_weight():
    old = torch.randn(16, generator=gen(5))
    roll = torch.randn(16, generator=gen(6))
    w = truncated_weight(old, roll, 2.0)
    want = torch.minimum(torch.exp(old.double() - roll.double()), torch.tensor(2.0, dtype=torch.float64))
    assert torch.allclose(w.double(), want, rtol=1e-6) and w.max() <= 2.0 and not w.requires_grad
    assert torch.equal(truncated_weight(old, old, 2.0), torch.ones(16))
    assert torch.equal(truncated_weight(old, roll, None), torch.ones(16))


def test_reference_kl_is_the_gaussian_kl():
    mu = torch.randn(3, 5, 4, generator=gen(7))
    ref = mu + 0.01 * torch.randn(3, 5, 4, generator=gen(8))
    std = 0.05
    kl = reference_kl(mu, ref, std)
    # KL(N(mu, s^2) || N(ref, s^2)) per element, averaged per request, in float64
    want = ((mu.double() - ref.double()) ** 2 / (2 * std ** 2)).reshape(3, -1).mean(1)
    assert kl.shape == (3,) and torch.allclose(kl.double(), want, rtol=1e-5)
    assert torch.equal(reference_kl(mu, mu.clone(), std), torch.zeros(3))
    with pytest.raises(TrainingError, match="must be equal"):
        reference_kl(mu, ref[:2], std)


def test_pass_selection():
    sde = [True] * 10
    assert PassSelection("all").select(sde) == tuple(range(10))
    assert PassSelection("all").select([False, True, True, False]) == (1, 2)
    frac = PassSelection("fraction", fraction=0.6)
    a = frac.select(sde, seed=3, iteration=0, request=0)
    assert len(a) == 6 and list(a) == sorted(a) and a == frac.select(sde, seed=3, iteration=0, request=0)
    picks = {frac.select(sde, seed=3, iteration=it, request=r) for it in range(3) for r in range(3)}
    assert len(picks) > 1  # depends on iteration and request
    assert len(PassSelection("fraction", fraction=0.01).select(sde)) == 1  # at least one pass
    window = [False, False, True, True, True, True, False]
    assert PassSelection("window", start=2, size=4).select(window) == (2, 3, 4, 5)
    with pytest.raises(TrainingError, match=r"window passes \[6\]: not SDE passes"):
        PassSelection("window", start=3, size=4).select(window)
    with pytest.raises(TrainingError, match="no SDE pass"):
        PassSelection().select([False, False])
    for kw, msg in ((dict(kind="some"), "must be one of"), (dict(fraction=0.0), "pass fraction=0.0"),
                    (dict(fraction=1.5), "<= 1.0"), (dict(size=0), "window size=0")):
        with pytest.raises(TrainingError, match=msg):
            PassSelection(**kw)
    assert PassSelection.from_dict(frac.to_dict()) == frac


def test_ratio_stats():
    s = ratio_stats([torch.ones(3), torch.tensor([1.0 + 2 ** -20, 1.0 - 2 ** -21])])
    assert s["count"] == 5 and s["exactly_one"] == 3
    assert s["max"] == 2 ** -20 and s["min"] == -(2 ** -21) and s["max_abs"] == 2 ** -20
