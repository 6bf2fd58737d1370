"""The types every reward module shares: `RewardSample` (one request as a reward sees it), `Reward`, the `@reward`
decorator, `score` (the checks on what a reward returns) and `score_parts` (a weighted sum's parts). The contract is
`rewards.py`'s docstring; this module holds no reward and resolves no name (`rewards.py`, `reward_mix.py`,
`reward_client.py` and `reward_protocol.py` build on it).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import H3Error

NEEDS = ("decoded", "latents")


class RewardError(H3Error):
    """A reward cannot be resolved, or returned something other than one finite float per request."""


@dataclass(frozen=True, eq=False)
class RewardSample:
    """One request of a rollout as a reward sees it (module docstring)."""

    prompt: str
    seed: int
    index: int
    frames: np.ndarray | None = None  # uint8 (F, H, W, 3)
    audio: torch.Tensor | None = None  # float32 (2, S) in [-1, 1]
    sample_rate: int = 32000
    latents: torch.Tensor | None = None  # final target video latents (C, T, h, w) float32
    audio_latents: torch.Tensor | None = None  # final target audio rows (2A, C_audio) float32
    first: str | None = None  # first-frame anchor path
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_result(cls, result: Any, index: int = 0, decoded: bool = True) -> "RewardSample":
        """From a `GenerationResult` (frames, audio, latents, settings)."""
        s = result.settings
        return cls(prompt=s.prompt, seed=int(result.seed), index=index,
                   frames=result.frames if decoded else None, audio=result.audio if decoded else None,
                   sample_rate=int(result.sample_rate), latents=result.latents, audio_latents=result.audio_latents,
                   first=s.first)


@dataclass(frozen=True)
class Reward:
    """A named reward: `fn` per sample (or per batch with `batched`), on decoded media or on latents (`needs`)."""

    name: str
    fn: Callable[..., Any]
    needs: str = "decoded"
    batched: bool = False
    parts: tuple = ()  # a weighted sum's ((Reward, weight), ...) in order (`reward_mix.py`); () for one reward

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise RewardError(f"reward {self.name!r}: {self.fn!r} is not callable")
        if self.needs not in NEEDS:
            raise RewardError(f"reward {self.name!r} needs={self.needs!r}: must be one of {', '.join(NEEDS)}")


def reward(name: str | None = None, needs: str = "decoded", batched: bool = False):
    """Decorator marking a function as a reward: `@reward(needs="latents")`; `resolve_reward` reads the marks."""
    def mark(fn):
        fn.needs, fn.batched = needs, batched
        if name is not None:
            fn.reward_name = name
        return fn
    return mark


# ================================================================================================ checks
def _value(name: str, index: int, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, (np.ndarray, np.generic)) and (
            np.size(value) == 1):
        value = value.item()  # a one-element tensor or array, a numpy scalar
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise RewardError(f"reward {name!r} returned {value!r} for request {index}: must be a real number")
    value = float(value)
    if not math.isfinite(value):
        raise RewardError(f"reward {name!r} returned {value} for request {index}: must be finite (not NaN or inf)")
    return value


def score(reward_: Reward, samples: Sequence[RewardSample]) -> torch.Tensor:
    """(B,) float64: one checked value per sample, in order (module docstring)."""
    samples = list(samples)
    if reward_.batched:
        out = reward_.fn(samples)
        try:
            values = list(out)
        except TypeError:
            raise RewardError(f"reward {reward_.name!r} returned {type(out).__name__}: a batched reward returns "
                              f"one value per request ({len(samples)})") from None
        if len(values) != len(samples):
            raise RewardError(f"reward {reward_.name!r} returned {len(values)} values for {len(samples)} requests: "
                              "must return one per request")
    else:
        values = [reward_.fn(s) for s in samples]
    return torch.tensor([_value(reward_.name, i, v) for i, v in enumerate(values)], dtype=torch.float64)


def score_parts(reward_: Reward, samples: Sequence[RewardSample]) -> tuple[torch.Tensor, list[dict]]:
    """(total (B,) float64, parts): a weighted sum's parts each scored (`score`) and summed in their order, float64,
    `total = ((0 + w_1 * v_1) + w_2 * v_2) + ...`; parts = [{"name", "weight", "values", "mean"}] per part (values
    per request in order, mean their float64 mean). A plain reward: (`score(reward, samples)`, [])."""
    if not reward_.parts:
        return score(reward_, samples), []
    samples = list(samples)
    total = torch.zeros(len(samples), dtype=torch.float64)
    parts = []
    for part, weight in reward_.parts:
        values = score(part, samples)
        total = total + weight * values
        parts.append({"name": part.name, "weight": float(weight), "values": [float(v) for v in values],
                      "mean": float(values.mean()) if len(samples) else 0.0})
    return total, parts


def is_weight(text: str) -> bool:
    """Whether `text` reads as a number (a weighted-sum part's weight, not a function name)."""
    try:
        float(text)
    except ValueError:
        return False
    return True
