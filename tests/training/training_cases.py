"""Builders for the training tests: one small config, seeded models in either dtype policy and their float64 twin,
packed layouts with conditioning rows, fresh random clip requests, and torch's usual batched-backward gradient (the
path the fixed-order combine is contrasted with).

Sizes are small because the Triton interpreter runs every strict program in Python: one strict forward + backward of
`SMALL` over the 22-row fl2va layout takes ~2 s on one idle CPU thread (several times that on a loaded machine).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from h3lab import H3Config, H3Transformer
from h3lab.execution import runtime
from h3lab.run.layout import PackedLayout, Reference, build_layout
from h3lab.model import random_state_dict
from h3lab.training import ClipRequest, Objective, flow_matching_loss, trainable_parameters
from h3lab.training.step import flat_gradient

# The strict room's float64 twin (same weights upcast exactly, inv_freq float32), the truth both paths are measured
# against in `off` mode.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "strict"))
from strict_cases import truth_model as float64_twin  # noqa: E402,F401

# One block, one refiner block, 3 heads x 8 = 24 narrower than hidden 28, rotary 6 of 8, odd widths (K % 8 == 0 for
# the linear_tree projections).
SMALL = H3Config(
    num_attention_heads=3, attention_head_dim=8, hidden_size=28, num_layers=1, num_refiner_layers=1, ffn_dim=32,
    in_channels=2, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=12, freq_dim=10,
    time_embed_hidden_dim=18, time_embed_dim=14, rope_freq_dim=1,
)


def build_model(config: H3Config, policy: str, seed: int) -> H3Transformer:
    model = H3Transformer(config, dtype_policy=policy)
    model.load_state_dict(random_state_dict(config, seed))
    return model


def make_layout(task: str, patch_size=(1, 2, 2)) -> PackedLayout:
    """fl2va 22 rows: 4 text, a first-frame anchor (4 conditioning video rows), 2 target frames on a 2x2 grid, 3 audio
    latents x 2 channels. ref2va 22 rows: 4 text, an image reference (4 conditioning video rows) and an audio
    reference (2 clean conditioning audio rows per channel), 1 target frame, 3 audio latents."""
    if task == "fl2va":
        return build_layout("fl2va", [1] * 4, 2, 4, 4, 3, anchors=("first",), patch_size=patch_size)
    if task == "ref2va":
        refs = (Reference.image(4, 4), Reference.audio(2))
        return build_layout("ref2va", [1] * 4, 1, 4, 4, 3, references=refs, patch_size=patch_size)
    raise ValueError(task)


def make_clip(config: H3Config, layout: PackedLayout, seed: int, draw_seed: int | None = None,
              weight: float = 1.0) -> ClipRequest:
    """Fresh random clean rows (never zeros) for one clip; `draw_seed` (default `seed`) seeds its sigma/noise draws."""
    g = torch.Generator().manual_seed(seed)
    return ClipRequest(
        layout,
        text=torch.randn(1, layout.num_text_tokens, config.text_dim, generator=g),
        video=torch.randn(1, layout.video_indices.numel(), config.video_patch_dim, generator=g),
        audio=torch.randn(1, layout.audio_indices.numel(), config.audio_in_channels, generator=g),
        seed=seed if draw_seed is None else draw_seed,
        weight=weight,
    )


def make_dataset() -> list[ClipRequest]:
    """Three clips over two layouts (fl2va, ref2va, fl2va): the dataset of the sealed-run and data-parallel tests."""
    fl2va, ref2va = make_layout("fl2va"), make_layout("ref2va")
    return [make_clip(SMALL, fl2va, seed=1), make_clip(SMALL, ref2va, seed=2), make_clip(SMALL, fl2va, seed=3)]


def batched_torch_gradient(model: H3Transformer, requests: list[ClipRequest], objective: Objective,
                           mode: str = "off") -> torch.Tensor:
    """Torch's usual path: the requests (one layout) stacked into one forward, the mean of their losses, one
    backward -> the flat float32 gradient. Not the contract; the tests show where it differs from it.
    H3's forward takes one timestep table for the whole batch, so the requests must share their sigma draws
    (`draw_seed`): a batch of independently drawn sigmas cannot be one forward at all."""
    samples = [r.sample(objective) for r in requests]
    s0 = samples[0]
    for s in samples:
        assert torch.equal(s.timestep, s0.timestep) and torch.equal(s.timestep_indices, s0.timestep_indices)
    kwargs = s0.model_kwargs()
    for key, name in (("hidden_states", "video"), ("audio_hidden_states", "audio"), ("encoder_hidden_states", "text")):
        kwargs[key] = torch.cat([getattr(s, name) for s in samples])
    params = trainable_parameters(model)
    model.zero_grad(set_to_none=True)
    with runtime.use_mode(mode):
        v_video, v_audio = model(**kwargs)
        loss = sum(flow_matching_loss(objective, v_video[i:i + 1], v_audio[i:i + 1], s)
                   for i, s in enumerate(samples)) / len(samples)
        loss.backward()
    grad = flat_gradient(params)
    model.zero_grad(set_to_none=True)
    return grad


def rollout_spec(model: H3Transformer, seed: int, mode: str = "strict"):
    """A 2-pass `RunSpec` of the fl2va layout on `model` (fresh random text, anchor rows and noise from `seed`): the
    rollout the LoRA gate's train/rollout check takes a training step over (SMALL: every strict program runs on one
    block + one refiner block)."""
    from h3lab.hashing import model_fingerprint
    from h3lab.run import DenoiseInputs, RunSpec
    from h3lab.run.sampler import DualSchedule

    layout, schedule = make_layout("fl2va"), DualSchedule.from_passes(2)
    clip = make_clip(model.config, layout, seed=seed)
    inputs = DenoiseInputs.from_layout(layout, schedule, clip.text, clip.video, clip.audio, {"request": seed})
    return RunSpec(inputs, schedule, mode=mode, layout=layout, fingerprint=model_fingerprint(model))
