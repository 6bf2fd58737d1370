"""The LoRA gradient gate (strict, released bf16 base, float32 adapter on every attention and FFN projection, fl2va
with an anchor):

- the adapter factors are the only trainable parameters; their gradients are finite and non-zero (B random, so the
  A factors see a signal); no base parameter receives a gradient; every op of the step ran a strict kernel;
- accuracy: strict LoRA gradients against a float64 truth (the same base and adapter upcast, `off`) within 2x the
  same-precision torch (`off`) error plus 4 float32 ulps of the truth's norm;
- byte-equal LoRA gradients: repeat (the request alone and at batch positions 0, 1 and 2: four computations of
  one request), gradient checkpointing on vs off (the request alone runs checkpointed), and two
  gloo data-parallel ranks vs one process (the gate's batch BA, computed once); torch's usual batched backward of
  the same requests is not the fixed combine (shown where it is cheap, `off`);
- train/rollout (RFC section 1, R/R with a backward taken): the velocity inside a LoRA training step equals the strict
  rollout of the same adapter (applied through `RunSpec.adapters`) at every pass, byte for byte.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lora_cases import ALPHA, RANK, lora_model, randomize_b
from training_cases import (SMALL, batched_torch_gradient, build_model, float64_twin, make_clip, make_layout,
                            rollout_spec)

from strict_testing import assert_error_within
from h3lab.execution import runtime
from h3lab.training import (
    Objective,
    StepResult,
    add_lora,
    adapter_entry,
    adapter_state_dict,
    compute_gradients,
    flow_matching_loss,
    read_adapter,
    remove_lora,
    request_gradient,
    rollout_requests,
    save_adapter,
    trainable_parameters,
)
from h3lab.adapters.field import attached
from h3lab.adapters.lora import load_adapter_weights
from h3lab.training.step import input_leaves, split_flat

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from harness import run_ranks  # noqa: E402

OBJECTIVE = Objective(video_weight=1.0, audio_weight=0.5)


@dataclass
class Gate:
    model: object
    requests: dict
    alone: StepResult
    batches: dict[str, StepResult]


@pytest.fixture(scope="module")
def gate() -> Gate:
    model = lora_model()
    layout = make_layout("fl2va")
    # distinct clips sharing one sigma/noise draw (torch's batched path needs one timestep table per forward)
    requests = {k: make_clip(SMALL, layout, seed=s, draw_seed=9, weight=w)
                for k, s, w in (("A", 201, 1.0), ("B", 202, 0.75))}
    # A alone runs with gradient checkpointing on: against A at position 0 of ABA (off) it is the checkpointing check,
    # one strict LoRA backward less than a separate checkpointed run
    alone = compute_gradients(model, [requests["A"]], OBJECTIVE, keep=True, gradient_checkpointing=True)
    assert model.gradient_checkpointing is False  # restored
    # A at positions 0 and 2 of one batch, at position 1 of the other (BA: also the data-parallel test's one process)
    batches = {o: compute_gradients(model, [requests[k] for k in o], OBJECTIVE, keep=True) for o in ("ABA", "BA")}
    return Gate(model, requests, alone, batches)


def assert_same(got, want, what: str) -> None:
    assert torch.equal(got.loss, want.loss), f"{what}: loss differs"
    assert all(torch.equal(a, b) for a, b in zip(got.velocity, want.velocity)), f"{what}: velocities differ"
    if not torch.equal(got.gradient, want.gradient):
        diff = (got.gradient - want.gradient).abs()
        raise AssertionError(f"{what}: LoRA gradient differs in {int((diff > 0).sum())} of {diff.numel()} values")


def test_lora_gradients_finite_nonzero_base_absent_strict_only(gate):
    params = trainable_parameters(gate.model)
    assert params and all(".lora_A." in n or ".lora_B." in n for n, _ in params)
    grads = split_flat(gate.alone.request_gradients[0].gradient, params)
    for name, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().max() > 0, f"LoRA gradient of {name} is zero or not finite"
    assert all(p.grad is None for p in gate.model.parameters()), "a parameter kept a gradient"
    # a raw backward: only the adapter factors receive gradients, never a base weight
    sample = gate.requests["A"].sample(OBJECTIVE)
    with runtime.use_mode("off"):
        v, a = gate.model(**sample.model_kwargs())
        (v.float().square().mean() + a.float().square().mean()).backward()
    got = {n for n, p in gate.model.named_parameters() if p.grad is not None}
    gate.model.zero_grad(set_to_none=True)
    assert got == {n for n, _ in params}
    summary = gate.alone.trace.to_dict()
    assert summary["non_strict_calls"] == 0 and all(set(b) == {"strict"} for b in summary["ops"].values())
    assert summary["ops"]["gated_residual"]["strict"] >= 12  # the LoRA combines (12 adapted projections) + residuals


def lora_truth(model):
    """The float64 twin of the base with the same adapter, its factors upcast to float64 (exact)."""
    base = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}

    class _Plain:
        config = model.config

        def state_dict(self):
            return base

    twin = float64_twin(_Plain())
    add_lora(twin, RANK, ALPHA)
    load_adapter_weights(twin, adapter_state_dict(model))
    for n, p in twin.named_parameters():
        if ".lora_" in n:
            assert p.dtype == torch.float64, n  # peft placed the factors at the base's dtype
    return twin


def test_lora_gradient_accuracy_against_float64_truth(gate):
    model, request = gate.model, gate.requests["A"]
    sample = request.sample(OBJECTIVE)
    strict = gate.alone.request_gradients[0]
    with runtime.use_mode("off"):
        model.train()
        torch_rg = request_gradient(model, sample, OBJECTIVE)
        model.eval()
    twin = lora_truth(model)
    s64 = dataclasses.replace(sample, video=sample.video.double(), audio=sample.audio.double(),
                              text=sample.text.double())
    kwargs = s64.model_kwargs()
    input_leaves(kwargs)
    with runtime.use_mode("off"):
        v_video, v_audio = twin(**kwargs)
        assert v_video.dtype == torch.float64
        flow_matching_loss(OBJECTIVE, v_video, v_audio, s64).backward()
    truth = {n: p.grad for n, p in twin.named_parameters() if p.requires_grad}
    params = trainable_parameters(model)
    assert [n for n, _ in params] == list(truth)
    ours, theirs = split_flat(strict.gradient, params), split_flat(torch_rg.gradient, params)
    assert not torch.equal(strict.gradient, torch_rg.gradient), "strict and torch agree bytewise: nothing measured"
    for name, _ in params:
        assert_error_within(ours[name], theirs[name], truth[name], f"LoRA gradient {name}")


def test_repeat_checkpointing_and_batch_positions(gate):
    alone = gate.alone.request_gradients[0]  # checkpointed
    aba, ba = gate.batches["ABA"].request_gradients, gate.batches["BA"].request_gradients
    assert_same(aba[0], alone, "gradient checkpointing off (request A at batch position 0) vs on (A alone)")
    for position, rg in ((1, ba[1]), (2, aba[2])):  # with `alone`: four computations of one request
        assert_same(rg, aba[0], f"request A at batch position {position} vs 0")
        assert_same(rg, alone, f"request A at batch position {position} vs alone")
    assert_same(ba[0], aba[1], "request B at positions 0 and 1")
    assert aba[0].digest != aba[1].digest


def test_torch_batched_lora_backward_is_not_the_fixed_combine(gate):
    reqs = [gate.requests[k] for k in "AB"]
    fixed = compute_gradients(gate.model, reqs, OBJECTIVE, mode="off").gradient
    batched = batched_torch_gradient(gate.model, reqs, OBJECTIVE, mode="off")
    assert not torch.equal(fixed, batched)


def _dp_rank(rank: int, world: int, requests: list) -> dict:
    from h3lab.training import data_parallel_gradients

    result = data_parallel_gradients(lora_model(), requests, OBJECTIVE, mode="strict")
    return {"gradient": result.gradient, "loss": result.loss}


def test_two_gloo_ranks_equal_one_process(gate):
    """The batch BA on two data-parallel ranks (one request each, a model rebuilt on each rank) vs the gate's
    one-process strict `compute_gradients` of the same batch."""
    ranks = run_ranks(_dp_rank, 2, [gate.requests[k] for k in "BA"], timeout=600)
    one = gate.batches["BA"]
    for r, out in enumerate(ranks):
        assert torch.equal(out["gradient"], one.gradient), f"rank {r}: LoRA gradient differs from one process"
        assert torch.equal(out["loss"], one.loss), f"rank {r}: loss differs"


def test_lora_train_step_velocity_equals_lora_rollout_at_every_pass(tmp_path):
    """On the gate's SMALL config (one block + one refiner block; the tiny snapshot's 2 + 2 blocks would double
    every strict program), a 2-pass strict rollout of the fl2va layout with the adapter applied by
    `RunSpec.adapters`, then a strict LoRA step over its passes."""
    from h3lab.run.trajectory import record

    model = build_model(SMALL, "released", 45)
    plain = rollout_spec(model, seed=46)
    handle = add_lora(model, 2, 4.0, seed=1)
    randomize_b(model, 12)
    path, digest = save_adapter(model, tmp_path / "adapter")
    remove_lora(model, handle)
    spec = plain.replace(adapters=[adapter_entry(path)])
    assert spec.adapters[0]["sha256"] == digest
    traj = record(spec, model, keep=("latents", "velocities"))
    assert traj.digest != record(plain, model).digest  # the adapter changed the rollout
    with attached(model, read_adapter(path)):
        params = trainable_parameters(model)
        assert params and all(".lora_" in n for n, _ in params)
        result = compute_gradients(model, rollout_requests(traj, weight=0.8), Objective(), mode="strict", keep=True)
    assert len(result.velocities) == traj.inputs.num_passes == 2
    for i, (vv, va) in enumerate(result.velocities):
        assert torch.equal(vv, traj.kept[f"velocity_video.{i:04d}"]), f"pass {i}: video velocity drifted"
        assert torch.equal(va, traj.kept[f"velocity_audio.{i:04d}"]), f"pass {i}: audio velocity drifted"
    for rg in result.request_gradients:  # a backward was taken: every factor got a finite, non-zero gradient
        for name, g in split_flat(rg.gradient, params).items():
            assert torch.isfinite(g).all() and g.abs().max() > 0, name
    assert result.trace.to_dict()["non_strict_calls"] == 0
