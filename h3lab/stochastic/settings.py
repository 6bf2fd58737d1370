"""The generation settings of the stochastic steppers, declared once in the settings schema: `stepper`, `level`,
`window` -- so `h3lab -p ... --stepper flow_sde --level 0.7 --window 1,4`, `!stepper` / `!level` / `!window`, the
panel's "stepper" row and the settings summary all come from these three declarations.

Contract
--------
- `stepper`: "euler" (the released ODE step, the default: no change to any spec, hash or replay) or one of
  `SDE_KINDS` (flow_sde = Flow-GRPO, dance_sde = DanceGRPO, cps = coefficient-preserving).
- `level`: the SDE's noise level for both modalities (flow_sde's a, dance_sde's eta, cps's a), default 0.7; the
  stepper's rule applies (a >= 0, eta >= 0, cps a in [0, 1]; 0 is the Euler step: use stepper euler).
- `window`: None (every pass stochastic) or "S,W": MixGRPO's window, SDE on passes S .. S+W-1 (0-based), the Euler
  step elsewhere; S + W must not exceed `steps`.
- Sealed: a generation with stepper != euler builds its `RunSpec` with `stepper=<kind>` and
  `stepper_params={"level": level, "seed": settings.seed, "requests": None, "window": {"start": S, "size": W} | None}`
  (the pass noise is `transitions.pass_noise(seed, batch item, pass, modality)`), normalised and checked by the
  stepper's own `check_params` -- the same object `Session.rollout` seals, so `verify` replays it.
- Rules: each value is checked as the settings are built (one-line `ValidationError` naming the value and the rule:
  CLI exit 2, the REPL/panel keep the previous settings). A `level` or `window` given with stepper euler is kept with
  a notice (it takes effect once an SDE stepper is chosen).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ValidationError
from ..schema import Control, Repl, Setting, declare
from .transitions import SDE_KINDS

EULER = "euler"
DEFAULT_LEVEL = 0.7
_WINDOW = re.compile(r"(\d+),(\d+)")


def parse_window(text: str | None) -> dict[str, int] | None:
    """ "S,W" -> {"start": S, "size": W} (None stays None); one-line `ValidationError` on another form."""
    if text is None:
        return None
    m = _WINDOW.fullmatch(text.strip())
    if m is None or int(m.group(2)) < 1:
        raise ValidationError(f"window={text!r}: must be S,W (SDE passes S..S+W-1, integers S >= 0, W >= 1) or off")
    return {"start": int(m.group(1)), "size": int(m.group(2))}


def stepper_params(settings: Any) -> dict[str, Any]:
    """The normalised `RunSpec.stepper_params` of `settings` (stepper != euler), checked by the stepper itself."""
    from ..run import RunSpecError
    from .steppers import check_params

    kind = settings.stepper
    window = parse_window(settings.window)
    if window is not None and window["start"] + window["size"] > settings.steps:
        raise ValidationError(f"window={settings.window!r}: SDE passes {window['start']}.."
                              f"{window['start'] + window['size'] - 1} exceed the {settings.steps} passes (--steps)")
    try:
        return check_params(kind, {"level": settings.level, "seed": settings.seed, "requests": None,
                                   "window": window})
    except RunSpecError as err:
        raise ValidationError(str(err)) from None


def _rule(name: str):
    """The rule of setting `name`: the whole combination is checked whichever of the three changed (module
    docstring); with stepper euler a level or window is only noted."""

    def rule(value: Any, settings: Any) -> list[str]:
        if settings.stepper != EULER:
            stepper_params(settings)
            return []
        parse_window(settings.window)
        if name == "stepper":
            return []
        shown = f"{value:g}" if isinstance(value, float) else value
        return [f"note: {name} {shown} takes effect with an SDE stepper (--stepper {'|'.join(SDE_KINDS)})"]

    return rule


def _spec(kind: str, settings: Any) -> dict[str, Any]:
    if kind == EULER:
        return {}
    return {"stepper": kind, "stepper_params": stepper_params(settings)}


def _p_window(name: str, args: list[str]) -> tuple:
    from ..schema.words import one

    text = one(name, args, "S,W|off")
    return (None,) if text == "off" else (text,)


def _reply(new: Any, _state: Any) -> list[str]:
    if new.stepper == EULER:
        return [f"stepper euler (the released ODE step){_window_words(new)}"] + list(new.notices)
    return [f"stepper {new.stepper} level {new.level:g}{_window_words(new)}, noise seed {new.seed}"]


def _window_words(s: Any) -> str:
    w = parse_window(s.window)
    return "" if w is None else f", SDE passes {w['start']}..{w['start'] + w['size'] - 1} (Euler elsewhere)"


for _setting in (
    Setting("stepper", str, EULER, "the step of each pass: euler (the released ODE, default) or an SDE with a sealed "
            "Gaussian log-density per pass: flow_sde (Flow-GRPO), dance_sde (DanceGRPO), cps", order=130,
            choices=(EULER,) + tuple(SDE_KINDS), rule=_rule("stepper"), spec=_spec,
            maps="RunSpec.stepper and RunSpec.stepper_params (level, seed, window)",
            command=Repl(usage=f"!stepper {'|'.join((EULER,) + tuple(SDE_KINDS))}",
                         summary="the step of each pass: the released Euler ODE or a stochastic SDE", reply=_reply,
                         complete=((EULER,) + tuple(SDE_KINDS),)),
            control=Control("stepper", kind="dropdown", row="stepper"),
            summary=lambda v: None if v == EULER else f"stepper {v}"),
    Setting("level", float, DEFAULT_LEVEL, "the SDE stepper's noise level (flow_sde a, dance_sde eta, cps a in "
            "[0, 1]; default 0.7)", order=131, bounds=(0.0, None), rule=_rule("level"), metavar="A",
            maps="RunSpec.stepper_params level",
            command=Repl(usage="!level A", summary="noise level of the SDE stepper", reply=_reply),
            control=Control("level", row="stepper", step=0.05),
            summary=lambda v: None if v == DEFAULT_LEVEL else f"level {v:g}"),
    Setting("window", str, None, "MixGRPO window S,W: SDE on passes S..S+W-1, Euler elsewhere (default: every pass)",
            order=132, rule=_rule("window"), metavar="S,W", maps="RunSpec.stepper_params window",
            command=Repl(usage="!window S,W|off", summary="SDE passes only inside a window (MixGRPO)",
                         parse=_p_window, complete=(("off",),), reply=_reply),
            control=Control("SDE window", kind="text", row="stepper", off=""),
            summary=lambda v: None if v is None else f"window {v}"),
):
    declare(_setting)
