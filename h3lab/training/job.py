"""A training job of the `h3lab train` front end: a LoRA fine-tune on a sealed clip dataset, or a reward-weighted
update over sealed rollouts, with periodic atomic checkpoints and a byte-equal resume.

Contract
--------
`TrainJob` (frozen) is everything a job varies: snapshot, variant, device, data (`clips` folder or `rollouts`
(path, reward) pairs), the LoRA (rank, alpha, targets, init seed), the `TrainConfig` (steps, batch, seed, mode,
checkpointing, AdamW, objective), `checkpoint_every`, `out`. `check()` validates every value and every path, loads
and checks the data and fits it and the LoRA targets to the snapshot's transformer config -- all before any model
loads -- raising one-line `TrainingError` / `AdapterError` / `ValidationError`s.

The output folder `out`:
    job.json                    the job (written first; `--resume` must name the same job, else refused)
    initial/                    the adapter before step 0 (PEFT format)
    checkpoints/step-NNNNNN/    after every `checkpoint_every` steps and after the final step, atomically (temp
                                folder renamed): adapter/ (PEFT format), optimizer.safetensors (StrictAdamW state, step
                                count in its metadata), state.json (the step records and trace summary so far); older
                                ones are removed
    adapter/                    the final adapter (PEFT format), its sha256 the run's adapter.final_sha256
    run/                        the sealed training run (`h3lab.training.load` / `verify`)
`run_job(job, model, resume=False, progress=None)` trains; with `resume`, the newest checkpoint's adapter and
optimiser state are put back and the run continues from there (`run.RunState`): the final adapter bytes, the step
records and the run digest equal an uninterrupted run's. `progress(k, steps, record)` is called after each step
(after any checkpoint of that step), so an interruption there leaves a checkpoint to resume from.

Faults: a job folder a crash, a kill or a full disk interrupted can always be continued with
`--resume` and the same arguments -- from its newest checkpoint, or, when none was written yet (only `job.json`,
perhaps a partial `initial/`), restarted cleanly from step 0 (the LoRA init is seeded: the same initial adapter).
A resume after the final step's checkpoint only seals the run and writes the adapter. `--resume` on a finished job
(`run/` sealed and `adapter/` written) is refused, saying it is finished. `--resume` with other arguments names every
differing key (`config.steps 6 vs 4`). A checkpoint that cannot be read or does not match its own step records is
refused naming its path (remove that folder to resume from the start). Every error names the path it is about.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..io_utils import atomic_save_safetensors, atomic_write_dir, atomic_write_json
from ..adapters.adapter_file import read_adapter
from .dataset import check_fits, load_dataset, rollout_dataset
from ..adapters.lora import PROJECTIONS, add_lora, adapter_files, match_targets, parse_targets, remove_lora, save_adapter
from .job_folder import JOB, check_job_folder
from .objective import TrainingError, checked_int
from .run import RunState, TrainConfig, train
from .step import trainable_parameters

CHECKPOINTS = "checkpoints"
VARIANTS = ("transformer", "transformer_ref")



def check_alpha(alpha: Any) -> None:
    """--alpha: None (= rank) or a finite number > 0."""
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
                              or not math.isfinite(alpha) or alpha <= 0):
        raise TrainingError(f"--alpha {alpha!r}: must be a finite number > 0")


@dataclass(frozen=True)
class TrainJob:
    """One `h3lab train` job (module docstring). `snapshot=None` is the embedded tiny snapshot."""

    out: str
    config: TrainConfig
    clips: str | None = None
    rollouts: tuple[tuple[str, float], ...] = ()
    snapshot: str | None = None
    variant: str = "transformer"
    device: str | None = None
    rank: int = 16
    alpha: float | None = None
    targets: tuple[str, ...] = PROJECTIONS
    lora_seed: int = 0
    checkpoint_every: int = 10
    data: list = field(default_factory=list, compare=False, repr=False)  # filled by check()
    data_digest: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        """What job.json holds (paths resolved); two jobs with equal dicts are the same job."""
        return {"config": self.config.to_dict(), "clips": self.clips,
                "rollouts": [[p, r] for p, r in self.rollouts], "snapshot": self.snapshot, "variant": self.variant,
                "rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "lora_seed": self.lora_seed,
                "checkpoint_every": self.checkpoint_every, "data_digest": self.data_digest}

    # ---------------------------------------------------------------------------------------------- checks
    def check(self, resume: bool = False) -> "TrainJob":
        """Every value, path and the data, before any model loads; returns the job with its data and paths filled."""
        from ..execution.devices import resolve_device

        if self.variant not in VARIANTS:
            raise TrainingError(f"--variant {self.variant!r}: must be one of {', '.join(VARIANTS)}")
        rank = checked_int("--rank", self.rank, 1)
        check_alpha(self.alpha)
        every = checked_int("--checkpoint-every", self.checkpoint_every, 1)
        lora_seed = checked_int("--lora-seed", self.lora_seed, 0)
        targets = parse_targets(self.targets)
        device = resolve_device(self.device)
        if self.config.mode == "strict" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise TrainingError("--mode strict on the cpu: strict kernels run there only under TRITON_INTERPRET=1 "
                                "(export it before starting), or use --mode off")
        snapshot = self._snapshot()
        if (self.clips is None) == (not self.rollouts):
            raise TrainingError("give the data once: --clips DATASET (fine-tune) or --rollout TRAJECTORY REWARD "
                                "(reward-weighted update), not both, not neither")
        out = check_job_folder(Path(self.out).expanduser(), resume, "training",
                               lambda folder: latest_checkpoint(folder) is not None)
        if self.clips is not None:
            data, digest = load_dataset(self.clips)
            clips, rollouts = str(Path(self.clips).resolve()), ()
        else:
            data, digest = rollout_dataset(self.rollouts)
            clips, rollouts = None, tuple((str(Path(p).resolve()), float(r)) for p, r in self.rollouts)
        config = _snapshot_config(snapshot, self.variant)
        check_fits(data, config)
        _check_targets(targets, config)
        return dataclasses.replace(self, out=str(out.resolve()), clips=clips, rollouts=rollouts, snapshot=str(snapshot),
                                   rank=rank, checkpoint_every=every, lora_seed=lora_seed, targets=targets,
                                   data=data, data_digest=digest)

    def _snapshot(self) -> Path:
        from ..errors import CheckpointError

        if self.snapshot is None:
            from ..checkpoint.tiny import default_snapshot

            return Path(default_snapshot()).resolve()
        path = Path(self.snapshot).expanduser()
        if not (path / self.variant / "config.json").is_file():
            raise CheckpointError(f"snapshot {self.snapshot!r}: no {self.variant}/config.json (not a MiniMax-H3 "
                                  "snapshot folder)")
        return path.resolve()


def _snapshot_config(snapshot: Path, variant: str):
    from ..adapters.field import snapshot_config

    return snapshot_config(snapshot, variant)


def _check_targets(targets, config) -> None:
    from ..model import H3Transformer

    with torch.device("meta"):
        match_targets(H3Transformer(config), targets)


# ============================================================================================== checkpoints
def _step_dir(k: int) -> str:
    return f"step-{k + 1:06d}"


def latest_checkpoint(out: Path) -> Path | None:
    root = out / CHECKPOINTS
    found = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")) if root.is_dir() else []
    return found[-1] if found else None


def write_checkpoint(out: Path, k: int, model, optimizer, records: list[dict], trace, initial_sha: str) -> Path:
    """Checkpoint after step k (module docstring), atomically; removes older checkpoints once it is in place."""
    files = adapter_files(model)
    state = {"step": k, "records": records, "trace": trace.to_dict(), "optimizer_steps": optimizer.step_count,
             "initial_adapter": initial_sha}
    tensors = {key: t.detach().cpu().contiguous() for key, t in optimizer.state_tensors().items()}

    def write(tmp: Path) -> None:
        (tmp / "adapter").mkdir()
        for name, data in files.items():
            (tmp / "adapter" / name).write_bytes(data)
        atomic_save_safetensors(tmp / "optimizer.safetensors", tensors,
                                metadata={"format": "h3lab-adamw/1", "step_count": str(optimizer.step_count)})
        atomic_write_json(tmp / "state.json", state)

    (out / CHECKPOINTS).mkdir(exist_ok=True)
    path = atomic_write_dir(out / CHECKPOINTS / _step_dir(k), write)
    for old in (out / CHECKPOINTS).iterdir():
        if old.is_dir() and old.name.startswith("step-") and old.name < path.name:
            shutil.rmtree(old)
    return path


def read_checkpoint(path: Path, model) -> RunState:
    """Put a checkpoint's adapter into `model` (which carries the job's adapter) and return its `RunState`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from ..errors import H3Error
    from ..adapters.lora import load_adapter_weights

    remedy = "remove that checkpoint folder to resume from the start"
    for name in ("state.json", "optimizer.safetensors"):
        try:
            if name == "state.json":
                state = json.loads((path / name).read_text(encoding="utf-8"))
                if not isinstance(state, dict) or not {"records", "optimizer_steps", "trace"} <= set(state):
                    raise ValueError("not a checkpoint state")
            else:
                optimizer = load_file(str(path / name))
        except (OSError, ValueError, SafetensorError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
            raise TrainingError(f"checkpoint {str(path / name)!r}: unreadable ({reason}); {remedy}") from None
    try:
        adapter = read_adapter(path / "adapter")
    except H3Error as exc:
        raise TrainingError(f"checkpoint {str(path / 'adapter')!r}: {exc}; {remedy}") from None
    device = next(model.parameters()).device
    load_adapter_weights(model, {k: v.to(device, torch.float32) for k, v in adapter.tensors.items()})
    initial = read_adapter(path.parent.parent / "initial").tensors
    names = [n for n, _ in trainable_parameters(model)]  # the run's parameter order
    module_key = {n: n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.") for n in names}
    if sorted(module_key.values()) != sorted(initial):
        raise TrainingError(f"checkpoint {str(path)!r}: the initial adapter does not match the job's LoRA")
    return RunState(records=state["records"], optimizer=optimizer, optimizer_steps=int(state["optimizer_steps"]),
                    initial={n: initial[module_key[n]].to(torch.float32) for n in names},
                    initial_adapter=state["initial_adapter"], trace=state["trace"])


# ===================================================================================================== run
def _differences(recorded: Any, now: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, this command's value, the recorded value) of every leaf where two job dicts differ."""
    if isinstance(recorded, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(recorded) | set(now)):
            out += _differences(recorded.get(key), now.get(key), f"{prefix}{key}.")
        return out
    return [] if recorded == now else [(prefix.rstrip("."), now, recorded)]


def load_model(job: TrainJob, device=None):
    """The job's base transformer, loaded from its snapshot onto its device (`device`: a mesh rank's, instead)."""
    from ..model import H3Transformer
    from ..execution.devices import resolve_device

    device = resolve_device(job.device) if device is None else device
    model = H3Transformer.from_pretrained(job.snapshot, subfolder=job.variant, device=device)
    return model


def run_job(job: TrainJob, model, *, resume: bool = False,
            progress: Callable[[int, int, dict], None] | None = None,
            place: Callable[[Any], dict] | None = None, lead: bool = True, dp_group: Any = None) -> dict[str, Any]:
    """Train `job` (checked) on `model` (its base transformer) and write its folder (module docstring); returns a
    summary {steps, loss, adapter, adapter_sha256, run, digest}. A write that fails without naming its file (a full
    disk inside an atomic write) is reported naming the job folder.
    On a mesh (`h3lab train --cp C` under torchrun) every rank calls this with the same job: `place(model)` puts the
    adapted model on the mesh and returns the records the run's manifest keeps in its `meta` (`{"mesh": ...}`;
    `{"residency": ...}` for a model streamed under a GPU-memory budget), beside the digest, never in it; only the `lead` rank (rank 0) writes the folder and reports progress, the others train alike and
    write nothing (they read a checkpoint to resume, which rank 0 replaces only after every rank has started).
    `dp_group`: the mesh's data-parallel group (`--dp`): each step's requests are split over it
    (`data_parallel_gradients`); None: every rank computes the whole batch."""
    try:
        return _run_job(job, model, resume, progress, place, lead, dp_group)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise TrainingError(f"--out {job.out!r}: writing the job failed ({exc.strerror or exc}); free the space and "
                            "continue with the same command and --resume") from None


def _run_job(job: TrainJob, model, resume: bool, progress, place, lead: bool, dp_group: Any) -> dict[str, Any]:
    out = Path(job.out)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
    if resume:
        try:
            recorded = json.loads((out / JOB).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TrainingError(f"--resume: {str(out / JOB)!r} is unreadable ({exc}); start a new folder") from None
        now = json.loads(json.dumps(job.to_dict()))
        diffs = _differences(recorded, now)
        if diffs:
            listed = "; ".join(f"{key} {mine!r} vs {theirs!r}" for key, mine, theirs in diffs[:4])
            raise TrainingError(f"--resume: this command differs from the job in {str(out / JOB)!r} ({listed}; this "
                                "command's value first); resume with the same arguments")
    elif lead:
        atomic_write_json(out / JOB, job.to_dict())
    handle = add_lora(model, job.rank, job.alpha, job.targets, seed=job.lora_seed)
    try:
        meta = {"job": job.to_dict()}
        if place is not None:
            meta.update(place(model))
        state = None
        last = latest_checkpoint(out) if resume else None
        if last is not None:
            state = read_checkpoint(last, model)
        elif lead:  # a new job, or one interrupted before its first checkpoint: (re)start from step 0
            save_adapter(model, out / "initial")
        initial_sha = read_adapter(out / "initial").sha256 if lead else ""
        records = list(state.records) if state is not None else []

        def on_step(k: int, record: dict, optimizer, trace) -> None:
            records.append(record)
            if not lead:
                return
            if (k + 1) % job.checkpoint_every == 0 or k + 1 == job.config.steps:  # the final step too
                write_checkpoint(out, k, model, optimizer, records, trace, initial_sha)
            if progress is not None:
                progress(k + 1, job.config.steps, record)

        try:
            run = train(model, job.data, job.config, on_step=on_step, resume=state, meta=meta,
                        data_parallel=dp_group is not None, group=dp_group)
        except TrainingError as exc:
            if state is not None and str(exc).startswith("resume"):  # the checkpoint is not what it recorded
                raise TrainingError(f"checkpoint {str(last)!r}: {exc}; remove that checkpoint folder to resume from "
                                    "the start") from None
            raise
        if not lead:
            return {"steps": len(run.steps), "loss": run.steps[-1]["loss"], "adapter": "",
                    "adapter_sha256": run.manifest["adapter"]["final_sha256"], "run": "", "digest": run.digest}
        adapter_path, sha = save_adapter(model, out / "adapter")
        run_path = run.seal(out / "run")
        return {"steps": len(run.steps), "loss": run.steps[-1]["loss"], "adapter": str(adapter_path),
                "adapter_sha256": sha, "run": str(run_path), "digest": run.digest}
    finally:
        remove_lora(model, handle)
