"""`h3lab`: the one-shot CLI, `--info`, `--replay`, and the REPL when no prompt is given.

    h3lab -p "a blue square moves right, a middle tone" -o sq.mp4  # embedded h3-shapes snapshot, its native 64x64
    h3lab -d ./MiniMax-H3 -p PROMPT -o out.mp4 --width 512 --height 512 --frames 22 --steps 20
    h3lab -d ./MiniMax-H3                                          # interactive session (REPL)
    h3lab --replay replays/t2va.h3 [--update]                     # scripted replay, checks '# expect' hashes
    h3lab --info [-d PATH] [--json]                                # snapshot report, no generation
    h3lab --info --plan -d PATH --width 1344 --height 768 --frames 362 --adaln tables [--card-memory 80]
                                                                   # what the settings need on the GPU
    torchrun --nproc-per-node 4 -m h3lab --tp 2 --cp 2 -p PROMPT   # strict TP / CP (Ulysses) / SP on 4 ranks
    h3lab verify DIR                                               # replay a sealed trajectory / run (h3lab.frontends.verify)
    h3lab train ... / h3lab train grpo ... / h3lab encode ...      # the training front ends (h3lab.frontends.train, .encode)

Reference flags (`--ref-image`, `--ref-video`, `--ref-silent-video`, `--ref-video-audio VIDEO AUDIO`,
`--ref-audio`) may repeat; their command-line order is the reference order. Settings flags map one to one onto
`h3lab.schema.generation_settings.GenerationSettings` and go through the same validation as the REPL's commands; they are generated
from the settings schema (`h3lab.schema.argv`: `--width` ... `--mode`, the presets' flags, and every setting declared
later, with the actions that take it), and so are the `Session(...)` options declared there. The other flags (-d, -p,
-o, anchors, references, outputs, `--info`, `--replay`, placement, LoRA, mesh) are declared once each in
`h3lab.schema.cli_flags`, with the actions that take them.

`--tp T --cp C [--sp] [--row-parallel auto|k_chunks|n_split]` (under torchrun, world size T*C) run the one-shot
generation, the REPL or a replay on a device mesh (`h3lab.distributed.frontend`): rank 0 runs the front end, the
other ranks follow its forwards; the mode defaults to strict there (a sharded forward runs strict only). Every
rank runs under `distributed.peers.watch`: a rank that dies mid-run (a signal, `os._exit`, a broken transport) ends
every surviving rank with one line naming it ("rank 1 died mid-generation (no word from it ...)", exit 2), and
rank 0, the only writer, leaves nothing half-written (every output is written atomically after the last forward).

The CLI parses flags and prints; the work is elsewhere: `--info` is `h3lab.research.diagnostics.info_report`, `--replay` is
`h3lab.frontends.replay.run_replay`, the REPL is `h3lab.frontends.repl.run_repl` given a session factory (`session_from_args`), and a
generation is `Session.generate`. `settings_from_args` is the one flag -> `GenerationSettings` conversion.

Fail before the work: `check_flags` refuses flags the chosen action would ignore (`-p` with `--replay`, `-o` in the
REPL, ...), and `preflight` checks the device, every output path (`-o`, `--wav`, `--frames-dir`, `--session-dir`,
`--replay --update`'s file), every directory the environment names (`H3LAB_CACHE` when the tiny snapshot must be
built, `TRITON_CACHE_DIR` on CUDA) and the ffmpeg binary, all before a snapshot is read or a model loaded; then the
session checks the prompt's length and every input file (`Session.check_request`).

Exit status: 0 success; 1 a replay hash mismatch; 2 any error (one line on stderr naming the value and the rule,
no traceback, no exception class name: `errors.user_message`; with `--json` that line is a JSON object
`{"error": ..., "exit": 2}`; set `H3LAB_DEBUG=1` for the traceback); 130 cancelled with Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from ..errors import H3Error, user_message


class CliError(H3Error):
    """A command-line usage error (one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message by default)
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    """The declared infrastructure flags (`h3lab.schema.cli_flags`: -d, -p, -o first) around every declared
    generation setting and `Session(...)` option (`h3lab.schema.argv`)."""
    from ..schema.argv import add_flags
    from ..schema.cli_flags import LEAD_ORDER
    from ..schema.program import add_program_flags

    p = _Parser(
        prog="h3lab",
        description="MiniMax-H3 research workbench: generate video with sound, strict deterministic execution, "
        "sealed trajectories. Without -p (and without --replay/--info) an interactive session starts. "
        "Subcommands (each with --help): `h3lab encode` (MP4s -> a clip dataset), `h3lab train`.",
    )
    add_program_flags(p, "h3lab", orders=(-math.inf, LEAD_ORDER))
    add_flags(p, "generation")  # every declared generation setting (h3lab.schema): --width ... --mode, the presets
    add_program_flags(p, "h3lab", orders=(LEAD_ORDER, math.inf))
    add_flags(p, "session")  # declared Session(...) options
    p.set_defaults(references=[])
    return p


# ------------------------------------------------------------------------------------------------ progress
class ProgressBar:
    """A one-line per-pass progress bar on a terminal stream (redrawn with \\r), or nothing when not a tty."""

    def __init__(self, stream: TextIO | None = None, width: int = 30):
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def __call__(self, info) -> None:
        if not self.enabled:
            return
        if info.step == 1:
            self.t0 = time.perf_counter() - info.seconds
        done = int(self.width * info.step / info.total)
        elapsed = time.perf_counter() - self.t0
        mark = "" if info.evaluated else " (reused)"
        self.stream.write(  # t = 1 - sigma (0 noise, 1 clean): the last pass starts below 1 and ends at sigma 0
            f"\rdenoise [{'#' * done}{'.' * (self.width - done)}] {info.step}/{info.total} "
            f"sigma={1 - info.video_t:.4f} (t=1-sigma) {elapsed:6.2f} s{mark}   "
        )
        if info.step == info.total:
            self.stream.write("\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------------------ helpers
def native_settings(snapshot: str | None):
    """The settings a run of `snapshot` (-d; None: the embedded default) starts from: the schema's defaults on the
    snapshot's native canvas and length when it declares them (`h3lab.checkpoint.native`)."""
    from ..checkpoint.native import native_form
    from ..schema.generation_settings import GenerationSettings

    if snapshot is None:
        from ..checkpoint.tiny import default_snapshot

        snapshot = default_snapshot()
    form = native_form(Path(snapshot).expanduser())
    return GenerationSettings(**form.defaults()) if form else GenerationSettings()


def settings_from_args(args: argparse.Namespace, base=None):
    """GenerationSettings from the flags (validated); `base` (default: `native_settings` of -d) supplies values for
    flags not given."""
    from ..schema.generation_settings import Reference

    from ..schema.argv import changes as flag_changes

    changes: dict[str, Any] = flag_changes(args)  # the declared settings (h3lab.schema) given as flags
    for flag, name in (("first_frame", "first"), ("last_frame", "last")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    if args.prompt is not None:
        changes["prompt"] = args.prompt
    refs = []
    for kind, values in args.references:
        refs.append(Reference(kind, values[0], values[1] if kind == "video-audio" else None))
    if refs:
        changes["references"] = tuple(refs)
    base = base or native_settings(getattr(args, "model", None))
    return base.replace(**changes)


def _print_lines(lines, stream=None) -> None:
    stream = stream or sys.stdout
    for line in lines:
        print(line, file=stream)


def quiet_libraries() -> None:
    """Silence library chatter a terminal user cannot act on: transformers' weight-loading progress bars and
    deprecation FutureWarnings raised inside diffusers/torch while the components load. Through the environment
    variables transformers reads at import, so nothing is imported here (an early error stays fast); an already
    imported transformers is told directly."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def session_from_args(args: argparse.Namespace):
    """The `Session` the flags ask for (`-d`, `--device`, `--residency`); what the REPL's and the replay's session
    factories call."""
    from ..app.session import Session

    quiet_libraries()
    mesh = getattr(args, "mesh", None)  # set by h3lab.distributed.frontend under torchrun
    device = mesh.device if mesh is not None else args.device
    residency = args.residency or ("streamed" if args.gpu_memory is not None else "resident")
    from ..schema.argv import session_options

    session = Session(args.model, device=device, residency=residency, gpu_memory=args.gpu_memory, mesh=mesh,
                      adaln=args.adaln or "resident", card_memory=args.card_memory, **session_options(args))
    if getattr(args, "lora", None):
        session.load_lora(args.lora)  # checked against the snapshot's config; no model loads
    return session


# ------------------------------------------------------------------------------------------------ fail early
# A flag the chosen action would ignore is an error. Which action takes which flag is declared with the flag: the
# infrastructure flags' `actions` (`h3lab.schema.cli_flags`) and the settings' (`h3lab.schema.argv`).
REFERENCES = {"references": "--ref-*"}  # the five reference flags fill one list (`cli_flags.RefAction`)


def settings_flags() -> dict[str, str]:
    """dest -> flag of every setting flag: the declared generation settings, the anchors and the references."""
    from ..schema.argv import flags

    return {**flags("generation"), "first_frame": "--first-frame", "last_frame": "--last-frame", **REFERENCES}


def flag_names() -> dict[str, str]:
    """dest -> flag as typed, of every flag `check_flags` looks at (each named once, by its short spelling when it has
    one; the references as --ref-*)."""
    from ..schema.argv import flags
    from ..schema.program import PROGRAMS

    named = {**settings_flags(), **flags("session")}
    fixed = {s.keyword: (s.aliases or (s.flag,))[0] for s in PROGRAMS["h3lab"]}  # as typed most: -p, -o
    return {**named, **{k: v for k, v in fixed.items() if k not in named}}


def allowed() -> dict[str, set[str]]:
    """action -> the dests it takes: each declared flag's `actions`."""
    from ..schema.argv import flag_actions
    from ..schema.program import program_actions

    declared = flag_actions()
    declared["plan"] = declared.get("one-shot", set())  # a plan is for the settings a generation would take
    fixed = program_actions("h3lab")
    return {action: dests | declared.get(action, set()) for action, dests in fixed.items()}


WHY = {
    "info": "--info only reports the snapshot (it takes -d, --device, --json; with --plan the settings too)",
    "plan": "--info --plan reports what the settings need on the GPU (it takes the settings, --first-frame, "
            "--last-frame, --residency, --gpu-memory, --adaln, --card-memory, --json)",
    "replay": "a replay takes its prompts and settings from its file (it takes -d, --device, --residency, "
              "--gpu-memory, --session-dir, --profile, --update, --allow-unchecked)",
    "one-shot": "-p generates once and writes -o/--wav/--frames-dir/--trajectory; --session-dir only goes with --show",
    "repl": "the interactive session (no -p) numbers its videos in --session-dir; -o/--wav/--frames-dir/--trajectory/"
            "--json go with -p (the REPL seals with !trajectory save PATH)",
}


def action_of(args: argparse.Namespace) -> str:
    if args.info:
        return "plan" if args.plan else "info"
    if args.replay:
        return "replay"
    return "repl" if args.prompt is None else "one-shot"


def check_flags(args: argparse.Namespace) -> str:
    """The action the flags ask for; a one-line `CliError` naming a flag that action would silently ignore."""
    if (args.update or args.allow_unchecked) and not args.replay:
        raise CliError(f"{'--update' if args.update else '--allow-unchecked'} only goes with --replay FILE")
    if args.plan and not args.info:
        raise CliError("--plan only goes with --info (h3lab --info --plan [settings]); in the REPL: !plan")
    action = action_of(args)
    names = flag_names()
    takes = allowed()[action]
    if action == "one-shot" and args.session_dir is not None and not args.show:
        raise CliError(f"--session-dir {args.session_dir!r} without --show: {WHY['one-shot']}")
    if action == "one-shot" and args.zoom is not None and not args.show:
        raise CliError(f"--zoom {args.zoom} without --show: --zoom sizes the --show previews")
    if args.zoom is not None:
        from .preview import check_zoom

        check_zoom(args.zoom, "--zoom")
    stray = [dest for dest in names if getattr(args, dest) not in (None, False, []) and dest not in takes]
    if stray:
        head = {"info": "--info", "plan": "--info --plan", "replay": f"--replay {args.replay!r}", "one-shot": "-p",
                "repl": "the interactive session (no -p)"}[action]
        raise CliError(f"{names[stray[0]]} with {head}: {WHY[action]}")
    return action


def preflight(args: argparse.Namespace, action: str) -> None:
    """Every check that needs no snapshot and no model (module docstring), in one pass, before any work."""
    from ..io_utils import check_output_dir, check_output_file
    from ..app.session import check_outputs, resolve_device
    from ..schema.generation_settings import check_prompt

    device = resolve_device(args.device)
    if device.type == "cpu" and action != "plan" and (args.residency == "streamed" or args.gpu_memory is not None):
        flag = "--residency streamed" if args.residency == "streamed" else f"--gpu-memory {args.gpu_memory:g}"
        raise CliError(f"{flag} on the cpu: streaming moves DiT blocks from host memory to a GPU; on the cpu every "
                       "block already is in host memory (the flag would change nothing)")
    if action in ("one-shot", "repl"):  # a replay's `!mode` lines are checked with the whole replay
        from ..execution.whatran import check_strict_runs

        check_strict_runs(args.mode, device, "--mode strict" + (" (the mode on a mesh)" if args.tp or args.cp else ""))
    if args.model is not None:
        model = Path(args.model).expanduser()
        if not model.is_dir():
            from ..errors import CheckpointError

            raise CheckpointError(f"snapshot {args.model!r}: not a directory")
    else:
        _check_cache_dir()
    cache = os.environ.get("TRITON_CACHE_DIR")
    if cache and device.type == "cuda":  # Triton compiles (and writes its cache) only on the GPU
        check_output_dir(cache, "TRITON_CACHE_DIR")
    if getattr(args, "lora", None):
        from ..adapters.adapter_file import read_adapter

        read_adapter(args.lora)  # format and factors; the shapes are checked against the snapshot with the session
    if action == "one-shot":
        check_prompt(args.prompt)
        output = "h3lab.mp4" if args.output is None else args.output
        check_outputs(output or None, args.wav, args.frames_dir)
        _check_trajectory_flags(args)
        if args.show:
            check_output_dir(Path(args.session_dir or "h3lab-session") / "previews", "--session-dir (--show previews)")
        _check_ffmpeg()
    elif action == "repl":
        if args.keep is not None:
            from ..app.session import check_keep

            check_keep(args.keep, "--keep")
        check_output_dir(args.session_dir or "h3lab-session", "--session-dir")
        _check_ffmpeg()
    elif action == "replay":
        if args.session_dir is not None:
            check_output_dir(args.session_dir, "--session-dir")
        if args.update:
            check_output_file(args.replay, (), "--replay --update")
        _check_ffmpeg()


def _check_trajectory_flags(args: argparse.Namespace) -> None:
    """--keep names tensors the trajectory keeps, which a one-shot run writes only into --trajectory DIR."""
    from ..app.session import check_keep, check_seal_target

    if args.keep is not None:
        check_keep(args.keep, "--keep")
        if args.trajectory is None:
            raise CliError(f"--keep {args.keep} with -p: the kept tensors go into the sealed trajectory; give "
                           "--trajectory DIR to write it")
    if args.trajectory is not None:
        target = Path(args.trajectory).expanduser()
        check_seal_target(target, f"--trajectory {args.trajectory!r}", "--trajectory")
        for flag, other in (("-o", args.output), ("--wav", args.wav), ("--frames-dir", args.frames_dir)):
            if other and Path(other).expanduser().resolve() == target.resolve():
                raise CliError(f"--trajectory {args.trajectory!r} and {flag} name the same path")


def _check_cache_dir() -> None:
    """Without -d the tiny snapshot lives in `$H3LAB_CACHE` (default ~/.cache/h3lab): it must be a folder that
    accepts files unless the snapshot is already built there."""
    from ..checkpoint.tiny import TINY_VERSION, cache_dir
    from ..io_utils import check_output_dir

    cache = cache_dir()
    env = os.environ.get("H3LAB_CACHE")
    what = "H3LAB_CACHE" if env else "the tiny-snapshot cache (H3LAB_CACHE unset)"
    if cache.exists() and not cache.is_dir():
        check_output_dir(cache, what)  # raises: a file where the cache folder should be
    if not (cache / f"{TINY_VERSION}-seed0").is_dir():
        check_output_dir(cache, what)


def _check_ffmpeg() -> None:
    from ..components.media import check_ffmpeg

    check_ffmpeg()


def _info(args) -> int:
    from ..checkpoint.info import format_info
    from ..research.diagnostics import info_report

    report = info_report(args.model, args.device, forward=args.prompt is None)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
        return 0
    print(format_info(report))
    forward = report.get("forward")
    if forward is not None:
        print(
            f"one forward ({forward['variant']}, {forward['mode']}, {forward['rows']} rows): video "
            f"{forward['video_out']}, audio {forward['audio_out']} in {forward['seconds']:.4f} s on "
            f"{forward['device']}"
        )
    return 0


def _plan(args, settings) -> int:
    """`--info --plan`: the settings' memory plan on this machine's GPU or the `--card-memory` card (no model
    loads)."""
    plan = session_from_args(args).plan(settings)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, sort_keys=True, default=str))
    else:
        print("\n".join(plan.lines()))
    return 0


def _one_shot(args) -> int:
    from . import commands
    from .preview import TerminalPreview

    settings = settings_from_args(args)  # validated, like the outputs (preflight), before loading anything
    session = session_from_args(args)
    settings = session.check_request(settings)  # prompt length, every input file probed and decoded
    output = "h3lab.mp4" if args.output is None else args.output
    cancel = threading.Event()
    preview = None
    if args.show:
        # Inline in a terminal that speaks an image protocol; elsewhere PNGs under <session dir>/previews.
        viewer = TerminalPreview(Path(args.session_dir or "h3lab-session") / "previews", stream=sys.stderr,
                                 zoom=2 if args.zoom is None else args.zoom)

        def preview(frame, step, total):
            print(viewer.show(frame, f"step{step:03d}-of-{total:03d}"), file=sys.stderr)

    try:
        result = session.generate(
            settings,
            progress=ProgressBar(),
            cancel=cancel,
            preview=preview,
            output=output or None,
            frames_dir=args.frames_dir,
            wav=args.wav,
        )
    except KeyboardInterrupt:
        cancel.set()
        print("h3lab: cancelled", file=sys.stderr)
        return 130
    sealed = result.trajectory.seal(Path(args.trajectory).expanduser()) if args.trajectory else None
    if args.json:
        report = {**result.to_dict(), "ran": commands.what_ran(result)}
        if sealed is not None:
            report["trajectory_dir"] = str(sealed)
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        _print_lines(commands.generation_lines(result, profile=args.profile))
        if sealed is not None:
            kept = f" with its {','.join(session.keep)}" if session.keep else ""
            print(f"trajectory {result.trajectory_hash} sealed in {sealed}{kept}")
    return 0


def _replay(args) -> int:
    from . import commands
    from .replay import run_replay

    path = Path(args.replay)
    state = commands.SessionState(
        session=lambda: session_from_args(args),
        settings=native_settings(args.model),
        base_dir=path.resolve().parent,
        out_dir=Path(args.session_dir) if args.session_dir else None,
        profile=args.profile,
    )
    report = run_replay(state, path, update=args.update, repeat=not args.allow_unchecked)
    summary = (
        f"replay {path}: {report.generations} generations, {report.checked} checked, "
        f"{len(report.mismatches)} mismatches" + (", expect lines updated" if report.updated else "")
        + (f", {len(report.repeated)} repeated" if report.repeated else "")
        + (f", {len(report.unrepeated)} not repeated" if report.unrepeated else "")
    )
    print(summary)
    if report.unchecked and not args.update:
        how = ("each ran twice and gave the same digest" if len(report.repeated) == len(report.unchecked)
               else "not run twice (--allow-unchecked)" if args.allow_unchecked else "see above")
        print(f"note: generations on lines {report.unchecked} have no '# expect[{report.tag}]' line for this "
              f"machine's arithmetic class ({how}); --update records them. Strict digests hold on every machine of "
              "one CPU capability, off/auto digests on one arithmetic class (README, \"Which bytes are portable\")")
    return 0 if report.ok else 1


MESH_WORK = {"one-shot": "generation", "replay": "replay", "repl": "session"}  # "rank R died mid-<work>"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # `h3lab train ...`: the training front end
        from .train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["verify"]:  # `h3lab verify DIR`: replay a sealed trajectory or run
        from .verify import main as verify_main

        quiet_libraries()
        return verify_main(argv[1:])
    if argv[:1] == ["encode"]:  # `h3lab encode ...`: MP4s + a manifest -> a sealed clip dataset
        from .encode import main as encode_main

        quiet_libraries()
        return encode_main(argv[1:])
    as_json = "--json" in argv  # known before parsing, so a usage error is JSON too
    try:
        args = build_parser().parse_args(argv)
        action = check_flags(args)
        mesh = None
        if action not in ("info", "plan"):
            from ..distributed.frontend import mesh_request

            mesh = mesh_request(args)  # None without --tp/--cp/--sp and without torchrun; sets --mode strict
        settings = settings_from_args(args) if action in ("one-shot", "repl", "plan") else None
        if mesh is not None:  # rank 0 checks and runs the action, the other ranks follow its forwards
            from ..distributed.frontend import close_mesh, run_on_mesh
            from ..distributed.launch import RankFailed
            from ..distributed.peers import watch

            def lead_action() -> int:
                preflight(args, action)
                return run_action(args, action, settings)

            try:  # a rank that dies mid-run is named in one line on every survivor (peers.watch)
                with watch(mesh, MESH_WORK.get(action, "run")):
                    rc = run_on_mesh(args, mesh, lead_action, lambda: session_from_args(args))
            except RankFailed:
                raise  # a peer is gone: no barrier left to meet at
            except BaseException:
                close_mesh()  # every rank reached run_on_mesh's failure exchange, so every rank meets here
                raise
            close_mesh()
            return rc
        preflight(args, action)
        return run_action(args, action, settings)
    except KeyboardInterrupt:
        print("h3lab: cancelled", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the CLI's contract: one line, exit 2
        if os.environ.get("H3LAB_DEBUG"):
            raise
        message = user_message(err)  # torchrun: every rank prints the same line (run_on_mesh's MeshFailure)
        line = json.dumps({"error": message, "exit": 2}) if as_json else f"h3lab: error: {message}"
        sys.stderr.write(line + "\n")  # one write: torchrun's ranks share the stream
        sys.stderr.flush()
        return 2


def run_action(args: argparse.Namespace, action: str, settings) -> int:
    """The chosen action, after `check_flags` and `preflight` (on a mesh: rank 0's part)."""
    if action == "info":
        return _info(args)
    if action == "plan":
        return _plan(args, settings)
    if action == "replay":
        return _replay(args)
    if action == "repl":
        from .repl import run_repl

        return run_repl(lambda: session_from_args(args), settings, session_dir=args.session_dir,
                        show=args.show, profile=args.profile, zoom=2 if args.zoom is None else args.zoom)
    return _one_shot(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
