"""`h3lab verify DIR` (also `python -m h3lab.frontends.verify`): replay a sealed trajectory, training run or GRPO run and say
OK or where it first differs.

    h3lab verify runs/fox                 # a job folder of `h3lab train` / `h3lab train grpo` (its run/)
    h3lab verify traj/t2va-seed42         # a sealed trajectory (`--seal`, `!trajectory save`)
    h3lab verify runs/fox/run --steps 2   # the first two steps of a training run only
    h3lab verify traj/x -d ./MiniMax-H3 --device cuda

A front end: it parses and prints; the work is `h3lab.app.sealed.verify_sealed`, which rebuilds the model from what the
folder sealed (the base transformer by its fingerprint, the LoRA adapter from its recorded peft config) -- nothing
to guess. Output: one line naming what was rebuilt, then the verdict (`OK: ...` or the first difference). Exit
status 0 when it replays byte for byte, 1 when it differs, 2 on a usage error or a folder it cannot replay (one line
on stderr naming the value and the rule), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from ..errors import H3Error, user_message


class VerifyArgError(H3Error):
    """A `h3lab verify` usage error (one line)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise VerifyArgError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="h3lab verify", description="Replay a sealed trajectory, training run or GRPO run byte for "
                "byte and print OK or the first difference.")
    p.add_argument("path", metavar="DIR", help="a sealed trajectory, a sealed run, or a job folder (its run/)")
    p.add_argument("-d", "--model", dest="snapshot", metavar="PATH", default=None,
                   help="snapshot to rebuild the model from (default: the one the job recorded when it exists "
                        "here, else the embedded h3-shapes snapshot)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="replay only the first N steps of a training run (default: all)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        from ..app.sealed import verify_sealed

        verdict = verify_sealed(args.path, args.snapshot, args.device, args.steps)
    except KeyboardInterrupt:
        print("h3lab verify: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - one line, exit 2
        if os.environ.get("H3LAB_DEBUG"):
            raise
        print(f"h3lab verify: error: {user_message(err)}", file=sys.stderr)
        return 2
    print(f"{verdict.kind} {verdict.path}: rebuilt {verdict.model}")
    print(verdict.report)
    return 0 if verdict.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
