"""One DiffusionNFT iteration: the rollout's final clean latents noised by the forward process, the frozen previous
policy's velocity on them (no grad), and the NFT loss of the trained policy (per request, batch 1, LoRA), several
inner epochs of StrictAdamW steps.

Contract
--------
- A `CleanRequest` is one request of a rollout as NFT trains on it: its id `request` (prompt-major: p * G + g) and
  `prompt` index, the inputs it was generated with (text, the layout tensors, `key_order`, the conditioning video
  and reference audio rows exactly as the rollout fed them) and its final clean latents x0 (the generated rows after
  the last pass), video (1, Nv, C) and audio (1, Na, C_audio) float32, conditioning rows first. Its per-row timestep
  kinds are read from the index tensors (text rows and generated video rows: video_t, conditioning video rows:
  max(video_t, 0.999), generated audio rows: audio_t, reference audio rows: clean), which is the layout's own rule
  (`layout.timesteps_of_kinds`; a test checks it reproduces the rollout's per-pass plan byte for byte).
- `noised(sigma_video, sigma_audio, noise_video, noise_audio)` is the forward process of the supervised objective on
  the generated rows, x_t = noise_mix(x0, noise, 1 - sigma) with target x0 - noise; conditioning and reference rows
  stay as the rollout fed them; the row timesteps are `timesteps_of_kinds(kinds, 1 - sigma_video, 1 - sigma_audio)`.
  The noise and sigmas come from `noised_items` (`objective.py`'s draw order), on the model's device.
- One iteration (`nft_iteration`): A = `group_advantages(rewards, G, adv_eps)` (float64, no clip), r =
  `optimality(A, adv_clip)`; the items (request, draw), request-major and draw-ascending; then, with the model in
  `mode` and train mode (`gradient_checkpointing`):
    1. v_old of every item: a no-grad forward of the model as it stands (the adapter as it was at the start of the
       iteration, LoRA on), the samples in canonical order, one forward per (prompt, draw) over the G members
       (`old_batch="group"`) or one per member ("request") -- byte-equal either way in strict (batch 1 vs N, any
       position); and with `ref_kl` > 0 v_ref the same way with the adapter off (`lora.adapter_disabled`).
    2. per inner epoch e, for every item in order, one batch-1 forward + backward (`step.request_gradient` with the
       NFT loss as `loss_fn`: canonical order, train mode, checkpointing, the fixed-order tree), the epoch's gradient
       the tree of the items' gradients / n, then one `StrictAdamW.step`.
  Refresh schedule: v_old is computed once per iteration, before its first optimiser step, and is the same for all
  its inner epochs; the previous policy is therefore refreshed to the trained adapter after each iteration's
  optimiser steps (DiffusionNFT's old-policy decay 0), and iteration k + 1's rollout and v_old both use it.
- On-policy gate: at epoch 0 the training forward of an item runs the same weights as v_old, so in strict its
  velocity is byte-equal to v_old on every generated row (`torch.equal`): recorded per item and modality as the
  largest |v_theta - v_old| (0.0 exactly) and counted per epoch (`on_policy`: count, exactly_equal, max_abs).
- Record (JSON floats are exact values): rewards (and a weighted sum's `reward_parts`), advantages, optimality, the
  sigmas of every (prompt, draw), the items, the SHA-256 (device scheme) of every item's v_old (and v_ref); per epoch
  every item's loss, per-modality positive / negative / KL terms, on-policy gap (epoch 0) and gradient digest, the
  batch loss, every parameter's gradient and weight digest, the optimiser digest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from ...hashing import tensor_digest
from ...run.layout import TIME_AUDIO, TIME_CONDITION, TIME_REFERENCE_AUDIO, TIME_VIDEO, timesteps_of_kinds
from ...run.sampler import draw_noise, noise_mix
from ...run.trajectory import TraceSummary
from ..combine import TreeAccumulator
from ..grpo import group_advantages
from ...adapters.lora import adapter_disabled, has_lora
from ..objective import MODALITIES, TrainingError, TrainingSample, shifted_sigma
from ..optim import StrictAdamW
from ..rl_run import step_record
from ..run import _scheme
from ..step import _TrainContext, model_device, request_gradient, trainable_parameters
from .objective import NftConfig, nft_modality_loss, noising_seed, optimality

_LAYOUT = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")


@dataclass(frozen=True, eq=False)
class CleanRequest:
    """One request's final clean latents and the inputs it was generated with (module docstring)."""

    request: int
    prompt: int
    text: torch.Tensor
    video: torch.Tensor
    audio: torch.Tensor
    position_ids: torch.Tensor
    token_tags: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    text_indices: torch.Tensor
    num_condition_video_rows: int = 0
    num_condition_audio_rows: int = 0
    key_order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name, rows, ncond in (("video", self.video, self.num_condition_video_rows),
                                  ("audio", self.audio, self.num_condition_audio_rows)):
            if rows.ndim != 3 or rows.shape[0] != 1 or not 0 <= ncond < rows.shape[1]:
                raise TrainingError(f"request {self.request}: {name} rows {tuple(rows.shape)} with {ncond} "
                                    "conditioning rows: must be (1, rows, channels) with at least one generated row")

    def kinds(self) -> torch.Tensor:
        """(S,) int64 per-row timestep kinds (module docstring)."""
        kinds = torch.full((self.position_ids.shape[0],), TIME_VIDEO, dtype=torch.int64)
        ncv, nca = self.num_condition_video_rows, self.num_condition_audio_rows
        kinds[self.video_indices[:ncv].cpu()] = TIME_CONDITION
        kinds[self.audio_indices[:nca].cpu()] = TIME_REFERENCE_AUDIO
        kinds[self.audio_indices[nca:].cpu()] = TIME_AUDIO
        return kinds

    def noised(self, sigma_video: torch.Tensor, sigma_audio: torch.Tensor, noise_video: torch.Tensor,
               noise_audio: torch.Tensor) -> TrainingSample:
        """The forward-process sample at (sigma_video, sigma_audio) with this noise (module docstring)."""
        device = noise_video.device
        ncv, nca = self.num_condition_video_rows, self.num_condition_audio_rows
        t_video, t_audio = 1.0 - sigma_video, 1.0 - sigma_audio
        x0v, x0a = self.video.to(device), self.audio.to(device)
        video = torch.cat([x0v[:, :ncv], noise_mix(x0v[:, ncv:], noise_video[:, ncv:], t_video.to(device))], dim=1)
        audio = torch.cat([x0a[:, :nca], noise_mix(x0a[:, nca:], noise_audio[:, nca:], t_audio.to(device))], dim=1)
        timestep, timestep_indices = timesteps_of_kinds(self.kinds(), float(t_video), float(t_audio))
        return TrainingSample(
            text=self.text.to(device), video=video, audio=audio, timestep=timestep.to(device),
            timestep_indices=timestep_indices.to(device),
            **{k: getattr(self, k).to(device) for k in _LAYOUT},
            target_video=x0v[:, ncv:] - noise_video[:, ncv:], target_audio=x0a[:, nca:] - noise_audio[:, nca:],
            num_condition_video_rows=ncv, num_condition_audio_rows=nca, sigma_video=sigma_video,
            sigma_audio=sigma_audio, key_order=None if self.key_order is None else self.key_order.to(device))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {k: getattr(self, k) for k in ("text", "video", "audio", *_LAYOUT)}
        if self.key_order is not None:
            out["key_order"] = self.key_order
        return out

    def meta(self) -> dict[str, Any]:
        return {"request": self.request, "prompt": self.prompt,
                "num_condition_video_rows": self.num_condition_video_rows,
                "num_condition_audio_rows": self.num_condition_audio_rows}

    @classmethod
    def from_sealed(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> "CleanRequest":
        missing = sorted({"text", "video", "audio", *_LAYOUT} - set(tensors))
        if missing:
            raise TrainingError(f"sealed NFT request {meta.get('request')} lacks tensors {missing}")
        return cls(int(meta["request"]), int(meta["prompt"]), **{k: tensors[k] for k in ("text", "video", "audio",
                                                                                        *_LAYOUT)},
                   num_condition_video_rows=int(meta["num_condition_video_rows"]),
                   num_condition_audio_rows=int(meta["num_condition_audio_rows"]), key_order=tensors.get("key_order"))


def clean_request(trajectory: Any, item: int, request: int, prompt: int) -> CleanRequest:
    """Batch item `item` of a rollout trajectory (latents kept) as request `request` of prompt `prompt`."""
    inputs, kept = trajectory.inputs, trajectory.kept
    last = inputs.num_passes - 1
    missing = [f"{m}.{last:04d}" for m in MODALITIES if f"{m}.{last:04d}" not in kept]
    if missing:
        raise TrainingError(f"trajectory lacks its final latents {missing}: record it with keep=('latents', ...)")
    b = slice(item, item + 1)
    ncv, nca = inputs.num_condition_video_rows, inputs.num_condition_audio_rows
    video = torch.cat([inputs.video[b, :ncv].cpu(), kept[f"video.{last:04d}"][b, ncv:].cpu()], dim=1).float()
    audio = torch.cat([inputs.audio[b, :nca].cpu(), kept[f"audio.{last:04d}"][b, nca:].cpu()], dim=1).float()
    return CleanRequest(int(request), int(prompt), inputs.text[b].cpu(), video, audio,
                        **{k: v.cpu() for k, v in inputs.layout_kwargs().items()}, num_condition_video_rows=ncv,
                        num_condition_audio_rows=nca,
                        key_order=None if inputs.key_order is None else inputs.key_order.cpu())


@dataclass(frozen=True, eq=False)
class NftBatch:
    """One iteration's rollouts: `requests[r]` (request order 0..R-1, prompt-major), `rewards` (R,) float64, the
    stepper and trajectories' digests for the record (`origin`), a weighted-sum reward's parts."""

    requests: list[CleanRequest]
    rewards: torch.Tensor
    origin: dict = field(default_factory=dict)
    parts: list = field(default_factory=list)

    def __post_init__(self) -> None:
        ids = [q.request for q in self.requests]
        if ids != list(range(len(ids))) or self.rewards.shape != (len(ids),):
            raise TrainingError(f"NFT batch of request ids {ids[:8]} with rewards {tuple(self.rewards.shape)}: must be "
                                "requests 0..R-1 in order and one reward each")


def batch_from_rollout(rollout: Any, rewards: torch.Tensor, parts: list | None = None) -> NftBatch:
    """The `NftBatch` of an `h3lab.app.rollout.Rollout` (any stepper) and its requests' rewards (request order)."""
    requests = [clean_request(q.trajectory, q.item, q.request, q.prompt_index)
                for q in sorted(rollout.requests, key=lambda q: q.request)]
    origin = {"kind": rollout.stepper, "trajectories": [t.digest for t in rollout.trajectories]}
    return NftBatch(requests, torch.as_tensor(rewards, dtype=torch.float64), origin, list(parts or []))


# ============================================================================================== the draws
@dataclass(frozen=True, eq=False)
class NftItem:
    """One noising of one request: its `request`, `prompt`, `draw` index and the noised `sample`."""

    request: int
    prompt: int
    draw: int
    sample: TrainingSample


def noised_items(batch: NftBatch, config: NftConfig, iteration: int,
                 device: torch.device | str) -> tuple[list[NftItem], list[dict]]:
    """(items request-major and draw-ascending, per (prompt, draw) its sigmas) -- the draws of `objective.py`."""
    prompts: dict[int, list[CleanRequest]] = {}
    for q in batch.requests:
        prompts.setdefault(q.prompt, []).append(q)
    items, sigmas = [], []
    for p, members in prompts.items():
        for k in range(config.draws):
            g = torch.Generator(device="cpu").manual_seed(noising_seed(config.seed, iteration, p, k))
            u = torch.rand(2, generator=g, dtype=torch.float32)
            sigma_video = shifted_sigma(u[0], config.objective.video_shift)
            sigma_audio = shifted_sigma(u[1], config.objective.audio_shift)
            sigmas.append({"prompt": p, "draw": k, "sigma_video": float(sigma_video),
                           "sigma_audio": float(sigma_audio)})
            for q in members:
                noise_video = draw_noise(q.video.shape, g, device)
                noise_audio = draw_noise(q.audio.shape, g, device)
                items.append(NftItem(q.request, p, k, q.noised(sigma_video, sigma_audio, noise_video, noise_audio)))
    return sorted(items, key=lambda it: (it.request, it.draw)), sigmas


def _forward_groups(items: Sequence[NftItem], old_batch: str) -> list[list[int]]:
    """Indices of the items sharing one no-grad forward: per (prompt, draw) in item order, or one each."""
    if old_batch == "request":
        return [[k] for k in range(len(items))]
    groups: dict[tuple[int, int], list[int]] = {}
    for k, it in enumerate(items):
        groups.setdefault((it.prompt, it.draw), []).append(k)
    return list(groups.values())


def frozen_velocities(model: nn.Module, items: Sequence[NftItem], old_batch: str,
                      reference: bool = False) -> list[dict[str, torch.Tensor]]:
    """Per item {"video", "audio"} velocities (1, N, C) of a no-grad forward in the current runtime mode: the model
    as it stands (v_old), or with its adapter off (`reference`: v_ref); batched per `old_batch` (module docstring)."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in items]
    with torch.no_grad():
        for group in _forward_groups(items, old_batch):
            samples = [items[k].sample.canonical() for k in group]
            first = samples[0]
            for s in samples[1:]:
                same = all(torch.equal(getattr(s, n), getattr(first, n)) for n in (*_LAYOUT, "timestep",
                                                                                   "timestep_indices"))
                if not same or s.text.shape != first.text.shape:
                    raise TrainingError(f"NFT items {[items[k].request for k in group]} of one prompt differ in "
                                        "layout or timesteps: they cannot share a forward (use old_batch='request')")
            kwargs = first.model_kwargs()
            kwargs.update(hidden_states=torch.cat([s.video for s in samples]),
                          audio_hidden_states=torch.cat([s.audio for s in samples]),
                          encoder_hidden_states=torch.cat([s.text for s in samples]))
            if reference:
                with adapter_disabled(model):
                    v_video, v_audio = model(**kwargs)
            else:
                v_video, v_audio = model(**kwargs)
            for j, k in enumerate(group):
                out[k] = {"video": v_video[j:j + 1].detach(), "audio": v_audio[j:j + 1].detach()}
    return out


# ============================================================================================ the iteration
def _item_loss(config: NftConfig, sample: TrainingSample, v_video, v_audio, r: float,
               old: dict[str, torch.Tensor], ref: dict[str, torch.Tensor] | None, info: dict) -> torch.Tensor:
    weights = {"video": config.objective.video_weight, "audio": config.objective.audio_weight}
    ncond = {"video": sample.num_condition_video_rows, "audio": sample.num_condition_audio_rows}
    velocity = {"video": v_video, "audio": v_audio}
    loss = None
    for m in MODALITIES:
        c = ncond[m]
        term, parts = nft_modality_loss(velocity[m][:, c:], old[m][:, c:], getattr(sample, f"target_{m}"), r,
                                        config.beta, None if ref is None else ref[m][:, c:])
        if ref is not None:
            term = term + config.ref_kl * parts["kl"]
        term = weights[m] * term
        loss = term if loss is None else loss + term
        info[m] = {k: float(v.detach()) for k, v in parts.items()}
    return loss


def _gap_stats(gaps: list[float]) -> dict:
    return {"count": len(gaps), "exactly_equal": sum(g == 0.0 for g in gaps), "max_abs": max(gaps, default=0.0)}


def nft_iteration(model: nn.Module, batch: NftBatch, config: NftConfig, optimizer: StrictAdamW,
                  iteration: int = 0, trace: TraceSummary | None = None) -> dict[str, Any]:
    """Every inner epoch of one rollout batch (module docstring); trains `model` in place; returns the record."""
    params = trainable_parameters(model)
    if not params:
        raise TrainingError("no trainable parameters: DiffusionNFT trains a LoRA adapter (or any requires_grad "
                            "weights)")
    if config.ref_kl > 0 and not has_lora(model):
        raise TrainingError(f"NFT ref_kl={config.ref_kl}: the reference is the model with its LoRA adapter off, and "
                            "this model carries none (add_lora first, or ref_kl=0)")
    kind = batch.origin.get("kind", config.kind)
    if kind != config.kind:
        raise TrainingError(f"the rollout stepped with {kind!r} but NftConfig.kind is {config.kind!r}")
    advantages = group_advantages(batch.rewards, config.group, config.adv_eps)
    r = optimality(advantages, config.adv_clip)
    scheme, device = _scheme(model), model_device(model)
    items, sigmas = noised_items(batch, config, iteration, device)
    trace = TraceSummary() if trace is None else trace
    epochs = []
    with _TrainContext(model, config.mode, config.gradient_checkpointing):
        old = frozen_velocities(model, items, config.old_batch)
        ref = frozen_velocities(model, items, config.old_batch, reference=True) if config.ref_kl > 0 else None
        frozen = [{"request": it.request, "draw": it.draw,
                   "old": {m: tensor_digest(old[k][m], scheme) for m in MODALITIES},
                   **({"ref": {m: tensor_digest(ref[k][m], scheme) for m in MODALITIES}} if ref else {})}
                  for k, it in enumerate(items)]
        for epoch in range(config.inner_epochs):
            grads, losses, records, gaps = TreeAccumulator(), TreeAccumulator(), [], []
            for k, it in enumerate(items):
                info: dict = {}
                rq = float(r[it.request])

                def loss_fn(v_video, v_audio, canonical, k=k, rq=rq, info=info):
                    return _item_loss(config, canonical, v_video, v_audio, rq, old[k], None if ref is None else ref[k],
                                      info)

                rg = request_gradient(model, it.sample, config.objective, params, trace=trace, loss_fn=loss_fn)
                grads.add(rg.gradient)
                losses.add(rg.loss.to(torch.float32))
                record = {"request": it.request, "draw": it.draw, "loss": float(rg.loss), "gradient": rg.digest,
                          **info}
                if epoch == 0:
                    ncond = {"video": it.sample.num_condition_video_rows, "audio": it.sample.num_condition_audio_rows}
                    gap = {m: float((v[:, ncond[m]:] - old[k][m][:, ncond[m]:]).abs().max())
                           for m, v in zip(MODALITIES, rg.velocity)}
                    record["on_policy_gap"] = gap
                    gaps += list(gap.values())
                records.append(record)
            epochs.append({
                "epoch": epoch, "items": records, **step_record(grads, losses, len(items), params, optimizer, scheme),
                **({"on_policy": _gap_stats(gaps)} if epoch == 0 else {}),
            })
    return {"iteration": iteration, "rewards": [float(x) for x in batch.rewards],
            **({"reward_parts": [dict(p) for p in batch.parts]} if batch.parts else {}),
            "advantages": [float(a) for a in advantages], "optimality": [float(x) for x in r],
            "origin": dict(batch.origin), "sigmas": sigmas, "items": [[it.request, it.draw] for it in items],
            "frozen": frozen, "epochs": epochs}
