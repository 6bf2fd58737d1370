"""The sealed-run core that GRPO (`grpo_run.py`) and DiffusionNFT (`nft/run.py`) share: iterations of (rollout batch
-> one algorithm iteration), resume from a sealed partial run, the manifest, load checks and verify.

Contract
--------
An `Algorithm` names what differs: its name, its sealed run class (an `RlRun`: manifest format, config class, the
per-iteration tensors of a batch `batch_tensors(k, batch) -> (metadata entries, {key: tensor})`), its batch class,
`iterate(model, batch, config, optimizer, k, trace) -> record`, and the manifest key the batches' metadata entries
live under (`inputs_key`: GRPO's "transitions"). `step_record` is the optimiser step both iterations end an inner
epoch with, and its record.

`train(algorithm, model, rollout, config, iterations, ...)` trains `model` (its trainable parameters: a LoRA adapter)
in place: iteration k calls `rollout(k, model)` for the iteration's batch (the front end's: a rollout of the current
policy, scored by the reward), then `algorithm.iterate`; one `StrictAdamW` (from `config.optimizer`) lives across
iterations. `on_iteration(k, record, run_so_far)` follows every iteration (a front end seals `run_so_far` as its
checkpoint); `resume` (such a sealed partial run, same config) puts its final weights and optimiser state into the
model and continues with iteration len(resume.iterations): the finished run's records, digest and weights are the
uninterrupted run's. A rollout that raises (a reward server that fails) leaves the model at the weights of the
iteration before, so the last checkpoint stays the place to resume from.

The manifest: format, creation time, code provenance, device, hash scheme, the config (every knob), the reward's name
and the free-form `meta`, the base checkpoint fingerprint, the trainable parameters and their initial digests, the
adapter (peft config, sha256 before and after), `inputs_key` (per iteration its metadata entries), the iteration
records, the optimiser step count, the trace summary, the weights file's digests, and `digest` = SHA-256 of the
canonical JSON of the iteration records. `weights.safetensors`: `initial.<param>`, `final.<param>`,
`optimizer.<param>.<state>`.

`read(run_class, path, required)` reads the manifest (digest re-checked) and both tensor files (every tensor
re-hashed); `verify(algorithm, run, model)` puts the initial trainable weights into the model, re-runs every
iteration from the sealed batches and compares each iteration record field by field (`first_difference`), and
leaves the model's weights as it found them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn

from ..run.artifact import MANIFEST, SealedArtifact, code_provenance
from ..hashing import tensor_digest
from ..run.trajectory import TraceSummary
from .combine import TreeAccumulator
from ..adapters.lora import adapter_digest, base_fingerprint, config_json, has_lora
from .objective import TrainingError
from .run import _scheme, check_stored_weights, check_trainable
from .optim import StrictAdamW
from .step import model_device, split_flat, trainable_parameters

INPUTS_FILE = "inputs.safetensors"
WEIGHTS_FILE = "weights.safetensors"


@dataclass(frozen=True)
class Algorithm:
    """What differs between the sealed RL runs (module docstring)."""

    name: str
    run: type
    batch_type: type
    iterate: Callable[..., dict]
    inputs_key: str


@dataclass
class RlRun(SealedArtifact):
    """A sealed RL run: the manifest, per iteration its batch, the weights tensors, and its path once sealed (sealed
    and read through `artifact.SealedArtifact`). A subclass names `FORMAT`, `WHAT`, `CONFIG` (its config class, with
    `from_dict`) and `batch_tensors(k, batch)`."""

    ERROR = TrainingError
    CONFIG: ClassVar[type]

    manifest: dict[str, Any]
    batches: list
    weights: dict[str, torch.Tensor]
    path: Path | None = None

    @staticmethod
    def batch_tensors(k: int, batch: Any) -> tuple[list[dict], dict[str, torch.Tensor]]:  # pragma: no cover
        raise NotImplementedError

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def config(self) -> Any:
        return self.CONFIG.from_dict(self.manifest["config"])

    @property
    def iterations(self) -> list[dict]:
        return self.manifest["iterations"]

    def tensor_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """What `seal` writes: every iteration's batch tensors and the weights."""
        tensors: dict[str, torch.Tensor] = {}
        for k, batch in enumerate(self.batches):
            tensors.update(self.batch_tensors(k, batch)[1])
        return {INPUTS_FILE: tensors, WEIGHTS_FILE: self.weights}


def sealed_entry(prefix: str, tensors: dict[str, torch.Tensor], meta: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest entry: `meta` plus the SHA-256 of each tensor, {prefix + name: host copy}) of one batch element."""
    named = {prefix + n: v.detach().cpu().clone().contiguous() for n, v in tensors.items()}
    return {**meta, "sha256": {n: tensor_digest(v, "sha256") for n, v in named.items()}}, named


def entry_tensors(inputs: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of one sealed batch element, by their names without `prefix`."""
    return {n[len(prefix):]: v for n, v in inputs.items() if n.startswith(prefix)}


def step_record(grads: TreeAccumulator, losses: TreeAccumulator, n: int, params: Sequence[tuple[str, nn.Parameter]],
                optimizer: StrictAdamW, scheme: str) -> dict[str, Any]:
    """One optimiser step on the tree's mean gradient of `n` items, and its record: the mean loss, every parameter's
    gradient and weight digest after the step, the optimiser digest."""
    gradient = grads.result() / n
    optimizer.step(gradient)
    return {"loss": float(losses.result() / n),
            "gradient": {k: tensor_digest(g, scheme) for k, g in split_flat(gradient, params).items()},
            "weights": {name: tensor_digest(p.detach(), scheme) for name, p in params},
            "optimizer": optimizer.state_digest()}


def records_digest(iterations: list[dict]) -> str:
    return hashlib.sha256(json.dumps(iterations, sort_keys=True).encode()).hexdigest()


def host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def train(algorithm: Algorithm, model: nn.Module, rollout: Callable[[int, nn.Module], Any], config: Any,
          iterations: int, *, reward: str = "", meta: dict | None = None,
          on_iteration: Callable[[int, dict, Any], None] | None = None, resume: Any = None) -> Any:
    """Train `model` for `iterations` iterations of `algorithm` (module docstring); returns the in-memory run."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise TrainingError(f"iterations={iterations!r}: must be an integer >= 1")
    params = trainable_parameters(model)
    if not params:
        raise TrainingError(f"no trainable parameters: {algorithm.name} trains a LoRA adapter (or any requires_grad "
                            "weights)")
    optimizer = config.optimizer(params)
    if resume is None:
        initial = host(dict(params))
        adapter = {"config": json.loads(config_json(model.peft_config["default"])),
                   "initial_sha256": adapter_digest(model)} if has_lora(model) else None
        records, batches, entries = [], [], []
    else:
        if resume.config != config:
            raise TrainingError(f"resume: the checkpoint's {algorithm.name} config differs from this job's")
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
        entries = list(resume.manifest[algorithm.inputs_key])
    header = {"reward": str(reward), "meta": dict(meta or {}), "initial": initial, "adapter": adapter}
    trace = TraceSummary()
    run = None
    for k in range(len(records), iterations):
        batch = rollout(k, model)
        if not isinstance(batch, algorithm.batch_type):
            raise TrainingError(f"rollout({k}) returned a {type(batch).__name__}: must be a "
                                f"{algorithm.batch_type.__name__}")
        record = algorithm.iterate(model, batch, config, optimizer, k, trace)
        records.append(record)
        batches.append(batch)
        entries.append(algorithm.run.batch_tensors(k, batch)[0])
        run = _assemble(algorithm, model, config, params, optimizer, header, records, batches, entries, trace)
        if on_iteration is not None:
            on_iteration(k, record, run)
    return run


def _assemble(algorithm, model, config, params, optimizer, header, records, batches, entries, trace) -> Any:
    scheme = _scheme(model)
    adapter = header["adapter"]
    if adapter is not None:
        adapter = dict(adapter, final_sha256=adapter_digest(model))
    weights = {f"initial.{k}": v for k, v in header["initial"].items()}
    weights.update({f"final.{n}": p for n, p in host(dict(params)).items()})
    weights.update({f"optimizer.{k}": v for k, v in host(optimizer.state_tensors()).items()})
    manifest = {
        "format": algorithm.run.FORMAT,
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
        algorithm.inputs_key: list(entries),
        "iterations": list(records),
        "optimizer_steps": optimizer.step_count,
        "trace": trace.to_dict(),
        "weights_file": {k: tensor_digest(v, "sha256") for k, v in weights.items()},
        "digest": records_digest(records),
    }
    return algorithm.run(manifest, list(batches), weights)


def read(algorithm: Algorithm, path: str | os.PathLike) -> tuple[Path, dict, dict, dict]:
    """(root, manifest, inputs tensors, weights tensors) of a sealed run, every digest re-checked."""
    root = Path(path)
    key = algorithm.inputs_key
    manifest = algorithm.run.read_manifest(root, ("iterations", key, "config", "trainable", "weights_file", "digest"))
    if records_digest(manifest["iterations"]) != manifest["digest"]:
        raise TrainingError(f"{root / MANIFEST}: digest does not match its iteration records: the manifest was edited")
    inputs = algorithm.run.read_tensors(root / INPUTS_FILE, {n: d for it in manifest[key] for e in it
                                                            for n, d in e["sha256"].items()})
    weights = algorithm.run.read_tensors(root / WEIGHTS_FILE, manifest["weights_file"])
    return root, manifest, inputs, weights


@dataclass
class RlVerifyReport:
    """OK, or the first iteration / field whose re-run value differs from the record."""

    ok: bool
    iterations_checked: int
    num_iterations: int
    first_iteration: int | None = None
    field: str | None = None
    expected: Any = None
    got: Any = None
    digest: str = ""
    algorithm: str = "GRPO"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        if self.ok:
            return (f"OK: {self.iterations_checked}/{self.num_iterations} {self.algorithm} iterations byte-equal "
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


def verify(algorithm: Algorithm, run: Any, model: nn.Module) -> RlVerifyReport:
    """Re-run every iteration of a sealed run on `model` and compare (module docstring)."""
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
            record = algorithm.iterate(model, batch, config, optimizer, k, None)
            done += 1
            found = first_difference(manifest["iterations"][k], json.loads(json.dumps(record)))
            if found:
                found = (k, *found)
                break
    finally:
        with torch.no_grad():
            for n, p in params:
                p.copy_(saved[n])
    common = dict(iterations_checked=done, num_iterations=len(run.batches), digest=run.digest,
                  algorithm=algorithm.name)
    if found:
        return RlVerifyReport(False, first_iteration=found[0], field=found[1], expected=found[2], got=found[3],
                              **common)
    return RlVerifyReport(True, **common)
