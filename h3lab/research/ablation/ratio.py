"""The rollout-vs-training ratio row of the ablation matrix: the on-policy importance ratio
exp(logp_train - logp_rollout) of RL on H3 (`h3lab.training.grpo_step`).

Contract
--------
The rollout is the bench request at batch position 1 of 3 (the other two independent random requests,
`probes._batched`), stepped by `flow_sde` (level 0.7, seed 11) and sealed with its kept latents; its per-pass
float32 log-density is the rollout's record. The training side replays the request alone (batch 1) at every SDE
pass from the sealed transition (`grpo_step.replay_ratios`, the training room's on-policy check) and recomputes the
log-density of the recorded next rows, per modality.

  strict  the ratio is 1.0 exactly at every pass and modality (batch invariance: the request's velocity is the same
          bytes alone and at position 1 of 3).
  off     with a planted batch-position change -- the video input projection of every batch item after the first
          computed in bfloat16, as a batch-variant GEMM would -- the ratio moves off 1.0 (|ratio - 1| > 0), and the
          first-drift localiser comparing the rollout's item 1 with the request alone (one forward at pass 0) names
          the planted op first (`video_proj_in`, pass 0; torch's own CPU batch variance, if any, shows later in
          canonical order, at `audio_proj_in`).

`check_ratio(bench, mode)` runs both (the strict promise and the planted negative control, so the row can fail) and
returns (status, observed, passed, None); the row's mode column is strict (its promise), the `mode` argument is not
used: the row always runs the strict promise and the planted `off` control.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...execution import runtime
from ..drift import RowMap, compare, pass_label
from ...run.trajectory import record
from ...training.grpo_step import RolloutBatch, replay_ratios, trajectory_transitions
from .bench import Bench
from .probes import _batched

POSITION, SIZE, SEED = 1, 3, 17
STEPPER, PARAMS = "flow_sde", {"level": 0.7, "seed": 11}
PLANTED = "video_proj_in"


def planted_overrides(model: Any) -> dict:
    """The planted batch-position change (module docstring): `linear` on the video input projection's weight rounds
    every batch item after the first through bfloat16; every other call is the mode's op."""
    weight = model.proj_in.weight

    def linear(x, w, bias=None):
        out = runtime.mode_op("linear")(x, w, bias)
        if w is not weight or x.dim() != 3 or x.shape[0] == 1:
            return out
        b = None if bias is None else bias.to(torch.bfloat16)
        late = F.linear(x[1:].to(torch.bfloat16), w.to(torch.bfloat16), b).to(out.dtype)
        return torch.cat([out[:1], late], dim=0)

    return {"linear": linear}


def ratios(bench: Bench, mode: str, overrides: dict | None = None) -> list[dict[str, Any]]:
    """Per SDE pass of the request at `POSITION`: {request, pass, video, audio} ratios (training alone vs the
    batched rollout) in `mode`, with `overrides` planted on both sides."""
    spec = bench.spec(mode).replace(inputs=_batched(bench, POSITION, SIZE, SEED), stepper=STEPPER,
                                    stepper_params=PARAMS)
    if overrides:
        spec = spec.with_custom(overrides=overrides)
    trajectory = record(spec, bench.model, keep=("latents",))
    request, passes, sde = trajectory_transitions(trajectory)[POSITION]
    batch = RolloutBatch([passes], [sde], torch.zeros(1, dtype=torch.float64), {"kind": STEPPER})
    with runtime.use_overrides(overrides or {}):
        return replay_ratios(bench.model, batch, mode)


def _deviation(rows: list[dict[str, Any]]) -> float:
    return max(abs(r[m] - 1.0) for r in rows for m in ("video", "audio") if m in r)


def planted_drift(bench: Bench):
    """The drift report of the request alone vs the rollout's item `POSITION` with the plant, one `off` forward at
    pass 0 (the bench's cached reference capture is the alone arm)."""
    ref = bench.reference("off", "forward")
    spec = ref.spec.replace(inputs=_batched(bench, POSITION, SIZE, SEED)).with_custom(
        overrides=planted_overrides(bench.model))
    probe = ref.replace(spec=spec, label=f"rollout item {POSITION} of {SIZE}, planted",
                        row_map=RowMap(batch_index=POSITION))
    return compare(ref, probe, reference=bench.reference_capture("off", "forward", 0))


def check_ratio(bench: Bench, mode: str):
    """The row's check (module docstring): (status, observed, passed, None); the numbers stay in
    `bench.cache[("ratio", "strict" | "planted_off" | "planted_first_drift")]`."""
    strict = ratios(bench, "strict")
    exact = bool(strict) and all(r[m] == 1.0 for r in strict for m in ("video", "audio") if m in r)
    planted = ratios(bench, "off", planted_overrides(bench.model))
    moved = _deviation(planted)
    first = planted_drift(bench).first
    named = first is not None and (first.point, first.step) == (PLANTED, 0)
    ok = exact and moved > 0 and named
    where = f"{first.point} ({pass_label(first.step)})" if first is not None else "nowhere (equal)"
    observed = (f"{'PASS' if exact else 'FAIL'}: strict ratio exp(logp_train - logp_rollout) "
                f"{'== 1.0 exactly' if exact else '!= 1.0'} at {len(strict)} SDE passes (rollout at batch position "
                f"{POSITION} of {SIZE}, training alone); off with a planted batch-position change: max |ratio - 1| = "
                f"{moved:.3g}, first drift at {where}")
    bench.cache[("ratio", "strict")] = strict
    bench.cache[("ratio", "planted_off")] = planted
    bench.cache[("ratio", "planted_first_drift")] = first.to_dict() if first is not None else None
    return ("PASS" if ok else "FAIL"), observed, ok, None
