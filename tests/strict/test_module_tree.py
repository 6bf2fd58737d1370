"""h3lab/execution/module_tree.py: a cached walk is always what a fresh walk gives now; every change of the tree after a cached
walk (module replaced, wrapped, added, deleted; parameter or buffer replaced, swapped by torch's direct dict writes;
hook added; an object freed and its id reusable) is seen, and the signature of h3lab/execution/graphs.py misses with it."""

from __future__ import annotations

import dataclasses
import gc

import torch

from h3lab import H3Transformer
from h3lab.execution import graphs, module_tree
from h3lab.config import H3Config


def _model(seed: int = 5) -> H3Transformer:
    torch.manual_seed(seed)
    return H3Transformer(dataclasses.replace(H3Config.tiny(), num_layers=3))


def _same_as_fresh(model) -> module_tree.Tree:
    """The walk (cached or not) checked against a fresh one."""
    tree = module_tree.walk(model)
    ids, tensors, hooked, _ = module_tree._fresh(model)
    assert tree.module_ids == ids and tree.hooked == hooked
    assert [id(t) for t in tree.tensors] == [id(t) for t in tensors] and tree.tensor_ids == tuple(map(id, tensors))
    return tree


def test_the_cached_walk_is_reused_and_equals_a_fresh_one():
    model = _model()
    first = _same_as_fresh(model)
    cached = module_tree._TREES[model]
    second = _same_as_fresh(model)
    assert module_tree._TREES[model] is cached and second.module_ids is first.module_ids  # no re-walk
    assert len(first.module_ids) == sum(1 for _ in model.modules())
    every = [id(t) for t in (*model.parameters(), *model.buffers())]
    assert sorted(first.tensor_ids) == sorted(every)


def _changes(model):
    """(what, change, undo) after a cached walk; each change must re-walk."""
    block = model.transformer_blocks[1]
    saved_ff, saved_w = block.ff, block.attn.to_q.weight
    yield "module replaced", lambda: setattr(block, "ff", torch.nn.Sequential(saved_ff)), \
        lambda: setattr(block, "ff", saved_ff)
    yield "module added by a direct dict write", lambda: model.transformer_blocks.insert(0, torch.nn.Identity()), \
        lambda: model.transformer_blocks.__delitem__(0)
    yield "module deleted", lambda: delattr(block, "ff"), lambda: setattr(block, "ff", saved_ff)
    fresh = torch.nn.Parameter(torch.randn(saved_w.shape).to(saved_w.dtype))
    yield "parameter replaced", lambda: setattr(block.attn.to_q, "weight", fresh), \
        lambda: setattr(block.attn.to_q, "weight", saved_w)
    yield "parameter swapped by a direct dict write (functional_call's way)", \
        lambda: block.attn.to_q._parameters.__setitem__("weight", fresh), \
        lambda: block.attn.to_q._parameters.__setitem__("weight", saved_w)
    buf_owner = next(m for m in model.modules() if m._buffers)
    name, buf = next(iter(buf_owner._buffers.items()))
    yield "buffer replaced (Module._apply's direct write)", \
        lambda: buf_owner._buffers.__setitem__(name, buf.clone()), lambda: buf_owner._buffers.__setitem__(name, buf)
    handles = []
    yield "forward hook added", lambda: handles.append(block.ff.register_forward_hook(lambda *a: None)), \
        lambda: handles.pop().remove()
    yield "forward pre-hook added", lambda: handles.append(block.register_forward_pre_hook(lambda *a: None)), \
        lambda: handles.pop().remove()


def test_every_change_after_a_cached_walk_is_seen_and_the_signature_misses():
    model = _model()
    args = (torch.randn(1, 3, 16), torch.arange(4))  # one float (data) and one integer (layout) argument
    key = graphs.signature(model, args, graphs.STRICT)
    for what, change, undo in _changes(model):
        _same_as_fresh(model)  # cached
        change()
        tree = _same_as_fresh(model)
        if "hook" in what:  # GraphCache.run refuses a hooked tree (the signature does not hold hooks)
            assert tree.hooked, what
        else:
            assert graphs.signature(model, args, graphs.STRICT, tree) != key, what
        undo()
        key = graphs.signature(model, args, graphs.STRICT, _same_as_fresh(model))


def test_an_in_place_update_or_new_storage_misses_without_a_re_walk():
    model = _model()
    args = (torch.randn(1, 3, 16),)
    key = graphs.signature(model, args, graphs.STRICT)
    cached = module_tree._TREES[model]
    w = model.transformer_blocks[2].attn.to_k.weight
    with torch.no_grad():
        w.add_(torch.randn(w.shape).to(w.dtype))  # a new _version
    key2 = graphs.signature(model, args, graphs.STRICT)
    assert key2 != key
    w.data = w.data.clone()  # new storage, same object, same _version
    assert graphs.signature(model, args, graphs.STRICT) != key2
    w.data = w.data.to(torch.float32) if w.dtype != torch.float32 else w.data.double()  # a cast
    assert graphs.signature(model, args, graphs.STRICT) not in (key, key2)
    assert module_tree._TREES[model] is cached  # the same tree: only the tensors' fields changed


def test_a_freed_object_marks_the_walk_stale_so_a_reused_id_is_never_trusted():
    model = _model()
    block = model.transformer_blocks[0]
    old = block.ff
    _same_as_fresh(model)
    cached = module_tree._TREES[model]
    del block.ff, old  # freed now: another object may take its id
    gc.collect()
    assert cached.stale and cached.dicts == []  # the stale walk holds none of the removed module's dicts
    block.ff = torch.nn.Linear(2, 2)
    _same_as_fresh(model)
    assert module_tree._TREES[model] is not cached


def test_the_cache_holds_no_strong_reference_to_the_model():
    model = _model()
    module_tree.walk(model)
    assert len(module_tree._TREES) >= 1
    ref = __import__("weakref").ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_hooked_tree_is_never_cached():
    model = _model()
    handle = model.proj_out.register_forward_hook(lambda *a: None)
    try:
        assert module_tree.walk(model).hooked and model not in module_tree._TREES
    finally:
        handle.remove()
    assert not module_tree.walk(model).hooked and model in module_tree._TREES


def test_adapter_switch_and_scaling_are_part_of_the_walk_and_the_signature():
    """peft's adapter off switch (GRPO's reference policy) changes no module or tensor, only what the LoRA forward
    branches on: the walk reads it on every call, so a graph of the adapter-on forward never serves the adapter-off
    one (and the other way round)."""
    from h3lab.training import add_lora
    from h3lab.adapters.lora import adapter_disabled, lora_layers

    model = _model()
    add_lora(model, 2, 4.0, seed=1)
    layers = [m for _, m in lora_layers(model)]
    on = _same_as_fresh(model)
    assert len(on.state) == len(layers) > 0 and all(s[0] is False for s in on.state)
    args = (torch.zeros(1), torch.ones(2, dtype=torch.int64))
    key_on = graphs.signature(model, args, graphs.STRICT)
    with adapter_disabled(model):
        off = module_tree.walk(model)
        assert off.module_ids is on.module_ids  # the cached walk, its state read anew
        assert all(s[0] is True for s in off.state)
        assert graphs.signature(model, args, graphs.STRICT) != key_on
    assert module_tree.walk(model).state == on.state
    assert graphs.signature(model, args, graphs.STRICT) == key_on
    layers[0].scaling["default"] = 0.5  # a scale change is another forward too
    assert graphs.signature(model, args, graphs.STRICT) != key_on


def test_a_swapped_tile_table_is_another_signature(monkeypatch):
    """A graph replays the kernels it captured: a tile table swapped after a capture (the benchmarks' variants) must
    not meet the old graph."""
    from h3kernels import attention, gemm

    model = _model()
    args = (torch.zeros(1), torch.ones(2, dtype=torch.int64))
    key = graphs.signature(model, args, graphs.STRICT)
    assert graphs.signature(model, args, graphs.STRICT) == key
    monkeypatch.setitem(gemm.TREE_TILES, torch.float32,
                        dataclasses.replace(gemm.TREE_TILES[torch.float32], precision="ieee"))
    assert graphs.signature(model, args, graphs.STRICT) != key
    monkeypatch.undo()
    assert graphs.signature(model, args, graphs.STRICT) == key
    monkeypatch.setitem(attention.FORWARD, torch.bfloat16,
                        dataclasses.replace(attention.FORWARD[torch.bfloat16], fp_fusion=False))
    assert graphs.signature(model, args, graphs.STRICT) != key
