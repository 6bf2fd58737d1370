"""The MiniMax-H3 sampler: two rectified-flow Euler schedules (video, audio), the conditioning noise mix, the
request's noise draws, and the low-budget whole-denoiser `reuse` option. Small pure functions over tensors with
explicit generators; nothing here holds a model.

Contract (bit-equal to Diffusers' `MiniMaxH3Scheduler` and the modular pipeline, torch CPU, every dtype below):

- Grid. `sigma_schedule(num_points, shift)`: `base = linspace(1, 0, num_points)` in float32, `sigma = shift*base /
  (1 + (shift-1)*base)` in float32, consecutive float32 duplicates collapsed, the terminal 0 included. `num_points`
  counts grid points, so a grid drives `len(sigmas) - 1` model evaluations ("passes"). This is Diffusers'
  `set_timesteps(num_points)`, whose argument is misleadingly called `num_inference_steps` and gives N - 1 passes.
  The user-facing `--steps N` follows the seed README instead: N denoising passes, `passes_to_points(N) = N + 1`.
- Timesteps. `t = 1 - sigma[:-1]` in float32, t = 1 clean. No pass is evaluated at the terminal sigma 0.
- Euler step (`euler_step`), eta = 0, data-ward velocity:
    x0     = x_t + (1 - t) * v          in the dtype torch promotes (sample dtype, t cast to it) and v to;
    r      = sigma_next / sigma         from the *grid*, in float32 (float64 for float64 samples);
    x_next = r * x_t + (1 - r) * x0     in float32 for half samples, cast back to the sample dtype once, at the end.
  x0 uses the sigma recovered from the timestep the model saw, the ratio uses the grid: `1 - (1 - sigma)` is not
  exact in float32 for sigma < 0.5, and the reference keeps the two sources apart, so this does too.
- Two schedules per request: video on shift 12 (`VIDEO_SHIFT`), audio on shift 3 (`AUDIO_SHIFT`), same number of
  points, never sharing a step index implicitly (`DualSchedule`, which also carries SHA-256 of the sigma bytes).
- Conditioning noise mix (`noise_mix`): `x = t*x0 + (1-t)*noise` with t cast to x0's dtype (`scale_noise`); visual
  conditions are held at `CONDITION_T = 0.999`; reference soundtracks are not noised.
- Noise draws (`draw_noise`, `draw_generation_noise`): float32 `torch.randn` on the generator's device, moved after.
  Order on the request's one generator: one draw per visual condition in packed order (its latent shape
  (1, C, F, h, w)), then the target video noise as a latent tensor (1, C, F, H, W), then the target audio noise
  directly in row layout (2A, C_audio).

Whole-denoiser reuse (seed README, `--reuse k`): `reuse_plan(num_passes, k)` evaluates the model on the first pass,
the last pass and every pass whose index is a multiple of k (20 passes: k=1 -> 20, k=2 -> 11, k=3 -> 8
evaluations, the README's numbers). A skipped pass gets `extrapolate_velocity(...)`, per modality on that
modality's own sigma grid: by default linear in sigma through the last two evaluated velocities,

    v(sigma) = v_b + w * (v_b - v_a),   w = (sigma - sigma_b) / (sigma_b - sigma_a)

(a = the older, b = the newer evaluation; w from the float32 grid values in float64, rounded once to float32; the
blend in float32, cast back to v_b's dtype), and a zero-order hold (`v = v_b`) when only one evaluation exists or
`mode="hold"` is asked for. The loop is then

    plan = reuse_plan(schedule.num_passes, k)
    for i in range(schedule.num_passes):
        if plan[i]:
            v_video, v_audio = model(...)                      # record (sigma_i, v) per modality
        else:
            v_video = extrapolate_velocity(schedule.video.sigmas[i], video_history)
            v_audio = extrapolate_velocity(schedule.audio.sigmas[i], audio_history)
        x_video = schedule.video.step(i, x_video, v_video); x_audio = schedule.audio.step(i, x_audio, v_audio)

where a history is the list of the `(sigma, velocity)` pairs of the evaluated passes, oldest first.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ValidationError

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
# The t visual conditioning is noised to and held at (Diffusers' `keyframe_noise_aug`).
CONDITION_T = 0.999
REUSE_MODES = ("linear", "hold")


class ScheduleError(ValidationError):
    """A sampler setting breaks a rule (grid size, shift, step index, reuse interval); names value and rule."""


# ------------------------------------------------------------------------------------------------ validation
def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ScheduleError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)


def _check_shift(shift) -> float:
    if isinstance(shift, bool) or not isinstance(shift, numbers.Real) or not math.isfinite(shift) or shift <= 0:
        raise ScheduleError(f"shift={shift!r}: must be a finite number > 0")
    return float(shift)


# ----------------------------------------------------------------------------------------------- the grid
def sigma_schedule(num_points: int, shift: float) -> torch.Tensor:
    """The float32 sigma grid (num_points,) or shorter: shifted linspace(1, 0), consecutive duplicates collapsed,
    terminal 0 included; `num_points - 1` passes unless duplicates collapsed. Always built on the CPU."""
    num_points = _check_int("num_points", num_points, 2)
    shift = _check_shift(shift)
    base = torch.linspace(1.0, 0.0, num_points, dtype=torch.float32)
    # sigma' = s*sigma / (1 + (s-1)*sigma), every op in float32 (s and s-1 are python floats, rounded by torch).
    shifted = shift * base / (1 + (shift - 1) * base)
    # A huge shift can map neighbouring grid points onto one float32 value; those collapse (0 stays terminal).
    sigmas = torch.unique_consecutive(shifted)
    # An absurd shift (~1e5 and up) also makes float32 rounding non-monotone (1, 0.99999994, 1, ...). Diffusers
    # builds that grid silently and its step() then finds the wrong index for a repeated t; fail closed instead.
    if not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ScheduleError(
            f"shift={shift}, num_points={num_points}: float32 rounding makes the shifted grid not strictly decreasing; "
            "use a smaller shift"
        )
    return sigmas


def timesteps(sigmas: torch.Tensor) -> torch.Tensor:
    """(len(sigmas) - 1,) timesteps `t = 1 - sigma` in the sigmas' dtype; the terminal sigma has no pass."""
    if sigmas.ndim != 1 or sigmas.numel() < 2:
        raise ScheduleError(f"sigmas of shape {tuple(sigmas.shape)}: must be a 1-D grid of at least 2 points")
    return 1.0 - sigmas[:-1]


def passes_to_points(steps: int) -> int:
    """User-facing `--steps N` (N denoising passes, seed README) -> grid points N + 1, terminal 0 included.
    Diffusers' `num_inference_steps=N` is N points, i.e. N - 1 passes."""
    return _check_int("steps", steps, 1) + 1


# -------------------------------------------------------------------------------------------- the update
def euler_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    t: float | torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
) -> torch.Tensor:
    """One data-ward Euler step (eta = 0); returns x_next in `sample`'s dtype and device.

    sample: x_t, any shape. velocity: v at t, broadcastable to sample (the pipeline passes float32 head outputs).
    t: the timestep the model was conditioned on (a float32 schedule entry); cast to sample's dtype first, so a
    bfloat16 sample sees a bfloat16 t. sigma, sigma_next: grid values sigmas[i], sigmas[i+1] (python floats are
    taken as float32 grid values)."""
    # x0 = x_t + (1 - t) * v: (1 - t) in the sample dtype, shaped like sample so it promotes as a tensor.
    t = torch.as_tensor(t, dtype=sample.dtype) if not isinstance(t, torch.Tensor) else t
    sigma_t = 1 - t.to(device=sample.device, dtype=sample.dtype)
    sigma_t = sigma_t.reshape(sigma_t.shape + (1,) * (sample.ndim - sigma_t.ndim))
    x0 = sample + sigma_t * velocity
    # The blend runs in float32 for half samples (float64 stays float64): r from the grid, not from t.
    compute = torch.float32 if sample.dtype in (torch.float16, torch.bfloat16) else sample.dtype
    sigma = _grid_value(sigma).to(device=sample.device, dtype=compute)
    sigma_next = _grid_value(sigma_next).to(device=sample.device, dtype=compute)
    r = sigma_next / sigma
    x_next = r * sample.to(compute) + (1.0 - r) * x0.to(compute)
    return x_next.to(sample.dtype)


def _grid_value(value: float | torch.Tensor) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32)


def noise_mix(x0: torch.Tensor, noise: torch.Tensor, t: float | torch.Tensor) -> torch.Tensor:
    """Rectified-flow forward process `t*x0 + (1-t)*noise` (Diffusers' `scale_noise`), t cast to x0's dtype and
    shaped like x0; t = 1 returns x0. Visual conditions use t = `CONDITION_T`."""
    t = torch.as_tensor(t, dtype=x0.dtype) if not isinstance(t, torch.Tensor) else t
    t = t.to(device=x0.device, dtype=x0.dtype)
    t = t.reshape(t.shape + (1,) * (x0.ndim - t.ndim))
    return t * x0 + (1.0 - t) * noise


# ---------------------------------------------------------------------------------------------- noise draws
def draw_noise(shape: Sequence[int], generator: torch.Generator, device: torch.device | str | None = None):
    """float32 standard normal of `shape` drawn on the generator's device, then moved to `device` (default: the
    generator's). A CPU generator therefore gives the same bytes whatever device the run uses."""
    if not isinstance(generator, torch.Generator):
        raise ScheduleError(f"generator={generator!r}: must be an explicit torch.Generator")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ScheduleError(f"shape={shape}: sizes must be >= 0")
    noise = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32)
    return noise if device is None else noise.to(device)


@dataclass(frozen=True)
class GenerationNoise:
    """Every draw of one request, in draw order: conditions (one per visual condition, packed order), the target
    video latent noise (1, C, F, H, W), the target audio noise in row layout (2A, C_audio). All float32."""

    conditions: tuple[torch.Tensor, ...]
    video: torch.Tensor
    audio: torch.Tensor


def draw_generation_noise(
    generator: torch.Generator,
    condition_shapes: Sequence[Sequence[int]],
    video_shape: Sequence[int],
    audio_shape: Sequence[int],
    device: torch.device | str | None = None,
) -> GenerationNoise:
    """The request's draws in the pipeline's order from one generator (see the module docstring). condition_shapes:
    the latent shape (1, C, F, h, w) of every keyframe / image / video reference in packed order; video_shape:
    (1, C, F, H, W); audio_shape: (2 * num_audio_latents, C_audio)."""
    conditions = tuple(draw_noise(shape, generator, device) for shape in condition_shapes)
    video = draw_noise(video_shape, generator, device)
    audio = draw_noise(audio_shape, generator, device)
    return GenerationNoise(conditions, video, audio)


# ------------------------------------------------------------------------------------------------ schedules
def _sha256(t: torch.Tensor) -> str:
    # Little-endian bytes of the contiguous CPU tensor (dtype fixed by the caller: float32 sigmas).
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


@dataclass(frozen=True, eq=False)
class Schedule:
    """One modality's grid: `sigmas` (P,) float32 CPU, `timesteps` (P - 1,) float32, `num_passes = P - 1`.
    `num_points` is the requested grid size; P < num_points only when float32 duplicates collapsed."""

    shift: float
    num_points: int
    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @classmethod
    def build(cls, num_points: int, shift: float) -> "Schedule":
        sigmas = sigma_schedule(num_points, shift)
        return cls(float(shift), int(num_points), sigmas, timesteps(sigmas))

    @property
    def num_passes(self) -> int:
        return self.timesteps.numel()

    @property
    def sha256(self) -> str:
        """SHA-256 of the float32 sigma bytes (little-endian), the grid's identity in sealed artifacts."""
        return _sha256(self.sigmas)

    def step(self, i: int, sample: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        """Pass i: `euler_step(sample, velocity, timesteps[i], sigmas[i], sigmas[i+1])`."""
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < self.num_passes:
            raise ScheduleError(f"step index {i!r}: must be an integer in [0, {self.num_passes})")
        i = int(i)
        return euler_step(sample, velocity, self.timesteps[i], self.sigmas[i], self.sigmas[i + 1])

    def to_dict(self) -> dict:
        return {
            "shift": self.shift,
            "num_points": self.num_points,
            "sigmas": [float(s) for s in self.sigmas],
            "sha256": self.sha256,
        }

    def __eq__(self, other) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (self.shift, self.num_points) == (other.shift, other.num_points) and torch.equal(
            self.sigmas, other.sigmas
        )

    def __hash__(self) -> int:
        return hash(self.sha256)


@dataclass(frozen=True, eq=False)
class DualSchedule:
    """The two grids of one request, built from the same number of points on separate shifts. Video and audio
    step on their own `Schedule`; pass i of the loop is `video.step(i, ...)` and `audio.step(i, ...)`."""

    video: Schedule
    audio: Schedule

    def __post_init__(self) -> None:
        # Diffusers zips the two timestep lists, which would silently truncate one of them; refuse instead. Only an
        # extreme shift collapses float32 points (none for shifts 0.5..1000 with up to 3000 points; 1e4 at 1000).
        if self.video.num_passes != self.audio.num_passes:
            raise ScheduleError(
                f"video grid has {self.video.num_passes} passes but audio grid has {self.audio.num_passes} "
                f"(shifts {self.video.shift}, {self.audio.shift}): the two schedules must pass together"
            )

    @classmethod
    def build(cls, num_points: int, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT):
        """Diffusers' `set_timesteps(num_points)` on both schedulers."""
        return cls(Schedule.build(num_points, video_shift), Schedule.build(num_points, audio_shift))

    @classmethod
    def from_passes(cls, steps: int, video_shift: float = VIDEO_SHIFT, audio_shift: float = AUDIO_SHIFT):
        """The user-facing `--steps N`: exactly N passes (N + 1 points)."""
        return cls.build(passes_to_points(steps), video_shift, audio_shift)

    @property
    def num_points(self) -> int:
        return self.video.num_points

    @property
    def num_passes(self) -> int:
        return self.video.num_passes

    @property
    def video_sha256(self) -> str:
        return self.video.sha256

    @property
    def audio_sha256(self) -> str:
        return self.audio.sha256

    def to_dict(self) -> dict:
        """Manifest form: both grids with their float32 values (exact as python floats) and hashes."""
        return {"num_points": self.num_points, "video": self.video.to_dict(), "audio": self.audio.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> "DualSchedule":
        """Rebuild from `to_dict()`; the rebuilt grids must reproduce the recorded hashes (else `ScheduleError`)."""
        out = cls.build(int(data["num_points"]), data["video"]["shift"], data["audio"]["shift"])
        for name in ("video", "audio"):
            if getattr(out, name).sha256 != data[name]["sha256"]:
                raise ScheduleError(
                    f"{name} sigma grid sha256 {data[name]['sha256']}: this build gives {getattr(out, name).sha256}"
                )
        return out

    def __eq__(self, other) -> bool:
        if not isinstance(other, DualSchedule):
            return NotImplemented
        return self.video == other.video and self.audio == other.audio

    def __hash__(self) -> int:
        return hash((self.video_sha256, self.audio_sha256))


# --------------------------------------------------------------------------------------- whole-denoiser reuse
def reuse_plan(num_passes: int, k: int) -> tuple[bool, ...]:
    """Which passes run the model: pass i is evaluated iff i % k == 0 or i is the last pass. k = 1: all."""
    num_passes, k = _check_int("num_passes", num_passes, 1), _check_int("reuse", k, 1)
    return tuple(i % k == 0 or i == num_passes - 1 for i in range(num_passes))


def extrapolate_velocity(
    sigma: float | torch.Tensor,
    history: Sequence[tuple[float | torch.Tensor, torch.Tensor]],
    mode: str = "linear",
) -> torch.Tensor:
    """Velocity for a skipped pass at grid value `sigma`, from `history`: the (sigma_i, v_i) of the evaluated
    passes of *this modality*, oldest first (only the last two are read).

    mode "linear": v_b + w*(v_b - v_a), w = (sigma - sigma_b)/(sigma_b - sigma_a) computed in float64 from the
    grid values and rounded once to float32, the blend in float32, cast back to v_b's dtype. With one evaluation,
    or mode "hold": v_b itself (zero-order hold)."""
    if mode not in REUSE_MODES:
        raise ScheduleError(f"reuse mode {mode!r}: must be one of {REUSE_MODES}")
    if len(history) == 0:
        raise ScheduleError("velocity history is empty: the first pass must evaluate the model")
    sigma_b, v_b = history[-1]
    if mode == "hold" or len(history) == 1:
        return v_b
    sigma_a, v_a = history[-2]
    s, s_a, s_b = float(sigma), float(sigma_a), float(sigma_b)
    if not s_a > s_b > s:
        raise ScheduleError(f"sigmas {s_a}, {s_b} -> {s}: extrapolation needs a strictly decreasing history")
    w = torch.tensor((s - s_b) / (s_b - s_a), dtype=torch.float32, device=v_b.device)
    v_b32 = v_b.to(torch.float32)
    return (v_b32 + w * (v_b32 - v_a.to(torch.float32))).to(v_b.dtype)
