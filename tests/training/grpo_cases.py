"""Builders for the GRPO tests: a batched SDE rollout of G requests on one model (the rollout side of the
consistency gate: one batched no-grad forward per pass over all G requests, rl-core's transition and seeded noise,
the float32 log-density per request), turned into the `RolloutBatch` the GRPO step trains on."""

from __future__ import annotations

import torch

from h3lab import runtime
from h3lab.run import DenoiseInputs
from h3lab.sampler import DualSchedule, draw_noise
from h3lab.stochastic import gaussian_logprob, pass_noise, transition_mean_std
from h3lab.training.grpo_step import RolloutBatch, transition

from training_cases import SMALL, make_layout


def group_inputs(config, layout, schedule: DualSchedule, group: int, seed: int = 0) -> DenoiseInputs:
    """One prompt (text and anchor shared), G requests with their own initial noise on the generated rows."""
    g = torch.Generator().manual_seed(seed)
    ncv = layout.num_condition_video_rows
    nv, na, nt = layout.video_indices.numel(), layout.audio_indices.numel(), layout.text_indices.numel()
    text = torch.randn(1, nt, config.text_dim, generator=g).expand(group, -1, -1).contiguous()
    cond = torch.randn(1, ncv, config.video_patch_dim, generator=g).expand(group, -1, -1)
    video = torch.cat([cond, draw_noise((group, nv - ncv, config.video_patch_dim), g)], dim=1)
    audio = draw_noise((group, na, config.audio_in_channels), g)
    return DenoiseInputs.from_layout(layout, schedule, text, video, audio, {"request": seed})


def sde_rollout(model, inputs: DenoiseInputs, schedule: DualSchedule, mode: str, kind: str, level: float,
                seed: int, position_order=None):
    """Every pass batched (B = G), no grad, eval mode. `position_order[j]` is the request at batch position j
    (default identity): the noise is keyed by the request, not the position. Returns per request the latents
    entering each pass and after it (all rows) and the per-pass logp_mean per modality."""
    B = inputs.batch_size
    order = list(range(B)) if position_order is None else list(position_order)
    nc = {"video": inputs.num_condition_video_rows, "audio": inputs.num_condition_audio_rows}
    x = {"video": inputs.video[order].clone(), "audio": inputs.audio[order].clone()}
    text = inputs.text[order]
    out = {r: [] for r in range(B)}
    was = model.training
    model.eval()
    with torch.no_grad(), runtime.use_mode(mode):
        for i in range(inputs.num_passes):
            t, ti = inputs.plan[i]
            v = dict(zip(("video", "audio"), model(
                hidden_states=x["video"], audio_hidden_states=x["audio"], encoder_hidden_states=text,
                timestep=t, timestep_indices=ti, key_order=inputs.key_order, **inputs.layout_kwargs())))
            nxt, logp = {}, {}
            for m in ("video", "audio"):
                s, sn = getattr(schedule, m).sigmas[i], getattr(schedule, m).sigmas[i + 1]
                gen = x[m][:, nc[m]:]
                mean, std = transition_mean_std(kind, gen, v[m][:, nc[m]:], s, sn, level)
                eps = torch.stack([pass_noise(seed, r, i, m, gen.shape[1:]) for r in order])
                new = mean + std * eps
                logp[m] = gaussian_logprob(new, mean, std)[0]  # (B,)
                nxt[m] = torch.cat([x[m][:, :nc[m]], new], dim=1)
            for j, r in enumerate(order):
                out[r].append(({m: x[m][j:j + 1] for m in x}, {m: nxt[m][j:j + 1] for m in x},
                               {m: logp[m][j] for m in x}))
            x = nxt
    model.train(was)
    return out


def rollout_batch(inputs, schedule, records, rewards, passes=None) -> RolloutBatch:
    """The `RolloutBatch` of `sde_rollout`'s records (every pass an SDE pass)."""
    B, n = inputs.batch_size, inputs.num_passes
    trans = [[transition(inputs, schedule, r, r, i, *records[r][i]) for i in (passes or range(n))] for r in range(B)]
    return RolloutBatch(trans, [[True] * n for _ in range(B)], torch.as_tensor(rewards, dtype=torch.float64))


def small_setup(group: int = 3, passes: int = 2, seed: int = 0):
    layout = make_layout("fl2va")
    schedule = DualSchedule.from_passes(passes)
    return layout, schedule, group_inputs(SMALL, layout, schedule, group, seed)
