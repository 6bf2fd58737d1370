"""What a sealed stochastic pass holds, read back for the training side of the importance ratio.

`recorded_transition(trajectory, pass_index, item, modality) -> PassTransition`: the pass's record for one batch item
(kind, level, sigmas, std, the rollout's float32 logp mean and sum, the request id) and the generated rows entering
and leaving the pass, (1, N, C) float32 on the trajectory inputs' device, from the kept latents (the trajectory must
be recorded with `keep=("latents", ...)`). `PassTransition.logprob(v)` recomputes (logp_mean, logp_sum, mean, std)
from a velocity `v` of the generated rows (training's forward) with `transitions.transition_logprob`: on-policy and
byte-equal inputs, its logp equals the recorded one byte for byte.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from .transitions import MODALITIES, TransitionError, transition_logprob


@dataclass(frozen=True)
class PassTransition:
    """One stochastic pass of one request and modality, as sealed (module docstring)."""

    kind: str
    level: float
    sigma: float
    sigma_next: float
    std: float
    request: int
    logp_mean: float
    logp_sum: float
    x: torch.Tensor  # (1, N, C) generated rows entering the pass
    x_next: torch.Tensor  # (1, N, C) generated rows after it
    num_condition_rows: int

    def logprob(self, v: torch.Tensor):
        """(logp_mean, logp_sum, mean, std) of the recorded transition under velocity `v` ((1, N, C))."""
        return transition_logprob(self.kind, self.level, self.x, v, self.x_next, self.sigma, self.sigma_next)


def recorded_transition(trajectory: Any, pass_index: int, item: int, modality: str) -> PassTransition:
    """The sealed stochastic pass `pass_index` of batch item `item`, modality `modality` (module docstring)."""
    if modality not in MODALITIES:
        raise TransitionError(f"modality={modality!r}: must be one of {', '.join(MODALITIES)}")
    steps, inputs = trajectory.steps, trajectory.inputs
    for name, value, bound in (("pass_index", pass_index, len(steps)), ("item", item, inputs.batch_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < bound:
            raise TransitionError(f"{name}={value!r}: must be an integer in [0, {bound})")
    record = steps[pass_index].get("transition")
    if record is None or not record[modality]["sde"]:
        raise TransitionError(f"pass {pass_index} {modality}: not a stochastic transition (an Euler pass has no "
                              "log-density)")
    entry = record[modality]
    keys = [f"{modality}.{k:04d}" for k in (pass_index - 1, pass_index) if k >= 0]
    missing = [k for k in keys if k not in trajectory.kept]
    if missing:
        raise TransitionError(f"trajectory lacks kept latents {missing}: record it with keep=('latents', ...)")
    c = inputs.num_condition_video_rows if modality == "video" else inputs.num_condition_audio_rows
    b = slice(item, item + 1)
    device = getattr(inputs, modality).device
    entering = getattr(inputs, modality) if pass_index == 0 else trajectory.kept[keys[0]]
    leaving = trajectory.kept[keys[-1]]
    request = entry["requests"][item]
    return PassTransition(
        kind=record["kind"], level=entry["level"], sigma=entry["sigma"], sigma_next=entry["sigma_next"],
        std=entry["std"], request=request["request"], logp_mean=request["logp_mean"],
        logp_sum=request["logp_sum"], x=entering[b, c:].to(device).float(), x_next=leaving[b, c:].to(device).float(),
        num_condition_rows=c)
