"""The training command lines' flags as declared settings (`h3lab.schema.program`, `schema/train_flags.py`): a
shared flag is one declaration in every program that takes it, a declaration reaches the parser with its default in
the help and the config it is sealed in, `--stepper`'s choices follow the stepper registry, and one OptimizerConfig
holds AdamW's settings for the three configs."""

from __future__ import annotations

import argparse

import pytest

from h3lab.frontends import train
from h3lab.run import STEPPERS
from h3lab.schema import Setting
from h3lab.schema.program import PROGRAMS, declare_flag, flag_names, sealed
from h3lab.stochastic.steppers import SDEProvider, sde_steppers
from h3lab.training import OptimizerConfig, TrainConfig, TrainingError
from h3lab.training.grpo_step import GrpoConfig
from h3lab.training.nft import NftConfig

PARSERS = {"train": train.build_parser, "train grpo": train.build_grpo_parser, "train nft": train.build_nft_parser}


def test_a_shared_flag_is_one_declaration_in_each_program():
    for name in ("lr", "weight_decay", "rank", "targets", "seed", "mode", "gradient_checkpointing", "out"):
        declared = {PROGRAMS[p].get(name) for p in PARSERS}
        assert len(declared) == 1 and None not in declared, name
    assert PROGRAMS["train"].get("steps") is not PROGRAMS["train grpo"].get("steps")  # optimiser steps vs passes
    for program, build in PARSERS.items():
        dests = {a.dest for a in build()._actions} - {"help"}
        assert dests == {s.name for s in PROGRAMS[program]}, program


@pytest.mark.parametrize("program", list(PARSERS))
def test_every_flag_says_its_default(program):
    p = PARSERS[program]()
    for action in p._actions:
        assert action.help, action.dest
        if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS) and not action.required:
            assert "default" in action.help, (program, action.dest, action.help)


def test_the_flags_fill_the_configs_they_are_sealed_in():
    args = train.build_nft_parser().parse_args(["--prompts", "p.txt", "--reward", "brightness", "--out", "o",
                                                "--nft-beta", "0.5", "--lr", "3e-3", "--video-weight", "0.25"])
    config, job = train.sealed_parts(args, "train nft")
    assert config["beta"] == 0.5 and config["kind"] == "euler" and "nft_beta" not in config
    assert config["optim"] == OptimizerConfig(lr=3e-3) and config["objective"].video_weight == 0.25
    assert job["prompts"] == "p.txt" and isinstance(job["targets"], tuple)
    assert NftConfig(**config).optim.lr == 3e-3
    assert flag_names("train nft")["beta"] == "--nft-beta" and flag_names("train grpo")["kind"] == "--stepper"
    grpo = train.build_grpo_parser().parse_args(["--prompts", "p", "--reward", "r", "--out", "o", "--passes",
                                                 "window:0,2"])
    selection = sealed(grpo, "train grpo", "config")["selection"]
    assert (selection.kind, selection.start, selection.size) == ("window", 0, 2)


def test_a_declared_flag_reaches_the_parser_and_its_record():
    probe = declare_flag(Setting("probe_knob", int, 7, "a probe", target="command", programs=("train",),
                                 seal="job"))
    try:
        p = train.build_parser()
        assert "a probe (default 7)" in " ".join(p.format_help().split())
        args = p.parse_args(["--out", "o", "--probe-knob", "9"])
        assert sealed(args, "train", "job")["probe_knob"] == 9
    finally:
        PROGRAMS["train"].withdraw(probe.name)
    with pytest.raises(ValueError, match="program 'tarin'"):
        declare_flag(Setting("x", int, 0, "x", target="command", programs=("tarin",)))


def test_stepper_choices_follow_the_stepper_registry():
    def choices(program):
        return next(a.choices for a in PARSERS[program]()._actions if a.dest == "stepper")

    assert tuple(choices("train grpo")) == sde_steppers() == ("flow_sde", "dance_sde", "cps")
    assert tuple(choices("train nft")) == ("euler", *sde_steppers())
    flow = STEPPERS.get("flow_sde")
    STEPPERS.register("probe_sde", SDEProvider(build=flow.build, validate=flow.validate))
    try:
        assert "probe_sde" in choices("train grpo") and "probe_sde" in choices("train nft")
    finally:
        STEPPERS.unregister("probe_sde")
    assert "probe_sde" not in choices("train grpo")


def test_one_optimizer_config_for_the_three_configs():
    optim = OptimizerConfig(lr=2e-3, weight_decay=1e-3)
    for config in (TrainConfig(steps=1, batch_size=1, optim=optim), GrpoConfig(optim=optim), NftConfig(optim=optim)):
        record = config.to_dict()
        assert "optim" not in record and OptimizerConfig.from_record(record) == optim
        assert type(config).from_dict(record) == config
    assert TrainConfig(steps=1, batch_size=1).optim.weight_decay == 1e-2  # torch AdamW's, the Python default
    assert GrpoConfig().optim == NftConfig().optim == OptimizerConfig()
    for bad, text in ((dict(lr=0.0), "AdamW.lr=0.0: must be a finite number > 0"),
                      (dict(master_weights=1), "master_weights=1: must be true or false")):
        with pytest.raises(TrainingError, match=text):
            OptimizerConfig(**bad)
    with pytest.raises(TrainingError, match="GrpoConfig.optim is a dict: must be an OptimizerConfig"):
        GrpoConfig(optim={"lr": 1e-3})
