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
