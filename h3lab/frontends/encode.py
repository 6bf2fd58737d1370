"""`h3lab encode` (also `python -m h3lab.frontends.encode`): a folder of MP4s and a manifest of their prompts -> one sealed clip
dataset for `h3lab train --clips`.

    h3lab encode --videos clips/ --manifest clips/metadata.csv -o data/fox
    h3lab encode --videos clips/ --manifest prompts.jsonl -o data/fox --width 512 --height 320 --frames 56

A front end: it parses, checks and prints; the rules are `h3lab.app.clips_manifest` (the manifest's rows) and
`h3lab.app.clips_in` (each clip: 24 fps grid, 17n+5 length, canvas or cover-crop, its own audio track), the encode is
`Session.encode_clip`, the dataset `h3lab.training.save_dataset` (written atomically and sealed). Every bad row and
every bad clip is named, one stderr line each, before anything is encoded (exit 2, nothing written); a progress bar
on a terminal while the clips encode; Ctrl-C exits 130 and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from ..errors import H3Error, ValidationError
from .train import Progress as TrainProgress
from .train import _guarded

PROG = "h3lab encode"


class EncodeArgError(H3Error):
    """A `h3lab encode` usage error (one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise EncodeArgError(message)


def build_parser() -> argparse.ArgumentParser:
    """The declared flags of `h3lab encode` (`h3lab.schema.encode_flags`)."""
    from ..schema.program import add_program_flags

    p = _Parser(prog=PROG, description="Encode MP4 clips and their prompts into a sealed clip dataset for "
                "`h3lab train --clips` (video and audio latents through the snapshot's VAEs, text features through "
                "its text encoder).")
    add_program_flags(p, "encode")
    return p


def check_out(out: str) -> Path:
    """The dataset folder: new, empty, or a sealed dataset (replaced whole), in a folder that accepts files."""
    from ..io_utils import check_output_dir
    from ..training.dataset import FORMAT, MANIFEST

    target = Path(out).expanduser()
    check_output_dir(target, "-o")
    if target.is_dir() and any(target.iterdir()):
        try:
            sealed = json.loads((target / MANIFEST).read_text(encoding="utf-8")).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            sealed = False
        if not sealed:
            raise ValidationError(f"-o {out!r}: is a folder that is not a sealed clip dataset; writing replaces the "
                                  "folder, so give a new or empty one")
    return target


class Progress(TrainProgress):
    """One redrawn line per clip on a terminal (`encode [####....] 3/10 a.mp4 1.20 s/clip`), nothing else."""

    def __call__(self, done: int, total: int, name: str) -> None:
        self.draw("encode", done, total, f"{name} {self.rate(done):.2f} s/clip")


def check_all(args: argparse.Namespace, session) -> tuple[list, list[str]]:
    """(plans of every good row, one problem line per bad row or clip): nothing encoded, no model loaded."""
    from ..app.clips_in import check_clip
    from ..app.clips_manifest import read_manifest

    rows, problems = read_manifest(args.manifest, args.videos)
    plans = []
    for row in rows:
        try:
            plans.append(check_clip(session, row.path, row.prompt, args.width, args.height, args.frames,
                                    args.allow_silent))
        except H3Error as err:
            problems.append(f"{Path(args.manifest).name} line {row.line}: {err}")
    return plans, problems


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    problems: list[str] = []

    def work() -> dict:
        args = build_parser().parse_args(argv)
        if (args.width is None) != (args.height is None):
            raise EncodeArgError(f"--width {args.width} --height {args.height}: give both or neither")
        out = check_out(args.out)
        from ..components.media import check_ffmpeg
        from ..app.session import Session

        check_ffmpeg()
        session = Session(args.snapshot, device=args.device)
        session.check_prompt_length("a prompt")  # the snapshot's tokenizer: a broken snapshot is one error, not per row
        session.store.component_config("transformer")
        plans, bad = check_all(args, session)
        if bad:
            problems.extend(bad)
            return {}
        from ..training.dataset import MANIFEST, save_dataset

        progress, requests = Progress(), []
        for i, plan in enumerate(plans):
            requests.append(session.encode_clip(plan.path, plan.settings.prompt, plan=plan, seed=i))
            progress(i + 1, len(plans), plan.path.name)
        written = save_dataset(out, requests)
        digest = json.loads((written / MANIFEST).read_text(encoding="utf-8"))["digest"]
        return {"path": written, "digest": digest, "plans": plans}

    code, summary = _guarded(PROG, work, interrupted="interrupted; nothing written")
    if code:
        return code
    if problems:  # one line each, then exit 2: nothing was encoded or written
        for line in problems:
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return 2
    for plan in summary["plans"]:
        print(f"  {plan.describe()}")
    print(f"encoded {len(summary['plans'])} clips into {summary['path']}; dataset digest {summary['digest']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
