"""Training under a GPU-memory budget: the frozen blocks stream through device slots in the forward and again in the
backward's recomputation (gradient checkpointing), the LoRA factors and the optimiser state stay resident. Losses,
gradients, weights and the sealed run's digest are byte-equal to the resident run's, in strict and in off; a
streamed model refuses to train without checkpointing; `h3lab train --gpu-memory` and `h3lab train grpo
--gpu-memory` record the residency beside the digest, and their runs verify on a resident model.
(On a CPU every copy is synchronous: the CUDA ordering rules are proven on the GPU by benchmark_lora --gpu-memory.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from training_cases import SMALL, build_model, make_clip, make_layout

from h3lab.frontends import cli, train
from h3lab.components.residency import GiB, ResidencyError
from h3lab.components.streaming import stream_blocks, streamer_of
from h3lab.training import OptimizerConfig, TrainConfig, add_lora, load
from h3lab.training import train as train_run
from h3lab.training.dataset import save_dataset


DEEP = dataclasses.replace(SMALL, num_layers=4)  # a budget that keeps two of five units streams three


def _model(streamed: str | None):
    """DEEP with a rank-2 adapter: resident, every block streamed ("all"), or three of five ("half": more units than slots, so streaming saves memory)."""
    model = build_model(DEEP, "released", 1).requires_grad_(False)
    if streamed == "all":
        stream_blocks(model, "cpu")
    elif streamed == "half":
        streamer = stream_blocks(model, "cpu")  # every block streamed: its sizes give a budget that keeps two
        sizes = {u.name: u.nbytes for u in streamer.units}
        kept = sizes["token_refiner.refiner_blocks.0"] + sizes["transformer_blocks.1"]
        plan = streamer.plan
        stream_blocks(model, "cpu", gpu_memory_gib=(plan.fixed_bytes + plan.slots * plan.slot_bytes + kept) / GiB)
        assert 0 < len(streamer_of(model).plan.streamed) < len(sizes), streamer_of(model).plan
    add_lora(model, 2, 4.0, seed=0)
    return model


def _run(model, mode: str):
    layout = make_layout("fl2va")
    data = [make_clip(DEEP, layout, seed=s) for s in (1, 2)]
    config = TrainConfig(steps=2, batch_size=1, mode=mode, gradient_checkpointing=True,  # an update between
                         optim=OptimizerConfig(lr=1e-2, weight_decay=1e-2))
    run = train_run(model, data, config)
    return run.digest, run.weights


@pytest.mark.parametrize("mode, streamed", [("strict", "half"), ("off", "all")])
def test_a_streamed_step_is_the_resident_step_byte_for_byte(mode, streamed):
    resident = _run(_model(None), mode)
    model = _model(streamed)
    factors = [p for n, p in model.named_parameters() if "lora_" in n]
    assert factors and all(p.requires_grad for p in factors)
    got = _run(model, mode)
    assert got[0] == resident[0]
    assert set(got[1]) == set(resident[1]) and all(torch.equal(got[1][k], resident[1][k]) for k in got[1])


def test_a_streamed_model_trains_only_with_checkpointing():
    model = _model("all")
    layout = make_layout("fl2va")
    with pytest.raises(ResidencyError, match="trains only with gradient checkpointing") as err:
        train_run(model, [make_clip(DEEP, layout, seed=1)], TrainConfig(steps=1, batch_size=1, mode="off"))
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def clips(tmp_path_factory, tiny_snapshot):
    from h3lab import H3Config

    d = tmp_path_factory.mktemp("streamed-train")
    save_dataset(d / "clips", [make_clip(H3Config.tiny(), make_layout("fl2va"), seed=s) for s in (1, 2)])
    return d / "clips"


def _argv(clips, out, tiny_snapshot, *extra):
    return ["--clips", str(clips), "--out", str(out), "-d", str(tiny_snapshot), "--rank", "2", "--steps", "2",
            "--batch-size", "2", "--lr", "1e-2", "--mode", "off", "--device", "cpu", "--gradient-checkpointing",
            *extra]


def test_h3lab_train_under_a_budget(clips, tiny_snapshot, tmp_path, capsys):
    assert train.main(_argv(clips, tmp_path / "resident", tiny_snapshot)) == 0
    assert train.main(_argv(clips, tmp_path / "streamed", tiny_snapshot, "--gpu-memory", "1")) == 0
    capsys.readouterr()
    a, b = load(tmp_path / "resident" / "run"), load(tmp_path / "streamed" / "run")
    assert a.digest == b.digest and "residency" not in a.manifest["meta"]
    assert b.manifest["meta"]["residency"]["policy"] == "streamed"
    assert b.manifest["meta"]["residency"]["gpu_memory_gib"] == 1.0
    assert cli.main(["verify", str(tmp_path / "streamed")]) == 0  # replayed on a resident model
    assert capsys.readouterr().out.splitlines()[1].startswith("OK")
    cases = [(["--gpu-memory", "1"], "add --gradient-checkpointing"), (["--gpu-memory", "0"], "must be a number")]
    for extra, message in cases:
        argv = [a for a in _argv(clips, tmp_path / "refused", tiny_snapshot, *extra) if
                a != "--gradient-checkpointing" or extra[1] == "0"]
        assert train.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--gpu-memory {extra[1]}" in err[0] and message in err[0], err
        assert not (tmp_path / "refused").exists()


def test_h3lab_train_grpo_under_a_budget(tiny_snapshot, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("a red fox\n")
    argv = ["--prompts", str(tmp_path / "prompts.txt"), "--group", "2", "--reward", "latent_mean", "--iterations",
            "2", "--steps", "2", "--width", "64", "--height", "64", "--frames", "22", "--mode", "off", "--rank", "2",
            "--lr", "1e-2", "--device", "cpu", "-d", str(tiny_snapshot), "--gradient-checkpointing"]
    from h3lab.training.grpo_run import load as load_grpo

    assert train.main(["grpo", *argv, "--out", str(tmp_path / "resident")]) == 0
    assert train.main(["grpo", *argv, "--out", str(tmp_path / "streamed"), "--gpu-memory", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("(8/8 exactly 1)") == 2, out
    a, b = load_grpo(tmp_path / "resident" / "run"), load_grpo(tmp_path / "streamed" / "run")
    assert a.digest == b.digest
    assert b.manifest["meta"]["residency"] == {"policy": "streamed", "gpu_memory_gib": 1.0}


def test_a_model_adapted_before_it_streams_keeps_its_factors_resident():
    """Streaming after `add_lora` (as a benchmark that builds, adapts, then places does): the factors are not packed
    into the units -- they stay where they are, trainable -- and the step is the resident step's."""
    resident = _run(_model(None), "off")
    model = build_model(DEEP, "released", 1).requires_grad_(False)
    add_lora(model, 2, 4.0, seed=0)
    streamer = stream_blocks(model, "cpu")
    packed = {id(e.get()) for u in streamer.units for e in u.entries}
    factors = [p for n, p in model.named_parameters() if "lora_" in n]
    assert factors and not any(id(p) in packed for p in factors) and all(p.requires_grad for p in factors)
    got = _run(model, "off")
    assert got[0] == resident[0] and all(torch.equal(got[1][k], resident[1][k]) for k in got[1])
