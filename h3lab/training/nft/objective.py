"""DiffusionNFT's pieces as pure functions over tensors, and `NftConfig`, every knob of a run.

Contract (DiffusionNFT, arXiv 2509.16117, as verl-omni implements it; `docs/reference/diffusion_nft.md`), in H3's
convention (`training/objective.py`: data-ward v, x0 = x_t + sigma * v, x_t = (1 - sigma) * x0 + sigma * noise, so
the flow-matching target of a clean sample noised with `noise` is `x0 - noise`, exactly the supervised target)
--------
- Optimality (`optimality`): the group advantages A (`grpo.group_advantages`, float64, not clipped there) map to
  r = clamp(A / adv_clip, -1, 1) / 2 + 0.5 in [0, 1] (float64): 1 for the best of a group, 0 for the worst, 0.5 for
  a group of equal rewards.
- Loss of one noised sample (`nft_modality_loss`, per modality m, generated rows only, in the velocity's dtype;
  float32 heads): with v_theta the trained policy's velocity (grad), v_old the previous policy's (detached),
      v+ = beta * v_theta + (1 - beta) * v_old          the implicit positive policy
      v- = (1 + beta) * v_old - beta * v_theta          the implicit negative policy
      L_m = r * mse(v+, target) + (1 - r) * mse(v-, target),    mse(a, b) = sum((a - b)^2) / numel
  and, with ref_kl > 0, KL_m = mse(v_theta, v_ref) (v_ref the adapter-off velocity, detached). The sample's loss is
  sum_m weight_m * (L_m + ref_kl * KL_m), weight_m the `Objective`'s video / audio weights (as the supervised loss
  weighs them). At v_theta = v_old its gradient in v_theta is 2 beta (2r - 1) (v_old - target) / numel: toward the
  target for an above-average sample, away from it for a below-average one.
- Noising draws (`noising_seed`): a CPU generator per (run seed, iteration, prompt, draw) seeded with 63 bits of
  SHA-256 of `h3lab-nft-noising|seed|iteration|prompt|draw`; from it, in this order: u = rand(2) float32
  ([video, audio]) -> sigma_m = shift_m * u_m / (1 + (shift_m - 1) * u_m) (`objective.shifted_sigma`, the
  supervised objective's draw, shifts from the `Objective`), then for each member g = 0..G-1 of the prompt's group
  noise_video (1, Nv, C) then noise_audio (1, Na, C_audio) (`sampler.draw_noise`, every row, as the supervised
  draw). The group shares the sigmas (so its members can share one forward for v_old) and each member has its own
  noise.
- `NftConfig`: the rollout stepper `kind` ("euler", the released deterministic ODE step, or an SDE kind of
  `stochastic.SDE_KINDS` with its `level`; NFT never needs a log-density), the `group` G, `beta`, `adv_eps`,
  `adv_clip`, `ref_kl`, `draws` (noisings per request per iteration), `inner_epochs` (optimiser steps per
  iteration), `old_batch` ("group": one no-grad forward per (prompt, draw) over the G members; "request": one per
  member -- byte-equal in strict, the batch invariance contract), the run `seed`, the runtime `mode`,
  `gradient_checkpointing`, AdamW's hyper-parameters (`optim`, an `OptimizerConfig`) and the `objective`. No CFG:
  H3's sampler has none to turn off.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ...hashing import key_seed
from ...stochastic import SDE_KINDS
from ..grpo import ADVANTAGE_EPS
from ..grpo_step import check_training_knobs, config_of, config_record
from ..objective import Objective, SettingError, TrainingError, checked_int
from ..optim import StrictAdamW
from ..optim_config import OptimizerConfig

KINDS = ("euler", *SDE_KINDS)
OLD_BATCHES = ("group", "request")


def optimality(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """(R,) float64 r = clamp(A / adv_clip, -1, 1) / 2 + 0.5 (module docstring)."""
    a = torch.as_tensor(advantages).to(torch.float64)
    return torch.clamp(a / float(adv_clip), -1.0, 1.0) / 2 + 0.5


def _mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    d = a - b
    return (d * d).sum() / d.numel()


def nft_modality_loss(v_theta: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, r: float, beta: float,
                      v_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(L_m [+ KL_m term excluded], parts): L_m = r mse(v+, target) + (1 - r) mse(v-, target) on one modality's
    generated rows, in v_theta's dtype (module docstring); parts {positive, negative, kl} (detached; kl only with
    `v_ref`)."""
    v_old = v_old.to(v_theta.dtype).detach()
    target = target.to(v_theta.dtype)
    positive = _mse(beta * v_theta + (1 - beta) * v_old, target)
    negative = _mse((1 + beta) * v_old - beta * v_theta, target)
    loss = r * positive + (1 - r) * negative
    parts = {"positive": positive.detach(), "negative": negative.detach()}
    if v_ref is not None:
        parts["kl"] = _mse(v_theta, v_ref.to(v_theta.dtype).detach())
    return loss, parts


def noising_seed(seed: int, iteration: int, prompt: int, draw: int) -> int:
    """63 bits of SHA-256 of `h3lab-nft-noising|seed|iteration|prompt|draw` (module docstring)."""
    return key_seed(f"h3lab-nft-noising|{seed}|{iteration}|{prompt}|{draw}")


def _real(name: str, value, low: float, open_low: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or (
            value <= low if open_low else value < low):
        raise SettingError("NftConfig", name, value, f"must be a finite number {'>' if open_low else '>='} {low:g}")
    return float(value)


@dataclass(frozen=True)
class NftConfig:
    """Every DiffusionNFT knob (module docstring); defaults are verl-omni's H3 recipe where it has one."""

    kind: str = "euler"
    level: float | None = None
    group: int = 4
    beta: float = 1.0
    adv_eps: float = ADVANTAGE_EPS
    adv_clip: float = 5.0
    ref_kl: float = 1e-4
    draws: int = 1
    inner_epochs: int = 1
    old_batch: str = "group"
    seed: int = 0
    mode: str = "strict"
    gradient_checkpointing: bool = False
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    objective: Objective = field(default_factory=Objective)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise SettingError("NftConfig", "kind", self.kind, f"must be one of {', '.join(KINDS)}")
        if self.kind == "euler":
            if self.level is not None:
                raise SettingError("NftConfig", "level", self.level, "the released ODE step (kind 'euler') has no noise "
                                   "level (leave it unset, or roll out with an SDE kind)")
        else:
            object.__setattr__(self, "level", _real("level", 0.7 if self.level is None else self.level, 0.0))
        object.__setattr__(self, "group", checked_int("NftConfig.group", self.group, 2))
        object.__setattr__(self, "beta", _real("beta", self.beta, 0.0))
        object.__setattr__(self, "adv_eps", _real("adv_eps", self.adv_eps, 0.0))
        object.__setattr__(self, "adv_clip", _real("adv_clip", self.adv_clip, 0.0))
        object.__setattr__(self, "ref_kl", _real("ref_kl", self.ref_kl, 0.0, open_low=False))
        object.__setattr__(self, "draws", checked_int("NftConfig.draws", self.draws, 1))
        object.__setattr__(self, "inner_epochs", checked_int("NftConfig.inner_epochs", self.inner_epochs, 1))
        if self.old_batch not in OLD_BATCHES:
            raise SettingError("NftConfig", "old_batch", self.old_batch, f"must be one of {', '.join(OLD_BATCHES)}")
        object.__setattr__(self, "seed", checked_int("NftConfig.seed", self.seed, 0))
        check_training_knobs(self, "DiffusionNFT")

    def optimizer(self, params: Sequence[tuple[str, nn.Parameter]]) -> StrictAdamW:
        return self.optim.build(params)

    def to_dict(self) -> dict[str, Any]:
        return config_record(self)

    @classmethod
    def from_dict(cls, data: dict) -> "NftConfig":
        return config_of(cls, data)
