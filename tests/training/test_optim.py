"""StrictAdamW: byte-equal to torch.optim.AdamW's single-tensor path on float32 weights (and torch's fused path is
not), within 2x torch's error of a float64 AdamW, byte-equal to itself; bfloat16 weights follow their float32 master;
bad hyperparameters and bad gradients raise and leave the weights as they were."""

import pytest
import torch
from torch import nn

from strict_testing import assert_error_within
from h3lab.training import StrictAdamW, TrainingError

SHAPES = [(37, 5), (129,), (3, 7, 11)]
HYPER = {"lr": 3e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}


def setting(seed: int = 0, steps: int = 5):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) * 10.0 ** (k - 2) for s in SHAPES] for k in range(steps)]
    return init, grads


def run_strict(init, grads, dtype=torch.float32, **kw):
    params = [nn.Parameter(x.clone().to(dtype)) for x in init]
    opt = StrictAdamW([(f"p{i}", p) for i, p in enumerate(params)], **{**HYPER, **kw})
    for gs in grads:
        opt.step(torch.cat([g.reshape(-1) for g in gs]))
    return [p.detach() for p in params], opt


def run_torch(init, grads, dtype=torch.float32, **kw):
    params = [nn.Parameter(x.clone().to(dtype)) for x in init]
    opt = torch.optim.AdamW(params, **HYPER, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone().to(dtype)
        opt.step()
    return [p.detach() for p in params]


def test_equals_torch_single_tensor_adamw_and_is_accurate():
    init, grads = setting()
    ours, _ = run_strict(init, grads)
    torch_single = run_torch(init, grads, foreach=False)
    torch_fused = run_torch(init, grads, fused=True)
    truth = run_torch(init, grads, dtype=torch.float64, foreach=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, torch_single))
    assert not all(torch.equal(a, b) for a, b in zip(ours, torch_fused)), "fused AdamW rounds differently"
    for i, (a, b, t) in enumerate(zip(ours, torch_single, truth)):
        assert not torch.equal(a.double(), t)
        assert_error_within(a, b, t, f"AdamW weight {i} vs float64")
        assert not torch.equal(a, init[i])


def test_repeat_is_byte_equal():
    init, grads = setting(seed=4)
    (a, opt_a), (b, opt_b) = run_strict(init, grads), run_strict(init, grads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert opt_a.state_digest() == opt_b.state_digest() and opt_a.step_count == 5
    assert set(opt_a.state_tensors()) == {f"p{i}.{k}" for i in range(3) for k in ("exp_avg", "exp_avg_sq")}


def test_bfloat16_weights_follow_a_float32_master():
    init, grads = setting(seed=2)
    bf16, opt = run_strict(init, grads, dtype=torch.bfloat16)
    master = [opt.state[f"p{i}"]["master"] for i in range(3)]
    # the master is the float32 run from the bf16-rounded start; the weights are it rounded to nearest even
    f32, _ = run_strict([x.to(torch.bfloat16).float() for x in init], grads)
    assert all(torch.equal(m, w) for m, w in zip(master, f32))
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(bf16, master))
    # without a master, updates below half a bf16 ulp are lost: weights of magnitude in [1, 8) have ulps >= 2^-7,
    # and Adam moves each by about lr per step
    big = [x.sign() * (1 + x.abs()).clamp(max=7.0) for x in init]
    start = [x.to(torch.bfloat16) for x in big]
    tiny = {"lr": 1e-5, "weight_decay": 0.0}
    many = [grads[0]] * 1000  # 1000 steps of ~1e-5 = 1e-2 > half an ulp of the weights in [1, 2)
    lost, _ = run_strict(big, many, dtype=torch.bfloat16, master_weights=False, **tiny)
    moved, _ = run_strict(big, many, dtype=torch.bfloat16, **tiny)
    assert all(torch.equal(p, s) for p, s in zip(lost, start))
    assert not all(torch.equal(p, s) for p, s in zip(moved, start))


def test_bad_settings_and_gradients_raise():
    p = nn.Parameter(torch.randn(4))
    for kw, match in (({"lr": 0.0}, "lr"), ({"lr": float("nan")}, "lr"), ({"betas": (0.9, 1.0)}, "betas"),
                      ({"eps": -1.0}, "eps"), ({"weight_decay": -0.1}, "weight_decay")):
        with pytest.raises(TrainingError, match=match):
            StrictAdamW([("p", p)], **kw)
    with pytest.raises(TrainingError, match="no parameters"):
        StrictAdamW([])
    opt = StrictAdamW([("p", p)])
    before = p.detach().clone()
    with pytest.raises(TrainingError, match="float32 \\(4,\\)"):
        opt.step(torch.randn(5))
    with pytest.raises(TrainingError, match="float32"):
        opt.step(torch.randn(4, dtype=torch.float64))
    with pytest.raises(TrainingError, match="non-finite"):
        opt.step(torch.tensor([1.0, float("inf"), 0.0, 0.0]))
    assert torch.equal(p.detach(), before) and opt.step_count == 0
