"""The REPL: driven through prompt-toolkit's pipe input (generation, cancel with Ctrl-C, errors, history,
completion, toolbar), and one smoke test of the real terminal program inside a detached tmux session."""

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from h3lab.components import media
from h3lab.frontends.repl import H3Completer, Repl, run_repl
from h3lab.schema.generation_settings import GenerationSettings

from session_helpers import subprocess_env


def drive(state, text, tmp_path):
    out: list[str] = []
    with create_pipe_input() as inp:
        inp.send_text(text)
        repl = Repl(state, history=tmp_path / "history", input=inp, output=DummyOutput(), printer=out.append)
        assert repl.run(banner=["hello"]) == 0
    return out


def test_repl_generates_cancels_and_keeps_going(state, tmp_path):
    state.out_dir = tmp_path / "videos"
    script = (
        "!nosuch\n"  # one-line error, session continues
        "!size 50x50\n"
        "a red fox walks\n"
        "\x03"  # Ctrl-C right after submitting: the queued / running generation is cancelled
        "!status\n"
        "a red fox walks\n"
        "!save fox.wav\n"
        "!quit\n"
    )
    state.base_dir = tmp_path
    out = drive(state, script, tmp_path)
    text = "\n".join(out)
    assert out[0] == "hello"
    assert "error: unknown command !nosuch: type !help for the commands" in out
    assert any(line.startswith("error: size 50x50") or "width=50" in line for line in out)
    assert any(line.startswith("cancelling the running generation") for line in out)
    assert "next: t2va" in text and "64x64" in text  # the rejected !size left the settings alone
    assert len(state.results) == 1  # the cancelled request left no result
    result = state.results[0]
    assert result.frames.shape == (22, 64, 64, 3)
    assert any(line.startswith("  pass 2/2") for line in out)
    written = [Path(line.split()[1]) for line in out if line.startswith("wrote ")]
    assert len(written) == 1 and written[0].parent == state.out_dir and written[0].is_file()
    assert (tmp_path / "fox.wav").is_file()
    history = (tmp_path / "history").read_text()
    assert "a red fox walks" in history and "!save fox.wav" in history


def test_repl_eof_waits_for_queued_generations(state, tmp_path):
    out = drive(state, "!seed 3\nfirst prompt\n!seed 4\nsecond prompt\n\x04", tmp_path)  # Ctrl-D, no !quit
    assert [r.seed for r in state.results] == [3, 4]
    assert [r.settings.prompt for r in state.results] == ["first prompt", "second prompt"]
    assert sum(line.startswith("trajectory ") for line in out) == 2


def test_completer():
    c = H3Completer()
    ev = CompleteEvent(completion_requested=True)

    def words(text):
        return [x.text for x in c.get_completions(Document(text, len(text)), ev)]

    assert {"ref-image", "ref-video", "ref-remove", "render", "reuse", "refs"} <= set(words("!re"))
    assert words("!mode s") == ["strict"]
    assert words("!show o") == ["on", "off"]
    assert words("!trajectory s") == ["save"]
    assert words("a prompt") == []
    assert "H9" in words("!ablate H") and words("!ablate H9 o") == ["on", "off"]
    replays = Path(__file__).resolve().parents[2] / "replays"
    found = words(f"!ref-image {replays}/as")
    assert found and all(w.startswith("sets") for w in found)  # PathCompleter completes the rest of the name
    assert "clear" in words("!first c")
    assert words("!plot la") == ["latents"]  # plot kinds at the first position, paths at the second
    assert words("!ablate H9 on ") == [] and words("!seed 1 ") == []  # nothing past the declared arguments
    assert words("!ex") == ["exit"] and "q" in words("!q")  # aliases complete as names
    found = words(f"!ref-video-audio clip.mp4 {replays}/as")
    assert found and all(w.startswith("sets") for w in found)


def test_run_repl_takes_a_session_factory(session, tmp_path, monkeypatch):
    """The REPL never builds a session: it calls the factory it is given, once, before the first prompt."""
    monkeypatch.chdir(tmp_path)
    calls = []

    def factory():
        calls.append(1)
        return session

    out: list[str] = []
    settings = GenerationSettings().replace(width=64, height=64, frames=22, steps=2, mode="off", seed=5)
    with create_pipe_input() as inp:
        inp.send_text("!seed\n!status\n!quit\n")
        rc = run_repl(factory, settings, session_dir=tmp_path / "sess", profile=True, input=inp, output=DummyOutput(),
                      printer=out.append)
    assert rc == 0 and calls == [1]
    assert out[0] == f"h3lab {session.model_name} ({session.path}) on {session.device}"
    assert out[1] == f"outputs and history in {tmp_path / 'sess'}"
    assert "error: !seed expects N|random" in out
    assert "next: t2va seed 5, 64x64, 22 frames (0.917 s), 2 steps, mode off" in out
    assert "show off, profile on" in out and f"outputs: {tmp_path / 'sess'}" in out
    assert "!status" in (tmp_path / "sess" / "history").read_text()


def test_toolbar_shows_the_session(state, tmp_path):
    with create_pipe_input() as inp:
        repl = Repl(state, input=inp, output=DummyOutput(), printer=lambda line: None)
        bar = repl.toolbar()
    for part in ("mode off", "seed 42", "64x64", "22f", "2 steps"):
        assert part in bar


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tmux_smoke(snapshot, tmp_path):
    """The real program in a real terminal: prompt, toolbar, a command, a generation, !quit."""
    h3lab = Path(sys.executable).with_name("h3lab")
    assert h3lab.is_file(), "console script h3lab is not installed"
    env = subprocess_env(TERM="xterm-256color")
    sock = f"h3lab-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", sock]
    cmd = [
        str(h3lab), "-d", str(snapshot), "--session-dir", str(tmp_path / "sess"), "--width", "64", "--height", "64",
        "--frames", "22", "--steps", "2", "--mode", "off",
    ]
    subprocess.run(tmux + ["new-session", "-d", "-s", "h3", "-x", "160", "-y", "40", *cmd], check=True, env=env,
                   cwd=tmp_path)

    def pane() -> str:
        return subprocess.run(tmux + ["capture-pane", "-p", "-t", "h3"], capture_output=True, text=True).stdout

    def wait_for(text: str, timeout: float = 120.0) -> str:
        end = time.time() + timeout
        while time.time() < end:
            screen = pane()
            if text in screen:
                return screen
            time.sleep(0.5)
        raise AssertionError(f"{text!r} never appeared; screen:\n{pane()}")

    try:
        wait_for("h3>")  # capture-pane drops trailing blanks
        wait_for("mode off | seed 42 | 64x64 | 22f | 2 steps")  # bottom toolbar (drawn just after the prompt)
        subprocess.run(tmux + ["send-keys", "-t", "h3", "!seed 9", "Enter"], check=True)
        wait_for("seed 9")
        wait_for("| seed 9 |")  # toolbar redrawn
        subprocess.run(tmux + ["send-keys", "-t", "h3", "a red fox in snow", "Enter"], check=True)
        wait_for("001.mp4")
        wait_for("trajectory ")
        subprocess.run(tmux + ["send-keys", "-t", "h3", "!quit", "Enter"], check=True)
        end = time.time() + 30
        def alive() -> bool:
            return subprocess.run(tmux + ["has-session", "-t", "h3"], capture_output=True).returncode == 0

        while time.time() < end and alive():
            time.sleep(0.3)
        assert not alive()  # !quit ended the program, and with it the tmux session
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True)
    video = tmp_path / "sess" / "001.mp4"
    info = media.probe(video)
    assert info.frame_count == 22 and info.audio.sample_rate == 32000
    assert "a red fox in snow" in (tmp_path / "sess" / "history").read_text()


def test_a_command_word_without_its_bang_runs_the_command(state, tmp_path):
    """`help` typed without `!` is the help, not a clip of the prompt "help"; the REPL says so."""
    out = drive(state, "help\nquit\n", tmp_path)
    assert "(commands start with '!': ran !help; to generate the prompt 'help', say more words)" in out
    assert any(line.startswith("Type a prompt to generate. Commands:") for line in out)
    assert not state.results  # nothing was generated
