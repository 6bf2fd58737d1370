"""`fast` without the bfloat16 copies: the projection weights fast mode only ever reads as FP8 leave the device.

`fast.prepare` quantises every eligible projection into an FP8 copy beside its bfloat16 weight, 1.5x the DiT's bytes
on the GPU (92.6 GiB for the released DiT: it cannot fit an 80 GB card). A fast forward reads those weights only
through their FP8 copy (`fast.WEIGHTS`: `_fp8_linear`, and `linear_reference` under emulation), so their bfloat16
bytes can go.

Contract
--------
`drop_bf16(model, keep="host") -> int` (bytes freed on the device): every FP8-eligible bfloat16 weight of a
`torch.nn.Linear` (`fast.prepare`'s set) is quantised into `fast.WEIGHTS` if it is not already, then its Parameter
(the same object: module paths, hooks and the weight cache's key are kept) is bound to
- `keep="host"`: a host copy of its bytes (pinned when the weight was on CUDA), for `restore_bf16` (drift against
  `off` asks for them: `with bf16_restored(model): ...`);
- `keep="none"`: a 2-byte placeholder of the weight's shape and dtype (zero strides): the bytes are gone; `off` /
  strict forwards of that model then compute garbage -- reload the weights for them.
A fast forward after `drop_bf16` produces the same bytes as before it (the FP8 copies are the same tensors; tested on
the CPU under `fast.use_emulation()` with `keep="none"`, where any read of a dropped weight would read zeros), and
`fast` accepts a dropped weight on the host: its FP8 copy is what runs.
`restore_bf16(model, keep_fp8=True)`: the dropped weights back on their device (from the host copies; refused for
`keep="none"`); `keep_fp8=False` first drops their FP8 copies from `fast.WEIGHTS` (an 80 GB card holds one of the two
sets, not both). `bf16_restored(model)` restores for the enclosed code and drops again after (re-quantising, same
bytes, when the FP8 copies were dropped).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from . import fast

KEEPS = ("host", "none")


@dataclass(eq=False)
class _Dropped:
    param: torch.nn.Parameter
    device: torch.device
    host: torch.Tensor | None  # the bytes (keep="host"), else None


def _dropped(model: torch.nn.Module) -> list[_Dropped]:
    return model.__dict__.setdefault("_h3lab_fast_dropped", [])


def eligible(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights fast mode reads only as FP8: bfloat16 `nn.Linear` weights with K and N multiples of 16."""
    out, seen = [], set()
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(module, torch.nn.Linear) and isinstance(w, torch.Tensor) and w.dim() == 2 \
                and not w.is_meta and fast._fp8_eligible(w) and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def drop_bf16(model: torch.nn.Module, keep: str = "host") -> int:
    """Quantise and drop the bfloat16 bytes of every FP8-eligible weight (module docstring); bytes freed."""
    if keep not in KEEPS:
        raise ValueError(f"keep={keep!r}: must be one of {', '.join(KEEPS)}")
    done = {id(d.param) for d in _dropped(model)}
    freed = 0
    with torch.no_grad():
        for w in eligible(model):
            if id(w) in done:
                continue
            fast.WEIGHTS.get(w)  # the FP8 copy, on the weight's device, before its bytes go
            device = w.device
            host = None
            if keep == "host":
                host = torch.empty(w.shape, dtype=w.dtype, pin_memory=device.type == "cuda")
                host.copy_(w.data)
                placeholder = host
            else:
                placeholder = torch.zeros(1, dtype=w.dtype, device=device).expand(w.shape)
            freed += w.numel() * w.element_size()
            w.data = placeholder
            _dropped(model).append(_Dropped(w, device, host))
    if freed and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def restore_bf16(model: torch.nn.Module, keep_fp8: bool = True) -> int:
    """Put the dropped weights' bytes back on their device (module docstring); bytes restored."""
    dropped = _dropped(model)
    lost = [d for d in dropped if d.host is None]
    if lost:
        raise ValueError(f"restore_bf16: {len(lost)} weights were dropped with keep='none' (their bytes are gone); "
                         "reload the model's weights")
    restored = 0
    with torch.no_grad():
        if not keep_fp8:
            for d in dropped:
                fast.WEIGHTS._entries.pop(id(d.param), None)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        for d in dropped:
            d.param.data = d.host.to(d.device)
            restored += d.host.numel() * d.host.element_size()
    dropped.clear()
    return restored


@contextlib.contextmanager
def bf16_restored(model: torch.nn.Module, keep_fp8: bool = False) -> Iterator[torch.nn.Module]:
    """The dropped bfloat16 weights back for the enclosed code (a drift run in `off`), dropped again after."""
    had = bool(_dropped(model))
    restore_bf16(model, keep_fp8=keep_fp8)
    try:
        yield model
    finally:
        if had:
            drop_bf16(model, keep="host")
