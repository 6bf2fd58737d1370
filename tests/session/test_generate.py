"""`Session.generate` on the tiny snapshot: results, the released loop (checked against Diffusers' scheduler and noise
draws), caching, render size, anchors, references, cancellation, previews, residency, and the commands that need a
generation (!save, !trajectory, !drift, !ablate)."""

import threading

import numpy as np
import pytest
import torch

from h3lab.frontends import commands
from h3lab.components import media
from h3lab.components.video_vae import patchify, unpatchify
from h3lab.errors import ValidationError
from h3lab.app.session import PHASES, GenerationCancelled, Session

SMALL = dict(width=64, height=64, frames=22, steps=2, mode="off")


def test_t2va_result_cache_and_determinism(session):
    prompt = "a red fox walks through fresh snow (t2va test)"
    r1 = session.generate(prompt, seed=1, **SMALL)
    s = r1.settings
    assert r1.frames.dtype == np.uint8 and r1.frames.shape == (22, 64, 64, 3) and r1.frames.std() > 0
    assert r1.audio.dtype == torch.float32 and tuple(r1.audio.shape) == (2, 37 * 800)
    assert torch.isfinite(r1.audio).all() and r1.audio.abs().max() <= 1.0 and r1.sample_rate == 32000
    assert tuple(r1.latents.shape) == (4, 7, 4, 4) and tuple(r1.audio_latents.shape) == (74, 8)
    assert r1.layout.sequence_length == r1.layout.num_text_tokens + 7 * 4 + 74
    assert r1.trajectory_hash == r1.trajectory.digest and len(r1.trajectory.steps) == 2 and r1.evaluations == 2
    assert set(PHASES) <= set(r1.timings) and r1.peak_memory > 0
    assert r1.cached == {"text": False, "conditions": None} and r1.timings["text_encode"] > 0
    assert s.task == "t2va" and r1.arm.variant == "transformer"

    r2 = session.generate(prompt, seed=2, **SMALL)  # another seed: no text encoding at all
    assert r2.cached["text"] is True and r2.timings["text_encode"] == 0.0
    assert r2.trajectory_hash != r1.trajectory_hash
    assert "(cached)" in "\n".join(r2.timing_lines())

    r3 = session.generate(prompt, seed=1, **SMALL)  # same request: same bytes
    assert r3.trajectory_hash == r1.trajectory_hash and np.array_equal(r3.frames, r1.frames)
    assert torch.equal(r3.audio, r1.audio)


def test_loop_is_the_released_loop(session):
    """Noise draws, timestep plan and Euler steps against Diffusers' own code on the same transformer."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
    from diffusers.utils.torch_utils import randn_tensor

    steps, seed = 3, 11
    r = session.generate("released loop check", seed=seed, **{**SMALL, "steps": steps})
    inputs, layout = r.trajectory.inputs, r.layout
    nv, na = layout.num_condition_video_rows, layout.num_condition_audio_rows
    assert (nv, na) == (0, 0)

    g = torch.Generator().manual_seed(seed)  # Diffusers' draw order: video latent tensor, then audio rows
    video_noise = randn_tensor((1, 4, 7, 4, 4), generator=g, device=torch.device("cpu"), dtype=torch.float32)
    audio_noise = randn_tensor((74, 8), generator=g, device=torch.device("cpu"), dtype=torch.float32)
    assert torch.equal(inputs.video[0], patchify(video_noise[0]))
    assert torch.equal(inputs.audio[0], audio_noise)

    video_sched, audio_sched = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
    video_sched.set_timesteps(steps + 1)  # Diffusers counts grid points: steps passes = steps + 1 points
    audio_sched.set_timesteps(steps + 1)
    assert len(video_sched.timesteps) == steps
    model = session.transformer("transformer")
    x, a = inputs.video[0].clone(), inputs.audio[0].clone()
    with torch.no_grad():
        for t, ta in zip(video_sched.timesteps, audio_sched.timesteps):
            unique_t, t_idx = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                layout.video_indices, layout.audio_indices, nv, na, layout.num_text_tokens, float(t), float(ta),
                max(float(t), 0.999), 1.0,
            )
            v, va = model(
                hidden_states=x[None], audio_hidden_states=a[None], encoder_hidden_states=inputs.text,
                timestep=unique_t, timestep_indices=t_idx, **layout.model_inputs(),
            )
            x[nv:] = video_sched.step(v[0, nv:].float(), t, x[nv:], return_dict=False)[0]
            a[na:] = audio_sched.step(va[0, na:].float(), ta, a[na:], return_dict=False)[0]
    assert torch.equal(unpatchify(x, 7, 4, 4), r.latents)
    assert torch.equal(a, r.audio_latents)


def test_render_size_runs_small_and_upscales(session):
    r = session.generate("render size", width=128, height=64, render_width=64, render_height=32,
                         **{k: v for k, v in SMALL.items() if k not in ("width", "height")})
    assert r.frames.shape == (22, 64, 128, 3)
    assert tuple(r.latents.shape) == (4, 7, 2, 4) and r.layout.grid == (1, 2)


def test_fl2va_anchors_conditioning_rows_and_cache(session, assets):
    session.keep = ("latents",)
    try:
        first, last = str(assets / "first.png"), str(assets / "last.png")
        r1 = session.generate("anchored clip", first=first, last=last, seed=5, **SMALL)
        r2 = session.generate("anchored clip", first=first, last=last, seed=6, **SMALL)
    finally:
        session.keep = ()
    assert r1.settings.task == "fl2va" and r1.arm.variant == "transformer"
    nv = r1.layout.num_condition_video_rows
    assert nv == 2 * 4  # one latent frame of (64/16/2)^2 rows per anchor
    assert r1.cached["conditions"] is False and r2.cached == {"text": True, "conditions": True}
    assert r2.timings["condition_encode"] == 0.0 and r2.timings["text_encode"] == 0.0
    # Conditioning rows are never written: after the last pass they are the sealed (noise-mixed) input rows.
    kept = r1.trajectory.kept[f"video.{len(r1.trajectory.steps) - 1:04d}"]
    assert torch.equal(kept[:, :nv], r1.trajectory.inputs.video[:, :nv])
    assert not torch.equal(kept[:, nv:], r1.trajectory.inputs.video[:, nv:])
    # Different seeds draw different anchor augmentation noise.
    assert not torch.equal(r1.trajectory.inputs.video[:, :nv], r2.trajectory.inputs.video[:, :nv])


def test_ref2va_references_use_transformer_ref(session, assets):
    from h3lab.schema.generation_settings import Reference

    refs = (Reference("image", str(assets / "first.png")), Reference("audio", str(assets / "tone.wav")))
    r = session.generate("use Picture 1 and Audio 1", references=refs, **SMALL)
    assert r.settings.task == "ref2va" and r.arm.variant == "transformer_ref"
    assert "transformer_ref" in session.loaded and "transformer" not in session.loaded
    # image on a 64 short edge -> 4x4 latent -> 2x2 patches; audio truncated to 22/24 s -> 37 latents x 2 channels
    assert r.layout.num_condition_video_rows == 4 and r.layout.num_condition_audio_rows == 74
    assert r.frames.shape == (22, 64, 64, 3)
    refs = (Reference("video", str(assets / "clip.mp4")),)
    r = session.generate("continue Video 1", references=refs, **SMALL)
    assert r.layout.num_condition_video_rows == 7 * 4 and r.layout.num_condition_audio_rows == 74


def test_rejected_request_changes_nothing(session, tmp_path):
    from h3lab.schema.generation_settings import Reference

    t = np.arange(32000) / 32000
    short = tmp_path / "short.wav"
    media.write_wav(short, np.stack([np.sin(2 * np.pi * 220 * t)] * 2).astype(np.float32) * 0.2)
    image = tmp_path / "img.png"
    from PIL import Image

    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(image)
    before = (session.cache_info(), session.loaded, session.load_seconds)
    refs = (Reference("image", str(image)), Reference("audio", str(short)))
    with pytest.raises(ValidationError, match="2-15 s"):
        session.generate("never encoded", references=refs, **SMALL)
    with pytest.raises(ValidationError, match="must end in .mp4"):
        session.generate("never encoded", output=tmp_path / "x.avi", **SMALL)
    with pytest.raises(ValidationError, match="empty prompt"):
        session.generate("   ", **SMALL)
    with pytest.raises(ValidationError, match="width=48"):
        session.generate("never encoded", **{**SMALL, "width": 48})
    assert (session.cache_info(), session.loaded, session.load_seconds) == before


def test_cancel_between_passes_keeps_the_session_usable(session):
    cancel = threading.Event()
    seen = []

    def progress(info):
        seen.append(info.step)
        cancel.set()  # cancel after the first pass

    with pytest.raises(GenerationCancelled, match="before pass 1 of 3"):
        session.generate("cancel me", progress=progress, cancel=cancel, **{**SMALL, "steps": 3})
    assert seen == [1]
    r = session.generate("cancel me", **SMALL)
    assert r.cached["text"] is True and r.frames.shape[0] == 22


def test_preview_frame_after_every_pass(session):
    frames = []
    r = session.generate("preview", preview=lambda f, step, total: frames.append((f, step, total)), **SMALL)
    assert [(s, t) for _, s, t in frames] == [(1, 2), (2, 2)]
    for f, _, _ in frames:
        assert f.dtype == np.uint8 and f.shape == (64, 64, 3)
    assert not np.array_equal(frames[0][0], frames[1][0])
    assert r.frames.shape == (22, 64, 64, 3)


def test_reuse_skips_model_evaluations(session):
    r = session.generate("reuse", reuse=2, **{**SMALL, "steps": 3})  # passes 0 and 2 evaluate, 1 extrapolates
    assert r.evaluations == 2 and [s["evaluated"] for s in r.trajectory.steps] == [True, False, True]


def test_phased_residency_releases_every_component(snapshot):
    s = Session(snapshot, device="cpu", residency="phased")
    r = s.generate("phased", **SMALL)
    assert s.loaded == [] and r.frames.shape == (22, 64, 64, 3)
    assert r.timings["load"] > 0


def test_commands_that_need_generations(state, tmp_path):
    state.base_dir = tmp_path
    commands.run_line(state, "a fox for saving")
    mp4 = commands.run_line(state, "!save clip.mp4")
    wav = commands.run_line(state, "!save clip.wav")
    assert mp4 == [f"saved {tmp_path / 'clip.mp4'}"] and wav == [f"saved {tmp_path / 'clip.wav'}"]
    info = media.probe(tmp_path / "clip.mp4")
    assert info.video.codec == "h264" and info.audio.codec == "aac" and info.frame_count == 22
    with pytest.raises(ValidationError, match="extension"):
        commands.run_line(state, "!save clip.avi")
    sealed = commands.run_line(state, "!trajectory save traj")
    assert state.last.trajectory_hash in sealed[0] and (tmp_path / "traj" / "manifest.json").is_file()
    assert commands.run_line(state, "!trajectory verify traj")[0].startswith("OK: 2/2 passes byte-equal")
    commands.run_line(state, "!seed 43")
    commands.run_line(state, "a fox for saving")
    lines = commands.run_line(state, "!drift")
    assert "first drift at pass 1 input.video" in lines[0]
    commands.run_line(state, "!seed 42")
    commands.run_line(state, "a fox for saving")
    assert commands.run_line(state, "!drift")[0].count("byte-equal") == 0  # seed 43 vs 42 again differ
    commands.run_line(state, "!ablate H9 on")
    commands.run_line(state, "a fox for saving")
    lines = commands.run_line(state, "!drift")  # plain seed 42 vs seed 42 with the velocity sign flipped
    assert "first drift at pass 1 scheduler.video" in lines[0]


def test_ablation_factor_changes_the_run_where_the_matrix_says(session):
    plain = session.generate("ablation", **SMALL)
    rope = session.generate("ablation", ablations=("H5",), **SMALL)
    assert rope.trajectory_hash != plain.trajectory_hash
    report = session.drift(plain, rope)
    assert report.first.point == "blocks.0.q_rope" and report.first.step == 0
    again = session.generate("ablation", **SMALL)
    assert session.drift(plain, again).equal
    with pytest.raises(ValidationError, match="H15"):
        session.generate("ablation", ablations=("H15",), **SMALL)
