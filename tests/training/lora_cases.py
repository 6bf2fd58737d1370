"""Builders for the LoRA tests: a seeded model with a LoRA adapter whose B factors are fresh random values (peft's
default init leaves B at zero, which would make every lora_A gradient zero and hide the adapter's arithmetic)."""

from __future__ import annotations

import torch
from training_cases import SMALL, build_model

from h3lab.training import add_lora

RANK, ALPHA = 3, 8.0  # alpha / r = 8/3 is not a float32 number: the scaling's rounding is exercised


def randomize_b(model, seed: int, scale: float = 0.2) -> None:
    """Overwrite every lora_B factor with N(0, scale^2) draws from `seed` (in named_parameters order)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def lora_model(seed: int = 41, policy: str = "released", rank: int = RANK, alpha: float = ALPHA, b_seed: int = 7,
               targets=None, config=SMALL):
    """A seeded base model with a LoRA adapter on every attention and FFN projection (or `targets`), B random."""
    model = build_model(config, policy, seed)
    kwargs = {} if targets is None else {"targets": targets}
    add_lora(model, rank, alpha, seed=seed, **kwargs)
    randomize_b(model, b_seed)
    return model
