"""The ablation factors: declarative transforms of a run, and the `RunSpec.factors` field that applies them.

Contract
--------
`TABLE` maps each factor row of the matrix (A1-A3, A6, A7, H1-H14, H16; the order is the matrix order) to a
`Factor(transform, changes)`: `transform(run) -> run` perturbs a resolved run (`h3lab.run.ResolvedRun`: its inputs,
layout, schedule, stepper, op overrides, hooks or model) and `changes` names what it owns ("op:rms_norm", "stepper",
"plan", "schedule", "model", ...). `check_factors(names)` is the field's validator: known names, each once, H1 alone,
no two factors that change one thing, returned in canonical order (a model change first, then matrix order).
`apply_factors(names, run)` applies them in that order, each claiming what it changes. This module registers the
field (`h3lab.run.register_field("factors", ...)`) and the steppers of H9 and H13 ("negated_velocity",
"reordered_euler"), so a spec that names factors gets them re-derived by the one loop's `resolve` every time it runs.
The matrix (`matrix.py`) declares the rows and takes a factor row's transform from `TABLE`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from ...execution import runtime
from ...config import AUDIO
from ..drift import RowMap
from ...errors import H3Error
from ...run import DenoiseInputs, FieldProvider, ResolvedRun, ScheduleStepper, register_field, register_stepper
from ...run.sampler import DualSchedule, Schedule, timesteps


class AblationError(H3Error):
    """An unknown row or factor name or mode was asked for, or factors that cannot be combined."""


# The op the current runtime mode would dispatch to (for overrides that change only some calls).
_mode_op = runtime.mode_op


def _param_ids(params) -> set[int]:
    return {id(p) for p in params}


def _qk_norm_weights(model: Any) -> set[int]:
    """ids of the transformer blocks' Q/K RMSNorm weights (the refiner's are not targeted)."""
    return _param_ids([p for b in model.transformer_blocks for p in (b.attn.norm_q.weight, b.attn.norm_k.weight)])


def _first_target_video_row(inputs: DenoiseInputs) -> int:
    return int(inputs.video_indices[inputs.num_condition_video_rows])


def _full_head_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Standard rotate-half RoPE over all D head channels: the (S, 2*3F) half-angle tables are extended to D/2
    angles (the last axis's frequencies reused for the extra pairs), so every channel rotates (H5)."""
    half, extra = cos.shape[-1] // 2, (x.shape[-1] - cos.shape[-1]) // 2
    c = torch.cat([cos[..., :half], cos[..., half - extra : half]], dim=-1)
    s = torch.cat([sin[..., :half], sin[..., half - extra : half]], dim=-1)
    return _mode_op("rope")(x, torch.cat([c, c], dim=-1), torch.cat([s, s], dim=-1))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False):
    out = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), attn_mask=mask, is_causal=causal
    )
    return out.permute(0, 2, 1, 3)


def _packed_attention(seq_len: int, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Attention override that applies `fn` to the packed document (S rows) and the mode's op to the refiner."""

    def attention(q, k, v, key_order=None):
        if q.shape[1] != seq_len:
            return _mode_op("attention")(q, k, v, key_order)
        return fn(q, k, v)

    return attention


def _split_kv_reversed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A CP-style plan: keys in two blocks, each block's partial output rounded to the activation dtype with its
    float32 log-sum-exp, merged in reverse block order (A7)."""
    S, D = k.shape[1], q.shape[-1]
    half = S // 2
    parts = []
    for lo, hi in ((half, S), (0, half)):  # reversed merge order
        qf, kf, vf = (t.float().permute(0, 2, 1, 3) for t in (q, k[:, lo:hi], v[:, lo:hi]))
        s = qf @ kf.transpose(-1, -2) / math.sqrt(D)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        parts.append(((torch.softmax(s, dim=-1) @ vf).to(q.dtype), lse))
    lse = torch.logsumexp(torch.cat([p[1] for p in parts], dim=-1), dim=-1, keepdim=True)
    out = sum(p[0].float() * torch.exp(p[1] - lse) for p in parts)
    return out.to(q.dtype).permute(0, 2, 1, 3).contiguous()


class _NegatedVelocity(ScheduleStepper):
    """x0 = x_t - sigma * v (the flow-matching sign) instead of H3's data-ward + (H9)."""

    def step(self, modality, i, sample, velocity):
        return super().step(modality, i, sample, -velocity)


class _ReorderedEuler(ScheduleStepper):
    """x_next = x_t + (sigma - sigma_next) * v in float32: algebraically the H3 blend, rounded differently (H13)."""

    def step(self, modality, i, sample, velocity):
        s = getattr(self.schedule, modality)
        return (sample.float() + (s.sigmas[i] - s.sigmas[i + 1]) * velocity.float()).to(sample.dtype)


def _generic_grid(num_points: int, shift: float) -> Schedule:
    """A generic flow-matching grid: shifted linspace(1, 1/1000, num_points - 1), terminal 0 appended (H11)."""
    base = torch.linspace(1.0, 1.0 / 1000, num_points - 1, dtype=torch.float32)
    sigmas = torch.cat([shift * base / (1 + (shift - 1) * base), torch.zeros(1)])
    return Schedule(float(shift), num_points, sigmas, timesteps(sigmas))


def _permutation(n: int, seed: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------- factors: transforms of a run
def _overriding(run: ResolvedRun, **ops: Callable[..., Any]) -> ResolvedRun:
    return run.replace(overrides={**run.overrides, **ops})


def _layout_of(run: ResolvedRun, name: str) -> Any:
    if run.layout is None:
        raise AblationError(f"ablation {name} rebuilds the packed layout or its timestep plan: the run spec carries "
                            "no layout (RunSpec(layout=...))")
    return run.layout


def _euler_only(run: ResolvedRun, name: str) -> None:
    if run.stepper != "euler":
        raise AblationError(f"ablation {name} replaces the Euler step: this run steps with {run.stepper!r}")


def _t_A1(run):
    x = run.inputs
    pos = x.position_ids.clone()
    pos[_first_target_video_row(x), 1] += 1.0  # one row one unit along h
    return run.replace(inputs=x.replace(position_ids=pos))


def _t_A2(run):
    targets = _qk_norm_weights(run.model)

    def rms_norm(x, weight, eps):
        return _mode_op("rms_norm")(x, weight, eps * 1e4 if id(weight) in targets else eps)

    return _overriding(run, rms_norm=rms_norm)


def _t_A3(run):
    S = run.inputs.seq_len
    half = S // 2
    mask = torch.zeros(S, S, dtype=torch.bool)
    mask[:half, :half] = True
    mask[half:, half:] = True
    return _overriding(run, attention=_packed_attention(
        S, lambda q, k, v: _sdpa(q, k, v, mask=mask.to(q.device)).contiguous()))


def _t_A6(run):
    def modulate(x, scale, shift, index):
        # float32 throughout, one rounding at the end (the reference rounds after every bfloat16 op)
        y = x.float() * (1.0 + scale.index_select(0, index).float()) + shift.index_select(0, index).float()
        return y.to(x.dtype)

    return _overriding(run, modulate=modulate)


def _t_A7(run):
    return _overriding(run, attention=_packed_attention(run.inputs.seq_len, _split_kv_reversed))


def _t_H1(run):
    layout = _layout_of(run, "H1").permute(_permutation(run.inputs.seq_len, 11), leave_behind="position_ids")
    return run.replace(layout=layout, inputs=run.inputs.resealed(layout, run.schedule),
                       row_map=RowMap(packed_order=layout.canonical_order()))


def _t_H2(run):
    tags = run.inputs.token_tags.clone()
    tags[_first_target_video_row(run.inputs)] = AUDIO
    return run.replace(inputs=run.inputs.replace(token_tags=tags))


def _t_H3(run):
    row = _first_target_video_row(run.inputs)
    plan = []
    for t, idx in run.inputs.plan:
        idx = idx.clone()
        idx[row] = (idx[row] + 1) % t.numel()
        plan.append((t, idx))
    return run.replace(inputs=run.inputs.replace(plan=plan))


def _t_H4(run):
    state = {"final": False}

    def where(point, t):
        if point.name == "blocks.0.adaln_table":
            state["final"] = False
        elif point.name == "final_table":
            state["final"] = True
        return None

    def remap(index: torch.Tensor, rows: int) -> torch.Tensor:
        T = rows // 3  # modality-major addressing tag * T + timestep_index of a timestep-major table
        return (index % 3) * T + index // 3

    def modulate(x, scale, shift, index):
        index = index if state["final"] else remap(index, scale.shape[0])
        return _mode_op("modulate")(x, scale, shift, index)

    def gated_residual(residual, gate, index, y):
        index = index if state["final"] else remap(index, gate.shape[0])
        return _mode_op("gated_residual")(residual, gate, index, y)

    return _overriding(run, modulate=modulate, gated_residual=gated_residual).replace(hooks=run.hooks + (where,))


def _t_H5(run):
    return _overriding(run, rope=_full_head_rope)


def _t_H6(run):
    targets = _qk_norm_weights(run.model)
    pending: list[tuple[torch.Tensor, float]] = []

    def rms_norm(x, weight, eps):
        if id(weight) in targets:
            pending.append((weight, eps))  # q then k: applied after the rotation instead
            return x
        return _mode_op("rms_norm")(x, weight, eps)

    def rope(x, cos, sin):
        weight, eps = pending.pop(0)
        return _mode_op("rms_norm")(_mode_op("rope")(x, cos, sin), weight, eps)

    return _overriding(run, rms_norm=rms_norm, rope=rope)


def _t_H7(run):
    w = run.model.proj_in.weight

    def linear(x, weight, bias=None):
        if weight is w:  # the float32 video input projection, computed in bfloat16
            b = None if bias is None else bias.to(torch.bfloat16)
            return F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16), b).to(x.dtype)
        return _mode_op("linear")(x, weight, bias)

    return _overriding(run, linear=linear)


def _t_H8(run):
    return _overriding(run, attention=_packed_attention(
        run.inputs.seq_len, lambda q, k, v: _sdpa(q, k, v, causal=True).contiguous()))


def _t_H9(run):
    _euler_only(run, "H9")
    return run.replace(stepper="negated_velocity")


def _t_H10(run):
    s, device = run.schedule, run.inputs.video.device
    plan = _layout_of(run, "H10").timestep_plan(s.video.sigmas[:-1], s.audio.sigmas[:-1])  # t = sigma
    return run.replace(inputs=run.inputs.replace(plan=[(t.to(device), i.to(device)) for t, i in plan]))


def _with_schedule(run: ResolvedRun, schedule: DualSchedule, name: str) -> ResolvedRun:
    return run.replace(schedule=schedule, inputs=run.inputs.resealed(_layout_of(run, name), schedule))


def _t_H11(run):
    s = run.schedule
    return _with_schedule(run, DualSchedule(_generic_grid(s.num_points, s.video.shift),
                                            _generic_grid(s.num_points, s.audio.shift)), "H11")


def _t_H12(run):
    s = run.schedule
    return _with_schedule(run, DualSchedule(s.video, Schedule.build(s.num_points, s.video.shift)), "H12")


def _t_H13(run):
    _euler_only(run, "H13")
    return run.replace(stepper="reordered_euler")


def _t_H14(run):
    def select_rows(x, index):
        return _mode_op("select_rows")(x, index.roll(1))  # stale selection: every row one off

    return _overriding(run, select_rows=select_rows)


_OTHER_VARIANT = {"transformer": "transformer_ref", "transformer_ref": "transformer"}


def _t_H16(run):
    other = _OTHER_VARIANT.get(run.spec.variant)
    if other is None:
        raise AblationError(f"ablation H16 swaps transformer/ and transformer_ref/: this run's model is "
                            f"{run.spec.variant!r}")
    return run.replace(model=run.model_for(other, "ablation H16"))


# ================================================================================================= the table
@dataclass(frozen=True)
class Factor:
    """A factor of a run: `transform(run) -> run` and the things it `changes` (no two factors of one spec share one)."""

    transform: Callable[[ResolvedRun], ResolvedRun]
    changes: tuple[str, ...]


TABLE: dict[str, Factor] = {
    "A1": Factor(_t_A1, ("position_ids",)),
    "A2": Factor(_t_A2, ("op:rms_norm",)),
    "A3": Factor(_t_A3, ("op:attention",)),
    "A6": Factor(_t_A6, ("op:modulate",)),
    "A7": Factor(_t_A7, ("op:attention",)),
    "H1": Factor(_t_H1, ("layout",)),
    "H2": Factor(_t_H2, ("token_tags",)),
    "H3": Factor(_t_H3, ("plan",)),
    "H4": Factor(_t_H4, ("op:modulate", "op:gated_residual")),
    "H5": Factor(_t_H5, ("op:rope",)),
    "H6": Factor(_t_H6, ("op:rms_norm", "op:rope")),
    "H7": Factor(_t_H7, ("op:linear",)),
    "H8": Factor(_t_H8, ("op:attention",)),
    "H9": Factor(_t_H9, ("stepper",)),
    "H10": Factor(_t_H10, ("plan",)),
    "H11": Factor(_t_H11, ("schedule", "plan")),
    "H12": Factor(_t_H12, ("schedule", "plan")),
    "H13": Factor(_t_H13, ("stepper",)),
    "H14": Factor(_t_H14, ("op:select_rows",)),
    "H16": Factor(_t_H16, ("model",)),
}
# The rows that are factors of a run, in matrix order (all DRIFT rows of trajectory scope but H15, and A7).
FACTORS = tuple(TABLE)


# ============================================================================== the run spec's `factors` field
def _factor_rank(name: str) -> tuple[int, int]:
    """Canonical order: a factor that swaps the model first (the others read the model they perturb), then the
    matrix order."""
    return (0 if "model" in TABLE[name].changes else 1, FACTORS.index(name))


def check_factors(names: Any) -> list[str]:
    """The `factors` of a RunSpec, checked and in canonical order: known factor names, each once, H1 alone, no two
    that change one thing (an op, the stepper, the plan, the schedule, the model, ...)."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise AblationError(f"factors={names!r}: must be a list of factor names")
    unknown = [n for n in names if n not in FACTORS]
    if unknown:
        raise AblationError(f"ablation factor(s) {unknown}: must be among {', '.join(FACTORS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise AblationError(f"ablation factor(s) {twice} given twice: switch a factor on once")
    if "H1" in names and len(names) > 1:
        raise AblationError("ablation H1 permutes the packed rows: switch it on alone")
    owner: dict[str, str] = {}
    for name in sorted(names, key=_factor_rank):
        for target in TABLE[name].changes:
            if target in owner:
                raise AblationError(f"ablation {name}: changes {target}, which {owner[target]} changes too: "
                                    "switch one of them off")
            owner[target] = name
    return sorted(names, key=_factor_rank)


@contextlib.contextmanager
def apply_factors(names: list[str], run: ResolvedRun) -> Iterator[ResolvedRun]:
    """Each factor's transform in turn (canonical order), each claiming what it changes."""
    for name in names:
        factor = TABLE[name]
        run = factor.transform(run.replace(changed=run.claim(f"ablation {name}", *factor.changes)))
    yield run


register_field("factors", FieldProvider(validate=check_factors, apply=apply_factors), replace=True)
register_stepper("negated_velocity", _NegatedVelocity, replace=True)
register_stepper("reordered_euler", _ReorderedEuler, replace=True)
