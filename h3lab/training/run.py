"""Sealed training runs: N strict training steps over a sealed dataset, every step hashed, written atomically, and
re-run by `verify`, which names the first step and tensor that differ.

Contract
--------
`train(model, dataset, config)` trains `model` in place for `config.steps` steps and returns a `TrainingRun`:

- dataset: requests (`ClipRequest` for fine-tuning, `SampleRequest` from `rollout_request(s)` for RL), sealed whole.
- step k uses the requests `[(k * batch_size + j) % len(dataset) for j in range(batch_size)]`, in that order; a
  clip request at dataset index i draws with seed `request_seed(config.seed, k, i)` (SHA-256 of
  `h3lab-train-seed|seed|k|i`, 63 bits), so its draws depend on the run seed, the step and the request only.
- each step is `step.compute_gradients` (or `data_parallel.data_parallel_gradients` with `data_parallel=True`) in
  `config.mode` with `config.gradient_checkpointing`, then `StrictAdamW.step` built from the config.

A sealed run is a directory (written through `io_utils.atomic_write_dir`, the manifest last):

- `manifest.json`: format, code revision and versions, mode, device, hash scheme, the config (objective, optimiser),
  the checkpoint fingerprint of the model at the start, the trainable parameters (name, shape, dtype) and their
  initial digests, per dataset request its kind, metadata (layout for clips) and the SHA-256 of its tensors, per
  step the requests (dataset index, seed, loss, loss hash, gradient digest), the batch loss and its hash, the digest
  of every trainable parameter's batch gradient and of every trainable weight after the step, the optimiser state
  digest, the provenance trace summary, and `digest` (SHA-256 over the canonical JSON of the steps).
- `inputs.safetensors`: the dataset tensors, keys `<index:04d>.<name>`.
- `weights.safetensors`: `initial.<param>` (unless `keep_initial=False`), `final.<param>`,
  `optimizer.<param>.<state>`.

A model carrying a LoRA adapter (`lora.add_lora`) trains its adapter factors (its trainable parameters); the manifest
then records `adapter`: the peft config and the sha256 of the adapter's PEFT files (`lora.adapter_digest`) before
and after the run, so `lora.save_adapter(model, ...)` after `train` writes exactly the `final_sha256` bytes. The
checkpoint fingerprint is the base weights' (`lora.base_fingerprint`), whether or not an adapter is attached.

Interrupt and resume: `on_step(k, record, optimizer, trace)` is called after every step (a front end writes checkpoints
there; an exception it raises stops the run); `resume=RunState(...)` continues a run from the state a checkpoint
holds (the step records so far, the optimiser's state and step count, the run's initial trainable weights, the
trace summary): the model must hold the weights after the last recorded step, and the steps, weights, optimiser
state and digest of the finished run are byte-equal to an uninterrupted one.

Hashes are `tensor_digest` under the scheme of the model's device ("sha256" on CPU, "device" on accelerators; digests
of different schemes are not comparable). `load(path)` re-hashes every tensor against the manifest and the digest
against the steps. `verify(run, model)` puts the run's initial trainable weights into `model` (or checks that it
already holds them), re-runs the steps and compares, in order, each request's loss and gradient, the batch loss,
every parameter's gradient, every weight and the optimiser state; it reports the first difference or OK, and leaves
the model's weights as it found them. Before re-running, `verify` checks the stored result against the sealed steps
(`check_stored`): every `final.<param>` tensor must hash (under the run's scheme, on the model's device) to the
weights digest the last step record holds, and the `optimizer.*` tensors to its optimiser digest. The steps are
covered by `digest`; `weights_file` is not, so a final tensor changed together with its manifest entry is refused
here, naming the tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..execution import runtime
from ..run.artifact import MANIFEST, SealedArtifact, code_provenance, stored_mismatch
from ..hashing import key_seed, tensor_digest
from ..run.layout import PackedLayout
from ..run.trajectory import TraceSummary
from .data_parallel import data_parallel_gradients
from ..adapters.lora import adapter_digest, base_fingerprint, config_json, has_lora
from .objective import ClipRequest, Objective, SampleRequest, TrainingError, TrainingSample, checked_int
from .optim import StrictAdamW
from .optim_config import RECORD_KEYS, OptimizerConfig
from .step import StepResult, compute_gradients, model_device, split_flat, trainable_parameters

FORMAT = "h3lab-training/1"
INPUTS_FILE = "inputs.safetensors"
WEIGHTS_FILE = "weights.safetensors"


# ================================================================================================== config
@dataclass(frozen=True)
class TrainConfig:
    """Everything a run varies: steps, batch size, seed, runtime mode, checkpointing, AdamW (`optim`), the objective.
    Sealed flat: `to_dict` writes the optimiser's keys beside the others (`optim_config.RECORD_KEYS`)."""

    steps: int
    batch_size: int
    seed: int = 0
    mode: str = "strict"
    gradient_checkpointing: bool = False
    optim: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(weight_decay=1e-2))  # torch AdamW's decay
    objective: Objective = field(default_factory=Objective)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", checked_int("TrainConfig.steps", self.steps, 1))
        object.__setattr__(self, "batch_size", checked_int("TrainConfig.batch_size", self.batch_size, 1))
        object.__setattr__(self, "seed", checked_int("TrainConfig.seed", self.seed, 0))
        if self.mode not in runtime.MODES:
            raise TrainingError(f"TrainConfig.mode={self.mode!r}: must be one of {', '.join(runtime.MODES)}")
        if not isinstance(self.optim, OptimizerConfig):
            raise TrainingError(f"TrainConfig.optim is a {type(self.optim).__name__}: must be an OptimizerConfig")
        if not isinstance(self.objective, Objective):
            raise TrainingError(f"TrainConfig.objective is a {type(self.objective).__name__}: must be an Objective")

    def optimizer(self, params: Sequence[tuple[str, nn.Parameter]]) -> StrictAdamW:
        return self.optim.build(params)

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "batch_size": self.batch_size, "seed": self.seed, "mode": self.mode,
                "gradient_checkpointing": self.gradient_checkpointing, **self.optim.to_record(),
                "objective": self.objective.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        rest = {k: v for k, v in data.items() if k not in (*RECORD_KEYS, "objective")}
        return cls(**rest, optim=OptimizerConfig.from_record(data), objective=Objective.from_dict(data["objective"]))


def step_batch(config: TrainConfig, step: int, dataset_size: int) -> list[int]:
    """Dataset indices of step `step`'s requests, in batch order."""
    return [(step * config.batch_size + j) % dataset_size for j in range(config.batch_size)]


def request_seed(run_seed: int, step: int, index: int) -> int:
    """The seed of dataset request `index` at step `step` of a run seeded `run_seed` (63 bits of SHA-256)."""
    return key_seed(f"h3lab-train-seed|{run_seed}|{step}|{index}")


# ================================================================================================= dataset
def _dataset_entry(index: int, request: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest entry without hashes, tensors keyed `<index>.<name>`) of one dataset request."""
    if isinstance(request, ClipRequest):
        tensors = {"text": request.text, "video": request.video, "audio": request.audio}
        meta = {"kind": "clip", "weight": request.weight, "layout": request.layout.to_dict()}
    elif isinstance(request, SampleRequest):
        tensors = request.fixed.tensors()
        meta = {"kind": "sample", **request.fixed.meta(), "origin": dict(request.origin)}
    else:
        raise TrainingError(f"dataset request {index} is a {type(request).__name__}: must be a ClipRequest or "
                            "SampleRequest")
    return meta, {f"{index:04d}.{k}": v for k, v in tensors.items()}


def _request_from(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Any:
    if meta["kind"] == "clip":
        return ClipRequest(PackedLayout.from_dict(meta["layout"]), tensors["text"], tensors["video"], tensors["audio"],
                           weight=meta["weight"])
    if meta["kind"] == "sample":
        return SampleRequest(TrainingSample.from_tensors(tensors, meta), dict(meta.get("origin", {})))
    raise TrainingError(f"dataset request kind {meta['kind']!r}: must be clip or sample")


def _named_digests(tensors: dict[str, torch.Tensor], scheme: str) -> dict[str, str]:
    return {k: tensor_digest(v, scheme) for k, v in tensors.items()}


def steps_digest(steps: Sequence[dict]) -> str:
    """`TrainingRun.digest`: SHA-256 over the canonical JSON (sorted keys) of the step records."""
    return hashlib.sha256(json.dumps(list(steps), sort_keys=True).encode()).hexdigest()


# ==================================================================================================== run
@dataclass
class TrainingRun(SealedArtifact):
    """A run: the manifest (JSON-ready), the dataset requests, the weights tensors (`initial.*`, `final.*`,
    `optimizer.*`, host copies) and, once sealed or loaded, its path. Sealed and read through
    `artifact.SealedArtifact`."""

    FORMAT = FORMAT
    WHAT = "a sealed training run"
    ERROR = TrainingError

    manifest: dict[str, Any]
    dataset: list[Any]
    weights: dict[str, torch.Tensor]
    path: Path | None = None

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def steps(self) -> list[dict]:
        return self.manifest["steps"]

    @property
    def config(self) -> TrainConfig:
        return TrainConfig.from_dict(self.manifest["config"])

    def initial_weights(self) -> dict[str, torch.Tensor] | None:
        out = {k[len("initial."):]: v for k, v in self.weights.items() if k.startswith("initial.")}
        return out or None

    def tensor_files(self) -> dict[str, dict[str, torch.Tensor]]:
        """What `seal` writes: the dataset tensors and the weights."""
        tensors: dict[str, torch.Tensor] = {}
        for i, request in enumerate(self.dataset):  # copies: requests may share tensors (one layout, one text)
            tensors.update({k: v.detach().cpu().clone() for k, v in _dataset_entry(i, request)[1].items()})
        return {INPUTS_FILE: tensors, WEIGHTS_FILE: self.weights}


def _step_record(step: int, indices: list[int], seeds: list[int | None], result: StepResult,
                 params: Sequence[tuple[str, nn.Parameter]], optimizer: StrictAdamW, scheme: str) -> dict[str, Any]:
    requests = [
        {"index": i, "seed": s, "loss": float(loss), "loss_sha256": tensor_digest(loss, scheme), "gradient": digest}
        for i, s, loss, digest in zip(indices, seeds, result.request_losses, result.request_digests)
    ]
    return {
        "step": step,
        "requests": requests,
        "loss": float(result.loss),
        "loss_sha256": tensor_digest(result.loss, scheme),
        "gradient": _named_digests(split_flat(result.gradient, params), scheme),
        "weights": {name: tensor_digest(p.detach(), scheme) for name, p in params},
        "optimizer": optimizer.state_digest(),
    }


def _scheme(model: nn.Module) -> str:
    return "sha256" if model_device(model).type == "cpu" else "device"


def _run_steps(model: nn.Module, dataset: Sequence[Any], config: TrainConfig, *, data_parallel: bool, group: Any,
               trace: TraceSummary, check: Callable[[dict], bool] | None = None,
               steps: int | None = None, start: int = 0, optimizer: StrictAdamW | None = None,
               on_step: Callable[[int, dict, StrictAdamW, TraceSummary], None] | None = None,
               ) -> tuple[list[dict], StrictAdamW]:
    """The one loop `train` and `verify` share, from step `start` (with `optimizer` holding that step's state);
    `check(record)` returning True stops it; `on_step(k, record, optimizer, trace)` after each step."""
    params = trainable_parameters(model)
    if not params:
        raise TrainingError("the model has no trainable parameters (requires_grad): nothing to train")
    optimizer = config.optimizer(params) if optimizer is None else optimizer
    scheme = _scheme(model)
    records: list[dict] = []
    for k in range(start, config.steps if steps is None else steps):
        indices = step_batch(config, k, len(dataset))
        seeds = [request_seed(config.seed, k, i) if isinstance(dataset[i], ClipRequest) else None for i in indices]
        requests = [dataset[i].with_seed(s) if s is not None else dataset[i] for i, s in zip(indices, seeds)]
        kwargs = {"mode": config.mode, "gradient_checkpointing": config.gradient_checkpointing, "trace": trace}
        if data_parallel:
            result = data_parallel_gradients(model, requests, config.objective, group=group, **kwargs)
        else:
            result = compute_gradients(model, requests, config.objective, **kwargs)
        optimizer.step(result.gradient)
        records.append(_step_record(k, indices, seeds, result, params, optimizer, scheme))
        if on_step is not None:
            on_step(k, records[-1], optimizer, trace)
        if check is not None and check(records[-1]):
            break
    return records, optimizer


def _host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in tensors.items()}


@dataclass
class RunState:
    """Where an interrupted run stands (what a checkpoint holds): the step records so far, the optimiser's state
    tensors (`StrictAdamW.state_tensors`) and step count, the run's initial trainable weights (host), the adapter's
    initial sha256 (None without an adapter) and the trace summary so far."""

    records: list[dict]
    optimizer: dict[str, torch.Tensor]
    optimizer_steps: int
    initial: dict[str, torch.Tensor]
    initial_adapter: str | None = None
    trace: dict[str, Any] = field(default_factory=dict)


def _trace_from(data: dict[str, Any]) -> TraceSummary:
    """A `TraceSummary` continued from its `to_dict()` (a resumed run)."""
    trace = TraceSummary()
    if data:
        trace.forwards, trace.untraced = int(data["forwards"]), int(data["untraced_forwards"])
        trace.ops = {op: dict(b) for op, b in data["ops"].items()}
        trace.kernels, trace.fallbacks = set(data["kernels"]), int(data["non_strict_calls"])
        trace.head = {k: data[k] for k in ("mode", "device", "fingerprint", "versions") if k in data}
    return trace


def _resume(model: nn.Module, config: TrainConfig, state: RunState, params) -> StrictAdamW:
    """The optimiser of a resumed run; refuses a state that does not fit the model or the config."""
    if not 0 < len(state.records) <= config.steps:  # all of them: the run is only sealed (a final checkpoint)
        raise TrainingError(f"resume after {len(state.records)} of {config.steps} steps: must be after 1 to "
                            f"{config.steps} steps")
    if [r["step"] for r in state.records] != list(range(len(state.records))):
        raise TrainingError("resume: the recorded steps are not 0, 1, 2, ... in order")
    scheme = _scheme(model)
    now = {name: tensor_digest(p.detach(), scheme) for name, p in params}
    if now != state.records[-1]["weights"]:
        name = next((n for n in now if now[n] != state.records[-1]["weights"].get(n)), "?")
        raise TrainingError(f"resume: the model's trainable weight {name!r} is not the one recorded after step "
                            f"{len(state.records) - 1}")
    optimizer = config.optimizer(params)
    optimizer.load_state_tensors(state.optimizer, state.optimizer_steps)
    if optimizer.state_digest() != state.records[-1]["optimizer"]:
        raise TrainingError("resume: the optimiser state does not match the last recorded step")
    return optimizer


def train(
    model: nn.Module,
    dataset: Sequence[Any],
    config: TrainConfig,
    *,
    data_parallel: bool = False,
    group: Any = None,
    keep_initial: bool = True,
    meta: dict[str, Any] | None = None,
    on_step: Callable[[int, dict, StrictAdamW, TraceSummary], None] | None = None,
    resume: RunState | None = None,
) -> TrainingRun:
    """Train `model` in place (module docstring) and return the in-memory run (`.seal(path)` writes it). With
    `data_parallel`, every rank of `group` calls this with the same arguments and gets the same run. `on_step` and
    `resume`: interrupt and resume (module docstring)."""
    dataset = list(dataset)
    if not dataset:
        raise TrainingError("the dataset is empty: a run needs at least one request")
    entries = [_dataset_entry(i, r) for i, r in enumerate(dataset)]  # refuses unknown request kinds first
    params = trainable_parameters(model)
    scheme = _scheme(model)
    optimizer = _resume(model, config, resume, params) if resume is not None else None
    initial = _host({name: p for name, p in params}) if resume is None else dict(resume.initial)
    if [n for n, _ in params] != list(initial):
        raise TrainingError("resume: the run's initial weights name other parameters than the model's trainable ones")
    adapter = None
    if has_lora(model):
        first = adapter_digest(model) if resume is None else resume.initial_adapter
        adapter = {"config": json.loads(config_json(model.peft_config["default"])), "initial_sha256": first}
    header = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "code": code_provenance(),
        "mode": config.mode,
        "device": str(model_device(model)),
        "hash_scheme": scheme,
        "data_parallel": bool(data_parallel),
        "config": config.to_dict(),
        "checkpoint": {"fingerprint": base_fingerprint(model), "dtype_policy": getattr(model, "dtype_policy", "")},
        "trainable": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                      for n, p in params],
        "initial_weights": _named_digests(initial, scheme),
        "meta": dict(meta or {}),
    }
    weights = {f"initial.{k}": v for k, v in initial.items()} if keep_initial else {}
    trace = _trace_from(resume.trace) if resume is not None else TraceSummary()
    done = list(resume.records) if resume is not None else []
    records, optimizer = _run_steps(model, dataset, config, data_parallel=data_parallel, group=group, trace=trace,
                                    start=len(done), optimizer=optimizer, on_step=on_step)
    records = done + records
    if adapter is not None:
        adapter["final_sha256"] = adapter_digest(model)
    weights.update({f"final.{n}": p for n, p in _host(dict(params)).items()})
    weights.update({f"optimizer.{k}": v for k, v in _host(optimizer.state_tensors()).items()})
    dataset_manifest = []
    for i, (entry, tensors) in enumerate(entries):
        dataset_manifest.append({"index": i, **entry, "sha256": _named_digests(tensors, "sha256")})
    manifest = {
        **header,
        **({"adapter": adapter} if adapter is not None else {}),
        "dataset": dataset_manifest,
        "steps": records,
        "trace": trace.to_dict(),
        "weights_file": _named_digests(weights, "sha256"),
        "digest": steps_digest(records),
    }
    return TrainingRun(manifest, dataset, weights)


# =================================================================================================== load
def load(path: str | os.PathLike) -> TrainingRun:
    """Read a sealed run and check it: format, the steps digest, every dataset and weights tensor against the
    manifest. Any mismatch raises `TrainingError` naming it."""
    root = Path(path)
    manifest = TrainingRun.read_manifest(root, ("steps", "dataset", "config", "trainable", "weights_file", "digest"))
    if steps_digest(manifest["steps"]) != manifest["digest"]:
        raise TrainingError(f"{root / MANIFEST}: digest does not match its step records: the manifest was edited")
    inputs = TrainingRun.read_tensors(root / INPUTS_FILE, {k: v for e in manifest["dataset"] for k, v in e["sha256"].items()})
    weights = TrainingRun.read_tensors(root / WEIGHTS_FILE, manifest["weights_file"])
    dataset = []
    for e in manifest["dataset"]:
        prefix = f"{e['index']:04d}."
        dataset.append(_request_from(e, {k[len(prefix):]: v for k, v in inputs.items() if k.startswith(prefix)}))
    return TrainingRun(manifest, dataset, weights, path=root)


# ================================================================================================= verify
@dataclass
class RunVerifyReport:
    """Outcome of `verify`: OK, or the first step and field (request loss/gradient, loss, a parameter's gradient or
    weight, the optimiser state) whose digest differs, expected vs re-run."""

    ok: bool
    steps_checked: int
    num_steps: int
    first_step: int | None = None
    field: str | None = None
    expected: str | None = None
    got: str | None = None
    digest: str = ""
    fingerprint_match: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        if self.ok:
            return f"OK: {self.steps_checked}/{self.num_steps} training steps byte-equal (digest {self.digest[:16]})"
        note = "" if self.fingerprint_match else " (checkpoint fingerprint differs from the recorded one)"
        return (f"DRIFT at step {self.first_step}: {self.field} {str(self.got)[:16]} != recorded "
                f"{str(self.expected)[:16]}{note}")


def _first_difference(want: dict, got: dict) -> tuple[str, str, str] | None:
    """(field, expected, got) of the first differing digest of one step record, in the verify order."""
    pairs: list[tuple[str, Any, Any]] = []
    for j, (w, g) in enumerate(zip(want["requests"], got["requests"])):
        pairs += [(f"request {j} (dataset {w['index']}) seed", w["seed"], g["seed"]),
                  (f"request {j} (dataset {w['index']}) loss", w["loss_sha256"], g["loss_sha256"]),
                  (f"request {j} (dataset {w['index']}) gradient", w["gradient"], g["gradient"])]
    pairs.append(("loss", want["loss_sha256"], got["loss_sha256"]))
    pairs += [(f"gradient {n}", d, got["gradient"].get(n)) for n, d in want["gradient"].items()]
    pairs += [(f"weights {n}", d, got["weights"].get(n)) for n, d in want["weights"].items()]
    pairs.append(("optimizer", want["optimizer"], got["optimizer"]))
    for name, w, g in pairs:
        if w != g:
            return name, str(w), str(g)
    return None


def check_trainable(manifest: dict[str, Any], model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable parameters, refused unless they are the sealed run's (name, shape, dtype, in order)."""
    params = trainable_parameters(model)
    recorded = [(t["name"], t["shape"], t["dtype"]) for t in manifest["trainable"]]
    have = [(n, list(p.shape), str(p.dtype).replace("torch.", "")) for n, p in params]
    if recorded != have:
        diff = next(((a, b) for a, b in zip(recorded, have) if a != b), (len(recorded), len(have)))
        raise TrainingError(f"the model's trainable parameters differ from the run's (first: {diff[0]} vs {diff[1]})")
    return params


def check_stored(run: TrainingRun, config: TrainConfig, params: Sequence[tuple[str, nn.Parameter]],
                 scheme: str) -> None:
    """Refuse a run whose stored final weights or optimiser state are not what its last step record sealed (module
    docstring); `params` are the model's trainable parameters (their devices hash the stored tensors)."""
    last = run.manifest["steps"][-1] if run.manifest["steps"] else None
    where = run.path / WEIGHTS_FILE if run.path is not None else "the run's weights"
    if last is None:
        raise TrainingError(f"{where}: the run records no step")
    check_stored_weights(run.weights, where, params, scheme, config.optimizer(params), last, len(run.steps),
                         f"step {last['step']}")


def check_stored_weights(weights: dict[str, torch.Tensor], where: Any, params: Sequence[tuple[str, nn.Parameter]],
                         scheme: str, optimizer: StrictAdamW, last: dict, optimizer_steps: int, sealed_with: str,
                         ) -> None:
    """The stored `final.<param>` tensors must hash to the `weights` digests of the `last` record and the stored
    `optimizer.*` tensors (loaded into `optimizer` after `optimizer_steps` steps) to its `optimizer` digest (the
    verify half of a sealed training or GRPO run, `artifact.stored_mismatch`); else a `TrainingError` naming it."""
    if not params:
        raise TrainingError(f"{where}: the model has no trainable parameters to check the stored weights on")
    bad = stored_mismatch({n: weights.get(f"final.{n}") for n, _ in params}, last["weights"], scheme,
                          params[0][1].device)
    if bad is not None:
        raise TrainingError(f"{where}: stored tensor 'final.{bad}' does not match the weights digest sealed with "
                            f"{sealed_with}")
    stored = {k[len("optimizer."):]: v for k, v in weights.items() if k.startswith("optimizer.")}
    optimizer.load_state_tensors(stored, optimizer_steps)
    if optimizer.state_digest() != last["optimizer"]:
        raise TrainingError(f"{where}: the stored optimizer.* tensors do not match the optimiser digest sealed with "
                            f"{sealed_with}")


def verify(
    run: str | os.PathLike | TrainingRun,
    model: nn.Module,
    *,
    steps: int | None = None,
    data_parallel: bool = False,
    group: Any = None,
) -> RunVerifyReport:
    """Re-run the first `steps` (default all) steps of a sealed run on `model` and compare (module docstring)."""
    run = run if isinstance(run, TrainingRun) else load(run)
    manifest, config = run.manifest, run.config
    params = check_trainable(manifest, model)
    n_steps = len(manifest["steps"]) if steps is None else steps
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or not 1 <= n_steps <= len(manifest["steps"]):
        raise TrainingError(f"steps={steps!r}: must be an integer in [1, {len(manifest['steps'])}]")
    scheme = _scheme(model)
    if scheme != manifest["hash_scheme"]:
        raise TrainingError(f"the run was hashed with {manifest['hash_scheme']!r}; this model's device hashes with "
                            f"{scheme!r}: verify on a {manifest['device']} model")
    check_stored(run, config, params, scheme)
    saved = {name: p.detach().clone() for name, p in params}
    initial = run.initial_weights()
    first: dict[str, Any] = {}
    try:
        with torch.no_grad():
            if initial is not None:
                for name, p in params:
                    p.copy_(initial[name])
        now = _named_digests({n: p.detach() for n, p in params}, scheme)
        if now != manifest["initial_weights"]:
            name = next(n for n in now if now[n] != manifest["initial_weights"].get(n))
            raise TrainingError(f"the model's trainable weight {name!r} differs from the run's initial weights and the "
                                "run kept none (seal with keep_initial=True)")
        fp_match = base_fingerprint(model) == manifest["checkpoint"]["fingerprint"]

        def check(record: dict) -> bool:
            diff = _first_difference(manifest["steps"][record["step"]], record)
            if diff is not None:
                first.update(step=record["step"], field=diff[0], expected=diff[1], got=diff[2])
            return diff is not None

        records, _ = _run_steps(model, run.dataset, config, data_parallel=data_parallel, group=group,
                                trace=TraceSummary(), check=check, steps=n_steps)
    finally:
        with torch.no_grad():
            for name, p in params:
                p.copy_(saved[name])
    common = dict(steps_checked=len(records), num_steps=n_steps, digest=run.digest, fingerprint_match=fp_match)
    if first:
        return RunVerifyReport(ok=False, first_step=first["step"], field=first["field"], expected=first["expected"],
                               got=first["got"], **common)
    return RunVerifyReport(ok=True, **common)
