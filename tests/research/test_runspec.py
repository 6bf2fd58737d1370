"""`RunSpec`: JSON round trip and a stable hash; extension fields fail closed until a room provides them, and a
provided one is validated, applied for the run, sealed and replayed; custom callables make a spec unsealable (verify
refuses it); factors as declarative transforms (canonical order, refused combinations, a layout they need); a
manifest from before run specs still loads and verifies."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3lab.run import trajectory as T
from h3lab.research.ablation import AblationError, make_inputs, tiny_bench
from h3lab.config import H3Config
from h3lab.run.layout import build_layout
from h3lab.run import FIELDS, Custom, FieldProvider, RunSpec, RunSpecError, denoise, register_field, resolve
from h3lab.run.sampler import DualSchedule

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return tiny_bench(str(tiny_snapshot))


def small_spec(**changes) -> RunSpec:
    """A seeded spec that needs no model: the bench's fl2va layout on the tiny config, 2 passes."""
    cfg = H3Config.tiny()
    layout = build_layout("fl2va", torch.ones(5, dtype=torch.long), 2, 4, 4, 3, anchors=("first",),
                          patch_size=cfg.patch_size)
    schedule = DualSchedule.build(3)
    return RunSpec(make_inputs(cfg, layout, schedule, seed=4), schedule, layout=layout, **changes)


SMALL_SPEC_SHA = """
import sys; sys.path.insert(0, {tests!r})
from test_runspec import small_spec
print(small_spec(mode="strict", factors=("H5", "A2"), reuse=2).sha256)
"""


def test_json_round_trip_rebuilds_the_same_spec(bench):
    spec = bench.spec("off").replace(factors=("H5", "A2"), reuse=2, reuse_mode="hold", label="round trip")
    data = json.loads(json.dumps(spec.to_dict()))  # through text: nothing but JSON in the description
    tensors = {k: v.clone() for k, v in spec.tensors().items()}
    again = RunSpec.from_dict(data, tensors)
    assert again.sha256 == spec.sha256 and again.to_dict() == spec.to_dict()
    assert again.factors == ("A2", "H5") and (again.reuse, again.reuse_mode) == (2, "hold")
    assert again.layout == bench.layout and again.schedule == bench.schedule and again.label == "round trip"
    for name, t in spec.inputs.tensors().items():
        assert torch.equal(again.inputs.tensors()[name], t)
    tensors["text"] = tensors["text"].clone()
    tensors["text"].view(-1)[0] += 1.0
    with pytest.raises(RunSpecError, match="'text'"):
        RunSpec.from_dict(data, tensors)


def test_the_hash_is_stable_and_covers_every_field():
    spec = small_spec(mode="strict", factors=("H5", "A2"), reuse=2)
    # the same content in another process: the same hash (no addresses, no set order, no time)
    tests = os.path.join(REPO, "tests", "research")
    out = subprocess.run([sys.executable, "-c", SMALL_SPEC_SHA.format(tests=tests)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", REPO)})
    assert out.stdout.strip().splitlines()[-1] == spec.sha256
    # what is not identity: label, object, factor order, device copy
    assert spec.replace(label="x").sha256 == spec.sha256 == small_spec(mode="strict", factors=("A2", "H5"),
                                                                       reuse=2).sha256
    assert spec.to("cpu").sha256 == spec.sha256
    changed = [spec.replace(mode="off"), spec.replace(factors=("A2",)), spec.replace(reuse=3),
               spec.replace(reuse_mode="hold"), spec.replace(stepper="negated_velocity"),
               spec.replace(variant="transformer_ref"), spec.replace(fingerprint="weights:0"),
               spec.replace(layout=None), spec.replace(inputs=spec.inputs.replace(seeds={"request": 5})),
               spec.with_custom(hooks=(lambda p, t: None,))]
    text = spec.inputs.text.clone()
    text.view(-1)[7] = -text.view(-1)[7]
    changed.append(spec.replace(inputs=spec.inputs.replace(text=text)))
    hashes = {s.sha256 for s in changed}
    assert len(hashes) == len(changed) and spec.sha256 not in hashes


@pytest.mark.parametrize("field, value", [
    ("placement", {"tp": 2}),
    ("adapters", [{"name": "style", "sha256": "0" * 64, "scale": 1.0}]),
])
def test_extension_fields_fail_closed_without_a_provider(field, value, monkeypatch):
    # Simulate a room that provides nothing: withdraw the registered provider (the real ones -- training, presets,
    # distributed -- register when imported) and point the lazy import at a module that does not exist.
    monkeypatch.setitem(FIELDS.modules, field, "h3lab._no_such_provider_module")
    withdrawn = FIELDS.unregister(field)
    try:
        assert FIELDS.get(field) is None
        with pytest.raises(RunSpecError, match=rf"no provider is registered for RunSpec\.{field}"):
            small_spec(**{field: value})
        assert getattr(small_spec(**{field: None}), field) == getattr(small_spec(), field)  # None is the default
    finally:
        if withdrawn is not None:
            FIELDS.register(field, withdrawn)


def test_extension_values_must_be_json_of_the_right_kind():
    with pytest.raises(RunSpecError, match="must be JSON"):
        small_spec(preset={"table": torch.ones(2)})
    with pytest.raises(RunSpecError, match="finite"):
        small_spec(placement={"tp": float("nan")})
    with pytest.raises(RunSpecError, match="must be an object"):
        small_spec(preset=[1, 2])
    with pytest.raises(RunSpecError, match="must be an array"):
        small_spec(adapters={"name": "x"})
    with pytest.raises(RunSpecError, match="stepper 'rk4'"):
        small_spec(stepper="rk4")
    with pytest.raises(RunSpecError, match="reuse=0"):
        small_spec(reuse=0)
    with pytest.raises(RunSpecError, match="mode 'turbo'"):
        small_spec(mode="turbo")


def test_a_registered_provider_is_validated_applied_sealed_and_replayed(bench, tmp_path):
    """A stand-in for the speed-preset room: validates its value, and for the run's duration wraps the forward
    (counting calls) and scales the returned velocities -- so the preset changes the trajectory, and a replay that
    did not apply it would drift."""
    events = []

    def validate(value):
        if set(value) != {"velocity_scale"} or not isinstance(value["velocity_scale"], (int, float)):
            raise RunSpecError(f"preset={value!r}: must be {{'velocity_scale': number}}")
        return {"velocity_scale": float(value["velocity_scale"])}

    @contextlib.contextmanager
    def apply(value, run):
        scale, inner = value["velocity_scale"], run.forward
        events.append("enter")

        def forward(model, inputs, video, audio, i):
            events.append("forward")
            v, a = inner(model, inputs, video, audio, i)
            return v * scale, a * scale

        try:
            yield run.replace(forward=forward)
        finally:
            events.append("exit")

    FIELDS.get("preset")  # imports h3lab.presets, the field's provider; the stand-in replaces it for this test
    room = FIELDS.unregister("preset")
    register_field("preset", FieldProvider(validate=validate, apply=apply))
    try:
        with pytest.raises(RunSpecError, match="velocity_scale"):
            bench.spec("off").replace(preset={"speed": 2})
        spec = bench.spec("off").replace(preset={"velocity_scale": 2})
        assert dict(spec.preset) == {"velocity_scale": 2.0}
        traj = T.record(spec, bench.model)
        assert events == ["enter", "forward", "forward", "exit"]
        plain = T.record(bench.spec("off"), bench.model)
        assert traj.digest != plain.digest and traj.manifest["spec"]["preset"] == {"velocity_scale": 2.0}
        report = T.verify(traj.seal(tmp_path / "preset"), bench.model)
        assert report.ok and report.replay_digest == traj.digest and events.count("enter") == 2
    finally:
        FIELDS.unregister("preset")
    try:
        with pytest.raises(T.TrajectoryError, match="no provider is registered for RunSpec.preset"):
            T.load(tmp_path / "preset")  # once the room is gone, the sealed preset fails closed
    finally:
        if room is not None:
            register_field("preset", room)


def test_custom_callables_make_a_spec_unsealable_and_verify_refuses_it(bench, tmp_path):
    def hook(point, t):
        return t * 2 if point.name == "video_out" else None

    spec = bench.spec("off").with_custom(hooks=(hook,))
    assert not spec.sealable and spec.to_dict()["custom"] == {"overrides": [], "hooks": 1, "stepper": None}
    traj = T.record(spec, bench.model)
    assert traj.digest != T.record(bench.spec("off"), bench.model).digest and not traj.manifest["spec"]["sealable"]
    loaded = T.load(traj.seal(tmp_path / "custom"))
    assert loaded.spec.sha256 == spec.sha256 and not loaded.spec.custom.runnable
    with pytest.raises(T.TrajectoryError, match="custom callables"):
        T.verify(loaded, bench.model)
    with pytest.raises(RunSpecError, match="never sealed"):
        denoise(loaded.spec, bench.model)
    # a factor cannot silently replace a custom override of the same op
    with pytest.raises(RunSpecError, match="op:rope, which a custom override already changes"):
        denoise(bench.spec("off").with_custom(overrides={"rope": lambda x, c, s: x}).with_factors("H5"), bench.model)


def test_factors_are_canonical_and_refuse_what_cannot_compose(bench):
    spec = bench.spec("off")
    assert spec.with_factors("H16", "H5", "A2").factors == ("H16", "A2", "H5")  # model changes first
    with pytest.raises(AblationError, match="H6: changes op:rms_norm, which A2 changes too"):
        spec.with_factors("A2", "H6")
    with pytest.raises(AblationError, match="plan, which H3 changes too"):
        spec.with_factors("H3", "H10")
    with pytest.raises(AblationError, match="H1 permutes the packed rows: switch it on alone"):
        spec.with_factors("H1", "H2")
    with pytest.raises(AblationError, match=r"\['H15'\]: must be among"):
        spec.with_factors("H15")
    with pytest.raises(AblationError, match="given twice"):
        spec.with_factors("H5", "H5")
    with pytest.raises(AblationError, match="carries no layout"):
        denoise(spec.replace(layout=None, factors=("H10",)), bench.model)
    with pytest.raises(RunSpecError, match="pass models="):
        denoise(spec.with_factors("H16"), bench.model)


def test_factors_are_rederived_on_every_resolve(bench):
    """H4 keeps state in its closures: every resolve builds fresh ones, so two runs of one spec are byte-equal."""
    spec = bench.spec("off").with_factors("H4", "H2")
    a, b = T.record(spec, bench.model), T.record(spec, bench.model)
    assert a.digest == b.digest != T.record(bench.spec("off"), bench.model).digest
    with resolve(spec, bench.model) as run:
        assert set(run.changed) == {"op:modulate", "op:gated_residual", "token_tags"} and len(run.hooks) == 1
        assert not torch.equal(run.inputs.token_tags, spec.inputs.token_tags)
    assert run.spec is spec and spec.inputs.token_tags is bench.inputs.token_tags  # the spec itself is untouched


def test_a_manifest_from_before_run_specs_loads_and_verifies(bench, tmp_path):
    path = T.record(bench.spec("off").replace(reuse=2), bench.model).seal(tmp_path / "legacy")
    manifest = json.loads((path / T.MANIFEST).read_text())
    for key in ("spec", "result_sha256", "run_record"):
        del manifest[key]
    manifest["run"]["stepper"] = "ScheduleStepper"
    hashes = manifest["inputs"]["sha256"]
    manifest["inputs"]["sha256"] = {k: v for k, v in hashes.items() if not k.startswith("layout.")}
    tensors = {k: v for k, v in load_file(str(path / T.INPUTS_FILE)).items() if not k.startswith("layout.")}
    save_file(tensors, str(path / T.INPUTS_FILE))
    (path / T.MANIFEST).write_text(json.dumps(manifest))
    legacy = T.load(path)
    assert legacy.spec.reuse == 2 and legacy.spec.layout is None and legacy.spec.sealable
    assert T.verify(legacy, bench.model).ok
    manifest["meta"] = {"settings": {"ablations": ["H5"]}}  # its factors were not sealed by name: refused
    (path / T.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(T.TrajectoryError, match="custom callables"):
        T.verify(path, bench.model)
