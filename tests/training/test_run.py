"""Sealed training runs: N steps run twice give byte-equal weights and manifests (off, and strict at a tiny shape);
seal/load round-trips and `verify` re-runs to OK leaving the model as it was; verify names the first step and tensor
that differ; tampered artifacts, mismatched models and bad configs are refused."""

from __future__ import annotations

import json

import pytest
import torch
from training_cases import SMALL, build_model, make_clip, make_dataset, make_layout

from h3lab.run import sampler
from h3lab.run import DenoiseInputs, RunSpec
from h3lab.run.trajectory import record
from h3lab.training import (
    Objective,
    OptimizerConfig,
    SampleRequest,
    TrainConfig,
    TrainingError,
    load,
    rollout_requests,
    train,
    verify,
)
from h3lab.training.run import request_seed, step_batch

CONFIG = TrainConfig(steps=3, batch_size=2, seed=5, mode="off",
                     optim=OptimizerConfig(lr=1e-2, weight_decay=1e-2), objective=Objective(audio_weight=0.5))


def weights_of(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def off_runs():
    runs, models = [], []
    for _ in range(2):
        model = build_model(SMALL, "released", 31)
        runs.append(train(model, make_dataset(), CONFIG))
        models.append(model)
    return runs, models


def test_run_twice_is_byte_equal(off_runs):
    (a, b), (ma, mb) = off_runs
    assert a.digest == b.digest and a.steps == b.steps and len(a.steps) == 3
    wa, wb = weights_of(ma), weights_of(mb)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    initial = weights_of(build_model(SMALL, "released", 31))
    assert all(not torch.equal(wa[n], initial[n]) for n in wa), "some weight did not train"
    assert all(torch.equal(a.weights[f"final.{n}"], wa[n]) for n in wa)
    assert all(torch.equal(a.weights[f"initial.{n}"], initial[n]) for n in wa)
    # the record: dataset indices wrap, per-step seeds are derived, losses finite and distinct
    assert [[r["index"] for r in s["requests"]] for s in a.steps] == [[0, 1], [2, 0], [1, 2]]
    assert [step_batch(CONFIG, k, 3) for k in range(3)] == [[0, 1], [2, 0], [1, 2]]
    seeds = [r["seed"] for s in a.steps for r in s["requests"]]
    assert seeds[0] == request_seed(5, 0, 0) and len(set(seeds)) == len(seeds)
    m = a.manifest
    assert m["mode"] == "off" and m["hash_scheme"] == "sha256" and m["config"] == CONFIG.to_dict()
    assert [t["name"] for t in m["trainable"]] == list(wa) and len(m["dataset"]) == 3
    assert m["dataset"][1]["kind"] == "clip" and m["dataset"][1]["layout"]["task"] == "ref2va"
    assert set(m["steps"][0]["gradient"]) == set(wa) == set(m["steps"][0]["weights"])
    assert m["trace"]["forwards"] == 6 and m["trace"]["mode"] == "off"


def test_seal_load_verify(off_runs, tmp_path):
    run = off_runs[0][0]
    path = run.seal(tmp_path / "run")
    assert sorted(p.name for p in path.iterdir()) == ["inputs.safetensors", "manifest.json", "weights.safetensors"]
    loaded = load(path)
    assert loaded.digest == run.digest and loaded.config == CONFIG
    assert all(torch.equal(loaded.weights[k], v) for k, v in run.weights.items())
    for x, y in zip(loaded.dataset, run.dataset):
        assert x.layout == y.layout
        assert all(torch.equal(getattr(x, k), getattr(y, k)) for k in ("text", "video", "audio"))
    model = build_model(SMALL, "released", 77)  # other weights: verify puts the run's initial ones in
    before = weights_of(model)
    report = verify(path, model)
    assert report.ok and report.steps_checked == 3 and str(report).startswith("OK: 3/3")
    after = weights_of(model)
    assert all(torch.equal(before[n], after[n]) for n in before), "verify left the model changed"
    assert verify(loaded, model, steps=1).steps_checked == 1
    run.seal(tmp_path / "run")  # re-sealing over an existing run replaces it atomically
    assert load(tmp_path / "run").digest == run.digest


def test_verify_names_the_first_difference(off_runs):
    run = off_runs[0][0]
    model = build_model(SMALL, "released", 31)
    other = make_clip(SMALL, make_layout("ref2va"), seed=99)
    changed = type(run)(run.manifest, [run.dataset[0], other, run.dataset[2]], run.weights)
    report = verify(changed, model)
    assert not report.ok and report.first_step == 0 and report.field == "request 1 (dataset 1) loss"
    assert "DRIFT at step 0" in str(report)
    manifest = json.loads(json.dumps(run.manifest))
    manifest["config"]["lr"] = 2e-2  # same gradients, other update
    report = verify(type(run)(manifest, run.dataset, run.weights), model)
    first = next(iter(run.steps[0]["weights"]))
    assert not report.ok and report.first_step == 0 and report.field == f"weights {first}"


def test_tampered_artifacts_are_refused(off_runs, tmp_path):
    from safetensors.torch import load_file, save_file

    run = off_runs[0][0]
    path = run.seal(tmp_path / "run")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["steps"][1]["loss_sha256"] = "0" * 64
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TrainingError, match="digest does not match"):
        load(path)
    run.seal(path)
    tensors = load_file(str(path / "inputs.safetensors"))
    tensors["0001.video"] = tensors["0001.video"] + 1
    save_file(tensors, str(path / "inputs.safetensors"))
    with pytest.raises(TrainingError, match="'0001.video' does not match"):
        load(path)
    with pytest.raises(TrainingError, match="manifest.json is missing"):
        load(tmp_path / "nowhere")
    run.seal(path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format"] = "h3lab-trajectory/1"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TrainingError, match="is not 'h3lab-training/1'"):
        load(path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainingError, match="not a directory"):
        run.seal(tmp_path / "file")


@pytest.mark.parametrize("key", ["final", "optimizer"])
def test_verify_refuses_stored_tensors_that_are_not_the_sealed_ones(off_runs, tmp_path, key):
    """A final (or optimiser) tensor changed together with its `weights_file` entry loads (the
    entry is not under the steps digest) but must not verify: the last step record sealed its digest."""
    from safetensors.torch import load_file, save_file

    from h3lab.hashing import tensor_digest

    run = off_runs[0][0]
    path = run.seal(tmp_path / "run")
    tensors = load_file(str(path / "weights.safetensors"))
    name = next(k for k in tensors if k.startswith(key + "."))
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(path / "weights.safetensors"))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["weights_file"][name] = tensor_digest(tensors[name], "sha256")
    (path / "manifest.json").write_text(json.dumps(manifest))
    tampered = load(path)  # every tensor matches the (edited) manifest
    model = build_model(SMALL, "released", 31)
    before = weights_of(model)
    rule = f"'{name}' does not match" if key == "final" else "optimizer.* tensors do not match"
    with pytest.raises(TrainingError, match=rule) as err:
        verify(tampered, model)
    assert str(path / "weights.safetensors") in str(err.value) and "\n" not in str(err.value)
    assert all(torch.equal(before[n], p) for n, p in weights_of(model).items())


def test_mismatched_models_and_bad_configs_are_refused(off_runs):
    run = off_runs[0][0]
    frozen = build_model(SMALL, "released", 31)
    frozen.proj_in.weight.requires_grad_(False)
    with pytest.raises(TrainingError, match="trainable parameters differ"):
        verify(run, frozen)
    with pytest.raises(TrainingError, match="steps=4"):
        verify(run, build_model(SMALL, "released", 31), steps=4)
    no_initial = type(run)(run.manifest, run.dataset, {k: v for k, v in run.weights.items()
                                                       if not k.startswith("initial.")})
    model = build_model(SMALL, "released", 32)
    before = weights_of(model)
    with pytest.raises(TrainingError, match="differs from the run's initial weights"):
        verify(no_initial, model)
    assert all(torch.equal(before[n], p) for n, p in weights_of(model).items())
    for kwargs, match in (({"steps": 0}, "steps"), ({"batch_size": 1.5}, "batch_size"), ({"mode": "quick"}, "mode"),
                          ({"lr": -1.0}, "lr"), ({"betas": (0.9,)}, "betas")):
        with pytest.raises(TrainingError, match=match):
            optim = {k: kwargs.pop(k) for k in ("lr", "betas") if k in kwargs}
            TrainConfig(**{"steps": 1, "batch_size": 1, **kwargs}, optim=OptimizerConfig(**optim))
    with pytest.raises(TrainingError, match="dataset is empty"):
        train(model, [], CONFIG)
    with pytest.raises(TrainingError, match="must be a ClipRequest or SampleRequest"):
        train(model, ["clip"], CONFIG)


def test_strict_run_twice_is_byte_equal(tmp_path):
    """Strict at a tiny shape: 2 steps of one request; `verify` is the second run (every hash compared)."""
    config = TrainConfig(steps=2, batch_size=1, seed=1, mode="strict",
                         optim=OptimizerConfig(lr=1e-2, weight_decay=1e-2))
    model = build_model(SMALL, "released", 41)
    run = train(model, [make_clip(SMALL, make_layout("fl2va"), seed=4)], config, keep_initial=False)
    assert run.manifest["trace"]["non_strict_calls"] == 0 and run.manifest["trace"]["mode"] == "strict"
    assert "initial.proj_in.weight" not in run.weights
    path = run.seal(tmp_path / "strict")
    report = verify(path, build_model(SMALL, "released", 41))  # a fresh model at the run's initial weights
    assert report.ok and report.steps_checked == 2 and report.fingerprint_match, str(report)


def test_rollout_dataset_round_trip(tmp_path):
    model = build_model(SMALL, "float32", 51)
    layout = make_layout("fl2va")
    schedule = sampler.DualSchedule.from_passes(2)
    clip = make_clip(SMALL, layout, seed=6)
    inputs = DenoiseInputs.from_layout(layout, schedule, clip.text, clip.video, clip.audio)
    traj = record(RunSpec(inputs, schedule, mode="off"), model, keep=("latents",))
    data = rollout_requests(traj, weight=0.5)
    config = TrainConfig(steps=1, batch_size=2, mode="off", optim=OptimizerConfig(lr=1e-3, weight_decay=1e-2))
    run = train(build_model(SMALL, "float32", 51), data, config)
    assert [r["seed"] for r in run.steps[0]["requests"]] == [None, None]
    assert run.manifest["dataset"][1]["origin"] == {"kind": "rollout", "trajectory": traj.digest, "pass": 1, "item": 0}
    loaded = load(run.seal(tmp_path / "rl"))
    for x, y in zip(loaded.dataset, data):
        assert isinstance(x, SampleRequest) and x.weight == 0.5
        for name, t in y.fixed.tensors().items():
            assert torch.equal(x.fixed.tensors()[name], t), name
    assert verify(loaded, build_model(SMALL, "float32", 51)).ok
