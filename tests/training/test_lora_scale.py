"""`RunSpec.lora_scale` (`--lora-scale`): the adapter's delta scaled per block and per modality of the output rows.
Strict: scale 0 on a block is byte-equal to that block without the adapter (the whole trajectory against an adapter
file lacking that block); a per-modality factor leaves the other modalities' rows byte-equal where the factor is
applied, and factor 0 gives the base rows. The setting: its normal form, one declaration seen by the flag, the
command, the panel and the summary; `verify` replays it; a bad value fails before any model loads, naming the flag."""

from __future__ import annotations

import json

import pytest
import torch
from lora_cases import randomize_b

from h3lab import H3Config, H3Transformer
from h3lab.frontends import cli, commands
from h3lab.run import trajectory as T
from h3lab.research.ablation.bench import Bench
from h3lab.errors import H3Error
from h3lab.model import random_state_dict
from h3lab.schema import SETTINGS
from h3lab.schema.lora_scale import describe, parse
from h3lab.app.session import Session
from h3lab.training import add_lora, adapter_entry, save_adapter
from h3lab.adapters.lora import adapter_state_dict, load_adapter_weights, lora_layers

GEN = dict(width=64, height=64, frames=22, steps=2, mode="off", seed=3)


def _adapter_model(targets=None):
    model = H3Transformer(H3Config.tiny())
    model.load_state_dict(random_state_dict(model.config, 1))
    add_lora(model, 2, 4.0, seed=2, **({} if targets is None else {"targets": targets}))
    return model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_snapshot):
    """(entry of an adapter on every projection, entry of the same factors without block 1's)."""
    root = tmp_path_factory.mktemp("lora")
    full = _adapter_model()
    randomize_b(full, 4, scale=0.5)
    full_path, _ = save_adapter(full, root / "full")
    kept = [p for p, _ in lora_layers(full) if not p.startswith("transformer_blocks.1.")]
    partial = _adapter_model(kept)
    state = adapter_state_dict(full)
    load_adapter_weights(partial, {k: v for k, v in state.items() if not k.startswith("transformer_blocks.1.")})
    partial_path, _ = save_adapter(partial, root / "partial")
    return (adapter_entry(full_path, snapshot=tiny_snapshot), adapter_entry(partial_path, snapshot=tiny_snapshot))


@pytest.fixture(scope="module")
def bench(tiny_snapshot):
    return Bench.tiny(tiny_snapshot, num_points=2)  # 2 blocks, one pass: strict in the interpreter is slow


def _spec(bench, mode="strict", **fields):
    return bench.spec(mode).replace(**fields)


def test_normal_form_and_its_words():
    assert parse("blocks 0-9:0, blocks 10-19:0, audio:0.3") == {"blocks": [[0, 19, 0.0]], "audio": 0.3}
    assert parse("block 3:1, video:1") == {} and parse("text:-0") == {"text": 0.0}
    assert describe(parse("refiner:2, blocks 4-5:0.5, block 1:0")) == "blocks 1-1:0, blocks 4-5:0.5, refiner:2".replace(
        "blocks 1-1:0", "block 1:0")
    for bad, why in (("blocks 2-1:0", "ascend"), ("audio:1, audio:2", "named twice"), ("blocks 0-3:0, block 2:1",
                     "block 2 is named twice"), ("wind:1", "unknown target"), ("video:inf", "finite"),
                     ("video", "TARGET:SCALE")):
        with pytest.raises(H3Error, match=why) as err:
            parse(bad)
        assert str(err.value).startswith("--lora-scale ") and "\n" not in str(err.value)


def test_scale_zero_on_a_block_is_the_block_without_the_adapter(bench, adapters):
    full, partial = adapters
    scaled = T.record(_spec(bench, adapters=[full], lora_scale={"blocks": [[1, 1, 0.0]]}), bench.model)
    without = T.record(_spec(bench, adapters=[partial]), bench.model)
    plain = T.record(_spec(bench, adapters=[full]), bench.model)
    assert scaled.digest == without.digest != plain.digest
    assert not lora_layers(bench.model)  # nothing stays in the model after a run


def _rows_at(bench, spec, point="blocks.0.q"):
    seen = {}

    def keep(p, t):
        seen.setdefault(p.name, t.detach().clone())

    handle = bench.model.add_hook(keep, names=[point])
    try:
        T.record(spec, bench.model)
    finally:
        handle.remove()
    return seen[point][0]  # (S, inner)


def test_a_modality_factor_leaves_the_other_rows_byte_equal(bench, adapters):
    full, _ = adapters
    layout = bench.layout
    audio, video, text = layout.audio_indices, layout.video_indices, layout.text_indices
    plain = _rows_at(bench, _spec(bench, adapters=[full]))
    damped = _rows_at(bench, _spec(bench, adapters=[full], lora_scale={"audio": 0.3}))
    assert torch.equal(damped[video], plain[video]) and torch.equal(damped[text], plain[text])
    assert not torch.equal(damped[audio], plain[audio])
    # factor 0: the audio rows are the base projection's (block 0's audio input rows carry no adapter effect)
    off = _rows_at(bench, _spec(bench, adapters=[full], lora_scale={"audio": 0.0}))
    base = _rows_at(bench, _spec(bench))
    assert torch.equal(off[audio], base[audio]) and torch.equal(off[video], plain[video])


def test_one_declaration_reaches_flag_command_panel_summary_and_spec(tiny_snapshot, adapters, tmp_path):
    from h3lab.frontends.panel.controls import setting_controls

    setting = SETTINGS.get("lora_scale")
    assert setting.flag == "--lora-scale" and "lora-scale" in commands.COMMANDS
    session = Session(tiny_snapshot, device="cpu")
    state = commands.SessionState(session=session, settings=session.settings("a red fox", **GEN), base_dir=tmp_path)
    assert commands.run_line(state, "!lora-scale blocks 0-1:0, audio:0.5") == ["LoRA scale blocks 0-1:0, audio:0.5"]
    assert "LoRA scale blocks 0-1:0, audio:0.5" in state.settings.summary()
    assert setting_controls(state.settings, {})["lora_scale"].value == "blocks 0-1:0, audio:0.5"
    with pytest.raises(H3Error, match="none is loaded"):
        session.generate(state.settings)
    session.adapters = (adapters[0],)
    with pytest.raises(H3Error, match="block 2 does not exist"):
        session.generate(state.settings.replace(lora_scale="block 2:0"))
    result = session.generate(state.settings.replace(lora_scale="block 1:0, audio:0.5"))
    sealed = result.trajectory.seal(tmp_path / "traj")
    assert json.loads((sealed / "manifest.json").read_text())["spec"]["lora_scale"] == {
        "blocks": [[1, 1, 0.0]], "audio": 0.5}
    session.unload_lora()
    report = session.verify(sealed)  # the spec re-applies the adapter and its factors, byte for byte
    assert report.ok, str(report)
    session.adapters = (adapters[0],)
    rollout = session.rollout(["a red fox"], group=2, seed=3, lora_scale="audio:0.5", **{
        k: v for k, v in GEN.items() if k != "seed"})
    assert all(dict(t.spec.lora_scale) == {"audio": 0.5} for t in rollout.trajectories)
    assert not lora_layers(session.transformer())


class Tripwire(BaseException):
    """Raised where a bad value must never get to (a model load)."""


def test_a_bad_value_fails_before_any_model_loads(tiny_snapshot, tmp_path, monkeypatch, capsys):
    def tripwire(*args, **kwargs):
        raise Tripwire("a model was loaded")

    monkeypatch.setattr(Session, "component", tripwire)
    out = tmp_path / "x.mp4"
    code = cli.main(["-p", "a fox", "-d", str(tiny_snapshot), "--lora-scale", "blocks 0-x:0", "-o", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--lora-scale 'blocks 0-x:0'" in lines[0] and "unknown target" in lines[0]
    code = cli.main(["-p", "a fox", "-d", str(tiny_snapshot), "--lora-scale", "audio:0", "-o", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "none is loaded" in lines[0] and not out.exists()
