"""Rewards for RL on H3: a plain Python callable scoring each request of a rollout, shipped examples that need no
download, resolution of `NAME` or `module:function`, and the checks on what a reward returns.

Contract
--------
- A request reaches a reward as a `RewardSample`: its prompt, seed and index in the rollout batch; the decoded frames
  (uint8 (F, H, W, 3)) and soundtrack (float32 (2, S) in [-1, 1] at `sample_rate`); the final latents (target video
  (C, T, h, w) and audio rows (2A, C_audio), float32, normalised, as `GenerationResult` carries them); and the
  first-frame anchor's path when the request had one. A reward that `needs="latents"` is given samples whose
  `frames` / `audio` are None (the rollout may skip the VAE decodes for it).
- A reward is a `Reward(name, fn, needs, batched)`. `batched=False` (the default): `fn(sample) -> float` per request.
  `batched=True`: `fn(samples) -> sequence of floats`, one per sample in order (a scorer that runs one model over the
  batch). `score(reward, samples)` calls it and returns (B,) float64; it refuses, in one line naming the reward, the
  request and the value: a count other than B, a value that is not a real number (bool included), NaN or +-inf.
- Resolution (`resolve_reward`): a `Reward` as it is; a registered NAME (`REWARDS`); `"package.module:function"`
  imported with importlib (the attribute is a `Reward`, or a callable taken as a per-sample decoded reward unless it
  carries `needs` / `batched` attributes, as `@reward(...)` sets them); any other callable the same way. An unknown
  name, an unimportable module or a missing / non-callable attribute is a one-line `RewardError`. Two more spellings
  of a text spec: a weighted sum `"NAME:WEIGHT,NAME:WEIGHT"` (`reward_mix.py`; any spec whose last `:` part is a
  number, e.g. `"prompt_match:1.0"`) and a reward server `"http://HOST:PORT/PATH"` (`reward_client.py`; no comma
  in the URL: a comma makes a sum, and a server is not a part of one).
- Parts: a weighted sum is a `Reward` whose `parts` are its (part, weight) pairs; `score_parts(reward, samples)`
  returns the total and each part's values (`[]` for a plain reward), for the run records.
- The shipped rewards (all deterministic numpy on the CPU, float64):
    brightness     mean Rec. 601 luma of every frame, in [0, 1]
    redness        mean(R - (G + B) / 2) / 255 over every pixel, in [-1, 1]
    colour(r,g,b)  factory: 1 - mean |pixel - (r, g, b)| / 255, in [0, 1] (`REWARDS["colour"]` targets pure red)
    pitch          -|log2(f / 440)|, f the dominant frequency of the mono mix (largest rFFT magnitude above 20 Hz,
                   Hann window): 0 at A4, -1 one octave away; `pitch_near(hz)` targets another pitch
    anchor_match   1 - mean |frame 0 - anchor| / 255, the anchor image stretched onto the frame (PIL LANCZOS, as the
                   pipeline stretches a first-frame anchor); a request without a first-frame anchor is refused
    latent_mean    mean of the final target video latents (needs="latents": no decode; a cheap test reward)
    prompt_match   for the h3-shapes model: the fraction of the attributes colour, direction, tone and pan (`READS`)
                   on which the decoded clip, read with `h3lab.shapes.measure`, says what the request's prompt says
                   (`h3lab.shapes.read_prompt` + `matches`), in {0, 1/4, ..., 1}; a prompt the reader cannot parse is
                   refused naming it. `prompt_match(attributes=...)` scores a subset; registered subsets:
                   prompt_match_video (colour, direction), prompt_match_audio (tone, pan) and one per attribute,
                   colour_match, direction_match, tone_match, pan_match (each 0 or 1)
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import ValidationError
from ..shapes import READS, matches, measure, read_prompt
from .reward_base import (  # noqa: F401 - the reward API's names live here for callers
    NEEDS,
    Reward,
    RewardError,
    RewardSample,
    is_weight,
    reward,
    score,
    score_parts,
)

# ============================================================================================ the examples
def _frames(sample: RewardSample, name: str) -> np.ndarray:
    if sample.frames is None:
        raise RewardError(f"reward {name!r}: request {sample.index} has no decoded frames")
    return np.asarray(sample.frames, dtype=np.float64)


def brightness(sample: RewardSample) -> float:
    f = _frames(sample, "brightness")
    return float((0.299 * f[..., 0] + 0.587 * f[..., 1] + 0.114 * f[..., 2]).mean() / 255.0)


def redness(sample: RewardSample) -> float:
    f = _frames(sample, "redness")
    return float((f[..., 0] - 0.5 * (f[..., 1] + f[..., 2])).mean() / 255.0)


def colour(r: float, g: float, b: float) -> Reward:
    """1 - mean |pixel - (r, g, b)| / 255 (channels 0..255)."""
    target = np.asarray([r, g, b], dtype=np.float64)
    if target.shape != (3,) or not np.isfinite(target).all() or (target < 0).any() or (target > 255).any():
        raise RewardError(f"colour target {(r, g, b)!r}: must be three numbers in [0, 255]")

    def fn(sample: RewardSample) -> float:
        return float(1.0 - np.abs(_frames(sample, "colour") - target).mean() / 255.0)

    return Reward(f"colour({r:g},{g:g},{b:g})", fn)


def dominant_pitch(audio: torch.Tensor | np.ndarray, sample_rate: int) -> float:
    """Frequency (Hz) of the largest rFFT magnitude above 20 Hz of the Hann-windowed mono mix."""
    x = np.asarray(audio, dtype=np.float64)
    x = x.mean(axis=0) if x.ndim == 2 else x
    if x.ndim != 1 or x.size < 2:
        raise RewardError(f"audio of shape {tuple(np.shape(audio))}: dominant pitch needs (channels, samples)")
    spectrum = np.abs(np.fft.rfft(x * np.hanning(x.size)))
    freqs = np.fft.rfftfreq(x.size, 1.0 / sample_rate)
    band = freqs > 20.0
    if not band.any():
        raise RewardError(f"audio of {x.size} samples at {sample_rate} Hz: too short for a pitch above 20 Hz")
    return float(freqs[band][int(np.argmax(spectrum[band]))])


def pitch_near(hz: float) -> Reward:
    """-|log2(f / hz)| of the dominant frequency f."""
    if isinstance(hz, bool) or not isinstance(hz, numbers.Real) or not math.isfinite(hz) or hz <= 20:
        raise RewardError(f"pitch target {hz!r}: must be a frequency in Hz above 20")

    def fn(sample: RewardSample) -> float:
        if sample.audio is None:
            raise RewardError(f"reward 'pitch': request {sample.index} has no decoded audio")
        return -abs(math.log2(dominant_pitch(sample.audio, sample.sample_rate) / hz))

    return Reward(f"pitch_near({hz:g})", fn)


def anchor_match(sample: RewardSample) -> float:
    if sample.first is None:
        raise RewardError(f"reward 'anchor_match': request {sample.index} has no first-frame anchor (--first)")
    from PIL import Image, ImageOps

    frame = _frames(sample, "anchor_match")[0]
    h, w = frame.shape[:2]
    try:  # the anchor was read and checked by the session before the rollout; decoded here with PIL as it did
        with Image.open(sample.first) as image:
            rgb = ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError) as err:
        raise RewardError(f"reward 'anchor_match': cannot read the anchor {str(sample.first)!r} "
                          f"({str(err).splitlines()[0]})") from None
    anchor = np.asarray(rgb.resize((w, h), Image.Resampling.LANCZOS), dtype=np.float64)
    return float(1.0 - np.abs(frame - anchor).mean() / 255.0)


def latent_mean(sample: RewardSample) -> float:
    if sample.latents is None:
        raise RewardError(f"reward 'latent_mean': request {sample.index} has no final latents")
    return float(sample.latents.to(torch.float64).mean())


def prompt_match(attributes: Sequence[str] = READS, name: str | None = None) -> Reward:
    """The prompt-following reward of the h3-shapes model on `attributes` (module docstring)."""
    attributes = tuple(attributes)
    bad = [a for a in attributes if a not in READS]
    if not attributes or bad or len(set(attributes)) != len(attributes):
        raise RewardError(f"prompt_match attributes={attributes!r}: must be distinct names among {', '.join(READS)}")
    name = name or ("prompt_match" if attributes == READS else f"prompt_match({','.join(attributes)})")

    def fn(sample: RewardSample) -> float:
        try:
            colour_, shape, direction = read_prompt(sample.prompt)
        except ValidationError as err:
            raise RewardError(f"reward {name!r}, request {sample.index}: {err}") from None
        frames = sample.frames
        audio = sample.audio
        if frames is None or audio is None and any(a in ("tone", "pan") for a in attributes):
            raise RewardError(f"reward {name!r}: request {sample.index} has no decoded "
                              f"{'frames' if frames is None else 'audio'} (the rollout must decode)")
        audio = np.zeros((2, 16), np.float32) if audio is None else np.asarray(audio, dtype=np.float32)
        said = matches(measure(frames, audio, sample.sample_rate), colour_, shape, direction)
        return sum(bool(said[a]) for a in attributes) / len(attributes)

    return Reward(name, fn)


REWARDS: dict[str, Reward] = {
    "brightness": Reward("brightness", brightness),
    "redness": Reward("redness", redness),
    "colour": Reward("colour", colour(255, 0, 0).fn),
    "pitch": Reward("pitch", pitch_near(440.0).fn),
    "anchor_match": Reward("anchor_match", anchor_match),
    "latent_mean": Reward("latent_mean", latent_mean, needs="latents"),
    "prompt_match": prompt_match(),
    "prompt_match_video": prompt_match(("colour", "direction"), "prompt_match_video"),
    "prompt_match_audio": prompt_match(("tone", "pan"), "prompt_match_audio"),
    **{f"{a}_match": prompt_match((a,), f"{a}_match") for a in READS},
}


# ============================================================================================ resolution
def _wrap(name: str, obj: Any) -> Reward:
    if isinstance(obj, Reward):
        return check_signature(name, obj)
    if not callable(obj):
        raise RewardError(f"reward {name!r} is a {type(obj).__name__}: must be a callable or a Reward")
    return check_signature(name, Reward(getattr(obj, "reward_name", name), obj, getattr(obj, "needs", "decoded"),
                                        bool(getattr(obj, "batched", False))))


def check_signature(name: str, reward: Reward) -> Reward:
    """`reward` when its function can be called with one positional argument (a `RewardSample`, or the list of them
    when `batched`); else a one-line `RewardError` naming the reward, its signature and the expected one -- checked
    when the reward is resolved, before any rollout. A callable whose signature Python cannot read is taken as is."""
    try:
        signature = inspect.signature(reward.fn)
    except (TypeError, ValueError):
        return reward
    try:
        signature.bind(None)
    except TypeError:
        expected = "fn(samples) -> a float per sample" if reward.batched else "fn(sample) -> float"
        raise RewardError(f"reward {name!r}: {getattr(reward.fn, '__qualname__', name)}{signature} cannot take one "
                          f"argument; a reward is {expected}, the sample an h3lab.training.RewardSample") from None
    return reward


def resolve_reward(spec: str | Callable | Reward) -> Reward:
    """A `Reward` from a registered NAME, `"module:function"`, a callable or a `Reward` (module docstring)."""
    if not isinstance(spec, str):
        return _wrap(getattr(spec, "__name__", type(spec).__name__), spec)
    if spec in REWARDS:
        return REWARDS[spec]
    url = spec.startswith(("http://", "https://"))
    if "," in spec or not url and is_weight(spec.rpartition(":")[2]):
        from .reward_mix import mixed_reward

        return mixed_reward(spec, resolve_reward)
    if url:
        from .reward_client import remote_reward

        return remote_reward(spec)
    if ":" not in spec:
        raise RewardError(f"reward {spec!r}: not a shipped reward ({', '.join(REWARDS)}) nor module:function")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".") + attr.split(".")):
        raise RewardError(f"reward {spec!r}: must be NAME or package.module:function")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise RewardError(f"reward {spec!r}: cannot import module {module_name!r} ({err})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardError(f"reward {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return _wrap(spec, obj)
