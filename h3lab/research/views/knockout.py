"""Blocks knocked out (or scaled) from outside, through hook points: the model never knows.

Contract
--------
`knocked_out(model, blocks, scale=0.0)` is a context manager holding one hook on `model` (`model.add_hook`) at the
block-stack boundaries: `pack` (the stack's input) and `blocks.{i}.residual2` (block i's output, the next block's
input). For every block b in `blocks`, the value leaving block b is replaced by
  scale == 0   the value that entered block b, exactly (the block becomes the identity: a knockout), or
  otherwise    x + scale * (y - x) in float32, cast back to the stream's dtype (x entering, y leaving the block):
               the block's contribution to the residual stream scaled.
Consecutive blocks chain (a knocked-out block's replacement is what the next one receives). The blocks still run
(their work is discarded); strict, off and every other mode run as usual around them. A block the model lacks is
refused in one line. The hook is removed on exit.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterable, Iterator

import torch

from ...errors import ValidationError


@contextlib.contextmanager
def knocked_out(model: Any, blocks: Iterable[int], scale: float = 0.0) -> Iterator[None]:
    """Hold `blocks` of `model` knocked out (scale 0) or scaled (module docstring)."""
    n = int(model.config.num_layers)
    chosen = sorted(set(int(b) for b in blocks))
    bad = [b for b in chosen if not 0 <= b < n]
    if bad or not chosen:
        raise ValidationError(f"blocks {chosen}: name blocks in 0..{n - 1}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValidationError(f"scale={scale!r}: must be a finite number")
    entering: dict[int, torch.Tensor] = {}

    def hook(point: Any, tensor: torch.Tensor) -> torch.Tensor | None:
        i = -1 if point.name == "pack" else point.layer  # the block whose output this is (-1: the stack's input)
        out = tensor
        if i in chosen:
            x = entering.pop(i)
            out = x if scale == 0 else (x.float() + scale * (tensor.float() - x.float())).to(tensor.dtype)
        if i + 1 in chosen:
            entering[i + 1] = out
        return None if out is tensor else out

    names = {"pack" if b == 0 else f"blocks.{b - 1}.residual2" for b in chosen}
    names |= {f"blocks.{b}.residual2" for b in chosen}
    handle = model.add_hook(hook, names=sorted(names))
    try:
        yield
    finally:
        handle.remove()
        entering.clear()
