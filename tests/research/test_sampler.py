"""h3lab.run.sampler against Diffusers' `MiniMaxH3Scheduler` and the modular pipeline's noise blocks: bit-equal grids,
timesteps and full Euler step sequences (every grid size 2..200 at one shift and a spread of sizes at the others,
float32 and half samples), the conditioning noise mix, the request's draw order, and the reuse plan / velocity
extrapolation contract."""

from __future__ import annotations

import hashlib
import math
import types

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareConditionLatentsStep,
    MiniMaxH3PrepareLatentsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.modular_pipeline import PipelineState

from h3lab.run import sampler
from h3lab.errors import H3Error
from h3lab.run.sampler import (
    AUDIO_SHIFT,
    CONDITION_T,
    VIDEO_SHIFT,
    DualSchedule,
    Schedule,
    ScheduleError,
    draw_generation_noise,
    draw_noise,
    euler_step,
    extrapolate_velocity,
    noise_mix,
    passes_to_points,
    reuse_plan,
    sigma_schedule,
    timesteps,
)

SHIFTS = (12.0, 3.0, 1.0, 5.5)
POINTS = range(2, 201)


def _diffusers(num_points: int, shift: float) -> MiniMaxH3Scheduler:
    scheduler = MiniMaxH3Scheduler(shift=shift)
    scheduler.set_timesteps(num_points)
    return scheduler


def test_sigmas_and_timesteps_bit_equal_to_diffusers():
    for shift in SHIFTS + (0.5, 100.0):
        for n in POINTS:
            ref = _diffusers(n, shift)
            sigmas = sigma_schedule(n, shift)
            assert sigmas.dtype == torch.float32 and torch.equal(sigmas, ref.sigmas), (shift, n)
            t = timesteps(sigmas)
            assert t.dtype == torch.float32 and torch.equal(t, ref.timesteps), (shift, n)
            assert sigmas[-1].item() == 0.0 and len(t) == n - 1  # no collapse anywhere in this range


def _step_sequences(sample_dtype, velocity_dtype, points, shifts, generator):
    """Run Diffusers' step() and Schedule.step() over every pass of every grid with fresh random x_T and v_i."""
    for shift in shifts:
        for n in points:
            ref, mine = _diffusers(n, shift), Schedule.build(n, shift)
            x = torch.randn(3, 5, generator=generator).to(sample_dtype)
            x_ref = x.clone()
            vs = torch.randn(mine.num_passes, 3, 5, generator=generator).to(velocity_dtype)
            for i, t in enumerate(ref.timesteps):
                x_ref = ref.step(vs[i], t, x_ref, return_dict=False)[0]
                x = mine.step(i, x, vs[i])
                assert x.dtype == x_ref.dtype == sample_dtype
            assert torch.equal(x, x_ref), (shift, n, sample_dtype, velocity_dtype)


# Every grid size at one shift per test (the step arithmetic does not depend on the shift: the grids themselves are
# checked bit-equal at every size and shift above), the spread of sizes below at every other shift.
SPREAD = (2, 3, 4, 5, 8, 21, 50, 51, 99, 200)


def test_euler_steps_bit_equal_float32():
    g = torch.Generator().manual_seed(1)
    _step_sequences(torch.float32, torch.float32, POINTS, SHIFTS[:1], g)
    _step_sequences(torch.float32, torch.float32, SPREAD, SHIFTS[1:], g)


def test_euler_steps_bit_equal_bf16_samples_fp32_velocity():
    # The pipeline's case for a half sample: the heads are float32 and the loop passes `.float()` velocities.
    g = torch.Generator().manual_seed(2)
    _step_sequences(torch.bfloat16, torch.float32, POINTS, SHIFTS[1:2], g)
    _step_sequences(torch.bfloat16, torch.float32, SPREAD, SHIFTS[:1] + SHIFTS[2:], g)


@pytest.mark.parametrize(
    "sample_dtype, velocity_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.float64, torch.float32)],
)
def test_euler_steps_bit_equal_other_dtypes(sample_dtype, velocity_dtype):
    _step_sequences(sample_dtype, velocity_dtype, SPREAD, SHIFTS, torch.Generator().manual_seed(3))


def test_euler_step_low_level_matches_step_with_tensor_and_float_arguments():
    ref = _diffusers(50, 1.0)
    g = torch.Generator().manual_seed(4)
    x, v = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    # x0 uses sigma recovered from t, the ratio uses the grid; pick a pass where the two differ in float32.
    i = next(i for i in range(ref.num_inference_steps) if float(1 - ref.timesteps[i]) != float(ref.sigmas[i]))
    expected = ref.step(v, ref.timesteps[i], x.clone(), return_dict=False)[0]
    a = euler_step(x, v, ref.timesteps[i], ref.sigmas[i], ref.sigmas[i + 1])
    b = euler_step(x, v, float(ref.timesteps[i]), float(ref.sigmas[i]), float(ref.sigmas[i + 1]))
    assert torch.equal(a, expected) and torch.equal(b, expected)
    # x0 from the grid sigma instead would be a different step: the distinction is observable in the bytes.
    r = ref.sigmas[i + 1] / ref.sigmas[i]
    wrong = r * x + (1.0 - r) * (x + ref.sigmas[i] * v)
    assert not torch.equal(wrong, expected)


def test_collapsed_grid_bit_equal_and_non_monotone_grid_refused():
    # shift 1e4 at 1000 points collapses 20 float32 duplicates but stays strictly decreasing.
    ref, mine = _diffusers(1000, 1e4), Schedule.build(1000, 1e4)
    assert len(mine.sigmas) == 980 and torch.equal(mine.sigmas, ref.sigmas)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, generator=g)
    x_ref = x.clone()
    for i, t in enumerate(ref.timesteps):
        v = torch.randn(7, generator=g)
        x_ref, x = ref.step(v, t, x_ref, return_dict=False)[0], mine.step(i, x, v)
    assert torch.equal(x, x_ref)
    # shift 1e5 at 200 points: Diffusers keeps a grid that goes back up to 1.0; h3lab refuses it.
    bad = _diffusers(200, 1e5).sigmas
    assert not bool((bad[1:] < bad[:-1]).all())
    with pytest.raises(ScheduleError, match="shift=100000.0, num_points=200"):
        sigma_schedule(200, 1e5)


def test_eight_point_grids_match_the_facts_brief():
    # facts §7 quotes both 8-point grids to 4 decimals, hence the half-unit-in-the-4th-decimal tolerance.
    video = [1, 0.9863, 0.9677, 0.9412, 0.9, 0.8276, 0.6667, 0]
    audio = [1, 0.9474, 0.8824, 0.8, 0.6923, 0.5455, 0.3333, 0]
    dual = DualSchedule.build(8)
    assert torch.allclose(dual.video.sigmas.double(), torch.tensor(video, dtype=torch.float64), rtol=0, atol=5e-5)
    assert torch.allclose(dual.audio.sigmas.double(), torch.tensor(audio, dtype=torch.float64), rtol=0, atol=5e-5)
    assert dual.num_passes == 7 and (VIDEO_SHIFT, AUDIO_SHIFT) == (12.0, 3.0)


def test_passes_and_dual_schedule():
    assert passes_to_points(20) == 21 and passes_to_points(1) == 2
    dual = DualSchedule.from_passes(20)
    # `--steps 20` = 20 passes; Diffusers' num_inference_steps=21 gives the same 20 model calls.
    assert dual.num_passes == 20 and dual.num_points == 21 and len(_diffusers(21, 12.0).timesteps) == 20
    assert torch.equal(dual.video.sigmas, _diffusers(21, 12.0).sigmas)
    assert torch.equal(dual.audio.sigmas, _diffusers(21, 3.0).sigmas)
    assert not torch.equal(dual.video.sigmas, dual.audio.sigmas)
    assert dual.video_sha256 == hashlib.sha256(_diffusers(21, 12.0).sigmas.numpy().tobytes()).hexdigest()
    assert dual.audio_sha256 == hashlib.sha256(_diffusers(21, 3.0).sigmas.numpy().tobytes()).hexdigest()
    assert dual.video_sha256 != dual.audio_sha256
    data = dual.to_dict()
    assert DualSchedule.from_dict(data) == dual
    assert [float(s) for s in dual.video.sigmas] == data["video"]["sigmas"]
    data["audio"]["sha256"] = "0" * 64
    with pytest.raises(ScheduleError, match="audio sigma grid sha256"):
        DualSchedule.from_dict(data)
    # Grids of different lengths must not be zipped into one loop.
    with pytest.raises(ScheduleError, match="must pass together"):
        DualSchedule(Schedule.build(9, 12.0), Schedule.build(8, 3.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noise_mix_bit_equal_to_scale_noise(dtype):
    g = torch.Generator().manual_seed(6)
    ref = MiniMaxH3Scheduler(shift=12.0)
    x0, noise = torch.randn(1, 4, 2, 6, 8, generator=g).to(dtype), torch.randn(1, 4, 2, 6, 8, generator=g).to(dtype)
    for t in (CONDITION_T, 0.3, 1.0, torch.tensor(0.25), torch.tensor(0.7, dtype=torch.float64)):
        assert torch.equal(noise_mix(x0, noise, t), ref.scale_noise(x0, t, noise))
    assert torch.equal(noise_mix(x0, noise, 1.0), x0)


def test_generation_noise_matches_the_pipeline_draw_order():
    """Diffusers' condition block then latents block, on one generator, against `draw_generation_noise`."""
    components = types.SimpleNamespace(
        _execution_device=torch.device("cpu"),
        patch_size=(1, 2, 2),
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        keyframe_noise_aug=0.999,
        vae_latent_channels=4,
        audio_channels=2,
        audio_latent_channels=8,
    )
    g = torch.Generator().manual_seed(7)
    conditions = [torch.randn(1, 4, 1, 6, 8, generator=g), torch.randn(1, 4, 3, 4, 4, generator=g)]
    num_cond_rows = 1 * 3 * 4 + 3 * 2 * 2
    state = PipelineState()
    for key, value in dict(
        generator=torch.Generator().manual_seed(1234),
        condition_latents=conditions,
        num_condition_video_rows=num_cond_rows,
        num_latent_frames=5,
        latent_height=6,
        latent_width=10,
        num_audio_latents=9,
    ).items():
        state.set(key, value)
    MiniMaxH3PrepareConditionLatentsStep()(components, state)
    MiniMaxH3PrepareLatentsStep()(components, state)

    noise = draw_generation_noise(
        torch.Generator().manual_seed(1234), [c.shape for c in conditions], (1, 4, 5, 6, 10), (2 * 9, 8)
    )
    cond_rows = torch.cat(
        [patchify_video_latents(noise_mix(c, n, CONDITION_T), (1, 2, 2)) for c, n in zip(conditions, noise.conditions)]
    )
    assert torch.equal(cond_rows, state.get("condition_rows"))
    assert torch.equal(patchify_video_latents(noise.video, (1, 2, 2)), state.get("latents"))
    assert torch.equal(noise.audio, state.get("audio_latents"))
    assert all(n.dtype == torch.float32 for n in (*noise.conditions, noise.video, noise.audio))
    # The draw order matters: swapping video and audio draws gives different bytes.
    g2 = torch.Generator().manual_seed(1234)
    for c in conditions:
        draw_noise(c.shape, g2)
    assert not torch.equal(draw_noise((2 * 9, 8), g2), noise.audio)


def test_reuse_plan():
    # The seed README: at 20 passes, --reuse 1/2/3 evaluate 20, 11 and 8 times.
    assert [sum(reuse_plan(20, k)) for k in (1, 2, 3)] == [20, 11, 8]
    plan = reuse_plan(20, 3)
    assert [i for i, e in enumerate(plan) if e] == [0, 3, 6, 9, 12, 15, 18, 19]
    for n in range(1, 30):
        for k in range(1, 8):
            plan = reuse_plan(n, k)
            assert len(plan) == n and plan[0] and plan[-1]
            assert all(plan[i] == (i % k == 0 or i == n - 1) for i in range(n))
    assert reuse_plan(5, 100) == (True, False, False, False, True)


def test_extrapolate_velocity_declared_arithmetic_and_accuracy():
    dual = DualSchedule.from_passes(20)
    g = torch.Generator().manual_seed(8)
    eps = torch.finfo(torch.float32).eps
    for sched in (dual.video, dual.audio):
        # A velocity field exactly linear in this modality's sigma, known in float64.
        a, b = torch.randn(5, 7, generator=g, dtype=torch.float64), torch.randn(5, 7, generator=g, dtype=torch.float64)
        field = [a + float(s) * b for s in sched.sigmas[:-1]]
        for i in range(2, sched.num_passes):
            history = [(sched.sigmas[j], field[j].float()) for j in (i - 2, i - 1)]
            out = extrapolate_velocity(sched.sigmas[i], history)
            # Declared arithmetic, byte for byte: w in float64 from the grid, rounded once; blend in float32.
            s, sa, sb = float(sched.sigmas[i]), float(sched.sigmas[i - 2]), float(sched.sigmas[i - 1])
            w = torch.tensor((s - sb) / (sb - sa), dtype=torch.float32)
            va, vb = history[0][1], history[1][1]
            assert torch.equal(out, vb + w * (vb - va))
            # Accuracy against the float64 truth: input rounding (u each) plus three float32 ops, u = eps/2.
            bound = 4 * eps * (vb.abs() + w.abs() * (va.abs() + vb.abs())).double() + eps * field[i].abs()
            assert bool(((out.double() - field[i]).abs() <= bound).all()), (sched.shift, i)
    # The two modalities extrapolate on their own grids: the same history gives different weights.
    v_a, v_b = torch.randn(4, generator=g), torch.randn(4, generator=g)
    vid = extrapolate_velocity(dual.video.sigmas[3], [(dual.video.sigmas[1], v_a), (dual.video.sigmas[2], v_b)])
    aud = extrapolate_velocity(dual.audio.sigmas[3], [(dual.audio.sigmas[1], v_a), (dual.audio.sigmas[2], v_b)])
    assert not torch.equal(vid, aud)
    # Zero-order hold: asked for, or with a single evaluation; a bf16 velocity keeps its dtype.
    hist = [(dual.video.sigmas[0], v_a.bfloat16()), (dual.video.sigmas[1], v_b.bfloat16())]
    assert extrapolate_velocity(dual.video.sigmas[2], hist, mode="hold") is hist[-1][1]
    assert extrapolate_velocity(dual.video.sigmas[2], hist[:1]) is hist[0][1]
    assert extrapolate_velocity(dual.video.sigmas[2], hist).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: sigma_schedule(1, 12.0), "num_points=1"),
        (lambda: sigma_schedule(2.5, 12.0), "num_points=2.5"),
        (lambda: sigma_schedule(True, 12.0), "num_points=True"),
        (lambda: sigma_schedule(10, 0.0), "shift=0.0"),
        (lambda: sigma_schedule(10, -3), "shift=-3"),
        (lambda: sigma_schedule(10, math.nan), "shift=nan"),
        (lambda: sigma_schedule(10, math.inf), "shift=inf"),
        (lambda: passes_to_points(0), "steps=0"),
        (lambda: Schedule.build(5, 3.0).step(4, torch.zeros(1), torch.zeros(1)), "step index 4"),
        (lambda: timesteps(torch.zeros(1)), "shape"),
        (lambda: reuse_plan(0, 1), "num_passes=0"),
        (lambda: reuse_plan(5, 0), "reuse=0"),
        (lambda: extrapolate_velocity(0.5, [(0.6, torch.zeros(1))], mode="cubic"), "mode 'cubic'"),
        (lambda: extrapolate_velocity(0.5, []), "history is empty"),
        (lambda: extrapolate_velocity(0.7, [(0.8, torch.zeros(1)), (0.6, torch.zeros(1))]), "strictly decreasing"),
        (lambda: draw_noise((2, 3), None), "generator=None"),
        (lambda: draw_noise((2, -3), torch.Generator()), "shape=\\(2, -3\\)"),
    ],
)
def test_errors_are_one_line_h3_errors(call, match):
    with pytest.raises(ScheduleError, match=match) as info:
        call()
    assert isinstance(info.value, H3Error) and "\n" not in str(info.value)


def test_module_has_no_heavy_imports():
    # The sampler room imports nothing from the project but errors (DESIGN.md rooms).
    names = {n for n, v in vars(sampler).items() if isinstance(v, types.ModuleType)}
    assert names <= {"hashlib", "math", "numbers", "torch"}
