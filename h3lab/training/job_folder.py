"""The one rule of a job folder (`h3lab train`, `h3lab train grpo`, and every RL command): what `--out` may hold
when a job starts or resumes.

Contract
- `check_job_folder(out, resume, kind, checkpointed) -> Path`, called by a job's `check()` after every argument is
  checked and before anything is written:
    fresh (no `--resume`): `out` is absent or an empty folder. A folder holding a job says `--resume` (from its
    checkpoint, or -- stopped before its first checkpoint -- from the start); any other content is refused.
    `--resume`: `out` holds `job.json`; a finished job (`run/` sealed and `adapter/` written) is refused, saying so.
  `checkpointed(out)` tells whether the job wrote a checkpoint. One-line `TrainingError`s naming `--out` and the path.
- What a job does with it is the same in every command: `job.json` first, then `initial/`, then checkpoints, then
  `adapter/` and `run/`. `--resume` continues from the newest checkpoint or, when none was written (interrupted, a
  failing reward, a full disk before it), restarts from step 0: the adapter's init is seeded, so it is the run a
  fresh start would make.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..io_utils import check_output_dir
from .objective import TrainingError

JOB = "job.json"


def finished(out: Path) -> bool:
    """The job in `out` sealed its run and wrote its adapter."""
    return (out / "run" / "manifest.json").is_file() and (out / "adapter").is_dir()


def check_job_folder(out: Path, resume: bool, kind: str, checkpointed: Callable[[Path], bool]) -> Path:
    """`out` checked for a fresh start or a resume of a `kind` job (module docstring)."""
    check_output_dir(out, "--out")
    has_job = (out / JOB).is_file()
    if resume and not has_job:
        raise TrainingError(f"--resume: {str(out)!r} holds no {kind} job ({JOB}); start it without --resume")
    if resume and finished(out):
        raise TrainingError(f"--resume: the {kind} job in {str(out)!r} is finished (run/ sealed, adapter/ written): "
                            "verify it (h3lab verify), or train again in a new folder")
    if not resume and out.exists() and any(out.iterdir()):
        why = "is a folder of other files"
        if has_job:
            why = (f"holds a {kind} job: add --resume to continue it from its checkpoint" if checkpointed(out) else
                   f"holds a {kind} job stopped before its first checkpoint: add --resume to start it again")
        raise TrainingError(f"--out {str(out)!r} {why}, or give a new folder")
    return out
