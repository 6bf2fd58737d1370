"""Steppers by name: what advances one modality's generated rows by one pass, as a `RunSpec` names it.

`Stepper.step(modality, i, sample, velocity) -> next sample` (modality "video" | "audio", i the pass index; sample and
velocity are the generated rows only, (B, N, C) float32 velocity). A spec carries a stepper *name* and, for a stepper
that takes them, its parameters (`RunSpec.stepper_params`, a JSON object sealed and hashed with the spec); the loop
builds the stepper on the run's final schedule with `make_stepper(name, schedule, params)` (a factor may change the
schedule first, H11).

A spec with parameters builds its stepper once when it is constructed, and calls `check_inputs(inputs)` when the
stepper has it, so a rule that needs the schedule or the inputs (a window past the last pass, one request id per
batch item) fails before any run. A stepper may also report what it did on a pass: `pass_record(i) -> (record,
tensors) | None`, called by the loop once per pass after both modalities stepped; `record` is JSON (sealed in the
trajectory's pass entry), `tensors` name -> CPU tensor (kept with `keep=("noise",)`). A stepper without
`pass_record` reports nothing (the Euler step).

Registered names (`STEPPERS`):
  euler             the sampler's Euler step on the schedule's own grid per modality (`ScheduleStepper`, default);
  diffusers         Diffusers' `MiniMaxH3Scheduler` pair, the P side of the experiment arms (`h3lab.research.arms`);
  negated_velocity  x0 = x_t - sigma * v, the ablation factor H9 (`h3lab.research.ablation`);
  reordered_euler   x_next = x_t + (sigma - sigma_next) * v, the ablation factor H13 (`h3lab.research.ablation`);
  flow_sde, dance_sde, cps   the SDE transitions with a seeded Gaussian per pass and its log-density
                    (`h3lab.stochastic`), parameters {"level", "seed", "requests", "window"}.
A room adds one with `register_stepper(name, factory)`: `factory(schedule) -> Stepper` for a stepper without
parameters, or a `StepperProvider(build, validate)` for one with (`validate(params) -> params` normalises a JSON
object or raises a one-line `H3Error` when a spec is built; `build(schedule, params) -> Stepper`). It declares its
module in `STEPPERS.modules` so that a spec naming it resolves without an explicit import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import torch

from .sampler import DualSchedule
from .fields import freeze, thaw
from .registry import Registry, RunSpecError


class Stepper(Protocol):
    """Advances one modality's generated rows by one pass: `step(modality, i, sample, velocity) -> next sample`."""

    def step(self, modality: str, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor: ...


class ScheduleStepper:
    """The default stepper: the sampler's Euler step on the schedule's own grid for each modality."""

    def __init__(self, schedule: DualSchedule):
        self.schedule = schedule

    def step(self, modality: str, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        return getattr(self.schedule, modality).step(i, sample, velocity)


StepperFactory = Callable[[DualSchedule], Stepper]


@dataclass(frozen=True)
class StepperProvider:
    """A stepper that takes parameters (see the module docstring)."""

    build: Callable[[DualSchedule, Mapping[str, Any]], Stepper]
    validate: Callable[[Mapping[str, Any]], Mapping[str, Any]]


STEPPERS = Registry("stepper", {
    "diffusers": "h3lab.research.arms",
    "negated_velocity": "h3lab.research.ablation",
    "reordered_euler": "h3lab.research.ablation",
    "flow_sde": "h3lab.stochastic",
    "dance_sde": "h3lab.stochastic",
    "cps": "h3lab.stochastic",
})
STEPPERS.register("euler", ScheduleStepper)


def register_stepper(name: str, factory: StepperFactory | StepperProvider, *, replace: bool = False) -> None:
    """Make `name` a stepper a spec can carry: `factory(schedule) -> Stepper`, or a `StepperProvider`."""
    STEPPERS.register(name, factory, replace=replace)


def check_stepper(name: str) -> str:
    """`name` if a stepper of that name is provided, else a one-line `RunSpecError`."""
    if not isinstance(name, str) or STEPPERS.get(name) is None:
        raise RunSpecError(f"stepper {name!r}: no stepper of that name is registered (known: "
                           f"{', '.join(STEPPERS.names())})")
    return name


def check_stepper_params(name: str, params: Any) -> Mapping[str, Any]:
    """The frozen, normalised parameters of stepper `name` ({} for None); a stepper without parameters refuses any."""
    frozen = freeze({} if params is None else params, "stepper_params")
    if not isinstance(frozen, Mapping):
        raise RunSpecError(f"stepper_params={thaw(frozen)!r}: must be a JSON object")
    provider = STEPPERS.get(check_stepper(name))
    if not isinstance(provider, StepperProvider):
        if frozen:
            raise RunSpecError(f"stepper {name!r} takes no parameters (got {sorted(frozen)})")
        return frozen
    return freeze(provider.validate(thaw(frozen)), "stepper_params")


def make_stepper(name: str, schedule: DualSchedule, params: Mapping[str, Any] | None = None) -> Stepper:
    provider = STEPPERS.get(check_stepper(name))
    if isinstance(provider, StepperProvider):
        return provider.build(schedule, thaw(check_stepper_params(name, params)))
    check_stepper_params(name, params)
    return provider(schedule)
