"""The H3 flow-matching objective in the released sampler's conventions, and the requests it is computed over.

Conventions (taken from `h3lab.run.sampler`, RFC section 1): the model predicts the *data-ward* velocity v, and
`x0 = x_t + sigma * v`; the model is conditioned on `t = 1 - sigma` (t = 1 clean); the forward process is the
sampler's `noise_mix`, `x_t = t * x0 + (1 - t) * noise`; video and audio carry separate sigmas, each drawn on its
own schedule's shift. Regressing v onto `x0 - noise` is therefore exactly the sampler's relation read backwards:
`(x0 - x_t) / sigma = x0 - noise`.

One request, one `TrainingSample` (batch 1; the step never stacks requests, see `step.py`). Two kinds of request:

- `ClipRequest` (fine-tuning on encoded clips): clean latent rows x0 of a `PackedLayout` (video (1, Nv, C) in
  `video_indices` order, conditioning rows first; audio (1, Na, C_audio), reference rows first), text embeddings and
  a `seed`. Draws, in this order, from one CPU `torch.Generator` seeded with `seed` (so the bytes do not depend on
  the device, the batch or the request's position in it):
    u      = torch.rand(2) float32, [video, audio]
    sigma  = shift * u / (1 + (shift - 1) * u)   float32, the sampler's grid formula at a uniform u, i.e. the density
             the released sampler visits (video shift 12, audio shift 3 by default, `Objective` fields)
    t      = 1 - sigma                            float32 (the sampler's `timesteps`)
    noise  = `sampler.draw_noise` (1, Nv, C_video), then (1, Na, C_audio), float32, every row (reference audio rows
             draw noise too and do not use it, so the draw order does not depend on the layout)
  Inputs: target video rows `noise_mix(x0, noise, t_video)`, target audio rows `noise_mix(x0, noise, t_audio)`;
  conditioning video rows (anchors, image/video references) at their released `noise_mix(x0, noise, CONDITION_T)`
  (t = 0.999); reference audio rows clean. The row timesteps are the layout's released ones
  (`PackedLayout.row_timesteps(t_video, t_audio)`: conditioning video rows max(t_video, 0.999), reference audio 1).
  Target: `x0 - noise` on the target rows only.
- `RolloutRequest` (RL on a sealed trajectory): pass i of item b of a recorded trajectory (latents kept). Input: the
  recorded latents entering pass i, at the pass's recorded row-timestep plan; x0: the rollout's own final latents
  (after the last pass, where the sampler's x_next is its x0 prediction); sigma_i = 1 - t_i of the pass (float32,
  the sigma the sampler's `euler_step` recovers from t); target `(x0 - x_i) / sigma_i` (float32) on the generated
  rows — the fine-tuning target with the noise implied by the recorded latent. The request's `weight` carries the
  reward (or advantage): a reward-weighted regression toward the rollout's own samples. Transition log-probabilities
  stay absent: the released sampler is an eta = 0 ODE and defines none (RFC section 1); nothing here labels an ODE
  quantity a log-probability.

Loss of one request (`flow_matching_loss`), in the velocity's dtype (float32 heads; float64 for a float64 truth):
    mse_m = sum((v_m[target rows] - target_m)^2) / numel        per modality m; conditioning rows excluded
    loss  = weight * (video_weight * mse_video + audio_weight * mse_audio)
The per-modality weights are `Objective` fields (declared, sealed with a run). Its gradient with respect to the
velocity is elementwise (`2 * weight * w_m * (v - target) / numel` on target rows, exactly 0 on conditioning rows),
so no reduction order enters the backward seed; the loss value itself is one torch sum per modality (deterministic
for a given device and shape; recorded, never differentiated through its order).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import H3Error
from ..run.layout import PackedLayout
from ..run.sampler import AUDIO_SHIFT, CONDITION_T, VIDEO_SHIFT, draw_noise, noise_mix
from ..run.trajectory import Trajectory

MODALITIES = ("video", "audio")


class TrainingError(H3Error):
    """A training input or setting breaks a rule (request shapes, weights, seeds, trajectories, runs)."""


class SettingError(TrainingError):
    """One training setting breaks its rule. `owner` (the config that holds it, "" for none), `name` (its keyword
    there), `value` and `rule` are kept: the message is the Python spelling `Owner.name=value: rule`; a front end says
    the flag the user typed instead (`as_flag`)."""

    def __init__(self, owner: str, name: str, value: Any, rule: str):
        self.owner, self.name, self.value, self.rule = owner, name, value, rule
        super().__init__(f"{owner + '.' if owner else ''}{name}={value!r}: {rule}")

    def as_flag(self, flag: str) -> str:
        """The message naming `flag` (`--group 1: must be an integer >= 2`)."""
        return f"{flag} {self.value!r}: {self.rule}"


def checked_int(name: str, value, minimum: int) -> int:
    """`value` as an int when it is an integer (not a bool) >= `minimum`, else a one-line `SettingError` naming it
    (`name` may be "Owner.field")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        owner, _, field_name = name.rpartition(".")
        raise SettingError(owner, field_name, value, f"must be an integer >= {minimum}")
    return int(value)


def _finite(name: str, value, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TrainingError(f"{name}={value!r}: must be a finite number")
    if minimum is not None and value < minimum:
        raise TrainingError(f"{name}={value!r}: must be >= {minimum}")
    return float(value)


@dataclass(frozen=True)
class Objective:
    """The declared loss: per-modality weights and the shifts the clip sigmas are drawn on (module docstring)."""

    video_weight: float = 1.0
    audio_weight: float = 1.0
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT

    def __post_init__(self) -> None:
        for name in ("video_weight", "audio_weight"):
            object.__setattr__(self, name, _finite(f"Objective.{name}", getattr(self, name), 0.0))
        for name in ("video_shift", "audio_shift"):
            value = _finite(f"Objective.{name}", getattr(self, name))
            if value <= 0:
                raise TrainingError(f"Objective.{name}={value!r}: must be > 0")
            object.__setattr__(self, name, value)
        if self.video_weight == 0 and self.audio_weight == 0:
            raise SettingError("Objective", "video_weight", self.video_weight, "with an audio weight of 0 too: at least "
                               "one modality must be weighted")

    def to_dict(self) -> dict[str, float]:
        return {"video_weight": self.video_weight, "audio_weight": self.audio_weight,
                "video_shift": self.video_shift, "audio_shift": self.audio_shift}

    @classmethod
    def from_dict(cls, data: dict) -> "Objective":
        return cls(**{k: data[k] for k in ("video_weight", "audio_weight", "video_shift", "audio_shift")})


def shifted_sigma(u: torch.Tensor, shift: float) -> torch.Tensor:
    """`shift * u / (1 + (shift - 1) * u)` in u's dtype: the sampler's sigma-grid formula applied to u."""
    return shift * u / (1 + (shift - 1) * u)


# ================================================================================================= the sample
_LAYOUT_KEYS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")


@dataclass(frozen=True, eq=False)
class TrainingSample:
    """One request as the model sees it, batch 1: inputs text (1, Nt, D), video/audio rows x_t (1, N, C); the row
    timestep table `timestep` (T,) float32 and `timestep_indices` (S,); the layout tensors; `key_order` (None when
    canonical); regression targets on the generated rows only, (1, Nv - ncv, C) and (1, Na - nca, C_audio); the
    request's `weight`; the sigmas (0-d float32) for the record."""

    text: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    timestep: torch.Tensor
    timestep_indices: torch.Tensor
    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    target_video: torch.Tensor
    target_audio: torch.Tensor
    num_condition_video_rows: int
    num_condition_audio_rows: int
    weight: float = 1.0
    sigma_video: torch.Tensor | None = None
    sigma_audio: torch.Tensor | None = None
    key_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        _finite("request weight", self.weight)
        for name, rows, ncond in (("video", self.video, self.num_condition_video_rows),
                                  ("audio", self.audio, self.num_condition_audio_rows)):
            target = getattr(self, f"target_{name}")
            if rows.ndim != 3 or rows.shape[0] != 1:
                raise TrainingError(f"sample {name} rows of shape {tuple(rows.shape)}: must be (1, rows, channels)")
            want = (1, rows.shape[1] - ncond, rows.shape[2])
            if tuple(target.shape) != want or want[1] <= 0:
                raise TrainingError(
                    f"sample target_{name} of shape {tuple(target.shape)}: must be {want} (the generated rows after "
                    f"{ncond} conditioning rows, at least one)"
                )

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `H3Transformer.forward` (the Diffusers signature plus `key_order`)."""
        return {
            "hidden_states": self.video, "audio_hidden_states": self.audio, "encoder_hidden_states": self.text,
            "timestep": self.timestep, "timestep_indices": self.timestep_indices,
            **{k: getattr(self, k) for k in _LAYOUT_KEYS}, "key_order": self.key_order,
        }

    def canonical(self) -> "TrainingSample":
        """The same logical request with its packed rows in canonical order (`key_order` = None).

        Canonical row c sits at packed position `key_order[c]`: per-row tensors are gathered by `key_order` and the
        index tensors remapped through its inverse, which is `PackedLayout.permute(canonical_order())` done on the
        model's tensors. The streams (video, audio, text rows) keep their order, so inputs, targets and outputs are
        unchanged; only the reductions over packed rows (weight, norm and AdaLN-table gradients) change order — to
        the canonical one."""
        order = self.key_order
        if order is None:
            return self
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return _replace(
            self, key_order=None, position_ids=self.position_ids.index_select(0, order),
            token_tags=self.token_tags.index_select(0, order),
            timestep_indices=self.timestep_indices.index_select(0, order),
            video_indices=inv[self.video_indices], audio_indices=inv[self.audio_indices],
            text_indices=inv[self.text_indices],
        )

    def to(self, device: torch.device | str) -> "TrainingSample":
        return _replace(self, **{name: t.to(device) for name, t in self.tensors().items()})

    @classmethod
    def _tensor_names(cls) -> tuple[str, ...]:
        return ("text", "video", "audio", "timestep", "timestep_indices", *_LAYOUT_KEYS, "target_video",
                "target_audio", "sigma_video", "sigma_audio", "key_order")

    def tensors(self) -> dict[str, torch.Tensor]:
        """name -> tensor for sealing (absent optional tensors left out)."""
        return {n: getattr(self, n) for n in self._tensor_names() if getattr(self, n) is not None}

    def meta(self) -> dict[str, Any]:
        return {"num_condition_video_rows": self.num_condition_video_rows,
                "num_condition_audio_rows": self.num_condition_audio_rows, "weight": self.weight}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "TrainingSample":
        required = set(cls._tensor_names()) - {"sigma_video", "sigma_audio", "key_order"}
        missing = sorted(required - set(tensors))
        if missing:
            raise TrainingError(f"sealed sample lacks tensors {missing}")
        return cls(**{n: tensors.get(n) for n in cls._tensor_names()},
                   num_condition_video_rows=int(meta["num_condition_video_rows"]),
                   num_condition_audio_rows=int(meta["num_condition_audio_rows"]), weight=float(meta["weight"]))


def _replace(sample: TrainingSample, **changes: Any) -> TrainingSample:
    return dataclasses.replace(sample, **changes)


# ============================================================================================== the loss
def flow_matching_loss(objective: Objective, v_video: torch.Tensor, v_audio: torch.Tensor,
                       sample: TrainingSample) -> torch.Tensor:
    """0-d loss of one request in the velocity's dtype (module docstring); conditioning rows excluded."""
    mse = []
    for v, target, ncond in ((v_video, sample.target_video, sample.num_condition_video_rows),
                             (v_audio, sample.target_audio, sample.num_condition_audio_rows)):
        d = v[:, ncond:] - target.to(v.dtype)
        mse.append((d * d).sum() / d.numel())
    return sample.weight * (objective.video_weight * mse[0] + objective.audio_weight * mse[1])


# ============================================================================================= the requests
def _rows(name: str, x: Any, rows: int) -> torch.Tensor:
    """`x` as (1, rows, C) (an (rows, C) tensor is taken as batch 1); C is checked by the model against its config."""
    if not isinstance(x, torch.Tensor):
        raise TrainingError(f"request {name} is a {type(x).__name__}: must be a tensor")
    x = x[None] if x.ndim == 2 else x
    if x.ndim != 3 or x.shape[:2] != (1, rows):
        raise TrainingError(f"request {name} of shape {tuple(x.shape)}: must be (1, {rows}, channels) for this layout")
    if not x.is_floating_point() or not bool(torch.isfinite(x).all()):
        raise TrainingError(f"request {name} ({x.dtype}): must hold finite floating-point values")
    return x


def _seed(value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < 2**63:
        raise TrainingError(f"request seed={value!r}: must be an integer in [0, 2**63)")
    return int(value)


@dataclass(frozen=True, eq=False)
class ClipRequest:
    """One encoded clip for fine-tuning (module docstring): `layout`, clean rows `video` (1, Nv, C) float32
    (conditioning rows first), `audio` (1, Na, C_audio) float32 (reference rows first), `text` (1, Nt, text_dim),
    the `seed` of its draws, and its loss `weight`. (N, C) tensors are taken as batch 1."""

    layout: PackedLayout
    text: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    seed: int = 0
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.layout, PackedLayout) or not self.layout.is_consistent:
            raise TrainingError(f"request layout {self.layout!r}: must be a consistent PackedLayout")
        lay = self.layout
        for name, x in (("video", self.video), ("audio", self.audio)):
            if isinstance(x, torch.Tensor) and x.dtype != torch.float32:
                raise TrainingError(f"request {name} dtype {x.dtype}: clean latent rows must be float32")
        object.__setattr__(self, "video", _rows("video", self.video, lay.video_indices.numel()))
        object.__setattr__(self, "audio", _rows("audio", self.audio, lay.audio_indices.numel()))
        object.__setattr__(self, "text", _rows("text", self.text, lay.num_text_tokens))
        object.__setattr__(self, "seed", _seed(self.seed))
        object.__setattr__(self, "weight", _finite("request weight", self.weight))

    def with_seed(self, seed: int) -> "ClipRequest":
        return ClipRequest(self.layout, self.text, self.video, self.audio, seed, self.weight)

    def sample(self, objective: Objective) -> TrainingSample:
        """Draw sigmas and noise from `seed` and noise-mix (module docstring); CPU draws, moved to the rows' device."""
        lay, device = self.layout, self.video.device
        g = torch.Generator(device="cpu").manual_seed(self.seed)
        u = torch.rand(2, generator=g, dtype=torch.float32)
        sigma_video = shifted_sigma(u[0], objective.video_shift)
        sigma_audio = shifted_sigma(u[1], objective.audio_shift)
        t_video, t_audio = 1.0 - sigma_video, 1.0 - sigma_audio
        noise_video = draw_noise(self.video.shape, g, device)
        noise_audio = draw_noise(self.audio.shape, g, device)
        ncv, nca = lay.num_condition_video_rows, lay.num_condition_audio_rows
        x0v, x0a = self.video, self.audio
        video = torch.cat([noise_mix(x0v[:, :ncv], noise_video[:, :ncv], CONDITION_T),
                           noise_mix(x0v[:, ncv:], noise_video[:, ncv:], t_video.to(device))], dim=1)
        audio = torch.cat([x0a[:, :nca], noise_mix(x0a[:, nca:], noise_audio[:, nca:], t_audio.to(device))], dim=1)
        timestep, timestep_indices = lay.row_timesteps(float(t_video), float(t_audio))
        return TrainingSample(
            text=self.text, video=video, audio=audio, timestep=timestep.to(device),
            timestep_indices=timestep_indices.to(device), **lay.model_inputs(device),
            target_video=x0v[:, ncv:] - noise_video[:, ncv:], target_audio=x0a[:, nca:] - noise_audio[:, nca:],
            num_condition_video_rows=ncv, num_condition_audio_rows=nca, weight=self.weight,
            sigma_video=sigma_video, sigma_audio=sigma_audio,
            key_order=None if lay.key_order() is None else lay.key_order().to(device),
        )


@dataclass(frozen=True, eq=False)
class SampleRequest:
    """A request whose sample involves no draw (a recorded rollout pass, or a sealed sample read back): `sample()`
    returns it as it is, whatever the objective (whose modality weights still apply in the loss)."""

    fixed: TrainingSample
    origin: dict = field(default_factory=dict)

    @property
    def weight(self) -> float:
        return self.fixed.weight

    def with_seed(self, seed: int) -> "SampleRequest":
        return self  # nothing is drawn

    def sample(self, objective: Objective) -> TrainingSample:
        return self.fixed


def rollout_request(trajectory: Trajectory, pass_index: int, weight: float = 1.0, item: int = 0) -> SampleRequest:
    """Pass `pass_index` of batch item `item` of a recorded trajectory as a reward-weighted regression request
    (module docstring). The trajectory must keep its latents (`keep=("latents", ...)`) for every pass."""
    inputs, kept = trajectory.inputs, trajectory.kept
    n = inputs.num_passes
    if isinstance(pass_index, bool) or not isinstance(pass_index, numbers.Integral) or not 0 <= pass_index < n:
        raise TrainingError(f"pass_index={pass_index!r}: must be an integer in [0, {n})")
    if isinstance(item, bool) or not isinstance(item, numbers.Integral) or not 0 <= item < inputs.batch_size:
        raise TrainingError(f"item={item!r}: must be an integer in [0, {inputs.batch_size})")
    i, b = int(pass_index), slice(int(item), int(item) + 1)
    needed = [f"{m}.{k:04d}" for m in MODALITIES for k in sorted({i - 1, n - 1}) if k >= 0]
    missing = [k for k in needed if k not in kept]
    if missing:
        raise TrainingError(f"trajectory lacks kept latents {missing}: record it with keep=('latents', ...)")
    device = inputs.video.device
    schedule = trajectory.schedule
    entering = {m: (getattr(inputs, m) if i == 0 else kept[f"{m}.{i - 1:04d}"])[b].to(device) for m in MODALITIES}
    final = {m: kept[f"{m}.{n - 1:04d}"][b].to(device) for m in MODALITIES}
    ncond = {"video": inputs.num_condition_video_rows, "audio": inputs.num_condition_audio_rows}
    sigma, target = {}, {}
    for m in MODALITIES:
        sigma[m] = 1 - getattr(schedule, m).timesteps[i]  # float32: the sigma euler_step recovers from t
        x, x0, c = entering[m].float(), final[m].float(), ncond[m]
        target[m] = (x0[:, c:] - x[:, c:]) / sigma[m].to(device)
    timestep, timestep_indices = inputs.plan[i]
    fixed = TrainingSample(
        text=inputs.text[b], video=entering["video"], audio=entering["audio"], timestep=timestep,
        timestep_indices=timestep_indices, **inputs.layout_kwargs(), target_video=target["video"],
        target_audio=target["audio"], num_condition_video_rows=ncond["video"], num_condition_audio_rows=ncond["audio"],
        weight=_finite("request weight", weight), sigma_video=sigma["video"], sigma_audio=sigma["audio"],
        key_order=inputs.key_order,
    )
    return SampleRequest(fixed, {"kind": "rollout", "trajectory": trajectory.digest, "pass": i, "item": int(item)})


def rollout_requests(trajectory: Trajectory, weight: float = 1.0, item: int = 0,
                     passes: list[int] | None = None) -> list[SampleRequest]:
    """Every pass (or `passes`) of one trajectory item as requests of one reward `weight`, in pass order."""
    indices = range(trajectory.inputs.num_passes) if passes is None else passes
    return [rollout_request(trajectory, i, weight, item) for i in indices]
