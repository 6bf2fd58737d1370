"""The one command grammar every front end shares (REPL, scripted replays, notebook widgets), and its registry.

A line is parsed into a `Command` (`parse`), then executed against a `SessionState` (`execute`), which returns the
output lines. Parsing checks the command name, the arity and the argument types; execution checks everything that
needs the world (files, the model, earlier results). Both raise `H3Error` subclasses with one line, and execution
mutates the state only after every check passed, so a rejected line leaves the session exactly as it was.

Grammar:
- an empty line, or a line starting with `#`, does nothing (replays put `# expect <sha256>` lines there, see
  `h3lab.frontends.replay`);
- a line starting with `!` is a command, its arguments split like a POSIX shell (quote paths with spaces);
- any other line is a prompt and generates with the current settings.

Relative paths resolve against `SessionState.base_dir` (the working directory in the REPL, the replay file's folder
in a replay), so a replay is self-contained.

The registry: `COMMANDS` (name -> `CommandSpec`, in `!help` order) holds each command once -- usage, summary,
argument parser, handler, completion and aliases -- declared by the `@command(...)` decorator on its handler:

    @command("refs", "!refs [clear]", "list the references in order, or remove them all", parse=_p_clear,
             args=(Arg(("clear",)),))
    def _h_refs(state, *action):          # receives the parser's tuple as positional arguments
        ...
        return ["references cleared"]      # the output lines

`parse(name, words) -> tuple` turns the words after the name into typed values or raises `CommandError`; the
handler runs them against the state. The settings' commands (`!seed`, `!steps`, `!size`, `!mode`, the presets', and
any setting declared later) are not written here: `_setting_command` generates each from its declaration in the
settings schema (`h3lab.schema`, `Setting.command`), the word parsers are `h3lab.schema.words`. `help_lines()`, the REPL's completer (`args`, `aliases`, `drain`) and every
front end that runs lines (`run_line`, the widgets' `command()`) read this one table.
"""

from __future__ import annotations

import shlex
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import CommandError, H3Error  # noqa: F401 - CommandError: re-exported (h3lab.schema.words raises it)
from ..io_utils import check_output_dir, check_output_file
from ..schema import SETTINGS, Setting
from ..schema.words import choice, int_word, no_args, one, p_choice, p_float, p_int, p_on_off, p_word
from ..app.session import GenerationCancelled  # noqa: F401 - re-exported for front ends
from ..schema.generation_settings import GenerationSettings, Reference, check_path


@dataclass(frozen=True)
class Command:
    """A parsed line: `name` is a command name from `COMMANDS`, "generate" or "noop"; `args` are typed values."""

    name: str
    args: tuple = ()
    line: str = ""


# ------------------------------------------------------------------------------------------------ the registry
@dataclass(frozen=True)
class Arg:
    """How one argument position completes in the REPL: keywords (a tuple, or a zero-argument callable that computes
    them when asked, e.g. the ablation factors) and/or file paths."""

    words: tuple[str, ...] | Callable[[], Iterable[str]] = ()
    path: bool = False

    def keywords(self) -> tuple[str, ...]:
        return tuple(self.words() if callable(self.words) else self.words)


@dataclass(frozen=True)
class CommandSpec:
    """One command: `usage` ("!name ARGS") and `summary` for `!help`; `parse(name, words) -> tuple` checks the words
    after the name (raises `CommandError`); `handler(state, *args) -> list[str]` executes; `args` completes each
    argument position; `aliases` are other names; `drain`: the REPL lets queued generations finish first (the command
    reads results or the session)."""

    name: str
    usage: str
    summary: str
    parse: Callable[[str, list[str]], tuple]
    handler: Callable[..., list[str]]
    args: tuple[Arg, ...] = ()
    aliases: tuple[str, ...] = ()
    drain: bool = False


COMMANDS: dict[str, CommandSpec] = {}
ALIASES: dict[str, str] = {}  # alias -> command name


def command(
    name: str,
    usage: str,
    summary: str,
    *,
    parse: Callable[[str, list[str]], tuple],
    args: tuple[Arg, ...] = (),
    aliases: tuple[str, ...] = (),
    drain: bool = False,
) -> Callable[[Callable[..., list[str]]], Callable[..., list[str]]]:
    """Register the decorated handler as command `name` (see the module docstring). A name or alias taken twice, or
    a usage that does not start with `!name`, raises at import time."""

    def register(handler: Callable[..., list[str]]) -> Callable[..., list[str]]:
        taken = [n for n in (name, *aliases) if n in COMMANDS or n in ALIASES or n in ("generate", "noop")]
        if taken:
            raise ValueError(f"command !{name}: the name {taken[0]!r} is already registered")
        if usage.split()[0] != f"!{name}":
            raise ValueError(f"command !{name}: usage {usage!r} must start with '!{name}'")
        COMMANDS[name] = CommandSpec(name, usage, summary, parse, handler, tuple(args), tuple(aliases), drain)
        ALIASES.update({alias: name for alias in aliases})
        return handler

    return register


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


def execute(state: SessionState, cmd: Command) -> list[str]:
    """Run one parsed command; returns output lines. Raises `H3Error` (state unchanged) on any rejected input."""
    if cmd.name == "noop":
        return []
    if cmd.name == "generate":
        return run_generation(state, state.settings.replace(prompt=cmd.args[0]))
    spec = COMMANDS.get(cmd.name)
    if spec is None:
        raise CommandError(f"unknown command {cmd.name!r}")
    return spec.handler(state, *cmd.args)


def run_line(state: SessionState, line: str) -> list[str]:
    """parse + execute."""
    return execute(state, parse(line))


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
    zoom: int = 2  # --show display factor (h3lab.frontends.preview: 2 for Retina screens)
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

    def check_mode(self, mode: str, what: str = "!mode strict") -> None:
        """Refuse a mode the session's device cannot run in this process (strict on a CPU without the interpreter),
        now rather than at the next generation; a session not started yet is checked when it generates."""
        from ..execution.whatran import check_strict_runs

        device = getattr(self.session, "device", None)
        if device is not None:
            check_strict_runs(mode, device, what)

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

    def next_output(self) -> tuple[int, Path | None]:
        """(number, path) of the next numbered video in `out_dir` (001.mp4, 002.mp4, ...), skipping numbers already
        on disk. Nothing is reserved: `run_generation` sets `counter` to the number only once the video is written,
        so a failed or cancelled generation uses no number (001, 002, 003 after a failure, never 001, 002, 005)."""
        if self.out_dir is None:
            return self.counter, None
        number = self.counter
        while True:
            number += 1
            path = self.out_dir / f"{number:03d}.mp4"
            if not path.exists():
                return number, path

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


def _set(state: SessionState, **changes: Any) -> GenerationSettings:
    new = state.settings.replace(**changes)  # validates; raises before anything is assigned
    state.settings = new
    return new


# ------------------------------------------------------------------------------------------------ argument parsers
_one, _int_arg, _choice, _p_int, _p_on_off = one, int_word, choice, p_int, p_on_off


def _p_path_or_clear(name, args):
    return (_one(name, args, "PATH|clear"),)


def _p_path(name, args):
    return (_one(name, args, "PATH"),)


def _p_two_paths(name, args):
    if len(args) != 2:
        raise CommandError(f"!{name} expects VIDEO AUDIO, got {' '.join(args)!r}")
    return tuple(args)


def _p_clear(name, args):
    """No argument, or the word `clear`."""
    if not args:
        return ()
    return (_choice(name, _one(name, args, "[clear]"), ("clear",)),)


def _p_show(name, args):
    return () if not args else _p_on_off(name, args)


def _p_ablate(name, args):
    if not args:
        return ()
    if len(args) != 2:
        raise CommandError(f"!{name} expects FACTOR on|off, got {' '.join(args)!r}")
    return (args[0], _choice(name, args[1], ("on", "off")))


def _p_trajectory(name, args):
    keep = None
    if len(args) == 4 and args[0] == "save" and args[2] == "--keep":
        keep, args = args[3], args[:2]
    if len(args) != 2:
        raise CommandError(f"!{name} expects save|verify PATH (save PATH --keep latents), got {' '.join(args)!r}")
    if keep is not None:
        from ..run.trajectory import TrajectoryError, check_keep

        try:
            keep = check_keep(keep, f"!{name} save --keep")
        except TrajectoryError as err:
            raise CommandError(str(err)) from None
    return (_choice(name, args[0], ("save", "verify")), args[1]) + ((keep,) if keep is not None else ())


def _plot_kinds() -> tuple[str, ...]:
    from ..research.plots import PLOTS  # matplotlib: loaded when a plot is asked for, not with the grammar

    return tuple(PLOTS)


def _p_plot(name, args):
    kinds = _plot_kinds()
    if len(args) != 2:
        raise CommandError(f"!{name} expects KIND PATH.png (KIND: {'|'.join(kinds)}), got {' '.join(args)!r}")
    if not args[1].lower().endswith(".png"):
        raise CommandError(f"!{name} {args[1]}: the plot path must end in .png")
    return (_choice(name, args[0], kinds), args[1])


def _p_lora(name, args):
    if len(args) == 1 and args[0] == "off":
        return ("off",)
    if len(args) not in (1, 2):
        raise CommandError(f"!{name} takes PATH [SCALE] or off, got {len(args)} arguments")
    if len(args) == 1:
        return (args[0], 1.0)
    try:
        return (args[0], float(args[1]))
    except ValueError:
        raise CommandError(f"!{name} {args[0]} {args[1]}: SCALE must be a number") from None


def _ablation_factors() -> tuple[str, ...]:
    from ..app.session import ablation_factors

    return tuple(ablation_factors())


ON_OFF = Arg(("on", "off"))
PATH = Arg(path=True)
PATH_OR_CLEAR = Arg(("clear",), path=True)
CLEAR = Arg(("clear",))


# ------------------------------------------------------------------------------------------------ commands
# Registration order is the `!help` order.
@command("help", "!help", "this list", parse=no_args, aliases=("h", "?"))
def _h_help(state):
    return help_lines()


@command("status", "!status", "model, device, settings, anchors and references", parse=no_args, drain=True)
def _h_status(state):
    s = state.settings
    session = state.get_session()
    st = session.status()
    lines = [
        f"model {st['model']} ({st['snapshot']}) on {st['device']}, residency {st['residency']}",
        *st.get("streaming", ()),
        f"loaded: {', '.join(st['loaded']) or 'nothing'}; conditioning cache {st['cache_entries']} entries",
        f"next: {s.summary()}",
    ]
    from ..adapters.field import describe

    if getattr(session, "adapters", ()):
        lines.append(f"adapter: {describe(session.adapters)}")
    lines += [f"  {name}: {path}" for name, path in s.anchors]
    lines += [f"  ref {i}: {r.describe()}" for i, r in enumerate(s.references, 1)]
    if state.out_dir is not None:
        lines.append(f"outputs: {state.out_dir}")
    lines.append(f"show {'on' if state.show else 'off'}, profile {'on' if state.profile else 'off'}")
    return lines


@command("mesh", "!mesh", "the device mesh (torchrun --tp/--cp): topology, ranks, row-parallel strategy, this rank",
         parse=no_args, drain=True)
def _h_mesh(state):
    mesh = getattr(state.get_session(), "mesh", None)
    if mesh is None:
        return ["one process, no mesh (torchrun --nproc-per-node N -m h3lab --tp T --cp C runs on a mesh)"]
    t = mesh.topology
    return [f"mesh {t.name}: {t.world_size} rank(s), row-parallel {t.strategy}, sequence parallel "
            f"{'on' if t.sp else 'off'}; this front end is rank {mesh.rank} on {mesh.device} "
            f"({mesh.transport if mesh.backend else 'no process group'}); generations record placement {t.name}"
            + ("; shared device: timings are bytes only" if mesh.timing_label.startswith("bytes only") else "")]


# The settings' commands, generated from their declarations (h3lab.schema): !seed, !seconds, !frames, !size,
# !render, !steps, !reuse, the presets' (!layers, !core-reuse, !token-reduction, !reference-rope), !mode, ...
def _setting_command(setting: Setting) -> None:
    """Register the `@command` of a declared generation setting (`Setting.command`; defaults by its type)."""
    repl = setting.command
    if repl is None or setting.target != "generation":
        return
    name = repl.name or setting.name.replace("_", "-")
    choices = setting.allowed()
    if setting.type is bool:
        form, parser, complete = "on|off", p_on_off, (("on", "off"),)
    elif choices is not None:
        form, parser, complete = "|".join(choices), p_choice(tuple(choices)), (tuple(choices),)
    else:
        form = {int: "N", float: "X"}.get(setting.type, "VALUE")
        parser, complete = {int: p_int, float: p_float}.get(setting.type, p_word), ()

    def handler(state, *args):
        if repl.changes is not None:
            changes = repl.changes(state, *args)
        else:
            changes = {setting.name: args[0] == "on" if setting.type is bool else args[0]}
        new = state.settings.replace(**changes)  # validates; raises before anything is assigned
        if repl.check is not None:
            repl.check(state, new)
        state.settings = new
        if repl.reply is not None:
            return repl.reply(new, state)
        return [f"{name} {setting.word(getattr(new, setting.name))}"]

    handler.__name__ = f"_h_{name.replace('-', '_')}"
    complete = repl.complete if repl.complete is not None else complete
    command(name, repl.usage or f"!{name} {form}", repl.summary or setting.help, parse=repl.parse or parser,
            args=tuple(Arg(words) for words in complete), drain=repl.drain)(handler)


for _declared in SETTINGS:
    _setting_command(_declared)
SETTINGS.on_declare(_setting_command)  # a setting declared later gets its command at once


@command("zoom", "!zoom N", "display factor of --show previews (1-8; 2 for Retina screens)", parse=_p_int)
def _h_zoom(state, n):
    from .preview import check_zoom

    state.zoom = check_zoom(n, "!zoom")
    return [f"zoom {n}"]



def _anchor(state, which, value):
    if value == "clear":
        _set(state, **{which: None})
        return [f"{which} anchor cleared"]
    path = state.input_path(value, f"!{which}")
    new = state.settings.replace(**{which: path})
    state.get_session().check_request(new)  # decodes the image header: a non-image fails here, not mid-generation
    state.settings = new
    return [f"{which} anchor {path} ({new.task})"]


@command("first", "!first PATH|clear", "first-frame anchor (fl2va)", parse=_p_path_or_clear, args=(PATH_OR_CLEAR,))
def _h_first(state, value):
    return _anchor(state, "first", value)


@command("last", "!last PATH|clear", "last-frame anchor (fl2va)", parse=_p_path_or_clear, args=(PATH_OR_CLEAR,))
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


@command("ref-image", "!ref-image PATH", "append an image reference (<Picture N>)", parse=_p_path, args=(PATH,))
def _h_ref_image(state, path):
    return _add_ref(state, "image", path)


@command("ref-video", "!ref-video PATH", "append a video reference with its soundtrack", parse=_p_path,
         args=(PATH,))
def _h_ref_video(state, path):
    return _add_ref(state, "video", path)


@command("ref-silent-video", "!ref-silent-video PATH", "append a video reference, soundtrack ignored",
         parse=_p_path, args=(PATH,))
def _h_ref_silent_video(state, path):
    return _add_ref(state, "silent-video", path)


@command("ref-video-audio", "!ref-video-audio VIDEO AUDIO", "append a video reference with a replacement soundtrack",
         parse=_p_two_paths, args=(PATH, PATH))
def _h_ref_video_audio(state, video, audio):
    return _add_ref(state, "video-audio", video, audio)


@command("ref-audio", "!ref-audio PATH", "append a standalone audio reference (needs an image/video ref)",
         parse=_p_path, args=(PATH,))
def _h_ref_audio(state, path):
    return _add_ref(state, "audio", path)


@command("refs", "!refs [clear]", "list the references in order, or remove them all", parse=_p_clear, args=(CLEAR,))
def _h_refs(state, *action):
    if action == ("clear",):
        _set(state, references=())
        return ["references cleared"]
    refs = state.settings.references
    if not refs:
        return ["no references"]
    return [f"{i}: {r.describe()}" for i, r in enumerate(refs, 1)]


@command("ref-remove", "!ref-remove N", "remove reference N (1-based)", parse=_p_int)
def _h_ref_remove(state, index):
    refs = state.settings.references
    if not 1 <= index <= len(refs):
        raise CommandError(f"!ref-remove {index}: there are {len(refs)} references (1..{len(refs)})")
    removed = refs[index - 1]
    _set(state, references=refs[: index - 1] + refs[index:])
    return [f"removed ref {index}: {removed.describe()}"]


@command("ablate", "!ablate FACTOR on|off", "switch an ablation factor for the next generations", parse=_p_ablate,
         args=(Arg(_ablation_factors), ON_OFF))
def _h_ablate(state, *args):
    from ..app.session import ablation_factors

    factors = ablation_factors()
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


@command("lora", "!lora PATH [SCALE]|off", "generate with a LoRA adapter (PEFT folder or .safetensors), or without",
         parse=_p_lora, args=(Arg(("off",), path=True),), drain=True)
def _h_lora(state, path, scale=None):
    session = state.get_session()
    if path == "off":
        session.unload_lora()
        return ["lora off"]
    entry = session.load_lora(state.resolve(path), scale)  # checked before any model loads; state unchanged on error
    return [f"lora {entry['name']} scale {entry['scale']:g} (sha256 {entry['sha256'][:16]}) for the next generations"]


def _p_rollout(name, args):
    if len(args) < 3:
        raise CommandError(f"!{name} expects G REWARD PROMPT (G >= 2 requests; REWARD a shipped name or "
                           f"module:function), got {' '.join(args)!r}")
    group = _int_arg(name, args[0], "G REWARD PROMPT")
    if group < 2:
        raise CommandError(f"!{name} G={group}: a group needs at least 2 requests")
    from ..training.rewards import resolve_reward

    resolve_reward(args[1])  # an unknown reward fails here, before any model loads
    return (group, args[1], " ".join(args[2:]))


@command("rollout", "!rollout G REWARD PROMPT", "G flow_sde rollouts of PROMPT: each request's reward and the "
         "ratio exp(logp_replay - logp_rollout) of every pass replayed alone", parse=_p_rollout, drain=True)
def _h_rollout(state, group, reward_name, prompt):
    session = state.get_session()
    lines = session.rollout_report(prompt, group=group, reward=reward_name, settings=state.settings)
    return lines


def _last_two(state, what: str) -> tuple:
    if len(state.results) < 2:
        raise CommandError(f"{what}: needs two generations, have {len(state.results)}")
    return state.results[-2], state.results[-1]


@command("drift", "!drift", "first drift between the last two generations", parse=no_args, drain=True)
def _h_drift(state):
    a, b = _last_two(state, "!drift")
    return state.get_session().drift_lines(a, b)


def parse_heads(name: str, word: str) -> tuple[int, ...] | None:
    """HEADS: "all" (None), "0,2" or "0-3" (a range, inclusive)."""
    if word == "all":
        return None
    heads: list[int] = []
    for part in word.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or hi and not hi.isdigit():
            raise CommandError(f"!{name} heads {word!r}: must be all, a list 0,2 or a range 0-3")
        heads += range(int(lo), int(hi or lo) + 1)
    return tuple(heads)


def _p_attention(name, args):
    """BLOCK [HEADS] [pass N] [from REGION] [to REGION] [PATH.png] -> (block, heads, step, query, keys, path)."""
    usage = f"!{name} BLOCK [HEADS] [pass N] [from REGION] [to REGION] [PATH.png]"
    words = list(args)
    if not words or not words[0].isdigit():
        raise CommandError(f"{usage}: BLOCK must be a block index, got {' '.join(args)!r}")
    out: dict[str, Any] = {"block": int(words.pop(0)), "heads": None, "pass": None, "from": None, "to": None,
                           "path": None}
    if words and words[0] not in ("pass", "from", "to") and not words[0].lower().endswith(".png"):
        out["heads"] = parse_heads(name, words.pop(0))
    while words:
        word = words.pop(0)
        if word in ("pass", "from", "to") and words and out[word] is None:
            out[word] = words.pop(0)
        elif word.lower().endswith(".png") and not words:
            out["path"] = word
        else:
            raise CommandError(f"{usage}: unexpected {word!r}")
    step = None if out["pass"] is None else int_word(name, out["pass"], "pass N (1 = the first pass)") - 1
    return (out["block"], out["heads"], step, out["from"], out["to"], out["path"])


@command("attention", "!attention BLOCK [HEADS] [pass N] [from REGION] [to REGION] [PATH.png]",
         "who attends to whom at one block of the last generation: exact softmax rows summed over text tokens, "
         "references, video frames and audio time (REGION: text|video|audio|ref|cond|frame3|t2 ...)",
         parse=_p_attention, args=(Arg(("all",)),), drain=True)
def _h_attention(state, block, heads, step, query, keys, path):
    target = check_output_file(state.resolve(path), (".png",), "!attention") if path else None
    view = state.get_session().attention(state.last, block, step=step, heads=heads, query=query)
    columns = view.keys(keys) if keys else None
    lines = view.lines(keys=columns)
    if target is not None:
        from ..research import plots

        lines.append(f"wrote {plots.save(plots.attention_figure(view, keys=columns), target)}")
    return lines


def _p_optional_png(name, args):
    if len(args) > 1 or args and not args[0].lower().endswith(".png"):
        raise CommandError(f"!{name} [PATH.png]: got {' '.join(args)!r}")
    return tuple(args)


@command("compare", "!compare [PATH.png]", "matched-seed A/B of the last two generations: PSNR/SSIM per frame, "
         "audio spectral distance and RMS ratio, attribute reads, first drift", parse=_p_optional_png,
         args=(PATH,), drain=True)
def _h_compare(state, *path):
    a, b = _last_two(state, "!compare")
    target = check_output_file(state.resolve(path[0]), (".png",), "!compare") if path else None
    comparison = state.get_session().compare(a, b)
    lines = comparison.lines()
    if target is not None:
        from ..research import plots

        lines.append(f"wrote {plots.save(plots.compare_figure(comparison), target)}")
    return lines


@command("save", "!save PATH", "write the last generation (.mp4 video+audio, .wav audio)", parse=_p_path,
         args=(PATH,), drain=True)
def _h_save(state, path):
    result = state.last
    out = state.resolve(path)
    written = state.get_session().save(result, out)  # checks the suffix and the folder before encoding
    return [f"saved {written}"]


def _trajectory_target(state, path: str) -> Path:
    """Where `!trajectory save PATH` may seal (`trajectory.check_seal_target`: a new or empty folder, or a sealed
    trajectory, which is replaced whole)."""
    from ..run.trajectory import TrajectoryError, check_seal_target

    try:
        return check_seal_target(state.resolve(path), f"!trajectory save {path}", "!trajectory save")
    except TrajectoryError as err:
        raise CommandError(str(err)) from None


@command("trajectory", "!trajectory save|verify PATH [--keep latents]",
         "seal the last trajectory in PATH (--keep: with those per-pass tensors, re-recorded when the generation "
         "kept none) / replay a sealed one and compare", parse=_p_trajectory,
         args=(Arg(("save", "verify")), PATH, Arg(("--keep",)), Arg(("latents", "velocities", "noise"))), drain=True)
def _h_trajectory(state, action, path, keep=None):
    if action == "save":
        result = state.last
        target = _trajectory_target(state, path)
        lines = []
        if keep:
            from ..app.keep import kept_trajectory

            trajectory, rerun = kept_trajectory(state.get_session(), result, keep)
            if rerun:
                result.trajectory = trajectory  # the same run (digest checked), now with its tensors
                lines.append(f"re-ran the last generation's run spec to keep {','.join(keep)} (same digest)")
        written = result.trajectory.seal(target)
        return lines + [f"trajectory {result.trajectory_hash} sealed in {written}"]
    target = state.resolve(path)
    if not target.is_dir():
        raise CommandError(f"!trajectory verify {path}: not a sealed trajectory directory")
    report = state.get_session().verify(target)
    return [str(report)]


@command("cache", "!cache [clear]", "conditioning cache entries", parse=_p_clear, args=(CLEAR,), drain=True)
def _h_cache(state, *action):
    session = state.get_session()
    if action == ("clear",):
        n = session.clear_cache()
        return [f"cache cleared ({n} entries)"]
    entries = session.cache_info()
    if not entries:
        return ["conditioning cache is empty"]
    return [f"{e['kind']:<10} {e['key'][:16]}  {e['summary']}" for e in entries]


@command("plot", "!plot KIND PATH.png", "latents|norms|drift|ablation|sigmas of the recent generations",
         parse=_p_plot, args=(Arg(_plot_kinds), PATH), drain=True)
def _h_plot(state, kind, path):
    from ..research import plots

    target = check_output_file(state.resolve(path), (".png",), "!plot")  # before a drift re-run or the matrix
    session = state.get_session()
    source: Any = state.results
    if kind == "drift":  # the session re-runs the two generations; the figure only draws its report
        source = session.drift(*_last_two(state, "!plot drift"))
    elif kind == "ablation":
        source = _ablation_rows(session)
    fig = plots.plot(kind, source, session)
    return [f"wrote {plots.save(fig, target)}"]


def _ablation_rows(session) -> list[dict]:
    """The ablation matrix on the session's snapshot, with the rows this process cannot run marked "not run"
    (`passed` None) instead of failed: a strict arm on a CPU without TRITON_INTERPRET=1 raises `StrictError` before
    any comparison, which says nothing about the row's hypothesis."""
    from ..research import ablation

    rows = ablation.run_matrix(ablation.tiny_bench(str(session.path)))
    for row in rows:
        if row.get("status") == "ERROR" and "StrictError" in str(row.get("observed", "")) \
                and "TRITON_INTERPRET" in str(row.get("observed", "")):
            row.update(status="NOT RUN", passed=None,
                       observed="not run: strict kernels need TRITON_INTERPRET=1 on the CPU (set it before starting)")
    return rows


@command("profile", "!profile on|off", "print phase timings and peak memory after each generation",
         parse=_p_on_off, args=(ON_OFF,))
def _h_profile(state, switch):
    state.profile = switch == "on"
    return [f"profile {switch}"]


@command("show", "!show [on|off]", "preview the middle frame after every denoising pass", parse=_p_show,
         args=(ON_OFF,))
def _h_show(state, *switch):
    state.show = (not state.show) if not switch else switch[0] == "on"
    return [f"show {'on' if state.show else 'off'}"]


@command("streaming", "!streaming on|off", "stream the DiT's blocks from host memory through two GPU slots, or keep "
         "them resident", parse=_p_on_off, args=(ON_OFF,), drain=True)
def _h_streaming(state, switch):
    session = state.get_session()
    residency = "streamed" if switch == "on" else "resident"
    return session.set_residency(residency, session.gpu_memory if switch == "on" else None)


@command("adaln", "!adaln tables|resident", "keep the DiT blocks' AdaLN weights in host memory and only the AdaLN "
         "tables of each run on the GPU, or keep them resident", parse=p_choice(("tables", "resident")),
         args=(Arg(("tables", "resident")),), drain=True)
def _h_adaln(state, placement):
    session = state.get_session()
    return session.set_residency(session.residency, session.gpu_memory, placement)


@command("plan", "!plan", "what the next generation needs on the GPU: resident / streamed blocks, AdaLN tables, "
         "estimated peak against the card", parse=no_args)
def _h_plan(state):
    return state.get_session().plan(state.settings).lines()


@command("quit", "!quit", "leave (also !exit, Ctrl-D)", parse=no_args, aliases=("exit", "q"))
def _h_quit(state):
    state.running = False
    return []


# ------------------------------------------------------------------------------------------------ generation
def run_generation(state: SessionState, settings: GenerationSettings, cancel: threading.Event | None = None
                   ) -> list[str]:
    """Generate with `settings` (already validated), write the numbered output, keep the result, return lines.
    Front ends that queue generations capture `settings` when the line is entered and call this later, with one
    cancel event per generation; without one, `state.cancel` is cleared and used."""
    session = state.get_session()
    if cancel is None:
        cancel = state.cancel
        cancel.clear()
    number, output = state.next_output()
    result = session.generate(
        settings,
        progress=state.progress,
        cancel=cancel,
        preview=state.preview if state.show else None,
        output=output,
    )
    with state.lock:
        state.counter = number  # only a written video takes a number
        state.results = (state.results + [result])[-2:]
    return generation_lines(result, profile=state.profile)


def what_ran(result) -> str:
    """"ran " + the one line of `h3lab.execution.whatran.what_ran` over the generation's trajectory provenance summary: what
    served the transformer's op calls, with the requested mode when it differs ("ran auto → torch: ...") and why."""
    from ..execution.whatran import what_ran as line

    trace = (getattr(result.trajectory, "manifest", None) or {}).get("trace") or {}
    reasons = [r.fallback for r in getattr(result.trace, "fallbacks", ()) or () if r.fallback]
    from ..adapters.field import describe

    adapter = describe(getattr(getattr(result, "arm", None), "adapters", ()))
    return "ran " + line(trace, result.settings.mode, reasons, result.settings.ablations) + (
        f"; with {adapter}" if adapter else "")


def generation_lines(result, profile: bool = False) -> list[str]:
    """The lines a front end prints after a generation."""
    from ..presets import preset_lines

    s = result.settings
    lines = list(s.notices) + preset_lines(getattr(getattr(result, "arm", None), "preset", None))
    cached = [k for k, v in result.cached.items() if v]
    declared = "".join(f" {part}" for part in s.declared_parts())  # a non-Euler stepper, its level, ...
    lines.append(
        f"{s.task} {s.width}x{s.height} {s.num_frames}f {s.steps} steps seed {result.seed} mode {s.mode}{declared}: "
        f"{result.total_seconds:.2f} s" + (f" (cached: {', '.join(cached)})" if cached else "")
    )
    lines.append(what_ran(result))
    lines.append(f"trajectory {result.trajectory_hash}")
    for path in result.outputs:
        lines.append(f"wrote {path}")
    if profile:
        lines += result.timing_lines()
    return lines
