"""The switchable epilogue fusions (`runtime.use_fusions`: `qk_norm_rope`, `residual_norm_modulate`) in the model:
off by default; switched on, a strict forward and its gradients are the unfused forward's bytes while the trace
shows the fused ops; a registered hook, an override or a replaced norm module runs the unfused ops, so every hook
point fires; bad fusion names are refused in one line."""

import pytest
import torch
from model_cases import CONFIGS, random_state_dict, small_case, weighted_loss
from torch import nn

from h3lab import H3Transformer
from h3lab.execution import context, runtime

FUSED = ("qk_norm_rope", "residual_norm_modulate")


def build(policy="released", seed=0):
    model = H3Transformer(CONFIGS["tiny"], dtype_policy=policy)
    model.load_state_dict(random_state_dict(CONFIGS["tiny"], seed))
    return model


def run(model, inputs, mode="strict", fusions=()):
    with torch.no_grad(), runtime.use_mode(mode), runtime.use_fusions(fusions):
        out = model(**inputs)
    return out, runtime.last_trace()


def ops_of(trace):
    return [(r.op, r.point) for r in trace.records]


def same(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def case():
    model = build()
    inputs = small_case(model.config, batch=2)
    return model, inputs, run(model, inputs)


def test_off_by_default_and_the_trace_of_the_unfused_forward(case):
    model, inputs, (out, trace) = case
    assert runtime.current_fusions() == frozenset()
    points = ops_of(trace)
    assert ("rms_norm", "blocks.0.q_norm") in points and ("rope", "blocks.0.q_rope") in points
    assert ("gated_residual", "blocks.0.residual1") in points
    assert not {op for op, _ in points} & set(FUSED)


@pytest.mark.parametrize("fusions", [("qk_norm_rope",), ("residual_norm_modulate",), FUSED], ids="+".join)
def test_strict_fused_forward_is_the_unfused_bytes(case, fusions):
    model, inputs, (base, _) = case
    out, trace = run(model, inputs, fusions=fusions)
    assert same(out, base)
    assert all(r.actual == "strict" for r in trace.records)
    points = ops_of(trace)
    blocks = len(model.transformer_blocks)
    for i in range(blocks):
        p = f"blocks.{i}."
        if "qk_norm_rope" in fusions:
            assert ("qk_norm_rope", p + "q_rope") in points and ("rms_norm", p + "q_norm") not in points
            assert ("rope", p + "k_rope") not in points
        if "residual_norm_modulate" in fusions:
            assert ("residual_norm_modulate", p + "modulate2") in points
            assert ("gated_residual", p + "residual1") not in points and ("norm_modulate", p + "modulate2") not in points
    # the refiner has no RoPE and no AdaLN: its norms and residuals stay as they are
    assert ("rms_norm", "refiner.0.q_norm") in points and ("add", "refiner.0.residual1") in points


def test_off_mode_fused_reference_is_the_reference_sequence(case):
    model, inputs, _ = case
    base, _ = run(model, inputs, mode="off")
    out, trace = run(model, inputs, mode="off", fusions=FUSED)
    assert same(out, base) and ("qk_norm_rope", "blocks.0.q_rope") in ops_of(trace)


def test_a_hook_forces_the_unfused_path_and_every_point_fires(case):
    model, inputs, (base, _) = case
    seen = []
    handle = model.add_hook(lambda point, t: seen.append(point.name),
                            names=["blocks.0.q_norm", "blocks.0.k_rope", "blocks.1.residual1", "blocks.1.norm2"])
    try:
        out, trace = run(model, inputs, fusions=FUSED)
    finally:
        handle.remove()
    assert same(out, base)
    assert seen == ["blocks.0.q_norm", "blocks.0.k_rope", "blocks.1.residual1", "blocks.1.norm2"]
    assert not {op for op, _ in ops_of(trace)} & set(FUSED)


def test_an_override_or_a_replaced_norm_keeps_the_ops_apart(case):
    model, inputs, (base, _) = case
    rope = runtime.mode_op("rope")
    with runtime.use_overrides({"rope": lambda x, c, s: rope(x, c, s)}):
        out, trace = run(model, inputs, fusions=FUSED)
    points = ops_of(trace)
    assert same(out, base) and ("qk_norm_rope", "blocks.0.q_rope") not in points
    assert ("residual_norm_modulate", "blocks.0.modulate2") in points  # rope is not one of its ops

    block = model.transformer_blocks[1]
    original, norm_k = block.norm2, block.attn.norm_k

    class Wrapped(nn.Module):
        def forward(self, x):
            return original(x)

    block.norm2, block.attn.norm_k = Wrapped(), nn.Identity()
    try:
        _, trace = run(model, inputs, fusions=FUSED)
    finally:
        block.norm2, block.attn.norm_k = original, norm_k
    points = ops_of(trace)
    assert ("rms_norm", "blocks.1.norm2") in points and ("gated_residual", "blocks.1.residual1") in points
    assert ("rope", "blocks.1.k_rope") in points and ("qk_norm_rope", "blocks.0.q_rope") in points


def test_strict_fused_gradients_are_the_unfused_bytes():
    model = build()
    inputs = small_case(model.config, batch=1)

    def grads(fusions):
        x = {k: (v.clone().requires_grad_() if k.endswith("hidden_states") and v.is_floating_point() else v)
             for k, v in inputs.items()}
        model.zero_grad(set_to_none=True)
        with runtime.use_mode("strict"), runtime.use_fusions(fusions):
            video, audio = model(**x)
        weighted_loss(video, audio, 0).backward()
        out = {k: p.grad.clone() for k, p in model.named_parameters()}
        out.update({k: x[k].grad.clone() for k in x if k.endswith("hidden_states")})
        return out

    base, fused = grads(()), grads(FUSED)
    assert base.keys() == fused.keys()
    for key in base:
        assert torch.equal(base[key], fused[key]), key


def test_fast_mode_keeps_its_own_producers():
    """Fast mode serves the unfused ops with its own fused FP8 producers: a switched-on fusion does not apply there."""
    table = runtime.Ops("fast", runtime.Trace(mode="fast", device=""), record=False)
    with runtime.use_fusions(FUSED):
        assert not runtime.Ops("fast", runtime.Trace(mode="fast", device=""), record=False).fuses("qk_norm_rope")
        assert runtime.Ops("strict", runtime.Trace(mode="strict", device=""), record=False).fuses("qk_norm_rope")
    assert not table.fuses("qk_norm_rope")


def test_fusion_names_are_checked():
    with pytest.raises(ValueError, match=r"fusion\(s\) \['swiglu_gemm'\]: must be among qk_norm_rope, "):
        with runtime.use_fusions(["swiglu_gemm"]):
            pass
    with pytest.raises(ValueError, match="fusions='qk_norm_rope': must be a collection of fusion names"):
        runtime.check_fusions("qk_norm_rope")
    with runtime.use_fusions(["qk_norm_rope"]) as on:
        assert on == runtime.current_fusions() == {"qk_norm_rope"}
        # The fusions are a field of the one execution context: a captured graph's signature sees the switch.
        assert context.current().fusions == ("qk_norm_rope",)
        on_digest = context.current().digest()
    assert context.current().fusions == () and context.current().digest() != on_digest
