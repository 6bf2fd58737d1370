"""`--mode fast`: the released graph with FP8 e4m3 projections and the fastest attention. NOT strict.

Contract
--------
linear, linear_tree   a bfloat16 weight (N, K) with K and N multiples of 16 and bfloat16 rows x (..., K), on a CUDA
                      GPU with FP8 matmuls (compute capability >= 8.9):
                        weight  quantised once per weight tensor (first use; cached while it is the same live tensor
                                with the same `_version`, so an in-place update re-quantises) to float8_e4m3fn with one
                                float32 scale per output channel, scale_w[n] = max|w[n, :]| / 448 (`prepare(model)`
                                quantises every projection up front, at load);
                        rows    quantised per call, one scale per row (`h3kernels.fp8_quant.quantize_rows`);
                        y       torch._scaled_mm(q_x, q_w^T, scale_x (M, 1), scale_w (1, N), out_dtype bfloat16)
                                (CUTLASS row-wise scaling, float32 accumulation with promotion: use_fast_accum off),
                                then + bias in bfloat16.
                      float32 weights (the released float32 modules: time embedder, AdaLN input side, heads) run
                      F.linear in float32, exactly as `off`; a bfloat16 projection whose K or N is not a multiple of
                      16 runs F.linear in bfloat16 (trace kernel_id `fast.bf16.linear`).
attention             F.scaled_dot_product_attention with cuDNN first (then flash, memory-efficient): the `off` call
                      with the faster backend.
every other op        the reference torch op (`off`).
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
                      projections are `linear_reference` (kernel_id `fast.emulated.fp8_e4m3`), attention the plain
                      SDPA call. Never the product path: the session's CPU refusal stands outside that context.
Cost                  measured per pass against `off` (velocity and latent drift over a 20-pass trajectory) by
                      `benchmarks/benchmark_every_length.py` (H200: 7% per-pass velocity, 4.5% latent after 20
                      passes at 512x512x22f; forward_every_length.json); see README.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
AMAX_FLOOR = 1e-12
ALIGN = 16  # torch._scaled_mm needs K and N multiples of 16
MIN_CAPABILITY = (8, 9)

_LINEAR_INFO = {"kernel_id": "fast.fp8_e4m3.scaled_mm.rowwise", "tile": "cutlass rowwise, fast_accum off",
                "acc_dtype": "float32"}
_BF16_INFO = {"kernel_id": "fast.bf16.linear", "tile": "", "acc_dtype": "torch-default"}
_FP32_INFO = {"kernel_id": "fast.fp32.linear", "tile": "", "acc_dtype": "float32"}
_ATTN_INFO = {"kernel_id": "fast.sdpa.cudnn", "tile": "cudnn > flash > efficient", "acc_dtype": "float32"}
_TORCH_INFO = {"kernel_id": "fast.torch", "tile": "", "acc_dtype": "torch-default"}
_EMULATED_INFO = {"kernel_id": "fast.emulated.fp8_e4m3", "tile": "float32 emulation", "acc_dtype": "float32"}
_emulated: contextvars.ContextVar[bool] = contextvars.ContextVar("h3lab_fast_emulated", default=False)


@contextlib.contextmanager
def use_emulation() -> Iterator[None]:
    """Tests and CPU dry runs only: fast mode runs anywhere, its projections emulated by `linear_reference`."""
    token = _emulated.set(True)
    try:
        yield
    finally:
        _emulated.reset(token)


_BOUND: dict[str, Any] = {}  # set by `bind` from h3lab.runtime: this module never imports the runtime


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
    scale = torch.clamp(t.abs().amax(dim=1, keepdim=True), min=AMAX_FLOOR) / FP8_MAX
    q = torch.clamp(t / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fast projection emulated in float32 on any device: dequantised rows @ dequantised weight^T (+ bias),
    cast to x's dtype. What `_scaled_mm` computes, up to its accumulation order."""
    qx, sx = quantize_rows_reference(x)
    qw, sw = quantize_rows_reference(weight)
    y = (qx.float() * sx) @ (qw.float() * sw).t()
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _WeightCache:
    """weight tensor -> (q (N, K) float8_e4m3fn, scale (1, N) float32), valid while it is the same live tensor with
    the same `_version`."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Any, int, torch.Tensor, torch.Tensor]] = {}

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(w)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is w and entry[1] == w._version:
            return entry[2], entry[3]
        with torch.no_grad():
            q, scale = quantize_rows_reference(w.detach())
        q, scale = q.contiguous(), scale.reshape(1, -1).contiguous()
        self._entries[key] = (weakref.ref(w, lambda _r, k=key: self._entries.pop(k, None)), w._version, q, scale)
        return q, scale

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


WEIGHTS = _WeightCache()


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
    x2d = x.reshape(-1, x.shape[-1])
    qx, sx = quantize_rows(x2d)
    y = torch._scaled_mm(qx, qw.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=False)
    if bias is not None:
        y += bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _attention(q, k, v, key_order=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if key_order is not None:
        k, v = k.index_select(1, key_order), v.index_select(1, key_order)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
                     set_priority=True):
        out = F.scaled_dot_product_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3))
    return out.permute(0, 2, 1, 3)


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
    if _emulated.get():
        return
    for t in tensors:
        if t.device.type != "cuda":
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
    REFERENCE_OPS = _BOUND["ops"]
    _check(name, point, args, kwargs)
    if name in ("linear", "linear_tree"):
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        if weight.dtype == torch.float32:
            return _FP32_INFO, REFERENCE_OPS[name]
        x = args[0] if args else kwargs["x"]
        if _fp8_eligible(weight) and x.dtype == torch.bfloat16:
            return (_EMULATED_INFO, linear_reference) if _emulated.get() else (_LINEAR_INFO, _fp8_linear)
        return _BF16_INFO, REFERENCE_OPS[name]
    if name == "attention":
        return (_TORCH_INFO, REFERENCE_OPS[name]) if _emulated.get() else (_ATTN_INFO, _attention)
    return _TORCH_INFO, REFERENCE_OPS[name]
