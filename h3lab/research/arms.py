"""The RFC's minimum experiment arms (section 6.4): P/P, R/P, P/R, R/R — training side / rollout side.

Contract
--------
A side is one implementation of the transformer and the scheduler:
  P  the pinned production reference: Diffusers' `MiniMaxH3Transformer3DModel` (plain torch) stepped by two
     `MiniMaxH3Scheduler`s (video shift 12, audio shift 3) — `DiffusersStepper`;
  R  h3lab in strict mode: `H3Transformer` under `runtime.use_mode("strict")` stepped by `h3lab.run.sampler`.
Both sides hold the same weights (`diffusers_twin` copies the H3Transformer's state dict, dtypes kept) and read the
same sealed inputs and row timestep plan (built from the sealed `DualSchedule`; `DiffusersStepper` checks that its
scheduler grids are byte-equal to the sealed ones — "same sealed schedules").

A side is a transform of one base `RunSpec` (the sealed inputs and schedule): `Side.spec(inputs, schedule)` sets the
side's mode, model identity (variant "diffusers" / "transformer", its fingerprint) and stepper by name ("diffusers",
registered here, or "euler"). Every run of a side -- rollout, training recompute, localisation -- is that spec.

An arm `train/rollout`:
  1. rollout: the rollout side's spec runs through the one loop (`trajectory.record`, no grad) and records every
     pass's latents and velocities;
  2. training: for every pass i the training side recomputes the velocity from the *recorded* latents entering pass i
     with autograd enabled and the model in train mode, as a trainer would (no backward is taken: the forward a
     trainer differentiates is what must match), then applies its own scheduler step to the recorded latents;
  3. report per pass: velocity drift (training velocity vs the rollout's) and latent drift (training side's next
     latent vs the rollout's), each max |a-b|, relative L2 and byte equality, video and audio; `byte_equal` over all
     passes; and the first drift — the first pass/tensor whose bytes differ, localised to an operator by
     `drift.compare` of one forward of each side at that pass (hook points on R, module taps on P; points only one
     side exposes are skipped); `seconds` per phase (performance). No reward model exists here: reward fields are
     absent, as are transition log-probabilities (RFC: not defined for the eta = 0 sampler).
R/R must be byte-equal at every pass; the others report what they find (on CPU, P/P is byte-equal, and every arm
with one strict side drifts from the first reduction onwards, since strict and torch reduce in different orders).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .drift import Execution, compare
from ..errors import H3Error
from ..hashing import model_fingerprint, tensor_digest
from ..run import DenoiseInputs, RunSpec, register_stepper, resolve
from ..run.sampler import DualSchedule
from ..run.trajectory import Trajectory, record

ARMS = ("P/P", "R/P", "P/R", "R/R")


class ArmError(H3Error):
    """An arm name or side setting breaks a rule."""


# ====================================================================================================== sides
class DiffusersStepper:
    """Steps with Diffusers' `MiniMaxH3Scheduler` pair, as the released pipeline does (`scheduler.step(v, t, x)` on
    the generated rows). Stateless per call: the scheduler is re-armed at pass i (`set_timesteps`, `set_begin_index`)
    so a training recompute can step any pass in any order."""

    def __init__(self, schedule: DualSchedule):
        from diffusers import MiniMaxH3Scheduler

        self.num_points = schedule.num_points
        self.schedulers = {
            "video": MiniMaxH3Scheduler(shift=schedule.video.shift),
            "audio": MiniMaxH3Scheduler(shift=schedule.audio.shift),
        }
        for name, sched in self.schedulers.items():
            sched.set_timesteps(self.num_points)
            sealed = getattr(schedule, name).sigmas
            if sched.sigmas.dtype != sealed.dtype or not torch.equal(sched.sigmas.cpu(), sealed):
                raise ArmError(f"Diffusers' {name} sigma grid differs from the sealed one: not one sealed schedule")

    def step(self, modality: str, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        sched = self.schedulers[modality]
        sched.set_timesteps(self.num_points)
        sched.set_begin_index(i)
        return sched.step(velocity, sched.timesteps[i], sample, return_dict=False)[0]


def diffusers_twin(model: Any) -> Any:
    """Diffusers' `MiniMaxH3Transformer3DModel` with `model`'s config and a copy of its weights (dtypes kept)."""
    from diffusers import MiniMaxH3Transformer3DModel

    twin = MiniMaxH3Transformer3DModel(**model.config.to_diffusers())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    twin.load_state_dict(state, strict=True, assign=True)
    return twin.eval()


register_stepper("diffusers", DiffusersStepper, replace=True)


@dataclass
class Side:
    """One implementation: `name` "P" or "R", its model, the runtime mode its forwards run in, and a description."""

    name: str
    model: Any
    mode: str
    description: str

    @property
    def stepper(self) -> str:
        return "diffusers" if self.name == "P" else "euler"

    def spec(self, inputs: DenoiseInputs, schedule: DualSchedule) -> RunSpec:
        """This side's run of the sealed inputs and schedule."""
        return RunSpec(inputs, schedule, mode=self.mode, variant="diffusers" if self.name == "P" else "transformer",
                       fingerprint=model_fingerprint(self.model), stepper=self.stepper, label=f"side {self.name}")


def sides(model: Any, p_model: Any | None = None) -> dict[str, Side]:
    """P (Diffusers twin of `model`, unless given) and R (`model` in strict mode)."""
    p_model = p_model if p_model is not None else diffusers_twin(model)
    return {
        "P": Side("P", p_model, "off", "Diffusers MiniMaxH3Transformer3DModel + MiniMaxH3Scheduler"),
        "R": Side("R", model, "strict", "h3lab H3Transformer strict + h3lab.run.sampler"),
    }


# ====================================================================================================== rollout
def rollout(side: Side, inputs: DenoiseInputs, schedule: DualSchedule) -> Trajectory:
    """The side's spec through the one loop, latents and velocities kept for every pass."""
    return record(side.spec(inputs, schedule), side.model, keep=("latents", "velocities"), meta={"side": side.name})


def _entering(traj: Trajectory, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (video, audio) rows that entered pass i of a recorded trajectory, on the sealed inputs' device (the
    recorder keeps its tensors on the host)."""
    if i == 0:
        return traj.inputs.video, traj.inputs.audio
    device = traj.inputs.video.device
    return traj.kept[f"video.{i - 1:04d}"].to(device), traj.kept[f"audio.{i - 1:04d}"].to(device)


def _drift(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Rollout value `a` vs training value `b`: bytes equal, max |a-b|, ||a-b|| / ||a|| (float64)."""
    equal = a.dtype == b.dtype and a.shape == b.shape and tensor_digest(a) == tensor_digest(b)
    d = a.detach().double() - b.detach().double().to(a.device)
    den = a.detach().double().norm()
    rel = float(d.norm() / den) if den > 0 else (0.0 if float(d.norm()) == 0 else float("inf"))
    return {"equal": equal, "max_abs": float(d.abs().max()) if d.numel() else 0.0, "rel_l2": rel}


# ===================================================================================================== the arms
@dataclass
class ArmReport:
    arm: str
    train: str
    rollout: str
    velocity_drift: list[dict] = field(default_factory=list)
    latent_drift: list[dict] = field(default_factory=list)
    byte_equal: bool = True
    first_drift: dict | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    rollout_digest: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def summary(self) -> str:
        if self.byte_equal:
            return f"{self.arm}: byte-equal at every pass ({len(self.velocity_drift)} passes)"
        worst_v = max(max(s["video"]["rel_l2"], s["audio"]["rel_l2"]) for s in self.velocity_drift)
        worst_x = max(max(s["video"]["rel_l2"], s["audio"]["rel_l2"]) for s in self.latent_drift)
        where = self.first_drift or {}
        point = (where.get("point") or {}).get("point", "?")
        return (f"{self.arm}: velocity rel L2 <= {worst_v:.3g}, latent rel L2 <= {worst_x:.3g}; first drift pass "
                f"{where.get('step')} {where.get('field')} at {point}")


def run_arm(
    train: Side, roll: Side, inputs: DenoiseInputs, schedule: DualSchedule, trajectory: Trajectory | None = None
) -> ArmReport:
    """One arm (see the module docstring). `trajectory`: the rollout side's recorded trajectory, if already run."""
    report = ArmReport(arm=f"{train.name}/{roll.name}", train=train.description, rollout=roll.description)
    t0 = time.perf_counter()
    traj = trajectory if trajectory is not None else rollout(roll, inputs, schedule)
    # A shared rollout carries its own time in its manifest meta.
    report.seconds["rollout"] = traj.manifest["meta"].get("seconds", round(time.perf_counter() - t0, 3))
    report.rollout_digest = traj.digest
    nv, na = inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    model = train.model
    was_training = model.training
    first: dict[str, Any] | None = None
    t0 = time.perf_counter()
    try:
        model.train()
        with resolve(train.spec(traj.inputs, schedule), model) as run:
            stepper = run.make_stepper()
            for i in range(schedule.num_passes):
                vel, lat = _recompute(run, stepper, traj, i, nv, na)
                report.velocity_drift.append({"step": i, **vel})
                report.latent_drift.append({"step": i, **lat})
                if first is None:
                    for kind, d in (("velocity", vel), ("latent", lat)):
                        bad = [m for m in ("video", "audio") if not d[m]["equal"]]
                        if bad:
                            first = {"step": i, "field": f"{kind}_{bad[0]}"}
                            break
    finally:
        model.train(was_training)
    report.seconds["training"] = round(time.perf_counter() - t0, 3)
    report.byte_equal = first is None
    if first is not None:
        t0 = time.perf_counter()
        first["point"] = _localise(train, roll, traj, first["step"])
        report.seconds["localise"] = round(time.perf_counter() - t0, 3)
    report.first_drift = first
    return report


def _recompute(run, stepper, traj: Trajectory, i: int, nv: int, na: int):
    """The training side's pass i from the recorded latents entering it: a forward with autograd enabled, then its
    own scheduler step; its drift against the rollout's velocities and latents."""
    video, audio = _entering(traj, i)
    with torch.enable_grad():
        v_video, v_audio = run.forward(run.model, run.inputs, video, audio, i)
    v_video, v_audio = v_video.detach(), v_audio.detach()
    with torch.no_grad():
        x_video = stepper.step("video", i, video[:, nv:], v_video[:, nv:].float())
        x_audio = stepper.step("audio", i, audio[:, na:], v_audio[:, na:].float())
        x_video = torch.cat([video[:, :nv], x_video], 1)  # conditioning rows are never stepped
        x_audio = torch.cat([audio[:, :na], x_audio], 1)
    vel = {"video": _drift(traj.kept[f"velocity_video.{i:04d}"], v_video),
           "audio": _drift(traj.kept[f"velocity_audio.{i:04d}"], v_audio)}
    lat = {"video": _drift(traj.kept[f"video.{i:04d}"], x_video),
           "audio": _drift(traj.kept[f"audio.{i:04d}"], x_audio)}
    return vel, lat


def _localise(train: Side, roll: Side, traj: Trajectory, i: int) -> dict | None:
    """The first differing operator of one forward of each side at pass i, from the recorded entering latents: the
    rollout side without grad, the training side with autograd enabled. The P side (when there is one) is the
    reference arm, so the strict forward runs once."""
    video, audio = _entering(traj, i)
    inputs = traj.inputs.replace(video=video, audio=audio)
    ra = Execution(roll.spec(inputs, traj.schedule), roll.model, scope="forward", forward_pass=i,
                   label=f"rollout {roll.name}")
    tb = Execution(train.spec(inputs, traj.schedule), train.model, scope="forward", forward_pass=i, grad=True,
                   backward=False, label=f"training {train.name}")
    a, b = (tb, ra) if train.name == "P" and roll.name != "P" else (ra, tb)
    report = compare(a, b)
    return report.first.to_dict() if report.first is not None else None


def run_arms(
    model: Any,
    inputs: DenoiseInputs,
    schedule: DualSchedule,
    p_model: Any | None = None,
    arms: tuple[str, ...] = ARMS,
    r_trajectory: Trajectory | None = None,
) -> dict[str, ArmReport]:
    """Every arm in `arms` over the same sealed inputs and schedule; each rollout runs once and is shared by the arms
    that use it. `r_trajectory`: a strict rollout of `model` already recorded (e.g. the ablation bench's)."""
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ArmError(f"arms {bad}: each must be one of {', '.join(ARMS)}")
    sd = sides(model, p_model)
    rollouts: dict[str, Trajectory] = {}
    if r_trajectory is not None:
        if r_trajectory.mode != "strict":
            raise ArmError(f"r_trajectory was recorded in mode {r_trajectory.mode!r}: the R rollout is strict")
        rollouts["R"] = r_trajectory
    out = {}
    for arm in arms:
        train, roll = arm.split("/")
        if roll not in rollouts:
            t0 = time.perf_counter()
            rollouts[roll] = rollout(sd[roll], inputs, schedule)
            rollouts[roll].manifest["meta"]["seconds"] = round(time.perf_counter() - t0, 3)
        out[arm] = run_arm(sd[train], sd[roll], inputs, schedule, trajectory=rollouts[roll])
    return out
