"""The GRPO pieces as pure functions over tensors: group-relative advantages, the clipped surrogate, truncated
importance weights, the KL to the reference policy, and which passes train.

Contract (formulas from Flow-GRPO / DanceGRPO / MixGRPO, `docs/reference/rl_anchors.md`; nothing here holds a model)
--------
- Advantages (`group_advantages`): rewards (P * G,) in prompt-major order (entries p*G .. p*G + G - 1 are prompt
  p's G rollouts). Per group, in float64: mean m = sum(r) / G, population std s = sqrt(sum((r - m)^2) / G),
  A = (r - m) / (s + eps), eps declared (`ADVANTAGE_EPS` = 1e-4, Flow-GRPO's), then clamped to [-clip, clip] when
  `clip` is given (Flow-GRPO's 5). A group of identical rewards gives A = 0 exactly. G = 1 is refused (no group).
- Ratio and surrogate (`clipped_surrogate`): ratio = exp(logp_train - logp_old) elementwise (float32, the log-density
  dtype); per entry loss = max(-A * ratio, -A * clamp(ratio, 1 - eps_c, 1 + eps_c)) (PPO's pessimistic bound, eps_c
  the clip range, Flow-GRPO's 1e-4). `clipped` marks entries where the clamped branch is the larger one and differs
  from the unclamped (the gradient is zero there): the "clip engages" statistic.
- Truncated importance weights (`truncated_weight`, Yao et al.'s TIS for rollouts from another engine):
  w = min(exp(logp_old - logp_rollout), C), detached, where logp_old is the training engine's log-density at the
  rollout's weights (first inner epoch) and logp_rollout the engine's record; it multiplies the surrogate. With a
  strict rollout on the same engine logp_old == logp_rollout, so w = 1 exactly. C = None disables it.
- KL to the reference (`reference_kl`, Flow-GRPO's): per request (dim 0), mean over every other element of
  (mu_theta - mu_ref)^2 / (2 * std^2), float32; std is the transition's std (broadcast). Exactly 0 when the two
  means are equal (the adapter-off reference before any update, or a LoRA whose B factors are 0).
- Pass selection (`PassSelection`): which passes of a rollout train. "all": every SDE pass; "fraction" f
  (DanceGRPO's 0.6): per request its own seeded permutation of the SDE passes, the first max(1, floor(f * n)) of it,
  returned sorted (the CPU generator is seeded with `selection_seed(seed, iteration, request)`, 63 bits of SHA-256,
  so the choice depends on the run seed, the iteration and the request only); "window" (MixGRPO): the passes
  start .. start + size - 1, which must be SDE passes of the rollout. Only passes with a Gaussian transition (the SDE
  passes: `sde` below) can train; an ODE pass has no log-density.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

import torch

from ..hashing import key_seed
from .objective import TrainingError

ADVANTAGE_EPS = 1e-4
SELECTIONS = ("all", "fraction", "window")


def _real(name: str, value, low: float | None = None, high: float | None = None, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TrainingError(f"{name}={value!r}: must be a finite number")
    if low is not None and (value <= low if open_low else value < low):
        raise TrainingError(f"{name}={value!r}: must be {'>' if open_low else '>='} {low}")
    if high is not None and value > high:
        raise TrainingError(f"{name}={value!r}: must be <= {high}")
    return float(value)


def _int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise TrainingError(f"{name}={value!r}: must be an integer >= {minimum}")
    return int(value)


# ============================================================================================= advantages
def group_advantages(rewards: torch.Tensor, group: int, eps: float = ADVANTAGE_EPS,
                     clip: float | None = None) -> torch.Tensor:
    """(P * G,) float64 group-relative advantages (module docstring)."""
    group = _int("group", group, 2)
    eps = _real("advantage eps", eps, 0.0, open_low=True)
    r = torch.as_tensor(rewards).to(torch.float64)
    if r.ndim != 1 or r.numel() == 0 or r.numel() % group:
        raise TrainingError(f"rewards of shape {tuple(r.shape)}: must be (prompts * group,) with group={group}")
    if not bool(torch.isfinite(r).all()):
        raise TrainingError("rewards hold NaN or inf: every reward must be finite")
    g = r.reshape(-1, group)
    mean = g.sum(dim=1, keepdim=True) / group
    std = (((g - mean) ** 2).sum(dim=1, keepdim=True) / group).sqrt()
    a = ((g - mean) / (std + eps)).reshape(-1)
    if clip is not None:
        clip = _real("advantage clip", clip, 0.0, open_low=True)
        a = a.clamp(-clip, clip)
    return a


# ============================================================================================== surrogate
def ratio_of(logp_train: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """exp(logp_train - logp_old), elementwise in the log-densities' dtype."""
    return torch.exp(logp_train - logp_old)


def clipped_surrogate(ratio: torch.Tensor, advantage: torch.Tensor, clip_range: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-entry loss, clipped mask): max(-A r, -A clamp(r, 1 - eps, 1 + eps)) (module docstring)."""
    eps = _real("clip range", clip_range, 0.0, open_low=True)
    a = advantage.to(ratio.dtype)
    unclipped = -a * ratio
    clipped = -a * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()


def truncated_weight(logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float | None) -> torch.Tensor:
    """min(exp(logp_old - logp_rollout), cap), detached; ones when `cap` is None (module docstring)."""
    if cap is None:
        return torch.ones_like(logp_old).detach()
    cap = _real("importance cap", cap, 0.0, open_low=True)
    return torch.clamp(torch.exp(logp_old.detach() - logp_rollout.detach()), max=cap)


def reference_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """(B,) mean over non-batch elements of (mean - mean_ref)^2 / (2 std^2), float32 (module docstring)."""
    if mean.shape != mean_ref.shape or mean.ndim < 2:
        raise TrainingError(f"KL means of shapes {tuple(mean.shape)} and {tuple(mean_ref.shape)}: must be equal, "
                            "(batch, ...)")
    d = mean.to(torch.float32) - mean_ref.to(torch.float32)
    std = torch.as_tensor(std, dtype=torch.float32, device=d.device)
    return (d * d / (2 * std * std)).reshape(d.shape[0], -1).mean(dim=1)


# ========================================================================================= pass selection
def selection_seed(seed: int, iteration: int, request: int) -> int:
    """63 bits of SHA-256 of `h3lab-grpo-passes|seed|iteration|request`."""
    return key_seed(f"h3lab-grpo-passes|{seed}|{iteration}|{request}")


@dataclass(frozen=True)
class PassSelection:
    """Which SDE passes train (module docstring): `kind` all | fraction | window."""

    kind: str = "all"
    fraction: float = 0.6
    start: int = 0
    size: int = 4

    def __post_init__(self) -> None:
        if self.kind not in SELECTIONS:
            raise TrainingError(f"pass selection {self.kind!r}: must be one of {', '.join(SELECTIONS)}")
        object.__setattr__(self, "fraction", _real("pass fraction", self.fraction, 0.0, 1.0, open_low=True))
        object.__setattr__(self, "start", _int("window start", self.start, 0))
        object.__setattr__(self, "size", _int("window size", self.size, 1))

    def check_passes(self, sde: Sequence[bool]) -> list[int]:
        """The SDE passes of a rollout whose passes are SDE or not as `sde` says; a one-line `TrainingError` when
        there is none or the window reaches outside them (a job checks this before its first rollout)."""
        sde_passes = [i for i, s in enumerate(sde) if s]
        if not sde_passes:
            raise TrainingError("the rollout has no SDE pass: an ODE pass has no log-density to train on")
        if self.kind == "window":
            outside = [i for i in range(self.start, self.start + self.size) if i >= len(sde) or not sde[i]]
            if outside:
                raise TrainingError(f"window passes {outside}: not SDE passes of this rollout ({len(sde)} passes, "
                                    f"SDE at {sde_passes})")
        return sde_passes

    def select(self, sde: Sequence[bool], seed: int = 0, iteration: int = 0, request: int = 0) -> tuple[int, ...]:
        """Sorted pass indices that train, given per pass whether it is an SDE pass."""
        sde_passes = self.check_passes(sde)
        if self.kind == "all":
            return tuple(sde_passes)
        if self.kind == "window":
            return tuple(range(self.start, self.start + self.size))
        g = torch.Generator(device="cpu").manual_seed(selection_seed(seed, iteration, request))
        perm = torch.randperm(len(sde_passes), generator=g).tolist()
        take = max(1, math.floor(self.fraction * len(sde_passes)))
        return tuple(sorted(sde_passes[j] for j in perm[:take]))

    def to_dict(self) -> dict:
        return {"kind": self.kind, "fraction": self.fraction, "start": self.start, "size": self.size}

    @classmethod
    def from_dict(cls, data: dict) -> "PassSelection":
        return cls(data["kind"], data["fraction"], data["start"], data["size"])


def ratio_stats(ratios: Sequence[torch.Tensor]) -> dict:
    """min / max / mean of ratio - 1 (float64 of the float32 values), the count and how many are exactly 1."""
    flat = torch.cat([torch.as_tensor(r).reshape(-1) for r in ratios]) if ratios else torch.zeros(0)
    if flat.numel() == 0:
        return {"count": 0}
    d = flat.to(torch.float64) - 1.0
    return {"count": int(flat.numel()), "exactly_one": int((flat == 1).sum()), "min": float(d.min()),
            "max": float(d.max()), "mean": float(d.mean()), "max_abs": float(d.abs().max())}
