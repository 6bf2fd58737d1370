"""The gradient gate of the strict training step (one process, released bf16 policy, fl2va with an anchor):

- every trainable parameter, the input latents (video, audio) and the text conditions get finite, non-zero
  gradients, through strict kernels only;
- accuracy: the strict per-request gradients' error against a float64 truth (same weights and inputs upcast, `off`)
  is at most ~2x the same-policy torch (`off`) error (`assert_error_within`);
- byte-equal per-request gradients: repeat, the same request alone and inside a batch at positions 0, 1 and 2,
  gradient checkpointing on vs off (H-C6), a consistent permutation of the packed rows (`PackedLayout.permute` +
  `key_order`); the batch gradient is the declared tree of the per-request gradients over n;
- and where the contract could not hold without the step's design: the raw strict backward of a permuted layout
  has byte-equal velocities and input gradients but other weight-gradient bytes (reductions over packed rows in
  packed order — why the step canonicalises), and torch's usual batched backward (off and strict) is neither the
  fixed-order combination nor independent of the batch order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from training_cases import SMALL, batched_torch_gradient, build_model, float64_twin, make_clip, make_layout

from strict_testing import assert_error_within
from h3lab.execution import runtime
from h3lab.training import (
    ClipRequest,
    Objective,
    StepResult,
    StrictAdamW,
    TrainingError,
    compute_gradients,
    flow_matching_loss,
    request_gradient,
    train_step,
    trainable_parameters,
    tree_sum,
)
from h3lab.training.step import input_leaves, split_flat

OBJECTIVE = Objective(video_weight=1.0, audio_weight=0.5)
ROTATIONS = ("ABC", "CAB", "BCA")  # every request at every position


@dataclass
class Gate:
    model: object
    layout: object
    requests: dict[str, ClipRequest]
    alone: StepResult
    rotations: dict[str, StepResult]
    checkpointed: StepResult
    permuted: StepResult
    permuted_request: ClipRequest


@pytest.fixture(scope="module")
def gate() -> Gate:
    model = build_model(SMALL, "released", 21).eval()
    layout = make_layout("fl2va")
    # distinct clips and weights sharing one sigma/noise draw, so torch's batched path can run them as one forward
    requests = {k: make_clip(SMALL, layout, seed=s, draw_seed=9, weight=w)
                for k, s, w in (("A", 101, 1.0), ("B", 102, 0.75), ("C", 103, 1.25))}
    alone = compute_gradients(model, [requests["A"]], OBJECTIVE, keep=True, input_grads=True)
    rotations = {o: compute_gradients(model, [requests[k] for k in o], OBJECTIVE, keep=True) for o in ROTATIONS}
    checkpointed = compute_gradients(model, [requests["A"]], OBJECTIVE, keep=True, input_grads=True,
                                     gradient_checkpointing=True)
    assert model.gradient_checkpointing is False and not model.training  # restored
    perm = torch.randperm(layout.sequence_length, generator=torch.Generator().manual_seed(5))
    a = requests["A"]
    permuted_request = ClipRequest(layout.permute(perm), a.text, a.video, a.audio, seed=a.seed, weight=a.weight)
    permuted = compute_gradients(model, [permuted_request], OBJECTIVE, keep=True, input_grads=True)
    return Gate(model, layout, requests, alone, rotations, checkpointed, permuted, permuted_request)


def assert_same_request(got, want, what: str, inputs: bool = False) -> None:
    assert torch.equal(got.loss, want.loss), f"{what}: loss differs"
    assert all(torch.equal(a, b) for a, b in zip(got.velocity, want.velocity)), f"{what}: velocities differ"
    if not torch.equal(got.gradient, want.gradient):
        diff = (got.gradient - want.gradient).abs()
        raise AssertionError(f"{what}: gradient differs in {int((diff > 0).sum())} of {diff.numel()} values "
                             f"(max {float(diff.max()):.3e})")
    if inputs:
        for k in want.inputs:
            assert torch.equal(got.inputs[k], want.inputs[k]), f"{what}: input gradient {k} differs"


def test_every_gradient_is_finite_and_nonzero_through_strict_kernels(gate):
    rg = gate.alone.request_gradients[0]
    params = trainable_parameters(gate.model)
    assert len(params) == len(list(gate.model.parameters()))  # full-parameter training: every parameter
    grads = split_flat(rg.gradient, params)
    for name, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().max() > 0, f"gradient of {name} is zero or not finite"
    assert set(rg.inputs) == {"video", "audio", "text"}
    for name, g in rg.inputs.items():
        assert torch.isfinite(g).all(), name
        assert (g.abs().amax(dim=-1) > 0).all(), f"some {name} input row has a zero gradient"  # conditioning rows too
    summary = gate.alone.trace.to_dict()
    assert summary["mode"] == "strict" and summary["forwards"] == 1 and summary["non_strict_calls"] == 0
    assert all(set(backends) == {"strict"} for backends in summary["ops"].values()), summary["ops"]


def truth_gradients(model, sample, objective):
    """float64 gradients of every parameter and input of one request (the truth)."""
    twin = float64_twin(model)
    s64 = dataclasses.replace(sample, video=sample.video.double(), audio=sample.audio.double(),
                              text=sample.text.double())
    kwargs = s64.model_kwargs()
    leaves = input_leaves(kwargs)
    with runtime.use_mode("off"):
        v_video, v_audio = twin(**kwargs)
        assert v_video.dtype == torch.float64
        flow_matching_loss(objective, v_video, v_audio, s64).backward()
    grads = {n: p.grad for n, p in twin.named_parameters()}
    return grads, {k: x.grad for k, x in leaves.items()}


def test_gradient_accuracy_against_float64_truth(gate):
    """Every parameter, input-latent and text-condition gradient: strict error <= 2 x torch error (same released
    policy) + 4 float32 ulps of the truth's norm, against the float64 truth."""
    model, request = gate.model, gate.requests["A"]
    sample = request.sample(OBJECTIVE)
    strict = gate.alone.request_gradients[0]
    with runtime.use_mode("off"):
        model.train()
        torch_rg = request_gradient(model, sample, OBJECTIVE, input_grads=True)
        model.eval()
    truth, truth_inputs = truth_gradients(model, sample, OBJECTIVE)
    params = trainable_parameters(model)
    ours, theirs = split_flat(strict.gradient, params), split_flat(torch_rg.gradient, params)
    assert not torch.equal(strict.gradient, torch_rg.gradient), "strict and torch agree bytewise: nothing measured"
    for name, _ in params:
        assert_error_within(ours[name], theirs[name], truth[name], f"gradient {name}")
    for name in ("video", "audio", "text"):
        assert_error_within(strict.inputs[name], torch_rg.inputs[name], truth_inputs[name], f"input gradient {name}")


def test_request_alone_and_at_every_batch_position(gate):
    alone = gate.alone.request_gradients[0]
    per = {}
    for order, result in gate.rotations.items():
        assert len(result.request_gradients) == 3
        for position, key in enumerate(order):
            rg = result.request_gradients[position]
            assert result.request_digests[position] == rg.digest
            per.setdefault(key, []).append((position, rg))
        # the batch gradient and loss are the declared tree over the batch, divided by n
        assert torch.equal(result.gradient, tree_sum([rg.gradient for rg in result.request_gradients]) / 3)
        assert torch.equal(result.loss, tree_sum([rg.loss for rg in result.request_gradients]) / 3)
    for key, seen in per.items():
        assert sorted(p for p, _ in seen) == [0, 1, 2]
        for position, rg in seen[1:]:
            assert_same_request(rg, seen[0][1], f"request {key} at position {position} vs {seen[0][0]}")
    for position, rg in per["A"]:
        assert_same_request(rg, alone, f"request A at position {position} vs alone")
    assert per["A"][0][1].digest != per["B"][0][1].digest != per["C"][0][1].digest


def test_checkpointing_on_off(gate):
    assert_same_request(gate.checkpointed.request_gradients[0], gate.alone.request_gradients[0],
                        "gradient checkpointing on vs off", inputs=True)


def test_consistent_packed_row_permutation(gate):
    permuted_layout = gate.permuted_request.layout
    assert permuted_layout.key_order() is not None and not torch.equal(permuted_layout.token_tags,
                                                                       gate.layout.token_tags)
    assert_same_request(gate.permuted.request_gradients[0], gate.alone.request_gradients[0],
                        "consistent permutation of the packed rows", inputs=True)


def test_raw_permuted_backward_differs_in_weight_gradients(gate):
    """Without the step's canonicalisation: the strict forward of the permuted layout (with its key_order) gives the
    same velocities and input gradients, but weight gradients reduce over packed rows in packed order."""
    model, sample = gate.model, gate.permuted_request.sample(OBJECTIVE)
    assert sample.key_order is not None
    kwargs = sample.model_kwargs()
    leaves = input_leaves(kwargs)
    params = trainable_parameters(model)
    model.zero_grad(set_to_none=True)
    with runtime.use_mode("strict"):
        v_video, v_audio = model(**kwargs)
        flow_matching_loss(OBJECTIVE, v_video, v_audio, sample).backward()
    raw = {n: p.grad.float() for n, p in params}
    model.zero_grad(set_to_none=True)
    canon = gate.alone.request_gradients[0]
    assert torch.equal(v_video.detach(), canon.velocity[0]) and torch.equal(v_audio.detach(), canon.velocity[1])
    for name, x in leaves.items():
        assert torch.equal(x.grad, canon.inputs[name]), name
    ours = split_flat(canon.gradient, params)
    differ = [n for n in raw if not torch.equal(raw[n], ours[n])]
    assert differ, "the raw permuted backward matched: the step's canonicalisation would be unneeded"


def test_torch_batched_backward_is_not_the_fixed_combine(gate):
    """Torch's usual path (one stacked forward — H3 takes one timestep table per forward, so the gate's requests share
    a sigma draw — the mean loss, one backward) is not the fixed-order combination of the per-request gradients and
    changes with the batch order, in `off` and in strict mode alike (the strict dW reduction runs over all rows of
    the batch). On CPU the `off` forward itself happens to be batch-invariant at these sizes; its gradient is not."""
    model, reqs = gate.model, gate.requests
    for mode in ("off", "strict"):
        if mode == "off":
            fixed = {o: compute_gradients(model, [reqs[k] for k in o], OBJECTIVE, mode="off").gradient
                     for o in ROTATIONS[:2]}
        else:
            fixed = {o: gate.rotations[o].gradient for o in ROTATIONS[:2]}
        batched = {o: batched_torch_gradient(model, [reqs[k] for k in o], OBJECTIVE, mode=mode) for o in ROTATIONS[:2]}
        for o in ROTATIONS[:2]:
            assert not torch.equal(fixed[o], batched[o]), f"{mode} {o}"
        assert not torch.equal(batched["ABC"], batched["CAB"]), mode


def test_train_step_updates_only_trainable_parameters():
    model = build_model(SMALL, "released", 22)
    layout = make_layout("fl2va")
    frozen = {n for n, _ in model.named_parameters() if n.startswith(("token_refiner", "proj_in"))}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = trainable_parameters(model)
    assert {n for n, _ in params} == set(before) - frozen and params
    optimizer = StrictAdamW(params, lr=1e-2)
    reqs = [make_clip(SMALL, layout, seed=s) for s in (1, 2)]
    result = train_step(model, reqs, OBJECTIVE, optimizer, mode="off")
    assert result.gradient.shape == (sum(p.numel() for _, p in params),)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]) == (n in frozen), n
        assert p.grad is None, f"{n}.grad left behind"
    assert optimizer.step_count == 1


def test_bad_steps_raise():
    model = build_model(SMALL, "float32", 23).eval()
    layout = make_layout("fl2va")
    with pytest.raises(TrainingError, match="at least one request"):
        compute_gradients(model, [], OBJECTIVE, mode="off")
    with pytest.raises(TrainingError, match="mode='fast-ish'"):
        compute_gradients(model, [make_clip(SMALL, layout, seed=1)], OBJECTIVE, mode="fast-ish")
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(TrainingError, match="no trainable parameters"):
        compute_gradients(model, [make_clip(SMALL, layout, seed=1)], OBJECTIVE, mode="off")
    assert not model.training
