"""Sealed GRPO runs: iterations of (rollout batch -> `grpo_step.grpo_iteration`), every knob and every record sealed,
written atomically, and re-run by `verify`, which names the first iteration, epoch and field that differ.

Contract
--------
`grpo_train(model, rollout, config, iterations)` trains `model` (its LoRA adapter) in place: iteration k calls
`rollout(k, model)` for a `RolloutBatch` (the front end's: a stochastic rollout of the current policy, scored by the
reward), then `grpo_iteration(model, batch, config, optimizer, k)`; one `StrictAdamW` (from the config) lives across
iterations. It returns a `GrpoRun`:

- `manifest.json`: format, code revision and versions, device, hash scheme, the `GrpoConfig` (every knob), the
  reward's name and the run's free-form `meta`, the base checkpoint fingerprint, the trainable parameters and their
  initial digests, the adapter (peft config, sha256 before and after), per iteration its record (rewards,
  advantages, the trained items, per inner epoch every item's log-densities, ratios, clip flags, KL, weights, loss
  and gradient digest; the epoch's gradient, weight and optimiser digests, ratio statistics), the transitions'
  metadata and SHA-256, and `digest` = SHA-256 of the canonical JSON of the iteration records.
- `inputs.safetensors`: every iteration's transitions, keys `<k:04d>.<request:04d>.<pass:04d>.<name>`.
- `weights.safetensors`: `initial.<param>`, `final.<param>`, `optimizer.<param>.<state>`.

`load(path)` re-hashes every tensor and the digest. `verify(run, model)` puts the initial trainable weights into the
model, re-runs every iteration from the sealed transitions and rewards (not the rollouts: a rollout trajectory is
sealed and verified on its own, `h3lab.trajectory.verify`) and compares each iteration record field by field; it
leaves the model's weights as it found them. Hashes use `tensor_digest` under the model device's scheme.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..artifact import MANIFEST, SealedArtifact, code_provenance
from ..hashing import tensor_digest
from ..trajectory import TraceSummary
from .grpo_step import GrpoConfig, RolloutBatch, Transition, grpo_iteration
from .lora import adapter_digest, base_fingerprint, config_json, has_lora
from .objective import TrainingError
from .run import _scheme, check_stored_weights, check_trainable
from .step import model_device, trainable_parameters

FORMAT = "h3lab-grpo/1"
INPUTS_FILE = "inputs.safetensors"
WEIGHTS_FILE = "weights.safetensors"


def records_digest(iterations: list[dict]) -> str:
    return hashlib.sha256(json.dumps(iterations, sort_keys=True).encode()).hexdigest()


def _host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def _batch_tensors(k: int, batch: RolloutBatch) -> tuple[list[dict], dict[str, torch.Tensor]]:
    meta, tensors = [], {}
    for passes in batch.transitions:
        for t in passes:
            prefix = f"{k:04d}.{t.request:04d}.{t.pass_index:04d}."
            named = {prefix + n: v.detach().cpu().clone().contiguous() for n, v in t.tensors().items()}
            tensors.update(named)
            meta.append({**t.meta(), "sha256": {n: tensor_digest(v, "sha256") for n, v in named.items()}})
    return meta, tensors


@dataclass
class GrpoRun(SealedArtifact):
    """A run: the manifest, per iteration its `RolloutBatch`, the weights tensors, and its path once sealed. Sealed
    and read through `artifact.SealedArtifact`."""

    FORMAT = FORMAT
    WHAT = "a sealed GRPO run"
    ERROR = TrainingError

    manifest: dict[str, Any]
    batches: list[RolloutBatch]
    weights: dict[str, torch.Tensor]
    path: Path | None = None

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def config(self) -> GrpoConfig:
        return GrpoConfig.from_dict(self.manifest["config"])

    @property
    def iterations(self) -> list[dict]:
        return self.manifest["iterations"]

    def tensor_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """What `seal` writes: every iteration's transitions and the weights."""
        tensors: dict[str, torch.Tensor] = {}
        for k, batch in enumerate(self.batches):
            tensors.update(_batch_tensors(k, batch)[1])
        return {INPUTS_FILE: tensors, WEIGHTS_FILE: self.weights}


def grpo_train(model: nn.Module, rollout: Callable[[int, nn.Module], RolloutBatch], config: GrpoConfig,
               iterations: int, *, reward: str = "", meta: dict | None = None,
               on_iteration: Callable[[int, dict, "GrpoRun"], None] | None = None,
               resume: "GrpoRun | None" = None) -> GrpoRun:
    """Train `model` for `iterations` GRPO iterations (module docstring) and return the in-memory run.
    `on_iteration(k, record, run_so_far)` after every iteration (a front end seals `run_so_far` as its checkpoint);
    `resume` (such a sealed partial run, same config) puts its final weights and optimiser state into the model and
    continues with iteration len(resume.iterations)."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise TrainingError(f"iterations={iterations!r}: must be an integer >= 1")
    params = trainable_parameters(model)
    if not params:
        raise TrainingError("no trainable parameters: GRPO trains a LoRA adapter (or any requires_grad weights)")
    optimizer = config.optimizer(params)
    if resume is None:
        initial = _host(dict(params))
        adapter = {"config": json.loads(config_json(model.peft_config["default"])),
                   "initial_sha256": adapter_digest(model)} if has_lora(model) else None
        records, batches, transitions = [], [], []
    else:
        if resume.config != config:
            raise TrainingError("resume: the checkpoint's GRPO config differs from this job's")
        if not 0 < len(resume.iterations) < iterations:
            raise TrainingError(f"resume after {len(resume.iterations)} of {iterations} iterations: nothing to resume")
        initial = {n: resume.weights[f"initial.{n}"] for n, _ in params}
        adapter = resume.manifest.get("adapter")
        adapter = dict(adapter, final_sha256=None) if adapter else None
        with torch.no_grad():
            for n, p in params:
                p.copy_(resume.weights[f"final.{n}"])
        optimizer.load_state_tensors({k[len("optimizer."):]: v.to(model_device(model))
                                      for k, v in resume.weights.items() if k.startswith("optimizer.")},
                                     int(resume.manifest["optimizer_steps"]))
        records, batches = list(resume.iterations), list(resume.batches)
        transitions = list(resume.manifest["transitions"])
    header = {"reward": str(reward), "meta": dict(meta or {}), "initial": initial, "adapter": adapter}
    trace = TraceSummary()
    run = None
    for k in range(len(records), iterations):
        batch = rollout(k, model)
        if not isinstance(batch, RolloutBatch):
            raise TrainingError(f"rollout({k}) returned a {type(batch).__name__}: must be a RolloutBatch")
        record = grpo_iteration(model, batch, config, optimizer, k, trace)
        records.append(record)
        batches.append(batch)
        transitions.append(_batch_tensors(k, batch)[0])
        run = _assemble(model, config, params, optimizer, header, records, batches, transitions, trace)
        if on_iteration is not None:
            on_iteration(k, record, run)
    return run


def _assemble(model, config, params, optimizer, header, records, batches, transitions, trace) -> GrpoRun:
    scheme = _scheme(model)
    adapter = header["adapter"]
    if adapter is not None:
        adapter = dict(adapter, final_sha256=adapter_digest(model))
    weights = {f"initial.{k}": v for k, v in header["initial"].items()}
    weights.update({f"final.{n}": p for n, p in _host(dict(params)).items()})
    weights.update({f"optimizer.{k}": v for k, v in _host(optimizer.state_tensors()).items()})
    manifest = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code": code_provenance(),
        "device": str(model_device(model)),
        "hash_scheme": scheme,
        "config": config.to_dict(),
        "reward": header["reward"],
        "meta": header["meta"],
        "checkpoint": {"fingerprint": base_fingerprint(model), "dtype_policy": getattr(model, "dtype_policy", "")},
        "trainable": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                      for n, p in params],
        "initial_weights": {k: tensor_digest(v, scheme) for k, v in header["initial"].items()},
        **({"adapter": adapter} if adapter is not None else {}),
        "transitions": list(transitions),
        "iterations": list(records),
        "optimizer_steps": optimizer.step_count,
        "trace": trace.to_dict(),
        "weights_file": {k: tensor_digest(v, "sha256") for k, v in weights.items()},
        "digest": records_digest(records),
    }
    return GrpoRun(manifest, list(batches), weights)


def load(path: str | os.PathLike) -> GrpoRun:
    """Read a sealed GRPO run and check every tensor and the digest against the manifest."""
    root = Path(path)
    manifest = GrpoRun.read_manifest(root, ("iterations", "transitions", "config", "trainable", "weights_file",
                                            "digest"))
    if records_digest(manifest["iterations"]) != manifest["digest"]:
        raise TrainingError(f"{root / MANIFEST}: digest does not match its iteration records: the manifest was edited")
    inputs = GrpoRun.read_tensors(root / INPUTS_FILE, {n: d for it in manifest["transitions"] for e in it
                                                       for n, d in e["sha256"].items()})
    weights = GrpoRun.read_tensors(root / WEIGHTS_FILE, manifest["weights_file"])
    batches = []
    for k, (entries, record) in enumerate(zip(manifest["transitions"], manifest["iterations"])):
        requests = len(record["rewards"])
        per: list[list[Transition]] = [[] for _ in range(requests)]
        for e in entries:
            prefix = f"{k:04d}.{e['request']:04d}.{e['pass']:04d}."
            tensors = {n[len(prefix):]: v for n, v in inputs.items() if n.startswith(prefix)}
            per[e["request"]].append(Transition.from_sealed(tensors, e))
        batches.append(RolloutBatch(per, record["sde"], torch.tensor(record["rewards"], dtype=torch.float64),
                                    dict(record["origin"])))
    return GrpoRun(manifest, batches, weights, path=root)


@dataclass
class GrpoVerifyReport:
    """OK, or the first iteration / field whose re-run value differs from the record."""

    ok: bool
    iterations_checked: int
    num_iterations: int
    first_iteration: int | None = None
    field: str | None = None
    expected: Any = None
    got: Any = None
    digest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        if self.ok:
            return (f"OK: {self.iterations_checked}/{self.num_iterations} GRPO iterations byte-equal "
                    f"(digest {self.digest[:16]})")
        return (f"DRIFT at iteration {self.first_iteration}: {self.field} {str(self.got)[:24]} != recorded "
                f"{str(self.expected)[:24]}")


def first_difference(want: Any, got: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(path, expected, got) of the first differing leaf of two JSON records (dict keys in the record's order)."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in want:
            found = first_difference(want[key], got.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        for j, (w, g) in enumerate(zip(want, got)):
            found = first_difference(w, g, f"{path}[{j}]")
            if found:
                return found
        return None
    return None if want == got else (path, want, got)


def verify(run: str | os.PathLike | GrpoRun, model: nn.Module) -> GrpoVerifyReport:
    """Re-run every iteration of a sealed run on `model` and compare (module docstring)."""
    run = run if isinstance(run, GrpoRun) else load(run)
    manifest, config = run.manifest, run.config
    params = check_trainable(manifest, model)
    if _scheme(model) != manifest["hash_scheme"]:
        raise TrainingError(f"the run was hashed with {manifest['hash_scheme']!r}: verify on a {manifest['device']} "
                            "model")
    if not run.iterations:
        raise TrainingError(f"{run.path or 'the run'}: the run records no iteration")
    last = run.iterations[-1]["epochs"][-1]
    check_stored_weights(run.weights, run.path / WEIGHTS_FILE if run.path is not None else "the run's weights", params,
                         manifest["hash_scheme"], config.optimizer(params), last, int(manifest["optimizer_steps"]),
                         f"iteration {len(run.iterations) - 1}")
    saved = {n: p.detach().clone() for n, p in params}
    optimizer = config.optimizer(params)
    done, found = 0, None
    try:
        with torch.no_grad():
            for n, p in params:
                p.copy_(run.weights[f"initial.{n}"])
        for k, batch in enumerate(run.batches):
            record = grpo_iteration(model, batch, config, optimizer, k)
            done += 1
            found = first_difference(manifest["iterations"][k], json.loads(json.dumps(record)))
            if found:
                found = (k, *found)
                break
    finally:
        with torch.no_grad():
            for n, p in params:
                p.copy_(saved[n])
    common = dict(iterations_checked=done, num_iterations=len(run.batches), digest=run.digest)
    if found:
        return GrpoVerifyReport(False, first_iteration=found[0], field=found[1], expected=found[2], got=found[3],
                                **common)
    return GrpoVerifyReport(True, **common)
