"""Builders for the whole-model strict tests: two small configs, the three packed layouts from `build_layout`, seeded
random weights in either dtype policy, per-request inputs that stack into a batch, strict forwards that capture every
hook point, and a spy on the torch reference ops.

Sizes are tiny because the Triton interpreter runs every program in Python: one strict forward of `tiny` over the
34-row fl2va layout takes ~1.5 s at batch 1 and ~3 s at batch 3 on one CPU thread.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from h3lab import H3Config, H3Transformer
from h3lab.execution import runtime
from h3lab.run.layout import PackedLayout, Reference, build_layout
from h3lab.model.random_init import random_state_dict  # noqa: F401 - the tests import it from here

# Two structures: `tiny` (inner 2x16 = 32 wider than hidden 24, rotary 12 of 16, 2 refiner + 2 blocks) and `h3d8`
# (3 heads x 8 = 24 narrower than hidden 28, rotary 6 of 8, odd widths 28/14/18/10 that exercise tile tails). Every
# K of a `linear_tree` (inner, ffn_dim) is a multiple of 8, as the strict tree requires.
CONFIGS = {
    "tiny": H3Config.tiny(),
    "h3d8": H3Config(
        num_attention_heads=3, attention_head_dim=8, hidden_size=28, num_layers=1, num_refiner_layers=1, ffn_dim=32,
        in_channels=2, audio_in_channels=6, patch_size=(1, 2, 2), text_dim=12, freq_dim=10,
        time_embed_hidden_dim=18, time_embed_dim=14, rope_freq_dim=1,
    ),
}

# (video_t, audio_t) of every forward: distinct, so t2va has 2 distinct timesteps, fl2va 3, ref2va 4.
TIMESTEPS = (0.42, 0.7)


def make_layout(task: str, patch_size=(1, 2, 2)) -> PackedLayout:
    """The canonical layout of one small request per task:
    t2va  19 rows: 5 text, 2 frames x 2x2 grid, 3 audio latents x 2 channels.
    fl2va 34 rows: 6 text (2 of them a vision block, tag 0), first + last anchors, 3 target frames, 4 audio latents.
    ref2va 31 rows: 5 text; references image (2x4 latent), video (2 frames 2x2 + 2-latent soundtrack), audio (2);
          2 target frames, 3 audio latents."""
    if task == "t2va":
        return build_layout("t2va", [1] * 5, 2, 4, 4, 3, patch_size=patch_size)
    if task == "fl2va":
        return build_layout("fl2va", [1, 1, 0, 0, 1, 1], 3, 4, 4, 4, anchors=("first", "last"), patch_size=patch_size)
    if task == "ref2va":
        refs = (Reference.image(2, 4), Reference.video(2, 2, 2, soundtrack_latents=2), Reference.audio(2))
        return build_layout("ref2va", [1] * 5, 2, 4, 4, 3, references=refs, patch_size=patch_size)
    raise ValueError(f"task {task!r}")


def build_model(config: H3Config, policy: str, seed: int) -> H3Transformer:
    """A model in `policy` ("released": bf16 + the float32 modules; "float32") with seeded random weights."""
    model = H3Transformer(config, dtype_policy=policy)
    model.load_state_dict(random_state_dict(config, seed))  # copies cast to each parameter's policy dtype
    return model


def truth_model(model: H3Transformer) -> H3Transformer:
    """The same weights upcast exactly to float64 (inv_freq stays float32, as the model requires): the truth the
    strict and torch paths are both measured against, run in `off` mode."""
    truth = H3Transformer(model.config, dtype_policy="float32")
    truth.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in truth.parameters():
            p.data = p.data.to(torch.float64)
    return truth


@dataclass(frozen=True)
class Request:
    """One request's rows (batch axis 1): video (1, Nv, video_patch_dim), audio (1, Na, C), text (1, L, text_dim)."""

    video: torch.Tensor
    audio: torch.Tensor
    text: torch.Tensor


def make_request(config: H3Config, layout: PackedLayout, seed: int) -> Request:
    """Fresh random float32 rows for one request (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    nv, na, nt = layout.video_indices.numel(), layout.audio_indices.numel(), layout.num_text_tokens
    return Request(
        torch.randn(1, nv, config.video_patch_dim, generator=g),
        torch.randn(1, na, config.audio_in_channels, generator=g),
        torch.randn(1, nt, config.text_dim, generator=g),
    )


def forward_kwargs(layout: PackedLayout, requests: list[Request], timesteps=TIMESTEPS) -> dict:
    """Keyword arguments of `H3Transformer.forward` for `requests` stacked in order over `layout`, with the
    layout's `key_order()` (None when canonical)."""
    t, ti = layout.row_timesteps(*timesteps)
    return {
        "hidden_states": torch.cat([r.video for r in requests]),
        "audio_hidden_states": torch.cat([r.audio for r in requests]),
        "encoder_hidden_states": torch.cat([r.text for r in requests]),
        "timestep": t,
        "timestep_indices": ti,
        **layout.model_inputs(),
        "key_order": layout.key_order(),
    }


def strict_forward(model: H3Transformer, kwargs: dict, capture: bool = False):
    """No-grad strict forward -> ((video, audio), {point name: captured tensor} or None)."""
    captured: dict[str, torch.Tensor] = {}
    handle = model.add_hook(lambda p, t: captured.__setitem__(p.name, t.detach().clone())) if capture else None
    try:
        with torch.no_grad(), runtime.use_mode("strict"):
            out = model(**kwargs)
    finally:
        if handle is not None:
            handle.remove()
    return out, (captured if capture else None)


def weighted_loss(video: torch.Tensor, audio: torch.Tensor, seed: int) -> torch.Tensor:
    """A scalar depending on every output value through fixed random weights (the gradient seed)."""
    g = torch.Generator().manual_seed(seed)
    return (video * torch.randn(video.shape, generator=g)).sum() + (audio * torch.randn(audio.shape, generator=g)).sum()


def forward_backward(model: H3Transformer, kwargs: dict, mode: str = "strict", seed: int = 0, train: bool = True):
    """Grad-enabled forward + backward of `weighted_loss` in `mode` -> ((video, audio) detached, {name: grad}) with
    the gradients of every parameter ("param:<name>") and of the three input streams ("input:<name>")."""
    x = {k: (v.clone().requires_grad_() if k.endswith("hidden_states") else v) for k, v in kwargs.items()}
    model.train(train)
    model.zero_grad(set_to_none=True)
    try:
        with runtime.use_mode(mode):
            video, audio = model(**x)
            assert video.requires_grad and audio.requires_grad
            weighted_loss(video, audio, seed).backward()
    finally:
        model.eval()
    grads = {f"param:{k}": p.grad.clone() for k, p in model.named_parameters()}
    grads.update({f"input:{k}": x[k].grad.clone() for k in x if k.endswith("hidden_states")})
    model.zero_grad(set_to_none=True)
    return (video.detach(), audio.detach()), grads


class ReferenceSpy:
    """Counts calls of the torch reference ops `runtime.REFERENCE_OPS` dispatches to (strict must make none).
    Install with `monkeypatch` through `install(monkeypatch)`; `calls` is a Counter op -> calls."""

    def __init__(self):
        self.calls: Counter = Counter()

    def install(self, monkeypatch) -> "ReferenceSpy":
        for name, fn in list(runtime.REFERENCE_OPS.items()):
            def spy(*args, _name=name, _fn=fn, **kwargs):
                self.calls[_name] += 1
                return _fn(*args, **kwargs)

            monkeypatch.setitem(runtime.REFERENCE_OPS, name, spy)
        return self
