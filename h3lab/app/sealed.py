"""Sealed folders: what a folder holds (a trajectory, a training run, a GRPO run, or a job folder standing for its
`run/`) and its replay with the model rebuilt from what it sealed.

Contract
- `sealed_folder(path) -> (folder, kind, manifest)`; anything else is a one-line `ValidationError`.
- `verify_sealed(path, snapshot=None, device=None, steps=None) -> SealedVerdict`: what `h3lab verify DIR` runs. A
  trajectory replays on a `Session` of `snapshot` (default: the embedded default; `Session.verify`); a training or
  GRPO run on the base transformer its manifest names by fingerprint (`<variant>:<hash>`), from `snapshot` (default:
  the snapshot its job recorded when that folder exists here, else the embedded default), carrying a LoRA adapter of
  the run's recorded peft config (rank, alpha, targets; the replay puts the run's own initial factors back). A base
  whose fingerprint is not the recorded one is refused; strict on a CPU without the interpreter is refused. The
  verdict's report is the artifact's own (`str(report)`: OK, or the first difference).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..components.store import VARIANTS
from ..errors import ValidationError


SEALED_KINDS = {"h3lab-trajectory/1": "trajectory", "h3lab-training/1": "training run", "h3lab-grpo/1": "GRPO run"}


@dataclass
class SealedVerdict:
    """What `verify_sealed` did: the kind of artifact, its folder, the model it rebuilt (words) and the report
    (`str(report)` is the verdict line: OK, or the first difference)."""

    kind: str
    path: Path
    model: str
    report: Any

    @property
    def ok(self) -> bool:
        return bool(self.report.ok)


def sealed_folder(path: str | os.PathLike) -> tuple[Path, str, dict]:
    """(folder, kind, manifest) of a sealed trajectory, training run or GRPO run; a job folder of `h3lab train` /
    `h3lab train grpo` stands for its `run/`. One-line `ValidationError` for anything else."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ValidationError(f"{str(path)!r}: not a folder (give a sealed trajectory, run or job folder)")
    if not (root / "manifest.json").is_file() and (root / "job.json").is_file():
        if not (root / "run" / "manifest.json").is_file():
            raise ValidationError(f"{str(path)!r}: a job folder without a sealed run/ (the job has not finished: "
                                  "continue it with --resume)")
        root = root / "run"
    try:
        manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValidationError(f"{str(path)!r}: no readable manifest.json ({exc.__class__.__name__}): not a sealed "
                              "trajectory, run or job folder") from None
    kind = SEALED_KINDS.get(manifest.get("format") if isinstance(manifest, dict) else None)
    if kind is None:
        raise ValidationError(f"{str(path)!r}: manifest format {manifest.get('format')!r} is none of "
                              f"{', '.join(SEALED_KINDS)}")
    return root, kind, manifest


def verify_sealed(path: str | os.PathLike, snapshot: str | os.PathLike | None = None, device: Any = None,
                  steps: int | None = None) -> SealedVerdict:
    """Rebuild what a sealed folder ran on and replay it: a trajectory on a `Session` of `snapshot` (default: the
    embedded default); a training or GRPO run on the base transformer its manifest names by fingerprint, from
    `snapshot` (default: the snapshot its job recorded when that folder exists, else the embedded default), with a
    LoRA adapter of the run's recorded peft config (rank, alpha, targets; the run puts its own initial factors
    back). `steps` limits a training run's replay. A base whose fingerprint is not the recorded one is refused."""
    root, kind, manifest = sealed_folder(path)
    if kind == "trajectory":
        from .session import Session

        session = Session(snapshot, device=device)
        return SealedVerdict(kind, root, f"{session.model_name} ({session.path})", session.verify(root))
    return _verify_run(root, kind, manifest, snapshot, device, steps)


def _verify_run(root: Path, kind: str, manifest: dict, snapshot: Any, device: Any, steps: int | None
                ) -> SealedVerdict:
    from ..execution.devices import resolve_device
    from ..model import H3Transformer
    from ..adapters.adapter_file import config_from_json
    from ..adapters.lora import inject
    from ..execution.whatran import check_strict_runs

    fingerprint = str(manifest.get("checkpoint", {}).get("fingerprint", ""))
    variant = fingerprint.partition(":")[0]
    if variant not in VARIANTS:
        raise ValidationError(f"{root}: base fingerprint {fingerprint!r} names no transformer variant "
                              f"({', '.join(VARIANTS)})")
    base = _run_snapshot(root, manifest, snapshot)
    device = resolve_device(device)
    check_strict_runs(manifest.get("mode", "off"), device, f"verify {root} (mode {manifest.get('mode')})")
    model = H3Transformer.from_pretrained(base, subfolder=variant, device=device)
    if model.fingerprint != fingerprint:
        raise ValidationError(f"{root}: the run's base is {fingerprint}; {base} holds {model.fingerprint} (give its "
                              "snapshot with -d)")
    words = f"{base} {variant}"
    adapter = manifest.get("adapter")
    if adapter is not None:
        config = config_from_json(root / "manifest.json", adapter.get("config"), "adapter.config")
        handle = inject(model, config)
        words += f" + LoRA rank {config.r} on {len(handle.modules)} modules"
    if kind == "training run":
        from ..training import verify

        return SealedVerdict(kind, root, words, verify(root, model, steps=steps))
    if steps is not None:
        raise ValidationError("--steps: a GRPO run replays every iteration (it limits training runs only)")
    from ..training.grpo_run import verify as verify_grpo

    return SealedVerdict(kind, root, words, verify_grpo(root, model))


def _run_snapshot(root: Path, manifest: dict, snapshot: Any) -> Path:
    """The snapshot to rebuild a run's base from (see `verify_sealed`)."""
    if snapshot is not None:
        path = Path(snapshot).expanduser()
        if not path.is_dir():
            raise ValidationError(f"-d {str(snapshot)!r}: not a snapshot folder")
        return path
    recorded = (manifest.get("meta") or {}).get("job", {}).get("snapshot")
    if recorded and Path(recorded).is_dir():
        return Path(recorded)
    from ..checkpoint.tiny import default_snapshot

    return default_snapshot()
