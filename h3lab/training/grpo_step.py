"""The GRPO step: from the SDE passes of a rollout batch, recompute each selected pass's velocity with the training
forward (per request, batch 1, LoRA), its transition log-density, the ratio to the rollout's, the clipped surrogate,
an optional KL to the adapter-off reference, and several inner epochs of StrictAdamW steps.

Contract
--------
- A `Transition` is one SDE pass of one request as the rollout sealed it: the model inputs entering the pass (a
  batch-1 `TrainingSample` whose `video` / `audio` are the latents entering the pass, all rows, and whose `target_*`
  slots hold the *sampled next rows* x_next of the generated rows, (1, N - ncond, C) float32), the pass's float32 grid
  sigmas per modality (sigma_i, sigma_{i+1}), and the rollout's float32 `logp_mean` per modality (rl-core's
  `gaussian_logprob` record). `request` is the request's identity in its rollout (prompt-major: p * G + g).
- `GrpoConfig` is every knob (sealed in the run, `to_dict`): the transition `kind` and `level`, the `group` G, the
  advantage `adv_eps` / `adv_clip`, the surrogate's `clip_range`, the KL weight `beta` (0: no reference forward), the
  truncated-importance cap `importance_cap` (None: off), `inner_epochs`, the pass `selection`, the run `seed` (pass
  selection draws), the runtime `mode`, `gradient_checkpointing`, AdamW's hyper-parameters (`optim`, an
  `OptimizerConfig`) and the `objective`'s per-modality weights.
- One iteration (`grpo_iteration`): advantages A = `group_advantages(rewards, G, adv_eps, adv_clip)` (float64, cast
  to float32 once in the surrogate); per request the selected passes (`PassSelection.select(..., seed, iteration,
  request)`); then per inner epoch e, for every (request, pass) item in request-major, pass-ascending order, one
  batch-1 forward + backward in `mode` (train mode, `gradient_checkpointing`):
      v                = model(pass inputs)                                   the training forward (LoRA on)
      logp_m, mean_m, std_m = transition_logprob(kind, level, x_m, v_m, x_next_m, sigma_m, sigma_next_m)
      r_m              = exp(logp_m - logp_rollout_m)                          recorded every epoch: the gate's ratio
      logp_old_m       = logp_rollout_m, or with `importance_cap` C the training engine's epoch-0 logp_m (detached)
      w_m              = 1, or min(exp(logp_old_m - logp_rollout_m), C)        (truncated importance weight, detached)
      L_m              = w_m * max(-A r'_m, -A clamp(r'_m, 1 - clip, 1 + clip)),  r'_m = exp(logp_m - logp_old_m)
      KL_m             = mean (mean_m - mean_ref_m)^2 / (2 std_m^2)   with beta > 0: mean_ref from a no-grad forward
                         of the same inputs with the adapter off (`lora.adapter_disabled`: peft's switch)
      loss             = sum_m weight_m * (L_m + beta * KL_m)                  m = video, audio (`Objective` weights)
  x_m are the generated rows entering the pass, v_m the velocity's generated rows. The epoch's gradient is the
  fixed tree of the items' gradients / n (`combine.py`), then one `StrictAdamW.step`. So a strict rollout of G
  requests batched, replayed one request at a time, gives r = 1.0 exactly at epoch 0 (the velocities are byte-equal,
  H-C1/H-C2, and the log-density's reduction is per request); `off` gives the measured deviation.
- Record (JSON floats are exact float32 values): a weighted-sum reward's parts per request and their means
  (`reward_parts`, only for a sum); per epoch and item, per modality logp, r, clipped, KL, w, the item
  loss and gradient digest; per epoch the batch loss, every parameter's gradient and weight digest, the optimiser
  digest, and the ratio statistics (`grpo.ratio_stats`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ..execution import runtime
from ..stochastic import SDE_KINDS, transition_logprob, transition_mean_std
from ..stochastic.transitions import TransitionError, check_level
from ..run.trajectory import TraceSummary
from .combine import TreeAccumulator
from .grpo import (
    ADVANTAGE_EPS,
    PassSelection,
    clipped_surrogate,
    group_advantages,
    ratio_stats,
    reference_kl,
    truncated_weight,
)
from ..adapters.lora import adapter_disabled, has_lora
from .objective import MODALITIES, Objective, SettingError, TrainingError, TrainingSample, checked_int
from .optim import StrictAdamW
from .optim_config import RECORD_KEYS, OptimizerConfig
from .rl_run import step_record
from .run import _scheme
from .step import _TrainContext, model_device, request_gradient, trainable_parameters


def _opt_real(name: str, value, positive: bool = True) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (
            positive and value <= 0):
        raise SettingError("GrpoConfig", name, value, f"must be a finite number{' > 0' if positive else ''}")
    return float(value)



def check_training_knobs(config: Any, algorithm: str) -> None:
    """The rules an RL config shares (`mode`, `optim`, `objective`), one-line `TrainingError`s naming
    `<Config class>.<field>` (AdamW's own values are checked by `OptimizerConfig`)."""
    owner = type(config).__name__
    if config.mode not in runtime.MODES:
        raise TrainingError(f"{owner}.mode={config.mode!r}: must be one of {', '.join(runtime.MODES)}")
    if config.mode == "fast":  # runtime.require_not_fast's rule, as a training error
        raise TrainingError(f"{owner}.mode='fast': {algorithm} needs the strict contract (fast's FP8 projections "
                            "are neither strict nor batch-invariant); use mode strict")
    if not isinstance(config.optim, OptimizerConfig):
        raise TrainingError(f"{owner}.optim is a {type(config.optim).__name__}: must be an OptimizerConfig")
    if not isinstance(config.objective, Objective):
        raise TrainingError(f"{owner}.objective is a {type(config.objective).__name__}: must be an Objective")


def config_record(config: Any, **fields: Any) -> dict[str, Any]:
    """The sealed record of an RL config: its fields in declaration order, the optimiser's keys flat in `optim`'s
    place (`optim_config` module docstring), the objective as a dict, and `fields` (the other nested values)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "optim":
            out.update(value.to_record())
        else:
            out[f.name] = fields[f.name] if f.name in fields else (
                value.to_dict() if f.name == "objective" else value)
    return out


def config_of(cls: type, data: dict, **fields: Any) -> Any:
    """`cls` from its sealed record (`config_record`), `fields` the nested values read by the caller."""
    rest = {k: v for k, v in data.items() if k not in (*RECORD_KEYS, "objective", *fields)}
    return cls(**rest, **fields, optim=OptimizerConfig.from_record(data),
               objective=Objective.from_dict(data["objective"]))


@dataclass(frozen=True)
class GrpoConfig:
    """Every GRPO knob (module docstring); defaults are Flow-GRPO's where it has one."""

    kind: str = "flow_sde"
    level: float = 0.7
    group: int = 4
    clip_range: float = 1e-4
    adv_eps: float = ADVANTAGE_EPS
    adv_clip: float | None = 5.0
    beta: float = 0.0
    importance_cap: float | None = None
    inner_epochs: int = 1
    selection: PassSelection = field(default_factory=PassSelection)
    seed: int = 0
    mode: str = "strict"
    gradient_checkpointing: bool = False
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    objective: Objective = field(default_factory=Objective)

    def __post_init__(self) -> None:
        if self.kind not in SDE_KINDS:
            raise SettingError("GrpoConfig", "kind", self.kind, f"must be one of {', '.join(SDE_KINDS)}")
        object.__setattr__(self, "level", _opt_real("level", self.level))
        try:  # the stepper's own rule for its level (cps: in [0, 1]), checked here: before any rollout
            check_level(self.kind, self.level)
        except TransitionError as err:
            raise SettingError("GrpoConfig", "level", self.level, f"{str(err).split(': ', 1)[-1]} for stepper "
                               f"{self.kind}") from None
        object.__setattr__(self, "group", checked_int("GrpoConfig.group", self.group, 2))
        object.__setattr__(self, "clip_range", _opt_real("clip_range", self.clip_range))
        object.__setattr__(self, "adv_eps", _opt_real("adv_eps", self.adv_eps))
        object.__setattr__(self, "adv_clip", _opt_real("adv_clip", self.adv_clip))
        beta = _opt_real("beta", self.beta, positive=False)
        if beta < 0:
            raise SettingError("GrpoConfig", "beta", self.beta, "must be >= 0")
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "importance_cap", _opt_real("importance_cap", self.importance_cap))
        object.__setattr__(self, "inner_epochs", checked_int("GrpoConfig.inner_epochs", self.inner_epochs, 1))
        object.__setattr__(self, "seed", checked_int("GrpoConfig.seed", self.seed, 0))
        if not isinstance(self.selection, PassSelection):
            raise TrainingError(f"GrpoConfig.selection is a {type(self.selection).__name__}: must be a PassSelection")
        check_training_knobs(self, "GRPO")

    def optimizer(self, params: Sequence[tuple[str, nn.Parameter]]) -> StrictAdamW:
        return self.optim.build(params)

    def to_dict(self) -> dict[str, Any]:
        return config_record(self, selection=self.selection.to_dict())

    @classmethod
    def from_dict(cls, data: dict) -> "GrpoConfig":
        return config_of(cls, data, selection=PassSelection.from_dict(data["selection"]))


# ============================================================================================ transitions
@dataclass(frozen=True, eq=False)
class Transition:
    """One SDE pass of one request (module docstring). `levels` and `logp_rollout` name the modalities whose
    transition was stochastic on this pass (a modality at level 0, or outside a window, stepped deterministically
    and has no density: it does not enter the loss)."""

    request: int
    pass_index: int
    sample: TrainingSample
    sigmas: dict[str, tuple[float, float]]
    levels: dict[str, float]
    logp_rollout: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        where = f"transition of request {self.request}, pass {self.pass_index}"
        if not self.logp_rollout or set(self.logp_rollout) - set(MODALITIES) or set(self.levels) != set(
                self.logp_rollout):
            raise TrainingError(f"{where}: logp_rollout {sorted(self.logp_rollout)} and levels {sorted(self.levels)} "
                                "must name the same stochastic modalities (video and/or audio)")
        for m, lp in self.logp_rollout.items():
            if not isinstance(lp, torch.Tensor) or lp.dtype != torch.float32 or lp.numel() != 1:
                raise TrainingError(f"{where}: logp_rollout[{m!r}] must be one float32 value")
            if m not in self.sigmas:
                raise TrainingError(f"{where}: no sigmas for {m}")

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(m for m in MODALITIES if m in self.logp_rollout)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = dict(self.sample.tensors())
        out.update({f"logp_rollout_{m}": self.logp_rollout[m].reshape(()) for m in self.modalities})
        return out

    def meta(self) -> dict[str, Any]:
        return {"request": self.request, "pass": self.pass_index, **self.sample.meta(),
                "sigmas": {m: list(v) for m, v in self.sigmas.items()}, "levels": dict(self.levels)}

    @classmethod
    def from_sealed(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "Transition":
        logp = {m: tensors.pop(f"logp_rollout_{m}").reshape(1) for m in MODALITIES if f"logp_rollout_{m}" in tensors}
        return cls(int(meta["request"]), int(meta["pass"]), TrainingSample.from_tensors(tensors, meta),
                   {m: tuple(v) for m, v in meta["sigmas"].items()}, dict(meta["levels"]), logp)


def transition(inputs: Any, schedule: Any, item: int, request: int, pass_index: int, entering: dict[str, torch.Tensor],
               after: dict[str, torch.Tensor], logp_rollout: dict[str, torch.Tensor],
               levels: dict[str, float]) -> Transition:
    """A `Transition` from a rollout's `DenoiseInputs` (batch item `item`), its `DualSchedule`, the latents entering
    pass `pass_index` and after it (per modality, this item, all rows, (1, N, C)), the rollout's logp_mean and the
    level of every stochastic modality."""
    ncond = {"video": inputs.num_condition_video_rows, "audio": inputs.num_condition_audio_rows}
    b = slice(item, item + 1)
    timestep, timestep_indices = inputs.plan[pass_index]
    sample = TrainingSample(
        text=inputs.text[b], video=entering["video"], audio=entering["audio"], timestep=timestep,
        timestep_indices=timestep_indices, **inputs.layout_kwargs(),
        target_video=after["video"][:, ncond["video"]:].float(),
        target_audio=after["audio"][:, ncond["audio"]:].float(),
        num_condition_video_rows=ncond["video"], num_condition_audio_rows=ncond["audio"], key_order=inputs.key_order)
    sigmas = {m: (float(getattr(schedule, m).sigmas[pass_index]), float(getattr(schedule, m).sigmas[pass_index + 1]))
              for m in MODALITIES}
    logp = {m: torch.as_tensor(v).detach().reshape(1).to(torch.float32).cpu() for m, v in logp_rollout.items()}
    return Transition(int(request), int(pass_index), sample, sigmas, {m: float(levels[m]) for m in logp}, logp)


def trajectory_transitions(trajectory: Any) -> list[tuple[int, list[Transition], list[bool]]]:
    """Per batch item of a sealed SDE trajectory (latents kept; rl-core's per-pass `transition` records):
    (request id, its `Transition`s in pass order, per pass whether it was stochastic)."""
    inputs, kept, schedule = trajectory.inputs, trajectory.kept, trajectory.schedule
    n, out = inputs.num_passes, []
    missing = [f"{m}.{i:04d}" for m in MODALITIES for i in range(n) if f"{m}.{i:04d}" not in kept]
    if missing:
        raise TrainingError(f"trajectory lacks kept latents {missing[:3]}: record it with keep=('latents', ...)")
    device = inputs.video.device
    for b in range(inputs.batch_size):
        request, passes, sde = None, [], []
        for i, step in enumerate(trajectory.steps):
            record = step.get("transition") or {}
            stochastic = [m for m in MODALITIES if (record.get(m) or {}).get("sde")]
            sde.append(bool(stochastic))
            if not stochastic:
                continue
            entries = {m: record[m]["requests"][b] for m in stochastic}
            ids = {e["request"] for e in entries.values()}
            if len(ids) != 1 or (request is not None and ids != {request}):
                raise TrainingError(f"trajectory {trajectory.digest[:12]} pass {i}: item {b}'s request ids {ids} "
                                    "disagree between modalities or passes")
            request = ids.pop()
            entering = {m: (getattr(inputs, m) if i == 0 else kept[f"{m}.{i - 1:04d}"])[b:b + 1].to(device)
                        for m in MODALITIES}
            after = {m: kept[f"{m}.{i:04d}"][b:b + 1].to(device) for m in MODALITIES}
            logp = {m: torch.tensor(entries[m]["logp_mean"], dtype=torch.float32) for m in stochastic}
            passes.append(transition(inputs, schedule, b, request, i, entering, after, logp,
                                     {m: record[m]["level"] for m in stochastic}))
        if request is None:
            raise TrainingError(f"trajectory {trajectory.digest[:12]} has no stochastic pass: roll out with an SDE "
                                "stepper (flow_sde, dance_sde, cps)")
        out.append((request, passes, sde))
    return out


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """One iteration's rollouts: `transitions[r]` every SDE pass of request r (pass order), `sde[r]` per pass of
    the rollout whether it was an SDE pass, `rewards` (R,) float64 in request order (prompt-major), the
    trajectories' digests for the record, and a weighted-sum reward's parts (`rewards.score_parts`; [] for one
    reward), recorded as the iteration's `reward_parts`."""

    transitions: list[list[Transition]]
    sde: list[list[bool]]
    rewards: torch.Tensor
    origin: dict = field(default_factory=dict)
    parts: list = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.transitions)
        if self.rewards.shape != (n,) or len(self.sde) != n:
            raise TrainingError(f"rollout batch of {n} requests with rewards {tuple(self.rewards.shape)} and "
                                f"{len(self.sde)} pass plans: must be one of each per request")


def batch_from_trajectories(trajectories: Sequence[Any], kind: str, rewards: torch.Tensor,
                            parts: list | None = None) -> RolloutBatch:
    """The `RolloutBatch` of sealed SDE trajectories stepped with `kind` (every request id 0..R-1 exactly once,
    across them), the rewards of the requests in request order and the reward's parts (`rewards.score_parts`)."""
    found: dict[int, tuple[list[Transition], list[bool]]] = {}
    for trajectory in trajectories:
        for request, passes, sde in trajectory_transitions(trajectory):
            if request in found:
                raise TrainingError(f"rollout request {request} appears twice in the trajectories")
            found[request] = (passes, sde)
    if sorted(found) != list(range(len(found))):
        raise TrainingError(f"rollout request ids {sorted(found)[:8]}: must be 0..{len(found) - 1}")
    order = range(len(found))
    origin = {"kind": kind, "trajectories": [t.digest for t in trajectories]}
    return RolloutBatch([found[r][0] for r in order], [found[r][1] for r in order],
                        torch.as_tensor(rewards, dtype=torch.float64), origin, list(parts or []))


def batch_from_rollout(rollout: Any, rewards: torch.Tensor, parts: list | None = None) -> RolloutBatch:
    """`batch_from_trajectories` of an `h3lab.app.rollout.Rollout` (its trajectories and stepper)."""
    return batch_from_trajectories(rollout.trajectories, rollout.stepper, rewards, parts)


# ============================================================================================ one item
def _item_loss(config: GrpoConfig, t: Transition, sample: TrainingSample, v_video, v_audio, advantage: float,
               logp_old: dict[str, torch.Tensor] | None, mean_ref: dict[str, torch.Tensor] | None,
               info: dict) -> torch.Tensor:
    """The item's loss (module docstring); fills `info` with the per-modality statistics."""
    device = v_video.device
    adv = torch.tensor([advantage], dtype=torch.float64, device=device)
    weights = {"video": config.objective.video_weight, "audio": config.objective.audio_weight}
    ncond = {"video": sample.num_condition_video_rows, "audio": sample.num_condition_audio_rows}
    loss = None
    velocity = {"video": v_video, "audio": v_audio}
    for m in t.modalities:
        v = velocity[m]
        x = getattr(sample, m)[:, ncond[m]:]
        x_next = getattr(sample, f"target_{m}")
        sigma, sigma_next = t.sigmas[m]
        logp, _, mean, std = transition_logprob(config.kind, t.levels[m], x, v[:, ncond[m]:], x_next, sigma,
                                                sigma_next)
        rollout = t.logp_rollout[m].to(device)
        ratio_rollout = torch.exp(logp.detach() - rollout)
        old = rollout if config.importance_cap is None else (
            logp.detach() if logp_old is None else logp_old[m].to(device))
        w = truncated_weight(old, rollout, config.importance_cap)
        surrogate, clipped = clipped_surrogate(torch.exp(logp - old), adv, config.clip_range)
        term = w * surrogate
        kl = None
        if mean_ref is not None:
            kl = reference_kl(mean, mean_ref[m], std)
            term = term + config.beta * kl
        term = weights[m] * term.sum()
        loss = term if loss is None else loss + term
        info[m] = {"logp": logp.detach().reshape(()).cpu(), "ratio": ratio_rollout.reshape(()).cpu(),
                   "clipped": bool(clipped.any()), "weight": float(w.reshape(())),
                   "kl": None if kl is None else float(kl.detach().reshape(()))}
    return loss


def _reference_means(config: GrpoConfig, model: nn.Module, t: Transition, sample: TrainingSample
                     ) -> dict[str, torch.Tensor]:
    """mean_ref per modality: the adapter-off model's transition mean on the same inputs (no grad)."""
    with torch.no_grad(), adapter_disabled(model):
        v_video, v_audio = model(**sample.canonical().model_kwargs())
    out = {}
    velocity = {"video": v_video, "audio": v_audio}
    ncond = {"video": sample.num_condition_video_rows, "audio": sample.num_condition_audio_rows}
    for m in t.modalities:
        nc = ncond[m]
        sigma, sigma_next = t.sigmas[m]
        out[m] = transition_mean_std(config.kind, getattr(sample, m)[:, nc:], velocity[m][:, nc:], sigma, sigma_next,
                                     t.levels[m])[0]
    return out


# ============================================================================================ the iteration
def selected_items(batch: RolloutBatch, config: GrpoConfig, iteration: int) -> list[Transition]:
    """The (request, pass) items that train this iteration, request-major and pass-ascending."""
    items = []
    for r, (passes, sde) in enumerate(zip(batch.transitions, batch.sde)):
        chosen = set(config.selection.select(sde, config.seed, iteration, r))
        have = {t.pass_index for t in passes}
        missing = sorted(chosen - have)
        if missing:
            raise TrainingError(f"request {r}: selected passes {missing} have no recorded transition")
        items += [t for t in passes if t.pass_index in chosen]
    return items


def grpo_iteration(model: nn.Module, batch: RolloutBatch, config: GrpoConfig, optimizer: StrictAdamW,
                   iteration: int = 0, trace: TraceSummary | None = None) -> dict[str, Any]:
    """Every inner epoch of one rollout batch (module docstring); trains `model` in place; returns the record."""
    params = trainable_parameters(model)
    if not params:
        raise TrainingError("no trainable parameters: GRPO trains a LoRA adapter (or any requires_grad weights)")
    if config.beta > 0 and not has_lora(model):
        raise TrainingError(f"GRPO beta={config.beta}: the KL's reference is the model with its LoRA adapter off, "
                            "and this model carries none (add_lora first, or beta=0)")
    kind = batch.origin.get("kind", config.kind)
    if kind != config.kind:
        raise TrainingError(f"the rollout stepped with {kind!r} but GrpoConfig.kind is {config.kind!r}: the training "
                            "side must use the rollout's transition")
    advantages = group_advantages(batch.rewards, config.group, config.adv_eps, config.adv_clip)
    items = selected_items(batch, config, iteration)
    scheme, device = _scheme(model), model_device(model)
    trace = TraceSummary() if trace is None else trace
    logp_old: list[dict[str, torch.Tensor] | None] = [None] * len(items)
    epochs = []
    with _TrainContext(model, config.mode, config.gradient_checkpointing):
        for epoch in range(config.inner_epochs):
            grads, losses, records, ratios = TreeAccumulator(), TreeAccumulator(), [], []
            for k, t in enumerate(items):
                sample = t.sample.to(device)
                mean_ref = _reference_means(config, model, t, sample) if config.beta > 0 else None
                info: dict = {}

                def loss_fn(v_video, v_audio, canonical, t=t, k=k, mean_ref=mean_ref, info=info):
                    return _item_loss(config, t, canonical, v_video, v_audio, float(advantages[t.request]),
                                      logp_old[k], mean_ref, info)

                rg = request_gradient(model, sample, config.objective, params, trace=trace, loss_fn=loss_fn)
                if epoch == 0 and config.importance_cap is not None:
                    logp_old[k] = {m: info[m]["logp"].reshape(1) for m in t.modalities}
                grads.add(rg.gradient)
                losses.add(rg.loss.to(torch.float32))
                ratios += [info[m]["ratio"] for m in t.modalities]
                records.append({
                    "request": t.request, "pass": t.pass_index, "advantage": float(advantages[t.request]),
                    "loss": float(rg.loss), "gradient": rg.digest,
                    **{m: {**{k2: v2 for k2, v2 in info[m].items() if k2 not in ("logp", "ratio")},
                           "logp": float(info[m]["logp"]), "ratio": float(info[m]["ratio"])} for m in t.modalities},
                })
            epochs.append({
                "epoch": epoch, "items": records, **step_record(grads, losses, len(items), params, optimizer, scheme),
                "ratio": ratio_stats(ratios),
                "clipped": sum(r[m]["clipped"] for r in records for m in MODALITIES if m in r),
                "kl": None if config.beta == 0 else [r[m]["kl"] for r in records for m in MODALITIES if m in r],
            })
    return {"iteration": iteration, "rewards": [float(r) for r in batch.rewards],
            **({"reward_parts": [dict(p) for p in batch.parts]} if batch.parts else {}),
            "advantages": [float(a) for a in advantages], "origin": dict(batch.origin),
            "sde": [[bool(s) for s in plan] for plan in batch.sde],
            "items": [[t.request, t.pass_index] for t in items], "epochs": epochs}



def replay_ratios(model: nn.Module, batch: RolloutBatch, mode: str = "strict") -> list[dict[str, Any]]:
    """The on-policy consistency of a rollout batch without an update: every (request, SDE pass) replayed alone (batch
    1, no grad) in `mode`, its log-density recomputed, and exp(logp_replay - logp_rollout) per stochastic modality.
    Returns one record per item {request, pass, <modality>: ratio} (request-major, pass-ascending); strict gives 1.0
    exactly (training forward and no-grad forward are byte-equal, H-C1)."""
    if mode not in runtime.MODES:
        raise TrainingError(f"mode={mode!r}: must be one of {', '.join(runtime.MODES)}")
    device, out = model_device(model), []
    with torch.no_grad(), runtime.use_mode(mode):
        for passes in batch.transitions:
            for t in passes:
                sample = t.sample.to(device).canonical()
                v = dict(zip(MODALITIES, model(**sample.model_kwargs())))
                ncond = {"video": sample.num_condition_video_rows, "audio": sample.num_condition_audio_rows}
                row: dict[str, Any] = {"request": t.request, "pass": t.pass_index}
                for m in t.modalities:
                    sigma, sigma_next = t.sigmas[m]
                    logp = transition_logprob(_kind(batch), t.levels[m], getattr(sample, m)[:, ncond[m]:],
                                              v[m][:, ncond[m]:], getattr(sample, f"target_{m}"), sigma,
                                              sigma_next)[0]
                    row[m] = float(torch.exp(logp - t.logp_rollout[m].to(device)))
                out.append(row)
    return out


def _kind(batch: RolloutBatch) -> str:
    """The SDE kind a batch was rolled out with (`origin["kind"]`, set by `batch_from_trajectories`)."""
    if "kind" not in batch.origin:
        raise TrainingError("the rollout batch does not record its SDE kind (origin['kind']): build it with "
                            "batch_from_trajectories / batch_from_rollout")
    return batch.origin["kind"]
