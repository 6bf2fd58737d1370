"""Core reuse (`--core-reuse K`, 1..6): run the expensive block stack every K passes; refresh the rest every pass.

The seed (h3-metal): "Core reuse holds the previous full transformer residual while refreshing the patch projection
and timestep-aware head; it remains mutually exclusive with whole-velocity reuse."

What is cached: the block stack's residual R = x_out - x_in, in float32, of the last pass that ran the stack -- x_in
the packed stream entering block 0 (the `pack` output), x_out the stream leaving the last block (the input of
`norm_out`), all S packed rows. What runs every pass: the video / audio patch projections of the current latents,
the text projection and token refiner (constant across passes), `pack`, the timestep embedding, `norm_out` with the
current timestep's table, and both heads. On a core pass the stack runs and R is taken; on the other passes every
block returns its input (`_blocks.skip_blocks`) and `norm_out` receives `(x_in + R)` rounded once to the stream dtype
(float32 elementwise arithmetic: row-local, deterministic, the same bytes in every mode, like the sampler's step).

Which passes run the core: `core_plan(num_passes, K)` = `sampler.reuse_plan(num_passes, K)` -- the first pass, every
K-th pass and the last one, the same grid whole-velocity reuse evaluates on. K = 1 is the full path (no preset).

Where it lives: a forward wrapper of the run (it sets, per pass, whether the stack runs) plus two torch forward
pre-hooks -- on `transformer_blocks[0]` (takes x_in) and on `norm_out` (takes R, or substitutes x_in + R) -- all
installed by `apply_core_reuse(run, K)` for the run's duration. The model has no special case. The hooks read the
stream positionally or by name (`x`): on a CP mesh the placement's own pre-hooks, which run first, cut the rows
and pass the arguments by name; x_in and the stream at `norm_out` are then the rank's rows, and the residual
arithmetic is row-local, so each row's bytes are the one-process ones. A forward of a pass
whose core was not run earlier in the same run (drift's forward scope at such a pass) fails closed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..run.sampler import reuse_plan
from ._blocks import skip_blocks
from .errors import PresetError

MAX_CORE_REUSE = 6  # the seed: "values above 6 are not exposed because validation lost subject fidelity"


def check_core_reuse(k: Any, what: str = "core_reuse") -> int:
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_CORE_REUSE:
        raise PresetError(f"{what}={k!r}: must be an integer between 1 and {MAX_CORE_REUSE} "
                          "(1 runs the core every pass)")
    return k


def core_plan(num_passes: int, k: int) -> tuple[bool, ...]:
    """Which passes run the block stack (see the module docstring)."""
    return reuse_plan(num_passes, k)


def check_exclusive(core_reuse: int, reuse: int) -> None:
    if core_reuse > 1 and reuse > 1:
        raise PresetError(f"core_reuse={core_reuse} with reuse={reuse}: --core-reuse and --reuse are mutually "
                          "exclusive (whole-velocity reuse skips entire forwards); set one of them to 1")


@contextlib.contextmanager
def apply_core_reuse(run: Any, k: int) -> Iterator[Any]:
    """Core reuse with interval `k` on `run` (module docstring); yields the run with its forward wrapped."""
    check_core_reuse(k)
    check_exclusive(k, run.reuse)
    model, inner = run.model, run.forward
    plan = core_plan(run.schedule.num_passes, k)
    state: dict[str, Any] = {"core": True, "x_in": None, "residual": None}

    def take_input(_module, args, kwargs):
        state["x_in"] = args[0] if args else kwargs["x"]

    def head(_module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        if state["core"]:
            state["residual"] = x.float() - state["x_in"].float()  # (B, S, hidden) float32
            return None
        x = (state["x_in"].float() + state["residual"]).to(x.dtype)
        return ((x,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, "x": x})

    def forward(m, inputs, video, audio, i):
        if not plan[i] and state["residual"] is None:
            raise PresetError(f"core reuse: pass {i} reuses the block-stack residual of an earlier pass, and none "
                              "ran in this run (run the passes in order)")
        state["core"] = plan[i]
        return inner(m, inputs, video, audio, i)

    handles = []
    with skip_blocks(model, lambda _i: not state["core"]):
        try:
            handles.append(model.transformer_blocks[0].register_forward_pre_hook(take_input, with_kwargs=True))
            handles.append(model.norm_out.register_forward_pre_hook(head, with_kwargs=True))
            yield run.replace(forward=forward)
        finally:
            for h in handles:
                h.remove()


# ------------------------------------------------------------------------------------------------ registration
def _validate(value: dict) -> dict:
    k = check_core_reuse(value.get("core_reuse", 1))
    return {"core_reuse": k} if k > 1 else {}


def _describe(p: dict) -> list[str]:
    k = p["core_reuse"]
    return [f"core reuse {k}: the block stack every {k} passes and on the last; patch projections and heads every pass"]


def _reply(new: Any, _state: Any) -> list[str]:
    return [f"core reuse {new.core_reuse}"] + new.preset_notices


def _register() -> None:
    from ..schema import Control, Repl, Setting, declare
    from .registry import Preset, register_preset

    register_preset(Preset(
        "core_reuse", _validate, lambda value, run: apply_core_reuse(run, value["core_reuse"]),
        lambda s, _model, _layout: {"core_reuse": s.core_reuse} if s.core_reuse > 1 else {}, _describe,
        order=20, apply_order=40, check=lambda value, run: check_exclusive(value.get("core_reuse", 1), run.reuse)))
    declare(Setting(
        "core_reuse", int, 1, "run the block stack every K passes (1-6), heads every pass; exclusive with --reuse",
        order=90,
        command=Repl(usage="!core-reuse K", summary="run the block stack every K passes (1-6), heads every pass",
                     reply=_reply),
        control=Control("core reuse", row="presets"),
        summary=lambda k: f"core reuse {k}" if k > 1 else None, maps="RunSpec.preset core_reuse"))


_register()
