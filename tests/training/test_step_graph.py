"""The strict training micro-batch through `h3lab.training.step_graph` on the CPU, with a backend that "replays" by
running the captured body again on the graph's static buffers under a no-host-read guard (what a stream capture
refuses) -- so the signature, buffer, pin and fallback logic runs here; the real capture runs on the H200
(benchmarks/benchmark_lora.py --step-graph).

- steps through the graph path (warm-up, capture, replays) give the eager strict step's loss, velocity and gradient
  bytes at every step, across optimiser updates of the LoRA factors (the graph reads them by address);
- a new layout, request weight or frozen weight written in place is a new signature (a new warm-up); the factors'
  in-place updates are not;
- ineligible calls (mode off, input gradients, a custom loss, a hook, graphs off, too many rows) and a capture that
  fails run eager and say why; the capture runs with the checkpoints' RNG state off; bad settings raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from lora_cases import lora_model
from training_cases import SMALL, make_clip, make_layout

from h3lab.execution import context
from h3lab.model import transformer
from h3lab.training import Objective, StrictAdamW, compute_gradients, step_graph, trainable_parameters
from h3lab.training.step import request_gradient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strict"))
from graph_fakes import ReplayBackend, no_host_reads  # noqa: E402

OBJECTIVE = Objective(video_weight=1.0, audio_weight=0.5)


def guarded():
    """No host reads, and the checkpoints must not touch the RNG state (torch refuses it during a capture)."""
    @contextlib.contextmanager
    def guard():
        assert context.current().checkpoint_rng is False
        with no_host_reads():
            yield
    return guard


@pytest.fixture()
def graphs(monkeypatch):
    cache = step_graph.StepGraphs(ReplayBackend(guard=guarded()), device_ok=lambda: True)
    monkeypatch.setattr(step_graph, "GRAPHS", cache)
    return cache


@pytest.fixture(scope="module")
def case():
    layout = make_layout("fl2va")
    return layout, make_clip(SMALL, layout, seed=101, draw_seed=9, weight=1.0)


def steps(request, n: int, graphs_on: bool, model=None):
    """n strict steps (gradients, then an AdamW update of the LoRA factors) from a fresh model: per step the
    (loss, gradient, velocity) and the path the micro-batch took."""
    model = model or lora_model()
    optimizer = StrictAdamW(trainable_parameters(model), lr=1e-2, weight_decay=0.0)
    out = []
    with step_graph.use_graphs(graphs_on):
        for _ in range(n):
            result = compute_gradients(model, [request], OBJECTIVE, gradient_checkpointing=True)
            out.append((result.loss, result.gradient, result.velocities[0], step_graph.last_path()))
            optimizer.step(result.gradient)
    return out


def test_graph_steps_equal_eager_steps_over_updates(graphs, case):
    _, request = case
    eager = steps(request, 4, False)
    graphed = steps(request, 4, True)
    assert [p["cuda_graph"] for *_, p in eager] == ["eager"] * 4
    assert "disabled" in eager[0][3]["reason"]
    assert [p["cuda_graph"] for *_, p in graphed] == ["eager", "captured", "replay", "replay"]
    assert "warm-up" in graphed[0][3]["reason"]
    assert graphs.backend.captures == 1 and len(graphs) == 1
    for i, ((l0, g0, v0, _), (l1, g1, v1, _)) in enumerate(zip(eager, graphed)):
        assert torch.equal(l0, l1), f"step {i}: loss differs"
        assert torch.equal(g0, g1), f"step {i}: gradient differs"
        assert all(torch.equal(a, b) for a, b in zip(v0, v1)), f"step {i}: velocity differs"
    assert not torch.equal(eager[0][1], eager[3][1])  # the updates moved the factors: the steps differ


def test_replay_outputs_are_copies_and_trace_says_replay(graphs, case):
    _, request = case
    model = lora_model()
    params = trainable_parameters(model)
    results = []
    with step_graph.use_graphs(True):
        for _ in range(3):
            results.append(compute_gradients(model, [request], OBJECTIVE, gradient_checkpointing=True))
    first, third = results[0], results[2]
    assert torch.equal(first.gradient, third.gradient)  # no update in between
    third.gradient.add_(1.0)  # a caller's write never reaches the graph's buffers
    with step_graph.use_graphs(True):
        again = compute_gradients(model, [request], OBJECTIVE, gradient_checkpointing=True)
    assert torch.equal(again.gradient, first.gradient)
    other = make_clip(SMALL, case[0], seed=102, draw_seed=10)  # same layout, other data: copied into the buffers
    with step_graph.use_graphs(True):
        replayed = compute_gradients(model, [other], OBJECTIVE, gradient_checkpointing=True)
    assert step_graph.last_path()["cuda_graph"] == "replay"
    with step_graph.use_graphs(False):
        want = compute_gradients(model, [other], OBJECTIVE, gradient_checkpointing=True)
    assert torch.equal(replayed.gradient, want.gradient) and not torch.equal(want.gradient, first.gradient)
    assert third.trace.to_dict()["non_strict_calls"] == 0
    assert third.trace.forwards == 1 and third.trace.untraced == 0
    assert all(p.grad is None for _, p in params)


def test_signature_changes_warm_up_again(graphs, case):
    layout, request = case
    model = lora_model()
    params = trainable_parameters(model)

    def path(req):
        with step_graph.use_graphs(True), transformer.checkpoint_rng_state(True):
            compute_gradients(model, [req], OBJECTIVE, gradient_checkpointing=True)
        return step_graph.last_path()["cuda_graph"]

    assert [path(request) for _ in range(3)] == ["eager", "captured", "replay"]
    heavier = dataclasses.replace(request, weight=0.75)  # a constant of the loss
    assert [path(heavier) for _ in range(2)] == ["eager", "captured"]
    ref2va = make_clip(SMALL, make_layout("ref2va"), seed=101, draw_seed=9)  # another layout
    assert path(ref2va) == "eager"
    with torch.no_grad():
        params[0][1].add_(0.5)  # a trainable factor updated in place: the same graph
    assert path(request) == "replay"
    base = next(p for n, p in model.named_parameters() if not p.requires_grad and p.is_floating_point())
    with torch.no_grad():
        base.mul_(1.5)  # a frozen weight written in place: a new signature
    assert path(request) == "eager"
    assert step_graph.last_path()["reason"].startswith("first call")


def test_ineligible_calls_run_eager_and_say_why(graphs, case, monkeypatch):
    _, request = case
    model = lora_model()
    params = trainable_parameters(model)
    sample = request.sample(OBJECTIVE)

    def reason(**kwargs):
        with step_graph.use_graphs(True), runtime_mode(kwargs.pop("mode", "strict")):
            model.train()
            request_gradient(model, sample, OBJECTIVE, params, **kwargs)
        path = step_graph.last_path()
        assert path["cuda_graph"] == "eager"
        return path["reason"]

    assert reason(mode="off").startswith("runtime mode 'off'")
    assert reason(input_grads=True) == "input gradients asked for"
    assert reason(loss_fn=lambda v, a, s: (v * v).sum()) == "a custom loss (loss_fn)"
    handle = model.add_hook(lambda point, t: None)
    assert reason() == "an h3lab hook is registered"
    handle.remove()
    monkeypatch.setattr(step_graph, "MAX_ROWS", 8)
    assert reason().startswith(f"{sample.position_ids.shape[0]} packed rows > step_graph.MAX_ROWS = 8")
    monkeypatch.undo()
    cpu = step_graph.StepGraphs(ReplayBackend())  # the default device rule: CUDA only
    monkeypatch.setattr(step_graph, "GRAPHS", cpu)
    assert reason() == "inputs not on a CUDA device"
    assert graphs.backend.captures == 0 and cpu.backend.captures == 0


def test_failed_capture_stays_eager_with_the_same_bytes(monkeypatch, case):
    _, request = case
    failing = step_graph.StepGraphs(ReplayBackend(fail=True), device_ok=lambda: True)
    monkeypatch.setattr(step_graph, "GRAPHS", failing)
    eager = steps(request, 3, False)
    graphed = steps(request, 3, True)
    assert [p["cuda_graph"] for *_, p in graphed] == ["eager"] * 3
    assert graphed[1][3]["reason"].startswith("capture failed: RuntimeError: operation not permitted")
    assert graphed[2][3]["reason"] == graphed[1][3]["reason"]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(eager, graphed))


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="max_graphs=0"):
        step_graph.StepGraphs(max_graphs=0)
    with pytest.raises(TypeError, match="must be True or False"):
        with step_graph.use_graphs("yes"):
            pass
    with pytest.raises(TypeError, match="must be True or False"):
        with transformer.checkpoint_rng_state(1):
            pass


@contextlib.contextmanager
def runtime_mode(mode: str):
    from h3lab.execution import runtime

    with runtime.use_mode(mode):
        yield


def test_layouts_cycling_past_max_graphs_leave_the_dropped_one_eager(monkeypatch, case):
    _, request = case
    cache = step_graph.StepGraphs(ReplayBackend(guard=guarded()), max_graphs=1, device_ok=lambda: True)
    monkeypatch.setattr(step_graph, "GRAPHS", cache)
    other = make_clip(SMALL, make_layout("ref2va"), seed=101, draw_seed=9)
    model = lora_model()
    paths = []
    with step_graph.use_graphs(True):
        for req in (request, other, request, other, request, other):
            got = compute_gradients(model, [req], OBJECTIVE, gradient_checkpointing=True)
            paths.append(step_graph.last_path())
            with step_graph.use_graphs(False):
                want = compute_gradients(model, [req], OBJECTIVE, gradient_checkpointing=True)
            assert torch.equal(got.gradient, want.gradient)
    assert [p["cuda_graph"] for p in paths] == ["eager", "eager", "captured", "captured", "eager", "replay"]
    assert "dropped for another signature" in paths[4]["reason"] and "max_graphs = 1" in paths[4]["reason"]
    assert cache.backend.captures == 2 and len(cache) == 1


def test_train_progress_line_says_graph_when_the_step_replayed(monkeypatch):
    import io

    from h3lab.frontends.train import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = Progress(tty, width=4)
    step_graph.set_eager("inputs not on a CUDA device")
    bar(1, 2, {"loss": 0.5})
    monkeypatch.setattr(step_graph, "last_path", lambda: {"cuda_graph": "replay", "replays": 3})
    bar(2, 2, {"loss": 0.25})
    first, second = tty.getvalue().split("\r")[1:]
    assert first.startswith("train [##..] 1/2 loss 0.5 ") and first.rstrip().endswith("s/step")
    assert second.startswith("train [####] 2/2 loss 0.25 ") and second.rstrip().endswith("s/step graph")

