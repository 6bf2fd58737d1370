"""`h3lab.model`: the reference MiniMax-H3 transformer written against the runtime op table.

- `transformer.py`  `H3Transformer` (Diffusers keys, forward, dtype policy, checkpointing, loading entry point)
- `layers.py`       the module boundary (`Linear`, `RMSNorm`: nn modules dispatching through the op table) and the
                    block forwards (refiner block, transformer block, attention, FFN, AdaLN, heads' norm)
- `hooks.py`        `HookPoint`, the hook-point list (`RESHAPABLE` points), the registry, `HookSite` call sites
- `precision.py`    the `released` / `float32` dtype policies
- `inputs.py`       forward input validation (`ModelInputError`)
- `random_init.py`  `random_state_dict(config, seed)`: seeded random weights for studies without a checkpoint

May import: the foundations, `checkpoint`, `execution` (the op table it is written against). Never the run
spec, the adapters or the parallel code: those are applied to a built model from outside.
"""

from .hooks import RESHAPABLE, HookError, HookPoint, HookSite, hook_points
from .inputs import ModelInputError
from .precision import POLICIES, DtypePolicyError, policy_dtype
from .random_init import random_state_dict
from .transformer import H3Transformer

__all__ = [
    "H3Transformer", "HookPoint", "HookError", "HookSite", "RESHAPABLE", "hook_points", "ModelInputError", "POLICIES",
    "DtypePolicyError", "policy_dtype", "random_state_dict",
]
