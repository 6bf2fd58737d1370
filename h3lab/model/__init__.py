"""`h3lab.model`: the reference MiniMax-H3 transformer written against the runtime op table.

- `transformer.py`  `H3Transformer` (Diffusers keys, forward, dtype policy, checkpointing, loading entry point)
- `layers.py`       parameter holders and block forwards (refiner block, transformer block, attention, FFN)
- `hooks.py`        `HookPoint`, the hook-point list, the hook registry
- `precision.py`    the `released` / `float32` dtype policies
- `inputs.py`       forward input validation (`ModelInputError`)
- `random_init.py`  `random_state_dict(config, seed)`: seeded random weights for studies without a checkpoint
"""

from .hooks import HookError, HookPoint, hook_points
from .inputs import ModelInputError
from .precision import POLICIES, DtypePolicyError, policy_dtype
from .random_init import random_state_dict
from .transformer import H3Transformer

__all__ = [
    "H3Transformer", "HookPoint", "HookError", "hook_points", "ModelInputError", "POLICIES", "DtypePolicyError",
    "policy_dtype", "random_state_dict",
]
