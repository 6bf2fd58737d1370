"""Builders for the GRPO tests: G requests of one prompt (shared text and anchor, each its own initial noise) rolled
out batched through the one loop on rl-core's SDE stepper (`RunSpec(stepper="flow_sde", stepper_params=...)`, the
trajectory records each pass's per-request log-density), turned into the `RolloutBatch` the GRPO step trains on."""

from __future__ import annotations

import torch

from h3lab.hashing import model_fingerprint
from h3lab.run import DenoiseInputs, RunSpec
from h3lab.run.sampler import DualSchedule, draw_noise
from h3lab.run.trajectory import record
from h3lab.training.grpo_step import batch_from_trajectories

from training_cases import SMALL, make_layout


def group_inputs(config, layout, schedule: DualSchedule, group: int, seed: int = 0) -> DenoiseInputs:
    g = torch.Generator().manual_seed(seed)
    ncv = layout.num_condition_video_rows
    nv, na, nt = layout.video_indices.numel(), layout.audio_indices.numel(), layout.text_indices.numel()
    text = torch.randn(1, nt, config.text_dim, generator=g).expand(group, -1, -1).contiguous()
    cond = torch.randn(1, ncv, config.video_patch_dim, generator=g).expand(group, -1, -1)
    video = torch.cat([cond, draw_noise((group, nv - ncv, config.video_patch_dim), g)], dim=1)
    audio = draw_noise((group, na, config.audio_in_channels), g)
    return DenoiseInputs.from_layout(layout, schedule, text, video, audio, {"request": seed})


def small_setup(group: int = 3, passes: int = 2, seed: int = 0):
    layout = make_layout("fl2va")
    schedule = DualSchedule.from_passes(passes)
    return layout, schedule, group_inputs(SMALL, layout, schedule, group, seed)


def sde_trajectory(model, layout, schedule, inputs, mode: str, seed: int, requests, level: float = 0.7):
    """The batched rollout: batch item b is request `requests[b]` (its pass noise keyed by that id)."""
    spec = RunSpec(inputs, schedule, mode=mode, layout=layout, fingerprint=model_fingerprint(model),
                   stepper="flow_sde", stepper_params={"level": level, "seed": seed, "requests": list(requests)})
    return record(spec, model, keep=("latents",))


def rollout_batch(trajectory, rewards):
    return batch_from_trajectories([trajectory], "flow_sde", torch.as_tensor(rewards, dtype=torch.float64))
