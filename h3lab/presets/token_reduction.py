"""Token reduction (`--token-reduction`): the middle blocks see horizontally paired target-video tokens.

The seed (h3-metal): "After block 3 it pairs adjacent horizontal target-video tokens while leaving text, audio,
conditions, and reference tokens exact. The complete full-resolution state is kept as a bypass. During the first ten
noisy evaluations it restores before block 40; subsequent detail-forming evaluations restore before block 30. Each
token returns as its original value plus the update learned by its pair, so within-pair detail is not discarded."
Refused at 256x256 ("Keep token reduction off at this size"), and on a mesh with CP or SP (`refuse_row_cut`; a TP
mesh runs it, byte-equal to one process).

It is a layout transform plus a bypass, applied through block hooks:

- The layout transform is `h3lab.run.layout.pair_horizontal_tokens(run.layout)`: a reduced `PackedLayout` (its AdaLN
  rows, positions, key order) and the member table. A pair's position is the mean of its members' (the run's
  positions, after any RoPE adaptation); its AdaLN row is its first member's (pairs share tag and timestep kind).
- Entering block `start` (a forward pre-hook): the full stream x (B, S, D) is kept as the bypass; the reduced stream
  is `pool = (x[m0] + x[m1]) / 2` (float32, one rounding to the stream dtype; a singleton row, and every text /
  audio / anchor / reference row, is copied exactly); the block gets the reduced `adaln_indices`, the RoPE tables of
  the reduced positions (`rope_table` through the forward's op table, traced at `blocks.{start}.token_pool`) and the
  reduced layout's key order. Every following reduced block gets the same reduced tables (a pre-hook each).
- Leaving block `end - 1` (a forward hook): each paired full row returns as `bypass + (y - pool)` of its pair (y the
  reduced output; float32, one rounding), every other row as its reduced output row unchanged. Blocks from `end`
  on, `norm_out` and the heads see the full layout again.

Schedule (sealed in the preset, `DEFAULT_SCHEDULE` is the seed's): blocks `start` .. `end - 1` are reduced, with
`end = early_end` for the first `early_evaluations` evaluations of the block stack and `end` after; block indices
count the model's blocks (layer thinning skips some of them, the schedule does not move). An *evaluation* is a pass
whose forward runs the stack (whole-velocity reuse and core reuse skip some passes); without reuse it is the pass.
An end past the last block restores after the last block. The pool / restore arithmetic is float32 elementwise
torch (row-local, batch-invariant, the same bytes in every mode), like the sampler's step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..execution import runtime
from ..run.layout import LayoutError, pair_horizontal_tokens
from .errors import PresetError
from .rope_adaptation import is_native_256

DEFAULT_SCHEDULE = {"start": 4, "end": 30, "early_end": 40, "early_evaluations": 10}
SCHEDULE_KEYS = tuple(DEFAULT_SCHEDULE)


def check_schedule(value: Any) -> dict[str, int] | None:
    """True -> `DEFAULT_SCHEDULE`, False -> None (off), or an explicit schedule dict, checked."""
    if value is True:
        return dict(DEFAULT_SCHEDULE)
    if value is False:
        return None
    if not isinstance(value, dict) or set(value) != set(SCHEDULE_KEYS):
        raise PresetError(f"token_reduction={value!r}: must be true, false or {{{', '.join(SCHEDULE_KEYS)}}}")
    bad = [k for k in SCHEDULE_KEYS if isinstance(value[k], bool) or not isinstance(value[k], int)]
    if bad:
        raise PresetError(f"token_reduction.{bad[0]}={value[bad[0]]!r}: must be an integer")
    s, e, ee, n = (value[k] for k in SCHEDULE_KEYS)
    if not (1 <= s < e <= ee) or n < 0:
        raise PresetError(f"token_reduction={value}: needs 1 <= start < end <= early_end and early_evaluations >= 0 "
                          "(block 0 always sees the full layout)")
    return {k: value[k] for k in SCHEDULE_KEYS}


def refuse_row_cut(placement: Any) -> None:
    """Token reduction on a mesh whose CP (or SP) cut gives each rank part of the packed rows: refused (one line). The
    pairs change the row count in the middle blocks and a pair's members may sit on two ranks; the row cut is made
    once, at block 0, for the full rows. On a TP mesh without SP every rank holds every row: admitted."""
    p = dict(placement or {})
    cp, sp = int(p.get("cp", 1)), bool(p.get("sp", False))
    if cp > 1 or sp:
        where = f"tp{p.get('tp', 1)}xcp{cp}" + ("+sp" if sp else "")
        raise PresetError(f"token_reduction on {where}: refused (it pairs target-video rows across the packed stream "
                          "and changes the row count after block 0, where the CP / SP row cut is made for the full "
                          "rows); use a TP mesh with --cp 1 and without --sp")


def refuse_native_256(layout: Any) -> None:
    if is_native_256(layout):
        raise PresetError("token reduction at 256x256: refused (an 8x8 token grid; the seed keeps token reduction "
                          "off at this size)")


def ends(schedule: dict[str, int], stack_runs: Sequence[bool], num_layers: int) -> tuple[int | None, ...]:
    """Per pass: the block before which the stream is restored, or None when the pass is not reduced (its forward
    skips the stack, or the schedule reduces no block of this model)."""
    out, evaluations = [], 0
    for runs in stack_runs:
        if not runs:
            out.append(None)
            continue
        end = schedule["early_end"] if evaluations < schedule["early_evaluations"] else schedule["end"]
        evaluations += 1
        end = min(end, num_layers)
        out.append(end if end > schedule["start"] else None)
    return tuple(out)


@contextlib.contextmanager
def apply_token_reduction(run: Any, schedule: dict[str, int], stack_runs: Sequence[bool]) -> Iterator[Any]:
    """Token reduction on `run` (module docstring); `stack_runs[i]`: pass i's forward runs the block stack."""
    if run.layout is None:
        raise PresetError("token reduction pairs target-video rows by their identity: the run spec carries no "
                          "layout (RunSpec(layout=...))")
    refuse_native_256(run.layout)
    model = run.model
    num_layers = len(model.transformer_blocks)
    start = schedule["start"]
    if start >= num_layers:
        raise PresetError(f"token_reduction.start={start}: the transformer has {num_layers} blocks, so no block "
                          "would see the reduced layout")
    try:
        pairs = pair_horizontal_tokens(run.layout)
    except LayoutError as err:
        raise PresetError(f"token reduction: {err}") from None
    per_pass = ends(schedule, stack_runs, num_layers)
    inputs = run.inputs
    device = inputs.video.device
    m0, m1 = pairs.members[:, 0].to(device), pairs.members[:, 1].to(device)
    inverse = pairs.inverse.to(device)
    from_pair = pairs.paired[pairs.inverse].to(device)[None, :, None]  # (1, S, 1): the full row belongs to a pair
    pos = inputs.position_ids.to(device)
    positions = ((pos[m0] + pos[m1]) / 2).to(torch.float32)  # (R, 3); the model's float32 cast, as in its forward
    key_order = pairs.layout.key_order()
    key_order = None if key_order is None else key_order.to(device)
    state: dict[str, Any] = {"end": None}

    def pool(_block, args):
        if state["end"] is None:
            return None
        x, temb, adaln_indices = args[0], args[1], args[2]
        reduced = ((x.index_select(1, m0).float() + x.index_select(1, m1).float()) * 0.5).to(x.dtype)  # (B, R, D)
        cos, sin = runtime.current_ops().rope_table(positions, model.rope.inv_freq, point=f"blocks.{start}.token_pool")
        state.update(bypass=x, baseline=reduced, tables=(adaln_indices.index_select(0, m0), (cos, sin), key_order))
        return (reduced, temb) + state["tables"]

    def reduced_tables(index: int):
        def hook(_block, args):
            if state["end"] is None or index >= state["end"]:
                return None
            return (args[0], args[1]) + state["tables"]

        return hook

    def restore(index: int):
        def hook(_block, _args, y):
            if state["end"] is None or index != state["end"] - 1:
                return None
            update = (y.float() - state["baseline"].float()).index_select(1, inverse)  # (B, S, D)
            full = torch.where(from_pair, state["bypass"].float() + update, y.index_select(1, inverse).float())
            state.update(bypass=None, baseline=None, tables=None)
            return full.to(y.dtype)

        return hook

    def forward(m, inputs, video, audio, i):
        state["end"] = per_pass[i]
        return inner(m, inputs, video, audio, i)

    inner = run.forward
    last = max((e for e in per_pass if e is not None), default=start + 1)
    handles = []
    try:
        for index in range(start, last):
            block = model.transformer_blocks[index]
            handles.append(block.register_forward_pre_hook(pool if index == start else reduced_tables(index)))
            handles.append(block.register_forward_hook(restore(index)))
        yield run.replace(forward=forward)
    finally:
        for h in handles:
            h.remove()


# ------------------------------------------------------------------------------------------------ registration
def _validate(value: dict) -> dict:
    if "token_reduction" not in value:
        return {}
    schedule = check_schedule(value["token_reduction"])
    return {} if schedule is None else {"token_reduction": schedule}


def _apply(value: dict, run: Any):
    from ..run.sampler import reuse_plan
    from .core_reuse import core_plan

    n = run.schedule.num_passes
    stack_runs = [a and b for a, b in zip(reuse_plan(n, run.reuse), core_plan(n, value.get("core_reuse", 1)))]
    return apply_token_reduction(run, value["token_reduction"], stack_runs)


def _describe(p: dict) -> list[str]:
    s = p["token_reduction"]
    return [f"token reduction: blocks {s['start']}..{s['early_end'] - 1} for the first {s['early_evaluations']} "
            f"evaluations, {s['start']}..{s['end'] - 1} after"]


def _reply(new: Any, _state: Any) -> list[str]:
    return [f"token reduction {'on' if new.token_reduction else 'off'}"] + new.preset_notices


def _register() -> None:
    from ..schema import Control, Repl, Setting, declare
    from .registry import Preset, register_preset

    register_preset(Preset(
        "token_reduction", _validate, _apply,
        lambda s, _model, _layout: {"token_reduction": dict(DEFAULT_SCHEDULE)} if s.token_reduction else {},
        _describe, order=30, apply_order=20,
        check=lambda value, run: refuse_row_cut(run.spec.placement) if "token_reduction" in value else None))
    declare(Setting(
        "token_reduction", bool, False, "pair horizontal video tokens inside the middle blocks (refused at 256x256)",
        order=100,
        command=Repl(summary="pair horizontal video tokens in the middle blocks", reply=_reply),
        control=Control("token reduction", row="presets"),
        summary=lambda on: "token reduction" if on else None, maps="RunSpec.preset token_reduction (the schedule)"))


_register()
