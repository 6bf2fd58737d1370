"""The strict training step: per-request forward + backward through `H3Transformer`, a fixed-order combine, AdamW.

Contract
--------
- Mode: the step runs the model in the runtime mode it is given (`mode="strict"` by default: only the strict
  kernels, failing closed; `off` is the torch reference). `gradient_checkpointing` (None: leave the model's setting)
  sets `model.gradient_checkpointing` for the step — byte-neutral in strict and off (H-C6). The model is in train
  mode during the step and put back as it was.
- Requests: encoded clips for fine-tuning (`ClipRequest`: sigmas and noise drawn from the request's seed, noise-mixed,
  the target velocity `x0 - noise` regressed) and recorded rollout passes for RL (`rollout_request(s)`: the recorded
  pass latents regressed toward the rollout's own final latents, weighted by the reward). Transition
  log-probabilities stay absent: the released sampler is an eta = 0 ODE and has none (RFC section 1).
- Trainable parameters (`trainable_parameters`): `model.named_parameters()` with `requires_grad`, in that order.
  Full-parameter training: all of them. A LoRA wrapper freezes the base weights and leaves its adapter parameters
  trainable; they enter this list, the flat gradient and the optimiser in the same named-parameter order.
- One request, one micro-batch: each request's `TrainingSample` (`objective.py`), brought to canonical packed order
  first (`TrainingSample.canonical`), is its own batch-1 forward and backward of its own loss. Its gradient is the
  flat float32 vector of every trainable parameter's `.grad` (each cast once to float32 from the parameter's dtype:
  bfloat16 for released bf16 weights, as the strict kernels return it) in parameter order; a parameter that received
  no gradient contributes zeros. So a request's gradient bytes depend only on the request (its tensors, seed and
  weight), the weights and the mode: not on the batch, its size or the request's position in it.
  Why canonical order: the strict kernels reduce weight, norm-weight and AdaLN-table gradients over packed rows in
  packed order, so a consistently permuted layout (which gives byte-equal velocities, H-C3) would otherwise give
  other weight-gradient bytes. Canonicalising changes no input, output or target (the streams keep their order).
- Combine: the batch gradient is `combine.tree(g_0 .. g_{n-1}) / n` over requests in batch order (the fixed binary
  tree of `combine.py`; float32), the gradient of the mean request loss; the batch loss is the same tree over the
  request losses / n. Data-parallel ranks (`data_parallel.py`) finish the same tree from gathered node partials.
- Not the usual torch path: one batched backward reduces every weight gradient over all rows of all requests in one
  accumulator (cast once), so it is neither the sum of per-request gradients nor independent of batch composition.
- Optimiser: `StrictAdamW.step(gradient)` (`optim.py`). Nothing here reduces outside the model but the loss sums and
  the declared tree; everything is device-agnostic (tensors live on the model's device; draws are on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..execution import runtime
from ..hashing import tensor_digest
from ..run.trajectory import TraceSummary
from . import step_graph
from .combine import TreeAccumulator
from .objective import Objective, TrainingError, TrainingSample, flow_matching_loss
from .optim import StrictAdamW

INPUT_NAMES = {"video": "hidden_states", "audio": "audio_hidden_states", "text": "encoder_hidden_states"}


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter with `requires_grad`, in `named_parameters()` order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def flat_gradient(params: Sequence[tuple[str, nn.Parameter]]) -> torch.Tensor:
    """(P,) float32: each parameter's `.grad` cast to float32 and flattened, in order (None -> zeros)."""
    parts = [(p.grad.to(torch.float32) if p.grad is not None else torch.zeros(p.shape, device=p.device)).reshape(-1)
             for _, p in params]
    return torch.cat(parts) if parts else torch.zeros(0)


def split_flat(flat: torch.Tensor, params: Sequence[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """name -> the view of `flat` holding that parameter's entries, shaped like it."""
    out, offset = {}, 0
    for name, p in params:
        out[name] = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
    return out


def input_leaves(kwargs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Replace the video/audio/text inputs in forward `kwargs` by fresh leaves that require grad; returns them by
    name ("video", "audio", "text")."""
    leaves = {}
    for name, key in INPUT_NAMES.items():
        leaves[name] = kwargs[key] = kwargs[key].detach().clone().requires_grad_()
    return leaves


@dataclass
class RequestGradient:
    """One request's micro-batch: loss (0-d), flat float32 gradient, the velocities the forward returned (detached,
    all rows), and with `input_grads` the gradients of its video/audio/text inputs."""

    loss: torch.Tensor
    gradient: torch.Tensor
    velocity: tuple[torch.Tensor, torch.Tensor]
    inputs: dict[str, torch.Tensor] | None = None

    @property
    def digest(self) -> str:
        return tensor_digest(self.gradient, "auto")


def request_gradient(
    model: nn.Module,
    sample: TrainingSample,
    objective: Objective,
    params: Sequence[tuple[str, nn.Parameter]] | None = None,
    *,
    input_grads: bool = False,
    trace: TraceSummary | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor, TrainingSample], torch.Tensor] | None = None,
) -> RequestGradient:
    """Forward + backward of one request in the current runtime mode (module docstring); the model's `.grad`s are
    left cleared. `trace` receives the forward's provenance trace. `loss_fn(v_video, v_audio, sample)` (default: the
    flow-matching loss) gives the 0-d loss differentiated, on the canonical sample (the GRPO surrogate, `grpo_step`).
    A strict micro-batch on CUDA with the default loss and no input gradients runs through a CUDA graph of itself
    where eligible (`step_graph`: the same kernels, the same bytes, without the host's launches)."""
    params = trainable_parameters(model) if params is None else list(params)
    if not params and not input_grads:
        raise TrainingError("no trainable parameters (requires_grad) and no input gradients asked for: nothing to do")
    sample = sample.canonical()
    before = runtime.last_trace()
    if input_grads or loss_fn is not None:
        kwargs = sample.model_kwargs()
        leaves = input_leaves(kwargs) if input_grads else {}
        loss, gradient, v_video, v_audio = _micro_batch(model, sample, objective, params, kwargs, loss_fn)
        step_graph.set_eager("input gradients asked for" if input_grads else "a custom loss (loss_fn)")
        inputs = {k: x.grad for k, x in leaves.items()} if input_grads else None
    else:
        def body(s: TrainingSample) -> tuple:
            return _micro_batch(model, s, objective, params, s.model_kwargs(), None)

        loss, gradient, v_video, v_audio = step_graph.run(model, sample, objective, params, body)
        inputs = None
    if trace is not None:
        now = runtime.last_trace()
        trace.add(now if now is not before else None)
    return RequestGradient(loss.detach(), gradient, (v_video.detach(), v_audio.detach()), inputs)


def _micro_batch(model, sample, objective, params, kwargs, loss_fn) -> tuple:
    """(loss, flat gradient, v_video, v_audio) of one canonical sample: forward of `kwargs`, the loss, its backward;
    every `.grad` cleared before and after. No host read: `step_graph` captures it."""
    for _, p in params:
        p.grad = None
    try:
        with torch.enable_grad():
            v_video, v_audio = model(**kwargs)
            if loss_fn is None:
                loss = flow_matching_loss(objective, v_video, v_audio, sample)
            else:
                loss = loss_fn(v_video, v_audio, sample)
            loss.backward()
        gradient = flat_gradient(params)
    finally:
        for _, p in params:
            p.grad = None
    return loss.detach(), gradient, v_video.detach(), v_audio.detach()


@dataclass
class StepResult:
    """A step's outcome: batch `loss` (0-d float32), batch `gradient` (P,) float32, per request (batch order) the
    loss, the gradient digest, the velocities and (with `keep`) the gradient itself; the step's trace summary."""

    loss: torch.Tensor
    gradient: torch.Tensor
    request_losses: list[torch.Tensor]
    request_digests: list[str]
    velocities: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    request_gradients: list[RequestGradient] = field(default_factory=list)
    trace: TraceSummary = field(default_factory=TraceSummary)


class _TrainContext:
    """Train mode, the runtime mode and the checkpointing setting for a step; restores the model afterwards."""

    def __init__(self, model: nn.Module, mode: str, gradient_checkpointing: bool | None):
        self.model, self.mode, self.ckpt = model, mode, gradient_checkpointing

    def __enter__(self) -> None:
        if self.mode not in runtime.MODES:
            raise TrainingError(f"mode={self.mode!r}: must be one of {', '.join(runtime.MODES)}")
        self.was_training = self.model.training
        self.was_ckpt = getattr(self.model, "gradient_checkpointing", None)
        self._mode = runtime.use_mode(self.mode)
        self._mode.__enter__()
        self.model.train()
        if self.ckpt is not None:
            self.model.gradient_checkpointing = bool(self.ckpt)

    def __exit__(self, *exc: Any) -> None:
        self.model.train(self.was_training)
        if self.ckpt is not None:
            self.model.gradient_checkpointing = self.was_ckpt
        self._mode.__exit__(*exc)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def for_each_request(
    model: nn.Module,
    requests: Iterable[Any],
    objective: Objective,
    consume: Callable[[int, RequestGradient], None],
    *,
    mode: str = "strict",
    gradient_checkpointing: bool | None = None,
    input_grads: bool = False,
    trace: TraceSummary | None = None,
) -> None:
    """`consume(i, request_gradient(...))` for every request (anything with `.sample(objective)`) in order, inside
    one train context (`mode`, train mode, checkpointing), restored afterwards."""
    params = trainable_parameters(model)
    device = model_device(model)
    with _TrainContext(model, mode, gradient_checkpointing):
        for i, request in enumerate(requests):
            sample = request.sample(objective).to(device)
            consume(i, request_gradient(model, sample, objective, params, input_grads=input_grads, trace=trace))


def compute_gradients(
    model: nn.Module,
    requests: Sequence[Any],
    objective: Objective,
    *,
    mode: str = "strict",
    gradient_checkpointing: bool | None = None,
    keep: bool = False,
    input_grads: bool = False,
    trace: TraceSummary | None = None,
) -> StepResult:
    """The batch gradient of `requests` (module docstring), streamed through the fixed tree; no optimiser step.
    `keep` keeps every `RequestGradient` (with `input_grads`, their input gradients too); `trace` (default: a
    fresh one, `StepResult.trace`) receives every forward's provenance."""
    requests = list(requests)
    if not requests:
        raise TrainingError("a training step needs at least one request")
    trace = TraceSummary() if trace is None else trace
    grads, losses = TreeAccumulator(), TreeAccumulator()
    request_losses, digests, velocities, kept = [], [], [], []

    def consume(_: int, rg: RequestGradient) -> None:
        grads.add(rg.gradient)
        losses.add(rg.loss.to(torch.float32))
        request_losses.append(rg.loss)
        digests.append(rg.digest)
        velocities.append(rg.velocity)
        if keep:
            kept.append(rg)

    for_each_request(model, requests, objective, consume, mode=mode, gradient_checkpointing=gradient_checkpointing,
                     input_grads=input_grads, trace=trace)
    n = len(requests)
    return StepResult(losses.result() / n, grads.result() / n, request_losses, digests, velocities, kept, trace)


def train_step(
    model: nn.Module,
    requests: Sequence[Any],
    objective: Objective,
    optimizer: StrictAdamW,
    **kwargs: Any,
) -> StepResult:
    """`compute_gradients(...)`, then `optimizer.step(result.gradient)`; returns the result."""
    result = compute_gradients(model, requests, objective, **kwargs)
    optimizer.step(result.gradient)
    return result
