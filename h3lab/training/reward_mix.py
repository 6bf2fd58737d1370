"""Weighted sums of rewards: `--reward prompt_match:1.0,brightness:0.1`.

Contract
--------
- Spelling: `PART[,PART...]`, `PART = SPEC:WEIGHT`, where SPEC is a shipped reward NAME or
  `package.module:function` (`rewards.resolve_reward`, which passes itself in; the weight is what follows the *last*
  colon) and WEIGHT a finite, non-zero number (negative weights subtract; one weight a part). Blanks around parts are
  ignored; an empty part, a part without a weight, a SPEC that does not resolve, a non-finite or zero weight, the
  same SPEC twice, or a reward server URL inside a sum is refused in one line naming the flag (`--reward`), the spec
  and the rule.
- The result is a `Reward` named by the canonical spelling (`NAME:repr(weight)` joined by `,`), batched, whose
  `parts` are the (Reward, weight) pairs in the given order and whose `needs` is "decoded" when any part needs decoded
  media ("latents" otherwise: every sample carries its latents either way). Its value per request is
  `((0 + w_1 * v_1) + w_2 * v_2) + ...` in float64 (`rewards.score_parts`, which also returns each part's values for
  the run records). A single part (`prompt_match:1.0`) is a sum of one part: its records log that part.
"""

from __future__ import annotations

import math
from typing import Callable

from .reward_base import Reward, RewardError, is_weight, score_parts

RULE = ("must be NAME:WEIGHT[,NAME:WEIGHT...] with each NAME a shipped reward or package.module:function and each "
        "WEIGHT a finite non-zero number")


def parse_parts(spec: str) -> list[tuple[str, float]]:
    """[(part spec, weight)] of a weighted-sum spelling (module docstring); one-line `RewardError` otherwise."""
    out: list[tuple[str, float]] = []
    for i, part in enumerate(spec.split(",")):
        part = part.strip()
        name, _, weight = part.rpartition(":")
        where = f"--reward {spec!r}: part {i + 1} {part!r}"
        if not part or not name or not is_weight(weight) or is_weight(name.rpartition(":")[2]):
            raise RewardError(f"{where}: {RULE}")
        value = float(weight)
        if not math.isfinite(value) or value == 0:
            raise RewardError(f"{where}: weight {weight!r} must be a finite non-zero number")
        if name.startswith(("http://", "https://")):
            raise RewardError(f"{where}: a reward server scores alone (--reward-server URL), not inside a sum")
        if name in [n for n, _ in out]:
            raise RewardError(f"{where}: {name!r} appears twice; give each reward once")
        out.append((name, value))
    return out


def _resolved(spec: str, i: int, name: str, resolve: Callable[[str], Reward]) -> Reward:
    try:
        return resolve(name)
    except RewardError as err:
        raise RewardError(f"--reward {spec!r}: part {i + 1}: {err}") from None


def mixed_reward(spec: str, resolve: Callable[[str], Reward]) -> Reward:
    """The weighted sum `spec` names (module docstring); `resolve` is `rewards.resolve_reward`, for the parts."""
    parts = tuple((_resolved(spec, i, name, resolve), weight) for i, (name, weight) in enumerate(parse_parts(spec)))
    needs = "decoded" if any(r.needs == "decoded" for r, _ in parts) else "latents"
    name = ",".join(f"{n}:{w!r}" for n, w in parse_parts(spec))

    def fn(samples):
        return [float(v) for v in score_parts(mixed, samples)[0]]

    mixed = Reward(name, fn, needs=needs, batched=True, parts=parts)
    return mixed
