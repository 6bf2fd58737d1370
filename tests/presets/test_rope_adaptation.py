"""The 256x256 RoPE adaptation: the session's preset at exactly 256x256 halves the h and w rotary coordinates the
model receives (time untouched), --use-reference-rope keeps the released ones, other sizes carry no rope key, and
halving anywhere else is refused."""

import types

import pytest
import torch
from preset_cases import deep_model, spec_for

from h3lab.run.layout import build_layout
from h3lab.presets import PresetError, preset_for
from h3lab.run import denoise
from h3lab.schema.generation_settings import GenerationSettings


def _layout(latent: int):
    return build_layout("fl2va", torch.ones(3, dtype=torch.long), 1, latent, latent, 2, anchors=("last",))


def _positions(model, spec):
    """The position_ids the model is called with, per pass, and the positions its rope module receives."""
    seen = {"model": [], "rope": []}
    h1 = model.register_forward_pre_hook(lambda _m, _a, kw: seen["model"].append(kw["position_ids"].clone()),
                                         with_kwargs=True)
    h2 = model.rope.register_forward_pre_hook(lambda _m, args: seen["rope"].append(args[0].clone()))
    try:
        denoise(spec, model)
    finally:
        h1.remove()
        h2.remove()
    return seen


def _settings(**kw):
    return types.SimpleNamespace(layers=None, core_reuse=1, token_reduction=False, reference_rope=False, **kw)


def test_at_256_the_spatial_coordinates_are_halved():
    model = deep_model(2)
    layout = _layout(16)
    assert preset_for(_settings(), model, layout) == {"rope": "halved"}
    assert preset_for(_settings(), model, _layout(8)) == {} == preset_for(_settings(), model, _layout(32))
    assert preset_for(types.SimpleNamespace(**{**vars(_settings()), "reference_rope": True}), model, layout) == {
        "rope": "reference"}
    full = layout.position_ids
    halved = _positions(model, spec_for(model, layout, passes=2, preset={"rope": "halved"}))
    reference = _positions(model, spec_for(model, layout, passes=2, preset={"rope": "reference"}))
    plain = _positions(model, spec_for(model, layout, passes=2))
    for p in range(2):
        got = halved["model"][p]
        assert torch.equal(got[:, 0], full[:, 0])  # time
        assert torch.equal(got[:, 1:], full[:, 1:] * 0.5)  # h and w of every row (anchor, target, audio)
        assert torch.equal(halved["rope"][p], got.to(torch.float32))
        assert torch.equal(reference["model"][p], full) and torch.equal(plain["model"][p], full)
    assert float(full[:, 1:].abs().max()) > 0  # the check is not vacuous


def test_halving_is_defined_only_at_256():
    model = deep_model(2)
    with pytest.raises(PresetError, match="defined at exactly 256x256") as err:
        denoise(spec_for(model, _layout(8), passes=1, preset={"rope": "halved"}), model)
    assert "\n" not in str(err.value)
    with pytest.raises(PresetError, match="rope='reference'"):
        denoise(spec_for(model, _layout(8), passes=1, preset={"rope": "reference"}), model)
    note = GenerationSettings(reference_rope=True).notices[-1]
    assert note.startswith("notice: --use-reference-rope changes nothing at 512x512")
