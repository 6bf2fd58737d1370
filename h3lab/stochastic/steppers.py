"""The SDE steppers as sealed `RunSpec` choices: `flow_sde`, `dance_sde`, `cps` (registered by name in the run-spec
room's stepper registry), each with its parameters sealed in `RunSpec.stepper_params`, and a MixGRPO window.

Parameters (a JSON object, normalised when the spec is built; every key is sealed and hashed with the spec):

  level     the noise level (Flow-GRPO's a, DanceGRPO's eta, CPS's a): one number for both modalities or
            {"video": x, "audio": y}; normalised to the per-modality object. A modality at level 0 steps with the
            released Euler step (its bytes). Both at 0 is refused (that is the `euler` stepper).
  seed      integer >= 0 (< 2**63): the rollout's noise seed (`transitions.pass_noise`).
  requests  the identity of each batch item in its rollout, distinct integers >= 0, one per batch item; null: the
            batch positions 0..B-1. The noise of a request depends on (seed, request, pass, modality) only.
  window    null (every pass is stochastic) or {"start": s, "size": w}: MixGRPO's window, SDE on passes
            s <= i < s + w and the Euler step (its bytes) on every other pass; s + w must not exceed the pass count.

One pass of one modality, rows entering x (the generated rows only), velocity v, the modality's own grid:
  (mean, std) = transitions.transition_mean_std(kind, x, v, sigma_i, sigma_{i+1}, level)  (level 0 outside the window)
  std == 0 (outside the window, level 0, the CPS step into sigma 0, no generated rows): x_next = mean (Euler bytes);
  else eps[b] = pass_noise(seed, requests[b], i, modality, x.shape[1:]) for every item b (CPU, then moved to x's
  device), x_next = mean + std * eps, and (logp_mean, logp_sum) = gaussian_logprob(x_next, mean, std).

`pass_record(i)` (read by the loop after both modalities stepped) returns the pass's JSON record and its noise:
  {"kind": kind, "video": M, "audio": M},  M = {"sde": bool, "level": level used, "sigma": sigma_i,
   "sigma_next": sigma_{i+1}, "std": std, "requests": [{"request": r, "logp_mean": .., "logp_sum": ..,
   "mean_sha256": ..}, ...]}    (floats are the exact float32 values; "requests" only when "sde")
and {"noise_video": (B, N, C), "noise_audio": ...} float32 CPU for the stochastic modalities (kept with
`keep=("noise",)`). The trajectory seals the record in the pass entry; `verify` replays and compares it.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch

from ..hashing import tensor_digest
from ..run import STEPPERS, RunSpecError, StepperProvider, register_stepper
from ..run.sampler import DualSchedule
from .transitions import (MODALITIES, SDE_KINDS, TransitionError, check_level, gaussian_logprob, pass_noise,
                          transition_mean_std)

PARAM_KEYS = ("level", "seed", "requests", "window")


def _integer(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum or (
            maximum is not None and value > maximum):
        rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise RunSpecError(f"{name}={value!r}: must be an integer {rule}")
    return int(value)


def check_params(kind: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The normalised parameters of stepper `kind` (module docstring); one-line `RunSpecError` on a bad one."""
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise RunSpecError(f"{kind} stepper parameter {unknown[0]!r}: known parameters are {', '.join(PARAM_KEYS)}")
    if "level" not in params or "seed" not in params:
        missing = "level" if "level" not in params else "seed"
        raise RunSpecError(f"{kind} stepper: parameter {missing!r} is required")
    level = params["level"]
    if not isinstance(level, Mapping):
        level = {m: level for m in MODALITIES}
    if set(level) != set(MODALITIES):
        raise RunSpecError(f"{kind} level={dict(level)!r}: must be a number or an object with keys video and audio")
    try:
        levels = {m: check_level(kind, level[m]) for m in MODALITIES}
    except TransitionError as err:
        raise RunSpecError(str(err)) from None
    if not any(levels.values()):
        raise RunSpecError(f"{kind} level 0 for both modalities is the Euler step: use stepper 'euler'")
    requests = params.get("requests")
    if requests is not None:
        if not isinstance(requests, (list, tuple)) or not requests:
            raise RunSpecError(f"{kind} requests={requests!r}: must be a non-empty list of integers or null")
        requests = [_integer(f"{kind} request", r, 0) for r in requests]
        if len(set(requests)) != len(requests):
            raise RunSpecError(f"{kind} requests={requests}: must be distinct (each request draws its own noise)")
    window = params.get("window")
    if window is not None:
        if not isinstance(window, Mapping) or set(window) != {"start", "size"}:
            raise RunSpecError(f"{kind} window={window!r}: must be null or an object {{\"start\": s, \"size\": w}}")
        window = {"start": _integer(f"{kind} window start", window["start"], 0),
                  "size": _integer(f"{kind} window size", window["size"], 1)}
    return {"level": levels, "seed": _integer(f"{kind} seed", params["seed"], 0, 2**63 - 1), "requests": requests,
            "window": window}


class SDEStepper:
    """One SDE kind on a schedule (module docstring); `pass_record(i)` hands the loop what pass i did."""

    def __init__(self, kind: str, schedule: DualSchedule, params: Mapping[str, Any]):
        self.kind, self.schedule = kind, schedule
        self.levels, self.seed = dict(params["level"]), int(params["seed"])
        self.requests = None if params["requests"] is None else [int(r) for r in params["requests"]]
        self.window = params["window"]
        if self.window is not None and self.window["start"] + self.window["size"] > schedule.num_passes:
            raise RunSpecError(f"{kind} window {dict(self.window)}: passes {self.window['start']}.."
                               f"{self.window['start'] + self.window['size'] - 1} exceed the run's "
                               f"{schedule.num_passes} passes")
        self._record: dict[str, Any] = {}
        self._tensors: dict[str, torch.Tensor] = {}

    def check_inputs(self, inputs) -> None:
        """The spec's inputs carry one batch item per request id (called when the spec is built)."""
        self.requests_for(inputs.batch_size)

    def in_window(self, i: int) -> bool:
        return self.window is None or self.window["start"] <= i < self.window["start"] + self.window["size"]

    def requests_for(self, batch: int) -> list[int]:
        if self.requests is None:
            return list(range(batch))
        if len(self.requests) != batch:
            raise RunSpecError(f"{self.kind} requests={self.requests}: {len(self.requests)} ids for a batch of "
                               f"{batch} (one per batch item)")
        return self.requests

    def step(self, modality: str, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        grid = getattr(self.schedule, modality)
        sigma, sigma_next = grid.sigmas[i], grid.sigmas[i + 1]
        level = self.levels[modality] if self.in_window(i) and sample.shape[1] > 0 else 0.0
        mean, std = transition_mean_std(self.kind, sample, velocity, sigma, sigma_next, level)
        record: dict[str, Any] = {"sde": False, "level": level, "sigma": float(sigma),
                                  "sigma_next": float(sigma_next), "std": float(std)}
        self._record[modality] = record
        if float(std) == 0.0:
            return mean.to(sample.dtype)
        requests = self.requests_for(sample.shape[0])
        noise = torch.stack([pass_noise(self.seed, r, i, modality, sample.shape[1:]) for r in requests])
        x_next = mean + std * noise.to(mean.device)
        logp_mean, logp_sum = gaussian_logprob(x_next, mean, std)
        record.update(sde=True, requests=[
            {"request": r, "logp_mean": float(logp_mean[b]), "logp_sum": float(logp_sum[b]),
             "mean_sha256": tensor_digest(mean[b].cpu(), "sha256")} for b, r in enumerate(requests)])
        self._tensors[f"noise_{modality}"] = noise
        return x_next.to(sample.dtype)

    def pass_record(self, i: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        record, tensors = {"kind": self.kind, **self._record}, self._tensors
        self._record, self._tensors = {}, {}
        return record, tensors


class SDEProvider(StepperProvider):
    """The provider of a stepper with a seeded Gaussian per pass and its log-density: one RL can train on."""


def _provider(kind: str) -> SDEProvider:
    return SDEProvider(build=lambda schedule, params: SDEStepper(kind, schedule, params),
                       validate=lambda params: check_params(kind, params))


for _kind in SDE_KINDS:
    register_stepper(_kind, _provider(_kind), replace=True)


def sde_steppers() -> tuple[str, ...]:
    """The registered steppers with a transition log-density, in registration order (`h3lab train grpo --stepper`'s
    choices; `train nft` adds the released "euler")."""
    return tuple(name for name, provider in STEPPERS.registered() if isinstance(provider, SDEProvider))
