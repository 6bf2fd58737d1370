"""`--mode fast`: the released graph with FP8 e4m3 projections and the fastest attention. NOT strict.

Contract
--------
linear, linear_tree   a bfloat16 weight (N, K) with K and N multiples of 16 and bfloat16 rows x (..., K), on a CUDA
                      GPU with FP8 matmuls (compute capability >= 8.9):
                        weight  quantised once per weight tensor (first use; cached while it is the same live tensor
                                with the same `_version`, so an in-place update re-quantises) to float8_e4m3fn with one
                                float32 scale per output channel, scale_w[n] = max|w[n, :]| / 448 (`prepare(model)`
                                quantises every projection up front, at load);
                        rows    one scale per row: the codes a fused producer emitted with x (below), else
                                `h3kernels.fp8_quant.quantize_rows(x)`, kept with x (`ROWS`, while x lives at the
                                same `_version`) so the q, k and v projections of one input quantise it once;
                        y       torch._scaled_mm(q_x, q_w^T, scale_x (M, 1), scale_w (1, N), out_dtype bfloat16)
                                (CUTLASS row-wise scaling, float32 accumulation with promotion: use_fast_accum off),
                                then + bias in bfloat16.
                      float32 weights (the released float32 modules: time embedder, AdaLN input side, heads) run
                      F.linear in float32, exactly as `off`; a bfloat16 projection whose K or N is not a multiple of
                      16 runs F.linear in bfloat16 (trace kernel_id `fast.bf16.linear`).
attention             `use_fp8_attention("auto")` (default): `h3kernels.fp8_attention.attention_fp8` (e4m3 Q/K/P/V,
                      per-block scales, float32 softmax, bfloat16 out) for head_dim 128 at FP8_ATTENTION_MIN_ROWS
                      rows or more, where it measured faster than cuDNN on the H200 (benchmarks/results/
                      fp8_attention_sweep.json); else F.scaled_dot_product_attention with cuDNN first (then flash,
                      memory-efficient): the `off` call with the faster backend. "on" takes the FP8 kernel for every
                      head_dim it supports, "off" never.
norm_modulate, swiglu  fused FP8 producers (`h3kernels.fp8_fused`, bfloat16 rows that fit one program): the op's
                      bfloat16 output (float32 arithmetic, one rounding) and its e4m3 row codes and scales in one
                      launch, kept in `ROWS` for the projection that reads the output. `use_fused_producers(False)`
                      turns both the fusion and the shared codes off (the reference ops and one quantiser a call).
rms_norm, rope        on (B, S, H, D) bfloat16 heads (the Q/K norm and RoPE): `h3kernels.fast_qk` (one launch each, float32
                      arithmetic, one bfloat16 rounding; torch's ops took ~8 launches for a RoPE); off with
                      `use_fused_producers(False)`.
every other op        the reference torch op (`off`).
CUDA graphs           `H3Transformer.forward` runs a fast forward through `h3lab.execution.graphs` (its fast front: capture
                      on a signature's second call, replays after; the eager forward otherwise): see that module.
Not strict            the trace's mode is "fast", every record's backend is "fast" and `Trace.to_dict()` carries
                      "strict": false; strict kernels are never called and strict never calls these. Code that
                      needs the strict contract (RL rollouts, batch-invariant replays) calls
                      `runtime.require_not_fast(what)`, which refuses with one line.
Refused (FastModeError, one line naming the op, its point and the rule)
                      tensors on a device other than CUDA (no FP8 matmul on the CPU: the CPU has no fast mode; tests
                      use `linear_reference`, the float32 emulation of the same quantised product), a GPU below
                      compute capability 8.9, and autograd recording through an op (fast is inference-only: FP8
                      products have no backward).
Emulation             `use_emulation()` (tests and the benchmarks' CPU dry runs only) lets fast run on the CPU: the
                      projections are `linear_reference` (kernel_id `fast.emulated.fp8_e4m3`; a weight already in
                      `WEIGHTS` is read through its cached FP8 copy, the same bytes), attention the plain SDPA call.
                      Never the product path: the session's CPU refusal stands outside that context.
Without bf16          `h3lab.execution.fast_weights.drop_bf16(model)` moves the bf16 bytes of the weights fast only reads as
                      FP8 off the GPU (92.6 -> ~31 GiB for the released DiT); a weight in `WEIGHTS` is accepted on
                      the host, its FP8 copy is what runs.
Cost                  measured per pass against `off` (velocity and latent drift over a 20-pass trajectory) by
                      `benchmarks/benchmark_every_length.py` (H200: 7% per-pass velocity, 4.5% latent after 20
                      passes at 512x512x22f; forward_fast_drift.json); see docs/strict-and-drift.md.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from . import context

FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
ALIGN = 16  # torch._scaled_mm needs K and N multiples of 16
MIN_CAPABILITY = (8, 9)

_LINEAR_INFO = {"kernel_id": "fast.fp8_e4m3.scaled_mm.rowwise", "tile": "cutlass rowwise, fast_accum off",
                "acc_dtype": "float32"}
_BF16_INFO = {"kernel_id": "fast.bf16.linear", "tile": "", "acc_dtype": "torch-default"}
_FP32_INFO = {"kernel_id": "fast.fp32.linear", "tile": "", "acc_dtype": "float32"}
_ATTN_INFO = {"kernel_id": "fast.sdpa.cudnn", "tile": "cudnn > flash > efficient", "acc_dtype": "float32"}
_FP8_ATTN_INFO = {"kernel_id": "fast.fp8_e4m3.attention", "tile": "per-block scales, P e4m3", "acc_dtype": "float32"}
_TORCH_INFO = {"kernel_id": "fast.torch", "tile": "", "acc_dtype": "torch-default"}
_NORM_MOD_INFO = {"kernel_id": "fast.fused.norm_modulate_e4m3", "tile": "one row per program",
                  "acc_dtype": "float32"}
_SWIGLU_INFO = {"kernel_id": "fast.fused.swiglu_e4m3", "tile": "one row per program", "acc_dtype": "float32"}
_HEAD_NORM_INFO = {"kernel_id": "fast.fused.head_rms_norm", "tile": "8 heads per program", "acc_dtype": "float32"}
_ROPE_INFO = {"kernel_id": "fast.fused.rope", "tile": "8 heads per program", "acc_dtype": "float32"}
_EMULATED_INFO = {"kernel_id": "fast.emulated.fp8_e4m3", "tile": "float32 emulation", "acc_dtype": "float32"}
# Fast mode's switches are fields of the one execution context (`h3lab.execution.context`): fast_emulated, fast_fused,
# fp8_attention.


@contextlib.contextmanager
def use_emulation() -> Iterator[None]:
    """Tests and CPU dry runs only: fast mode runs anywhere, its projections emulated by `linear_reference`."""
    with context.use(fast_emulated=True):
        yield


def use_fused_producers(enabled: bool):
    """Enable (default) or disable the fused FP8 producers and the shared row codes (benchmarks measure both)."""
    return context.use_flag("fast_fused", enabled, "use_fused_producers")


FP8_ATTENTION_CHOICES = ("auto", "on", "off")
# "auto": the FP8 kernel from this many rows on. H200, fp8_attention_sweep.json (56 x 128 heads, quantisation included):
# 0.73x cuDNN at 2,066 rows, 1.05x at 7,272, 1.12x at 37,853
FP8_ATTENTION_MIN_ROWS = 7000


@contextlib.contextmanager
def use_fp8_attention(choice: str) -> Iterator[None]:
    """"auto" (default: the FP8 attention kernel where it measured faster), "on" or "off" (cuDNN bf16 SDPA)."""
    if choice not in FP8_ATTENTION_CHOICES:
        raise ValueError(f"use_fp8_attention({choice!r}): must be one of {', '.join(FP8_ATTENTION_CHOICES)}")
    with context.use(fp8_attention=choice):
        yield


def emulated() -> bool:
    """True inside `use_emulation()`."""
    return context.current().fast_emulated


_BOUND: dict[str, Any] = {}  # set by `bind` from h3lab.execution.runtime: this module never imports the runtime


def bind(reference_ops: dict[str, Callable[..., Any]], error: type[Exception]) -> None:
    """The runtime hands fast mode its reference op table and its refusal type (`runtime.FastModeError`) at import."""
    _BOUND["ops"], _BOUND["error"] = reference_ops, error


def _error(message: str) -> Exception:
    return _BOUND["error"](message)


# ------------------------------------------------------------------------------------------------ quantisation
def quantize_rows_reference(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn (R, K), scale float32 (R, 1)) of t (R, K), one scale per row: the math of the GPU row
    quantiser in torch (any device). Used for weights (rows = output channels) and as the test reference."""
    t = t.reshape(-1, t.shape[-1]).float()
    amax = torch.clamp(t.abs().amax(dim=1, keepdim=True), min=AMAX_FLOOR)
    scale = amax / torch.full_like(amax, FP8_MAX)  # a true division on CUDA too (a scalar divisor is a reciprocal)
    q = torch.clamp(t / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fast projection emulated in float32 on any device: dequantised rows @ dequantised weight^T (+ bias),
    cast to x's dtype. What `_scaled_mm` computes, up to its accumulation order."""
    qx, sx = quantize_rows_reference(x)
    hit = WEIGHTS.lookup(weight)  # a weight `fast_weights.drop_bf16` dropped is read through its FP8 copy only
    qw, sw = (hit[0], hit[1].reshape(-1, 1)) if hit is not None else quantize_rows_reference(weight)
    y = (qx.float() * sx) @ (qw.float() * sw).t()
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def norm_modulate_quant_reference(x, weight, eps, scale, shift, index):
    """float32 torch reference of `h3kernels.fp8_fused.norm_modulate_quant`: (y bf16, q, s), (q, s) of y."""
    xf = x.float()
    inv = 1.0 / torch.sqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    y = (xf * inv * weight.float() * (1.0 + scale.float().index_select(0, index))
         + shift.float().index_select(0, index)).to(torch.bfloat16)
    return (y, *quantize_rows_reference(y))


def swiglu_quant_reference(h):
    """float32 torch reference of `h3kernels.fp8_fused.swiglu_quant`: (y bf16, q, s), (q, s) of y."""
    value, gate = h.float().chunk(2, dim=-1)
    y = (value * (gate / (1.0 + torch.exp(-gate)))).to(torch.bfloat16)
    return (y, *quantize_rows_reference(y))


class _TensorCache:
    """tensor -> its FP8 form (q float8_e4m3fn, scale float32), valid while it is the same live tensor with the same
    `_version` (an in-place update invalidates the entry; a dead tensor's entry is dropped)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, int, torch.Tensor, torch.Tensor]] = {}

    def lookup(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        entry = self._entries.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2], entry[3]
        return None

    def store(self, t: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        key = id(t)
        self._entries[key] = (weakref.ref(t, lambda _r, k=key: self._entries.pop(k, None)), t._version, q, scale)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class _WeightCache(_TensorCache):
    """weight tensor -> (q (N, K) float8_e4m3fn, scale (1, N) float32), quantised on first use."""

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self.lookup(w)
        if hit is not None:
            return hit
        with torch.no_grad():
            q, scale = quantize_rows_reference(w.detach())
        q, scale = q.contiguous(), scale.reshape(1, -1).contiguous()
        self.store(w, q, scale)
        return q, scale


WEIGHTS = _WeightCache()
# activation -> (q (M, K), scale (M, 1)): what a fused producer emitted with it (`norm_modulate`, `swiglu`) or what
# the first projection reading it quantised (the q, k and v projections share one input: one quantiser launch)
ROWS = _TensorCache()


def _fp8_eligible(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % ALIGN == 0 and k % ALIGN == 0


def prepare(model: torch.nn.Module) -> int:
    """Quantise every FP8-eligible projection weight of `model` now (what the first fast forward would do lazily);
    returns how many. Call once after loading."""
    n = 0
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.dim() == 2 and w.is_cuda and _fp8_eligible(w) and _is_linear(module):
            WEIGHTS.get(w)
            n += 1
    return n


def _is_linear(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear)  # the model's Linear is an nn.Linear (no import of the model room)


# ----------------------------------------------------------------------------------------------------- ops
def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    from h3kernels.fp8_quant import quantize_rows

    qw, sw = WEIGHTS.get(weight)
    fused = context.current().fast_fused
    hit = ROWS.lookup(x) if fused else None
    if hit is None:
        hit = quantize_rows(x.reshape(-1, x.shape[-1]))
        if fused:
            ROWS.store(x, *hit)
    qx, sx = hit
    y = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=False)
    if bias is not None:
        y += bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _norm_modulate(x, weight, eps, scale, shift, index):
    from h3kernels.fp8_fused import norm_modulate_quant

    y, q, s = norm_modulate_quant(x, weight, eps, scale, shift, index)
    ROWS.store(y, q, s)
    return y


def _swiglu(h):
    from h3kernels.fp8_fused import swiglu_quant

    y, q, s = swiglu_quant(h)
    ROWS.store(y, q, s)
    return y


def _fusable_rows(x: torch.Tensor, cols: int) -> bool:
    from h3kernels.fp8_fused import MAX_COLS

    return x.dtype == torch.bfloat16 and x.stride(-1) == 1 and 1 <= cols <= MAX_COLS


def _attention(q, k, v, key_order=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if key_order is not None:
        k, v = k.index_select(1, key_order), v.index_select(1, key_order)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
                     set_priority=True):
        out = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
    return out.permute(0, 2, 1, 3)


def _heads4(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype == torch.bfloat16 and x.stride(-1) == 1


def _head_rms_norm(x, weight, eps):
    from h3kernels.fast_qk import head_rms_norm

    return head_rms_norm(x, weight, eps)


def _rope(x, cos, sin):
    from h3kernels.fast_qk import rope

    return rope(x, cos, sin)


def _attention_fp8(q, k, v, key_order=None):
    from h3kernels.fp8_attention import attention_fp8

    return attention_fp8(q, k, v, key_order)


def _fp8_attention_wanted(args: tuple) -> bool:
    from h3kernels.fp8_attention import HEAD_DIMS

    choice = context.current().fp8_attention
    q = args[0] if args else None
    if choice == "off" or not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype != torch.bfloat16:
        return False
    if choice == "on":
        return q.shape[-1] in HEAD_DIMS
    return q.shape[-1] == 128 and q.shape[1] >= FP8_ATTENTION_MIN_ROWS


def _tensors(args: tuple, kwargs: dict):
    for a in args + tuple(kwargs.values()):
        for t in a if isinstance(a, (tuple, list)) else (a,):
            if isinstance(t, torch.Tensor):
                yield t


_CAPABLE: dict[int, bool] = {}


def _check(name: str, point: str, args: tuple, kwargs: dict) -> None:
    where = f"op {name!r} at {point or '<no point>'}"
    tensors = list(_tensors(args, kwargs))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise _error(f"mode 'fast' is inference-only (FP8 products have no backward): {where} was called with "
                     "autograd recording; use strict or off for training")
    if context.current().fast_emulated:
        return
    for t in tensors:
        if t.device.type != "cuda" and WEIGHTS.lookup(t) is None:  # a dropped bf16 weight runs as its FP8 copy
            raise _error(f"mode 'fast' needs a CUDA GPU with FP8 matmuls: {where} has a tensor on {t.device} "
                         "(no fast mode on the CPU; use off, auto or strict)")
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        ok = _CAPABLE.get(index)
        if ok is None:
            ok = _CAPABLE[index] = torch.cuda.get_device_capability(index) >= MIN_CAPABILITY
        if not ok:
            cap = torch.cuda.get_device_capability(index)
            raise _error(f"mode 'fast' needs FP8 matmuls (compute capability >= 8.9): {where} runs on a GPU of "
                         f"capability {cap[0]}.{cap[1]}")


def serve(name: str, point: str, args: tuple, kwargs: dict) -> tuple[dict, Callable[..., Any]]:
    """(trace info, the callable that computes op `name` in fast mode); raises FastModeError (one line) for a call
    fast mode refuses."""
    REFERENCE_OPS, ctx = _BOUND["ops"], context.current()
    _check(name, point, args, kwargs)
    if name in ("linear", "linear_tree"):
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        if weight.dtype == torch.float32:
            return _FP32_INFO, REFERENCE_OPS[name]
        x = args[0] if args else kwargs["x"]
        if _fp8_eligible(weight) and x.dtype == torch.bfloat16:
            return (_EMULATED_INFO, linear_reference) if ctx.fast_emulated else (_LINEAR_INFO, _fp8_linear)
        return _BF16_INFO, REFERENCE_OPS[name]
    if name == "attention":
        if ctx.fast_emulated:
            return _TORCH_INFO, REFERENCE_OPS[name]
        return (_FP8_ATTN_INFO, _attention_fp8) if _fp8_attention_wanted(args) else (_ATTN_INFO, _attention)
    if not ctx.fast_emulated and ctx.fast_fused:
        x = args[0] if args else None
        if name in ("rms_norm", "rope") and _heads4(x):
            return (_HEAD_NORM_INFO, _head_rms_norm) if name == "rms_norm" else (_ROPE_INFO, _rope)
        if name == "norm_modulate" and isinstance(x, torch.Tensor) and x.dim() == 3 and _fusable_rows(x, x.shape[-1]) \
                and all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in args[3:5]):
            return _NORM_MOD_INFO, _norm_modulate
        if name == "swiglu" and isinstance(x, torch.Tensor) and x.shape[-1] % 2 == 0 \
                and _fusable_rows(x, x.shape[-1] // 2):
            return _SWIGLU_INFO, _swiglu
    return _TORCH_INFO, REFERENCE_OPS[name]
