"""The flow-matching objective against an independent float64 formulation written here: the sigma draw is the
sampler's grid formula, the noised rows / targets / loss are the released relations within derived float32 error
bounds, conditioning rows sit at their released timesteps and noise levels and are excluded from the loss (zero
gradient), the per-modality weights act as declared, rollout requests regress toward the rollout's own final
latents, canonicalisation equals `PackedLayout.permute(canonical_order())`, and bad input raises."""

import pytest
import torch
from training_cases import SMALL, build_model, make_clip, make_layout

from h3lab.run import sampler
from h3lab.run.layout import CONDITION_VIDEO_T
from h3lab.run import DenoiseInputs, RunSpec
from h3lab.run.trajectory import record
from h3lab.training import ClipRequest, Objective, TrainingError, flow_matching_loss, rollout_request, rollout_requests
from h3lab.training.objective import shifted_sigma

EPS = torch.finfo(torch.float32).eps


def reference_draws(request: ClipRequest, objective: Objective):
    """Independent float64 formulation: u ~ U[0,1) (2 values), sigma = s*u / (1 + (s-1)*u), noise N(0,1) for every
    video row then every audio row, x_t = (1 - sigma)*x0 + sigma*noise, target = x0 - noise (all float64)."""
    g = torch.Generator().manual_seed(request.seed)
    u = torch.rand(2, generator=g).double()
    shifts = torch.tensor([objective.video_shift, objective.audio_shift], dtype=torch.float64)
    sigma = shifts * u / (1 + (shifts - 1) * u)
    noise_v = torch.randn(request.video.shape, generator=g).double()
    noise_a = torch.randn(request.audio.shape, generator=g).double()
    return sigma, noise_v, noise_a


@pytest.mark.parametrize("shift", [sampler.VIDEO_SHIFT, sampler.AUDIO_SHIFT, 1.0])
def test_sigma_formula_is_the_samplers_grid_formula(shift):
    base = torch.linspace(1.0, 0.0, 41, dtype=torch.float32)
    assert torch.equal(shifted_sigma(base, shift), sampler.sigma_schedule(41, shift))
    assert torch.equal(1.0 - shifted_sigma(base, shift)[:-1], sampler.timesteps(sampler.sigma_schedule(41, shift)))


@pytest.mark.parametrize("task", ["fl2va", "ref2va"])
def test_clip_sample_against_float64_formulation(task):
    layout = make_layout(task)
    objective = Objective(video_weight=0.7, audio_weight=1.3)
    request = make_clip(SMALL, layout, seed=5, draw_seed=11, weight=0.5)
    s = request.sample(objective)
    sigma, noise_v, noise_a = reference_draws(request, objective)
    ncv, nca = layout.num_condition_video_rows, layout.num_condition_audio_rows
    assert ncv > 0 and (nca > 0) == (task == "ref2va")
    x0v, x0a = request.video.double(), request.audio.double()
    # sigma: float32 formula of a float32 u (3 roundings) -> within 4 eps relative of the float64 value
    got = torch.stack([s.sigma_video, s.sigma_audio]).double()
    assert s.sigma_video.dtype == torch.float32 and torch.all((got - sigma).abs() <= 4 * EPS * sigma)
    assert 0 < float(s.sigma_video) < 1 and 0 < float(s.sigma_audio) < 1
    # target rows: x_t = (1 - sigma)*x0 + sigma*noise. float32 t = 1 - sigma32 and 1 - t carry <= 6 eps absolute,
    # each product and the sum one rounding more: |err| <= 8 eps (|x0| + |noise|) elementwise.
    for name, x0, noise, sig, c in (("video", x0v, noise_v, sigma[0], ncv), ("audio", x0a, noise_a, sigma[1], nca)):
        rows = getattr(s, name)[:, c:].double()
        want = (1 - sig) * x0[:, c:] + sig * noise[:, c:]
        bound = 8 * EPS * (x0[:, c:].abs() + noise[:, c:].abs())
        assert torch.all((rows - want).abs() <= bound), name
        assert not torch.equal(rows, x0[:, c:]), f"{name} target rows were not noised"
        target = getattr(s, f"target_{name}").double()
        assert torch.all((target - (x0[:, c:] - noise[:, c:])).abs() <= EPS * (x0[:, c:] - noise[:, c:]).abs())
        # the released relation read backwards: x0 = x_t + sigma * v at v = target, to the two roundings above
        assert torch.all((rows + sig * target - x0[:, c:]).abs() <= bound + sig * EPS * target.abs()), name
    # conditioning rows at their released noise levels: anchors/references t = 0.999, reference audio clean
    assert torch.equal(s.video[:, :ncv], sampler.noise_mix(request.video[:, :ncv], noise_v[:, :ncv].float(),
                                                           sampler.CONDITION_T))
    assert torch.equal(s.audio[:, :nca], request.audio[:, :nca])
    # row timesteps: the layout's released table at (t_video, t_audio)
    t_v, t_a = float(1 - s.sigma_video), float(1 - s.sigma_audio)
    want_t, want_idx = layout.row_timesteps(t_v, t_a)
    assert torch.equal(s.timestep, want_t) and torch.equal(s.timestep_indices, want_idx)
    row_t = s.timestep[s.timestep_indices]
    assert torch.all(row_t[layout.video_indices[:ncv]] == torch.tensor(max(t_v, CONDITION_VIDEO_T)))
    assert torch.all(row_t[layout.audio_indices[:nca]] == 1.0)
    assert torch.all(row_t[layout.video_indices[ncv:]] == torch.tensor(t_v, dtype=torch.float32))

    # the loss against float64: recursive-summation bound gamma_n over n squared terms (+ the few final roundings)
    g = torch.Generator().manual_seed(9)
    v_video = torch.randn(s.video.shape, generator=g, requires_grad=True)
    v_audio = torch.randn(s.audio.shape, generator=g, requires_grad=True)
    loss = flow_matching_loss(objective, v_video, v_audio, s)
    value = float(loss.detach())
    assert loss.dtype == torch.float32 and loss.ndim == 0
    mse = [((v.detach().double()[:, c:] - (x0[:, c:] - n[:, c:])) ** 2).mean()
           for v, x0, n, c in ((v_video, x0v, noise_v, ncv), (v_audio, x0a, noise_a, nca))]
    truth = 0.5 * (0.7 * mse[0] + 1.3 * mse[1])
    n = max(v_video[:, ncv:].numel(), v_audio[:, nca:].numel())
    assert abs(value - float(truth)) <= (n + 8) * EPS * float(truth) and value != float(truth)
    # the backward seed: elementwise 2*weight*w_m*(v - target)/numel on target rows, exactly 0 on conditioning rows
    loss.backward()
    for v, target, c, w in ((v_video, s.target_video, ncv, 0.7), (v_audio, s.target_audio, nca, 1.3)):
        assert torch.equal(v.grad[:, :c], torch.zeros_like(v.grad[:, :c]))
        d = v.detach()[:, c:].double() - target.double()
        want = 2 * 0.5 * w * d / d.numel()
        assert torch.allclose(v.grad[:, c:].double(), want, rtol=8 * EPS, atol=0)


def test_modality_weights_are_declared_and_act():
    layout = make_layout("fl2va")
    s = make_clip(SMALL, layout, seed=3).sample(Objective())
    g = torch.Generator().manual_seed(1)
    v_video = torch.randn(s.video.shape, generator=g, requires_grad=True)
    v_audio = torch.randn(s.audio.shape, generator=g, requires_grad=True)
    video_only = flow_matching_loss(Objective(video_weight=1.0, audio_weight=0.0), v_video, v_audio, s)
    video_only.backward()
    assert torch.count_nonzero(v_audio.grad) == 0 and torch.count_nonzero(v_video.grad[:, 4:]) == v_video[:, 4:].numel()
    both = flow_matching_loss(Objective(), v_video, v_audio, s)
    audio_only = flow_matching_loss(Objective(video_weight=0.0), v_video, v_audio, s)
    assert torch.equal(both, video_only + audio_only)
    assert Objective(audio_weight=2.0).to_dict() == {"video_weight": 1.0, "audio_weight": 2.0,
                                                      "video_shift": 12.0, "audio_shift": 3.0}


def test_draws_depend_on_the_seed_only():
    layout = make_layout("fl2va")
    a = make_clip(SMALL, layout, seed=3, draw_seed=40).sample(Objective())
    b = make_clip(SMALL, layout, seed=3, draw_seed=40).sample(Objective())
    c = make_clip(SMALL, layout, seed=3, draw_seed=41).sample(Objective())
    for name in ("video", "audio", "target_video", "target_audio", "sigma_video", "timestep", "timestep_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.video, c.video) and not torch.equal(a.sigma_video, c.sigma_video)


def test_canonical_equals_layout_permute_back():
    layout = make_layout("ref2va")
    perm = torch.randperm(layout.sequence_length, generator=torch.Generator().manual_seed(2))
    permuted = layout.permute(perm)
    request = make_clip(SMALL, layout, seed=8)
    s = ClipRequest(permuted, request.text, request.video, request.audio, seed=request.seed).sample(Objective())
    assert s.key_order is not None
    canon = s.canonical()
    want = permuted.permute(permuted.canonical_order())
    base = request.sample(Objective())
    assert canon.key_order is None and want.is_canonical
    for name in ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices"):
        assert torch.equal(getattr(canon, name), getattr(want, name)), name
        assert torch.equal(getattr(canon, name), getattr(base, name)), name
    assert torch.equal(canon.timestep_indices, base.timestep_indices)
    for name in ("video", "audio", "text", "target_video", "target_audio", "timestep"):
        assert torch.equal(getattr(canon, name), getattr(base, name)), name  # the streams keep their order
    assert canon.canonical() is canon


@pytest.fixture(scope="module")
def trajectory():
    """A 3-pass off-mode fl2va trajectory of a small model, latents and velocities kept."""
    model = build_model(SMALL, "float32", 4)
    layout = make_layout("fl2va")
    schedule = sampler.DualSchedule.from_passes(3)
    clip = make_clip(SMALL, layout, seed=6)
    noise = torch.randn(clip.video.shape, generator=torch.Generator().manual_seed(7))
    video = torch.cat([clip.video[:, :4], noise[:, 4:]], 1)
    inputs = DenoiseInputs.from_layout(layout, schedule, clip.text, video, torch.randn(clip.audio.shape))
    return record(RunSpec(inputs, schedule, mode="off"), model, keep=("latents", "velocities"))


def test_rollout_request_targets_the_rollouts_final_latents(trajectory):
    inputs, kept = trajectory.inputs, trajectory.kept
    n = inputs.num_passes
    requests = rollout_requests(trajectory, weight=-0.25)
    assert len(requests) == n and all(r.weight == -0.25 for r in requests)
    for i, r in enumerate(requests):
        s = r.sample(Objective())
        entering_v = inputs.video if i == 0 else kept[f"video.{i - 1:04d}"]
        entering_a = inputs.audio if i == 0 else kept[f"audio.{i - 1:04d}"]
        assert torch.equal(s.video, entering_v) and torch.equal(s.audio, entering_a)
        assert torch.equal(s.timestep, inputs.plan[i][0]) and torch.equal(s.timestep_indices, inputs.plan[i][1])
        for m, x, c in (("video", entering_v, 4), ("audio", entering_a, 0)):
            sigma = 1 - getattr(trajectory.schedule, m).timesteps[i].double()
            want = (kept[f"{m}.{n - 1:04d}"][:, c:].double() - x[:, c:].double()) / sigma
            got = getattr(s, f"target_{m}").double()
            # float32 difference then a division: 2 roundings of the float64 value, relative to the magnitudes
            scale = (kept[f"{m}.{n - 1:04d}"][:, c:].double().abs() + x[:, c:].double().abs()) / sigma
            assert torch.all((got - want).abs() <= 3 * EPS * scale), (i, m)
    # the last pass's target is its own velocity: x_next = x0 prediction = x + sigma*v (one float32 rounding) at
    # sigma_next = 0, so (x_next - x)/sigma = v up to eps*(|x| + |x_next|)/sigma and the target's own roundings
    last = requests[-1].sample(Objective())
    v = kept[f"velocity_video.{n - 1:04d}"][:, 4:].double()
    x, x_n = kept[f"video.{n - 2:04d}"][:, 4:].double(), kept[f"video.{n - 1:04d}"][:, 4:].double()
    sigma = 1 - trajectory.schedule.video.timesteps[n - 1].double()
    bound = 4 * EPS * (x.abs() + x_n.abs()) / sigma + EPS * v.abs()
    assert torch.all((last.target_video.double() - v).abs() <= bound)
    assert not torch.equal(last.target_video.double(), v)


def test_bad_inputs_raise(trajectory):
    layout = make_layout("fl2va")
    good = make_clip(SMALL, layout, seed=1)
    with pytest.raises(TrainingError, match="video of shape"):
        ClipRequest(layout, good.text, good.video[:, 1:], good.audio)
    with pytest.raises(TrainingError, match="float32"):
        ClipRequest(layout, good.text, good.video.double(), good.audio)
    bad = good.audio.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(TrainingError, match="finite"):
        ClipRequest(layout, good.text, good.video, bad)
    with pytest.raises(TrainingError, match="seed"):
        ClipRequest(layout, good.text, good.video, good.audio, seed=-1)
    with pytest.raises(TrainingError, match="weight"):
        ClipRequest(layout, good.text, good.video, good.audio, weight=float("inf"))
    with pytest.raises(TrainingError, match="consistent PackedLayout"):
        ClipRequest(layout.permute(torch.arange(layout.sequence_length), leave_behind="token_tags"),
                    good.text, good.video, good.audio)
    with pytest.raises(TrainingError, match="with an audio weight of 0 too: at least one modality"):
        Objective(video_weight=0.0, audio_weight=0.0)
    with pytest.raises(TrainingError, match="video_shift"):
        Objective(video_shift=0.0)
    with pytest.raises(TrainingError, match="video_weight"):
        Objective(video_weight=-1.0)
    with pytest.raises(TrainingError, match="pass_index"):
        rollout_request(trajectory, trajectory.inputs.num_passes)
    with pytest.raises(TrainingError, match="item"):
        rollout_request(trajectory, 0, item=1)
    bare = record(RunSpec(trajectory.inputs, trajectory.schedule, mode="off"), build_model(SMALL, "float32", 4))
    with pytest.raises(TrainingError, match="keep=\\('latents'"):
        rollout_request(bare, 1)
