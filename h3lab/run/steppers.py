"""Steppers by name: what advances one modality's generated rows by one pass, as a `RunSpec` names it.

`Stepper.step(modality, i, sample, velocity) -> next sample` (modality "video" | "audio", i the pass index; sample and
velocity are the generated rows only, (B, N, C) float32 velocity). A spec carries a stepper *name*; the loop builds the
stepper on the run's final schedule with `make_stepper(name, schedule)` (a factor may change the schedule first, H11).

Registered names (`STEPPERS`):
  euler             the sampler's Euler step on the schedule's own grid per modality (`ScheduleStepper`, default);
  diffusers         Diffusers' `MiniMaxH3Scheduler` pair, the P side of the experiment arms (`h3lab.arms`);
  negated_velocity  x0 = x_t - sigma * v, the ablation factor H9 (`h3lab.ablation`);
  reordered_euler   x_next = x_t + (sigma - sigma_next) * v, the ablation factor H13 (`h3lab.ablation`).
A room adds one with `register_stepper(name, factory)`, `factory(schedule) -> Stepper`, and declares its module in
`STEPPERS.modules` so that a spec naming it resolves without an explicit import.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..sampler import DualSchedule
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

STEPPERS = Registry("stepper", {
    "diffusers": "h3lab.arms",
    "negated_velocity": "h3lab.ablation",
    "reordered_euler": "h3lab.ablation",
})
STEPPERS.register("euler", ScheduleStepper)


def register_stepper(name: str, factory: StepperFactory, *, replace: bool = False) -> None:
    """Make `name` a stepper a spec can carry: `factory(schedule) -> Stepper`."""
    STEPPERS.register(name, factory, replace=replace)


def check_stepper(name: str) -> str:
    """`name` if a stepper of that name is provided, else a one-line `RunSpecError`."""
    if not isinstance(name, str) or STEPPERS.get(name) is None:
        raise RunSpecError(f"stepper {name!r}: no stepper of that name is registered (known: "
                           f"{', '.join(STEPPERS.names())})")
    return name


def make_stepper(name: str, schedule: DualSchedule) -> Stepper:
    return STEPPERS.get(check_stepper(name))(schedule)
