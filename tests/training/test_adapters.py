"""`RunSpec.adapters` end to end on the tiny snapshot: a generation with an adapter records its sha256, path, name and
scale in the sealed run and its trajectory differs; `verify` replays the same adapter bytes and refuses a changed
file; scale 0 reproduces the base trajectory; the model carries no adapter outside a run; `!lora PATH|off` and
`--lora PATH`; every bad adapter (missing, pickle, not safetensors, other model size, not plain LoRA) fails with one
line before any model loads, leaving the session as it was."""

from __future__ import annotations

import json
import re

import pytest
import torch
from lora_cases import randomize_b
from training_cases import SMALL, build_model

from h3lab import H3Config, H3Transformer
from h3lab.frontends import cli, commands
from h3lab.model import random_state_dict
from h3lab.run import RunSpecError
from h3lab.app.session import Session
from h3lab.training import AdapterError, add_lora, read_adapter, save_adapter
from h3lab.adapters.field import validate
from h3lab.adapters.lora import lora_layers

GEN = dict(width=64, height=64, frames=22, steps=2, mode="off", seed=3)


class Tripwire(BaseException):
    """Raised where a bad adapter must never get to (a model load)."""


def tiny_adapter(path, b_seed=4, config=None, rank=2):
    model = H3Transformer(config or H3Config.tiny())
    model.load_state_dict(random_state_dict(model.config, 1))
    add_lora(model, rank, 4.0, seed=2)
    randomize_b(model, b_seed, scale=0.5)
    return save_adapter(model, path)


@pytest.fixture(scope="module")
def session(tiny_snapshot):
    return Session(tiny_snapshot, device="cpu")


@pytest.fixture(scope="module")
def base(session):
    return session.generate("a red fox", **GEN)


def test_generation_with_adapter_is_sealed_and_verified(session, base, tmp_path):
    path, digest = tiny_adapter(tmp_path / "fox-lora")
    entry = session.load_lora(path, 1.0)
    assert entry == {"name": "fox-lora", "path": str(path.resolve()), "scale": 1.0, "sha256": digest}
    result = session.generate("a red fox", **GEN)
    assert result.trajectory_hash != base.trajectory_hash
    spec = result.trajectory.spec
    assert [dict(a) for a in spec.adapters] == [entry] and spec.sha256 != base.trajectory.spec.sha256
    assert not lora_layers(session.transformer())  # injected for the run only
    # the active adapter is shown in !status, the "ran" line and the drift labels
    from h3lab.frontends import commands

    shown = f"LoRA fox-lora x1 (sha256 {digest[:12]})"
    assert commands.what_ran(result).endswith(f"; with {shown}") and shown not in commands.what_ran(base)
    assert f"adapter: {shown}" in commands.run_line(commands.SessionState(session=session), "!status")
    assert "+lora:" in session.drift_lines(base, result)[0]
    assert result.trajectory.manifest["checkpoint"]["fingerprint"] == base.trajectory.manifest["checkpoint"][
        "fingerprint"]  # the base checkpoint; the adapter is recorded by its digest
    sealed = result.trajectory.seal(tmp_path / "traj")
    manifest = json.loads((sealed / "manifest.json").read_text())
    assert manifest["spec"]["adapters"] == [entry]
    session.unload_lora()
    report = session.verify(sealed)  # the spec re-applies the adapter, whatever the session holds now
    assert report.ok, str(report)
    assert session.generate("a red fox", **GEN).trajectory_hash == base.trajectory_hash  # unloaded
    tiny_adapter(tmp_path / "other", b_seed=9)
    for name in ("adapter_model.safetensors", "adapter_config.json"):  # weights, then config (alpha) changed
        original = (path / name).read_bytes()
        (path / name).write_bytes((tmp_path / "other" / name).read_bytes() if name.endswith(".safetensors")
                                  else original.replace(b'"lora_alpha": 4.0', b'"lora_alpha": 5.0'))
        with pytest.raises(AdapterError, match="changed: sha256") as err:
            session.verify(sealed)
        assert "\n" not in str(err.value)
        (path / name).write_bytes(original)
    assert session.verify(sealed).ok
    assert not lora_layers(session.transformer())


def test_scale_zero_gives_the_base_trajectory(session, base, tmp_path):
    path, _ = tiny_adapter(tmp_path / "a")
    session.load_lora(path, 0.0)
    try:
        result = session.generate("a red fox", **GEN)
    finally:
        session.unload_lora()
    assert result.trajectory_hash == base.trajectory_hash  # base + 0 * delta: the base bytes at every pass
    assert result.trajectory.spec.adapters[0]["scale"] == 0.0


def test_lora_command_and_flag(session, tmp_path, capsys):
    path, digest = tiny_adapter(tmp_path / "cmd")
    state = commands.SessionState(session=session, base_dir=tmp_path)
    assert commands.run_line(state, "!lora cmd 0.5") == [
        f"lora cmd scale 0.5 (sha256 {digest[:16]}) for the next generations"]
    assert session.adapters[0]["scale"] == 0.5
    assert commands.run_line(state, "!lora off") == ["lora off"] and session.adapters == ()
    assert any(line.startswith("  !lora PATH [SCALE]|off") for line in commands.help_lines())
    with pytest.raises(commands.CommandError, match="SCALE must be a number"):
        commands.parse("!lora cmd half")
    args = cli.build_parser().parse_args(["-p", "x", "--lora", str(path), "-d", str(session.path)])
    assert cli.check_flags(args) == "one-shot"
    assert cli.session_from_args(args).adapters[0]["sha256"] == digest
    args = cli.build_parser().parse_args(["--replay", "x.h3", "--lora", str(path)])
    with pytest.raises(cli.CliError, match="--lora with --replay"):
        cli.check_flags(args)


def bad_adapters(tmp_path):
    """name -> (path, expected message) of adapters that must be refused."""
    d = tmp_path
    (d / "weights.bin").write_bytes(b"\x80\x04pickle")
    pickled = d / "pickled"
    pickled.mkdir()
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    (pickled / "adapter_config.json").write_text("{}")
    (d / "junk.safetensors").write_bytes(b"not safetensors at all, not even close" * 4)
    small, _ = tiny_adapter(d / "small", config=SMALL)  # made for another model size
    dora, _ = tiny_adapter(d / "dora")
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    noconf, _ = tiny_adapter(d / "noconf")
    (noconf / "adapter_config.json").unlink()
    rank, _ = tiny_adapter(d / "rank")
    (rank / "adapter_config.json").write_text(json.dumps({**cfg, "r": 3}))
    return {
        "missing": (d / "nope", "no such file or directory"),
        "bin": (d / "weights.bin", "a .bin file is a pickle"),
        "pickled-dir": (pickled, "holds adapter_model.bin (a pickle"),
        "not-safetensors": (d / "junk.safetensors", "not a readable safetensors file"),
        "other-size": (small, "do not fit the projection"),
        "dora": (dora, "use_dora=True is not plain LoRA"),
        "no-config": (noconf, "has no adapter_config.json"),
        "rank": (rank, "do not have the config's rank 3"),
    }


def test_bad_adapters_fail_before_any_model_loads(tiny_snapshot, tmp_path, monkeypatch, capsys):
    session = Session(tiny_snapshot, device="cpu")

    def tripwire(*args, **kwargs):
        raise Tripwire("a model was loaded")

    monkeypatch.setattr(Session, "component", tripwire)
    good, _ = tiny_adapter(tmp_path / "good")
    session.load_lora(good)
    before = session.adapters
    state = commands.SessionState(session=session, base_dir=tmp_path)
    for name, (path, message) in bad_adapters(tmp_path).items():
        with pytest.raises(AdapterError, match=re.escape(message)) as err:
            session.load_lora(path)
        assert "\n" not in str(err.value), name
        assert session.adapters == before, f"{name}: the session changed"
        with pytest.raises(AdapterError, match=re.escape(message)):
            commands.run_line(state, f"!lora {path}")
        out = tmp_path / f"{name}.mp4"
        code = cli.main(["-p", "a fox", "-d", str(tiny_snapshot), "--lora", str(path), "-o", str(out)])
        err_lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err_lines) == 1 and message.split("(")[0] in err_lines[0], (name, err_lines)
        assert not out.exists()


def test_spec_entry_rules():
    entry = {"name": "a", "path": "/x/a", "scale": 1.0, "sha256": "0" * 64}
    assert validate([entry]) == [entry]
    for value, match in (([entry, entry], "one adapter per run"), ([{**entry, "sha256": "abc"}], "64 lowercase"),
                         ([{**entry, "path": "rel/a"}], "absolute path"), ([{**entry, "extra": 1}], "exactly the keys"),
                         ([{**entry, "scale": float("inf")}], "finite"), ({"a": 1}, "must be")):
        with pytest.raises((AdapterError, RunSpecError), match=match):
            validate(value)


def test_adapter_reads_back_what_it_saved(tmp_path):
    model = build_model(SMALL, "released", 3)
    add_lora(model, 2, 2.0)
    path, digest = save_adapter(model, tmp_path / "a")
    adapter = read_adapter(path, expect_sha256=digest)
    assert adapter.kind == "peft" and adapter.rank == 2 and adapter.config.lora_alpha == 2.0
    assert all(t.dtype == torch.float32 for t in adapter.tensors.values())
    with pytest.raises(AdapterError, match="changed"):
        read_adapter(path, expect_sha256="f" * 64)
    randomize_b(model, 3)
    again, other = save_adapter(model, tmp_path / "a")  # atomically replaced, never mixed
    assert again == path and other != digest and read_adapter(path).sha256 == other


def test_a_header_length_ending_in_0x80_is_not_taken_for_a_pickle(tmp_path):
    """A safetensors file starts with its header length's low byte, which can be 0x80 (a pickle's first byte): the
    trained default's adapters hit it. Such a file reads; a real pickle under a .safetensors name is still refused."""
    from safetensors.torch import save

    from h3lab.adapters.adapter_file import _tensors

    weights = {"w": torch.randn(3, 2, generator=torch.Generator().manual_seed(7))}
    data = next(d for d in (save(weights, metadata={"pad": "x" * n}) for n in range(400)) if d[0] == 0x80)
    tensors, meta = _tensors(tmp_path / "a.safetensors", data)
    assert torch.equal(tensors["w"], weights["w"]) and set(meta) == {"pad"}
    with pytest.raises(AdapterError, match="a pickle, not a safetensors file"):
        _tensors(tmp_path / "b.safetensors", b"\x80\x04" + bytes(40))
