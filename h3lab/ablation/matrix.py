"""The ablation matrix: the rows (`ROWS`, `Ablation`, `Expected`), the factor transforms of a run and their
`RunSpec.factors` provider, the probes, and the runner (`run_ablation`, `run_matrix`, `summarize`,
`format_table`). The contract is the package docstring (`h3lab.ablation`)."""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from .. import runtime
from ..config import AUDIO
from ..drift import DriftError, DriftPoint, DriftReport, Execution, RowMap, capture, compare
from ..errors import H3Error
from ..hashing import model_fingerprint, tensor_digest
from ..run import (
    DenoiseInputs,
    FieldProvider,
    ResolvedRun,
    RunSpec,
    ScheduleStepper,
    model_forward,
    register_field,
    register_stepper,
)
from ..sampler import CONDITION_T, DualSchedule, Schedule, draw_noise, noise_mix, timesteps
from ..trajectory import TrajectoryRecorder, load
from .bench import Bench, _ones_tags, make_inputs, tiny_bench  # noqa: F401 - re-exported

KINDS = ("PASS", "DRIFT", "REJECTED", "N/A")


class AblationError(H3Error):
    """An unknown row or factor name or mode was asked for, or factors that cannot be combined."""


# =================================================================================================== signatures
@dataclass(frozen=True)
class Expected:
    kind: str
    point: str | None = None
    step: int | None = None
    block_point: str | None = None

    def describe(self) -> str:
        if self.kind == "PASS":
            return "PASS byte-equal"
        if self.kind == "DRIFT":
            where = "scheduler construction" if self.step == -1 else f"pass {self.step}"
            block = f"; first in-block drift {self.block_point}" if self.block_point else ""
            return f"EXPECTED DRIFT at {self.point} ({where}){block}"
        if self.kind == "REJECTED":
            return "REJECTED as non-comparable"
        return "N/A"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "point": self.point, "step": self.step, "block_point": self.block_point}


PASS = Expected("PASS")


def drift_at(point: str, step: int = 0, block_point: str | None = None) -> Expected:
    return Expected("DRIFT", point, step, block_point)


@dataclass(frozen=True)
class Ablation:
    """One row of the matrix. `probe(bench, mode) -> (reference arm, probe arm)` for comparison rows; `check(bench,
    mode) -> (status, observed, passed, report)` for N/A and control rows without two arms. A factor row also has
    `transform(run) -> run` (a `ResolvedRun` with the perturbation applied) and the things it `changes`; its probe
    is the bench spec with the factor on."""

    name: str
    factor: str
    description: str
    apply: str
    expected: Expected
    mode: str
    scope: str
    rfc: str
    probe: Callable[["Bench", str], tuple[Execution, Execution]] | None = None
    check: Callable[["Bench", str], tuple[str, str, bool | None, DriftReport | None]] | None = None
    transform: Callable[[ResolvedRun], ResolvedRun] | None = None
    changes: tuple[str, ...] = ()
    distributed: str = ""  # a distributed row: what its arms run (h3lab.ablation.distributed)


# ============================================================================================= perturbations
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


def _batched(bench: Bench, position: int, size: int, seed: int) -> DenoiseInputs:
    """The bench request at batch `position` of `size`, the other items independent random requests."""
    g = torch.Generator().manual_seed(seed)
    x = bench.inputs

    def stack(t: torch.Tensor) -> torch.Tensor:
        items = [torch.randn(t.shape, generator=g, dtype=t.dtype) for _ in range(size)]
        items[position] = t
        return torch.cat(items, dim=0)

    return x.replace(text=stack(x.text), video=stack(x.video), audio=stack(x.audio))


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


# ------------------------------------------------------------------------------------------ other probes
def _factor_probe(name: str):
    """The probe of a factor row: the bench spec, and the bench spec with the factor switched on."""

    def probe(bench: Bench, mode: str):
        ref = bench.reference(mode)
        return ref, ref.with_spec(factors=(name,), label=name)

    probe.__name__ = probe.__qualname__ = f"probe_{name}"
    return probe


def _probe_repeat(scope: str):
    def probe(bench: Bench, mode: str):
        ref = bench.reference(mode, scope)
        return ref, ref.replace(label=f"repeat:{mode}")

    return probe


def _probe_sealed_replay(bench: Bench, mode: str):
    """A0 / H-C2: the reference trajectory sealed to disk, loaded back, and replayed from its sealed run spec."""
    key = ("sealed", mode)
    if key not in bench.cache:
        traj = bench.reference_trajectory(mode)
        folder = Path(tempfile.mkdtemp(prefix="h3lab-ablation-"))
        bench.cache[key] = load(traj.seal(folder / "reference"))
    sealed = bench.cache[key]
    replay = Execution(sealed.spec, bench.model, label=f"sealed-replay:{mode}", models=bench.models,
                       recorder=TrajectoryRecorder())
    return bench.reference(mode), replay


def _check_A5(bench, mode):
    """No KV cache: three calls (x1, x2, x1) on one model give byte-equal first and third outputs, and the model
    holds no cache state."""
    x1 = bench.inputs
    x2 = _batched(bench, 1, 2, seed=99)
    x2 = x2.replace(text=x2.text[:1], video=x2.video[:1], audio=x2.audio[:1])  # an unrelated request, same layout
    with runtime.use_mode(mode), torch.no_grad():
        first = model_forward(bench.model, x1, x1.video, x1.audio, 0)
        model_forward(bench.model, x2, x2.video, x2.audio, 0)
        third = model_forward(bench.model, x1, x1.video, x1.audio, 0)
    stateless = all(tensor_digest(a) == tensor_digest(b) for a, b in zip(first, third))
    cache_attrs = [n for n in ("past_key_values", "kv_cache", "cache") if getattr(bench.model, n, None) is not None]
    ok = stateless and not cache_attrs
    observed = ("N/A: no KV cache (calls x1, x2, x1 give byte-equal outputs for x1; no cache state)" if ok else
                f"cache semantics detected: stateless={stateless}, cache attributes {cache_attrs}")
    return "N/A" if ok else "FAIL", observed, ok, None


def _probe_C1(bench, mode):
    ref = bench.reference(mode)
    return ref, ref.with_spec(inputs=_batched(bench, 1, 2, seed=7), label="C1 batch[1/2]").replace(
        row_map=RowMap(batch_index=1))


def _check_C2(bench, mode):
    row = run_ablation("H-C2", bench, mode)
    ok = row["passed"] is True
    observed = f"N/A: no autoregressive cache handoff in H3; replaced by H-C2 ({row['observed']})"
    return "N/A" if ok else "FAIL", observed, ok, None


def _probe_H15(bench, mode):
    """The anchor rows re-made from another noise draw: from the clean anchor latents when the bench kept them
    (`parts["x0"]`), else from the sealed (already augmented) rows — the second case is a double augmentation."""
    x = bench.inputs
    ncv = x.num_condition_video_rows
    x0 = bench.parts.get("x0", x.video[:, :ncv]).to(x.video.device)
    g = torch.Generator().manual_seed(int(bench.parts.get("seed", 0)) + 1000)
    noise = draw_noise(tuple(x0.shape), g, device=x.video.device)
    video = torch.cat([noise_mix(x0, noise, CONDITION_T).to(x.video.dtype), x.video[:, ncv:]], dim=1)
    ref = bench.reference(mode)
    return ref, ref.with_spec(inputs=x.replace(video=video), label="H15")


def _probe_HC1(bench, mode):
    ref = bench.reference(mode, "forward")
    return ref, ref.with_spec(inputs=_batched(bench, 0, 3, seed=5), label="H-C1 batch[0/3]").replace(
        row_map=RowMap(batch_index=0))


def _probe_HC3(bench, mode):
    layout = bench.layout.permute(_permutation(bench.inputs.seq_len, 13))
    ref = bench.reference(mode)
    # The permuted layout's sealed inputs carry its key_order, so attention visits keys canonically: no override.
    probe = ref.with_spec(inputs=bench.inputs_for(layout=layout), layout=layout, label="H-C3 permuted")
    return ref, probe.replace(row_map=RowMap(packed_order=layout.canonical_order()))


def _probe_HC6(bench, mode):
    ref = bench.reference(mode, "forward").replace(grad=True, checkpointing=False, label=f"checkpointing off:{mode}")
    return ref, ref.replace(checkpointing=True, label=f"checkpointing on:{mode}")


def _check_HC7(bench, mode):
    """Repeated FL2VA / Ref2VA preprocessing: layouts, their JSON artifacts and the sealed inputs built twice are
    identical; component hashes (weights of both variants, snapshot files) are identical when taken twice."""
    from ..layout import Reference, build_layout

    cfg = bench.model.config
    mismatches = []
    builds = {
        "fl2va": lambda: build_layout("fl2va", _ones_tags(5), 2, 4, 4, 3, anchors=("first", "last")),
        "ref2va": lambda: build_layout("ref2va", _ones_tags(5), 2, 4, 4, 3,
                                       references=(Reference.image(4, 4), Reference.audio(2))),
    }
    for task, build in builds.items():
        a, b = build(), build()
        if a.sha256() != b.sha256() or a.to_json() != b.to_json():
            mismatches.append(f"{task} layout")
        ia = make_inputs(cfg, a, bench.schedule, 3)
        ib = make_inputs(cfg, b, bench.schedule, 3)
        ha = {k: tensor_digest(v) for k, v in ia.tensors().items()}
        hb = {k: tensor_digest(v) for k, v in ib.tensors().items()}
        if ha != hb:
            mismatches.append(f"{task} sealed inputs")
    for name, m in (("transformer", bench.model), ("transformer_ref", bench.variant)):
        if model_fingerprint(m) != model_fingerprint(m) or _weights_digest(m) != _weights_digest(m):
            mismatches.append(f"{name} weights")
    if bench.snapshot is not None:
        from ..checkpoint.info import component_hash

        for comp in ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder"):
            folder = bench.snapshot / comp
            if folder.is_dir() and component_hash(folder) != component_hash(folder):
                mismatches.append(f"{comp} component hash")
    ok = not mismatches
    observed = ("PASS: fl2va/ref2va layouts, layout JSON, sealed inputs and component hashes identical over two builds"
                if ok else f"differs: {', '.join(mismatches)}")
    return "PASS" if ok else "FAIL", observed, ok, None


def _weights_digest(model: Any) -> str:
    return "|".join(f"{n}:{tensor_digest(t)}" for n, t in model.state_dict().items())


# ================================================================================================== the matrix
def _row(name, factor, description, apply, expected, mode, scope, rfc, probe=None, check=None, transform=None,
         changes=()) -> Ablation:
    if transform is not None:
        probe = _factor_probe(name)
    return Ablation(name, factor, description, apply, expected, mode, scope, rfc, probe, check, transform,
                    tuple(changes))


def _distributed(name, factor, description, expected, scope, rfc, arms, transform=None, changes=()) -> Ablation:
    return Ablation(name, factor, description, "distributed", expected, "strict", scope, rfc,
                    transform=transform, changes=tuple(changes), distributed=arms)


ROWS: dict[str, Ablation] = {r.name: r for r in (
    # ---- 6.1 base taxonomy
    _row("A0", "Strict shared replay",
         "the strict reference trajectory sealed to disk, loaded, and replayed from its sealed inputs",
         "control", PASS, "strict", "trajectory", "PASS, byte-equal", probe=_probe_sealed_replay),
    _row("A1", "Position / RoPE", "one target video row moved one unit along h in position_ids", "input change",
         drift_at("rope_cos", 0, "blocks.0.q_rope"), "off", "trajectory",
         "EXPECTED DRIFT at first affected attention layer", transform=_t_A1, changes=("position_ids",)),
    _row("A2", "Q/K preprocessing", "block Q/K RMSNorm epsilon 1e-5 -> 0.1 (refiner norms untouched)",
         "op override", drift_at("blocks.0.q_norm"), "off", "trajectory", "EXPECTED DRIFT at Q/K norm or QK",
         transform=_t_A2, changes=("op:rms_norm",)),
    _row("A3", "Mask / sequence boundary", "the packed document split in two halves that do not attend to each other",
         "op override", drift_at("blocks.0.attention"), "off", "trajectory", "EXPECTED DRIFT at attention",
         transform=_t_A3, changes=("op:attention",)),
    _distributed("A4", "TP/CP logical ownership", "CP ranks holding each other's rows (and their metadata)",
                 Expected("REJECTED"), "forward", "REJECTED as non-comparable",
                 "one process vs cp 2 with the row shards rotated (2 gloo ranks)"),
    _row("A5", "KV-cache identity / layout", "no KV cache in H3: checks the model carries no state across calls",
         "control", Expected("N/A"), "off", "forward", "N/A; fail if a runtime silently introduces cache semantics",
         check=_check_A5),
    _row("A6", "Precision / rounding policy",
         "AdaLN modulation computed in float32 and rounded once (cast point moved)",
         "op override", drift_at("blocks.0.modulate1"), "off", "trajectory", "EXPECTED DRIFT at changed boundary",
         transform=_t_A6, changes=("op:modulate",)),
    _distributed("A7", "KV block plan / merge order",
                 "a CP ring-attention plan (2 KV blocks per rank, online softmax, bf16 running output) merged in "
                 "canonical block order vs in rank order", drift_at("blocks.0.attention"), "forward",
                 "EXPECTED DRIFT when order changes", "cp 2 ring canonical merge vs cp 2 ring rank-order merge (2 gloo "
                 "ranks); as a factor of one process: two KV blocks with bf16 partials merged in reverse order",
                 transform=_t_A7, changes=("op:attention",)),
    _distributed("C0", "TP partition preserving head mapping",
                 "the row-parallel layers partitioned by output columns (n_split) instead of K chunks, heads kept on "
                 "their ranks", PASS, "forward", "PASS, byte-equal", "one process vs tp 2 n_split (2 gloo ranks)"),
    _row("C1", "Sample alone vs packed batch row", "the request at batch position 1 of 2 beside another request",
         "input change", PASS, "strict", "trajectory", "PASS, byte-equal", probe=_probe_C1),
    _row("C2", "Prefill tail vs decode tail", "no autoregressive cache handoff in H3; runs H-C2 instead", "control",
         Expected("N/A"), "strict", "trajectory", "N/A; replaced by H-C2", check=_check_C2),
    # ---- 6.2 H3-specific probes
    _row("H1", "Packed row order", "rows permuted, position_ids left unpermuted (illegal permutation)",
         "layout change", drift_at("rope_cos", 0, "blocks.0.q_rope"), "off", "trajectory",
         "packed_index_copy or first MM-RoPE/AdaLN use", transform=_t_H1, changes=("layout",)),
    _row("H2", "Modality tag", "one target video row tagged audio", "layout change", drift_at("blocks.0.modulate1"),
         "off", "trajectory", "first block AdaLN modulation", transform=_t_H2, changes=("token_tags",)),
    _row("H3", "Timestep-table index", "one target video row's timestep index offset by one (every pass)",
         "layout change", drift_at("blocks.0.modulate1"), "off", "trajectory", "first block AdaLN modulation",
         transform=_t_H3, changes=("plan",)),
    _row("H4", "AdaLN table layout", "blocks address the timestep-major table modality-major (tag*T + t_index)",
         "op override", drift_at("blocks.0.modulate1"), "off", "trajectory", "first block AdaLN gather",
         transform=_t_H4, changes=("op:modulate", "op:gated_residual")),
    _row("H5", "Partial MM-RoPE", "standard rotate-half RoPE over all head channels instead of 2*3*F",
         "op override", drift_at("blocks.0.q_rope"), "off", "trajectory", "first layer Q/K after RoPE",
         transform=_t_H5, changes=("op:rope",)),
    _row("H6", "Q/K norm and RoPE order", "RoPE applied before the Q/K RMSNorm", "op override",
         drift_at("blocks.0.q_norm"), "off", "trajectory", "first layer Q/K",
         transform=_t_H6, changes=("op:rms_norm", "op:rope")),
    _row("H7", "Mixed precision", "the float32 video input projection computed in bfloat16", "op override",
         drift_at("video_proj_in"), "off", "trajectory", "corresponding projection or timestep MLP",
         transform=_t_H7, changes=("op:linear",)),
    _row("H8", "Attention document", "causal mask over the packed document", "op override",
         drift_at("blocks.0.attention"), "off", "trajectory", "first attention softmax/output",
         transform=_t_H8, changes=("op:attention",)),
    _row("H9", "Velocity sign", "x0 = x_t - sigma*v", "sampler change", drift_at("scheduler.video"), "off",
         "trajectory", "first scheduler step", transform=_t_H9, changes=("stepper",)),
    _row("H10", "Timestep convention", "the model sees t = sigma instead of 1 - sigma", "sampler change",
         drift_at("time_sinusoid"), "off", "trajectory", "timestep embedding before first block",
         transform=_t_H10, changes=("plan",)),
    _row("H11", "Sigma grid", "generic flow-matching grid: shifted linspace(1, 1/1000) + terminal 0",
         "sampler change", drift_at("schedule.video_sigmas", -1), "off", "trajectory",
         "scheduler construction or first differing step", transform=_t_H11, changes=("schedule", "plan")),
    _row("H12", "Dual scheduler ownership", "audio shares the video grid (shift 12)", "sampler change",
         drift_at("schedule.audio_sigmas", -1), "off", "trajectory", "first modality whose sigma differs",
         transform=_t_H12, changes=("schedule", "plan")),
    _row("H13", "Euler arithmetic", "x_next = x_t + (sigma - sigma_next) * v (reordered expression)",
         "sampler change", drift_at("scheduler.video"), "off", "trajectory", "scheduler step",
         transform=_t_H13, changes=("stepper",)),
    _row("H14", "Output-row selection", "stale selection index (every selected row one off)", "op override",
         drift_at("video_out"), "off", "trajectory", "output selection", transform=_t_H14, changes=("op:select_rows",)),
    _row("H15", "Conditioning augmentation", "anchor noise drawn from another seed", "input change",
         drift_at("input.video"), "off", "trajectory", "input latent before transformer", probe=_probe_H15),
    _row("H16", "Variant identity", "the Ref2VA transformer (transformer_ref/) runs the FL2VA layout",
         "model change", drift_at("video_proj_in"), "off", "trajectory", "checkpoint mapping or packed input",
         transform=_t_H16, changes=("model",)),
    _distributed("H17", "Distributed metadata", "hidden rows sharded, per-row metadata not (local row j reads "
                 "global row j)", drift_at("blocks.0.modulate1"), "forward", "first local AdaLN/MM-RoPE use",
                 "one process vs cp 2 with the metadata left unsharded (2 gloo ranks)"),
    # ---- 6.3 controls
    _row("H-C0", "Repeat identical one-step model call", "one strict forward at pass 0, twice", "control", PASS,
         "strict", "forward", "bitwise zero drift", probe=_probe_repeat("forward")),
    _row("H-C1", "Request alone vs same batch row", "one strict forward: the request at batch position 0 of 3",
         "input change", PASS, "strict", "forward", "bitwise zero drift", probe=_probe_HC1),
    _row("H-C2", "Same initial noise, complete trajectory",
         "the whole strict trajectory re-run from the same (sealed) inputs", "control", PASS, "strict", "trajectory",
         "bitwise zero drift at every step", probe=_probe_sealed_replay),
    _row("H-C3", "Canonical vs consistent row permutation",
         "rows and every metadata tensor permuted; keys visited in canonical order", "layout change", PASS, "strict",
         "trajectory", "outputs equal after inverse permutation", probe=_probe_HC3),
    _distributed("H-C4", "TP1 vs TP2/TP4/TP8", "the strict trajectory at every TP degree the config admits (<= 4 "
                 "ranks)", PASS, "trajectory", "bitwise zero drift", "one process vs tp 2/4/8 (gloo ranks)"),
    _distributed("H-C5", "CP1 vs accepted CP topology", "the strict trajectory at every CP degree the config admits, "
                 "uneven row shards", PASS, "trajectory", "bitwise zero drift", "one process vs cp 2/3/4 (gloo ranks)"),
    _row("H-C6", "Gradient checkpointing off vs on", "training forward + backward of a fixed probe loss",
         "model change", PASS, "off", "forward", "byte-equal forward and accepted gradient profile", probe=_probe_HC6),
    _row("H-C7", "FL2VA/Ref2VA repeated preprocessing", "layouts, sealed inputs and component hashes built twice",
         "control", PASS, "off", "-", "identical packed-layout artifact and component hashes", check=_check_HC7),
)}

ORDER = tuple(ROWS)
# The rows that are factors of a run: a transform of its RunSpec (all DRIFT rows of trajectory scope but H15).
FACTORS = tuple(name for name, row in ROWS.items() if row.transform is not None)


# ============================================================================== the run spec's `factors` field
def _factor_rank(name: str) -> tuple[int, int]:
    """Canonical order: a factor that swaps the model first (the others read the model they perturb), then ORDER."""
    return (0 if "model" in ROWS[name].changes else 1, ORDER.index(name))


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
        for target in ROWS[name].changes:
            if target in owner:
                raise AblationError(f"ablation {name}: changes {target}, which {owner[target]} changes too: "
                                    "switch one of them off")
            owner[target] = name
    return sorted(names, key=_factor_rank)


@contextlib.contextmanager
def apply_factors(names: list[str], run: ResolvedRun) -> Iterator[ResolvedRun]:
    """Each factor's transform in turn (canonical order), each claiming what it changes."""
    for name in names:
        row = ROWS[name]
        run = row.transform(run.replace(changed=run.claim(f"ablation {name}", *row.changes)))
    yield run


register_field("factors", FieldProvider(validate=check_factors, apply=apply_factors), replace=True)
register_stepper("negated_velocity", _NegatedVelocity, replace=True)
register_stepper("reordered_euler", _ReorderedEuler, replace=True)


# ================================================================================================ running rows
def _view(report: Any) -> tuple[bool, Any, Any, int]:
    """(equal, first, first_in_block, compared) of a `DriftReport` or of its `to_dict()` (points as `DriftPoint`s)."""
    if not isinstance(report, dict):
        return report.equal, report.first, report.first_in_block, report.compared

    def point(d):
        if d is None:
            return None
        shapes = {k: tuple(d[k]) if d.get(k) else None for k in ("shape_a", "shape_b")}
        return DriftPoint(**{**d, **shapes})

    return report["equal"], point(report["first"]), point(report["first_in_block"]), report["compared"]


def _observe(expected: Expected, report: Any) -> tuple[str, str, bool]:
    equal, first, first_in_block, compared = _view(report)
    if equal:
        status, observed = "PASS", f"PASS byte-equal ({compared} points compared)"
    else:
        status, observed = "DRIFT", f"DRIFT at {first}"
        if first_in_block is not None and first_in_block.point != first.point:
            observed += f"; first in-block drift {first_in_block.point}"
    if expected.kind == "PASS":
        return status, observed, equal
    if expected.kind == "DRIFT":
        ok = (not equal and first.point == expected.point and first.step == expected.step)
        if ok and expected.block_point is not None:
            ok = first_in_block is not None and first_in_block.point == expected.block_point
        return status, observed, ok
    return status, observed, False


def _run_distributed(row: Ablation, bench: "Bench", mode: str) -> dict[str, Any]:
    """A distributed row: its comparisons on local gloo ranks, each judged against the row's signature."""
    from .distributed import run_row

    comparisons = run_row(row.name, bench, mode)
    passed, statuses, observed, failing = True, [], [], None
    for c in comparisons:
        if "rejected" in c:
            status, text, ok = "REJECTED", f"REJECTED: {c['rejected']}", row.expected.kind == "REJECTED"
        else:
            status, text, ok = _observe(row.expected, c["report"])
        c["observed"] = text
        statuses.append(status)
        observed.append(f"{c['a']} vs {c['b']} ({c['world']} ranks): {text}")
        if not ok and failing is None:
            failing = c
        passed = passed and ok
    shown = failing or comparisons[0]
    report = shown.get("report")
    return {
        "status": statuses[comparisons.index(shown)], "observed": "; ".join(observed), "passed": passed,
        "report": report, "comparisons": comparisons,
        "first_drift": report["first"] if report else None,
        "first_in_block": report["first_in_block"] if report else None,
    }


def _compared(row: Ablation, bench: Bench, mode: str) -> tuple[DriftReport, str | None]:
    """The drift report of a comparison row, cached in the bench per (probe, mode): rows built on the same probe
    (A0 and H-C2 both replay the sealed reference) share one comparison. Also the replay's recorded digest when the
    probe arm records one."""
    key = ("report", row.probe, mode)
    if key not in bench.cache:
        a, b = row.probe(bench, mode)
        reference = None
        plain = not (a.grad or a.checkpointing is not None or a.row_map)
        if plain and a.model is bench.model and a.spec is bench.spec(mode):
            reference = bench.reference_capture(mode, a.scope, a.forward_pass)
        report = compare(a, b, reference=reference)
        bench.cache[key] = (report, b.recorder.finish().digest if b.recorder is not None else None)
    return bench.cache[key]


def run_ablation(name: str, bench: Bench | None = None, mode: str | None = None) -> dict[str, Any]:
    """Run one row (see the module docstring for the result dict). `mode` overrides the row's mode."""
    if name not in ROWS:
        raise AblationError(f"ablation {name!r}: must be one of {', '.join(ORDER)}")
    row = ROWS[name]
    mode = runtime.check_mode(mode) if mode is not None else row.mode
    bench = bench if bench is not None else tiny_bench()
    out: dict[str, Any] = {
        "name": row.name, "factor": row.factor, "description": row.description, "apply": row.apply, "mode": mode,
        "scope": row.scope, "expected": row.expected.describe(), "expected_signature": row.expected.to_dict(),
        "rfc": row.rfc, "observed": "", "status": "", "first_drift": None, "first_in_block": None, "passed": None,
        "report": None, "seconds": 0.0,
    }
    start = time.perf_counter()
    try:
        if row.distributed:
            out.update(_run_distributed(row, bench, mode))
        elif row.check is not None:
            status, observed, passed, report = row.check(bench, mode)
            out.update(status=status, observed=observed, passed=passed,
                       report=report.to_dict() if report is not None else None)
        else:
            report, replay_digest = _compared(row, bench, mode)
            status, observed, passed = _observe(row.expected, report)
            if replay_digest is not None and passed:
                sealed = bench.cache[("sealed", mode)]
                passed = replay_digest == sealed.digest
                observed += f"; replay digest {'==' if passed else '!='} sealed digest {sealed.digest[:16]}"
            out.update(status=status, observed=observed, passed=passed, report=report.to_dict(),
                       first_drift=report.first.to_dict() if report.first else None,
                       first_in_block=report.first_in_block.to_dict() if report.first_in_block else None)
    except DriftError as exc:
        ok = row.expected.kind == "REJECTED"
        out.update(status="REJECTED", observed=f"REJECTED: {exc}", passed=ok)
    except Exception as exc:  # a row that cannot run is reported, never silently passed
        out.update(status="ERROR", observed=f"ERROR {type(exc).__name__}: {exc}", passed=False)
    out["seconds"] = round(time.perf_counter() - start, 3)
    return out


def run_matrix(
    bench: Bench | None = None, names: list[str] | tuple[str, ...] | None = None, modes: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Every row (or `names`) in RFC order; `modes` overrides the mode of named rows."""
    bench = bench if bench is not None else tiny_bench()
    names = ORDER if names is None else tuple(names)
    modes = modes or {}
    return [run_ablation(n, bench, modes.get(n)) for n in names]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts: passed, failed, not run (`passed` None: rows the environment cannot run), and the failed rows."""
    return {
        "rows": len(rows),
        "passed": sum(r["passed"] is True for r in rows),
        "failed": [r["name"] for r in rows if r["passed"] is False],
        "not_run": [r["name"] for r in rows if r["passed"] is None],
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of the matrix (REPL `!ablate`, reports)."""
    lines = [f"{'row':6} {'mode':6} {'ok':5} {'expected':58} observed"]
    for r in rows:
        ok = {True: "yes", False: "NO", None: "-"}[r["passed"]]
        lines.append(f"{r['name']:6} {r['mode']:6} {ok:5} {r['expected'][:58]:58} {r['observed']}")
    return "\n".join(lines)
