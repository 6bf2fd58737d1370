"""h3lab/execution/graphs.py (its fast policy) on the CPU: the signature / capture / replay / fallback logic of the fast
forward's CUDA graphs, through a backend that "replays" by re-running the captured body on the static input buffers
(the real `torch.cuda.CUDAGraph` is exercised on the H200 by benchmarks/benchmark_every_length.py, section `graphs`). The
bodies are the tiny model's real traced forward in mode off, so a replay must reproduce the eager bytes."""

from __future__ import annotations

import pytest
import torch
from graph_fakes import ReplayBackend
from strict_cases import forward_kwargs, make_layout, make_request

from h3lab import H3Transformer
from h3lab.execution import fast, graphs, runtime

ARGS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", "timestep_indices",
        "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices", "key_order")


@pytest.fixture(scope="module")
def model(tiny_snapshot) -> H3Transformer:
    return H3Transformer.from_pretrained(tiny_snapshot, subfolder="transformer")


def _args(model, task="t2va", seed=7):
    kw = forward_kwargs(make_layout(task, model.config.patch_size), [make_request(model.config, make_layout(
        task, model.config.patch_size), seed)])
    return tuple(kw[k] for k in ARGS)


def _run(cache, model, args):
    with torch.no_grad():
        return cache.run(model, args, model._run_ops, device_ok=lambda a: True)


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_first_call_eager_second_captures_then_replays_with_fresh_inputs(model):
    cache = graphs.GraphCache(graphs.FAST, ReplayBackend())
    a, b, c = _args(model, seed=1), _args(model, seed=2), _args(model, seed=3)
    with torch.no_grad():
        truth = [model._run_ops(*x) for x in (a, b, c)]
    out = _run(cache, model, a)
    assert graphs.last_path("fast")["cuda_graph"] == "eager" and cache.backend.captures == 0 and _equal(out, truth[0])
    out_b = _run(cache, model, b)
    assert graphs.last_path("fast")["cuda_graph"] == "captured" and cache.backend.captures == 1 and len(cache) == 1
    out_c = _run(cache, model, c)
    assert graphs.last_path("fast") == {"cuda_graph": "replay", "replays": 2} and cache.backend.captures == 1
    assert _equal(out_b, truth[1]) and _equal(out_c, truth[2])  # inputs copied into the static buffers
    assert _equal(out_b, truth[1])  # a result is a clone: the next replay did not overwrite it
    assert runtime.last_trace().graph == {"cuda_graph": "replay", "replays": 2}


def test_a_shape_change_falls_back_to_the_eager_forward(model):
    cache = graphs.GraphCache(graphs.FAST, ReplayBackend())
    for _ in range(3):
        _run(cache, model, _args(model, "t2va"))
    other = _args(model, "fl2va", seed=4)
    with torch.no_grad():
        truth = model._run_ops(*other)
    out = _run(cache, model, other)  # a new signature: eager, exactly the forward itself
    assert graphs.last_path("fast")["cuda_graph"] == "eager" and _equal(out, truth)
    assert "first call" in graphs.last_path("fast")["reason"]
    _run(cache, model, other)
    assert graphs.last_path("fast")["cuda_graph"] == "captured" and cache.backend.captures == 2


def test_a_weight_update_is_a_new_signature(model):
    cache = graphs.GraphCache(graphs.FAST, ReplayBackend())
    a = _args(model)
    for _ in range(3):
        _run(cache, model, a)
    w = model.transformer_blocks[0].attn.to_q.weight
    with torch.no_grad():
        w.mul_(1.5)
        try:
            truth = model._run_ops(*a)
            out = _run(cache, model, a)
            assert graphs.last_path("fast")["cuda_graph"] == "eager" and _equal(out, truth)
        finally:
            w.div_(1.5)


def test_fast_switches_are_part_of_the_signature(model):
    cache = graphs.GraphCache(graphs.FAST, ReplayBackend())
    a = _args(model)
    for _ in range(3):
        _run(cache, model, a)
    with fast.use_fused_producers(False):
        _run(cache, model, a)  # another forward: never the graph captured with the fused producers
        assert graphs.last_path("fast")["cuda_graph"] == "eager"
    _run(cache, model, a)
    assert graphs.last_path("fast")["cuda_graph"] == "replay"


def test_ineligible_calls_run_eager_and_say_why(model):
    cache = graphs.GraphCache(graphs.FAST, ReplayBackend())
    a = _args(model)
    handle = model.add_hook(lambda point, t: None, names=["blocks.0.q"])
    try:
        for _ in range(3):
            _run(cache, model, a)
        assert graphs.last_path("fast") == {"cuda_graph": "eager", "reason": "an h3lab hook is registered"}
    finally:
        handle.remove()
    with graphs.use_graphs("fast", False):
        _run(cache, model, a)
    assert "disabled" in graphs.last_path("fast")["reason"]
    with runtime.use_overrides({"silu": torch.nn.functional.silu}):
        _run(cache, model, a)
    assert "overrides" in graphs.last_path("fast")["reason"]
    cache.run(model, a, model._run_ops, device_ok=lambda x: True)  # grad mode on
    assert graphs.last_path("fast")["reason"] == "grad mode is on"
    with torch.no_grad():
        cache.run(model, a, model._run_ops)  # CPU tensors with the default device check
    assert graphs.last_path("fast")["reason"] == "inputs not on a CUDA device"
    saved, graphs.FAST_MAX_ROWS = graphs.FAST_MAX_ROWS, a[6].shape[0] - 1
    try:
        for _ in range(3):
            _run(cache, model, a)
    finally:
        graphs.FAST_MAX_ROWS = saved
    assert graphs.last_path("fast")["reason"] == (f"{a[6].shape[0]} packed rows > graphs.FAST_MAX_ROWS = "
                                                f"{a[6].shape[0] - 1} (eager: graphs pay only at short layouts)")
    assert cache.backend.captures == 0
    with pytest.raises(TypeError, match="must be True or False"):
        with graphs.use_graphs("fast", "yes"):
            pass


def test_a_failed_capture_stays_eager_with_its_reason(model):
    cache = graphs.GraphCache(graphs.FAST, ReplayBackend(fail=True))
    a = _args(model)
    with torch.no_grad():
        truth = model._run_ops(*a)
    outs = [_run(cache, model, a) for _ in range(3)]
    assert all(_equal(o, truth) for o in outs)
    reason = graphs.last_path("fast")["reason"]
    assert reason.startswith("capture failed: RuntimeError: operation not permitted") and "\n" not in reason


def test_the_fast_forward_goes_through_the_graph_path(model):
    kw = dict(zip(ARGS, _args(model)))
    with runtime.use_mode("fast"), fast.use_emulation(), torch.no_grad():
        model(**kw)
    trace = runtime.last_trace()
    assert trace.mode == "fast" and trace.to_dict()["strict"] is False
    assert trace.to_dict()["graph"] == {"cuda_graph": "eager", "reason": "fast emulation (CPU dry run)"}
    with torch.no_grad():
        model(**kw)
    assert "graph" not in runtime.last_trace().to_dict()  # other modes' traces are unchanged
