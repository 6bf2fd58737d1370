"""Training data on disk: a sealed dataset of requests, and reward-weighted requests from sealed rollouts.

- `save_dataset(path, requests)` writes a folder (atomically): `manifest.json` (format `h3lab-dataset/1`, per request
  its kind, metadata -- the layout for clips -- and the SHA-256 of its tensors; `digest`) and `inputs.safetensors`
  (keys `<index:04d>.<name>`), the same entries a sealed training run holds. `load_dataset(path)` re-hashes every
  tensor and rebuilds the `ClipRequest`s / `SampleRequest`s. Clips are encoded latent rows (`ClipRequest`): the
  encoder side (media -> latents) is the session's VAEs and text encoder.
- `rollout_dataset([(trajectory_path, reward), ...])` loads sealed trajectories (which must keep their latents) and
  turns every pass of each into a request weighted by its reward (`objective.rollout_requests`): the reward-weighted
  regression toward the rollout's own samples. No transition log-probability is formed (RFC section 1).
- `check_fits(requests, config)` refuses rows whose widths are not the transformer's (before any model loads).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..run.artifact import MANIFEST, SealedArtifact
from .objective import ClipRequest, SampleRequest, TrainingError, rollout_requests
from .run import _dataset_entry, _named_digests, _request_from

FORMAT = "h3lab-dataset/1"
INPUTS = "inputs.safetensors"


@dataclass
class _SealedDataset(SealedArtifact):
    """The dataset folder as a sealed artifact (`artifact.SealedArtifact`: atomic seal, checked read)."""

    FORMAT = FORMAT
    WHAT = "a sealed clip dataset"
    ERROR = TrainingError

    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    path: Path | None = None

    def tensor_files(self) -> dict[str, dict[str, torch.Tensor]]:
        return {INPUTS: self.tensors}


def dataset_digest(entries: Sequence[dict]) -> str:
    """SHA-256 over the canonical JSON of the dataset's manifest entries (metadata + tensor hashes)."""
    return hashlib.sha256(json.dumps(list(entries), sort_keys=True).encode()).hexdigest()


def describe(requests: Sequence[Any]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """(manifest entries with tensor hashes, tensors) of a request list."""
    entries, tensors = [], {}
    for i, request in enumerate(requests):
        meta, ts = _dataset_entry(i, request)
        ts = {k: v.detach().cpu().contiguous().clone() for k, v in ts.items()}
        entries.append({"index": i, **meta, "sha256": _named_digests(ts, "sha256")})
        tensors.update(ts)
    return entries, tensors


def save_dataset(path: str | os.PathLike, requests: Sequence[Any]) -> Path:
    """Seal `requests` as a dataset folder (module docstring); returns its path."""
    requests = list(requests)
    if not requests:
        raise TrainingError("save_dataset: no requests")
    entries, tensors = describe(requests)
    manifest = {"format": FORMAT, "requests": entries, "digest": dataset_digest(entries)}
    return _SealedDataset(manifest, tensors).seal(path)


def load_dataset(path: str | os.PathLike) -> tuple[list[Any], str]:
    """(requests, digest) of a sealed dataset folder; any mismatch raises `TrainingError` naming it."""
    root = Path(path)
    manifest_path = root / MANIFEST
    manifest = _SealedDataset.read_manifest(root)
    entries = manifest.get("requests") or []
    if not entries or dataset_digest(entries) != manifest.get("digest"):
        raise TrainingError(f"{manifest_path}: the digest does not match its requests (edited or empty)")
    tensors = _SealedDataset.read_tensors(root / INPUTS, {k: v for e in entries for k, v in e["sha256"].items()})
    requests = []
    for e in entries:
        prefix = f"{e['index']:04d}."
        requests.append(_request_from(e, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}))
    return requests, manifest["digest"]


def rollout_dataset(rollouts: Sequence[tuple[str | os.PathLike, float]]) -> tuple[list[SampleRequest], str]:
    """(requests, digest): every pass of each sealed rollout, weighted by its reward (module docstring)."""
    from ..run.trajectory import TrajectoryError, load

    requests: list[SampleRequest] = []
    for path, reward in rollouts:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise TrainingError(f"--rollout {str(path)!r} reward={reward!r}: must be a finite number")
        try:
            trajectory = load(path)
        except TrajectoryError as exc:
            raise TrainingError(f"--rollout {str(path)!r}: {exc}") from None
        requests += rollout_requests(trajectory, weight=float(reward))
    entries, _ = describe(requests)
    return requests, dataset_digest(entries)


def check_fits(requests: Sequence[Any], config: Any) -> None:
    """Every request's text / video / audio rows have the transformer's widths."""
    for i, request in enumerate(requests):
        text, video, audio = ((request.text, request.video, request.audio) if isinstance(request, ClipRequest)
                              else (request.fixed.text, request.fixed.video, request.fixed.audio))
        for what, x, want in (("text", text, config.text_dim), ("video", video, config.video_patch_dim),
                              ("audio", audio, config.audio_in_channels)):
            if x.shape[-1] != want:
                raise TrainingError(f"training request {i}: {what} rows are {x.shape[-1]} wide; this transformer "
                                    f"takes {want}")
