"""The one denoise loop of h3lab: `denoise(spec, model, ...)` runs a `RunSpec`; every caller shares it (the session's
generation, `trajectory.verify`, drift's executions, the ablation matrix, the experiment arms' rollouts).

Contract
--------
`denoise(spec, model, recorder=None, callback=None, cancel=None, *, models=None) -> (video, audio)` is
`with resolve(spec, model, models=models) as run: return loop(run, recorder, callback, cancel)`:

`resolve` turns the spec into a `ResolvedRun` -- the live objects of one run: the model, the inputs, the schedule,
the layout, the stepper name, op overrides, perturbation hooks, the forward function, and (for drift) a row map into
the spec's frame -- and holds, for the duration of the `with`, in this order:
  1. the spec's runtime mode (`runtime.use_mode`);
  2. each non-default extension field's provider, in `EXTENSION_FIELDS` order (adapters, factors, preset,
     placement, residency): `provider.apply(value, run)` is entered as a context manager and yields the run to continue with
     (ablation factors change overrides / hooks / stepper / inputs / schedule / model here, re-derived from their
     names on every resolve, so a replay perturbs exactly as the original run did);
  3. the op overrides (`runtime.use_overrides`) and the hooks (`model.add_hook`), removed on exit.
`models` is what factors that swap the transformer (H16) ask for another variant: a mapping or a callable
variant -> model; the spec's own model is `model`.

`loop(run, ...)`: per pass i of the run's schedule --
  1. if `sampler.reuse_plan(num_passes, spec.reuse)[i]`: `model.hook_context["step"] = i` (when the model has one) and
     ONE transformer forward over the packed rows (`run.forward`, default `model_forward`) with pass i's sealed row
     timestep plan; else the velocities are extrapolated per modality on its own grid (`extrapolate_velocity`,
     `spec.reuse_mode`);
  2. the video rows after the `num_condition_video_rows` conditioning rows step down the video grid, the audio rows
     after the reference rows down the audio grid (the stepper named by the run with the spec's `stepper_params`,
     built on its final schedule); conditioning rows are never written; a stepper with `pass_record(i)` reports the
     pass (the SDE steppers: log-densities, sigmas, noise) into `StepRecord.transition` / `.transition_tensors`;
  3. the recorder (`begin(run)` once, then `record(StepRecord)`) and `callback(StepRecord)` see the pass.
`cancel` (an Event-like `.is_set()` or a callable) is checked before each pass and raises `DenoiseCancelled`. The
whole loop runs under `torch.no_grad()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch

from ..execution import runtime
from .sampler import DualSchedule, extrapolate_velocity, reuse_plan
from .fields import EXTENSION_FIELDS, is_default, provider, thaw
from .inputs import DenoiseInputs
from .registry import RunSpecError
from .spec import Custom, RunSpec
from .steppers import Stepper, make_stepper


class DenoiseCancelled(Exception):
    """Raised by the loop when `cancel` reports a cancellation before a pass (the session catches it)."""


def model_forward(model: Any, inputs: DenoiseInputs, video: torch.Tensor, audio: torch.Tensor, i: int):
    """One transformer forward of pass i over the packed layout; works for `H3Transformer` and Diffusers'
    `MiniMaxH3Transformer3DModel` (whose output object is unpacked)."""
    timestep, timestep_indices = inputs.plan[i]
    # Diffusers' model has no key_order; it only ever sees canonical layouts (packed order = canonical order).
    extra = {} if inputs.key_order is None else {"key_order": inputs.key_order}
    out = model(
        hidden_states=video,
        audio_hidden_states=audio,
        encoder_hidden_states=inputs.text,
        timestep=timestep,
        timestep_indices=timestep_indices,
        **inputs.layout_kwargs(),
        **extra,
    )
    if isinstance(out, tuple):
        return out[0], out[1]
    return out.sample, out.audio_sample


Forward = Callable[[Any, DenoiseInputs, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def set_hook_step(model: Any, i: int) -> None:
    ctx = getattr(model, "hook_context", None)
    if isinstance(ctx, dict):
        ctx["step"] = i


@dataclass(frozen=True, eq=False)
class ResolvedRun:
    """The live objects of one run of `spec` (see the module docstring). Transforms (factor and field providers)
    return changed copies (`replace`); `changed` maps what a transform changed ("op:rms_norm", "stepper", "plan",
    "schedule", "model", ...) to who changed it, so two transforms of one thing refuse to compose."""

    spec: RunSpec
    model: Any
    inputs: DenoiseInputs
    schedule: DualSchedule
    layout: Any
    stepper: str
    stepper_params: Mapping[str, Any] = field(default_factory=dict)
    overrides: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    hooks: tuple = ()
    forward: Forward = model_forward
    custom_stepper: Stepper | None = None
    reuse: int = 1
    reuse_mode: str = "linear"
    row_map: Any = None  # drift: maps this run's tensors into the spec's frame (a permuted layout, H1)
    models: Callable[[str], Any] | None = None
    base_model: Any = None  # the model the spec's variant names (`model` may be another after a factor, H16)
    changed: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes: Any) -> "ResolvedRun":
        return dataclasses.replace(self, **changes)

    def claim(self, by: str, *targets: str) -> dict[str, str]:
        """`changed` with `targets` claimed by `by`; refuses a target another transform already changed."""
        taken = {t: self.changed[t] for t in targets if t in self.changed}
        if taken:
            t, who = next(iter(taken.items()))
            raise RunSpecError(f"{by} changes {t}, which {who} already changes: switch one of them off")
        return {**self.changed, **{t: by for t in targets}}

    def model_for(self, variant: str, by: str) -> Any:
        if self.models is None:
            raise RunSpecError(f"{by} runs the {variant} model: pass models= (variant -> model) to the run")
        return self.models(variant)

    def make_stepper(self) -> Stepper:
        if self.custom_stepper is not None:
            return self.custom_stepper
        return make_stepper(self.stepper, self.schedule, self.stepper_params)


def _lookup(models: Mapping[str, Any] | Callable[[str], Any] | None) -> Callable[[str], Any] | None:
    if models is None or callable(models):
        return models

    def get(variant: str) -> Any:
        if variant not in models:
            raise RunSpecError(f"models has no {variant!r} model (has {', '.join(sorted(models))})")
        return models[variant]

    return get


def _enter(stack: contextlib.ExitStack, name: str, cm: ContextManager[ResolvedRun]) -> ResolvedRun:
    run = stack.enter_context(cm)
    if not isinstance(run, ResolvedRun):
        raise RunSpecError(f"the {name} provider yielded a {type(run).__name__}: it must yield the ResolvedRun")
    return run


@contextlib.contextmanager
def resolve(spec: RunSpec, model: Any, *,
            models: Mapping[str, Any] | Callable[[str], Any] | None = None,
            forward: Forward = model_forward) -> Iterator[ResolvedRun]:
    """Hold `spec` applied to `model` for the duration of the `with` (see the module docstring). `forward`: the
    innermost forward the transforms wrap (a mesh follower's calls the model with the lead rank's arguments)."""
    if not isinstance(spec, RunSpec):
        raise RunSpecError(f"spec is a {type(spec).__name__}: must be a RunSpec")
    custom = spec.custom or Custom()
    if not custom.runnable:
        raise RunSpecError(f"the run spec carries custom callables {custom.describe()} that were never sealed: "
                           "it cannot run from its description")
    run = ResolvedRun(spec=spec, model=model, inputs=spec.inputs, schedule=spec.schedule, layout=spec.layout,
                      stepper=spec.stepper, stepper_params=spec.stepper_params,
                      overrides=dict(custom.overrides), hooks=custom.hooks,
                      custom_stepper=custom.stepper, reuse=spec.reuse, reuse_mode=spec.reuse_mode,
                      models=_lookup(models), base_model=model, forward=forward,
                      changed={**{f"op:{op}": "a custom override" for op in custom.overrides},
                               **({"stepper": "a custom stepper"} if custom.stepper is not None else {})})
    with contextlib.ExitStack() as stack:
        stack.enter_context(runtime.use_mode(spec.mode))
        for name in EXTENSION_FIELDS:
            value = getattr(spec, name)
            if not is_default(name, value):
                run = _enter(stack, name, provider(name).apply(thaw(value), run))
        if run.inputs.num_passes != run.schedule.num_passes:
            raise RunSpecError(f"the resolved run has a plan for {run.inputs.num_passes} passes and a schedule of "
                               f"{run.schedule.num_passes}: a transform changed one without the other")
        if run.hooks and not hasattr(run.model, "add_hook"):
            raise RunSpecError(f"perturbation hooks need an H3Transformer; {type(run.model).__name__} has no add_hook")
        stack.enter_context(runtime.use_overrides(dict(run.overrides)))
        for hook in run.hooks:
            stack.callback(run.model.add_hook(hook).remove)
        yield run


@dataclass
class StepRecord:
    """One pass: t of each modality, whether the model ran (False: reused velocity), velocities as returned (all
    rows, (B, N, C)), latents after the step (B, N, C), the provenance trace of the forward (None if none), and what
    the stepper reported (`pass_record`: JSON `transition` and CPU `transition_tensors`; None for the Euler step)."""

    index: int
    t_video: float
    t_audio: float
    evaluated: bool
    velocity_video: torch.Tensor
    velocity_audio: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    trace: runtime.Trace | None = None
    transition: dict | None = None
    transition_tensors: dict | None = None


def _cancelled(cancel: Any) -> bool:
    if cancel is None:
        return False
    if hasattr(cancel, "is_set"):
        return bool(cancel.is_set())
    return bool(cancel())


def loop(run: ResolvedRun, recorder: Any = None, callback: Callable[[StepRecord], None] | None = None,
         cancel: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every pass of a resolved run; returns the final (video, audio) rows (B, N, C). See the module docstring."""
    schedule, inputs, model = run.schedule, run.inputs, run.model
    stepper = run.make_stepper()
    report = getattr(stepper, "pass_record", None)
    evaluate = reuse_plan(schedule.num_passes, run.reuse)
    history: dict[str, list] = {"video": [], "audio": []}
    nv, na = inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    video, audio = inputs.video, inputs.audio
    if recorder is not None:
        recorder.begin(run)
    with torch.no_grad():
        for i in range(schedule.num_passes):
            if _cancelled(cancel):
                raise DenoiseCancelled(f"cancelled before pass {i} of {schedule.num_passes}")
            trace = None
            if evaluate[i]:
                set_hook_step(model, i)
                before = runtime.last_trace()
                v_video, v_audio = run.forward(model, inputs, video, audio, i)
                trace = runtime.last_trace()
                trace = trace if trace is not before else None  # a model that does not trace (Diffusers)
                history["video"].append((schedule.video.sigmas[i], v_video))
                history["audio"].append((schedule.audio.sigmas[i], v_audio))
            else:
                v_video = extrapolate_velocity(schedule.video.sigmas[i], history["video"], run.reuse_mode)
                v_audio = extrapolate_velocity(schedule.audio.sigmas[i], history["audio"], run.reuse_mode)
            # Only the generated rows move; the conditioning / reference rows are kept as sealed.
            video = torch.cat([video[:, :nv], stepper.step("video", i, video[:, nv:], v_video[:, nv:].float())], 1)
            audio = torch.cat([audio[:, :na], stepper.step("audio", i, audio[:, na:], v_audio[:, na:].float())], 1)
            transition, transition_tensors = (report(i) or (None, None)) if report is not None else (None, None)
            record = StepRecord(
                index=i,
                t_video=float(schedule.video.timesteps[i]),
                t_audio=float(schedule.audio.timesteps[i]),
                evaluated=evaluate[i],
                velocity_video=v_video,
                velocity_audio=v_audio,
                video=video,
                audio=audio,
                trace=trace,
                transition=transition,
                transition_tensors=transition_tensors,
            )
            if recorder is not None:
                recorder.record(record)
            if callback is not None:
                callback(record)
    return video, audio


def denoise(spec: RunSpec, model: Any, recorder: Any = None, callback: Callable[[StepRecord], None] | None = None,
            cancel: Any = None, *, models: Mapping[str, Any] | Callable[[str], Any] | None = None):
    """Run `spec` on `model` (see the module docstring); returns the final (video, audio) rows (B, N, C)."""
    with resolve(spec, model, models=models) as run:
        return loop(run, recorder, callback, cancel)
