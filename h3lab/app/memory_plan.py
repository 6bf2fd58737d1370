"""What a generation request will need on the GPU, before any work: the DiT's resident / streamed split, the AdaLN
tables, an activation estimate and the peak, against the card's memory (or a hypothetical card of `card_gib`).

Contract
--------
`request_shape(settings, config, shifts, text_rows=TEXT_ROWS) -> RequestShape`: the packed rows S of the request
(`layout.build_layout` on the settings' canvas and frames; t2va / fl2va, references not counted), its batch (1), the
passes the model evaluates (`sampler.reuse_plan`) and the AdaLN table rows (per evaluated pass, the distinct
timesteps of its rows: `PackedLayout.row_timesteps` done on the row kinds present, not on every row), the DiT depth
(`layers`, or the config's).

`memory_plan(config, shape, execution, card_gib=None, card="", dtype_policy="released") -> MemoryPlan` does the
arithmetic on a meta-device model (no allocation; `H3Config.full()` gives the released 33B numbers on any machine):

    peak = weights + tables + max(staging, activations)
    weights      the DiT's tensors on the device: the outside-block tensors + the resident blocks + the streaming
                 slots (`residency.Plan.device_bytes` without the tables); with `--adaln tables` without the blocks'
                 AdaLN projections, which stay in host memory
    tables       rows x 18 x hidden x 2 bytes x blocks (`residency.table_bytes`; 0 with AdaLN resident)
    staging      2 device slots of one block's AdaLN weights while the tables are computed, before the forwards;
                 the caching allocator then hands those bytes to the activations, hence the max
    activations  batch x S x B_row x MARGIN + FIXED_ACTIVATIONS, where B_row = 2 bytes x max(2*hidden + 6*inner,
                 3*hidden + 3*ffn): the bfloat16 tensors live at once per packed row inside one block, in the attention
                 part (stream, normed input, q, k, v, two normed/rotated copies, the attention output) and in the FFN
                 (stream, normed input, up projection [value; gate], SwiGLU output, down projection)

Assumptions: inference under no_grad (one block's activations live at a time; a training step keeps far more),
released dtypes, no hook holding tensors, one request (batch 1), TEXT_ROWS text rows when the prompt is not known.
Not counted: the text encoder and the VAEs (`--residency phased` releases them before the denoise phase), CUDA graph
pools, the CUDA context. MARGIN and FIXED_ACTIVATIONS are calibrated on the H200 measurements of the resident
forward's peak over its weights: 0.52 GiB at 2,066 rows and 1.34 GiB at 7,272 rows
(benchmarks/results/streaming.json) and about 17 GiB at 109,205 rows (benchmarks/results/forward_every_length.json): the
formula gives 0.57, 1.39 and 17.3 GiB. It is an estimate; the benchmarks measure the peak.

`MemoryPlan.fits` is peak <= the card (unknown card: True); `check_fits(plan)` refuses a request that does not fit
with one line (`MemoryPlanError`) naming the estimate, the card and the settings that would fit it. `lines()` /
`to_dict()` are what `h3lab --info --plan` and `!plan` print.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ValidationError

GiB = 2**30
TEXT_ROWS = 256  # prompt rows assumed when the prompt's token count is not known
MARGIN = 1.4  # allocator rounding and short-lived temporaries over the live set (calibrated: module docstring)
FIXED_ACTIVATIONS = GiB // 4  # per-forward tensors that do not scale with the rows (heads, tables, indices)


class MemoryPlanError(ValidationError):
    """A request whose estimated peak does not fit the card (one line: the estimate, the card, what would fit)."""


@dataclass(frozen=True)
class RequestShape:
    """The sizes of one request that set its memory (see the module docstring)."""

    task: str
    rows: int  # packed rows S
    batch: int
    passes: int  # evaluated passes
    table_rows: int  # sum over evaluated passes of their distinct timesteps
    layers: int  # DiT blocks that run
    label: str  # e.g. "t2va 1344x768 362f, 50 steps"


def request_shape(settings: Any, config: Any, shifts: tuple[float, float], text_rows: int = TEXT_ROWS
                  ) -> RequestShape:
    """The `RequestShape` of `settings` for a DiT of `config` (module docstring)."""
    from ..run.layout import CONDITION_VIDEO_T, REFERENCE_AUDIO_T, build_layout
    from ..run.sampler import DualSchedule, reuse_plan

    s = settings
    task = "fl2va" if s.task == "fl2va" else "t2va"  # references are sized by their media: not counted here
    layout = build_layout(task, torch.ones(text_rows, dtype=torch.long), s.num_latent_frames, s.latent_height,
                          s.latent_width, s.num_audio_latents, anchors=tuple(name for name, _ in s.anchors),
                          patch_size=tuple(config.patch_size))
    kinds = sorted(set(layout.row_time_kinds.unique().tolist()))
    schedule = DualSchedule.from_passes(s.steps, *shifts)
    evaluate = reuse_plan(schedule.num_passes, s.reuse)
    rows = 0
    for v, a, ev in zip(schedule.video.timesteps.tolist(), schedule.audio.timesteps.tolist(), evaluate):
        if ev:  # the values `row_timesteps` reduces with torch.unique, float32-rounded, for the kinds present
            values = torch.tensor([v, a, max(v, CONDITION_VIDEO_T), REFERENCE_AUDIO_T], dtype=torch.float32)
            rows += len(set(values[kinds].tolist()))
    layers = s.layers if getattr(s, "layers", None) else config.num_layers
    label = f"{s.task} {s.canvas[0]}x{s.canvas[1]} {s.num_frames}f, {s.steps} steps, mode {s.mode}"
    return RequestShape(task, layout.sequence_length, 1, sum(evaluate), rows, layers, label)


def activation_bytes(config: Any, rows: int, batch: int = 1) -> int:
    """The activation estimate of one forward (module docstring)."""
    h, inner, ffn = config.hidden_size, config.inner_dim, config.ffn_dim
    per_row = 2 * max(2 * h + 6 * inner, 3 * h + 3 * ffn)
    return int(batch * rows * per_row * MARGIN) + FIXED_ACTIVATIONS


@functools.lru_cache(maxsize=4)
def _meta_model(config: Any, dtype_policy: str):
    from ..model import H3Transformer

    with torch.device("meta"):
        return H3Transformer(config, dtype_policy=dtype_policy)


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate of one request on one card (module docstring); bytes."""

    shape: RequestShape
    residency: str
    adaln: str
    gpu_memory_gib: float | None
    plan: Any  # residency.Plan
    weights: int
    tables: int
    staging: int
    activations: int
    card_gib: float | None
    card: str

    @property
    def peak(self) -> int:
        return self.weights + self.tables + max(self.staging, self.activations)

    @property
    def fits(self) -> bool:
        return self.card_gib is None or self.peak <= self.card_gib * GiB

    def lines(self) -> list[str]:
        p, t = self.plan, self.plan.tables
        card = f"{self.card} ({self.card_gib:.1f} GiB)" if self.card_gib is not None else "no card known"
        budget = f", budget {self.gpu_memory_gib:g} GiB" if self.gpu_memory_gib is not None else ""
        out = [f"plan for {self.shape.label} ({self.shape.rows:,} rows) on {card}",
               f"  residency {self.residency}{budget}, AdaLN {self.adaln}",
               f"  DiT weights on the GPU  {self.weights / GiB:7.2f} GiB ({len(p.resident)} of "
               f"{len(p.resident) + len(p.streamed)} blocks resident, {len(p.streamed)} streamed through "
               f"{p.slots if p.streamed else 0} slots)"]
        if p.streamed:
            out.append(f"  streamed per forward    {p.streamed_bytes / GiB:7.2f} GiB")
        if t is not None:
            out.append(f"  AdaLN tables            {self.tables / GiB:7.2f} GiB ({self.shape.table_rows} timestep rows"
                       f" x {self.shape.layers} blocks); AdaLN weights {t.host_bytes / GiB:.2f} GiB in host memory, "
                       f"staged through {self.staging / GiB:.2f} GiB")
        out.append(f"  activations (estimate)  {self.activations / GiB:7.2f} GiB")
        verdict = "" if self.card_gib is None else (": fits" if self.fits else ": does NOT fit")
        out.append(f"  peak (estimate)         {self.peak / GiB:7.2f} GiB{verdict}")
        out.append("  not counted: the text encoder and the VAEs (--residency phased releases them before the DiT)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"request": self.shape.__dict__, "residency": self.residency, "adaln": self.adaln,
                "gpu_memory_gib": self.gpu_memory_gib, "plan": self.plan.to_dict(), "weights_bytes": self.weights,
                "tables_bytes": self.tables, "staging_bytes": self.staging, "activations_bytes": self.activations,
                "peak_bytes": self.peak, "card": self.card, "card_gib": self.card_gib, "fits": self.fits}


def memory_plan(config: Any, shape: RequestShape, execution: Any, card_gib: float | None = None, card: str = "",
                dtype_policy: str = "released") -> MemoryPlan:
    """The estimate of `shape` on a DiT of `config` placed as `execution` says (module docstring)."""
    from ..config import H3Config

    depth = H3Config(**{**config.to_diffusers(), "num_layers": shape.layers}) if shape.layers != config.num_layers \
        else config
    plan = execution.streaming_plan(_meta_model(depth, dtype_policy), table_rows=shape.table_rows)
    tables = plan.tables.table_bytes if plan.tables is not None else 0
    staging = plan.tables.staging_bytes if plan.tables is not None else 0
    return MemoryPlan(shape, execution.residency, execution.adaln, execution.gpu_memory, plan,
                      plan.device_bytes - tables, tables, staging, activation_bytes(config, shape.rows, shape.batch),
                      card_gib, card)


def check_fits(plan: MemoryPlan) -> None:
    """Refuse a request whose estimated peak exceeds the card, in one line, before any work."""
    if plan.fits:
        return
    hint = ("--residency streamed --gpu-memory GiB" if plan.residency != "streamed" else "a smaller --gpu-memory")
    if plan.adaln != "tables":
        hint = "--adaln tables, " + hint
    raise MemoryPlanError(
        f"{plan.shape.label} ({plan.shape.rows:,} rows) needs about {plan.peak / GiB:.1f} GiB on the GPU "
        f"(weights {plan.weights / GiB:.1f} + tables {plan.tables / GiB:.1f} + activations "
        f"{plan.activations / GiB:.1f}), more than {plan.card or 'the card'}'s {plan.card_gib:.1f} GiB: try {hint}, "
        "or fewer frames / a smaller canvas (h3lab --info --plan)")


def card_of(device: torch.device, card_gib: float | None = None) -> tuple[float | None, str]:
    """(GiB, name) of the card a plan is measured against: `card_gib` (a hypothetical card) when given, else the
    CUDA device's total memory, else (None, "") (the CPU: nothing to fit)."""
    if card_gib is not None:
        from ..components.residency import check_gpu_memory

        return check_gpu_memory(card_gib), "a hypothetical card (--card-memory)"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory / GiB, props.name
    return None, ""


def plan_request(session: Any, settings: Any, card_gib: float | None = None) -> MemoryPlan:
    """The `MemoryPlan` of `settings` on `session`'s DiT (the injected model's config, else the snapshot's; no model
    loads), execution plan and card (`card_gib`, else the session's `card_memory`, else its CUDA device)."""
    from ..config import H3Config
    from .pipeline import variant_for

    store = session.store
    variant = variant_for(settings.task)
    model = store.injected.get(variant)
    config = model.config if model is not None else H3Config.from_dict(store.component_config(variant))
    shape = request_shape(settings, config, (session.video_shift, session.audio_shift))
    gib, card = card_of(session.device, card_gib if card_gib is not None else session.card_memory)
    return memory_plan(config, shape, store.plan, gib, card, store.dtype_policy)
