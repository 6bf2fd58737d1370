"""The run-spec room: `RunSpec` (one sealed description of a run) and the one loop that runs it.

  registry.py  `RunSpecError`; `Registry`, name -> provider with a lazy import of the providing room
  inputs.py    `DenoiseInputs`, the sealed tensors of a run
  steppers.py  `Stepper`, `ScheduleStepper` (the Euler step), steppers by registered name (`StepperProvider` for
               steppers with sealed parameters)
  fields.py    the extension fields (adapters, factors, preset, placement, residency): `FieldProvider`, `register_field`
  spec.py      `RunSpec`, `Custom`; JSON description, sealed tensors, `sha256`
  loop.py      `resolve(spec, model)` -> `ResolvedRun`; `loop(run)`; `denoise(spec, model)` = resolve + loop
  layout.py    `PackedLayout` and its builders: the packed rows of text, video and audio
  sampler.py   schedules (`DualSchedule`), the Euler step, noise mix, reuse
  artifact.py  `SealedArtifact`, the sealed-artifact base of trajectories, training runs and GRPO runs
  trajectory.py  `Trajectory` (the sealed record of one run), `TrajectoryRecorder`, `load`, `VerifyReport`

May import: the foundations (errors, io_utils, hashing, config) and `execution`; the model only through the
objects it is given. It never imports the rooms that register providers (adapters, ablation, arms, distributed,
presets): they are named by module in the registries.
"""

from .fields import EXTENSION_FIELDS, FIELDS, FieldProvider, register_field
from .inputs import DenoiseInputs
from .loop import DenoiseCancelled, ResolvedRun, StepRecord, denoise, loop, model_forward, resolve, set_hook_step
from .registry import Registry, RunSpecError
from .spec import Custom, RunSpec
from .steppers import STEPPERS, ScheduleStepper, Stepper, StepperProvider, make_stepper, register_stepper

__all__ = [
    "Custom", "DenoiseCancelled", "DenoiseInputs", "EXTENSION_FIELDS", "FIELDS", "FieldProvider", "Registry",
    "ResolvedRun", "RunSpec", "RunSpecError", "STEPPERS", "ScheduleStepper", "StepRecord", "Stepper", "StepperProvider",
    "denoise",
    "loop", "make_stepper", "model_forward", "register_field", "register_stepper", "resolve", "set_hook_step",
]
