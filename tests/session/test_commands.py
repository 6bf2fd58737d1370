"""The command grammar: parsing (pure) and execution against a real `Session` state; every rejected line must leave
the state exactly as it was. Generation-dependent commands are in test_generate.py."""

import dataclasses

import numpy as np
import pytest

from h3lab.frontends import commands
from h3lab.frontends.commands import Command, CommandError, parse
from h3lab.components import media
from h3lab.errors import H3Error

# ------------------------------------------------------------------------------------------------ parsing
EXAMPLES = {
    "help": ("!help", ()),
    "plot": ("!plot sigmas s.png", ("sigmas", "s.png")),
    "status": ("!status", ()),
    "mesh": ("!mesh", ()),
    "seed": ("!seed 7", (7,)),
    "seconds": ("!seconds 2.5", (2.5,)),
    "frames": ("!frames 39", (39,)),
    "size": ("!size 512x256", (512, 256)),
    "render": ("!render 256x128", (256, 128)),
    "steps": ("!steps 6", (6,)),
    "reuse": ("!reuse 2", (2,)),
    "mode": ("!mode strict", ("strict",)),
    "first": ("!first a.png", ("a.png",)),
    "last": ("!last clear", ("clear",)),
    "ref-image": ("!ref-image a.png", ("a.png",)),
    "ref-video": ("!ref-video v.mp4", ("v.mp4",)),
    "ref-silent-video": ("!ref-silent-video v.mp4", ("v.mp4",)),
    "ref-video-audio": ("!ref-video-audio v.mp4 a.wav", ("v.mp4", "a.wav")),
    "ref-audio": ("!ref-audio a.wav", ("a.wav",)),
    "refs": ("!refs clear", ("clear",)),
    "ref-remove": ("!ref-remove 2", (2,)),
    "ablate": ("!ablate H3 on", ("H3", "on")),
    "drift": ("!drift", ()),
    "save": ("!save out.mp4", ("out.mp4",)),
    "trajectory": ("!trajectory verify t1", ("verify", "t1")),
    "cache": ("!cache", ()),
    "profile": ("!profile on", ("on",)),
    "show": ("!show off", ("off",)),
    "streaming": ("!streaming on", ("on",)),
    "adaln": ("!adaln tables", ("tables",)),
    "plan": ("!plan", ()),
    "layers": ("!layers 45", (45,)),
    "core-reuse": ("!core-reuse 4", (4,)),
    "token-reduction": ("!token-reduction on", ("on",)),
    "reference-rope": ("!reference-rope off", ("off",)),
    "zoom": ("!zoom 1", (1,)),
    "quit": ("!quit", ()),
    "lora": ("!lora fox-lora 0.5", ("fox-lora", 0.5)),
    "rollout": ("!rollout 4 brightness a red fox", (4, "brightness", "a red fox")),
    "stepper": ("!stepper flow_sde", ("flow_sde",)),
    "level": ("!level 0.3", (0.3,)),
    "window": ("!window 1,4", ("1,4",)),
    "attention": ("!attention 3 0-1 pass 2 from text to video map.png", (3, (0, 1), 1, "text", "video", "map.png")),
    "compare": ("!compare ab.png", ("ab.png",)),
    "lora-scale": ("!lora-scale blocks 0-19:0, audio:0.3", ("blocks 0-19:0, audio:0.3",)),
}


def test_every_command_has_an_example():
    assert set(EXAMPLES) == set(commands.COMMANDS)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_parse_examples(name):
    line, args = EXAMPLES[name]
    assert parse(line) == Command(name, args, line)


def test_plain_lines_generate_and_comments_do_nothing():
    assert parse("  a red fox  ") == Command("generate", ("a red fox",), "  a red fox  ")
    assert parse("").name == "noop" and parse("   ").name == "noop"
    assert parse("# expect 00ff").name == "noop"


def test_quoted_paths_and_aliases():
    assert parse('!first "my image.png"').args == ("my image.png",)
    assert parse("!seed random").args == ("random",)
    assert parse("!exit").name == "quit"
    assert parse("!show").args == ()
    assert parse("!refs").args == () and parse("!ablate").args == ()


@pytest.mark.parametrize(
    "line,match",
    [
        ("!nosuch", "unknown command !nosuch"),
        ("!", "type !help"),
        ("!seed", "expects N\\|random"),
        ("!seed 1.5", "integer seed"),
        ("!seed 1 2", "expects N\\|random"),
        ("!size 64", "WIDTHxHEIGHT"),
        ("!size 64x", "WIDTHxHEIGHT"),
        ("!render big", "WIDTHxHEIGHT"),
        ("!frames 2.5", "expected N"),
        ("!seconds soon", "number of seconds"),
        ("!mode turbo", "strict\\|audit\\|auto\\|off\\|fast"),
        ("!show maybe", "on\\|off"),
        ("!profile", "expects on\\|off"),
        ("!ref-video-audio v.mp4", "VIDEO AUDIO"),
        ("!trajectory load t", "save\\|verify"),
        ("!trajectory save", "save\\|verify PATH"),
        ("!ablate H3", "FACTOR on\\|off"),
        ("!refs all", "clear"),
        ("!help me", "takes no arguments"),
        ('!first "unterminated', "No closing quotation"),
    ],
)
def test_parse_errors_are_one_line(line, match):
    with pytest.raises(CommandError, match=match) as info:
        parse(line)
    assert isinstance(info.value, H3Error) and "\n" not in str(info.value)


def _no_session():
    raise AssertionError("this line must not load the session")


def test_every_registered_command_is_complete_and_in_help():
    """One registry: each entry carries its usage, summary, parser and handler, and `!help` (run as a line, without
    loading the session) lists every one of them in registration order."""
    state = commands.SessionState(session=_no_session)
    lines = commands.run_line(state, "!help")
    assert lines == commands.help_lines() and lines[0] == "Type a prompt to generate. Commands:"
    assert len(lines) == 1 + len(commands.COMMANDS) >= 29
    for line, (name, spec) in zip(lines[1:], commands.COMMANDS.items()):
        assert spec.name == name and spec.usage.split()[0] == f"!{name}"
        assert spec.summary.strip() and callable(spec.parse) and callable(spec.handler)
        assert all(isinstance(a, commands.Arg) for a in spec.args)
        assert line.split() == [*spec.usage.split(), *spec.summary.split()]  # "  usage  summary", in order
    for alias, name in commands.ALIASES.items():
        assert name in commands.COMMANDS and parse(f"!{alias}").name == name


@pytest.fixture
def scratch_registry(monkeypatch):
    """A copy of the registry, so a test may register commands without leaking them."""
    monkeypatch.setattr(commands, "COMMANDS", dict(commands.COMMANDS))
    monkeypatch.setattr(commands, "ALIASES", dict(commands.ALIASES))


def test_a_command_is_declared_in_one_place(scratch_registry):
    def p_words(name, words):
        if not words:
            raise CommandError(f"!{name} expects WORD...")
        return tuple(words)

    @commands.command("echo", "!echo WORD...", "say the words back", parse=p_words, args=(commands.Arg(("hi",)),),
                      aliases=("say",))
    def h_echo(state, *words):
        return [" ".join(words)]

    state = commands.SessionState(session=_no_session)
    assert commands.run_line(state, "!say hello 'big world'") == ["hello big world"]
    assert any(line.split()[:2] == ["!echo", "WORD..."] for line in commands.run_line(state, "!help"))
    with pytest.raises(CommandError, match="expects WORD"):
        parse("!echo")
    for name, usage, aliases in (("seed", "!seed N", ()), ("echo2", "!echo2", ("q",)), ("generate", "!generate", ())):
        with pytest.raises(ValueError, match="already registered"):
            commands.command(name, usage, "x", parse=commands.no_args, aliases=aliases)(h_echo)
    with pytest.raises(ValueError, match="must start with '!echo3'"):
        commands.command("echo3", "!echo WORD", "x", parse=commands.no_args)(h_echo)
    assert "echo2" not in commands.COMMANDS and "echo3" not in commands.COMMANDS


def test_parsing_loads_no_session_and_unknown_parsed_commands_are_refused():
    state = commands.SessionState(session=_no_session)
    assert commands.run_line(state, "!seed 3") == ["seed 3"] and commands.run_line(state, "# note") == []
    with pytest.raises(CommandError, match="unknown command 'nosuch'"):
        commands.execute(state, Command("nosuch"))


# ------------------------------------------------------------------------------------------------ execution
def snapshot_of(state):
    """Everything a command may change."""
    return (state.settings, state.show, state.profile, state.running, tuple(state.results), state.counter)


def assert_rejected(state, line, match):
    before = snapshot_of(state)
    with pytest.raises(H3Error, match=match) as info:
        commands.run_line(state, line)
    assert "\n" not in str(info.value)
    assert snapshot_of(state) == before
    return str(info.value)


def test_setting_commands(state):
    assert commands.run_line(state, "!seed 5") == ["seed 5"]
    assert state.settings.seed == 5
    commands.run_line(state, "!seed random")
    assert 0 <= state.settings.seed < 2**31
    out = commands.run_line(state, "!frames 23")
    assert state.settings.num_frames == 39 and any("snapped up to 39" in line for line in out)
    commands.run_line(state, "!seconds 2")
    assert state.settings.num_frames == 56 and state.settings.frames is None
    commands.run_line(state, "!size 128x64")
    commands.run_line(state, "!render 64x32")
    assert state.settings.canvas == (64, 32)
    commands.run_line(state, "!render off")
    assert state.settings.canvas == (128, 64)
    commands.run_line(state, "!steps 4")
    commands.run_line(state, "!reuse 2")
    assert (state.settings.steps, state.settings.reuse) == (4, 2)
    assert commands.run_line(state, "!profile on") == ["profile on"] and state.profile
    commands.run_line(state, "!show")
    assert state.show
    commands.run_line(state, "!show off")
    assert not state.show
    commands.run_line(state, "!quit")
    assert not state.running


def test_rejected_settings_leave_state_unchanged(state):
    assert_rejected(state, "!size 50x64", "multiple of 32")
    assert_rejected(state, "!size 1376x768", "exceeds")
    assert_rejected(state, "!size 160x32", "aspect ratio")
    assert_rejected(state, "!render 128x128", "larger than the output")
    assert_rejected(state, "!frames 400", "362-frame")
    assert_rejected(state, "!seconds 16", "362-frame")
    assert_rejected(state, "!steps 0", "between 1 and 1000")
    assert_rejected(state, "!reuse 9", "between 1 and steps")
    assert_rejected(state, "!seed -3", "seed=-3")
    assert_rejected(state, "!mode turbo", "strict\\|audit")
    assert_rejected(state, "!bogus", "unknown command")


def test_strict_on_cpu_without_interpreter_is_refused(state, monkeypatch):
    """Refused at the command, not noted and left to fail at the generation."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert_rejected(state, "!mode strict", "export TRITON_INTERPRET=1 before starting h3lab")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = commands.run_line(state, "!mode strict")
    assert out[0] == "mode strict" and "Triton's interpreter" in out[1]


def test_anchor_commands(state, tmp_path):
    assert_rejected(state, "!first missing.png", "no such file")
    assert_rejected(state, f"!first {tmp_path}", "not a regular file")
    assert_rejected(state, "!first tone.wav", "not an image")
    out = commands.run_line(state, "!first first.png")
    assert state.settings.task == "fl2va" and "first.png" in out[0]
    commands.run_line(state, "!last last.png")
    assert [a for a, _ in state.settings.anchors] == ["first", "last"]
    assert_rejected(state, "!ref-image first.png", "cannot be mixed")
    commands.run_line(state, "!first clear")
    commands.run_line(state, "!last clear")
    assert state.settings.task == "t2va"


@pytest.fixture
def short_and_silent(tmp_path):
    t = np.arange(32000) / 32000  # 1 s: below the 2 s minimum of a reference audio input
    short = tmp_path / "short.wav"
    media.write_wav(short, np.stack([np.sin(2 * np.pi * 220 * t)] * 2).astype(np.float32) * 0.2)
    frames = np.random.default_rng(0).integers(0, 255, (30, 64, 64, 3), dtype=np.uint8)
    silent = tmp_path / "silent.mp4"
    media.write_mp4(silent, frames)
    return short, silent


def test_reference_commands(state, short_and_silent):
    short, silent = short_and_silent
    assert_rejected(state, "!ref-audio tone.wav", "image or video reference")  # standalone audio alone
    commands.run_line(state, "!ref-image first.png")
    out = commands.run_line(state, "!ref-audio tone.wav")
    assert out == [f"ref 2: audio {state.base_dir / 'tone.wav'}"]
    assert_rejected(state, f"!ref-audio {short}", "2-15 s")
    assert_rejected(state, f"!ref-video {silent}", "has no audio stream")
    assert_rejected(state, "!first first.png", "cannot be mixed")
    assert_rejected(state, "!ref-remove 3", "there are 2 references")
    assert_rejected(state, "!ref-remove 1", "image or video reference")  # would leave the audio alone
    commands.run_line(state, f"!ref-silent-video {silent}")
    commands.run_line(state, "!ref-video-audio clip.mp4 tone.wav")
    listing = commands.run_line(state, "!refs")
    assert [line.split(":")[0] for line in listing] == ["1", "2", "3", "4"]
    assert "video-audio" in listing[3] and "tone.wav" in listing[3]
    assert [r.kind for r in state.settings.references] == ["image", "audio", "silent-video", "video-audio"]
    # 2.25 s tone + 2.25 s replacement track + 2.33 s soundtrack: a third audio input is legal, a fourth is not
    commands.run_line(state, "!ref-video clip.mp4")
    assert_rejected(state, "!ref-audio tone.wav", "4 audio inputs")
    commands.run_line(state, "!ref-remove 1")
    assert state.settings.references[0].kind == "audio"
    commands.run_line(state, "!refs clear")
    assert state.settings.references == () and state.settings.task == "t2va"


def test_commands_needing_results_fail_cleanly(state):
    assert_rejected(state, "!save out.mp4", "no generation yet")
    assert_rejected(state, "!drift", "needs two generations")
    assert_rejected(state, "!trajectory save t", "no generation yet")
    assert_rejected(state, "!trajectory verify nowhere", "not a sealed trajectory")


def test_status_and_cache(state):
    lines = commands.run_line(state, "!status")
    assert lines[0].startswith("model ") and any(line.startswith("next: t2va") for line in lines)
    assert commands.run_line(state, "!cache")  # entries or "empty": never raises


def test_ablate_lists_and_switches_factors(state):
    from h3lab.app.session import ablation_factors

    factors = ablation_factors()
    assert {"H5", "H9", "A2"} <= set(factors) and "H15" not in factors and "H-C0" not in factors
    lines = commands.run_line(state, "!ablate")
    assert [line.split(":")[0] for line in lines] == list(factors)
    assert_rejected(state, "!ablate NOSUCH on", "unknown factor")
    commands.run_line(state, "!ablate H9 on")
    commands.run_line(state, "!ablate H5 on")
    assert state.settings.ablations == ("H5", "H9")
    commands.run_line(state, "!ablate H9 off")
    assert state.settings.ablations == ("H5",)


def test_toolbar_text(state):
    commands.run_line(state, "!ref-image first.png")
    bar = state.toolbar()
    for part in ("mode off", "seed 42", "64x64", "22f", "2 steps", "refs 1"):
        assert part in bar
    assert dataclasses.replace(state.settings).task == "ref2va"
