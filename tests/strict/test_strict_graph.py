"""h3lab/execution/graphs.py (its strict policy) on the CPU: eligibility, the signature keys, the
capture-time rules, and that a strict forward on the CPU stays the eager forward, byte for byte.

The capture runs through a backend that "replays" by re-running the captured body on the static buffers (the real
`torch.cuda.CUDAGraph` is exercised on the H200 by benchmarks/benchmark_strict_graph.py), and that forbids, while it
captures, every host read a CUDA stream capture would refuse (`.item()`, `.tolist()`, `bool()`, `int()`, `float()`,
`torch.equal`, `.cpu()` of a tensor): the strict kernels' index checks must all be resolved by the first call."""

from __future__ import annotations

import pytest
import torch
from graph_fakes import ReplayBackend, no_host_reads
from strict_cases import CONFIGS, build_model, forward_kwargs, make_layout, make_request

from h3lab.execution import graphs, runtime

ARGS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
        "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices", "key_order")


@pytest.fixture(scope="module")
def model():
    return build_model(CONFIGS["h3d8"], "released", seed=21)


def _kwargs(model, seed: int, permuted: bool = False, timesteps=(0.42, 0.7)) -> dict:
    layout = make_layout("t2va", model.config.patch_size)
    if permuted:  # a consistent permutation: every index tensor remapped, attention reads keys through key_order
        layout = layout.permute(torch.randperm(layout.sequence_length, generator=torch.Generator().manual_seed(3)))
    return forward_kwargs(layout, [make_request(model.config, layout, seed)], timesteps)


def _args(kw: dict) -> tuple:
    return tuple(kw[k] for k in ARGS)


def _strict(cache, model, args):
    with torch.no_grad(), runtime.use_mode("strict"):
        return cache.run(model, args, model._run_ops, device_ok=lambda a: True)


def _eager(model, args):
    with torch.no_grad(), runtime.use_mode("strict"):
        return model._run_ops(*args)


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_strict_capture_reads_nothing_on_the_host_and_replays_the_eager_bytes(model):
    cache = graphs.GraphCache(graphs.STRICT, ReplayBackend(guard=no_host_reads))
    a, b, c = (_args(_kwargs(model, s, permuted=True)) for s in (1, 2, 3))
    assert a[-1] is not None  # key_order: attention's permutation check is one of the resolved index checks
    outs, paths = [], []
    for x in (a, b, c):
        outs.append(_strict(cache, model, x))
        paths.append(runtime.last_trace().graph["cuda_graph"])
    trace = runtime.last_trace()
    assert trace.mode == "strict" and trace.graph == {"cuda_graph": "replay", "replays": 2}
    assert not trace.fallbacks and set(trace.summary()["attention"]) == {"strict"}
    assert paths == ["eager", "captured", "replay"] and cache.backend.captures == 1
    assert _equal(outs[1], _eager(model, b)) and _equal(outs[2], _eager(model, c))  # the first call is the eager one
    assert not _equal(outs[1], outs[2])
    entry = next(iter(cache._entries.values()))
    assert len(entry.pins) >= 4  # pack, select (video, audio), modulate, key_order, AdaLN index: kept with the graph


def _auto(cache, model, args, mode="auto"):
    """The cache's logic on a cheap body: mode auto runs the torch ops on the CPU (the key holds the mode)."""
    with torch.no_grad(), runtime.use_mode(mode):
        return cache.run(model, args, model._run_ops, device_ok=lambda a: True)


def test_another_layout_of_the_same_shapes_is_another_graph(model):
    """The timesteps swapped: same shapes, other timestep_indices bytes. A replay of the first graph would read the
    first layout's index metadata (baked in at capture); the signature holds the integer bytes, so it runs eager."""
    cache = graphs.GraphCache(graphs.STRICT, ReplayBackend(guard=no_host_reads))
    first = _args(_kwargs(model, 4))
    for _ in range(3):
        _auto(cache, model, first)
    other = _args(_kwargs(model, 5, timesteps=(0.7, 0.42)))
    assert [x.shape for x in other if x is not None] == [x.shape for x in first if x is not None]
    assert not torch.equal(other[4], first[4])
    out = _auto(cache, model, other)
    assert graphs.last_path("strict")["cuda_graph"] == "eager" and "first call" in graphs.last_path("strict")["reason"]
    with torch.no_grad(), runtime.use_mode("auto"):
        assert _equal(out, model._run_ops(*other))
    _auto(cache, model, first)
    assert graphs.last_path("strict")["cuda_graph"] == "replay" and cache.backend.captures == 1


def _key(model, args, policy=graphs.STRICT):
    return graphs.signature(model, args, policy)


def test_the_signature_misses_on_every_change_that_can_change_a_byte(model):
    kw = _kwargs(model, 6)
    args = _args(kw)
    with runtime.use_mode("strict"):
        key = _key(model, args)
        same = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in args)
        assert _key(model, same) == key  # new tensors, same bytes: the same graph
        v = args[0]
        changed = {
            "shape": (torch.cat([v, v]),) + args[1:],
            "dtype": (v.double(),) + args[1:],
            "stride": (torch.empty_strided(v.shape, (v.shape[1] * v.shape[2], 1, v.shape[1])).copy_(v),) + args[1:],
            "layout bytes": args[:5] + (args[5].flip(0),) + args[6:],
            "key_order": args[:10] + (torch.arange(args[6].shape[0]),),
        }
        for what, other in changed.items():
            assert _key(model, other) != key, what
        w = model.transformer_blocks[0].attn.to_q.weight
        with torch.no_grad():
            w.add_(0.0)  # in place: a new _version
        assert _key(model, args) != key, "weight update"
        key = _key(model, args)
        saved = model.proj_out
        model.proj_out = torch.nn.Sequential(saved)  # the same parameters, another module tree
        try:
            assert _key(model, args) != key, "module replaced"
        finally:
            model.proj_out = saved
        assert _key(model, args) == key
        assert _key(model, args, policy=graphs.FAST) != key, "fast policy"
    with runtime.use_mode("auto"):
        assert _key(model, args) != key, "mode switch"


def test_a_mode_switch_misses_and_switching_back_replays(model):
    cache = graphs.GraphCache(graphs.STRICT, ReplayBackend(guard=no_host_reads))
    args = _args(_kwargs(model, 7))
    for _ in range(3):
        _auto(cache, model, args)
    _auto(cache, model, args, mode="off")
    assert graphs.last_path("strict")["cuda_graph"] == "eager"
    assert runtime.last_trace().graph is None  # an eager trace of another mode never carries the strict graph path
    _auto(cache, model, args)
    assert graphs.last_path("strict")["cuda_graph"] == "replay"


def test_strict_on_the_cpu_stays_the_eager_forward_and_says_why(model):
    kw = _kwargs(model, 8)
    with torch.no_grad(), runtime.use_mode("strict"):
        with graphs.use_graphs("strict", False):
            off = model(**kw)
        assert runtime.last_trace().graph["reason"] == "graphs disabled (graphs.use_graphs('strict', False))"
        before = len(graphs.CACHES["strict"]._entries)
        on = model(**kw)
    assert runtime.last_trace().to_dict()["graph"] == {"cuda_graph": "eager", "reason": "inputs not on a CUDA device"}
    assert _equal(on, off) and len(graphs.CACHES["strict"]._entries) == before == 0
    with torch.no_grad(), runtime.use_mode("off"):
        model(**kw)
    assert "graph" not in runtime.last_trace().to_dict()


def test_ineligible_and_bad_calls(model):
    cache = graphs.GraphCache(graphs.STRICT, ReplayBackend(guard=no_host_reads))
    args = _args(_kwargs(model, 9))
    with torch.inference_mode(), runtime.use_mode("auto"):
        cache.run(model, args, model._run_ops, device_ok=lambda a: True)
    assert graphs.last_path("strict")["reason"].startswith("inference mode")
    with runtime.use_mode("auto"):
        cache.run(model, args, model._run_ops, device_ok=lambda a: True)
    assert graphs.last_path("strict")["reason"] == "grad mode is on"
    saved, graphs.STRICT_MAX_ROWS = graphs.STRICT_MAX_ROWS, args[6].shape[0] - 1
    try:
        _auto(cache, model, args)
    finally:
        graphs.STRICT_MAX_ROWS = saved
    assert graphs.last_path("strict")["reason"].startswith(f"{args[6].shape[0]} packed rows > graphs.STRICT_MAX_ROWS")
    handle = model.transformer_blocks[0].ff.register_forward_hook(lambda *a: None)  # deep in the tree
    try:
        _auto(cache, model, args)
    finally:
        handle.remove()
    assert graphs.last_path("strict")["reason"] == "a torch forward hook is registered"
    expanded = (args[0][:, :1].expand(-1, args[0].shape[1], -1),) + args[1:]  # stride 0: no dense static copy
    out = _auto(cache, model, expanded)
    assert "not dense" in graphs.last_path("strict")["reason"]
    with torch.no_grad(), runtime.use_mode("auto"):
        assert _equal(out, model._run_ops(*expanded))
    assert len(cache._entries) == 0 and cache.backend.captures == 0

    def refused(*a):
        raise runtime.StrictError("strict mode cannot run op 'linear' (a refusal)")

    for _ in range(2):  # a refusal raises from the first call and leaves no signature behind
        with pytest.raises(runtime.StrictError, match="a refusal"), torch.no_grad():
            cache.run(model, args, refused, device_ok=lambda a: True)
    assert len(cache._entries) == 0
    with pytest.raises(TypeError, match="must be True or False"):
        with graphs.use_graphs("strict", 1):
            pass
    with pytest.raises(TypeError, match="must be an h3lab.execution.graphs.Policy"):
        graphs.GraphCache("strict")
    with pytest.raises(ValueError, match="max_graphs=0"):
        graphs.GraphCache(graphs.STRICT, max_graphs=0)


def test_an_index_cache_miss_at_capture_fails_loudly_not_by_a_host_sync(model):
    """The caches the first call built are gone before the second (a cleared cache): the capture must not build them
    (a host sync inside a capture); it fails with the reason, and the signature stays eager with it."""
    from h3kernels import modulate

    cache = graphs.GraphCache(graphs.STRICT, ReplayBackend(guard=no_host_reads))
    args = _args(_kwargs(model, 10))
    first = _strict(cache, model, args)
    modulate._CACHE._entries.clear()
    out = _strict(cache, model, args)
    reason = graphs.last_path("strict")["reason"]
    assert reason.startswith("capture failed: IndexCacheMiss: index cache miss") and "\n" not in reason
    assert runtime.last_trace().graph == {"cuda_graph": "eager", "reason": reason} and cache.backend.captures == 0
    assert _equal(out, first)  # the eager forward of the same arguments
    assert [e.failed for e in cache._entries.values()] == [reason]  # kept, failed: later calls run eager at once
