"""Training-path invariants: gradient checkpointing on/off gives identical outputs and gradients (both dtype
policies, with and without a perturbing hook), a grad-enabled forward equals a no-grad forward byte for byte, and
the checkpoint replay neither duplicates the trace nor hides itself from hooks."""

import pytest
import torch
from model_cases import CONFIGS, random_state_dict, small_case, weighted_loss

from h3lab import H3Transformer
from h3lab.execution import runtime


def build(config, policy, seed=0):
    model = H3Transformer(config, dtype_policy=policy)
    model.load_state_dict(random_state_dict(config, seed))
    return model


def forward_backward(model, inputs, seed=0):
    x = {k: (v.clone().requires_grad_() if k.endswith("hidden_states") and v.is_floating_point() else v)
         for k, v in inputs.items()}
    model.zero_grad(set_to_none=True)
    video, audio = model(**x)
    weighted_loss(video, audio, seed).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    grads.update({k: x[k].grad.clone() for k in x if k.endswith("hidden_states")})
    return (video.detach(), audio.detach()), grads


@pytest.mark.parametrize("policy", ["released", "float32"])
@pytest.mark.parametrize("name", ["tiny", "h1d24"])
def test_checkpointing_on_off_identical_outputs_and_gradients(policy, name):
    config = CONFIGS[name]
    model = build(config, policy)
    inputs = small_case(config, batch=2, seed=4, text_dtype=torch.bfloat16 if policy == "released" else torch.float32)
    model.gradient_checkpointing = False
    out_plain, grads_plain = forward_backward(model, inputs)
    n_records = len(runtime.last_trace().records)
    model.gradient_checkpointing = True
    out_ckpt, grads_ckpt = forward_backward(model, inputs)
    assert len(runtime.last_trace().records) == n_records, "the checkpoint replay appended to the trace"
    model.gradient_checkpointing = False
    assert all(torch.equal(a, b) for a, b in zip(out_plain, out_ckpt))
    assert grads_plain.keys() == grads_ckpt.keys()
    for key in grads_plain:
        assert torch.equal(grads_plain[key], grads_ckpt[key]), key
    assert any(g.abs().max() > 0 for g in grads_plain.values())


def test_checkpoint_replay_reapplies_perturbations_and_flags_recompute():
    config = CONFIGS["tiny"]
    model = build(config, "float32", seed=1)
    inputs = small_case(config, batch=1, seed=2)
    flags = []

    def perturb(point, tensor):
        flags.append((point.name, model.recomputing, model.hook_context["step"]))
        return tensor * 1.5

    handle = model.add_hook(perturb, names=["blocks.1.swiglu", "refiner.0.q"])
    model.hook_context = {"step": 0}
    out_plain, grads_plain = forward_backward(model, inputs)
    assert flags == [("refiner.0.q", False, 0), ("blocks.1.swiglu", False, 0)]
    flags.clear()
    model.gradient_checkpointing = True
    x = {k: (v.clone().requires_grad_() if k.endswith("hidden_states") else v) for k, v in inputs.items()}
    model.zero_grad(set_to_none=True)
    model.hook_context = {"step": 1}
    video, audio = model(**x)
    model.hook_context = {"step": 2}  # the loop moved on; the replay must still see step 1
    weighted_loss(video, audio, 0).backward()
    out_ckpt = (video.detach(), audio.detach())
    grads_ckpt = {k: p.grad for k, p in model.named_parameters()}
    grads_ckpt.update({k: x[k].grad for k in x if k.endswith("hidden_states")})
    model.gradient_checkpointing = False
    handle.remove()
    assert flags[:2] == [("refiner.0.q", False, 1), ("blocks.1.swiglu", False, 1)]
    assert set(flags[2:]) == {("refiner.0.q", True, 1), ("blocks.1.swiglu", True, 1)}, flags
    assert not model.recomputing and model.hook_context == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(out_plain, out_ckpt))
    for key in grads_plain:
        assert torch.equal(grads_plain[key], grads_ckpt[key]), key


@pytest.mark.parametrize("policy", ["released", "float32"])
def test_grad_forward_equals_no_grad_forward(policy):
    config = CONFIGS["tiny"]
    model = build(config, policy, seed=3)
    inputs = small_case(config, batch=3, seed=5)
    with torch.no_grad():
        ref = model(**inputs)
    for checkpointing in (False, True):
        model.gradient_checkpointing = checkpointing
        out = model(**inputs)
        assert out[0].requires_grad and out[1].requires_grad
        assert all(torch.equal(a.detach(), b) for a, b in zip(out, ref)), f"checkpointing={checkpointing}"
    model.gradient_checkpointing = False
