"""Stochastic rollouts for RL: G requests per prompt on an SDE stepper, each pass's Gaussian log-density
sealed in the trajectories. `Session.rollout` is this module's `rollout(session, ...)` under the session lock.

Contract
--------
`rollout(session, prompts, group=4, stepper="flow_sde", level=0.7, seed=0, window=None, decode=False,
batched=True, keep=("latents",), needs_density=True, **overrides) -> Rollout`

- `prompts`: a non-empty list of non-blank prompts; `overrides`: generation settings shared by every request
  (width, height, frames, steps, mode, ...; a per-request `seed` is refused: the rollout derives them). `stepper`:
  one of `stochastic.SDE_KINDS`; `level` a number or {"video": x, "audio": y}; `window` null or
  {"start": s, "size": w} (MixGRPO). With `needs_density=False` (forward-process RL, DiffusionNFT, which needs no
  log-density) `stepper` may also be "euler", the released deterministic step: `level` and `window` are then unused
  and the members of a group differ by their initial noise only. Everything is validated before any model loads
  (one-line `H3Error`).
- Requests, in this fixed order: prompt p = 0..P-1, member g = 0..G-1, request id r = p * G + g. Request r's
  initial noise is the released draw (`pipeline.draw_inputs`) from the request seed

      request_seed(seed, r) = int.from_bytes(sha256(f"h3lab-rollout/1|{seed}|{r}").digest()[:8], "little")
                              & (2**63 - 1)

  and its per-pass SDE noise is `stochastic.pass_noise(seed, r, pass, modality)` (the stepper's parameters seal
  `seed` and the request ids). So members of a group differ only by r, and any request can be re-run alone.
- Per prompt the text and the conditions are encoded once; `batched=True` runs the G members as one batch
  (B = G, requests [pG, ..., pG + G - 1]) -- one `Trajectory` per prompt; `batched=False` runs each member alone --
  G trajectories of batch 1 per prompt. Latents are always kept (`keep` adds "velocities" / "noise"), so
  `h3lab.training.rollout_request(trajectory, pass, item=...)` can rebuild every pass.
- `Rollout.requests[k]` (k = r) names its prompt, member, request id, request seed, the trajectory holding it and
  its batch `item` there, its final video latents (C, T, h, w) and audio rows (2A, C) float32 CPU, and with
  `decode=True` its frames (uint8 (T, H, W, 3)) and waveform. `Rollout.trajectories` are in run order.
- Every spec records what ran: the base checkpoint's fingerprint and the adapter -- the session's, or the one injected
  in the model (a GRPO job's current policy) by the sha256 of its content at that moment
  (`prepared.prepare(..., policy_adapter=True)`, hashed once per prompt), so `trajectory.verify` of a rollout re-runs
  it on the model carrying that adapter and refuses another one.
- The steps a generation runs are shared, not repeated: every prompt's text, then every prompt's conditions
  (`phases.encode`); per prompt one `prepared.PreparedRequest` (schedule, DiT, layout, adapters), whose `draw` makes
  each member's inputs and `spec` the batch's `RunSpec` (the stepper and the request ids replaced); the denoise phase
  (`phases.denoise`, which also frees the blocks a thinned spec does not run); with `decode=True` every video, then
  every waveform (`phases.decode`). What is the rollout's own: the checks, the request seeds, the batching of a
  group's draws and the trajectory manifest's "rollout" entry.
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from . import phases, pipeline
from ..execution import runtime
from ..errors import ValidationError
from .prepared import prepare
from ..schema.generation_settings import check_prompt

ROLLOUT_SCHEME = "h3lab-rollout/1"
MAX_GROUP = 64


def request_seed(seed: int, request: int) -> int:
    """The initial-noise seed of request `request` of a rollout seeded `seed` (module docstring)."""
    key = f"{ROLLOUT_SCHEME}|{int(seed)}|{int(request)}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)


@dataclass
class RolloutRequest:
    """One request of a rollout (module docstring)."""

    prompt_index: int
    member: int
    request: int
    seed: int
    trajectory: Any  # the h3lab.run.trajectory.Trajectory holding it
    item: int  # its batch item in that trajectory
    latents: torch.Tensor
    audio_rows: torch.Tensor
    frames: np.ndarray | None = None
    audio: np.ndarray | None = None


@dataclass
class Rollout:
    """What `rollout` returns: the requests in request order, the trajectories in run order, the stepper and its
    sealed parameters (shared by every run but the request ids)."""

    prompts: list[str]
    group: int
    stepper: str
    params: dict[str, Any]
    requests: list[RolloutRequest] = field(default_factory=list)
    trajectories: list[Any] = field(default_factory=list)

    def group_of(self, prompt_index: int) -> list[RolloutRequest]:
        return [r for r in self.requests if r.prompt_index == prompt_index]


def _check(session, prompts, group, stepper, level, seed, window, overrides, needs_density=True):
    from ..stochastic import SDE_KINDS
    from ..stochastic.steppers import check_params

    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValidationError(f"prompts={prompts!r}: must be a non-empty list of prompts")
    if isinstance(group, bool) or not isinstance(group, numbers.Integral) or not 1 <= group <= MAX_GROUP:
        raise ValidationError(f"group={group!r}: must be an integer in [1, {MAX_GROUP}]")
    ode = stepper == "euler" and not needs_density
    if stepper not in SDE_KINDS and not ode:
        raise ValidationError(f"stepper={stepper!r}: a rollout needs a stochastic stepper, one of "
                              f"{', '.join(SDE_KINDS)} (or euler with needs_density=False)")
    if "seed" in overrides:
        raise ValidationError("seed: a rollout derives every request's seed from its own seed= (request_seed)")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63:
        raise ValidationError(f"seed={seed!r}: must be an integer in [0, 2**63)")
    params = None if ode else check_params(stepper, {"level": level, "seed": seed, "window": window})
    settings = []
    for prompt in prompts:
        s = session.settings(check_prompt(prompt), **overrides).checked_paths()
        try:
            runtime.require_not_fast("a rollout (its log-densities are the GRPO ratio's denominator)", s.mode)
        except runtime.FastModeError as err:
            raise ValidationError(f"mode={s.mode!r}: {err}") from None
        session.check_prompt_length(s.prompt)
        session.check_preset(s)
        settings.append(s)
    return settings, params


def rollout(session, prompts: Sequence[str], *, group: int = 4, stepper: str = "flow_sde",
            level: float | Mapping[str, float] = 0.7, seed: int = 0, window: Mapping[str, int] | None = None,
            decode: bool = False, batched: bool = True, keep: Sequence[str] = ("latents",),
            needs_density: bool = True, **overrides: Any) -> Rollout:
    """Run the rollout (module docstring); the caller holds the session lock."""
    from ..run import trajectory as T

    settings, params = _check(session, prompts, group, stepper, level, seed, window, overrides, needs_density)
    keep = tuple(dict.fromkeys(("latents",) + tuple(keep)))
    T.TrajectoryRecorder(keep=keep)  # refuses an unknown keep entry before any work
    media = [session.read_media(s) for s in settings]
    encoded = phases.encode(session, list(zip(settings, media)))
    out = Rollout(prompts=[s.prompt for s in settings], group=int(group), stepper=stepper, params=dict(params or {}))
    for p, (s, m, enc) in enumerate(zip(settings, media, encoded)):
        prepared = prepare(session, s, m, enc, policy_adapter=True)  # the policy is fixed in a rollout
        _run_prompt(session, out, prepared, p, seed, params, batched, keep)
    session.phase_done("transformer", "transformer_ref")
    if decode:
        frames, waveforms = phases.decode(session, [(settings[r.prompt_index], r.latents, r.audio_rows)
                                                    for r in out.requests])
        for req, f, w in zip(out.requests, frames, waveforms):
            req.frames, req.audio = f, w
    return out


def _run_prompt(session, out: Rollout, prepared, p: int, seed: int, params, batched: bool, keep) -> None:
    """Prompt `p`'s G requests: their released draws from the request seeds, run as one batch or one by one on the
    shared denoise phase, appended to `out`."""
    from ..run import trajectory as T

    s, group = prepared.settings, out.group
    ids = [p * group + g for g in range(group)]
    seeds = [request_seed(seed, r) for r in ids]
    drawn = [prepared.draw(rs) for rs in seeds]
    for members in ([list(range(group))] if batched else [[g] for g in range(group)]):
        first = drawn[members[0]]
        inputs = first.replace(
            text=torch.cat([drawn[g].text for g in members]), video=torch.cat([drawn[g].video for g in members]),
            audio=torch.cat([drawn[g].audio for g in members]),
            seeds={**first.seeds, "request": [seeds[g] for g in members], "rollout": int(seed)})
        spec = prepared.spec(inputs, stepper=out.stepper, stepper_params={} if params is None else {
            **params, "requests": [ids[g] for g in members]})
        recorder = T.TrajectoryRecorder(keep=keep, meta={"settings": pipeline.settings_meta(s), "rollout": {
            "seed": int(seed), "group": int(group), "prompt_index": p, "members": members}})
        video, audio = phases.denoise(session, prepared, spec, recorder)
        traj = recorder.finish()
        out.trajectories.append(traj)
        for item, g in enumerate(members):
            latents, audio_rows = prepared.final(inputs, video[item:item + 1], audio[item:item + 1])
            out.requests.append(RolloutRequest(p, g, ids[g], seeds[g], traj, item, latents, audio_rows))
