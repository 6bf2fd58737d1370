"""Dtype policies of `H3Transformer` parameters.

- ``released``: the checkpoint's mixed precision. A parameter whose dotted name has a component in
  `config.FP32_MODULES` (proj_in, audio_proj_in, time_embedder, proj_out, audio_proj_out) is float32, every other
  parameter bfloat16. The component match is what Diffusers' loader applies to `_keep_in_fp32_modules`
  (`name in param_name.split(".")`); for the H3 keys it selects the same parameters as the substring match of
  `get_parameter_dtype`.
- ``float32``: every parameter float32.

The rope `inv_freq` buffer is float32 under both policies (it is not a parameter and is never cast).
"""

from __future__ import annotations

import torch

from ..config import FP32_MODULES
from ..errors import H3Error

POLICIES = ("released", "float32")


class DtypePolicyError(H3Error):
    """An unknown dtype policy name."""


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise DtypePolicyError(f"dtype_policy={policy!r}: must be one of {', '.join(POLICIES)}")
    return policy


def keeps_float32(param_name: str) -> bool:
    """True for parameters the released checkpoint stores in float32."""
    return any(part in FP32_MODULES for part in param_name.split("."))


def policy_dtype(param_name: str, policy: str) -> torch.dtype:
    """The dtype `policy` gives the parameter `param_name` (a state-dict key)."""
    check_policy(policy)
    if policy == "float32" or keeps_float32(param_name):
        return torch.float32
    return torch.bfloat16
