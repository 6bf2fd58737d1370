"""A DiffusionNFT job of the `h3lab train nft` front end: `grpo_job`'s job -- the same prompt file, reward (a name, a
weighted sum, a reward server), rollout canvas, LoRA, folder (job.json, initial/, checkpoint/ after every iteration
but the last, adapter/, run/), checks before any model loads, `--resume` and summary -- with an `NftConfig`.

Contract
--------
`NftJob` is a `GrpoJob` whose `config` is an `NftConfig` (`config.mode` and `config.to_dict()` are all the job reads
of it besides the hooks); it overrides the algorithm's hooks only:
- the rollout (`rollout_options`): `Session.rollout(..., stepper=config.kind, level=config.level or 0.7,
  needs_density=False)` -- the released Euler step by default (`level` unused there), an SDE stepper if asked;
  iteration k's rollout seed is `grpo_job.rollout_seed(seed, k)`, as GRPO's;
- the batch (`make_batch`): `nft.batch_from_rollout` (the requests' final latents, the rewards, a sum's parts);
- the run (`train_run`, `load_checkpoint`): `nft.nft_train` / `nft.load`, so `run/` is a sealed `h3lab-nft/1` run
  (`h3lab.training.nft.load` / `verify`);
- the summary: the last iteration's on-policy statistic (first epoch: how many generated-row velocities of the
  training forward were byte-equal to the frozen previous policy's).
`run_nft_job` is `grpo_job.run_grpo_job` (it calls the hooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

from ..grpo_job import GrpoJob, run_grpo_job
from .run import load, nft_train
from .step import batch_from_rollout


@dataclass(frozen=True)
class NftJob(GrpoJob):
    """One `h3lab train nft` job (module docstring)."""

    ALGORITHM: ClassVar[str] = "DiffusionNFT"

    def rollout_options(self) -> dict[str, Any]:
        return {"stepper": self.config.kind, "level": 0.7 if self.config.level is None else self.config.level,
                "needs_density": False}

    def make_batch(self, rollout: Any, rewards: Any, parts: list) -> Any:
        return batch_from_rollout(rollout, rewards, parts)

    def train_run(self, model: Any, rollout: Callable, **kwargs: Any) -> Any:
        return nft_train(model, rollout, self.config, self.iterations, **kwargs)

    def load_checkpoint(self, path: Path) -> Any:
        return load(path)

    def summary(self, last: dict) -> dict[str, Any]:
        return {"on_policy": last["epochs"][0]["on_policy"]}


run_nft_job = run_grpo_job
