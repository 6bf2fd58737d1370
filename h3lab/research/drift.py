"""First-drift localisation: run two executions that share sealed inputs, hash every operator boundary, and say
where they first differ — (pass, layer, operator, packed row, modality) with magnitudes — plus the drift matrices a
heatmap needs.

Contract
--------
An `Execution` is one arm: a `RunSpec` (sealed inputs, schedule, mode, factors, stepper, reuse, ...: everything the
run is) and the model it runs on, plus how drift observes it -- a `row_map` into the reference frame, gradient
checkpointing, and the scope: the whole trajectory (the one loop, `h3lab.run.loop`, every pass as the spec runs it,
reuse included) or one model call at `forward_pass` (optionally a training forward — autograd enabled — and the
backward of a fixed probe loss, whose parameter gradients are captured too). The spec is resolved
(`h3lab.run.resolve`) on every run, so factor perturbations are re-derived from their names; a factor that permutes
the packed rows (H1) brings its own row map.

Capture points, in canonical order within a pass (the order `compare` searches):
  pass -1   `schedule.video_sigmas`, `schedule.audio_sigmas` (scheduler construction, the resolved schedule)
  pass i    `input.text`, `input.video`, `input.audio` (what enters the transformer),
            every `H3Transformer` hook point in `hook_points()` order (Diffusers' model: the subset its modules
            expose, `DiffusersTaps`), `scheduler.video`, `scheduler.audio` (latents after the Euler step),
            `grad.<parameter>` (forward scope with `grad=True`).
A captured tensor is first mapped into the reference frame (`RowMap`: batch item `batch_index` of batched
activations; packed-row axes gathered back to canonical order with the layout's `canonical_order()`), then hashed
(`hashing.tensor_digest`, scheme "auto": SHA-256 of the bytes on CPU, the device checksum on CUDA, so clean
tensors never leave the device). Under gradient checkpointing the replayed block forwards are not captured again.

`compare(a, b)` runs three times at most:
  1. A, hashes only;  2. B, hashes; B keeps (on its device) the tensors whose hash differs from A's, and only at
     the first differing point, the per-layer matrix points (`blocks.{i}.<matrix_point>`, `pack`,
     `final_modulate`) and the pass outputs (`video_out`, `audio_out`, `scheduler.*`);
  3. only if something differs: A again, reducing each kept pair (float64) as A reaches it and dropping B's copy;
     A's hashes must repeat (`DriftReport.a_repeatable`, False flags a non-deterministic reference arm).
Equal hashes mean equal bytes (zero drift) without any reduction. Keys only one arm has (e.g. `modulate1`, which
Diffusers exposes no module for) are listed in `uncompared`, never counted as drift.

The first drift is the first (pass, point) in canonical order whose bytes differ; `DriftPoint` names its pass,
layer, operator, row axis, the first differing row along it, the packed row and modality that row is (video/audio/
text rows through the layout's index tensors; AdaLN table rows as timestep_index*3 + tag), the batch item, the
number of differing rows, max |a-b| and relative L2 ||a-b|| / ||a||. Across ranks (an arm whose spec has a
placement, captured through the placement's hook view, so both arms are seen in the one-process frame) it also
names the `owner` of that packed row: the rank, its (cp, tp) coordinates and the local row there. Layout metadata (positions, tags, indices, the
per-row timestep of every pass) is compared separately (`DriftReport.metadata`): it explains a drift, it is not an
operator boundary.

Matrices (numpy float64, NaN where a point was not captured by both arms): `step_layer_max_abs` /
`step_layer_rel_l2` (passes x layers) and `row_max_abs` / `row_rel_l2` (passes x layers x packed rows, canonical
order); `layer_row(step)` slices the latter at one pass (default: the pass of the first drift). Steps are 0-based
indices everywhere in the API and the JSON; printed text and plot labels number passes from 1 (`pass_label`). Labels:
`step_labels`, `layer_labels` (`pack`, `blocks.0`, ..., `final_modulate`), `row_labels` (`"12:video"`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from ..config import MODALITY_NAMES, NUM_MODALITIES
from ..errors import H3Error
from ..hashing import tensor_digest
from ..run import DenoiseInputs, ResolvedRun, RunSpec, StepRecord, loop, resolve, set_hook_step
from ..run.trajectory import Trajectory, TrajectoryRecorder

OUTPUT_POINTS = ("video_out", "audio_out", "scheduler.video", "scheduler.audio")
SCOPES = ("trajectory", "forward")


class DriftError(H3Error):
    """Two executions cannot be compared as asked (a setting breaks a rule); the message names it."""


# ===================================================================================================== points
@dataclass(frozen=True)
class Point:
    """A capture point: `name`, `layer` (block/refiner index or None), `op` (runtime op, or `input`, `euler_step`,
    `sigma_schedule`, `backward`), `rows` (what the row axis indexes), `row_axis`, `batched` (axis 0 is batch)."""

    name: str
    layer: int | None
    op: str
    rows: str
    row_axis: int | None
    batched: bool

    @classmethod
    def from_hook(cls, p: Any) -> "Point":
        axis = p.row_axis
        return cls(p.name, p.layer, p.op, p.rows, axis, axis == 1)


SCHEDULE_POINTS = (
    Point("schedule.video_sigmas", None, "sigma_schedule", "grid", 0, False),
    Point("schedule.audio_sigmas", None, "sigma_schedule", "grid", 0, False),
)
INPUT_POINTS = (
    Point("input.text", None, "input", "text", 1, True),
    Point("input.video", None, "input", "video", 1, True),
    Point("input.audio", None, "input", "audio", 1, True),
)
SCHEDULER_POINTS = (
    Point("scheduler.video", None, "euler_step", "video", 1, True),
    Point("scheduler.audio", None, "euler_step", "audio", 1, True),
)


def _grad_point(name: str) -> Point:
    return Point(f"grad.{name}", None, "backward", "param", None, False)


def model_points(model: Any) -> tuple[Point, ...]:
    """The model's hook points as `Point`s in execution order (H3Transformer, or Diffusers' model by config)."""
    if hasattr(model, "hook_points"):
        return tuple(Point.from_hook(p) for p in model.hook_points())
    from ..config import H3Config
    from ..model.hooks import hook_points

    return tuple(Point.from_hook(p) for p in hook_points(H3Config.from_dict(dict(model.config))))


# ===================================================================================================== row map
@dataclass(frozen=True)
class RowMap:
    """Maps an arm's tensors into the reference arm's frame: `batch_index` selects one item of batched tensors;
    `packed_order` (S,) int64 gathers packed-row axes back to canonical order (`layout.canonical_order()`)."""

    batch_index: int | None = None
    packed_order: torch.Tensor | None = None

    def __call__(self, point: Point, t: torch.Tensor) -> torch.Tensor:
        if self.batch_index is not None and point.batched:
            t = t.narrow(0, self.batch_index, 1)
        if self.packed_order is not None and point.rows == "packed" and point.row_axis is not None:
            t = t.index_select(point.row_axis, self.packed_order.to(t.device))
        return t

    def packed_positions(self, canonical_rows: torch.Tensor) -> torch.Tensor:
        """This arm's index-tensor values (packed positions) -> canonical packed rows."""
        if self.packed_order is None:
            return canonical_rows
        inv = torch.empty_like(self.packed_order)
        inv[self.packed_order] = torch.arange(self.packed_order.numel())
        return inv[canonical_rows.cpu()]


# =================================================================================================== execution
@dataclass
class Execution:
    """One arm of a comparison (see the module docstring): `spec` run on `model`; `models` the other variants a
    factor may swap in (H16); `label` defaults to the spec's tag."""

    spec: RunSpec
    model: Any
    label: str = ""
    models: Mapping[str, Any] | Callable[[str], Any] | None = None
    row_map: RowMap | None = None
    scope: str = "trajectory"
    forward_pass: int = 0
    grad: bool = False
    backward: bool = True
    checkpointing: bool | None = None
    recorder: TrajectoryRecorder | None = None  # trajectory scope: also record (and hash) the run

    def __post_init__(self) -> None:
        if not isinstance(self.spec, RunSpec):
            raise DriftError(f"spec is a {type(self.spec).__name__}: an Execution runs a RunSpec")
        self.label = self.label or self.spec.tag
        if self.scope not in SCOPES:
            raise DriftError(f"scope={self.scope!r}: must be one of {SCOPES}")
        if self.scope == "forward" and not 0 <= self.forward_pass < self.spec.inputs.num_passes:
            raise DriftError(f"forward_pass={self.forward_pass}: must be in [0, {self.spec.inputs.num_passes})")
        if self.grad and self.scope != "forward":
            raise DriftError("grad=True needs scope='forward' (a training step recomputes one pass)")
        if self.spec.custom is not None and self.spec.custom.hooks and not hasattr(self.model, "add_hook"):
            raise DriftError(f"perturbation hooks need an H3Transformer; {type(self.model).__name__} has no add_hook")

    def replace(self, **changes: Any) -> "Execution":
        return dataclasses.replace(self, **changes)

    def with_spec(self, label: str | None = None, **changes: Any) -> "Execution":
        """This execution with its spec changed (`RunSpec.replace(**changes)`) and, if given, a new label."""
        return self.replace(spec=self.spec.replace(**changes), label=self.label if label is None else label)


Sink = Callable[[int, Point, torch.Tensor], None]


class DiffusersTaps:
    """Forward hooks on Diffusers' `MiniMaxH3Transformer3DModel` modules that expose the H3 hook points a module
    boundary can give (module output == hook-point tensor, byte for byte): each point's `Tap` in the hook-point table
    (`h3lab.model.hooks`) names the module and what to take of its output. Inline arithmetic (modulate, RoPE
    application, attention, residual1, pack) has no module and is not captured."""

    def __init__(self, model: Any, emit: Callable[[str, torch.Tensor], None]):
        from ..config import H3Config
        from ..model.hooks import hook_points

        self.handles = []
        self.emit = emit
        for p in hook_points(H3Config.from_dict(dict(model.config))):
            if p.tap is not None:
                module = model.get_submodule(p.tap.module)
                self.handles.append(module.register_forward_hook(self._tap(p.name, p.tap.take)))

    def _tap(self, name: str, take: Any):
        def hook(_m, _a, out) -> None:
            if take == "cat":  # adaln_proj returns the six chunks of the (T*3, 6*hidden) table: their concatenation
                out = torch.cat(out, dim=-1)
            elif take is not None:  # a tuple, or Diffusers' output object (indexable in field order)
                out = out[take]
            self.emit(name, out)

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _probe_weights(v: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.device)


def execute(ex: Execution, sink: Sink) -> ResolvedRun:
    """Run `ex` and call `sink(pass, point, tensor)` for every capture point in execution order (tensors detached
    and mapped into the reference frame). Returns the resolved run (inputs, schedule, model as they ran) with the
    row map that was applied."""
    with resolve(ex.spec, ex.model, models=ex.models) as run:
        row_map = ex.row_map or run.row_map or RowMap()
        _execute(ex, run, row_map, sink)
    return run.replace(row_map=row_map)


def _execute(ex: Execution, run: ResolvedRun, row_map: RowMap, sink: Sink) -> None:
    model = run.model
    points = {p.name: p for p in model_points(model)}
    state = {"step": -1}

    def emit(point: Point, t: torch.Tensor) -> None:
        sink(state["step"], point, row_map(point, t.detach()))

    def on_hook(hp: Any, t: torch.Tensor) -> None:
        if not getattr(model, "recomputing", False):
            emit(points[hp.name], t)
        return None

    def on_tap(name: str, t: torch.Tensor) -> None:
        emit(points[name], t)

    def forward(m: Any, inputs: DenoiseInputs, video: torch.Tensor, audio: torch.Tensor, i: int):
        state["step"] = i
        for p, t in zip(INPUT_POINTS, (inputs.text, video, audio)):
            emit(p, t)
        return run.forward(m, inputs, video, audio, i)

    user = ex.recorder

    class _Tap(TrajectoryRecorder):
        def begin(self, *args: Any) -> None:
            if user is not None:
                user.begin(*args)

        def record(self, rec: StepRecord) -> None:
            state["step"] = rec.index  # a reused pass runs no forward: its step is set here
            emit(SCHEDULER_POINTS[0], rec.video)
            emit(SCHEDULER_POINTS[1], rec.audio)
            if user is not None:
                user.record(rec)

    handles = []  # the perturbation hooks are the resolved run's, registered first: capture sees their output
    taps = None
    if hasattr(model, "add_hook"):
        handles.append(model.add_hook(on_hook))
    elif type(model).__name__ == "MiniMaxH3Transformer3DModel":
        taps = DiffusersTaps(model, on_tap)
    saved_ckpt = getattr(model, "gradient_checkpointing", None)
    if ex.checkpointing is not None:
        model.gradient_checkpointing = ex.checkpointing
    try:
        emit(SCHEDULE_POINTS[0], run.schedule.video.sigmas)
        emit(SCHEDULE_POINTS[1], run.schedule.audio.sigmas)
        if ex.scope == "trajectory":
            loop(run.replace(forward=forward), _Tap())
        else:
            _forward_once(ex, run.replace(forward=forward), emit)
    finally:
        for h in handles:
            h.remove()
        if taps is not None:
            taps.remove()
        if ex.checkpointing is not None:
            model.gradient_checkpointing = saved_ckpt


def _forward_once(ex: Execution, run: ResolvedRun, emit: Callable[[Point, torch.Tensor], None]) -> None:
    """One model call at `ex.forward_pass` from the run's inputs; with `grad`, a training forward (autograd graph
    built) and, with `backward`, the backward of the fixed probe loss sum(v_video * w_v) + sum(v_audio * w_a)
    (w seeded, float32), then every parameter gradient."""
    model, inputs, i, forward = run.model, run.inputs, ex.forward_pass, run.forward
    set_hook_step(model, i)
    if not ex.grad:
        with torch.no_grad():
            forward(model, inputs, inputs.video, inputs.audio, i)
        return
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in params:
        p.grad = None
    with torch.enable_grad():
        v_video, v_audio = forward(model, inputs, inputs.video, inputs.audio, i)
        if not ex.backward:
            return
        # Weights seeded per output shape: gradients are comparable between arms of one batch size (H-C6).
        loss = (v_video.float() * _probe_weights(v_video, 1)).sum()
        loss = loss + (v_audio.float() * _probe_weights(v_audio, 2)).sum()
        loss.backward()
    for n, p in params:
        if p.grad is not None:
            emit(_grad_point(n), p.grad)
        p.grad = None


# ===================================================================================================== capture
@dataclass
class Capture:
    """Hashes of one execution: `order` of (pass, point name) keys as emitted, `points`, `digests`, `shapes`; and
    the inputs it ran on and the row map it was seen through (after its factors)."""

    label: str
    order: list[tuple[int, str]] = field(default_factory=list)
    points: dict[str, Point] = field(default_factory=dict)
    digests: dict[tuple[int, str], str] = field(default_factory=dict)
    shapes: dict[tuple[int, str], tuple[int, ...]] = field(default_factory=dict)
    inputs: DenoiseInputs | None = None
    row_map: RowMap | None = None

    def add(self, step: int, point: Point, t: torch.Tensor) -> tuple[int, str]:
        key = (step, point.name)
        self.points.setdefault(point.name, point)
        self.order.append(key)
        self.digests[key] = tensor_digest(t, "auto")
        self.shapes[key] = tuple(t.shape)
        return key


    def forward_view(self, step: int) -> "Capture":
        """The capture a forward-scope execution at pass `step` would make, cut from a trajectory capture (the
        schedule points, pass `step`'s inputs and model points; no scheduler points)."""
        out = Capture(self.label, inputs=self.inputs, row_map=self.row_map)
        skip = {p.name for p in SCHEDULER_POINTS}
        for key in self.order:
            if key[0] == -1 or (key[0] == step and key[1] not in skip):
                out.order.append(key)
                out.points.setdefault(key[1], self.points[key[1]])
                out.digests[key] = self.digests[key]
                out.shapes[key] = self.shapes[key]
        return out


def capture(ex: Execution) -> Capture:
    """Hashes of every capture point of one execution (no tensors kept)."""
    cap = Capture(ex.label)
    run = execute(ex, cap.add)
    cap.inputs, cap.row_map = run.inputs, run.row_map
    return cap


# ====================================================================================================== report
@dataclass
class DriftPoint:
    """Where two executions differ at one (pass, point); magnitudes over the whole tensor, float64."""

    step: int
    point: str
    layer: int | None
    op: str
    rows: str
    row: int | None = None  # first differing index along the row axis (reference frame)
    packed_row: int | None = None
    modality: str | None = None
    batch: int | None = None
    table_row: int | None = None  # AdaLN table row (timestep_index * 3 + tag) for rows == "table"
    rows_differing: int = 0
    max_abs: float | None = None
    rel_l2: float | None = None
    shape_a: tuple | None = None
    shape_b: tuple | None = None
    note: str = ""
    owner: dict | None = None  # an arm with a placement: the rank(s) holding `packed_row` (the placement provider's `locate`)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape_a"] = list(self.shape_a) if self.shape_a else None
        d["shape_b"] = list(self.shape_b) if self.shape_b else None
        for k in ("max_abs", "rel_l2"):
            d[k] = _json_float(d[k])
        return d

    def __str__(self) -> str:
        layer = f"layer {self.layer}, " if self.layer is not None else ""
        where = f"{pass_label(self.step)} {self.point} ({layer}op {self.op})"
        row = ""
        if self.packed_row is not None:
            row = f", packed row {self.packed_row} ({self.modality})"
        elif self.table_row is not None:
            row = f", AdaLN table row {self.table_row} ({self.modality})"
        elif self.row is not None:
            row = f", {self.rows} row {self.row}"
        if self.owner is not None:
            row += f" {self.owner['text']}"
        mag = "" if self.max_abs is None else f", max|a-b| {self.max_abs:.3g}, rel L2 {self.rel_l2:.3g}"
        return f"{where}{row}{mag}{'; ' + self.note if self.note else ''}"


def _json_float(x: float | None) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else (x if math.isfinite(x) else str(x))


def _nan_to_none(a: np.ndarray) -> list:
    return [[None if math.isnan(v) else v for v in row] for row in a.tolist()] if a.ndim == 2 else [
        _nan_to_none(x) for x in a
    ]


@dataclass
class DriftReport:
    """Outcome of `compare` (see the module docstring for every field's meaning)."""

    label_a: str
    label_b: str
    equal: bool
    first: DriftPoint | None
    first_in_block: DriftPoint | None
    compared: int
    uncompared: list[str]
    metadata: list[dict]
    step_labels: list[int]
    layer_labels: list[str]
    row_labels: list[str]
    step_layer_max_abs: np.ndarray
    step_layer_rel_l2: np.ndarray
    row_max_abs: np.ndarray
    row_rel_l2: np.ndarray
    per_step: list[dict]
    a_repeatable: bool | None = None
    differing: int = 0

    @property
    def matrix_step(self) -> int:
        return self.first.step if self.first is not None and self.first.step >= 0 else 0

    def layer_row(self, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(layers x rows) max |a-b| and relative L2 at one pass (default: the pass of the first drift)."""
        s = self.matrix_step if step is None else step
        if s not in self.step_labels:
            empty = np.full((len(self.layer_labels), len(self.row_labels)), np.nan)
            return empty, empty.copy()
        k = self.step_labels.index(s)
        return self.row_max_abs[k], self.row_rel_l2[k]

    @property
    def layer_row_max_abs(self) -> np.ndarray:
        return self.layer_row()[0]

    @property
    def layer_row_rel_l2(self) -> np.ndarray:
        return self.layer_row()[1]

    def summary(self) -> str:
        if self.equal:
            return f"{self.label_a} vs {self.label_b}: byte-equal at all {self.compared} compared points"
        return f"{self.label_a} vs {self.label_b}: first drift at {self.first}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "label_a": self.label_a,
            "label_b": self.label_b,
            "equal": self.equal,
            "first": self.first.to_dict() if self.first else None,
            "first_in_block": self.first_in_block.to_dict() if self.first_in_block else None,
            "compared": self.compared,
            "differing": self.differing,
            "uncompared": self.uncompared,
            "metadata": self.metadata,
            "a_repeatable": self.a_repeatable,
            "step_labels": self.step_labels,
            "layer_labels": self.layer_labels,
            "row_labels": self.row_labels,
            "step_layer_max_abs": _nan_to_none(self.step_layer_max_abs),
            "step_layer_rel_l2": _nan_to_none(self.step_layer_rel_l2),
            "layer_row_max_abs": _nan_to_none(self.layer_row_max_abs),
            "layer_row_rel_l2": _nan_to_none(self.layer_row_rel_l2),
            "matrix_step": self.matrix_step,
            "per_step": self.per_step,
        }


# ==================================================================================================== numerics
def _row_bytes(t: torch.Tensor, axis: int | None) -> torch.Tensor:
    """(R, nbytes_per_row) uint8 view of `t` with the row axis first (R = 1 when there is no row axis)."""
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    t = t.movedim(axis, 0).contiguous() if axis is not None and t.ndim > 0 else t.reshape(1, -1).contiguous()
    return t.reshape(t.shape[0], -1).view(torch.uint8) if t.numel() else t.reshape(t.shape[0], 0).to(torch.uint8)


def _stats(a: torch.Tensor, b: torch.Tensor, axis: int | None) -> dict[str, Any]:
    """max |a-b|, ||a-b||/||a|| overall and per row along `axis` (float64), and which rows differ in bytes."""
    if a.shape != b.shape:
        return {"shape_mismatch": True}
    rb_a, rb_b = _row_bytes(a, axis), _row_bytes(b, axis)
    differs = (rb_a != rb_b).any(dim=1)  # (R,) bytes-level
    a64 = a.detach().to(torch.float64)
    b64 = b.detach().to(torch.float64)
    if axis is not None and a64.ndim > 0:
        a64, b64 = a64.movedim(axis, 0), b64.movedim(axis, 0)
    else:
        a64, b64 = a64.reshape(1, -1), b64.reshape(1, -1)
    a64, b64 = a64.reshape(a64.shape[0], -1), b64.reshape(b64.shape[0], -1)
    diff = a64 - b64
    differs = differs.to(diff.device)
    # Rows with equal bytes are exactly 0 (even NaN == NaN bytes); a NaN/inf difference reads as inf.
    row_abs = diff.abs().amax(dim=1) if diff.shape[1] else torch.zeros(diff.shape[0], dtype=torch.float64)
    row_abs = torch.where(differs, torch.nan_to_num(row_abs, nan=math.inf), 0.0)
    row_num = torch.nan_to_num(diff.pow(2).sum(dim=1), nan=math.inf)
    row_den = torch.nan_to_num(a64.pow(2).sum(dim=1), nan=math.inf)
    row_rel = torch.where(row_den > 0, (row_num / row_den).sqrt(), torch.where(row_num > 0, math.inf, 0.0))
    row_rel = torch.where(differs, torch.nan_to_num(row_rel, nan=math.inf), 0.0)
    num, den = row_num.sum(), row_den.sum()
    rel = (num / den).sqrt() if den > 0 else torch.tensor(math.inf if num > 0 else 0.0)
    rel = torch.nan_to_num(rel, nan=math.inf)
    return {
        "differs": differs.cpu(),
        "row_max_abs": row_abs.cpu(),
        "row_rel_l2": row_rel.cpu(),
        "max_abs": float(row_abs.max()) if row_abs.numel() else 0.0,
        "rel_l2": float(rel),
    }


# ===================================================================================================== compare
def _point_rank(points: Sequence[Point]) -> dict[str, int]:
    """Canonical rank of a point name within a pass: inputs, model points (execution order), scheduler, grads."""
    rank = {p.name: i for i, p in enumerate(SCHEDULE_POINTS)}
    base = len(rank)
    for i, p in enumerate(INPUT_POINTS):
        rank[p.name] = base + i
    base = len(rank)
    for i, p in enumerate(points):
        rank[p.name] = base + i
    base = len(rank)
    for i, p in enumerate(SCHEDULER_POINTS):
        rank[p.name] = base + i
    return rank


def _matrix_names(num_layers: int, matrix_point: str) -> tuple[list[str], list[str]]:
    labels = ["pack"] + [f"blocks.{i}" for i in range(num_layers)] + ["final_modulate"]
    names = ["pack"] + [f"blocks.{i}.{matrix_point}" for i in range(num_layers)] + ["final_modulate"]
    return labels, names


def _row_streams(inputs: DenoiseInputs) -> list[str]:
    streams = ["?"] * inputs.seq_len
    for name in ("text", "video", "audio"):
        for r in getattr(inputs, f"{name}_indices").tolist():
            streams[r] = name
    return streams


def _locate(point: Point, stats: dict, inputs: DenoiseInputs) -> dict:
    """First differing row along the row axis -> packed row / modality / table row."""
    out: dict[str, Any] = {}
    differs = stats["differs"]
    idx = torch.nonzero(differs).flatten()
    out["rows_differing"] = int(idx.numel())
    if point.row_axis is None or idx.numel() == 0:
        return out
    r = int(idx[0])
    out["row"] = r
    if point.rows == "packed":
        out["packed_row"] = r
        out["modality"] = _row_streams(inputs)[r] if r < inputs.seq_len else None
    elif point.rows in ("video", "audio", "text"):
        index = getattr(inputs, f"{point.rows}_indices")
        out["modality"] = point.rows
        if r < index.numel():
            out["packed_row"] = int(index[r])
    elif point.rows == "table":
        out["table_row"] = r
        out["modality"] = MODALITY_NAMES.get(r % NUM_MODALITIES)
    return out


def _first_batch(a: torch.Tensor, b: torch.Tensor, point: Point) -> int | None:
    if not point.batched or a.shape != b.shape or a.ndim == 0:
        return None
    diff = (_row_bytes(a, 0) != _row_bytes(b, 0)).any(dim=1)
    nz = torch.nonzero(diff).flatten()
    return int(nz[0]) if nz.numel() else None


def _metadata(a: Capture, b: Capture) -> list[dict]:
    """Layout metadata and per-pass row timesteps of B, mapped to canonical rows, against A's (as they ran)."""
    ia, ib = a.inputs, b.inputs
    rm = b.row_map or RowMap()
    order = rm.packed_order
    out = []

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t if order is None else t.index_select(0, order.to(t.device))

    def note(name: str, ta: torch.Tensor, tb: torch.Tensor, step: int | None = None) -> None:
        ta, tb = ta.cpu(), tb.cpu()
        if ta.shape != tb.shape:
            out.append({"name": name, "step": step, "shape_a": list(ta.shape), "shape_b": list(tb.shape)})
            return
        if ta.dtype != tb.dtype or not torch.equal(ta, tb):
            diff = (ta != tb).reshape(ta.shape[0], -1).any(dim=1) if ta.ndim else (ta != tb).reshape(1)
            out.append({"name": name, "step": step, "rows": torch.nonzero(diff).flatten()[:16].tolist()})

    note("position_ids", ia.position_ids, per_row(ib.position_ids))
    note("token_tags", ia.token_tags, per_row(ib.token_tags))
    for name in ("video_indices", "audio_indices", "text_indices"):
        note(name, getattr(ia, name), rm.packed_positions(getattr(ib, name)))
    for s in range(min(ia.num_passes, ib.num_passes)):
        ta, xa = ia.plan[s]
        tb, xb = ib.plan[s]
        note("row_timestep", ta.cpu()[xa.cpu()], per_row(tb.cpu()[xb.cpu()]), s)
    if ia.num_passes != ib.num_passes:
        out.append({"name": "num_passes", "a": ia.num_passes, "b": ib.num_passes})
    return out


def pass_label(step: int) -> str:
    """A 0-based step index as users read it: "pass 1" is the first pass (the progress bar counts from 1 too), and
    step -1 is the scheduler's construction. Only what is printed counts from 1; reports and JSON keep the index."""
    return "scheduler construction" if step < 0 else f"pass {step + 1}"


def metadata_line(note: dict) -> str:
    """One readable line for a `DriftReport.metadata` entry (what a front end prints; never the raw dict)."""
    name = note.get("name", "?")
    where = f"{name} ({pass_label(note['step'])})" if note.get("step") is not None else name
    if "shape_a" in note:
        return f"{where}: shape {tuple(note['shape_a'])} vs {tuple(note['shape_b'])}"
    if "rows" in note:
        rows = note["rows"]
        listed = ", ".join(str(r) for r in rows) + (" ..." if len(rows) >= 16 else "")
        return f"{where}: differs at canonical row{'s' if len(rows) != 1 else ''} {listed}"
    if "a" in note:
        return f"{where}: {note['a']} vs {note['b']}"
    return where


def compare(
    a: Execution, b: Execution, matrix_point: str = "residual2", reference: Capture | None = None
) -> DriftReport:
    """Run `a` (the reference arm) and `b`, and localise their first drift (see the module docstring).
    `reference`: a `Capture` of `a` made earlier (skips the first run of `a`)."""
    if a.scope != b.scope:
        raise DriftError(f"scopes differ ({a.scope!r} vs {b.scope!r}): compare a trajectory with a trajectory")
    cap_a = reference if reference is not None else capture(a)  # pass 1: A's digests
    points_a = model_points(a.model)
    rank = _point_rank(points_a)
    num_layers = sum(1 for p in points_a if p.name.endswith(".norm1") and p.name.startswith("blocks."))
    layer_labels, layer_names = _matrix_names(num_layers, matrix_point)

    cap_b, kept = _capture_b(b, cap_a, rank, set(layer_names))  # pass 2
    common = [k for k in cap_a.order if k in cap_b.digests]
    common.sort(key=lambda k: (k[0], rank.get(k[1], 10**9)))
    differing = [k for k in common if cap_a.digests[k] != cap_b.digests[k]]
    only = sorted({k[1] for k in cap_a.digests.keys() ^ cap_b.digests.keys()})
    rerun = bool(kept)
    stats, a_tensor_first, repeatable = _reduce_kept(a, cap_a, kept, differing[0]) if rerun else ({}, {}, True)
    first, first_in_block = _first_points(differing, cap_a, cap_b, stats, a_tensor_first)
    _name_owners((first, first_in_block), (b, a), cap_a.inputs.seq_len)

    steps = sorted({k[0] for k in common if k[0] >= 0})
    rows = cap_a.inputs.seq_len
    sl_abs, sl_rel, r_abs, r_rel = _layer_matrices(steps, layer_names, rows, cap_a, cap_b, stats)
    streams = _row_streams(cap_a.inputs)
    return DriftReport(
        label_a=a.label or "a",
        label_b=b.label or "b",
        equal=not differing,
        first=first,
        first_in_block=first_in_block,
        compared=len(common),
        uncompared=only,
        metadata=_metadata(cap_a, cap_b),
        step_labels=steps,
        layer_labels=layer_labels,
        row_labels=[f"{r}:{streams[r]}" for r in range(rows)],
        step_layer_max_abs=sl_abs,
        step_layer_rel_l2=sl_rel,
        row_max_abs=r_abs,
        row_rel_l2=r_rel,
        per_step=_output_errors(steps, cap_a, cap_b, stats),
        a_repeatable=repeatable if rerun else None,
        differing=len(differing),
    )


def _capture_b(b: Execution, cap_a: Capture, rank: dict[str, int],
               matrix_set: set[str]) -> tuple[Capture, dict[tuple[int, str], torch.Tensor]]:
    """Pass 2: run B, hashing every point, and keep the tensors that differ from A's digest at the earliest drift so
    far (overall and inside the block stack), at the matrix points and at the outputs."""
    cap_b = Capture(b.label)
    kept: dict[tuple[int, str], torch.Tensor] = {}
    first: list[tuple[int, str]] = []  # earliest differing key so far (canonical order)
    first_block: list[tuple[int, str]] = []  # earliest differing key inside the block stack

    def sink_b(step: int, point: Point, t: torch.Tensor) -> None:
        key = cap_b.add(step, point, t)
        want = cap_a.digests.get(key)
        if want is None or want == cap_b.digests[key]:
            return
        keep = point.name in matrix_set or point.name in OUTPUT_POINTS
        for slot, eligible in ((first, True), (first_block, point.name.startswith("blocks."))):
            if eligible and (not slot or _before(key, slot[0], rank)):
                old = slot[0] if slot else None
                slot[:] = [key]
                keep = True
                if old is not None and old not in first + first_block and not _always_kept(old, matrix_set):
                    kept.pop(old, None)
        if keep:
            kept[key] = t.clone()

    run_b = execute(b, sink_b)
    cap_b.inputs, cap_b.row_map = run_b.inputs, run_b.row_map
    return cap_b, kept


def _reduce_kept(a: Execution, cap_a: Capture, kept: dict[tuple[int, str], torch.Tensor],
                 first_key: tuple[int, str]) -> tuple[dict, dict, bool]:
    """Pass 3: run A again and reduce each kept pair as A reaches it (`_stats`); returns the stats per key, the
    first drift's batch index and shapes, and whether A repeated its own digests on the kept points."""
    stats: dict[tuple[int, str], dict] = {}
    a_tensor_first: dict[str, Any] = {}
    repeat_ok = [True]

    def sink_a(step: int, point: Point, t: torch.Tensor) -> None:
        key = (step, point.name)
        if key not in kept:
            return
        if tensor_digest(t, "auto") != cap_a.digests.get(key):
            repeat_ok[0] = False
        tb = kept.pop(key)
        stats[key] = _stats(t, tb, point.row_axis)
        if key == first_key:
            a_tensor_first.update(batch=_first_batch(t, tb, point), shape_a=tuple(t.shape), shape_b=tuple(tb.shape))

    execute(a, sink_a)
    return stats, a_tensor_first, repeat_ok[0]


def _first_points(differing: list[tuple[int, str]], cap_a: Capture, cap_b: Capture, stats: dict,
                  a_tensor_first: dict) -> tuple[DriftPoint | None, DriftPoint | None]:
    """The first drift overall and the first inside the block stack (None when there is none)."""
    first = _drift_point(differing[0], cap_a, cap_b, stats, a_tensor_first) if differing else None
    first_in_block = None
    for k in differing:
        if k[1].startswith("blocks."):
            first_in_block = _drift_point(k, cap_a, cap_b, stats, {})
            break
    return first, first_in_block


def _name_owners(points: Sequence[DriftPoint | None], executions: Sequence[Execution], seq_len: int) -> None:
    """Across ranks: name the rank that holds each drift point's packed row (the placement of the first execution
    that has one; its provider, `h3lab.distributed`, says who holds a row)."""
    placement = next((dict(x.spec.placement) for x in executions if x.spec.placement), None)
    if placement is None:
        return
    from ..run.fields import provider

    locate = provider("placement").locate
    for dp in points:
        if dp is not None and dp.packed_row is not None and locate is not None:
            dp.owner = locate(placement, dp.point, dp.packed_row, seq_len)


def _layer_matrices(steps: list[int], layer_names: list[str], rows: int, cap_a: Capture, cap_b: Capture,
                    stats: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(pass, layer) max-abs and relative-L2 matrices and their per-row versions (pass, layer, row): 0 where the
    bytes are equal, the kept pair's statistics where they differ, NaN where nothing was compared or kept."""
    shape2 = (len(steps), len(layer_names))
    sl_abs = np.full(shape2, np.nan)
    sl_rel = np.full(shape2, np.nan)
    r_abs = np.full(shape2 + (rows,), np.nan)
    r_rel = np.full(shape2 + (rows,), np.nan)
    for si, s in enumerate(steps):
        for li, name in enumerate(layer_names):
            key = (s, name)
            if key not in cap_a.digests or key not in cap_b.digests:
                continue
            st = stats.get(key)
            if cap_a.digests[key] == cap_b.digests[key]:
                sl_abs[si, li] = sl_rel[si, li] = 0.0
                r_abs[si, li] = r_rel[si, li] = 0.0
            elif st is not None and "differs" in st and st["row_max_abs"].numel() == rows:
                sl_abs[si, li], sl_rel[si, li] = st["max_abs"], st["rel_l2"]
                r_abs[si, li] = st["row_max_abs"].numpy()
                r_rel[si, li] = st["row_rel_l2"].numpy()
    return sl_abs, sl_rel, r_abs, r_rel


def _output_errors(steps: list[int], cap_a: Capture, cap_b: Capture, stats: dict) -> list[dict[str, Any]]:
    """Per pass, the max-abs / relative-L2 error of every output point (None: differs, tensor not kept)."""
    per_step = []
    for s in steps:
        entry: dict[str, Any] = {"step": s}
        for name in OUTPUT_POINTS:
            key = (s, name)
            if key not in cap_a.digests or key not in cap_b.digests:
                continue
            if cap_a.digests[key] == cap_b.digests[key]:
                entry[name] = {"max_abs": 0.0, "rel_l2": 0.0}
            elif key in stats and "differs" in stats[key]:
                st = stats[key]
                entry[name] = {"max_abs": _json_float(st["max_abs"]), "rel_l2": _json_float(st["rel_l2"])}
            else:
                entry[name] = {"max_abs": None, "rel_l2": None}
        per_step.append(entry)
    return per_step


def _always_kept(key: tuple[int, str], matrix_set: set[str]) -> bool:
    return key[1] in matrix_set or key[1] in OUTPUT_POINTS


def _before(k1: tuple[int, str], k2: tuple[int, str], rank: dict[str, int]) -> bool:
    return (k1[0], rank.get(k1[1], 10**9)) < (k2[0], rank.get(k2[1], 10**9))


def _drift_point(key, cap_a: Capture, cap_b: Capture, stats: dict, extra: dict) -> DriftPoint:
    step, name = key
    p = cap_a.points[name]
    dp = DriftPoint(step=step, point=name, layer=p.layer, op=p.op, rows=p.rows,
                    shape_a=cap_a.shapes[key], shape_b=cap_b.shapes[key])
    st = stats.get(key)
    if st is None:
        dp.note = "bytes differ (tensor not kept)"
        return dp
    if st.get("shape_mismatch"):
        dp.note = "shapes differ"
        return dp
    dp.max_abs, dp.rel_l2 = st["max_abs"], st["rel_l2"]
    for k, v in _locate(p, st, cap_a.inputs).items():
        setattr(dp, k, v)
    if extra:
        dp.batch = extra.get("batch")
    return dp


def first_drift(a: Execution, b: Execution) -> DriftPoint | None:
    """The first differing (pass, point) of two executions, or None when they are byte-equal."""
    return compare(a, b).first


# ========================================================================================= sealed trajectories
def diff_steps(a: Trajectory, b: Trajectory) -> dict[str, Any] | None:
    """Cheapest comparison of two sealed trajectories: the first pass and tensor whose recorded hash differs (from
    the manifests alone, nothing is re-run), or None when every recorded hash is equal."""
    for sa, sb in zip(a.steps, b.steps):
        for name in ("velocity_video", "velocity_audio", "video", "audio"):
            if sa[name] != sb[name]:
                return {"step": sa["index"], "field": name}
    if len(a.steps) != len(b.steps):
        return {"step": min(len(a.steps), len(b.steps)), "field": "num_passes"}
    return None


def compare_trajectories(
    a: Trajectory, b: Trajectory, model_a: Any, model_b: Any | None = None, matrix_point: str = "residual2",
    models: Mapping[str, Any] | Callable[[str], Any] | None = None,
) -> DriftReport:
    """Re-run two sealed trajectories (each its own sealed run spec: inputs, schedule, mode, factors, reuse) with
    capture on every operator boundary and localise their first drift."""
    ea = Execution(a.spec, model_a, label=f"{a.spec.tag}:{a.digest[:12]}", models=models)
    eb = Execution(b.spec, model_b if model_b is not None else model_a, label=f"{b.spec.tag}:{b.digest[:12]}",
                   models=models)
    return compare(ea, eb, matrix_point=matrix_point)
