"""Scripted replays: every shipped `replays/*.h3` passes its `# expect` lines; mismatches fail the CLI with exit 1;
`--update` rewrites expect lines atomically; malformed replays stop with file:line."""

import re
from pathlib import Path

import pytest

from h3lab.frontends import cli, commands, replay as replays
from session_helpers import REPO

REPLAYS = sorted((REPO / "replays").glob("*.h3"))


def replay(state_factory, path, update=False, repeat=True):
    out: list[str] = []
    report = replays.run_replay(state_factory(path), path, update=update, echo=out.append, repeat=repeat)
    return report, out


@pytest.fixture
def replay_state(session):
    def make(path):
        return commands.SessionState(session=session, base_dir=Path(path).resolve().parent)

    return make


@pytest.fixture(scope="module")
def default_session():
    """The embedded default (the shipped trained snapshot): what `h3lab --replay FILE` without -d runs on, so the
    shipped replays' expect lines are this snapshot's."""
    from h3lab.frontends.cli import quiet_libraries
    from h3lab.app.session import Session

    quiet_libraries()
    return Session(None, device="cpu")


@pytest.fixture
def default_replay_state(default_session):
    def make(path):
        return commands.SessionState(session=default_session, base_dir=Path(path).resolve().parent)

    return make


def test_shipped_replays_exist():
    assert {p.stem for p in REPLAYS} >= {"t2va", "fl2va", "ref2va", "ablation", "strict_vs_off"}


TAG = replays.arithmetic_class("cpu")


def expect_line(digest: str) -> str:
    return f"# expect[{TAG}] {digest}"


@pytest.mark.parametrize("path", REPLAYS, ids=[p.stem for p in REPLAYS])
def test_shipped_replay_passes(path, default_replay_state):
    """Relies on: one arithmetic class's bytes where the file records lines for this machine's class (strict lines
    on every machine of the line's CPU capability); repeatability on any other class. Every generation is either
    checked against a recorded line or, with none for this class, run a second time and its digest repeats."""
    report, out = replay(default_replay_state, path)
    assert report.generations > 0
    assert report.ok, (report.mismatches, report.unrepeated)
    assert report.repeated == report.unchecked
    assert report.checked + len(report.repeated) == report.generations
    text = path.read_text()
    if f"# expect[{TAG}]" in text or f"# expect[{replays.strict_class(TAG)}]" in text:
        assert report.checked >= 1
    text = "\n".join(out)
    if path.stem == "ablation":
        assert re.search(r"off:\w{12} vs off\+H9:\w{12}: first drift at pass 1 scheduler\.video", text)
        assert re.search(r"off:\w{12} vs off\+H5:\w{12}: first drift at pass 1 blocks\.0\.q_rope", text)
    if path.stem == "strict_vs_off":
        assert re.search(r"off:\w{12} vs strict:\w{12}: first drift at pass 1 ", text)
    if path.stem == "t2va":
        assert "text_encode         0.000 s (cached)" in text  # the second seed encoded no text


def test_cli_replay_mismatch_exits_1_and_update_rewrites(tmp_path, snapshot, replay_state, capsys):
    path = tmp_path / "t2va.h3"
    bare = [line for line in (REPO / "replays" / "t2va.h3").read_text().splitlines() if "# expect" not in line]
    path.write_text("\n".join(bare) + "\n")
    replay(replay_state, path, update=True)  # this machine's lines
    original = path.read_text()
    lines = original.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"# expect[{TAG}]"))
    lines[first] = expect_line("0" * 64)
    path.write_text("\n".join(lines) + "\n")
    assert cli.main(["-d", str(snapshot), "--replay", str(path)]) == 1
    captured = capsys.readouterr().out
    assert "MISMATCH" in captured and "1 mismatches" in captured
    report, _ = replay(replay_state, path, update=True)
    assert report.updated and path.read_text() == original
    report, _ = replay(replay_state, path)
    assert report.ok and report.checked == 2


def test_update_inserts_missing_expect_lines(tmp_path, replay_state):
    path = tmp_path / "bare.h3"
    path.write_text("!size 64x64\n!frames 22\n!steps 2\n!mode off\na fox\n\n# a comment\n!seed 3\na fox\n")
    report, _ = replay(replay_state, path)
    assert report.ok and report.unchecked == [5, 9] and report.checked == 0
    report, _ = replay(replay_state, path, update=True)
    text = path.read_text().splitlines()
    assert text[5].startswith(f"# expect[{TAG}] ") and text[10].startswith(f"# expect[{TAG}] ")
    assert text[4] == "a fox" and text[6] == "" and text[7] == "# a comment"
    report, _ = replay(replay_state, path)
    assert report.ok and report.checked == 2 and not report.unchecked


def test_arithmetic_class_names_the_cpu_kernels():
    assert re.fullmatch(r"cpu_(default|avx2|avx512|avx512_vnni|sve\d*|zvector|vsx)[a-z0-9_]*", TAG), TAG
    assert replays.arithmetic_class("cuda") == "cuda"


def test_other_device_expectations_are_skipped(tmp_path, replay_state):
    path = tmp_path / "dev.h3"
    other = "cpu_sve" if TAG != "cpu_sve" else "cpu_avx2"
    path.write_text("!size 64x64\n!frames 22\n!steps 2\n!mode off\na fox\n# expect[cuda] " + "f" * 64 + "\n"
                    + f"# expect[{other}] " + "e" * 64 + "\n")
    report, _ = replay(replay_state, path)
    assert report.ok and report.skipped == 2 and report.unchecked == [5]


def test_malformed_replays_stop_with_file_and_line(tmp_path, replay_state):
    bad = tmp_path / "bad.h3"
    bad.write_text("# expect " + "a" * 64 + "\n")
    with pytest.raises(replays.ReplayError, match="bad.h3:1: '# expect' without a generation line"):
        replay(replay_state, bad)
    bad.write_text("!size 64x64\n!frames 9999\n")
    with pytest.raises(replays.ReplayError, match="bad.h3:2: .*362-frame"):
        replay(replay_state, bad)
    bad.write_text("!first does-not-exist.png\n")
    with pytest.raises(replays.ReplayError, match="bad.h3:1: .*no such file"):
        replay(replay_state, bad)
    assert cli.main(["--replay", str(tmp_path / "missing.h3")]) == 2


def test_a_replay_with_no_line_for_this_class_runs_twice_and_passes_when_it_repeats(tmp_path, snapshot, capsys):
    """A replay that holds no line for this machine's class still checks something: every generation runs twice and
    its digest must repeat (exit 0, and the output says so); --allow-unchecked skips the second runs."""
    path = tmp_path / "other.h3"
    path.write_text("!size 64x64\n!frames 22\n!steps 1\n!mode off\na fox\n# expect[cuda] " + "f" * 64 + "\n")
    assert cli.main(["-d", str(snapshot), "--replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "0 checked, 0 mismatches, 1 repeated" in out and f"no '# expect[{TAG}]' line" in out
    assert "each ran twice and gave the same digest" in out
    assert cli.main(["-d", str(snapshot), "--replay", str(path), "--allow-unchecked"]) == 0
    out = capsys.readouterr().out
    assert "repeated" not in out.splitlines()[-2] and "not run twice (--allow-unchecked)" in out


def test_a_digest_that_does_not_repeat_fails_the_replay(tmp_path, replay_state, monkeypatch):
    """The second run of an unchecked generation is compared, not just made: a different digest fails the replay
    with file:line and both digests."""
    from h3lab.app.session import Session

    path = tmp_path / "twice.h3"
    path.write_text("!size 64x64\n!frames 22\n!steps 1\n!mode off\na fox\n!seed 5\na fox\n")
    calls = []
    real = Session.generate

    def drifting(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        calls.append(result.trajectory_hash)
        if len(calls) == 4:  # the second run of the second generation
            result.trajectory_hash = "0" * 64
        return result

    monkeypatch.setattr(Session, "generate", drifting)
    report, out = replay(replay_state, path)
    assert report.repeated == [5] and len(report.unrepeated) == 1 and not report.ok
    assert report.unrepeated[0].startswith(f"{path}:7: a second run gave {'0' * 64}, the first {calls[2]}")
    assert any(line.startswith(f"NOT REPEATED {path}:7") for line in out)


def test_a_repeat_leaves_the_front_end_and_the_caches_as_they_were(tmp_path, replay_state):
    """The second run neither takes a result slot (!drift still compares the replay's own two generations) nor
    empties the cache a later generation reads (the second seed's text is cached)."""
    path = tmp_path / "pair.h3"
    path.write_text("!size 64x64\n!frames 22\n!steps 1\n!mode off\na fox\n!seed 5\na fox\n!drift\n")
    report, out = replay(replay_state, path)
    assert report.ok and report.repeated == [5, 7]
    assert any("(cached: text)" in line for line in out), out
    assert any(re.search(r"off:\w{12} vs off:\w{12}", line) for line in out), out


def test_an_amx_machine_checks_strict_lines_and_repeats_the_rest(default_replay_state, monkeypatch):
    """On a class with AMX the shipped strict line of its CPU capability holds (the interpreter does not use AMX);
    the off generation has no line there and must repeat. Simulated by naming this machine's class with `_amx`:
    the bytes are this machine's, so only the bookkeeping is under test."""
    path = REPO / "replays" / "strict_vs_off.h3"
    amx = TAG if TAG.endswith("_amx") else TAG + "_amx"
    monkeypatch.setattr(replays, "arithmetic_class", lambda device: amx)
    report, _ = replay(default_replay_state, path)
    strict_line = f"# expect[{replays.strict_class(amx)}]" in path.read_text()
    assert report.ok and report.generations == 2 and report.checked == int(strict_line)
    assert report.repeated == report.unchecked and len(report.unchecked) == 2 - int(strict_line)


def test_strict_lines_are_bound_to_the_cpu_capability_not_to_amx():
    """A strict generation's line of `cpu_X` holds on `cpu_X_amx` (the interpreter does not use AMX); an off
    generation's does not (bf16 torch matmuls take oneDNN's AMX paths)."""
    assert replays.strict_class("cpu_avx512_amx") == "cpu_avx512" and replays.strict_class("cpu_avx2") == "cpu_avx2"
    assert replays._tag_matches("cpu_avx512", "cpu_avx512_amx", strict=True)
    assert not replays._tag_matches("cpu_avx512", "cpu_avx512_amx", strict=False)
    assert not replays._tag_matches("cpu_avx2", "cpu_avx512_amx", strict=True)
    assert replays._tag_matches(None, "cpu_avx2", strict=False)


NUMPY_AVX512_OFF = "AVX512F AVX512CD AVX512_SKX"


@pytest.mark.parametrize("capability, flags, env, tag", [
    ("AVX2", "fpu avx2 fma", {}, "cpu_avx2"),
    ("AVX512", "avx2 avx512f avx512bw avx512_bf16", {}, "cpu_avx512"),
    ("AVX512", "avx512f avx512_bf16 amx_bf16 amx_tile", {}, "cpu_avx512_amx"),
    # oneDNN capped by its own variable: AMX goes unless the cap names it
    ("AVX512", "avx512f avx512_bf16 amx_bf16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "cpu_avx512"),
    ("AVX512", "avx512f amx_bf16", {"DNNL_MAX_CPU_ISA": "avx512_core_amx"}, "cpu_avx512_amx"),
    # the AVX2 emulation on an AVX-512 machine (it gave an AVX2 machine's digests byte for byte)
    ("AVX2", "avx512f amx_bf16", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                                  "NPY_DISABLE_CPU_FEATURES": NUMPY_AVX512_OFF}, "cpu_avx2"),
    # ATen lowered alone, or without numpy: a mixed class that no line names
    ("AVX2", "avx512f", {"ATEN_CPU_CAPABILITY": "avx2"}, "cpu_avx2_mixed"),
    ("AVX2", "avx512f", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, "cpu_avx2_mixed"),
])
def test_cpu_class_names_aten_and_onednn(capability, flags, env, tag):
    assert replays.cpu_class(capability, flags, env) == tag


def test_a_mesh_replay_refuses_a_non_strict_generation_before_any(tmp_path, snapshot):
    """On a mesh of several ranks every generation must be strict; the validation names the
    generation line before the first one runs."""
    from types import SimpleNamespace

    from h3lab.app.session import Session

    session = Session(snapshot, device="cpu")
    session.mesh = SimpleNamespace(topology=SimpleNamespace(world_size=2, name="tp2xcp1"))
    path = tmp_path / "mesh.h3"
    path.write_text("!size 64x64\n!steps 1\n!mode strict\na fox\n!mode off\na fox\n")
    state = commands.SessionState(session=session, base_dir=tmp_path)
    with pytest.raises(replays.ReplayError, match="mesh.h3:6: a generation in mode off on mesh tp2xcp1") as err:
        replays.run_replay(state, path)
    assert "\n" not in str(err.value) and state.results == [] and state.settings.mode == "auto"
