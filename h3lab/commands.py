"""The one command grammar every front end shares (REPL, scripted replays, notebook widgets, the CLI's flags).

A line is parsed into a `Command` (`parse`), then executed against a `SessionState` (`execute`), which returns the
output lines. Parsing checks the command name, the arity and the argument types; execution checks everything that
needs the world (files, the model, earlier results). Both raise `H3Error` subclasses with one line, and execution
mutates the state only after every check passed, so a rejected line leaves the session exactly as it was.

Grammar:
- an empty line, or a line starting with `#`, does nothing (replays use `# expect <sha256>` lines, see
  `run_replay`);
- a line starting with `!` is a command, its arguments split like a POSIX shell (quote paths with spaces);
- any other line is a prompt and generates with the current settings.

Relative paths resolve against `SessionState.base_dir` (the working directory in the REPL, the replay file's folder
in a replay), so a replay is self-contained.

Replays (`run_replay`): a `.h3` file is REPL lines; `# expect <sha256>` / `# expect[cpu|cuda] <sha256>` after a
generation line checks that generation's trajectory digest (`trajectory.Trajectory.digest`).
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .errors import H3Error, ValidationError
from .runtime import MODES
from .session import GenerationCancelled  # noqa: F401 - re-exported for front ends
from .settings import GenerationSettings, Reference, check_path


class CommandError(H3Error):
    """An unknown command or a bad argument (names the command, the value and the expected form)."""


class ReplayError(H3Error):
    """A replay line failed (prefixed with file:line)."""


@dataclass(frozen=True)
class Command:
    """A parsed line: `name` is a command name from `COMMANDS` or "generate"; `args` are typed values."""

    name: str
    args: tuple = ()
    line: str = ""


# ------------------------------------------------------------------------------------------------ argument parsers
def _no_args(name: str, args: list[str]) -> tuple:
    if args:
        raise CommandError(f"!{name} takes no arguments, got {' '.join(args)!r}")
    return ()


def _one(name: str, args: list[str], form: str) -> str:
    if len(args) != 1:
        raise CommandError(f"!{name} expects {form}, got {' '.join(args)!r}" if args else f"!{name} expects {form}")
    return args[0]


def _int_arg(name: str, text: str, form: str) -> int:
    if not re.fullmatch(r"[+-]?\d+", text):
        raise CommandError(f"!{name} {text}: expected {form}")
    return int(text)


def _choice(name: str, text: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise CommandError(f"!{name} {text}: expected one of {'|'.join(choices)}")
    return text


def _p_seed(name, args):
    text = _one(name, args, "N|random")
    return ("random",) if text == "random" else (_int_arg(name, text, "an integer seed or 'random'"),)


def _p_int(form):
    def parse(name, args):
        return (_int_arg(name, _one(name, args, form), form),)

    return parse


def _p_seconds(name, args):
    text = _one(name, args, "X (seconds)")
    try:
        value = float(text)
    except ValueError:
        raise CommandError(f"!{name} {text}: expected a number of seconds") from None
    return (value,)


def _size(name: str, text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)[xX](\d+)", text)
    if not m:
        raise CommandError(f"!{name} {text}: expected WIDTHxHEIGHT, e.g. 512x512")
    return int(m.group(1)), int(m.group(2))


def _p_size(name, args):
    return _size(name, _one(name, args, "WxH"))


def _p_render(name, args):
    text = _one(name, args, "WxH|off")
    return ("off",) if text == "off" else _size(name, text)


def _p_mode(name, args):
    return (_choice(name, _one(name, args, "|".join(MODES)), MODES),)


def _p_path_or_clear(name, args):
    return (_one(name, args, "PATH|clear"),)


def _p_path(name, args):
    return (_one(name, args, "PATH"),)


def _p_two_paths(name, args):
    if len(args) != 2:
        raise CommandError(f"!{name} expects VIDEO AUDIO, got {' '.join(args)!r}")
    return tuple(args)


def _p_refs(name, args):
    if not args:
        return ()
    return (_choice(name, _one(name, args, "[clear]"), ("clear",)),)


def _p_on_off(name, args):
    return (_choice(name, _one(name, args, "on|off"), ("on", "off")),)


def _p_show(name, args):
    return () if not args else _p_on_off(name, args)


def _p_ablate(name, args):
    if not args:
        return ()
    if len(args) != 2:
        raise CommandError(f"!{name} expects FACTOR on|off, got {' '.join(args)!r}")
    return (args[0], _choice(name, args[1], ("on", "off")))


def _p_trajectory(name, args):
    if len(args) != 2:
        raise CommandError(f"!{name} expects save|verify PATH, got {' '.join(args)!r}")
    return (_choice(name, args[0], ("save", "verify")), args[1])


def _p_cache(name, args):
    return _p_refs(name, args)


def _p_plot(name, args):
    from .plots import PLOTS

    if len(args) != 2:
        raise CommandError(f"!{name} expects KIND PATH.png (KIND: {'|'.join(PLOTS)}), got {' '.join(args)!r}")
    if not args[1].lower().endswith(".png"):
        raise CommandError(f"!{name} {args[1]}: the plot path must end in .png")
    return (_choice(name, args[0], tuple(PLOTS)), args[1])


@dataclass(frozen=True)
class Spec:
    usage: str
    summary: str
    parse: Callable[[str, list[str]], tuple]
    paths: bool = False  # arguments are file paths (REPL completion)


COMMANDS: dict[str, Spec] = {
    "help": Spec("!help", "this list", _no_args),
    "status": Spec("!status", "model, device, settings, anchors and references", _no_args),
    "seed": Spec("!seed N|random", "seed of the next generation (default 42)", _p_seed),
    "seconds": Spec("!seconds X", "duration at 24 fps, rounded up to a legal frame count", _p_seconds),
    "frames": Spec("!frames N", "frame count, snapped up to 17n+5", _p_int("N")),
    "size": Spec("!size WxH", "output size (multiples of 32, area <= 768x1344, aspect 1:4-4:1)", _p_size),
    "render": Spec("!render WxH|off", "internal canvas, same aspect, upscaled to the output size", _p_render),
    "steps": Spec("!steps N", "denoising passes (default 20)", _p_int("N")),
    "reuse": Spec("!reuse N", "whole-velocity reuse interval (1 = every pass runs the model)", _p_int("N")),
    "mode": Spec("!mode strict|audit|auto|off", "arithmetic of the transformer", _p_mode),
    "first": Spec("!first PATH|clear", "first-frame anchor (fl2va)", _p_path_or_clear, paths=True),
    "last": Spec("!last PATH|clear", "last-frame anchor (fl2va)", _p_path_or_clear, paths=True),
    "ref-image": Spec("!ref-image PATH", "append an image reference (<Picture N>)", _p_path, paths=True),
    "ref-video": Spec("!ref-video PATH", "append a video reference with its soundtrack", _p_path, paths=True),
    "ref-silent-video": Spec(
        "!ref-silent-video PATH", "append a video reference, soundtrack ignored", _p_path, paths=True
    ),
    "ref-video-audio": Spec(
        "!ref-video-audio VIDEO AUDIO", "append a video reference with a replacement soundtrack", _p_two_paths,
        paths=True,
    ),
    "ref-audio": Spec(
        "!ref-audio PATH", "append a standalone audio reference (needs an image/video ref)", _p_path, paths=True
    ),
    "refs": Spec("!refs [clear]", "list the references in order, or remove them all", _p_refs),
    "ref-remove": Spec("!ref-remove N", "remove reference N (1-based)", _p_int("N")),
    "ablate": Spec("!ablate FACTOR on|off", "switch an ablation factor for the next generations", _p_ablate),
    "drift": Spec("!drift", "first drift between the last two generations", _no_args),
    "save": Spec("!save PATH", "write the last generation (.mp4 video+audio, .wav audio)", _p_path, paths=True),
    "trajectory": Spec(
        "!trajectory save|verify PATH", "seal the last trajectory in PATH / replay a sealed one and compare",
        _p_trajectory, paths=True,
    ),
    "cache": Spec("!cache [clear]", "conditioning cache entries", _p_cache),
    "plot": Spec("!plot KIND PATH.png", "latents|norms|drift|ablation|sigmas of the recent generations", _p_plot,
                 paths=True),
    "profile": Spec("!profile on|off", "print phase timings and peak memory after each generation", _p_on_off),
    "show": Spec("!show [on|off]", "preview the middle frame after every denoising pass", _p_show),
    "quit": Spec("!quit", "leave (also !exit, Ctrl-D)", _no_args),
}
ALIASES = {"exit": "quit", "q": "quit", "h": "help", "?": "help"}


def parse(line: str) -> Command:
    """Parse one line. Blank lines and `#` comments parse to the no-op command "noop"."""
    text = line.strip()
    if not text or text.startswith("#"):
        return Command("noop", (), line)
    if not text.startswith("!"):
        return Command("generate", (text,), line)
    try:
        words = shlex.split(text[1:])
    except ValueError as err:
        raise CommandError(f"{text!r}: {err}") from None
    if not words:
        raise CommandError("'!' alone: type !help for the commands")
    name = ALIASES.get(words[0], words[0])
    spec = COMMANDS.get(name)
    if spec is None:
        raise CommandError(f"unknown command !{words[0]}: type !help for the commands")
    return Command(name, tuple(spec.parse(name, words[1:])), line)


def help_lines() -> list[str]:
    width = max(len(s.usage) for s in COMMANDS.values())
    lines = ["Type a prompt to generate. Commands:"]
    lines += [f"  {s.usage:<{width}}  {s.summary}" for s in COMMANDS.values()]
    return lines


# ------------------------------------------------------------------------------------------------ state
@dataclass
class SessionState:
    """What a front end holds between lines: the `Session`, the current settings and front-end switches.

    `session` may be a zero-argument factory; it is called on the first line that needs the model, so `!help` or a
    bad argument never loads weights. `progress(step, total, info)` and `preview(frame, step, total)` are the front
    end's per-step callbacks; `cancel` is set by the front end to stop a running generation between steps."""

    session: Any
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    out_dir: Path | None = None  # numbered videos go here (None: do not write)
    base_dir: Path = field(default_factory=Path.cwd)
    show: bool = False
    profile: bool = False
    running: bool = True
    results: list = field(default_factory=list)  # the last two GenerationResults (for !drift / !save)
    counter: int = 0
    progress: Callable[..., None] | None = None
    preview: Callable[..., Any] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def get_session(self):
        with self.lock:
            if callable(self.session) and not hasattr(self.session, "generate"):
                self.session = self.session()
            return self.session

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    def input_path(self, path: str, what: str) -> str:
        """Resolve and validate an input file (exists, regular, readable)."""
        return check_path(self.resolve(path), what)

    @property
    def last(self):
        if not self.results:
            raise CommandError("no generation yet: type a prompt first")
        return self.results[-1]

    def next_output(self) -> Path | None:
        """The next numbered video path in `out_dir` (001.mp4, 002.mp4, ...), skipping numbers already used."""
        if self.out_dir is None:
            return None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        while True:
            self.counter += 1
            path = self.out_dir / f"{self.counter:03d}.mp4"
            if not path.exists():
                return path

    def toolbar(self) -> str:
        s = self.settings
        session = self.session if hasattr(self.session, "generate") else None
        model = session.model_name if session is not None else "(not loaded)"
        cond = ""
        if s.first or s.last:
            cond = " anchors " + "+".join(name for name, _ in s.anchors)
        if s.references:
            cond += f" refs {len(s.references)}"
        size = f"{s.width}x{s.height}" + (f"@{s.render_width}x{s.render_height}" if s.render_width else "")
        return (
            f"{model} | mode {s.mode} | seed {s.seed} | {size} | {s.num_frames}f | {s.steps} steps"
            f"{cond}{' | show' if self.show else ''}{' | profile' if self.profile else ''}"
        )


# ------------------------------------------------------------------------------------------------ execution
def execute(state: SessionState, cmd: Command) -> list[str]:
    """Run one parsed command; returns output lines. Raises `H3Error` (state unchanged) on any rejected input."""
    handler = _HANDLERS.get(cmd.name)
    if handler is None:
        raise CommandError(f"unknown command {cmd.name!r}")
    return handler(state, *cmd.args)


def run_line(state: SessionState, line: str) -> list[str]:
    """parse + execute."""
    return execute(state, parse(line))


def _set(state: SessionState, **changes: Any) -> GenerationSettings:
    new = state.settings.replace(**changes)  # validates; raises before anything is assigned
    state.settings = new
    return new


def _h_noop(state):
    return []


def _h_help(state):
    return help_lines()


def _h_status(state):
    s = state.settings
    session = state.get_session()
    st = session.status()
    lines = [
        f"model {st['model']} ({st['snapshot']}) on {st['device']}, residency {st['residency']}",
        f"loaded: {', '.join(st['loaded']) or 'nothing'}; conditioning cache {st['cache_entries']} entries",
        f"next: {s.summary()}",
    ]
    lines += [f"  {name}: {path}" for name, path in s.anchors]
    lines += [f"  ref {i}: {r.describe()}" for i, r in enumerate(s.references, 1)]
    if state.out_dir is not None:
        lines.append(f"outputs: {state.out_dir}")
    lines.append(f"show {'on' if state.show else 'off'}, profile {'on' if state.profile else 'off'}")
    return lines


def _h_seed(state, value):
    if value == "random":
        value = secrets.randbelow(2**31)
    s = _set(state, seed=value)
    return [f"seed {s.seed}"]


def _h_seconds(state, value):
    s = _set(state, seconds=value, frames=None)
    return [f"{s.num_frames} frames ({s.duration:.3f} s)"] + list(s.notices)


def _h_frames(state, value):
    s = _set(state, frames=value, seconds=None)
    return [f"{s.num_frames} frames ({s.duration:.3f} s)"] + list(s.notices)


def _h_size(state, width, height):
    s = _set(state, width=width, height=height)
    return [f"size {s.width}x{s.height}"]


def _h_render(state, *value):
    if value == ("off",):
        _set(state, render_width=None, render_height=None)
        return ["render size off (model runs at the output size)"]
    s = _set(state, render_width=value[0], render_height=value[1])
    return [f"render {s.render_width}x{s.render_height}, upscaled to {s.width}x{s.height}"]


def _h_steps(state, value):
    s = _set(state, steps=value)
    return [f"{s.steps} denoising passes ({s.num_points} sigma grid points)"]


def _h_reuse(state, value):
    s = _set(state, reuse=value)
    return [f"reuse {s.reuse}"]


def _h_mode(state, mode):
    _set(state, mode=mode)
    lines = [f"mode {mode}"]
    device = getattr(state.session, "device", None)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if mode in ("strict", "auto") and getattr(device, "type", "") == "cpu" and not interpreted:
        lines.append(
            f"note: on the CPU strict kernels run only under TRITON_INTERPRET=1; without it {mode} "
            + ("fails closed" if mode == "strict" else "falls back to torch ops (recorded in the trace)")
        )
    return lines


def _anchor(state, which, value):
    if value == "clear":
        _set(state, **{which: None})
        return [f"{which} anchor cleared"]
    path = state.input_path(value, f"!{which}")
    new = state.settings.replace(**{which: path})
    state.get_session().check_request(new)  # decodes the image header: a non-image fails here, not mid-generation
    state.settings = new
    return [f"{which} anchor {path} ({new.task})"]


def _h_first(state, value):
    return _anchor(state, "first", value)


def _h_last(state, value):
    return _anchor(state, "last", value)


def _add_ref(state, kind, path, audio=None):
    flag = "!ref-" + ("image" if kind == "image" else kind)
    ref = Reference(
        kind,
        state.input_path(path, flag),
        state.input_path(audio, f"{flag} audio") if audio is not None else None,
    )
    new = state.settings.replace(references=state.settings.references + (ref,))
    state.get_session().check_request(new)  # media kinds, soundtracks and audio durations
    state.settings = new
    return [f"ref {len(new.references)}: {ref.describe()}"]


def _h_ref_image(state, path):
    return _add_ref(state, "image", path)


def _h_ref_video(state, path):
    return _add_ref(state, "video", path)


def _h_ref_silent_video(state, path):
    return _add_ref(state, "silent-video", path)


def _h_ref_video_audio(state, video, audio):
    return _add_ref(state, "video-audio", video, audio)


def _h_ref_audio(state, path):
    return _add_ref(state, "audio", path)


def _h_refs(state, *action):
    if action == ("clear",):
        _set(state, references=())
        return ["references cleared"]
    refs = state.settings.references
    if not refs:
        return ["no references"]
    return [f"{i}: {r.describe()}" for i, r in enumerate(refs, 1)]


def _h_ref_remove(state, index):
    refs = state.settings.references
    if not 1 <= index <= len(refs):
        raise CommandError(f"!ref-remove {index}: there are {len(refs)} references (1..{len(refs)})")
    removed = refs[index - 1]
    _set(state, references=refs[: index - 1] + refs[index:])
    return [f"removed ref {index}: {removed.describe()}"]


def _h_ablate(state, *args):
    from .session import ablation_factors

    try:
        factors = ablation_factors()
    except ValidationError as err:
        raise CommandError(f"!ablate: {err}") from None
    if not args:
        on = set(state.settings.ablations)
        return [f"{name}: {'on ' if name in on else 'off'} {text}" for name, text in factors.items()]
    name, switch = args
    if name not in factors:
        raise CommandError(f"!ablate {name}: unknown factor, one of {', '.join(factors)}")
    current = set(state.settings.ablations)
    current = current | {name} if switch == "on" else current - {name}
    _set(state, ablations=tuple(sorted(current)))
    return [f"ablation {name} {switch}: {factors[name]}"]


def _h_drift(state):
    try:
        from . import drift  # noqa: F401
    except ImportError:
        raise CommandError("!drift: first-drift localisation is not available yet (h3lab.drift is missing)") from None
    if len(state.results) < 2:
        raise CommandError(f"!drift: needs two generations, have {len(state.results)}")
    a, b = state.results[-2], state.results[-1]
    return state.get_session().drift_lines(a, b)


def _h_save(state, path):
    result = state.last
    out = state.resolve(path)
    written = state.get_session().save(result, out)
    return [f"saved {written}"]


def _h_trajectory(state, action, path):
    if action == "save":
        result = state.last
        written = result.trajectory.seal(state.resolve(path))
        return [f"trajectory {result.trajectory_hash} sealed in {written}"]
    target = state.resolve(path)
    if not target.is_dir():
        raise CommandError(f"!trajectory verify {path}: not a sealed trajectory directory")
    report = state.get_session().verify(target)
    return [str(report)]


def _h_plot(state, kind, path):
    from . import plots

    fig = plots.plot(kind, state.results, state.get_session())
    return [f"wrote {plots.save(fig, state.resolve(path))}"]


def _h_cache(state, *action):
    session = state.get_session()
    if action == ("clear",):
        n = session.clear_cache()
        return [f"cache cleared ({n} entries)"]
    entries = session.cache_info()
    if not entries:
        return ["conditioning cache is empty"]
    return [f"{e['kind']:<10} {e['key'][:16]}  {e['summary']}" for e in entries]


def _h_profile(state, switch):
    state.profile = switch == "on"
    return [f"profile {switch}"]


def _h_show(state, *switch):
    state.show = (not state.show) if not switch else switch[0] == "on"
    return [f"show {'on' if state.show else 'off'}"]


def _h_quit(state):
    state.running = False
    return []


def _h_generate(state, prompt):
    return run_generation(state, state.settings.replace(prompt=prompt))


def run_generation(state: SessionState, settings: GenerationSettings, cancel: threading.Event | None = None
                   ) -> list[str]:
    """Generate with `settings` (already validated), write the numbered output, keep the result, return lines.
    Front ends that queue generations capture `settings` when the line is entered and call this later, with one
    cancel event per generation; without one, `state.cancel` is cleared and used."""
    session = state.get_session()
    if cancel is None:
        cancel = state.cancel
        cancel.clear()
    output = state.next_output()
    result = session.generate(
        settings,
        progress=state.progress,
        cancel=cancel,
        preview=state.preview if state.show else None,
        output=output,
    )
    with state.lock:
        state.results = (state.results + [result])[-2:]
    return generation_lines(result, profile=state.profile)


def generation_lines(result, profile: bool = False) -> list[str]:
    """The lines a front end prints after a generation."""
    s = result.settings
    lines = list(s.notices)
    cached = [k for k, v in result.cached.items() if v]
    lines.append(
        f"{s.task} {s.width}x{s.height} {s.num_frames}f {s.steps} steps seed {result.seed} mode {s.mode}: "
        f"{result.total_seconds:.2f} s" + (f" (cached: {', '.join(cached)})" if cached else "")
    )
    lines.append(f"trajectory {result.trajectory_hash}")
    for path in result.outputs:
        lines.append(f"wrote {path}")
    if profile:
        lines += result.timing_lines()
    return lines


_HANDLERS: dict[str, Callable[..., list[str]]] = {
    "noop": _h_noop,
    "generate": _h_generate,
    "help": _h_help,
    "status": _h_status,
    "seed": _h_seed,
    "seconds": _h_seconds,
    "frames": _h_frames,
    "size": _h_size,
    "render": _h_render,
    "steps": _h_steps,
    "reuse": _h_reuse,
    "mode": _h_mode,
    "first": _h_first,
    "last": _h_last,
    "ref-image": _h_ref_image,
    "ref-video": _h_ref_video,
    "ref-silent-video": _h_ref_silent_video,
    "ref-video-audio": _h_ref_video_audio,
    "ref-audio": _h_ref_audio,
    "refs": _h_refs,
    "ref-remove": _h_ref_remove,
    "ablate": _h_ablate,
    "drift": _h_drift,
    "save": _h_save,
    "trajectory": _h_trajectory,
    "cache": _h_cache,
    "plot": _h_plot,
    "profile": _h_profile,
    "show": _h_show,
    "quit": _h_quit,
}
assert set(_HANDLERS) == set(COMMANDS) | {"noop", "generate"}


# ------------------------------------------------------------------------------------------------ replays
# `# expect <sha256>` checks on every machine; `# expect[TAG] <sha256>` only on a machine of arithmetic class TAG
# (`arithmetic_class()`): "cuda", or on a CPU "cpu_<torch's CPU capability>[_amx]" -- torch's CPU kernels (the
# text encoder, the VAEs, `off` mode) take ISA-specific paths (measured: the bf16 `off` DiT forward differs between
# an AMX machine and the machine that recorded the first lines), so a hash is a claim about one class.
# `--update` writes lines tagged with this machine's class.
EXPECT_RE = re.compile(r"^\s*#\s*expect(?:\[(?P<tag>[a-z0-9_]+)\])?\s+(?P<hash>\S+)\s*$")


def arithmetic_class(device: str) -> str:
    """The replay tag of this machine for `device` ("cpu" | "cuda"): "cuda", or "cpu_avx512_amx", "cpu_avx2", ..."""
    if device != "cpu":
        return device
    import torch

    tag = f"cpu_{torch.backends.cpu.get_cpu_capability().lower()}"
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        flags = ""
    return tag + ("_amx" if re.search(r"\bamx_bf16\b", flags) else "")


@dataclass
class ReplayReport:
    generations: int = 0
    checked: int = 0
    skipped: int = 0  # expect lines for another arithmetic class
    tag: str = ""  # this machine's arithmetic class (`arithmetic_class`)
    mismatches: list[str] = field(default_factory=list)
    unchecked: list[int] = field(default_factory=list)  # line numbers of generations without an expect line
    hashes: list[str] = field(default_factory=list)  # trajectory digest of every generation, in order
    updated: bool = False

    @property
    def ok(self) -> bool:
        return not self.mismatches


@dataclass
class _Pending:
    """The last generation line of a replay and the expect lines seen after it."""

    number: int  # 1-based line number of the generation
    digest: str
    index: int  # position of the generation line in the output lines
    last_index: int  # position of the last expect line for it (or the generation line)
    matched: bool = False  # an expect line for this device (or untagged) was seen


def run_replay(
    state: SessionState,
    path: str | Path,
    update: bool = False,
    echo: Callable[[str], None] = print,
) -> ReplayReport:
    """Run a `.h3` replay: every line through `parse`/`execute`. `# expect` lines after a generation line check its
    trajectory digest (see `EXPECT_RE` for arithmetic-class tags); a generation without one is reported as unchecked.
    Any command error stops the replay (`ReplayError` naming file:line). With `update`, this class's expect lines are
    rewritten (or inserted under their generation line) and the file is replaced atomically. On the CPU the replay
    runs with one torch thread, on CUDA with deterministic cuDNN (see below)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ReplayError(f"replay {str(path)!r}: {err.strerror or err}") from None
    lines = text.splitlines()
    session = state.get_session()
    session.clear_cache()  # a replay starts from nothing the session computed before (same bytes as a fresh run)
    device = session.device.type
    tag = arithmetic_class(device)
    import torch

    # A replay's hashes must not depend on the machine's core count or on autotuning: torch's CPU kernels reduce in
    # a thread-count-dependent order (measured: the audio VAE encode of a reference soundtrack differs between 1 and
    # 2 threads), so CPU replays run single-threaded; on CUDA cuDNN is held to deterministic, non-benchmarked
    # algorithms. Both are restored afterwards.
    threads = torch.get_num_threads()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    if device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        return _run_replay(state, path, text, lines, update, echo, tag)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def _run_replay(state, path, text, lines, update, echo, tag) -> ReplayReport:
    """`run_replay`'s loop; `tag` is the machine's arithmetic class, the tag its expect lines carry."""
    from .io_utils import atomic_write_text

    report = ReplayReport(tag=tag)
    out: list[str] = []
    pending: _Pending | None = None

    def close_pending() -> None:
        nonlocal pending
        if pending is not None and not pending.matched:
            report.unchecked.append(pending.number)
            if update:
                out.insert(pending.last_index + 1, f"# expect[{tag}] {pending.digest}")
        pending = None

    consumed = 0
    for number, line in enumerate(lines, 1):
        consumed = number
        m = EXPECT_RE.match(line)
        if m:
            if pending is None:
                raise ReplayError(f"{path}:{number}: '# expect' without a generation line before it")
            line_tag, expected = m.group("tag"), m.group("hash")
            if line_tag is not None and line_tag != tag:
                report.skipped += 1
                out.append(line)
                pending.last_index = len(out) - 1
                continue
            report.checked += 1
            pending.matched = True
            out.append(f"# expect[{tag}] {pending.digest}" if update else line)
            pending.last_index = len(out) - 1
            if expected != pending.digest:
                report.mismatches.append(f"{path}:{number}: expected {expected}, got {pending.digest}")
                echo(f"MISMATCH {path}:{number}: expected {expected}, got {pending.digest}")
            else:
                echo(f"ok {path}:{number}: {pending.digest}")
            continue
        try:
            cmd = parse(line)
            if cmd.name != "noop":
                close_pending()
            out.append(line)
            if cmd.name == "noop":
                continue
            echo(f"h3> {line.strip()}")
            for text_line in execute(state, cmd):
                echo(text_line)
        except H3Error as err:
            raise ReplayError(f"{path}:{number}: {err}") from None
        if cmd.name == "generate":
            digest = state.last.trajectory_hash
            report.generations += 1
            report.hashes.append(digest)
            pending = _Pending(number, digest, len(out) - 1, len(out) - 1)
        if not state.running:
            break
    close_pending()
    if update:
        new_text = "\n".join(out + lines[consumed:]) + "\n"
        if new_text != text:
            atomic_write_text(path, new_text)
            report.updated = True
    return report
