"""Shared pieces of the distributed tests: a 12-head config that admits TP 2, 3, 4 and CP 2, 3 (with TP 2 x CP 2 and
TP 4 x CP 3), seeded inputs that every rank and the parent rebuild to the same bytes, and the packed row count 19
(divisible by neither 2 nor 3: CP shards 10 + 9 and 7 + 6 + 6)."""

from __future__ import annotations

import torch

from h3lab import H3Config

# 12 heads x 8 = 96 inner (rotary 6 of 8), hidden 24, ffn 48: every linear_tree K (96, 48) is a multiple of 8; tp in
# {1, 2, 3, 4} divides heads, hidden and ffn; cp must divide 12 / tp heads, so of tp x cp <= 4 x 3 only 4 x 2 is refused.
CONFIG = H3Config(
    num_attention_heads=12, attention_head_dim=8, hidden_size=24, num_layers=2, num_refiner_layers=1, ffn_dim=48,
    in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=16, freq_dim=16, time_embed_hidden_dim=24,
    time_embed_dim=12, rope_freq_dim=1,
)
ROWS = 19


def randn(seed: int, *shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Seeded N(0, 1) in `dtype`; the same bytes in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def permutation(seed: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)


# ------------------------------------------------------------------------------------------- model-level runs
def _ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.long)


def build_layout(name: str):
    """The three layouts of the model-level tests; none of their row counts is a multiple of 2 or 3:
    t2va 11 rows (CP3 shards 4 + 4 + 3), fl2va 15 (first-frame anchor; CP2 8 + 7), ref2va 17 (an image and an
    audio reference; CP2 9 + 8, then SP 5 + 4 and 4 + 4)."""
    from h3lab.run.layout import Reference
    from h3lab.run.layout import build_layout as build

    p = CONFIG.patch_size
    if name == "t2va":
        return build("t2va", _ones(3), 1, 2, 4, 3, patch_size=p)
    if name == "fl2va":
        return build("fl2va", _ones(3), 2, 2, 4, 3, anchors=("first",), patch_size=p)
    if name == "ref2va":
        return build("ref2va", _ones(3), 1, 2, 4, 3, references=(Reference.image(2, 4), Reference.audio(2)),
                     patch_size=p)
    raise KeyError(name)


def config(layers: int = 2):
    """CONFIG with `layers` blocks (1: a quarter fewer kernel launches per forward under the interpreter)."""
    return CONFIG if layers == CONFIG.num_layers else H3Config(**{**CONFIG.to_diffusers(), "num_layers": layers})


def build_model(layers: int = 2):
    """The 12-head model with seeded random weights (released dtypes), the same bytes in every process."""
    from h3lab import H3Transformer
    from h3lab.model.random_init import random_state_dict

    c = config(layers)
    model = H3Transformer(c)
    model.load_state_dict(random_state_dict(c, 5))
    return model.eval().requires_grad_(False)


def build_spec(layout_name: str, passes: int = 3, mode: str = "strict"):
    """A sealed strict run of `passes` passes on a layout: seeded text, anchor and noise rows."""
    from h3lab.research.ablation import make_inputs
    from h3lab.run import RunSpec
    from h3lab.run.sampler import DualSchedule

    layout = build_layout(layout_name)
    schedule = DualSchedule.build(passes + 1)
    inputs = make_inputs(CONFIG, layout, schedule, seed=3)
    return RunSpec(inputs, schedule, mode=mode, layout=layout)


def fl2va_forward(model):
    """One strict forward of the 1-pass fl2va run on `model` (plain or parallelized): (video, audio, its trace)."""
    from h3lab.execution import runtime
    from h3lab.run import model_forward

    x = build_spec("fl2va", passes=1).inputs
    with runtime.use_mode("strict"), torch.no_grad():
        video, audio = model_forward(model, x, x.video, x.audio, 0)
    return video, audio, runtime.last_trace()
