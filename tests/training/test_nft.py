"""DiffusionNFT (`h3lab.training.nft`): its loss against a float64 reference and its gradient's sign, the forward
noising of the supervised objective (row timesteps equal to the rollout's own plan, draw order, target), the frozen
previous policy byte-equal however it is batched (strict: batch 1 vs N, any position; the first training forward
equal to it), and sealed runs that verify byte for byte, name a tampered record and resume to the uninterrupted run.
"""

import math

import pytest
import torch

from grpo_cases import group_inputs
from lora_cases import lora_model
from training_cases import SMALL, build_model, make_layout

from h3lab.hashing import model_fingerprint
from h3lab.run.layout import timesteps_of_kinds
from h3lab.run import RunSpec
from h3lab.run.sampler import DualSchedule, draw_noise, noise_mix
from h3lab.run.trajectory import record
from h3lab.training import OptimizerConfig, TrainingError, add_lora, trainable_parameters
from h3lab.training.objective import shifted_sigma
from h3lab.training.nft import (NftBatch, NftConfig, clean_request, frozen_velocities, load, nft_iteration,
                                nft_modality_loss, nft_train, noising_seed, optimality, verify)
from h3lab.training.nft.step import noised_items

REWARDS = [0.2, 0.9, 0.5]


def euler_rollout(model, task="fl2va", group=3, passes=2, seed=0, mode="off", requests=None):
    """G requests of one prompt rolled out batched on the released Euler step; their clean requests, in `requests`
    order of the batch positions (default 0..G-1)."""
    layout, schedule = make_layout(task), DualSchedule.from_passes(passes)
    inputs = group_inputs(SMALL, layout, schedule, group, seed)
    spec = RunSpec(inputs, schedule, mode=mode, layout=layout, fingerprint=model_fingerprint(model))
    trajectory = record(spec, model, keep=("latents",))
    ids = list(range(group)) if requests is None else list(requests)
    clean = sorted((clean_request(trajectory, b, ids[b], 0) for b in range(group)), key=lambda q: q.request)
    return trajectory, clean


def batch_of(clean, rewards=REWARDS, parts=None):
    return NftBatch(clean, torch.tensor(rewards, dtype=torch.float64), {"kind": "euler"}, parts or [])


def test_the_loss_is_the_float64_formula_and_its_gradient_points_by_the_advantage():
    g = torch.Generator().manual_seed(1)
    v_theta, v_old, target, v_ref = (torch.randn(1, 5, 3, generator=g) for _ in range(4))
    for r, beta in ((0.8, 1.0), (0.1, 0.3)):
        loss, parts = nft_modality_loss(v_theta, v_old, target, r, beta, v_ref)
        t, o, y = v_theta.double(), v_old.double(), target.double()
        pos = ((beta * t + (1 - beta) * o - y) ** 2).mean()
        neg = (((1 + beta) * o - beta * t - y) ** 2).mean()
        assert float(loss) == pytest.approx(float(r * pos + (1 - r) * neg), rel=1e-6)
        assert float(parts["kl"]) == pytest.approx(float(((t - v_ref.double()) ** 2).mean()), rel=1e-6)
    # at v_theta = v_old the gradient is 2 beta (2r - 1)(v_old - target) / numel: toward the target when r > 1/2
    for r in (0.9, 0.2):
        at = v_old.clone().requires_grad_()
        nft_modality_loss(at, v_old, target, r, 0.5)[0].backward()
        want = 2 * 0.5 * (2 * r - 1) * (v_old - target) / v_old.numel()
        assert torch.allclose(at.grad, want, rtol=1e-5, atol=1e-7)
    a = torch.tensor([-7.0, -2.5, 0.0, 1.0, 6.0], dtype=torch.float64)
    assert optimality(a, 5.0).tolist() == [0.0, 0.25, 0.5, 0.6, 1.0]


@pytest.mark.parametrize("task", ["fl2va", "ref2va"])
def test_row_timesteps_of_a_clean_request_are_the_layouts_own(task):
    model = build_model(SMALL, "released", 3)
    trajectory, clean = euler_rollout(model, task=task, group=2, passes=3)
    for i, (timestep, indices) in enumerate(trajectory.inputs.plan):
        tv, ta = trajectory.schedule.video.timesteps[i], trajectory.schedule.audio.timesteps[i]
        got = timesteps_of_kinds(clean[0].kinds(), float(tv), float(ta))
        assert torch.equal(got[0], timestep) and torch.equal(got[1], indices), (task, i)


def test_the_noising_is_the_supervised_forward_process_in_the_declared_order():
    model = build_model(SMALL, "released", 4)
    trajectory, clean = euler_rollout(model, group=3)
    cfg = NftConfig(group=3, draws=2, seed=5, mode="off")
    items, sigmas = noised_items(batch_of(clean), cfg, iteration=7, device="cpu")
    assert [(it.request, it.draw) for it in items] == [(r, k) for r in range(3) for k in range(2)]
    for k in range(2):  # the declared order, redrawn by hand
        g = torch.Generator().manual_seed(noising_seed(5, 7, 0, k))
        u = torch.rand(2, generator=g)
        sv, sa = shifted_sigma(u[0], 12.0), shifted_sigma(u[1], 3.0)
        assert (sigmas[k]["sigma_video"], sigmas[k]["sigma_audio"]) == (float(sv), float(sa))
        for q in clean:
            nv, na = draw_noise(q.video.shape, g), draw_noise(q.audio.shape, g)
            s = items[2 * q.request + k].sample
            ncv = q.num_condition_video_rows
            assert torch.equal(s.video[:, :ncv], q.video[:, :ncv])  # the anchor rows as the rollout fed them
            assert torch.equal(s.video[:, ncv:], noise_mix(q.video[:, ncv:], nv[:, ncv:], 1 - sv))
            assert torch.equal(s.audio, noise_mix(q.audio, na, 1 - sa))
            assert torch.equal(s.target_video, q.video[:, ncv:] - nv[:, ncv:])
            assert torch.equal(s.target_audio, q.audio - na)
    # the final latents are the rollout's last pass
    last = trajectory.inputs.num_passes - 1
    assert torch.equal(clean[1].video[:, 4:], trajectory.kept[f"video.{last:04d}"][1:2, 4:])


@pytest.fixture(scope="module")
def strict_case():
    model = lora_model(seed=44)
    _, clean = euler_rollout(model, group=3, passes=1, seed=6, mode="strict", requests=[2, 0, 1])
    return model, clean


def test_strict_old_velocities_are_byte_equal_however_batched(strict_case):
    model, clean = strict_case
    cfg = NftConfig(group=3, mode="strict", seed=2)
    items, _ = noised_items(batch_of(clean), cfg, 0, "cpu")
    from h3lab.execution import runtime

    with runtime.use_mode("strict"):
        grouped = frozen_velocities(model, items, "group")
        alone = frozen_velocities(model, items, "request")
        turned = frozen_velocities(model, items[::-1], "group")[::-1]  # every request at another batch position
    for a, b, c in zip(grouped, alone, turned):
        for m in ("video", "audio"):
            assert torch.equal(a[m], b[m]) and torch.equal(a[m], c[m]), m


def test_strict_first_training_forward_equals_the_old_velocity(strict_case):
    model, clean = strict_case
    before = {n: p.detach().clone() for n, p in trainable_parameters(model)}
    cfg = NftConfig(group=3, mode="strict", ref_kl=1e-4, optim=OptimizerConfig(lr=1e-3), gradient_checkpointing=True)
    rec = nft_iteration(model, batch_of(clean), cfg, cfg.optimizer(trainable_parameters(model)))
    with torch.no_grad():
        for n, p in trainable_parameters(model):
            p.copy_(before[n])
    on_policy = rec["epochs"][0]["on_policy"]
    assert on_policy == {"count": 6, "exactly_equal": 6, "max_abs": 0.0}
    assert all(math.isfinite(it["loss"]) for it in rec["epochs"][0]["items"])


def fresh_model(seed=9):
    model = build_model(SMALL, "released", seed)
    add_lora(model, 2, 4.0, seed=1)
    return model


def rollout_of(k, model, parts=None):
    _, clean = euler_rollout(model, group=3, passes=2, seed=10 + k)
    return batch_of(clean, [0.1 * k, 0.7, -0.3], parts)


CFG = NftConfig(group=3, mode="off", draws=2, inner_epochs=2, ref_kl=1e-3, optim=OptimizerConfig(lr=1e-2),
                seed=4)


@pytest.fixture(scope="module")
def off_run():
    model = fresh_model()
    parts = [{"name": "a", "weight": 1.0, "values": [0.1, 0.7, -0.3], "mean": 0.5 / 3}]
    return model, nft_train(model, lambda k, m: rollout_of(k, m, parts), CFG, 2, reward="a:1.0")


def test_an_off_run_trains_records_and_verifies(off_run, tmp_path):
    model, run = off_run
    first, second = run.iterations[0]["epochs"]
    assert first["on_policy"]["exactly_equal"] == first["on_policy"]["count"] == 12
    assert "on_policy" not in second and first["weights"] != second["weights"]
    assert run.iterations[0]["reward_parts"][0]["name"] == "a"
    assert [it["iteration"] for it in run.iterations] == [0, 1] and run.manifest["format"] == "h3lab-nft/1"
    assert run.manifest["adapter"]["initial_sha256"] != run.manifest["adapter"]["final_sha256"]
    # the second iteration's previous policy is the first one's trained adapter: v_old moved
    assert run.iterations[1]["frozen"][0]["old"] != run.iterations[1]["frozen"][0]["ref"]
    loaded = load(run.seal(tmp_path / "run"))
    assert loaded.config == CFG and loaded.digest == run.digest
    report = verify(loaded, model)
    assert report.ok and str(report).startswith("OK: 2/2 DiffusionNFT iterations byte-equal"), str(report)
    loaded.manifest["iterations"][1]["epochs"][0]["items"][2]["video"]["negative"] = 0.5
    report = verify(loaded, model)
    assert not report.ok and report.first_iteration == 1 and report.field == "epochs[0].items[2].video.negative"


def test_resume_from_a_checkpoint_equals_the_uninterrupted_run(off_run, tmp_path):
    _, whole = off_run

    class Stop(Exception):
        pass

    def stop(k, rec, run):
        run.seal(tmp_path / "ckpt")
        raise Stop

    parts = [{"name": "a", "weight": 1.0, "values": [0.1, 0.7, -0.3], "mean": 0.5 / 3}]
    with pytest.raises(Stop):
        nft_train(fresh_model(), lambda k, m: rollout_of(k, m, parts), CFG, 2, on_iteration=stop)
    resumed = nft_train(fresh_model(), lambda k, m: rollout_of(k, m, parts), CFG, 2, resume=load(tmp_path / "ckpt"))
    assert resumed.digest == whole.digest
    assert all(torch.equal(resumed.weights[k], whole.weights[k]) for k in whole.weights)


def test_config_refusals_are_one_line():
    for kw, msg in ((dict(kind="sde"), "NftConfig.kind='sde'"), (dict(kind="euler", level=0.5), "no noise level"),
                    (dict(group=1), "group=1"), (dict(beta=0.0), "beta=0.0"), (dict(adv_clip=-1), "adv_clip=-1"),
                    (dict(ref_kl=-1e-4), "ref_kl=-0.0001"), (dict(draws=0), "draws=0"),
                    (dict(old_batch="all"), "old_batch='all'"), (dict(mode="fast"), "DiffusionNFT needs the strict"),
                    (dict(kind="flow_sde", level=-1), "level=-1"), (dict(optim=0.0), "lr=0.0")):
        with pytest.raises(TrainingError, match=msg) as err:
            NftConfig(**kw) if "optim" not in kw else NftConfig(optim=OptimizerConfig(lr=kw["optim"]))
        assert "\n" not in str(err.value)
    assert NftConfig(kind="cps").level == 0.7
    cfg = NftConfig(kind="flow_sde", level=0.45, draws=3, old_batch="request")
    assert NftConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TrainingError, match="carries none"):
        nft_iteration(build_model(SMALL, "released", 1), batch_of([], []), NftConfig(group=3), None)
