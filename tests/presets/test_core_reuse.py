"""Core reuse: the patch projections, norm_out and heads run every pass, the block stack only on the core passes; a
reused pass's stream entering norm_out is its own patch projection plus the residual the stack added on the last
core pass (taken from an independent plain run); exclusive with whole-velocity reuse; a pass whose core never ran
fails closed."""

import pytest
import torch
from preset_cases import Calls, deep_model, fl2va_layout, spec_for

from h3lab.presets import PresetError, core_plan
from h3lab.run import denoise, resolve
from h3lab.schema.generation_settings import GenerationSettings


def _capture(model):
    """Per pass: the stream entering block 0 and the stream entering norm_out (pre-hooks registered before a run,
    so they see what the model passes, before any preset hook of the run changes it)."""
    seen = {"in": {}, "head": {}}

    def at(kind):
        def hook(_m, args):
            seen[kind][model.hook_context["step"]] = args[0].detach().clone()

        return hook

    handles = [model.transformer_blocks[0].register_forward_pre_hook(at("in")),
               model.norm_out.register_forward_pre_hook(at("head"))]
    return seen, handles


def test_projections_and_heads_every_pass_the_stack_on_core_passes():
    model = deep_model(4)
    spec = spec_for(model, fl2va_layout(), passes=6, preset={"core_reuse": 3})
    modules = {"proj_in": model.proj_in, "audio_proj_in": model.audio_proj_in, "norm_out": model.norm_out,
               "proj_out": model.proj_out, "audio_proj_out": model.audio_proj_out}
    modules |= {f"b{i}": b.attn for i, b in enumerate(model.transformer_blocks)}
    calls = Calls(model, modules)
    try:
        denoise(spec, model)
    finally:
        calls.remove()
    plan = core_plan(6, 3)
    assert plan == (True, False, False, True, False, True)
    for step, core in enumerate(plan):
        want = {name: 1 for name in ("proj_in", "audio_proj_in", "norm_out", "proj_out", "audio_proj_out")}
        want |= {f"b{i}": 1 for i in range(4)} if core else {}
        assert calls.at(step) == want, step
    assert "forward" not in model.transformer_blocks[2].__dict__  # restored


def test_a_reused_pass_adds_the_last_core_residual_to_its_own_projection():
    model = deep_model(4)
    layout = fl2va_layout()
    seen_plain, handles = _capture(model)
    try:
        denoise(spec_for(model, layout, passes=3), model)
    finally:
        for h in handles:
            h.remove()
    seen, handles = _capture(model)
    try:
        video, _ = denoise(spec_for(model, layout, passes=3, preset={"core_reuse": 2}), model)
    finally:
        for h in handles:
            h.remove()
    # Pass 0 runs the core in both runs: identical. Pass 1 reuses pass 0's residual on its own patch projection.
    assert torch.equal(seen["in"][0], seen_plain["in"][0]) and torch.equal(seen["head"][0], seen_plain["head"][0])
    residual = seen_plain["head"][0].float() - seen_plain["in"][0].float()
    assert not torch.equal(seen["in"][1], seen["in"][0])  # the latents moved: a fresh projection
    # What the model hands norm_out on pass 1 is x_in (every block skipped); the preset substitutes x_in + R.
    assert torch.equal(seen["head"][1], seen["in"][1])
    captured = {}

    def after(_m, args, _out):  # a forward hook that returns None: it only looks
        captured[model.hook_context["step"]] = args[0].clone()

    h = model.norm_out.register_forward_hook(after)
    try:
        denoise(spec_for(model, layout, passes=3, preset={"core_reuse": 2}), model)
    finally:
        h.remove()
    assert torch.equal(captured[1], (seen["in"][1].float() + residual).to(captured[1].dtype))
    assert torch.equal(captured[0], seen_plain["head"][0])


def test_exclusive_with_whole_velocity_reuse():
    model = deep_model(4)
    with pytest.raises(PresetError, match="mutually exclusive") as err:
        denoise(spec_for(model, fl2va_layout(), passes=4, preset={"core_reuse": 2}, reuse=2), model)
    assert "\n" not in str(err.value)
    with pytest.raises(PresetError, match="core_reuse=2 with reuse=3: --core-reuse and --reuse are mutually"):
        GenerationSettings(core_reuse=2, reuse=3)
    GenerationSettings(core_reuse=6, reuse=1)
    with pytest.raises(PresetError, match="between 1 and 6"):
        GenerationSettings(core_reuse=7)


def test_a_pass_whose_core_never_ran_fails_closed():
    model = deep_model(4)
    spec = spec_for(model, fl2va_layout(), passes=4, preset={"core_reuse": 2})
    with torch.no_grad(), resolve(spec, model) as run:
        with pytest.raises(PresetError, match="pass 1 reuses the block-stack residual"):
            run.forward(model, run.inputs, run.inputs.video, run.inputs.audio, 1)
        run.forward(model, run.inputs, run.inputs.video, run.inputs.audio, 0)
        run.forward(model, run.inputs, run.inputs.video, run.inputs.audio, 1)  # now there is one
