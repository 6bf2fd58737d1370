"""The interactive session (`h3lab` without `-p`): a prompt-toolkit REPL over `h3lab.frontends.commands`.

- A plain line generates; `!...` lines are commands (`!help`). Lines go through `commands.parse` at once, so a bad
  line is answered immediately with one `error:` line and nothing changes.
- Generations run on one worker thread, in submission order, with the settings captured when the line was entered;
  the prompt stays live meanwhile, and everything printed (progress lines, previews, results) appears above it
  (`patch_stdout(raw=True)`, raw so inline-image escapes reach the terminal). Commands whose registry entry says
  `drain` (they read results or the session: `!save`, `!drift`, `!trajectory`, `!plot`, `!status`, `!cache`) first
  wait for the queue to drain.
- Ctrl-C cancels the running generation (and drops queued ones) and keeps the session; at an idle prompt it just
  clears the line. A pass cannot be interrupted, so Ctrl-C says at once which pass is running and that the
  generation stops when it ends; the result line then says after which pass it stopped ("cancelled after pass 1/3").
  Ctrl-D or `!quit` leave after the queue drains (Ctrl-C while waiting cancels).
- While a generation runs the prompt says so (`h3 [generating 2/20]> `, `h3 [2 queued]> `) instead of the idle
  `h3> `, and a command that must wait for the queue (`drain` in the registry) says it waits before it does.
- Pass lines show sigma and t together (`t = 1 - sigma`: 0 is pure noise, 1 is clean; the last pass starts at the
  last sigma above 0 and ends at 0, so t never prints 1). Output numbers are taken only by written videos.
- History lives in `<session dir>/history`; completion covers command names and aliases, then what each argument
  position of the command declares in the registry (`commands.Arg`: keywords, file paths); the bottom toolbar
  shows model, mode, seed, size, frames, steps, anchors/references and generation progress.
- `run_repl(session_factory, settings, session_dir, ...)` is the entry point: the caller says how to get the
  `Session` (the CLI from its flags; a test or another front end injects one); this module never builds one and
  imports no other front end.
- On a mesh (torchrun, `Session(mesh=...)` of several ranks) a generation whose collective breaks (a peer rank died:
  `distributed.peers.broken_collective`) ends the session, not just that generation: the process group cannot
  carry another forward. The worker prints nothing for it, drops the queue and stops the prompt (also one that
  starts later); the launcher's stop (torchrun's SIGTERM to the survivors, `peers.Stopped`) landing in the prompt or
  in a line's command is taken the same way, never echoed as a line's error. `run` then waits for the worker and
  raises the first such error in the calling thread, where the CLI's `peers.watch` turns it into
  the one line naming the dead rank ("rank 1 died mid-session ..."), exit 2. Nothing of that generation is written.
- Testable without a terminal: `Repl(state, input=create_pipe_input(), output=DummyOutput())`, or `run_repl` with
  the same `input` / `output`.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory
from prompt_toolkit.patch_stdout import patch_stdout

from . import commands
from ..errors import H3Error, user_message
from ..io_utils import check_output_dir
from .preview import TerminalPreview
from ..schema.generation_settings import GenerationSettings


class H3Completer(Completer):
    """Command names (and aliases) after `!`, then per argument position what the command's registry entry declares
    (`commands.Arg`: keywords and/or file paths)."""

    def __init__(self) -> None:
        self.paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, event: CompleteEvent) -> Iterable[Completion]:
        text = document.text_before_cursor
        if not text.startswith("!"):
            return
        if " " not in text:
            word = text[1:]
            names = sorted(set(commands.COMMANDS) | set(commands.ALIASES))
            for name in names:
                if name.startswith(word):
                    yield Completion(name, start_position=-len(word), display=f"!{name}")
            return
        name, _, rest = text[1:].partition(" ")
        spec = commands.COMMANDS.get(commands.ALIASES.get(name, name))
        if spec is None:
            return
        word = rest.split(" ")[-1]
        position = len(rest.split(" ")) - 1
        if position >= len(spec.args):
            return
        arg = spec.args[position]
        try:
            keywords = arg.keywords()
        except H3Error:  # e.g. no ablation factors on offer: complete nothing rather than break the prompt
            keywords = ()
        for kw in keywords:
            if kw.startswith(word):
                yield Completion(kw, start_position=-len(word))
        if arg.path:
            yield from self.paths.get_completions(Document(word, len(word)), event)


class Repl:
    """One interactive session over a `commands.SessionState`."""

    def __init__(
        self,
        state: commands.SessionState,
        history: Path | None = None,
        input: Any = None,
        output: Any = None,
        printer: Callable[[str], None] | None = None,
    ):
        self.state = state
        self.printer = printer
        self.jobs: queue.Queue = queue.Queue()
        self.idle = threading.Event()  # set when no generation is running or queued
        self.idle.set()
        self.pending = 0  # generations queued or running, under self.count_lock
        self.count_lock = threading.Lock()
        self.running_cancel: threading.Event | None = None  # the cancel event of the running generation
        self.busy_text = ""
        self.passes = (0, 0)  # (passes completed, total) of the running generation
        self.prompt = PromptSession(
            message=self.message,
            history=FileHistory(str(history)) if history is not None else None,
            completer=H3Completer(),
            complete_while_typing=False,
            bottom_toolbar=self.toolbar,
            refresh_interval=0.5,
            input=input,
            output=output,
        )
        self.worker = threading.Thread(target=self._work, name="h3lab-generate", daemon=True)
        self.lost: BaseException | None = None  # the broken collective that ended the session (mesh only)
        state.progress = self._progress

    # -------------------------------------------------------------------------------------- output
    def echo(self, line: str) -> None:
        if self.printer is not None:
            self.printer(line)
        else:
            print(line, flush=True)

    def toolbar(self) -> str:
        text = self.state.toolbar()
        return f"{text} | {self.busy_text}" if self.busy_text else text

    def message(self) -> str:
        """The prompt: `h3> ` when idle, else what is running or queued."""
        with self.count_lock:
            pending = self.pending
        if pending == 0:
            return "h3> "
        done, total = self.passes
        running = self.running_cancel is not None
        step = "decoding" if total and done >= total else f"generating {done + 1}/{total}" if total else "generating"
        parts = [step] if running else []
        queued = pending - int(running)
        if queued:
            parts.append(f"{queued} queued")
        return f"h3 [{', '.join(parts)}]> "

    def _progress(self, info) -> None:
        mark = "" if info.evaluated else " reused"
        self.passes = (info.step, info.total)
        self.busy_text = f"generating {info.step}/{info.total}"
        hint = "  (t = 1 - sigma: 0 noise, 1 clean)" if info.step == 1 else ""
        self.echo(f"  pass {info.step}/{info.total} sigma={1 - info.video_t:.4f} t={info.video_t:.4f} "
                  f"{info.seconds:.2f} s{mark}{hint}")
        app = self.prompt.app
        if app.is_running:
            app.invalidate()

    # -------------------------------------------------------------------------------------- worker
    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            settings, cancel = job
            self.passes = (0, settings.steps)
            self.running_cancel = cancel
            try:
                self.busy_text = "generating"
                for line in commands.run_generation(self.state, settings, cancel):
                    self.echo(line)
            except commands.GenerationCancelled:
                done, total = self.passes
                where = f"after pass {done}/{total}" if done else f"before pass 1/{total}"
                self.echo(f"cancelled {where}; nothing written, the session is unchanged")
            except Exception as err:  # noqa: BLE001 - the session must survive any failure of one generation
                if self._mesh_broken(err):
                    self._lose(err)
                    continue
                self.echo(f"error: {user_message(err)}")
                if _debug() and not isinstance(err, H3Error):
                    traceback.print_exc()
            finally:
                self.busy_text = ""
                self.running_cancel = None
                with self.count_lock:
                    self.pending -= 1
                    if self.pending == 0:
                        self.idle.set()

    def _mesh_broken(self, err: BaseException) -> bool:
        """Whether `err` is a broken collective of a session on a mesh of several ranks (module docstring)."""
        mesh = getattr(self.state.session, "mesh", None)
        if mesh is None or mesh.dp * mesh.topology.world_size == 1:
            return False
        from ..distributed.peers import broken_collective

        return broken_collective(err)

    def _lose(self, err: BaseException) -> None:
        """End the session on a broken mesh: drop the queue, stop the prompt; `run` raises the first such error."""
        if self.lost is None:
            self.lost = err
        with self.count_lock:
            self.pending -= self._drop_queued()
            if self.pending == 0:
                self.idle.set()
        loop = self.prompt.app.loop
        if loop is not None:
            loop.call_soon_threadsafe(self._stop_prompt)

    def _stop_prompt(self) -> None:
        """In the prompt's event loop (or its pre_run): end a running prompt when the session is lost."""
        app = self.prompt.app
        if self.lost is not None and app.future is not None and not app.future.done():
            app.exit(exception=EOFError())

    def submit(self, prompt: str) -> None:
        settings = self.state.settings.replace(prompt=prompt)  # validated now, captured now
        self.state.get_session()  # load before queueing so a bad snapshot errors at the prompt
        with self.count_lock:
            self.pending += 1
            self.idle.clear()
            self.jobs.put((settings, threading.Event()))

    def _drop_queued(self) -> int:
        """Take every queued (not running) generation off the queue (under `count_lock`); returns how many."""
        dropped = 0
        while True:
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                return dropped
            dropped += 1

    def cancel(self) -> None:
        with self.count_lock:
            dropped = self._drop_queued()
            self.pending -= dropped
            running = self.pending > 0
            if running:
                # The one job left is the running one (or the one being dequeued): its own event stops it before
                # its next pass; a later generation gets a fresh event.
                while self.running_cancel is None and self.pending > 0 and not self.idle.is_set():
                    time.sleep(0.001)
                if self.running_cancel is not None:
                    self.running_cancel.set()
            else:
                self.idle.set()
        if running or dropped:
            done, total = self.passes
            now = (f": pass {done + 1}/{total} is running and cannot be interrupted; the generation stops when it "
                   "ends" if running and total and done < total else ": it stops before decoding" if running else "")
            self.echo("cancelling the running generation" + (f" (and {dropped} queued)" if dropped else "") + now)

    def wait_idle(self) -> None:
        """Block until the queue drains; Ctrl-C (SIGINT) while waiting cancels."""
        try:
            while not self.idle.wait(0.1):
                pass
        except KeyboardInterrupt:
            self.cancel()
            while not self.idle.wait(0.1):
                pass

    # -------------------------------------------------------------------------------------- lines
    def handle(self, line: str) -> None:
        if self.lost is not None:  # the mesh broke: no line runs any more
            return
        try:
            cmd = commands.parse(line)
            if cmd.name == "noop":
                return
            if cmd.name == "generate" and cmd.args[0].strip().lower() in BARE_COMMANDS:
                # A command word typed without its '!' is what the user meant, not a one-word prompt.
                word = cmd.args[0].strip().lower()
                self.echo(f"(commands start with '!': ran !{word}; to generate the prompt {word!r}, say more words)")
                cmd = commands.parse(f"!{word}")
            if cmd.name == "generate":
                self.submit(cmd.args[0])
                return
            if commands.COMMANDS[cmd.name].drain and not self.idle.is_set():
                self.echo(f"!{cmd.name} waits for the queued generations to finish (Ctrl-C cancels them)")
                self.wait_idle()
                if self.lost is not None:
                    return
            for out in commands.execute(self.state, cmd):
                self.echo(out)
        except Exception as err:  # noqa: BLE001 - one bad line never ends the session
            if self._mesh_broken(err):  # e.g. the launcher's stop while a drain waited for a broken generation
                self._lose(err)
                return
            self.echo(f"error: {user_message(err)}")
            if _debug() and not isinstance(err, H3Error):
                traceback.print_exc()

    def run(self, banner: Iterable[str] = ()) -> int:
        self.worker.start()
        with patch_stdout(raw=True):
            for line in banner:
                self.echo(line)
            while self.state.running and self.lost is None:
                try:
                    line = self.prompt.prompt(pre_run=self._stop_prompt)
                except KeyboardInterrupt:
                    self.cancel()
                    continue
                except EOFError:
                    break
                except Exception as err:  # noqa: BLE001 - the launcher's stop lands here while the prompt waits
                    if not self._mesh_broken(err):
                        raise
                    self._lose(err)
                    break
                self.handle(line)
            self.wait_idle()
            self.jobs.put(None)
            self.worker.join()
        if self.lost is not None:
            raise self.lost
        return 0


BARE_COMMANDS = frozenset({"help", "quit", "exit"})  # one-word lines taken as the command, not as a prompt


def _debug() -> bool:
    import os

    return bool(os.environ.get("H3LAB_DEBUG"))


def run_repl(
    session: Callable[[], Any],
    settings: GenerationSettings | None = None,
    session_dir: str | Path | None = None,
    show: bool = False,
    profile: bool = False,
    zoom: int = 2,
    input: Any = None,
    output: Any = None,
    printer: Callable[[str], None] | None = None,
) -> int:
    """Run the interactive session until `!quit` / Ctrl-D; returns the exit status (0).

    `session` is a zero-argument factory returning the `Session` (the CLI's builds it from its flags; tests and other
    front ends inject their own); it is called once, before the prompt, so a bad snapshot fails before any line is
    read. `settings` are the initial settings (their input paths are checked), `session_dir` holds the numbered
    outputs, previews and history (default ./h3lab-session); `show` / `profile` are the initial switches, `zoom`
    the --show display factor;
    `input` / `output` / `printer` go to `Repl` (a pipe input, a dummy output and a line sink in tests)."""
    session_dir = check_output_dir(Path(session_dir or "h3lab-session"), "--session-dir").resolve()
    session_dir.mkdir(parents=True, exist_ok=True)
    state = commands.SessionState(
        session=session(),
        settings=(settings or GenerationSettings()).checked_paths(),
        out_dir=session_dir,
        base_dir=Path.cwd(),
        show=show,
        zoom=zoom,
        profile=profile,
    )
    if state.settings.layers is not None or state.settings.token_reduction:
        state.session.check_preset(state.settings)  # the DiT's depth, from its config: before the first prompt
    viewer = TerminalPreview(session_dir / "previews", zoom=zoom)
    repl = Repl(state, history=session_dir / "history", input=input, output=output, printer=printer)
    state.preview = lambda frame, step, total: repl.echo(
        viewer.show(frame, f"{state.next_output()[0]:03d}-step{step:03d}", zoom=state.zoom))
    loaded = state.session
    banner = [
        f"h3lab {loaded.model_name} ({loaded.path}) on {loaded.device}",
        f"outputs and history in {session_dir}",
        "type a prompt to generate, !help for commands, Ctrl-C cancels a generation, Ctrl-D quits",
    ]
    native = getattr(loaded, "native", None)
    if native is not None:
        banner.append(f"{loaded.model_name} was trained at {native.width}x{native.height}, {native.frames} frames, on "
                      f"prompts like \"{native.example}\" ({native.prompt_form})")
    return repl.run(banner)
