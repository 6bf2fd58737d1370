"""Seeded random weights for an `H3Transformer` of any config, for studies and tests without a checkpoint.

`random_state_dict(config, seed)` -> Diffusers-keyed float32 tensors, every one random (so no test can pass on a
zero): RMSNorm weights 1 + 0.2 N(0,1), biases 0.3 N(0,1), matrices N(0,1)/sqrt(fan_in). Drawn in state-dict order
from one CPU generator, so the same (config, seed) gives the same bytes on every machine. Load with
`model.load_state_dict(sd)`; the model's dtype policy casts on load.
"""

from __future__ import annotations

import math

import torch

from ..config import H3Config


def random_state_dict(config: H3Config, seed: int) -> dict[str, torch.Tensor]:
    from .transformer import H3Transformer

    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in H3Transformer(config, dtype_policy="float32").state_dict().items()}
    out = {}
    for key, shape in shapes.items():
        if len(shape) == 1 and key.endswith(".weight"):  # RMSNorm weights
            out[key] = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif key.endswith(".bias"):
            out[key] = 0.3 * torch.randn(shape, generator=g)
        else:
            out[key] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return out
