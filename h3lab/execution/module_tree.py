"""The module tree a CUDA graph depends on, walked once per model and re-checked cheaply on every call.

Contract
--------
`walk(model) -> Tree(module_ids, tensors, tensor_ids, hooked, state)`: `module_ids` the id of every module in
pre-order (the root first, children in registration order), `tensors` every parameter and buffer (not None) in that
order, live objects of this call, `hooked` whether any module has a forward or forward-pre hook, and `state` the
forward-changing Python state of every adapter layer (`adapter_state`: peft's adapter on/off switch, active and
merged adapters, scalings, a run's LoRA factors per block and modality), read anew on every call. The result is always what a fresh walk of the tree would give
now; what is cached is only the work of walking it.

Why `state`: a CUDA graph bakes in the Python branches its forward took. peft's `enable_adapters(False)` (GRPO's
reference policy, `training.lora.adapter_disabled`) changes no module, tensor or version, only a flag the LoRA
layer's forward reads; without it in the signature, a graph captured with the adapter on would be replayed for the
adapter-off reference (or the other way round).

Why: a fresh walk visits every module (1,001 at 50 blocks) in Python (~0.9 ms on the CPU host); the check below
touches the same state through C-level `map`s (~0.2 ms) and re-walks only when it fails.

A cached walk is reused while, since it was taken:
- every container dict it read (`_parameters`, `_buffers`, `_modules`, `_forward_hooks`, `_forward_pre_hooks` of
  every module it visited) has the same length, and every one that was non-empty holds the same objects (by id) in
  the same order: a module replaced, wrapped (an adapter), added or deleted, a parameter or buffer replaced, added or
  deleted (`setattr`, `register_*`, `del`, and torch's direct dict writes: `Module._apply` replacing buffers,
  `functional_call`'s swaps, `ModuleList.insert`), and any forward hook added, all change one of them;
- no object it recorded (child module, parameter, buffer) has been freed: a weak reference's callback marks the walk
  stale, so a new object that reuses a freed one's id is never mistaken for it.
A tree with a hook is never cached (graphs refuse it anyway). Not covered, as the fresh walk never covered them
either: a module's class swapped, a container dict rebound to another dict object without changing the one read
(torch's own rebinding, `ModuleList.__delitem__`, deletes from the old dict first). A tensor's data pointer, dtype and
`_version` are not part of the tree: the caller reads them from `tensors` on every call.
The cache holds no strong reference to the model, its modules or its tensors (weak references and the container
dicts only; a stale walk drops its dicts at once).
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch

_CONTAINERS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks")


class Tree(NamedTuple):
    module_ids: tuple  # id of every module, pre-order
    tensors: list  # every parameter and buffer, the live objects
    tensor_ids: tuple  # their ids
    hooked: bool  # any module has a forward or forward-pre hook
    state: tuple = ()  # adapter_state of every adapter layer, pre-order


def is_adapter_layer(module: torch.nn.Module) -> bool:
    """A peft tuner layer (LoRA and the rest): its forward branches on Python state (`adapter_state`)."""
    return hasattr(module, "_disable_adapters") and hasattr(module, "merged_adapters")


def adapter_state(module: torch.nn.Module) -> tuple:
    """(adapters off, active adapters, merged adapters, scalings, the run's per-block / per-modality factors) of one
    adapter layer."""
    active = module.active_adapter
    scaling = getattr(module, "scaling", None)
    factors = module.__dict__.get("_h3_row_scale")  # h3lab.adapters.lora_scale.LayerScale or None
    return (bool(module._disable_adapters), (active,) if isinstance(active, str) else tuple(active),
            tuple(module.merged_adapters), tuple(sorted(scaling.items())) if isinstance(scaling, dict) else None,
            None if factors is None else factors.state())


class _Cached:
    """One model's walk: the container dicts read, their lengths, and the non-empty ones' member ids."""

    __slots__ = ("module_ids", "dicts", "lengths", "tensor_dicts", "module_dicts", "slot_ids", "child_ids",
                 "tensor_ids", "nones", "refs", "stale", "adapters", "__weakref__")

    def __init__(self, module_ids: tuple, modules: list, adapters: list):
        self.module_ids, self.stale = module_ids, False
        self.dicts = [getattr(m, name) for m in modules for name in _CONTAINERS]
        self.lengths = list(map(len, self.dicts))
        self.tensor_dicts = [d for m in modules for d in (m._parameters, m._buffers) if d]
        self.module_dicts = [m._modules for m in modules if m._modules]
        slots = list(itertools.chain.from_iterable(map(dict.values, self.tensor_dicts)))  # tensors and Nones
        children = list(itertools.chain.from_iterable(map(dict.values, self.module_dicts)))
        self.slot_ids, self.child_ids = list(map(id, slots)), list(map(id, children))
        self.nones = any(t is None for t in slots)
        self.tensor_ids = tuple(id(t) for t in slots if t is not None)
        me = weakref.ref(self)
        self.refs = [weakref.ref(o, lambda _r: _mark_stale(me)) for o in slots + children if o is not None]
        self.adapters = [weakref.ref(m) for m in adapters]  # alive while the walk holds

    def tensors(self) -> list | None:
        """The live tensors if the walk still holds, else None."""
        if self.stale or list(map(len, self.dicts)) != self.lengths:
            return None
        slots = list(itertools.chain.from_iterable(map(dict.values, self.tensor_dicts)))
        if list(map(id, slots)) != self.slot_ids:
            return None
        if list(map(id, itertools.chain.from_iterable(map(dict.values, self.module_dicts)))) != self.child_ids:
            return None
        return [t for t in slots if t is not None] if self.nones else slots


def _mark_stale(ref) -> None:
    cached = ref()
    if cached is not None:
        cached.stale = True
        cached.dicts = cached.tensor_dicts = cached.module_dicts = []  # hold no removed module's dicts


_TREES: "weakref.WeakKeyDictionary[torch.nn.Module, _Cached]" = weakref.WeakKeyDictionary()


def walk(model: torch.nn.Module) -> Tree:
    """The tree of `model` now (see the module contract): the cached walk where it still holds, else a fresh one."""
    cached = _TREES.get(model)
    tensors = cached.tensors() if cached is not None else None
    if tensors is not None:
        return Tree(cached.module_ids, tensors, cached.tensor_ids, False,
                    tuple(adapter_state(ref()) for ref in cached.adapters))
    module_ids, tensors, hooked, modules = _fresh(model)
    adapters = [m for m in modules if is_adapter_layer(m)]
    if hooked:
        _TREES.pop(model, None)
    else:
        _TREES[model] = _Cached(module_ids, modules, adapters)
    return Tree(module_ids, tensors, tuple(map(id, tensors)), hooked, tuple(map(adapter_state, adapters)))


def _fresh(model: torch.nn.Module) -> tuple[tuple, list, bool, list]:
    """One pass over the module tree (`model.modules()` and `model.parameters()` cost ~1 ms each at 50 blocks)."""
    modules, tensors, hooked, stack = [], [], False, [model]
    while stack:
        m = stack.pop()
        modules.append(m)
        hooked = hooked or bool(m._forward_hooks or m._forward_pre_hooks)
        tensors.extend(t for t in m._parameters.values() if t is not None)
        tensors.extend(t for t in m._buffers.values() if t is not None)
        stack.extend(c for c in reversed(m._modules.values()) if c is not None)
    return tuple(map(id, modules)), tensors, hooked, modules
