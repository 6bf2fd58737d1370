"""What the REPL's `!rollout` prints (`Session.rollout_report`): G stochastic rollouts of one prompt with the current
settings, each request's reward and group advantage, and the on-policy ratio exp(logp_replay - logp_rollout) of
every (request, SDE pass, modality) replayed alone (`grpo_step.replay_ratios`; strict: exactly 1). Also the
`RewardSample`s of a `Session.rollout` result (`reward_samples`), shared with `h3lab train grpo` (`grpo_job.py`).
This module never imports the session (the session imports it).
"""

from __future__ import annotations

from typing import Any

import torch

from .grpo_step import batch_from_rollout
from .rewards import RewardSample, resolve_reward, score


def reward_samples(rollout: Any, decoded: bool) -> list[RewardSample]:
    """One `RewardSample` per rollout request, in request order."""
    from ..schema.generation_settings import AUDIO_SAMPLE_RATE

    return [RewardSample(prompt=rollout.prompts[r.prompt_index], seed=int(r.seed), index=int(r.request),
                         frames=r.frames if decoded else None,
                         audio=None if not decoded or r.audio is None else torch.as_tensor(r.audio),
                         sample_rate=AUDIO_SAMPLE_RATE, latents=r.latents, audio_latents=r.audio_rows)
            for r in sorted(rollout.requests, key=lambda q: q.request)]


def rollout_report(session: Any, prompt: str, *, group: int, reward: str, settings: Any,
                   kind: str = "flow_sde", level: float = 0.7) -> list[str]:
    """The REPL's `!rollout`: G `kind` rollouts of `prompt` with the current `settings` (canvas, frames, steps, mode,
    seed; the session's adapter, if any), each request's reward and group advantage, and the ratio
    exp(logp_replay - logp_rollout) of every (request, SDE pass, modality) replayed alone (`replay_ratios`)."""
    from ..adapters.field import attached
    from ..adapters.adapter_file import read_adapter
    from .grpo import group_advantages, ratio_stats
    from .grpo_step import replay_ratios

    scorer = resolve_reward(reward)
    decoded = scorer.needs == "decoded"
    gen = {"width": settings.width, "height": settings.height, "frames": settings.num_frames,
           "steps": settings.steps, "mode": settings.mode}
    out = session.rollout([prompt], group=group, stepper=kind, level=level, seed=settings.seed, decode=decoded, **gen)
    rewards = score(scorer, reward_samples(out, decoded))
    advantages = group_advantages(rewards, group)
    batch = batch_from_rollout(out, rewards)
    model = session.transformer(session.variant_for(settings.task))
    if session.adapters:
        entry = session.adapters[0]
        with attached(model, read_adapter(entry["path"], expect_sha256=entry["sha256"]), entry["scale"]):
            rows = replay_ratios(model, batch, settings.mode)
    else:
        rows = replay_ratios(model, batch, settings.mode)
    lines = [f"rollout {kind} level {level:g}, G={group}, seed {settings.seed}, {settings.mode}: "
             f"{len(out.trajectories)} trajectory, reward {scorer.name}"]
    for r in sorted(out.requests, key=lambda q: q.request):
        lines.append(f"  request {r.request}: reward {float(rewards[r.request]):.6g}  advantage "
                     f"{float(advantages[r.request]):+.3f}")
    stats = ratio_stats([torch.tensor(row[m], dtype=torch.float32) for row in rows for m in ("video", "audio")
                         if m in row])
    lines.append(f"  ratio exp(logp_replay - logp_rollout), {stats['count']} (request, pass, modality): "
                 f"{stats['exactly_one']} exactly 1, ratio - 1 in [{stats['min']:.3g}, {stats['max']:.3g}], "
                 f"mean {stats['mean']:.3g}")
    return lines
