"""Sealed GRPO runs: iterations of (rollout batch -> `grpo_step.grpo_iteration`), every knob and every record sealed,
written atomically, and re-run by `verify`, which names the first iteration, epoch and field that differ.

Contract
--------
`grpo_train(model, rollout, config, iterations)` trains `model` (its LoRA adapter) in place: iteration k calls
`rollout(k, model)` for a `RolloutBatch` (the front end's: a stochastic rollout of the current policy, scored by the
reward), then `grpo_iteration(model, batch, config, optimizer, k)`; one `StrictAdamW` (from the config) lives across
iterations; `on_iteration` and `resume` as `rl_run.train` (the loop GRPO and DiffusionNFT share). It returns a
`GrpoRun`:

- `manifest.json`: format, code revision and versions, device, hash scheme, the `GrpoConfig` (every knob), the
  reward's name and the run's free-form `meta`, the base checkpoint fingerprint, the trainable parameters and their
  initial digests, the adapter (peft config, sha256 before and after), per iteration its record (rewards, a weighted
  sum's parts, advantages, the trained items, per inner epoch every item's log-densities, ratios, clip flags, KL,
  weights, loss and gradient digest; the epoch's gradient, weight and optimiser digests, ratio statistics), the
  transitions' metadata and SHA-256, and `digest` = SHA-256 of the canonical JSON of the iteration records.
- `inputs.safetensors`: every iteration's transitions, keys `<k:04d>.<request:04d>.<pass:04d>.<name>`.
- `weights.safetensors`: `initial.<param>`, `final.<param>`, `optimizer.<param>.<state>`.

`load(path)` re-hashes every tensor and the digest. `verify(run, model)` puts the initial trainable weights into the
model, re-runs every iteration from the sealed transitions and rewards (not the rollouts: a rollout trajectory is
sealed and verified on its own, `h3lab.run.trajectory.verify`) and compares each iteration record field by field; it
leaves the model's weights as it found them. Hashes use `tensor_digest` under the model device's scheme.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from . import rl_run
from .grpo_step import GrpoConfig, RolloutBatch, Transition, grpo_iteration
from .rl_run import INPUTS_FILE, WEIGHTS_FILE, first_difference, records_digest  # noqa: F401 - this module's names
from .rl_run import RlVerifyReport as GrpoVerifyReport

FORMAT = "h3lab-grpo/1"


@dataclass
class GrpoRun(rl_run.RlRun):
    """A run: the manifest, per iteration its `RolloutBatch`, the weights tensors, and its path once sealed."""

    FORMAT = FORMAT
    WHAT = "a sealed GRPO run"
    CONFIG = GrpoConfig

    @staticmethod
    def batch_tensors(k: int, batch: RolloutBatch) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """The transitions' metadata entries and tensors, keys `<k:04d>.<request:04d>.<pass:04d>.<name>`."""
        meta, tensors = [], {}
        for passes in batch.transitions:
            for t in passes:
                prefix = f"{k:04d}.{t.request:04d}.{t.pass_index:04d}."
                entry, named = rl_run.sealed_entry(prefix, t.tensors(), t.meta())
                meta.append(entry)
                tensors.update(named)
        return meta, tensors


GRPO = rl_run.Algorithm("GRPO", GrpoRun, RolloutBatch, grpo_iteration, "transitions")


def grpo_train(model: nn.Module, rollout: Callable[[int, nn.Module], RolloutBatch], config: GrpoConfig,
               iterations: int, *, reward: str = "", meta: dict | None = None,
               on_iteration: Callable[[int, dict, "GrpoRun"], None] | None = None,
               resume: "GrpoRun | None" = None) -> GrpoRun:
    """Train `model` for `iterations` GRPO iterations (module docstring) and return the in-memory run.
    `on_iteration(k, record, run_so_far)` after every iteration (a front end seals `run_so_far` as its checkpoint);
    `resume` (such a sealed partial run, same config) puts its final weights and optimiser state into the model and
    continues with iteration len(resume.iterations)."""
    return rl_run.train(GRPO, model, rollout, config, iterations, reward=reward, meta=meta,
                        on_iteration=on_iteration, resume=resume)


def load(path: str | os.PathLike) -> GrpoRun:
    """Read a sealed GRPO run and check every tensor and the digest against the manifest."""
    root, manifest, inputs, weights = rl_run.read(GRPO, path)
    batches = []
    for k, (entries, record) in enumerate(zip(manifest["transitions"], manifest["iterations"])):
        requests = len(record["rewards"])
        per: list[list[Transition]] = [[] for _ in range(requests)]
        for e in entries:
            tensors = rl_run.entry_tensors(inputs, f"{k:04d}.{e['request']:04d}.{e['pass']:04d}.")
            per[e["request"]].append(Transition.from_sealed(tensors, e))
        batches.append(RolloutBatch(per, record["sde"], torch.tensor(record["rewards"], dtype=torch.float64),
                                    dict(record["origin"]), list(record.get("reward_parts", []))))
    return GrpoRun(manifest, batches, weights, path=root)


def verify(run: str | os.PathLike | GrpoRun, model: nn.Module) -> GrpoVerifyReport:
    """Re-run every iteration of a sealed run on `model` and compare (module docstring)."""
    return rl_run.verify(GRPO, run if isinstance(run, GrpoRun) else load(run), model)
