"""`h3lab`: the one-shot CLI, `--info`, `--replay`, and the REPL when no prompt is given.

    h3lab -p "a red fox walks through snow" -o fox.mp4            # embedded tiny snapshot
    h3lab -d ./MiniMax-H3 -p PROMPT -o out.mp4 --width 512 --height 512 --frames 22 --steps 20
    h3lab -d ./MiniMax-H3                                          # interactive session (REPL)
    h3lab --replay sessions/t2va.h3 [--update]                     # scripted replay, checks '# expect' hashes
    h3lab --info [-d PATH] [--json]                                # snapshot report, no generation

Reference flags (`--ref-image`, `--ref-video`, `--ref-silent-video`, `--ref-video-audio VIDEO AUDIO`,
`--ref-audio`) may repeat; their command-line order is the reference order. Settings flags map one to one onto
`h3lab.settings.GenerationSettings` and go through the same validation as the REPL's commands.

The CLI parses flags and prints; the work is elsewhere: `--info` is `h3lab.diagnostics.info_report`, `--replay` is
`h3lab.replay.run_replay`, the REPL is `h3lab.repl.run_repl` given a session factory (`session_from_args`), and a
generation is `Session.generate`. `settings_from_args` is the one flag -> `GenerationSettings` conversion.

Exit status: 0 success; 1 a replay hash mismatch; 2 any error (one line on stderr, no traceback; set
`H3LAB_DEBUG=1` for the traceback); 130 cancelled with Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from .errors import H3Error
from .runtime import MODES


class CliError(H3Error):
    """A command-line usage error (one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage + message by default)
        raise CliError(message)


class _RefAction(argparse.Action):
    """Appends (kind, values) to one ordered `references` list, so mixed reference flags keep their order."""

    def __call__(self, parser, namespace, values, option_string=None):
        refs = list(getattr(namespace, "references", None) or [])
        values = values if isinstance(values, list) else [values]
        refs.append((self.const, values))
        namespace.references = refs


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="h3lab",
        description="MiniMax-H3 research workbench: generate video with sound, strict deterministic execution, "
        "sealed trajectories. Without -p (and without --replay/--info) an interactive session starts.",
    )
    p.add_argument("-d", "--model", dest="model", metavar="PATH", help="snapshot directory (default: embedded tiny)")
    p.add_argument("-p", "--prompt", help="prompt; generates once and exits")
    p.add_argument("-o", "--output", metavar="OUT.mp4", default=None,
                   help="MP4 path (default h3lab.mp4); -o '' disables the MP4")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--frames", type=int, default=None, help="frame count, snapped up to 17n+5")
    g.add_argument("--seconds", type=float, default=None, help="duration at 24 fps, rounded up to a legal count")
    p.add_argument("--steps", type=int, default=None, help="denoising passes (default 20)")
    p.add_argument("--seed", type=int, default=None, help="seed (default 42)")
    p.add_argument("--mode", choices=MODES, default=None, help="transformer arithmetic (default auto)")
    p.add_argument("--reuse", type=int, default=None, help="whole-velocity reuse interval (default 1)")
    p.add_argument("--first-frame", metavar="IMAGE", default=None, help="first-frame anchor (fl2va)")
    p.add_argument("--last-frame", metavar="IMAGE", default=None, help="last-frame anchor (fl2va)")
    p.add_argument("--ref-image", action=_RefAction, const="image", metavar="IMAGE", help="image reference")
    p.add_argument("--ref-video", action=_RefAction, const="video", metavar="VIDEO",
                   help="video reference with its soundtrack")
    p.add_argument("--ref-silent-video", action=_RefAction, const="silent-video", metavar="VIDEO",
                   help="video reference, soundtrack ignored")
    p.add_argument("--ref-video-audio", action=_RefAction, const="video-audio", nargs=2, metavar=("VIDEO", "AUDIO"),
                   help="video reference with a replacement soundtrack")
    p.add_argument("--ref-audio", action=_RefAction, const="audio", metavar="AUDIO",
                   help="standalone audio reference (needs an image or video reference)")
    p.add_argument("--render-width", type=int, default=None, help="internal canvas width (with --render-height)")
    p.add_argument("--render-height", type=int, default=None, help="internal canvas height (with --render-width)")
    p.add_argument("--frames-dir", metavar="DIR", default=None, help="also write every frame as PNG")
    p.add_argument("--wav", metavar="OUT.wav", default=None, help="also write the soundtrack as float32 WAV")
    p.add_argument("--show", action="store_true", help="preview the middle frame after every denoising pass")
    p.add_argument("--profile", action="store_true", help="print phase timings and peak memory")
    p.add_argument("--info", action="store_true", help="report the snapshot (and one forward) without generating")
    p.add_argument("--json", action="store_true", help="machine-readable output for --info and generations")
    p.add_argument("--replay", metavar="FILE", default=None, help="run a .h3 replay and check its expect lines")
    p.add_argument("--update", action="store_true", help="with --replay: rewrite the expect lines")
    p.add_argument("--device", default=None, help="torch device (default cuda if available, else cpu)")
    p.add_argument("--residency", choices=("resident", "phased", "streamed"), default=None,
                   help="keep components resident (default), load/release them per phase, or stream the DiT's blocks "
                        "from host memory through two GPU slots")
    p.add_argument("--gpu-memory", metavar="GiB", type=float, default=None,
                   help="GPU budget of the streamed DiT: blocks that fit stay resident, the rest stream (implies "
                        "--residency streamed)")
    p.add_argument("--session-dir", metavar="DIR", default=None,
                   help="REPL outputs, previews and history (default ./h3lab-session)")
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
        self.stream.write(
            f"\rdenoise [{'#' * done}{'.' * (self.width - done)}] {info.step}/{info.total} "
            f"t={info.video_t:.4f} {elapsed:6.2f} s{mark}   "
        )
        if info.step == info.total:
            self.stream.write("\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------------------ helpers
def settings_from_args(args: argparse.Namespace, base=None):
    """GenerationSettings from the flags (validated); `base` supplies values for flags not given."""
    from .settings import GenerationSettings, Reference

    changes: dict[str, Any] = {}
    for flag, name in (("width", "width"), ("height", "height"), ("steps", "steps"), ("seed", "seed"),
                       ("mode", "mode"), ("reuse", "reuse"), ("render_width", "render_width"),
                       ("render_height", "render_height"), ("first_frame", "first"), ("last_frame", "last")):
        value = getattr(args, flag)
        if value is not None:
            changes[name] = value
    if args.frames is not None:
        changes["frames"] = args.frames
    if args.seconds is not None:
        changes["seconds"] = args.seconds
    if args.prompt is not None:
        changes["prompt"] = args.prompt
    refs = []
    for kind, values in args.references:
        refs.append(Reference(kind, values[0], values[1] if kind == "video-audio" else None))
    if refs:
        changes["references"] = tuple(refs)
    base = base or GenerationSettings()
    return base.replace(**changes)


def _print_lines(lines, stream=None) -> None:
    stream = stream or sys.stdout
    for line in lines:
        print(line, file=stream)


def quiet_libraries() -> None:
    """Silence library chatter a terminal user cannot act on: transformers' weight-loading progress bars and
    deprecation FutureWarnings raised inside diffusers/torch while the components load."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass


def session_from_args(args: argparse.Namespace):
    """The `Session` the flags ask for (`-d`, `--device`, `--residency`); what the REPL's and the replay's session
    factories call."""
    from .session import Session

    quiet_libraries()
    residency = args.residency or ("streamed" if args.gpu_memory is not None else "resident")
    return Session(args.model, device=args.device, residency=residency, gpu_memory=args.gpu_memory)


def _info(args) -> int:
    from .checkpoint.info import format_info
    from .diagnostics import info_report

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


def _one_shot(args) -> int:
    from . import commands
    from .preview import TerminalPreview

    settings = settings_from_args(args)  # validate before loading anything
    session = session_from_args(args)
    settings = session.check_request(settings)
    output = "h3lab.mp4" if args.output is None else args.output
    cancel = threading.Event()
    preview = None
    if args.show:
        # Inline in a terminal that speaks an image protocol; elsewhere PNGs under <session dir>/previews.
        viewer = TerminalPreview(Path(args.session_dir or "h3lab-session") / "previews", stream=sys.stderr)

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
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True, default=str))
    else:
        _print_lines(commands.generation_lines(result, profile=args.profile))
    return 0


def _replay(args) -> int:
    from . import commands
    from .replay import run_replay

    path = Path(args.replay)
    state = commands.SessionState(
        session=lambda: session_from_args(args),
        base_dir=path.resolve().parent,
        out_dir=Path(args.session_dir) if args.session_dir else None,
        profile=args.profile,
    )
    report = run_replay(state, path, update=args.update)
    summary = (
        f"replay {path}: {report.generations} generations, {report.checked} checked, "
        f"{len(report.mismatches)} mismatches" + (", expect lines updated" if report.updated else "")
    )
    print(summary)
    if report.unchecked and not args.update:
        print(f"note: generations on lines {report.unchecked} have no '# expect[{report.tag}]' line for this machine's "
              f"arithmetic class (run with --update to record them)")
    return 0 if report.ok or args.update else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.update and not args.replay:
            raise CliError("--update only goes with --replay FILE")
        if args.info:
            return _info(args)
        if args.replay:
            return _replay(args)
        if args.prompt is None:
            from .repl import run_repl

            return run_repl(lambda: session_from_args(args), settings_from_args(args), session_dir=args.session_dir,
                            show=args.show, profile=args.profile)
        return _one_shot(args)
    except KeyboardInterrupt:
        print("h3lab: cancelled", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the CLI's contract: one line, exit 2
        if os.environ.get("H3LAB_DEBUG"):
            raise
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if not isinstance(err, H3Error):
            message = f"{type(err).__name__}: {message}"
        print(f"h3lab: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
