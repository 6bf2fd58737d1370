"""An attention view of a sealed run: its `RunSpec` re-run with a probe hook at one block's `q_rope` / `k_rope`.

Contract
--------
- `AttentionProbe(model, block, step, regions, ...)` is a hook (`fn(point, tensor) -> None`, `model.add_hook`)
  registered at `blocks.{block}.q_rope` and `blocks.{block}.k_rope` only. On the forward of pass `step`
  (`model.hook_context["step"]`, set by the one loop) it keeps batch item `batch_item` of the RoPE'd Q, and when
  the K of the same forward fires it computes the `AttentionMap` (`views.attention.attention_map`) and drops Q. It
  returns None at every call: it never replaces a value, so the run's bytes are those of the run without it (the
  model runs the unfused pre-norm while any hook is registered; the strict kernels give the fused kernel's bytes
  there, and the test compares the trajectory digests with and without the probe). It reads nothing during a
  gradient-checkpoint replay (`model.recomputing`) and nothing after it has its map.
- `attention_view(spec, model, block, step=None, heads=None, query=None, text_labels=None, text_words=None,
  audio_bin=1, batch_item=0, models=None, chunk=None, stop=True) -> AttentionMap` re-runs `spec` with the probe (the spec itself
  is unchanged: it stays sealable and its result hash is the same) and returns the map. `step` None is the last pass
  that runs a forward; a pass that reuses an earlier velocity (`spec.reuse`) runs no forward and is refused, as are
  a block the model does not have, a spec without a layout and a run whose blocks see other rows than the layout
  (token reduction). `stop` ends the run after the probed pass (`DenoiseCancelled`, caught here): the passes after
  it cannot change the map. `query`: region selector words (`views.regions.select`), None every region.
- The model knows nothing of the probe: it is one hook, added before the run and removed after it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ...run import DenoiseCancelled, RunSpec, denoise
from ...run.sampler import reuse_plan
from .attention import AttentionMap, AttentionViewError, attention_map
from .regions import Regions, layout_regions, select


class AttentionProbe:
    """The probe hook (module docstring); `map` holds the result once the probed forward ran."""

    def __init__(self, model: Any, block: int, step: int, regions: Regions, *, query: Sequence[int] | None = None,
                 heads: Sequence[int] | None = None, key_order: torch.Tensor | None = None, batch_item: int = 0,
                 chunk: int | None = None):
        self.model, self.block, self.step, self.regions = model, block, step, regions
        self.query, self.heads, self.key_order = query, heads, key_order
        self.batch_item, self.chunk = batch_item, chunk
        self.names = (f"blocks.{block}.q_rope", f"blocks.{block}.k_rope")
        self.map: AttentionMap | None = None
        self._q: torch.Tensor | None = None

    def __call__(self, point: Any, tensor: torch.Tensor) -> None:
        if self.map is not None or getattr(self.model, "recomputing", False):
            return None
        if getattr(self.model, "hook_context", {}).get("step") != self.step or point.name not in self.names:
            return None
        if tensor.shape[0] <= self.batch_item:
            raise AttentionViewError(f"batch_item={self.batch_item}: the run has {tensor.shape[0]} batch items")
        item = tensor.detach()[self.batch_item]  # (S, H, D): what ops.attention receives (never written)
        if point.name == self.names[0]:
            self._q = item
            return None
        q, self._q = self._q, None
        self.map = attention_map(q, item, self.regions, block=self.block, step=self.step, query=self.query,
                                 heads=self.heads, key_order=self.key_order, chunk=self.chunk,
                                 batch_item=self.batch_item)
        return None


def _check_block(model: Any, block: int) -> None:
    n = int(model.config.num_layers)
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < n:
        raise AttentionViewError(f"block={block!r}: the model has blocks 0..{n - 1}")


def evaluated_step(spec: RunSpec, step: int | None) -> int:
    """`step`, or the last pass that runs a forward; refuses a pass out of range or one that reuses a velocity."""
    passes = spec.inputs.num_passes
    evaluated = reuse_plan(passes, spec.reuse)
    if step is None:
        return max(i for i, e in enumerate(evaluated) if e)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < passes:
        raise AttentionViewError(f"pass {step!r}: the run has passes 0..{passes - 1}")
    if not evaluated[step]:
        ran = [i for i, e in enumerate(evaluated) if e]
        raise AttentionViewError(f"pass {step}: reuses an earlier velocity (reuse {spec.reuse}), no forward ran; "
                                 f"passes with a forward: {', '.join(map(str, ran))}")
    return step


def attention_view(spec: RunSpec, model: Any, block: int, *, step: int | None = None,
                   heads: Sequence[int] | None = None, query: str | Sequence[str] | None = None,
                   text_labels: Sequence[str] | None = None, text_words: Sequence[int] | None = None,
                   audio_bin: int = 1, batch_item: int = 0,
                   models: Any = None, chunk: int | None = None, stop: bool = True) -> AttentionMap:
    """The `AttentionMap` of `spec` re-run on `model` with the probe (module docstring)."""
    if spec.layout is None:
        raise AttentionViewError("the run spec carries no layout: an attention view needs the packed layout's regions")
    _check_block(model, block)
    step = evaluated_step(spec, step)
    regions = layout_regions(spec.layout, text_labels, audio_bin, text_words)
    probe = AttentionProbe(model, block, step, regions, query=select(regions, query), heads=heads,
                           key_order=spec.layout.key_order(), batch_item=batch_item, chunk=chunk)
    device = next(model.parameters()).device
    handle = model.add_hook(probe, names=probe.names)
    try:
        denoise(spec.to(device), model, cancel=(lambda: probe.map is not None) if stop else None, models=models)
    except DenoiseCancelled:
        pass
    finally:
        handle.remove()
    if probe.map is None:
        raise AttentionViewError(f"block {block} ran no attention at pass {step} (a preset skipped it?): no view")
    return probe.map
