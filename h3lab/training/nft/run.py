"""Sealed DiffusionNFT runs (`h3lab-nft/1`): iterations of (rollout batch -> `step.nft_iteration`) on the loop GRPO
shares (`rl_run`), every knob and record sealed, written atomically, and re-run byte for byte by `verify`.

Contract
--------
`nft_train(model, rollout, config, iterations, *, reward, meta, on_iteration, resume)` is `rl_run.train` with
`rollout(k, model) -> NftBatch` and `nft_iteration`; it returns an `NftRun`:

- `manifest.json`: as `rl_run` lists it, with the `NftConfig`; per iteration its record (`step.py`: rewards, a
  weighted sum's parts, advantages, optimality, the noising sigmas, every item's v_old / v_ref digests, per inner
  epoch every item's loss terms and the on-policy gap, the epoch's gradient, weight and optimiser digests) and, under
  `requests`, every clean request's metadata and the SHA-256 of its tensors.
- `inputs.safetensors`: every iteration's clean requests, keys `<k:04d>.<request:04d>.<name>`.
- `weights.safetensors`: `initial.<param>`, `final.<param>`, `optimizer.<param>.<state>`.

`load(path)` re-hashes every tensor and the digest. `verify(run, model)` puts the initial trainable weights into the
model and re-runs every iteration from the sealed clean requests and rewards: the noising draws, the previous
policy's velocities (from the weights the replay reached at that iteration's start), the reference's, the losses,
gradients and optimiser steps -- comparing each iteration record field by field (the rollouts themselves are
trajectories, verified on their own).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .. import rl_run
from ..rl_run import RlVerifyReport
from .objective import NftConfig
from .step import CleanRequest, NftBatch, nft_iteration

FORMAT = "h3lab-nft/1"


@dataclass
class NftRun(rl_run.RlRun):
    """A run: the manifest, per iteration its `NftBatch`, the weights tensors, and its path once sealed."""

    FORMAT = FORMAT
    WHAT = "a sealed DiffusionNFT run"
    CONFIG = NftConfig

    @staticmethod
    def batch_tensors(k: int, batch: NftBatch) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """The clean requests' metadata entries and tensors, keys `<k:04d>.<request:04d>.<name>`."""
        meta, tensors = [], {}
        for q in batch.requests:
            entry, named = rl_run.sealed_entry(f"{k:04d}.{q.request:04d}.", q.tensors(), q.meta())
            meta.append(entry)
            tensors.update(named)
        return meta, tensors


NFT = rl_run.Algorithm("DiffusionNFT", NftRun, NftBatch, nft_iteration, "requests")


def nft_train(model: nn.Module, rollout: Callable[[int, nn.Module], NftBatch], config: NftConfig, iterations: int, *,
              reward: str = "", meta: dict | None = None,
              on_iteration: Callable[[int, dict, NftRun], None] | None = None,
              resume: NftRun | None = None) -> NftRun:
    """Train `model` for `iterations` DiffusionNFT iterations (module docstring) and return the in-memory run."""
    return rl_run.train(NFT, model, rollout, config, iterations, reward=reward, meta=meta, on_iteration=on_iteration,
                        resume=resume)


def load(path: str | os.PathLike) -> NftRun:
    """Read a sealed DiffusionNFT run and check every tensor and the digest against the manifest."""
    root, manifest, inputs, weights = rl_run.read(NFT, path)
    batches = []
    for k, (entries, record) in enumerate(zip(manifest["requests"], manifest["iterations"])):
        requests = []
        for e in sorted(entries, key=lambda e: e["request"]):
            requests.append(CleanRequest.from_sealed(rl_run.entry_tensors(inputs, f"{k:04d}.{e['request']:04d}."), e))
        batches.append(NftBatch(requests, torch.tensor(record["rewards"], dtype=torch.float64),
                                dict(record["origin"]), list(record.get("reward_parts", []))))
    return NftRun(manifest, batches, weights, path=root)


def verify(run: str | os.PathLike | NftRun, model: nn.Module) -> RlVerifyReport:
    """Re-run every iteration of a sealed run on `model` and compare (module docstring)."""
    return rl_run.verify(NFT, run if isinstance(run, NftRun) else load(run), model)
