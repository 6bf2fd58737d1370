"""The consistency gate of the GRPO step (training side), on the CPU under the Triton interpreter.

- strict: a rollout of G = 2 requests batched through the one loop on the `flow_sde` stepper (request 1 at batch
  position 0; the trajectory records every pass's per-request log-density), every pass an SDE pass, replayed one
  request at a time by the training forward (grad on, gradient checkpointing on, LoRA with random B factors):
  exp(logp_train - logp_rollout) == 1.0 exactly for every pass, request and modality at the first inner epoch;
- off: the torch training forward over the same strict rollout reports its deviation (not zero: shown here), and
  over its own batched rollout the deviation it measures on this CPU;
- after an update (adapter B = 0 at the start, so the policy *is* the adapter-off reference): the KL is exactly 0 at
  epoch 0 and > 0 after, the ratio moves off 1 and the 1e-4 clip engages;
- a sealed run re-runs byte for byte (`grpo_run.verify`) and a tampered record is named.
"""

import math

import pytest
import torch

from grpo_cases import rollout_batch, sde_trajectory, small_setup
from lora_cases import lora_model
from training_cases import SMALL, build_model

from h3lab.training import OptimizerConfig, TrainingError, add_lora, trainable_parameters
from h3lab.training.grpo import PassSelection
from h3lab.training.grpo_run import grpo_train, load, verify
from h3lab.training.grpo_step import GrpoConfig, grpo_iteration

REWARDS = [0.3, -0.4]


@pytest.fixture(scope="module")
def strict_case():
    model = lora_model(seed=43)
    layout, schedule, inputs = small_setup(group=2, passes=2, seed=4)
    trajectory = sde_trajectory(model, layout, schedule, inputs, "strict", seed=9, requests=[1, 0])
    return model, layout, schedule, inputs, trajectory


def one_epoch(model, batch, mode, **kw):
    cfg = GrpoConfig(group=2, mode=mode, optim=OptimizerConfig(lr=1e-3), **kw)
    before = {n: p.detach().clone() for n, p in trainable_parameters(model)}
    record = grpo_iteration(model, batch, cfg, cfg.optimizer(trainable_parameters(model)))
    with torch.no_grad():  # put the adapter back for the next test
        for n, p in trainable_parameters(model):
            p.copy_(before[n])
    return record["epochs"][0]


def test_strict_on_policy_ratio_is_exactly_one(strict_case):
    model, _, _, _, trajectory = strict_case
    epoch = one_epoch(model, rollout_batch(trajectory, REWARDS), "strict", gradient_checkpointing=True)
    assert [(it["request"], it["pass"]) for it in epoch["items"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for it in epoch["items"]:
        for m in ("video", "audio"):
            assert it[m]["ratio"] == 1.0, (it["request"], it["pass"], m, it[m]["ratio"])
            assert math.isfinite(it[m]["logp"]) and not it[m]["clipped"]
    assert epoch["ratio"]["exactly_one"] == epoch["ratio"]["count"] == 8 and epoch["clipped"] == 0


def test_off_reports_its_deviation(strict_case):
    model, layout, schedule, inputs, trajectory = strict_case
    mixed = one_epoch(model, rollout_batch(trajectory, REWARDS), "off")["ratio"]
    print(f"\noff training over the strict rollout: ratio - 1 in [{mixed['min']:.3g}, {mixed['max']:.3g}], "
          f"mean {mixed['mean']:.3g}, {mixed['exactly_one']}/{mixed['count']} exactly 1")
    assert mixed["exactly_one"] < mixed["count"] and 0 < mixed["max_abs"] < 1e-2
    own = sde_trajectory(model, layout, schedule, inputs, "off", seed=9, requests=[1, 0])
    off = one_epoch(model, rollout_batch(own, REWARDS), "off")["ratio"]
    print(f"off training over its own batched rollout (this CPU): max |ratio - 1| = {off['max_abs']:.3g}, "
          f"{off['exactly_one']}/{off['count']} exactly 1")
    assert off["count"] == 8 and math.isfinite(off["max_abs"])


@pytest.fixture(scope="module")
def off_run():
    model = build_model(SMALL, "released", 5)
    add_lora(model, 2, 4.0, seed=2)  # B = 0: the policy starts equal to the adapter-off reference
    layout, schedule, inputs = small_setup(group=2, passes=2, seed=6)

    def rollout(k, m):
        return rollout_batch(sde_trajectory(m, layout, schedule, inputs, "off", seed=k, requests=[0, 1]), REWARDS)

    cfg = GrpoConfig(group=2, mode="off", beta=0.04, inner_epochs=2, optim=OptimizerConfig(lr=1e-2),
                     selection=PassSelection("fraction", fraction=0.5), seed=3)
    return model, grpo_train(model, rollout, cfg, 1, reward="test")


def test_update_moves_the_ratio_engages_the_clip_and_the_kl(off_run):
    _, run = off_run
    first, second = run.iterations[0]["epochs"]
    assert len(first["items"]) == 2  # one of the two passes per request (fraction 0.5)
    assert first["ratio"]["exactly_one"] == first["ratio"]["count"]
    assert first["kl"] == [0.0] * 4 and first["clipped"] == 0
    assert second["ratio"]["exactly_one"] == 0 and second["ratio"]["max_abs"] > 1e-4
    assert second["clipped"] > 0 and all(kl > 0 for kl in second["kl"])
    assert run.manifest["adapter"]["initial_sha256"] != run.manifest["adapter"]["final_sha256"]


def test_sealed_run_verifies_and_names_a_tampered_record(off_run, tmp_path):
    model, run = off_run
    loaded = load(run.seal(tmp_path / "run"))
    assert loaded.config == run.config and loaded.digest == run.digest
    report = verify(loaded, model)
    assert report.ok, str(report)
    loaded.manifest["iterations"][0]["epochs"][1]["items"][1]["audio"]["ratio"] = 0.5
    report = verify(loaded, model)
    assert not report.ok and report.field == "epochs[1].items[1].audio.ratio" and report.expected == 0.5
    (tmp_path / "run" / "manifest.json").write_text((tmp_path / "run" / "manifest.json").read_text().replace(
        '"reward": "test"', '"reward": "test2"'))
    load(tmp_path / "run")  # the reward name is not a record: still loads
    text = (tmp_path / "run" / "manifest.json").read_text()
    (tmp_path / "run" / "manifest.json").write_text(text.replace('"advantages": [', '"advantages": [0.0, ', 1))
    with pytest.raises(TrainingError, match="digest does not match"):
        load(tmp_path / "run")


@pytest.mark.parametrize("key", ["final", "optimizer"])
def test_verify_refuses_stored_tensors_that_are_not_the_sealed_ones(off_run, tmp_path, key):
    """The artifact base: a stored final weight or optimiser tensor that is not what the last
    epoch record sealed is refused before anything re-runs, naming it."""
    model, run = off_run
    loaded = load(run.seal(tmp_path / "run"))
    name = next(k for k in loaded.weights if k.startswith(key + "."))
    loaded.weights[name] = loaded.weights[name] + 1e-3
    with pytest.raises(TrainingError, match="stored tensor 'final." if key == "final" else "optimizer.. tensors"):
        verify(loaded, model)


def test_config_refusals():
    for kw, msg in ((dict(kind="sde"), "GrpoConfig.kind='sde'"), (dict(group=1), "group=1"),
                    (dict(clip_range=0.0), "clip_range=0.0"), (dict(beta=-1.0), "beta=-1.0"),
                    (dict(inner_epochs=0), "inner_epochs=0"), (dict(importance_cap=0), "importance_cap=0"),
                    (dict(mode="fast2"), "mode='fast2'"), (dict(mode="fast"), "needs the strict contract")):
        with pytest.raises(TrainingError, match=msg) as err:
            GrpoConfig(**kw)
        assert "\n" not in str(err.value)
    cfg = GrpoConfig(importance_cap=2.0, selection=PassSelection("window", start=1, size=1))
    assert GrpoConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TrainingError, match="carries none"):
        grpo_iteration(build_model(SMALL, "released", 1), None, GrpoConfig(beta=0.1), None)


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(tmp_path):
    layout, schedule, inputs = small_setup(group=2, passes=1, seed=8)
    cfg = GrpoConfig(group=2, mode="off", inner_epochs=1, optim=OptimizerConfig(lr=1e-2))

    def fresh():
        model = build_model(SMALL, "released", 9)
        add_lora(model, 2, 4.0, seed=1)
        return model

    def rollout(k, m):
        return rollout_batch(sde_trajectory(m, layout, schedule, inputs, "off", seed=k, requests=[0, 1]),
                             [0.1 * k, -0.2])

    whole = grpo_train(fresh(), rollout, cfg, 2)

    class Stop(Exception):
        pass

    def stop_after_first(k, record, run):
        run.seal(tmp_path / "ckpt")
        raise Stop

    with pytest.raises(Stop):
        grpo_train(fresh(), rollout, cfg, 2, on_iteration=stop_after_first)
    resumed = grpo_train(fresh(), rollout, cfg, 2, resume=load(tmp_path / "ckpt"))
    assert resumed.digest == whole.digest
    assert all(torch.equal(resumed.weights[k], whole.weights[k]) for k in whole.weights)
    with pytest.raises(TrainingError, match="nothing to resume"):
        grpo_train(fresh(), rollout, cfg, 1, resume=load(tmp_path / "ckpt"))


def test_a_weighted_sum_logs_its_parts_per_request_and_iteration(tmp_path):
    layout, schedule, inputs = small_setup(group=2, passes=1, seed=10)
    model = build_model(SMALL, "released", 11)
    add_lora(model, 2, 4.0, seed=3)
    parts = [{"name": "a", "weight": 1.0, "values": [0.5, 0.25], "mean": 0.375},
             {"name": "b", "weight": 0.1, "values": [1.0, 2.0], "mean": 1.5}]

    def rollout(k, m):
        batch = rollout_batch(sde_trajectory(m, layout, schedule, inputs, "off", seed=k, requests=[0, 1]),
                              [0.6, 0.45])
        return type(batch)(batch.transitions, batch.sde, batch.rewards, batch.origin, parts)

    run = grpo_train(model, rollout, GrpoConfig(group=2, mode="off", optim=OptimizerConfig(lr=1e-2)), 1, reward="a:1.0,b:0.1")
    assert run.iterations[0]["reward_parts"] == parts
    loaded = load(run.seal(tmp_path / "run"))
    assert loaded.batches[0].parts == parts and verify(loaded, model).ok
    plain = grpo_train(model, lambda k, m: rollout_batch(
        sde_trajectory(m, layout, schedule, inputs, "off", seed=k, requests=[0, 1]), [0.6, 0.45]),
        GrpoConfig(group=2, mode="off", optim=OptimizerConfig(lr=1e-2)), 1)
    assert "reward_parts" not in plain.iterations[0]  # one reward: the record is as it always was
