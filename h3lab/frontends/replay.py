"""Scripted replays: a `.h3` file is REPL lines run through the command grammar, with its sealed expected hashes.

Contract
- `run_replay(state, path, update=False, echo=print) -> ReplayReport`: every line goes through `commands.parse` /
  `commands.execute` against `state` (a `commands.SessionState`; relative paths resolve against its `base_dir`, so
  a replay is self-contained when `base_dir` is the file's folder). The file is read and every line parsed before
  the session is built, so bytes that are not UTF-8 or a malformed command fail at once (`ReplayError` naming
  file:line); a line rejected while running stops the replay the same way.
- Before the first line runs, the whole replay is validated (`validate_replay`): every line parses, every `# expect`
  line is `# expect[TAG] <64 hex digits>` after a generation line, there is at least one generation, and every
  setting command runs on a scratch copy of the settings (values, input paths, `!mode strict` where strict cannot
  run); each generation's settings are checked (paths, strict, and on a mesh of several ranks the mode: strict only,
  since a forward there runs strict). So `!size 100x100` or `!first /nope.png` on line 6 fails before line 5's
  generation runs. Commands that need results (`!drift`, `!save`, `!trajectory`, ...) are checked when they run.
- `# expect <sha256>` after a generation line checks that generation's trajectory digest
  (`trajectory.Trajectory.digest`) on every machine; `# expect[TAG] <sha256>` only on a machine of arithmetic class
  TAG (`arithmetic_class`: torch's CPU capability, and AMX for oneDNN). A strict generation's line may carry the
  class without `_amx` (`strict_class`): the DiT runs in Triton's interpreter (measured equal on an AVX-512 and an
  AVX-512+AMX machine), but the interpreter's numpy loops, the noise (torch's vectorised normal sampler) and the
  text encoder take ISA-specific paths (AVX2 and `ATEN_CPU_CAPABILITY=default` give other digests). No CPU digest
  is machine-free, so the shipped replays carry lines for several classes (docs/replays.md). A generation without
  a line for this class is reported as unchecked and run a second time, from empty conditioning caches with the
  same settings, before the next line runs (`repeat=True`, the default): its digest must repeat, else the replay
  fails (`unrepeated`). So a replay on a class it holds no lines for still checks something -- that every result
  is reproducible here -- and passes when every digest repeats. `repeat=False` (the CLI's `--allow-unchecked`)
  skips the second runs.
- `update=True` rewrites this class's expect lines (or inserts them under their generation line; strict generations
  get the `strict_class` tag) and replaces the file atomically; lines of other classes are kept.
- A replay starts from an empty conditioning cache and runs with one torch thread on the CPU, deterministic
  non-benchmarked cuDNN on CUDA (restored afterwards), so its hashes do not depend on the core count or autotuning.

The grammar itself (`parse`, `execute`, the command registry) is `h3lab.frontends.commands`; this module only drives it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..execution.arithmetic import arithmetic_class, cpu_class, strict_class  # noqa: F401 - the replay tags
from .commands import SessionState, execute, parse
from ..errors import H3Error
from ..io_utils import atomic_write_text


class ReplayError(H3Error):
    """A replay line failed (prefixed with file:line)."""


# `# expect <sha256>` checks on every machine; `# expect[TAG] <sha256>` only on a machine of arithmetic class TAG
# (`arithmetic_class()`): torch's CPU kernels (the text encoder, the VAEs, `off` mode) and oneDNN's bf16 matmuls
# take ISA-specific paths, so a hash is a claim about one class. `--update` writes lines tagged with this machine's.
EXPECT_RE = re.compile(r"^\s*#\s*expect(?:\[(?P<tag>[a-z0-9_]+)\])?\s+(?P<hash>[0-9a-f]{64})\s*$")
EXPECT_START = re.compile(r"^\s*#\s*expect\b")  # a line meant as an expect line: it must then match EXPECT_RE
SETTING_COMMANDS = frozenset({  # run on a scratch state by `validate_replay`: they change settings only
    "seed", "seconds", "frames", "size", "render", "steps", "reuse", "layers", "core-reuse", "token-reduction",
    "reference-rope", "mode", "first", "last", "ref-image", "ref-video", "ref-silent-video", "ref-video-audio",
    "ref-audio", "refs", "ref-remove", "ablate",
})


def _tag_matches(line_tag: str | None, tag: str, strict: bool) -> bool:
    return line_tag is None or line_tag == tag or (strict and line_tag == strict_class(tag))


@dataclass
class ReplayReport:
    """What a replay did: generation count, expect lines checked / skipped (other classes), mismatches (file:line
    messages), unchecked generation lines, every trajectory digest in order, and whether `update` rewrote the file."""

    generations: int = 0
    checked: int = 0
    skipped: int = 0  # expect lines for another arithmetic class
    tag: str = ""  # this machine's arithmetic class (`arithmetic_class`)
    mismatches: list[str] = field(default_factory=list)
    unchecked: list[int] = field(default_factory=list)  # line numbers of generations without an expect line
    repeated: list[int] = field(default_factory=list)  # unchecked generations whose second run gave the same digest
    unrepeated: list[str] = field(default_factory=list)  # file:line messages of those whose second run differed
    hashes: list[str] = field(default_factory=list)  # trajectory digest of every generation, in order
    updated: bool = False

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.unrepeated


@dataclass
class _Pending:
    """The last generation line of a replay and the expect lines seen after it."""

    number: int  # 1-based line number of the generation
    digest: str
    index: int  # position of the generation line in the output lines
    last_index: int  # position of the last expect line for it (or the generation line)
    strict: bool = False  # the generation ran in mode strict (its lines may carry `strict_class`)
    matched: bool = False  # an expect line for this device (or untagged) was seen


def read_replay(path: Path) -> str:
    """The replay's text; a one-line `ReplayError` naming the file (and, for bytes that are not UTF-8, the line and
    column) otherwise."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ReplayError(f"replay {str(path)!r}: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ReplayError(
            f"{path}:{line}: byte 0x{data[err.start]:02x} at column {column} is not UTF-8; a replay is UTF-8 text"
        ) from None


def run_replay(
    state: SessionState,
    path: str | Path,
    update: bool = False,
    echo: Callable[[str], None] = print,
    repeat: bool = True,
) -> ReplayReport:
    """Run a `.h3` replay: every line through `parse`/`execute`. `# expect` lines after a generation line check its
    trajectory digest (see `EXPECT_RE` for arithmetic-class tags); a generation without one is reported as unchecked.
    Any command error stops the replay (`ReplayError` naming file:line). With `update`, this class's expect lines are
    rewritten (or inserted under their generation line) and the file is replaced atomically. With `repeat` (and not
    `update`), every unchecked generation runs a second time and must give the same digest. On
    the CPU the replay runs with one torch thread, on CUDA with deterministic cuDNN (see below)."""
    path = Path(path)
    text = read_replay(path)
    lines = text.splitlines()
    validate_replay(state, path, lines)  # the whole replay, before the first line runs (no model loaded yet)
    session = state.get_session()
    session.clear_cache()  # a replay starts from nothing the session computed before (same bytes as a fresh run)
    device = session.device.type
    tag = arithmetic_class(device)
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
        return _run_replay(state, path, text, lines, update, echo, tag, repeat)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def validate_replay(state: SessionState, path: Path, lines: list[str]) -> None:
    """Check the whole replay before it runs (module docstring); a one-line `ReplayError` naming file:line. Builds
    the session object (no model loads) to know its device and mesh; `state` itself is not changed."""
    from ..execution.whatran import check_strict_runs

    commands_, generated = [], False
    for number, line in enumerate(lines, 1):
        if EXPECT_START.match(line):
            if not EXPECT_RE.match(line):
                raise ReplayError(f"{path}:{number}: {line.strip()!r}: an expect line is '# expect[TAG] <sha256>' "
                                  "with 64 lowercase hex digits")
            if not generated:
                raise ReplayError(f"{path}:{number}: '# expect' without a generation line before it")
        try:
            commands_.append((number, parse(line)))
        except H3Error as err:
            raise ReplayError(f"{path}:{number}: {err}") from None
        generated = generated or commands_[-1][1].name == "generate"
    session = state.get_session()
    mesh = getattr(session, "mesh", None)
    scratch = SessionState(session=session, settings=state.settings, base_dir=state.base_dir)
    for number, cmd in commands_:
        try:
            if cmd.name in SETTING_COMMANDS:
                execute(scratch, cmd)
            elif cmd.name == "generate":
                settings = scratch.settings.replace(prompt=cmd.line).checked_paths()
                check_strict_runs(settings.mode, session.device)
                if mesh is not None and mesh.topology.world_size > 1 and settings.mode != "strict":
                    raise ReplayError(f"a generation in mode {settings.mode} on mesh {mesh.topology.name}: a forward "
                                      "on several ranks runs in mode strict only; run this replay in one process "
                                      "(or give its generations !mode strict)")
            elif cmd.name == "quit":
                break
        except H3Error as err:
            raise ReplayError(f"{path}:{number}: {err}") from None
    if not generated:
        raise ReplayError(f"{path}: no generation line: a replay checks the digests of its generations")


def _run_replay(state, path, text, lines, update, echo, tag, repeat) -> ReplayReport:
    """`run_replay`'s loop; `tag` is the machine's arithmetic class, the tag its expect lines carry."""
    report = ReplayReport(tag=tag)
    out: list[str] = []
    pending: _Pending | None = None

    def line_for(p: _Pending) -> str:
        return f"# expect[{strict_class(tag) if p.strict else tag}] {p.digest}"

    def close_pending() -> None:
        nonlocal pending
        if pending is not None and not pending.matched:
            report.unchecked.append(pending.number)
            if update:
                out.insert(pending.last_index + 1, line_for(pending))
            elif repeat:
                _repeat(state, path, report, pending, echo)
        pending = None

    consumed = 0
    for number, line in enumerate(lines, 1):
        consumed = number
        m = EXPECT_RE.match(line)
        if m:
            if pending is None:
                raise ReplayError(f"{path}:{number}: '# expect' without a generation line before it")
            line_tag, expected = m.group("tag"), m.group("hash")
            if not _tag_matches(line_tag, tag, pending.strict):
                report.skipped += 1
                out.append(line)
                pending.last_index = len(out) - 1
                continue
            report.checked += 1
            if update and pending.matched:
                continue  # --update keeps one line per generation for this class
            pending.matched = True
            out.append(line_for(pending) if update else line)
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
            pending = _Pending(number, digest, len(out) - 1, len(out) - 1, strict=state.last.arm.mode == "strict")
        if not state.running:
            break
    close_pending()
    if update:
        new_text = "\n".join(out + lines[consumed:]) + "\n"
        if new_text != text:
            atomic_write_text(path, new_text)
            report.updated = True
    return report



def _repeat(state, path: Path, report: ReplayReport, pending: _Pending, echo: Callable[[str], None]) -> None:
    """Run the unchecked generation `pending` (the front end's last result) a second time, from empty conditioning
    caches, with its settings, before the next line changes anything; record in `report` whether its digest
    repeated. The front end's results, counters and the session's caches are as they were."""
    session = state.get_session()
    with session.fresh_cache():
        digest = session.generate(state.last.settings).trajectory_hash
    if digest == pending.digest:
        report.repeated.append(pending.number)
        echo(f"repeated {path}:{pending.number}: {digest} (no expect line for {report.tag}; a second run gave it "
             "again)")
    else:
        report.unrepeated.append(f"{path}:{pending.number}: a second run gave {digest}, the first {pending.digest}")
        echo(f"NOT REPEATED {path}:{pending.number}: first {pending.digest}, second {digest}")
