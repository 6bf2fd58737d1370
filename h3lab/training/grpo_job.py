"""A GRPO job of the `h3lab train grpo` front end: iterations of (stochastic rollout of the current LoRA policy on a
prompt file -> reward -> `grpo_step.grpo_iteration`), checkpointed after every iteration, resumable, sealed.

Contract
--------
`GrpoJob` (frozen) is everything a job varies: the prompt file (one prompt a line; blank lines and lines starting
with `#` are skipped), the group G, the reward (`rewards.resolve_reward`: NAME, a weighted sum NAME:W,NAME:W or
module:function; or a reward server URL with its `reward_timeout` and `reward_retries`, `reward_client`), the iteration
count, the rollout (SDE `GrpoConfig.kind`, `level`, `steps` passes, canvas `width` x `height` x `frames`), the LoRA
(rank, alpha, targets, init seed), the `GrpoConfig` (every GRPO knob), snapshot, device, `out`. `check()` validates
every value, the prompts (`settings.check_prompt`), the reward (imported, not called), the output folder and the LoRA
targets against the snapshot's transformer config -- before any model loads -- raising one-line `H3Error`s; a
reward server is asked once (`reward_client.probe`) so a dead one fails then too.

Iteration k rolls out with `Session.rollout(prompts, group=G, stepper=kind, level=level, seed=rollout_seed(seed, k),
decode=reward.needs == "decoded", steps=, width=, height=, frames=, mode=)` on the session's transformer, which
carries the job's LoRA adapter in place (so the rollout runs the current policy), scores every request with the
reward (`rewards.score_parts`: a sum's parts go into the records; `grpo_report.reward_samples`), builds the
`RolloutBatch` (`grpo_step.batch_from_rollout`) and trains one iteration. A reward that fails (a reward server that
does not answer) fails the iteration before its update: the checkpoint of the iteration before stays, `--resume`
continues from it. The same folder, checks and resume serve `h3lab train nft` (`nft/job.py`: `NftJob` subclasses
`GrpoJob` and overrides the hooks `rollout_options`, `make_batch`, `train_run`, `load_checkpoint`, `summary`).
The output folder `out`:
    job.json              the job (`--resume` must name the same job)
    initial/              the adapter before iteration 0 (PEFT format)
    checkpoint/           after every iteration but the last, atomically: the sealed run so far (`grpo_run`), whose
                          `final.*` weights and optimiser state are where the next iteration starts; removed once
                          `adapter/` and `run/` are written (the finished run supersedes it)
    adapter/              the final adapter (PEFT format)
    run/                  the sealed GRPO run (`h3lab.training.grpo_run.load` / `verify`)
`--resume` puts the checkpoint's weights and optimiser state back and continues; the rollouts after it are drawn
from the same seeds, so the finished run's records equal an uninterrupted run's. A job stopped before its first
checkpoint (interrupted, a failing reward, a full disk: only `job.json` and perhaps `initial/` on disk) is restarted
by `--resume` from iteration 0 (the LoRA init is seeded: the same initial adapter) -- the rule of every job folder
(`h3lab.training.job`). `--resume` on a finished job (`run/` sealed and `adapter/` written) is refused, saying it is
finished. Every argument is checked by `check()` before anything is written: the stepper's level rule, the pass
selection against the rollout's passes, the reward's signature.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from ..hashing import key_seed
from ..io_utils import atomic_write_json
from .grpo_report import reward_samples
from .grpo_run import GrpoRun, grpo_train
from .grpo_run import load as load_run
from .grpo_step import GrpoConfig, batch_from_rollout
from .job_folder import JOB, check_job_folder
from ..adapters.lora import PROJECTIONS, add_lora, parse_targets, remove_lora, save_adapter
from .objective import TrainingError
from .rewards import Reward, resolve_reward, score_parts

CHECKPOINT = "checkpoint"


def rollout_seed(seed: int, iteration: int) -> int:
    """63 bits of SHA-256 of `h3lab-grpo-rollout|seed|iteration`: the rollout seed of iteration k."""
    return key_seed(f"h3lab-grpo-rollout|{seed}|{iteration}")


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a prompt file (module docstring); one-line errors naming the file and line."""
    from ..schema.generation_settings import check_prompt

    p = Path(path).expanduser()
    if not p.is_file():
        raise TrainingError(f"--prompts {str(path)!r}: no such file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise TrainingError(f"--prompts {str(path)!r}: not UTF-8 text ({err.reason})") from None
    prompts = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    if not prompts:
        raise TrainingError(f"--prompts {str(path)!r}: holds no prompt (one a line; '#' lines are comments)")
    for prompt in prompts:
        check_prompt(prompt)
    return prompts


@dataclass(frozen=True)
class GrpoJob:
    """One `h3lab train grpo` job (module docstring). `snapshot=None` is the embedded tiny snapshot."""

    ALGORITHM: ClassVar[str] = "GRPO"

    out: str
    prompts: str
    reward: str
    config: GrpoConfig
    iterations: int = 1
    steps: int = 4
    width: int | None = None
    height: int | None = None
    frames: int | None = None
    snapshot: str | None = None
    device: str | None = None
    rank: int = 16
    alpha: float | None = None
    targets: tuple[str, ...] = PROJECTIONS
    lora_seed: int = 0
    prompt_list: tuple[str, ...] = field(default=(), compare=False, repr=False)  # filled by check()
    reward_timeout: float = 60.0
    reward_retries: int = 2

    @property
    def reward_server(self) -> bool:
        return self.reward.startswith(("http://", "https://")) and "," not in self.reward

    def to_dict(self) -> dict[str, Any]:
        server = {"reward_timeout": self.reward_timeout, "reward_retries": self.reward_retries}
        return {"prompts": self.prompts, "prompt_list": list(self.prompt_list), "reward": self.reward,
                "config": self.config.to_dict(), "iterations": self.iterations, "steps": self.steps,
                "width": self.width, "height": self.height, "frames": self.frames, "snapshot": self.snapshot,
                "rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "lora_seed": self.lora_seed,
                **(server if self.reward_server else {})}

    def scorer(self, probe: bool = False) -> Reward:
        """The job's reward (module docstring); a reward server with the job's timeout and retries, asked once when
        `probe`."""
        if not self.reward_server:
            return resolve_reward(self.reward)
        from .reward_client import probe as ask, remote_reward

        reward = remote_reward(self.reward, self.reward_timeout, self.reward_retries)
        if probe:
            ask(self.reward, min(self.reward_timeout, 10.0))
        return reward

    # ---------------------------------------------------------------- the algorithm's hooks (`NftJob` overrides)
    def rollout_options(self) -> dict[str, Any]:
        """`Session.rollout` keywords of the algorithm: the stepper and its level."""
        return {"stepper": self.config.kind, "level": self.config.level}

    def make_batch(self, rollout: Any, rewards: Any, parts: list) -> Any:
        return batch_from_rollout(rollout, rewards, parts)

    def train_run(self, model: Any, rollout: Callable, **kwargs: Any) -> Any:
        return grpo_train(model, rollout, self.config, self.iterations, **kwargs)

    def load_checkpoint(self, path: Path) -> Any:
        return load_run(path)

    def summary(self, last: dict) -> dict[str, Any]:
        """The on-policy statistics of the last iteration's first epoch, for the front end's last line."""
        return {"ratio": last["epochs"][0]["ratio"]}

    def generation(self) -> dict[str, Any]:
        """The generation settings every rollout request shares."""
        out = {"steps": self.steps, "mode": self.config.mode}
        out.update({k: getattr(self, k) for k in ("width", "height", "frames") if getattr(self, k) is not None})
        return out

    def check(self, resume: bool = False) -> "GrpoJob":
        """Every value, path and the prompts, before any model loads (module docstring)."""
        from ..execution.devices import resolve_device
        from ..schema.generation_settings import GenerationSettings
        from .job import _check_targets, _snapshot_config, check_alpha
        from .objective import checked_int

        iterations = checked_int("--iterations", self.iterations, 1)
        steps = checked_int("--steps", self.steps, 1)
        selection = getattr(self.config, "selection", None)  # GRPO trains SDE passes; NFT trains final latents
        if selection is not None:
            selection.check_passes([True] * steps)  # every rollout pass is an SDE pass (no window)
        rank = checked_int("--rank", self.rank, 1)
        lora_seed = checked_int("--lora-seed", self.lora_seed, 0)
        check_alpha(self.alpha)
        self.scorer()
        prompts = read_prompts(self.prompts)
        GenerationSettings(prompt=prompts[0], **self.generation())  # the canvas / frames / steps rules
        device = resolve_device(self.device)
        if self.config.mode == "strict" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise TrainingError("--mode strict on the cpu: strict kernels run there only under TRITON_INTERPRET=1 "
                                "(export it before starting), or use --mode off")
        targets = parse_targets(self.targets)
        out = check_job_folder(Path(self.out).expanduser(), resume, self.ALGORITHM,
                               lambda folder: (folder / CHECKPOINT).is_dir())
        snapshot = self._snapshot()
        _check_targets(targets, _snapshot_config(snapshot, "transformer"))
        if self.reward_server:
            self.scorer(probe=True)
        return dataclasses.replace(self, out=str(out.resolve()), prompts=str(Path(self.prompts).resolve()),
                                   iterations=iterations, steps=steps, rank=rank, lora_seed=lora_seed,
                                   targets=targets, snapshot=str(snapshot), prompt_list=tuple(prompts))

    def _snapshot(self) -> Path:
        from ..errors import CheckpointError

        if self.snapshot is None:
            from ..checkpoint.tiny import default_snapshot

            return Path(default_snapshot()).resolve()
        path = Path(self.snapshot).expanduser()
        if not (path / "transformer" / "config.json").is_file():
            raise CheckpointError(f"snapshot {self.snapshot!r}: no transformer/config.json (not a MiniMax-H3 "
                                  "snapshot folder)")
        return path.resolve()


def run_grpo_job(job: GrpoJob, session: Any, *, resume: bool = False,
                 progress: Callable[[int, int, dict], None] | None = None) -> dict[str, Any]:
    """Train `job` (checked) with `session` (its snapshot, on its device) and write its folder (module docstring);
    returns a summary {iterations, reward_mean, ratio, adapter, adapter_sha256, run, digest}. `progress(k, total,
    record)` after each iteration; its optional `phase(k, total, text)` as each phase of iteration k starts."""
    out = Path(job.out)
    out.mkdir(parents=True, exist_ok=True)
    if resume:
        recorded = json.loads((out / JOB).read_text(encoding="utf-8"))
        now = json.loads(json.dumps(job.to_dict()))
        if recorded != now:
            key = next(k for k in sorted(set(recorded) | set(now)) if recorded.get(k) != now.get(k))
            raise TrainingError(f"--resume: this command's {key} differs from the job in {str(out / JOB)!r}; "
                                "resume with the same arguments")
    else:
        atomic_write_json(out / JOB, job.to_dict())
    reward = job.scorer()
    decoded = reward.needs == "decoded"
    model = session.transformer("transformer")
    handle = add_lora(model, job.rank, job.alpha, job.targets, seed=job.lora_seed)
    try:
        previous = None
        if resume and (out / CHECKPOINT).is_dir():
            previous = job.load_checkpoint(out / CHECKPOINT)
        else:  # a new job, or one stopped before its first checkpoint: (re)start from iteration 0
            save_adapter(model, out / "initial")

        phase = getattr(progress, "phase", None) or (lambda k, total, text: None)
        requests = len(job.prompt_list) * job.config.group

        def rollout(k: int, _model: Any):
            phase(k, job.iterations, f"rollout of {requests} requests x {job.steps} passes")
            ro = session.rollout(list(job.prompt_list), group=job.config.group, **job.rollout_options(),
                                 seed=rollout_seed(job.config.seed, k), decode=decoded, **job.generation())
            phase(k, job.iterations, f"reward {job.reward}")
            batch = job.make_batch(ro, *score_parts(reward, reward_samples(ro, decoded)))
            phase(k, job.iterations, "training step")
            return batch

        def on_iteration(k: int, record: dict, run: GrpoRun) -> None:
            if k + 1 < job.iterations:
                run.seal(out / CHECKPOINT)
            if progress is not None:
                progress(k + 1, job.iterations, record)

        meta: dict[str, Any] = {"job": job.to_dict()}
        if getattr(session, "residency", "resident") != "resident":  # where the weights lived: beside the digest
            meta["residency"] = {"policy": session.residency, "gpu_memory_gib": session.gpu_memory}
        run = job.train_run(model, rollout, reward=job.reward, meta=meta, on_iteration=on_iteration,
                            resume=previous)
        adapter_path, sha = save_adapter(model, out / "adapter")
        run_path = run.seal(out / "run")
        shutil.rmtree(out / CHECKPOINT, ignore_errors=True)  # superseded by run/ (module docstring)
        last = run.iterations[-1]
        return {"iterations": len(run.iterations), "reward_mean": sum(last["rewards"]) / len(last["rewards"]),
                **job.summary(last), "adapter": str(adapter_path), "adapter_sha256": sha,
                "run": str(run_path), "digest": run.digest}
    finally:
        remove_lora(model, handle)


