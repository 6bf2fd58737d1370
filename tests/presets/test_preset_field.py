"""The `RunSpec.preset` field: h3lab.presets provides it (validation with one-line errors, normalisation to the
default), each preset is deterministic (two runs, one digest), sealed and replayed exactly by `verify`, in `off`
and -- every preset at once, and the RoPE halving -- in `strict`."""

import pytest
import torch
from preset_cases import deep_model, fl2va_layout, spec_for

from h3lab import presets
from h3lab.run import trajectory as T
from h3lab.run.layout import build_layout
from h3lab.presets import PresetError
from h3lab.run import FIELDS

SMALL_TR = {"start": 1, "end": 3, "early_end": 4, "early_evaluations": 1}


def test_the_presets_room_provides_the_field():
    assert FIELDS.get("preset").validate is presets.validate_preset


@pytest.mark.parametrize("value, rule", [
    ({"speed": 2}, "preset key 'speed': must be one of layers, blocks, core_reuse, token_reduction, rope"),
    ({"layers": 0}, "layers=0: must be a positive integer"),
    ({"layers": True}, "layers=True: must be a positive integer"),
    ({"layers": "45"}, "layers='45': must be a positive integer"),
    ({"blocks": [0, 1]}, "blocks without layers"),
    ({"layers": 2, "blocks": [1, 0]}, "distinct non-negative indices in increasing order"),
    ({"layers": 3, "blocks": [0, 1]}, "lists 2 blocks, layers=3"),
    ({"core_reuse": 7}, "core_reuse=7: must be an integer between 1 and 6"),
    ({"core_reuse": 0}, "core_reuse=0"),
    ({"token_reduction": {"start": 1}}, "token_reduction=.*must be true, false or"),
    ({"token_reduction": 1}, "must be true, false or"),
    ({"rope": "double"}, "rope='double': must be one of halved, reference"),
])
def test_bad_values_are_refused_when_the_spec_is_built(value, rule):
    model = deep_model(2)
    with pytest.raises(PresetError, match=rule) as err:
        spec_for(model, fl2va_layout(), passes=1, preset=value)
    assert "\n" not in str(err.value)


def test_defaults_normalise_away():
    model = deep_model(2)
    plain = spec_for(model, fl2va_layout(), passes=1)
    spec = spec_for(model, fl2va_layout(), passes=1, preset={"core_reuse": 1, "token_reduction": False})
    assert dict(spec.preset) == {} and spec.sha256 == plain.sha256
    tr = spec_for(model, fl2va_layout(), passes=1, preset={"token_reduction": True})
    assert dict(tr.preset["token_reduction"]) == presets.DEFAULT_SCHEDULE  # the schedule is sealed, not `true`


def _cases(model):
    native = build_layout("t2va", torch.ones(3, dtype=torch.long), 1, 16, 16, 2)
    return {
        "layers": (fl2va_layout(), {"layers": 5, "blocks": list(presets.choose_blocks(model, 5))}),
        "core_reuse": (fl2va_layout(), {"core_reuse": 2}),
        "token_reduction": (fl2va_layout(), {"token_reduction": SMALL_TR}),
        "rope": (native, {"rope": "halved"}),
        "all": (fl2va_layout(), {"layers": 5, "core_reuse": 3, "token_reduction": SMALL_TR}),
    }


@pytest.mark.parametrize("name", ["layers", "core_reuse", "token_reduction", "rope", "all"])
def test_each_preset_is_deterministic_sealed_and_verified(name, tmp_path):
    model = deep_model(6)
    layout, preset = _cases(model)[name]
    spec = spec_for(model, layout, passes=3, preset=preset)
    a, b = T.record(spec, model), T.record(spec, model)
    assert a.digest == b.digest != T.record(spec_for(model, layout, passes=3), model).digest
    sealed = T.load(a.seal(tmp_path / name))
    assert sealed.spec.sha256 == a.spec.sha256 and sealed.manifest["spec"]["preset"] == presets.validate_preset(preset)
    report = T.verify(sealed, model)
    assert report.ok and report.replay_digest == a.digest, str(report)


@pytest.mark.slow
def test_presets_under_strict_two_runs_one_digest_and_verify(tmp_path):
    """Every preset of one run at once (layer thinning, core reuse, token reduction), then the RoPE halving: strict
    kernels through Triton's interpreter, so small. The second run is `verify`'s replay: byte-equal to the first."""
    model = deep_model(5)
    layout = build_layout("t2va", torch.ones(3, dtype=torch.long), 1, 2, 6, 1)
    preset = {"layers": 4, "blocks": list(presets.choose_blocks(model, 4)), "core_reuse": 2,
              "token_reduction": SMALL_TR}
    a = T.record(spec_for(model, layout, passes=3, mode="strict", preset=preset), model)
    backends = {backend for ops in a.manifest["trace"]["ops"].values() for backend in ops}
    assert backends == {"strict"}
    report = T.verify(T.load(a.seal(tmp_path / "all")), model)
    assert report.ok and report.replay_digest == a.digest and report.mode == "strict"
    two = deep_model(2, refiner=1)
    native = build_layout("t2va", torch.ones(2, dtype=torch.long), 1, 16, 16, 1)
    a = T.record(spec_for(two, native, passes=1, mode="strict", preset={"rope": "halved"}), two)
    report = T.verify(T.load(a.seal(tmp_path / "rope")), two)
    assert report.ok and report.replay_digest == a.digest
