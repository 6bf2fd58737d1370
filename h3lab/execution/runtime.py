"""Runtime modes, the op table each mode dispatches to, and the provenance trace.

Every arithmetic operator of `H3Transformer` is called through an `Ops` object obtained with `runtime.ops(...)`
at the start of a forward. The op *signatures* are defined once, here, by the `off` table (`REFERENCE_OPS`): plain
torch, written exactly as Diffusers' `MiniMaxH3Transformer3DModel` computes, so `off` on CPU is bit-equal to it.

The table of the running forward is a context variable: `H3Transformer.forward` enters `use_ops(ops)` for its
duration (and again around a gradient-checkpoint replay), and every module of the model — or a module outside code
inserts (a LoRA layer, a tensor-parallel wrapper) — reads it with `current_ops()`, so its calls go through the same
mode, overrides and trace as the model's own. Outside any forward `current_ops()` is a fresh table of the current
mode and overrides that records nothing (a module called on its own still runs strict when strict is asked).

Modes (`use_mode(...)`, a context manager over the execution context `h3lab.execution.context`, one frozen value in one
context variable, so threads and notebooks stay independent; overrides, placement and precomputed results below are
fields of it too):

- ``off``     the reference torch arithmetic; the oracle strict is measured against.
- ``strict``  only the deterministic, batch-invariant kernels of `h3kernels` (the `kernels/` folder). An op with no
              strict kernel, or a call a kernel refuses (shape, dtype, device), raises `StrictError` naming the op,
              the hook point, shapes, dtypes and device. Never a silent fallback.
- ``audit``   runs the production path (the torch ops) and records every op as not strict.
- ``auto``    strict where the kernel accepts the call, else the torch op, recording each fallback and its reason.
              On the CPU the kernels are Triton's interpreter (exact, far slower): auto runs the torch op there
              (`AUTO_ON_CPU`), so exporting TRITON_INTERPRET=1 never changes what auto runs; strict still runs it.
- ``fast``    NOT strict: the released graph with FP8 e4m3 projections and cuDNN attention (`h3lab.execution.fast`), CUDA
              inference only; it refuses the CPU and autograd with one line (`FastModeError`). Its trace says
              "strict": false. Code that needs the strict contract calls `require_not_fast(what)`.

A kernel's `check` says "cannot serve" by raising `h3kernels.registry.StrictUnsupported` (auto then falls back,
strict raises `StrictError`); any other exception from a check is a bug in the check and propagates unchanged.

Overrides (`use_overrides({"rope": fn})`) replace single ops whatever the mode; the ablation matrix uses them to
plant a perturbation, and the trace records them as backend ``override``.

Fusions (`use_fusions({"qk_norm_rope"})`, names of `FUSIONS`, none by default) let the model call one op for a
sequence of ops: `qk_norm_rope` (Q/K RMSNorm + RoPE) and `residual_norm_modulate` (the attention's gated residual +
the FFN's AdaLN pre-norm). `Ops.fuses(name)` says whether a table may; the model also requires that no hook is
registered. Their strict kernels reproduce the unfused strict chain's bytes, so the switch changes which kernels run
and the trace, never a result hash. `norm_modulate` is fused whenever nothing observes the norm (no switch).

Placement (`use_placement(p)`, entered by `h3lab.distributed` around a sharded forward): a point-scoped layer before
the overrides and the mode's kernels. `p.serve(name, point, ops)` returns None (the op runs as usual) or a callable
that serves the call on the shards -- the row-parallel `linear_tree` as a gather and the declared tree, attention as
the Ulysses exchange around `ops.dispatch(...)` (so an override or the mode's kernel still computes the attention,
on all rows of the rank's heads). The trace records served calls (`ops.log_served`), the topology
(`Trace.placement`) and the forward's collective log (`Trace.collectives`); both are None, and absent from
`to_dict()`, for a one-process forward.

Precomputed results (`use_precomputed(server)`, entered around a forward by `h3lab.model.adaln_tables` when a model's
AdaLN tables were computed ahead): a point-scoped layer before the placement. `server.serve(name, point, ops)` returns
None (the op runs as usual) or a callable that returns the rows computed ahead for this call and traces it with
`ops.log_served(...)`, carrying the backend, kernel and tile of the call that computed them: the record equals the one
the op would have written. A table built by one forward keeps the layer (a gradient-checkpoint replay is served as
its forward was).

`derived(tensors, tag, make)` keeps a value derived from integer tensors (the AdaLN row index) while they are
unchanged, and `frozen_index_caches()` is what a CUDA graph capture (`h3lab.execution.graphs`) runs inside: no index-cache
entry is built there (a miss raises before any host sync), and the entries read are collected for the graph.

`last_trace()` returns the `Trace` of the most recent forward in this context: per op call the hook point, the
requested and actual backend, kernel id, tile config, accumulator dtype, shapes and dtypes, plus device, library
versions and checkpoint fingerprint. `Trace.to_json()` serialises it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from . import context

MODES = ("strict", "audit", "auto", "off", "fast")
# auto on CPU tensors: "torch" (the production op; the interpreter only when strict is asked for) or "interpreter"
# (auto's per-op dispatch as on CUDA, for tests of that dispatch on a CPU machine).
AUTO_ON_CPU = "torch"
AUTO_CPU_REASON = "auto does not run Triton's interpreter (TRITON_INTERPRET=1) on cpu; --mode strict does"


class StrictError(RuntimeError):
    """Strict mode cannot serve an op call; the message names the op, the point, shapes, dtypes and device."""


class FastModeError(StrictError):
    """Fast mode refuses a call (CPU tensors, no FP8 on the GPU, autograd), or strict-contract code was asked to run
    in fast mode (`require_not_fast`). One line naming the value and the rule."""


# ------------------------------------------------------------------------------------------ reference ops (off)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias. The caller has already cast x to weight's dtype (released precision policy)."""
    return F.linear(x, weight, bias)


def linear_tree(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The row-parallel projections (attention O-proj, FFN down). Same math as `linear`; in strict mode the K axis
    is reduced as a fixed binary tree over 8 chunks so a TP2/4/8 split reproduces TP1 bytes."""
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`nn.RMSNorm` over the last axis: block/refiner/final norms on (B, S, hidden), Q/K norms on (B, S, H, D)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """AdaLN modulation gathered per packed row: x (B, S, D); scale/shift tables (R, D); index (S,) int64.
    Each row reads table row `index[s]` (`timestep_index * 3 + token_tag` in blocks, `timestep_index` at the end)."""
    return x * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)


def norm_modulate(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """The AdaLN pre-norm as one op: `modulate(rms_norm(x, weight, eps), scale, shift, index)`, exactly the two
    reference ops in sequence (so `off` stays bit-equal to Diffusers). The model calls it when no hook observes the
    intermediate norm and neither op is overridden; the strict kernel reproduces the two strict kernels' bytes."""
    return modulate(rms_norm(x, weight, eps), scale, shift, index)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention's Q/K norm and RoPE as one op (fusion `qk_norm_rope`): `rope(rms_norm(q, q_weight, eps), cos,
    sin)` and the same for k, exactly the reference ops in sequence. The model calls it only when the fusion is on,
    no hook is registered and none of the ops is overridden; the strict kernel reproduces the strict chain's bytes."""
    return rope(rms_norm(q, q_weight, eps), cos, sin), rope(rms_norm(k, k_weight, eps), cos, sin)


def residual_norm_modulate(
    residual: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
    eps: float, scale: torch.Tensor, shift: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's attention residual and its FFN pre-norm as one op (fusion `residual_norm_modulate`):
    `s = gated_residual(residual, gate, index, y)` and `norm_modulate(s, weight, eps, scale, shift, index)`, returned
    as (s, modulated), exactly the reference ops in sequence. Called under the same conditions as `qk_norm_rope`."""
    stream = gated_residual(residual, gate, index, y)
    return stream, norm_modulate(stream, weight, eps, scale, shift, index)


def gated_residual(residual: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """residual + gate[index] * y, in that order (RFC: residual gates applied in the declared order)."""
    return residual + gate.index_select(0, index) * y


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain residual add (token refiner blocks)."""
    return a + b


def rope_table(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, 3) positions, (F,) inv_freq -> cos, sin of shape (S, 2*3*F) in float32, angle layout [t,h,w,t,h,w]."""
    position_ids = position_ids.to(torch.float32)
    freqs = position_ids.unsqueeze(-1) * inv_freq.view(1, 1, -1)  # (S, 3, F)
    freqs_t, freqs_h, freqs_w = freqs.unbind(dim=1)
    freqs = torch.cat((freqs_t, freqs_h, freqs_w), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotate-half RoPE on (B, S, H, D): the leading cos.shape[-1] channels rotate, the rest pass through.
    cos/sin are cast to x's dtype first, as the released implementation does."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    cos = cos.to(x.dtype)[None, :, None, :]
    sin = sin.to(x.dtype)[None, :, None, :]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rot = x_rot * cos + rotated * sin
    return torch.cat((x_rot, x_pass), dim=-1).contiguous()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_order: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal, unmasked attention over one packed document. q, k, v: (B, S, H, D) -> (B, S, H, D), scale
    1/sqrt(D). The same call Diffusers' native backend makes.

    `key_order` (S,) int64, optional: the canonical order in which keys are visited (`PackedLayout.key_order()`:
    the packed position of canonical row 0, 1, ...). None means packed order, which *is* canonical for a layout in
    canonical order — the released case, bit-equal to Diffusers. For a consistently permuted layout, visiting keys
    in canonical order is what makes the output bytes permute with the rows (H-C3); here K and V are gathered into
    that order before the torch op, strict kernels read them through the order directly."""
    if key_order is not None:
        k, v = k.index_select(1, key_order), v.index_select(1, key_order)
    out = F.scaled_dot_product_attention(
        q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), dropout_p=0.0, is_causal=False
    )
    return out.permute(0, 2, 1, 3)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """Diffusers' SwiGLU on the fc1 output: [value; gate] halves, value * silu(gate)."""
    value, gate = h.chunk(2, dim=-1)
    return value * F.silu(gate)


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """H3 timestep sinusoid: float32, t unscaled in [0, 1], max period 10000, [cos | sin] (flip_sin_to_cos)."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(start=0, end=half, dtype=torch.float32, device=t.device)
    exponent = exponent / half
    emb = t[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)


def pack_rows(
    seq_len: int,
    text: tuple[torch.Tensor, torch.Tensor],
    video: tuple[torch.Tensor, torch.Tensor],
    audio: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """Zero-initialised packed buffer (B, seq_len, D) in the text rows' dtype; text, video, audio rows copied to
    their packed positions in that order. Each part is (index (N,), rows (B, N, D))."""
    text_idx, text_rows = text
    out = text_rows.new_zeros((text_rows.shape[0], seq_len, text_rows.shape[-1]))
    out = out.index_copy(1, text_idx, text_rows)
    out = out.index_copy(1, video[0], video[1].to(text_rows.dtype))
    out = out.index_copy(1, audio[0], audio[1].to(text_rows.dtype))
    return out


def select_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Output-row selection: x (B, S, C) -> (B, N, C) rows `index`."""
    return x.index_select(1, index)


REFERENCE_OPS: dict[str, Callable[..., Any]] = {
    fn.__name__: fn
    for fn in (
        linear, linear_tree, rms_norm, modulate, norm_modulate, gated_residual, add, rope_table, rope, attention,
        swiglu, silu, timestep_embedding, pack_rows, select_rows, qk_norm_rope, residual_norm_modulate,
    )
}
OP_NAMES = tuple(REFERENCE_OPS)


# ----------------------------------------------------------------------------------------------- mode state
# The mode, overrides, placement and precomputed results are fields of the one execution context (`h3lab.execution.context`);
# the setters below are thin ones over it. The last trace and the running forward's op table are records of what ran.
_last_trace: contextvars.ContextVar["Trace | None"] = contextvars.ContextVar("h3lab_last_trace", default=None)
_current_ops: contextvars.ContextVar["Ops | None"] = contextvars.ContextVar("h3lab_current_ops", default=None)

# Epilogue fusions a forward may switch on (`use_fusions`), each an op of the table standing for a sequence of ops:
# fusion name -> the ops it replaces. Off by default; the model takes a fused op only where nothing could observe
# the values in between (no hook registered, none of the ops overridden).
FUSIONS: dict[str, tuple[str, ...]] = {
    "qk_norm_rope": ("rms_norm", "rope"),
    "residual_norm_modulate": ("gated_residual", "rms_norm", "modulate"),
}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: must be one of {', '.join(MODES)}")
    return mode


def current_mode() -> str:
    return context.current().mode


def require_not_fast(what: str, mode: str | None = None) -> None:
    """Refuse (FastModeError, one line) when `mode` (default: the current mode) is "fast": `what` (e.g. "an RL
    rollout") needs the strict contract, and fast mode's FP8 projections are neither strict nor batch-invariant."""
    mode = current_mode() if mode is None else mode
    if mode == "fast":
        raise FastModeError(f"{what} needs the strict contract: mode 'fast' (FP8 projections, cuDNN attention) is not "
                            "strict; use mode strict")


@contextlib.contextmanager
def use_mode(mode: str) -> Iterator[str]:
    """Run the enclosed forwards in `mode` ("strict" | "audit" | "auto" | "off")."""
    with context.use(mode=check_mode(mode)):
        yield mode


@contextlib.contextmanager
def use_overrides(overrides: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """Replace single ops (by name) in every mode; used to plant ablation perturbations."""
    unknown = sorted(set(overrides) - set(OP_NAMES))
    if unknown:
        raise ValueError(f"override for unknown op(s) {unknown}: ops are {', '.join(OP_NAMES)}")
    merged = {**dict(context.current().overrides), **overrides}
    with context.use(overrides=tuple(sorted(merged.items(), key=lambda item: item[0]))):
        yield


def check_fusions(names: Any) -> frozenset:
    """`names` (an iterable of names of `FUSIONS`) as a frozenset; one line naming the value and the rule if not."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"fusions={names!r}: must be a collection of fusion names ({', '.join(FUSIONS)})")
    unknown = sorted(set(names) - set(FUSIONS))
    if unknown:
        raise ValueError(f"fusion(s) {unknown}: must be among {', '.join(FUSIONS)}")
    return frozenset(names)


@contextlib.contextmanager
def use_fusions(names: Any) -> Iterator[frozenset]:
    """Switch on the epilogue fusions `names` (`FUSIONS`) for the enclosed forwards (replacing the enclosing
    choice; `use_fusions(())` switches all off). Every fused strict kernel reproduces the bytes of its unfused strict
    chain, so a result does not change: only the kernels that run (and the trace) do."""
    chosen = check_fusions(names)
    with context.use(fusions=tuple(sorted(chosen))):
        yield chosen


def current_fusions() -> frozenset:
    """The fusions the enclosing `use_fusions` switched on (empty by default)."""
    return frozenset(context.current().fusions)


@contextlib.contextmanager
def use_placement(placement: Any) -> Iterator[Any]:
    """Serve the enclosed forwards' ops through `placement` (`serve(name, point, ops) -> callable | None`, and
    `describe() -> dict` for the trace); `h3lab.distributed` enters it around a sharded forward."""
    with context.use(placement=placement):
        yield placement


def current_placement() -> Any:
    """The placement the enclosing `use_placement` set (None for a one-process forward)."""
    return context.current().placement


@contextlib.contextmanager
def use_precomputed(server: Any) -> Iterator[Any]:
    """Serve the enclosed forwards' ops from results computed ahead where `server.serve(name, point, ops)` returns a
    callable (see the module docstring); None serves nothing."""
    with context.use(precomputed=server):
        yield server


def current_precomputed() -> Any:
    """The server the enclosing `use_precomputed` set (None: every op is computed in its forward)."""
    return context.current().precomputed


def active_overrides() -> tuple[str, ...]:
    """Names of the ops the enclosing `use_overrides` replace, sorted."""
    return tuple(name for name, _ in context.current().overrides)


@contextlib.contextmanager
def use_ops(table: "Ops") -> Iterator["Ops"]:
    """Make `table` the op table of the enclosed code (`current_ops()`); `H3Transformer.forward` enters it."""
    token = _current_ops.set(table)
    try:
        yield table
    finally:
        _current_ops.reset(token)


def current_ops() -> "Ops":
    """The op table of the running forward (what `use_ops` set). A module dispatches through it:
    `runtime.current_ops().linear(x, weight, bias, point="blocks.0.q.lora_a")`. Outside any forward: a fresh table
    of the current mode and overrides that records nothing."""
    table = _current_ops.get()
    if table is None:
        mode = current_mode()
        table = Ops(mode, Trace(mode=mode, device=""), record=False)
    return table


def last_trace() -> "Trace | None":
    """Provenance of the last forward run in this context (None before the first)."""
    return _last_trace.get()


def set_last_trace(trace: "Trace") -> None:
    """Make `trace` `last_trace()`: a CUDA graph replay (`h3lab.execution.graphs`) runs no op table."""
    _last_trace.set(trace)


# ---------------------------------------------------------------------------------------------------- trace
@dataclass
class OpRecord:
    op: str
    point: str
    requested: str  # mode the call was made in
    actual: str  # "strict" | "torch" | "override"
    kernel_id: str
    tile: str
    acc_dtype: str
    shapes: list
    dtypes: list
    fallback: str = ""  # why a strict call fell back (auto) / was not strict (audit)


@dataclass
class Trace:
    mode: str
    device: str
    fingerprint: str = ""
    versions: dict = field(default_factory=dict)
    records: list[OpRecord] = field(default_factory=list)
    placement: dict | None = None  # topology, rank, ownership of a sharded forward (h3lab.distributed)
    collectives: Any = None  # its CollectiveLog (`to_dict()`): each collective, its algorithm, fallback state
    graph: dict | None = None  # fast and strict: how the forward ran (`h3lab.execution.graphs`: eager, captured, replay)

    @property
    def fallbacks(self) -> list[OpRecord]:
        return [r for r in self.records if r.actual != "strict"]

    def summary(self) -> dict[str, dict[str, int]]:
        """op -> {actual backend: count}."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            out.setdefault(r.op, {}).setdefault(r.actual, 0)
            out[r.op][r.actual] += 1
        return out

    def to_dict(self) -> dict[str, Any]:
        out = {
            "mode": self.mode,
            "device": self.device,
            "fingerprint": self.fingerprint,
            "versions": self.versions,
            "summary": self.summary(),
            "records": [asdict(r) for r in self.records],
        }
        if self.mode == "fast":
            out["strict"] = False  # only fast traces carry the key: every other trace's dict is unchanged
        if self.placement is not None:
            out["placement"] = self.placement
        if self.collectives is not None:
            out["collectives"] = self.collectives.to_dict()
        if self.graph is not None:
            out["graph"] = self.graph
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # pragma: no cover - triton is a hard dependency, but provenance must never crash
        out["triton"] = "unavailable"
    return out


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def _describe(args: tuple, kwargs: dict) -> tuple[list, list]:
    """Shapes and dtype names of the tensor arguments (and of tensors one tuple/list deep), in argument order."""
    shapes, dtypes = [], []
    for a in (args + tuple(kwargs.values())) if kwargs else args:
        if isinstance(a, torch.Tensor):
            shapes.append(list(a.shape))
            dtypes.append(_DTYPE_NAMES.get(a.dtype) or _dtype_name(a.dtype))
        elif isinstance(a, (tuple, list)):
            for t in a:
                if isinstance(t, torch.Tensor):
                    shapes.append(list(t.shape))
                    dtypes.append(_DTYPE_NAMES.get(t.dtype) or _dtype_name(t.dtype))
    return shapes, dtypes


def _device_of(args: tuple) -> str:
    for a in args:
        for t in a if isinstance(a, (tuple, list)) else (a,):
            if isinstance(t, torch.Tensor):
                return str(t.device)
    return "cpu"


_TORCH_INFO = {"kernel_id": "torch", "tile": "", "acc_dtype": "torch-default"}


# ------------------------------------------------------------------------------------------------ dispatcher
class Ops:
    """The op table of one forward. `ops.linear(x, w, b, point="blocks.3.q")`: every op takes its reference
    signature plus a keyword `point` (the hook point it serves, recorded in the trace). Every op is a method of the
    class (installed from `OP_NAMES` below), so a table makes no reference cycle."""

    def __init__(self, mode: str, trace: Trace, record: bool = True, overrides: bool = True,
                 placement: bool = True, precomputed: bool = True):
        self.mode = check_mode(mode)
        self.trace = trace
        self.record = record
        ctx = context.current()
        self._overrides = dict(ctx.overrides) if overrides else {}
        self._placement = ctx.placement if placement else None
        self._precomputed = ctx.precomputed if precomputed else None
        self._fusions = frozenset(ctx.fusions)
        self._strict, self._unsupported = _strict_registry() if mode in ("strict", "auto") else ({}, ())

    def fusable(self, *names: str) -> bool:
        """True when no override replaces any of the ops `names`: a fused op may then stand for their sequence
        (an override of one of them, e.g. an ablation's planted perturbation, keeps them apart)."""
        return not any(name in self._overrides for name in names)

    def fuses(self, fusion: str) -> bool:
        """True when the fusion `fusion` (`FUSIONS`) is switched on for this table, no override replaces any op it
        stands for and the mode is not fast (whose own fused producers serve the unfused ops); the caller also checks
        that no hook observes the values in between."""
        return fusion in self._fusions and self.mode != "fast" and self.fusable(*FUSIONS[fusion])

    def __getattr__(self, name: str) -> Callable[..., Any]:
        # Only reached for names that are no op (every op is a method, installed below `Ops`).
        raise AttributeError(f"no op {name!r}: ops are {', '.join(OP_NAMES)}")

    def overrides(self) -> dict[str, Callable[..., Any]]:
        """The op overrides this table applies (name -> function)."""
        return dict(self._overrides)

    def _call(self, name: str, point: str, args: tuple, kwargs: dict) -> Any:
        if self._precomputed is not None:
            served = self._precomputed.serve(name, point, self)
            if served is not None:
                return served(*args, **kwargs)
        if self._placement is not None:
            served = self._placement.serve(name, point, self)
            if served is not None:
                return served(*args, **kwargs)
        return self.dispatch(name, point, args, kwargs)

    def dispatch(self, name: str, point: str, args: tuple, kwargs: dict | None = None) -> Any:
        """Op `name` through the overrides and the mode's kernels, traced (what a call runs without a placement,
        and what a placement calls on the exchanged tensors)."""
        kwargs = kwargs or {}
        if name in self._overrides:
            self._log(name, point, "override", {"kernel_id": f"override:{name}", "tile": "", "acc_dtype": ""}, args, kwargs)
            return self._overrides[name](*args, **kwargs)
        if self.mode in ("off", "audit"):
            note = "audit: production torch op" if self.mode == "audit" else ""
            self._log(name, point, "torch", _TORCH_INFO, args, kwargs, note)
            return REFERENCE_OPS[name](*args, **kwargs)
        if self.mode == "fast":
            info, fn = fast.serve(name, point, args, kwargs)
            self._log(name, point, "fast", info, args, kwargs, "fast: not strict")
            return fn(*args, **kwargs)
        if self.mode == "auto" and AUTO_ON_CPU == "torch" and _device_of(args) == "cpu":
            self._log(name, point, "torch", _TORCH_INFO, args, kwargs, f"auto fallback: {AUTO_CPU_REASON}")
            return REFERENCE_OPS[name](*args, **kwargs)
        kernel = self._strict.get(name)
        reason = ""
        if kernel is None:
            reason = f"no strict kernel is registered for op {name!r}"
        else:
            try:
                info = kernel.check(*args, **kwargs)
            except self._unsupported as exc:  # the kernel refuses the call; any other exception is a bug: it propagates
                reason = str(exc)
            else:
                self._log(name, point, "strict", info, args, kwargs)
                return kernel.checked(*args, **kwargs)  # validated once, by the check above
        if self.mode == "strict":
            shapes, dtypes = _describe(args, kwargs)
            raise StrictError(
                f"strict mode cannot run op {name!r} at {point or '<no point>'} "
                f"(shapes {shapes}, dtypes {dtypes}, device {_device_of(args)}): {reason}"
            )
        self._log(name, point, "torch", _TORCH_INFO, args, kwargs, f"auto fallback: {reason}")
        return REFERENCE_OPS[name](*args, **kwargs)

    def log_served(self, name: str, point: str, info: dict, args: tuple, kwargs: dict | None = None,
                   actual: str = "strict", fallback: str = "") -> None:
        """Trace a call served outside `dispatch`: by a placement with strict kernels and strict collectives, or from
        rows computed ahead (`info`: kernel_id, tile, acc_dtype; `actual` / `fallback` as the computing call's)."""
        self._log(name, point, actual, info, args, kwargs or {}, fallback)

    def _log(self, name, point, actual, info, args, kwargs, fallback: str = "") -> None:
        if not self.record:
            return
        shapes, dtypes = _describe(args, kwargs)
        get = info.get
        self.trace.records.append(OpRecord(  # positional, in field order: this runs once per op call
            name, point, self.mode, actual, str(get("kernel_id", "")), str(get("tile", "")), str(get("acc_dtype", "")),
            shapes, dtypes, fallback,
        ))


def _op_method(name: str) -> Callable[..., Any]:
    def call(self: Ops, *args: Any, point: str = "", **kwargs: Any) -> Any:
        return self._call(name, point, args, kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = REFERENCE_OPS[name].__doc__
    return call


# Each op is a method of the class, not a closure stored on the instance: a table holds no reference to itself, so
# it -- and the trace it fills -- is freed by reference counting when the forward ends (a per-forward reference
# cycle left thousands of trace objects to the cyclic garbage collector, whose pauses showed on the GPU as a
# host-bound strict forward's jitter).
for _name in OP_NAMES:
    setattr(Ops, _name, _op_method(_name))
del _name


def ops(device: torch.device | str = "cpu", fingerprint: str = "", record: bool = True) -> Ops:
    """Start a forward in the current mode: a fresh `Trace` becomes `last_trace()` and the returned `Ops` fills it."""
    mode = current_mode()
    trace = Trace(mode=mode, device=str(device), fingerprint=fingerprint, versions=versions())
    placement = context.current().placement
    if placement is not None:
        trace.placement = placement.describe()
    _last_trace.set(trace)
    return Ops(mode, trace, record=record)


def mode_op(name: str) -> Callable[..., Any]:
    """Op `name` exactly as the current mode dispatches it (strict fails closed, auto falls back), ignoring overrides
    and any placement or precomputed results, recording nothing: what an override that perturbs only some calls
    delegates the others to."""
    mode = current_mode()
    return getattr(Ops(mode, Trace(mode=mode, device=""), record=False, overrides=False, placement=False,
                       precomputed=False), name)


# ------------------------------------------------------------------------------------- derived index tensors
_DERIVED: Any = None


def derived(tensors: tuple[torch.Tensor, ...], tag: str, make: Callable[[], Any]) -> Any:
    """`make()` (a value derived from the integer tensors `tensors`: the AdaLN row index, a tensor's host bytes)
    computed once while every tensor is the same live object at the same `_version`, as the strict kernels cache
    their validated index metadata (`h3kernels._index_cache`): the same layout tensors give the same derived object,
    so the kernels' caches keyed by it hit too, and a CUDA graph capture (`h3lab.execution.graphs`) finds it built.
    Inside `torch.inference_mode()` nothing is cached (its result is an inference tensor, which a later forward
    under autograd could not use)."""
    global _DERIVED
    if torch.is_inference_mode_enabled():
        return make()
    if _DERIVED is None:
        from h3kernels._index_cache import IndexCache

        _DERIVED = IndexCache(max_entries=256)
    return _DERIVED.get(tuple(tensors), (tag,), lambda: {"value": make()})["value"]


def host_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes on the host (one device read), read once per live tensor and `_version` (`derived`): what a
    graph signature holds of an integer tensor (`h3lab.execution.context` encodes tensors with it)."""
    return derived((t,), "host_bytes", lambda: t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
                   .tobytes())


def frozen_index_caches():
    """Context manager for a CUDA graph capture: no index-cache entry (strict kernels' or `derived`) is built
    inside, a miss raises `h3kernels._index_cache.IndexCacheMiss` before any host sync; it yields the list of every
    entry looked up (the graph keeps them alive)."""
    from h3kernels import _index_cache

    return _index_cache.frozen()


def kernel_settings() -> tuple:
    """The strict kernels' module-level launch settings a captured graph bakes in: the GEMM tile tables and narrow
    rule, attention's tiles and forward variants (frozen values, compared by value). A CUDA graph replays the kernels
    it captured whatever these say later, so graph signatures hold them (`h3lab.execution.graphs`,
    `h3lab.training.step_graph`): swapping a tile table (the benchmarks' variants do) is a new signature."""
    from h3kernels import attention, gemm

    return (tuple(gemm.LINEAR_TILES.items()), tuple(gemm.TREE_TILES.items()), gemm.SPLIT_MAX_N, gemm.SPLIT_MIN_K,
            tuple(attention.TILES.items()), tuple(attention.FORWARD.items()))


def live_index_entries() -> list:
    """Every index-cache entry held now (strict kernels' and `derived`): what a graph whose capture also ran on
    another thread (autograd's, for a captured backward) pins, since `frozen_index_caches()` covers one thread."""
    from h3kernels import _index_cache

    return _index_cache.live_entries()


def _strict_registry() -> tuple[dict[str, Any], type[Exception]]:
    """(op name -> strict kernel entry, the refusal exception). An entry's `.check(*args)` returns the provenance dict
    or raises `StrictUnsupported`; `.run(*args)` computes the op."""
    from h3kernels import registry

    return registry.STRICT_OPS, registry.StrictUnsupported


from . import fast  # noqa: E402 - the fast op table; it gets the reference ops and the refusal type from here
fast.bind(REFERENCE_OPS, FastModeError)
context.bind_bytes(host_bytes)
