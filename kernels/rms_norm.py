"""Strict RMSNorm over the last axis: `rms_norm(x, weight, eps)`, forward and backward.

Serves the block / refiner / final norms on (B, S, hidden) and the per-head Q/K norms on (B, S, H, D): every
leading axis is flattened into rows, each row is normalised on its own.

Contract
--------
math        y = ((x * rstd) * w) cast to x.dtype, rstd = 1 / sqrt(sum(x*x) / D + eps), D = x.shape[-1].
            Every step is float32 (x and w are upcast on load); the only cast is the final store. These are the
            cast points of torch's CPU `F.rms_norm` (measured with torch 2.13: upcast, normalise, multiply by the
            upcast weight, cast once; casting before the weight multiply does *not* reproduce it).
accumulator float32.
reduction   sum(x*x) along the row: the whole row sits in one (ROWS, BLOCK_D) register tile, BLOCK_D =
            next_power_of_2(D) >= D, reduced by one `tl.sum(axis=1)`; the tree is fixed by (ROWS, BLOCK_D,
            num_warps), which depend on D only, never on the row count, batch size or row position.
IEEE ops    the mean is a correctly rounded division `sum / D` (torch's CPU mean divides too) and
            rstd = div_rn(1, sqrt_rn(.)): no approximate rsqrt / sqrt / division, no FMA contraction
            (`enable_fp_fusion=False`). Bytes can still differ from torch's, whose CPU `rsqrt` and summation order
            are ISA-specific (and whose CUDA path is a fused kernel with its own order): float32 outputs agree to
            ~1 ulp; bfloat16 outputs were bit-equal to torch CPU on every test set and differ from torch CUDA on
            ~3e-5 of the elements (H200); the error against the float64 truth equals torch's.
backward    g = dy * w; c = sum(g * xhat) / D (same fixed row tile); dx = (g - xhat * c) * rstd, float32, one
            cast. dw = sum over rows of dy * xhat: rows are cut into fixed chunks of CHUNK consecutive rows
            (row order of the flattened input); a chunk sums its ROWS-row tiles in order (a `tl.sum(axis=0)` tree
            inside a tile, sequential across tiles) into a float32 partial; a second kernel adds the partials of
            every chunk in chunk order (GROUP chunks per `tl.sum` step, groups sequential) and casts to w.dtype
            once. No atomics. rstd is saved by the forward (bit-identical to recomputing it).
tiles       BLOCK_D = next_pow2(D); ROWS = clamp(8192 // BLOCK_D, 1, 64); CHUNK = TILES * ROWS rows with
            TILES = 8 if ROWS == 1 else 16; num_warps = 4 / 8 / 16 for BLOCK_D <= 256 / <= 8192 / larger; second
            stage: 64 columns x GROUP = 64 partials per step. (H200 sweep at the H3 shapes: hidden 5376 -> (1, 8192),
            8 warps, CHUNK 8; head 128 -> (64, 128), 4 warps, CHUNK 1024.)
refused     dtypes other than float32 / bfloat16 / float16; weight of another dtype or shape (D,); eps not a
            positive number (eps=None included: strict needs the declared epsilon); non-contiguous x or weight;
            empty tensors; D > 16384; mixed devices; CPU without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import registry
from h3kernels._launch import lean
from h3kernels._offsets import tile_offsets
from h3kernels._strict_math import round_to

KERNEL_ID = "h3kernels.rms_norm.rms_norm.v1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_D = 16384
GROUP = 64  # partials added per `tl.sum` step of the second weight-gradient stage
BLOCK_SUM = 64  # columns per program of the second stage


# ---------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _normalize_rows(x, w_ptr, cols, eps, D: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """(y, rstd) of a float32 (ROWS, BLOCK_D) tile of whole rows, zero past D: y = (x * rstd) * w, float32, not yet
    rounded. The forward math of the contract, shared with the fused `norm_modulate` so both compute the same bytes
    (one `tl.sum` tree per row, fixed by the tile shape and num_warps)."""
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), D * 1.0)  # (ROWS,)
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = y * w[None, :]
    return y, rstd


@lean
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, eps,
    D: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_D)  # (BLOCK_D,) the whole row
    row_ok = rows < n_rows
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    offs = tile_offsets(rows, D, cols, 1)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
    y, rstd = _normalize_rows(x, w_ptr, cols, eps, D, HAS_WEIGHT)
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs, round_to(y, out_ty).to(out_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@lean
@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows,
    D: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr,
):
    chunk = tl.program_id(0)  # rows [chunk * TILES * ROWS, (chunk + 1) * TILES * ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for t in range(TILES):  # constexpr trip count: tiles of the chunk in row order
        # A tile wholly past the last row is skipped: it would store nothing and add only +0.0 to dw, which is
        # never -0.0 (it starts at +0.0, and x + y rounds to -0.0 only when both are -0.0), so the bytes are the
        # same; a short input (the tiny model's 22 rows in a 1,024-row chunk) does not run 15 empty tiles.
        start = (chunk * TILES + t) * ROWS
        if start < n_rows:
            rows = start + tl.arange(0, ROWS)
            row_ok = rows < n_rows
            mask = row_ok[:, None] & col_ok[None, :]
            offs = tile_offsets(rows, D, cols, 1)
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            xhat = x * rstd[:, None]
            if HAS_WEIGHT:
                g = dy * w[None, :]
            else:
                g = dy
            c = tl.math.div_rn(tl.sum(g * xhat, axis=1), D * 1.0)  # (ROWS,)
            dx = (g - xhat * c[:, None]) * rstd[:, None]
            dx_ty = dx_ptr.dtype.element_ty
            tl.store(dx_ptr + offs, round_to(dx, dx_ty).to(dx_ty), mask=mask)
            if HAS_WEIGHT:
                dw += tl.sum(dy * xhat, axis=0)  # masked rows contribute exact zeros
    if HAS_WEIGHT:
        tl.store(dw_part_ptr + chunk.to(tl.int64) * D + cols, dw, mask=col_ok)


@lean
@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, n_chunks, D: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """out[cols] = sum over chunks of part[chunk, cols], GROUP chunks per tree step, groups in chunk order."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_ok = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # a while loop, not `range(n_chunks)`: a runtime trip count breaks `range` in Triton 3.6's interpreter
    c0 = tl.program_id(0) * 0
    while c0 < n_chunks:
        chunks = c0 + tl.arange(0, GROUP)
        mask = (chunks < n_chunks)[:, None] & col_ok[None, :]
        part = tl.load(part_ptr + tile_offsets(chunks, D, cols, 1), mask=mask, other=0.0)
        acc += tl.sum(part, axis=0)
        c0 += GROUP
    out_ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + cols, round_to(acc, out_ty).to(out_ty), mask=col_ok)


# ------------------------------------------------------------------------------------------------- launcher
def _tile(d: int) -> dict:
    """The fixed launch configuration for rows of width d (a function of d only; chosen by an H200 sweep at the H3
    shapes: `benchmarks/benchmark_elementwise.py --sweep`)."""
    block_d = triton.next_power_of_2(d)
    rows = max(1, min(64, 8192 // block_d))  # (ROWS, BLOCK_D) register tile of ~8192 elements
    warps = 4 if block_d <= 256 else (8 if block_d <= 8192 else 16)
    tiles = 8 if rows == 1 else 16  # tiles per weight-gradient chunk
    return {"BLOCK_D": block_d, "ROWS": rows, "TILES": tiles, "CHUNK": tiles * rows, "num_warps": warps}


def _tile_str(t: dict) -> str:
    return (
        f"BLOCK_D={t['BLOCK_D']},ROWS={t['ROWS']},CHUNK={t['CHUNK']},GROUP={GROUP}x{BLOCK_SUM},warps={t['num_warps']}"
    )


def _validate(x, weight, eps, op: str = "rms_norm") -> dict:
    """The tile for this call, or StrictUnsupported; `op` names the caller in messages (the fused norm_modulate)."""
    if not isinstance(x, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: x must be a tensor, got {type(x).__name__}")
    registry.check_device(x, weight, op=op)
    if x.dtype not in DTYPES:
        raise registry.StrictUnsupported(f"{op}: x dtype {x.dtype} not served (float32, bfloat16, float16)")
    if x.dim() < 1 or x.numel() == 0:
        raise registry.StrictUnsupported(f"{op}: x shape {list(x.shape)} is empty")
    d = x.shape[-1]
    if d > MAX_D:
        raise registry.StrictUnsupported(f"{op}: row width {d} exceeds the single-tile limit {MAX_D}")
    if not x.is_contiguous():
        raise registry.StrictUnsupported(f"{op}: x of shape {list(x.shape)} strides {x.stride()} is not contiguous")
    if weight is not None:
        if not isinstance(weight, torch.Tensor):
            raise registry.StrictUnsupported(f"{op}: weight must be a tensor or None, got {type(weight).__name__}")
        if weight.dtype != x.dtype:
            raise registry.StrictUnsupported(f"{op}: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
        if tuple(weight.shape) != (d,):
            raise registry.StrictUnsupported(f"{op}: weight shape {list(weight.shape)} must be ({d},)")
        if not weight.is_contiguous():
            raise registry.StrictUnsupported(f"{op}: weight strides {weight.stride()} are not contiguous")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise registry.StrictUnsupported(f"{op}: eps={eps!r} must be a positive number")
    return _tile(d)


def check(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> dict:
    tile = _validate(x, weight, eps)
    return {"kernel_id": KERNEL_ID, "tile": _tile_str(tile), "acc_dtype": "float32"}


def _forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, tile: dict):
    d = x.shape[-1]
    n_rows = x.numel() // d
    y = torch.empty_like(x)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n_rows, tile["ROWS"]),)
    _rms_norm_fwd_kernel[grid](
        x, weight if weight is not None else x, y, rstd, n_rows, float(eps),
        D=d, HAS_WEIGHT=weight is not None, ROWS=tile["ROWS"], BLOCK_D=tile["BLOCK_D"],
        num_warps=tile["num_warps"], enable_fp_fusion=False,
    )
    return y, rstd


def _backward(x, weight, rstd, dy, tile: dict):
    d = x.shape[-1]
    n_rows = x.numel() // d
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    n_chunks = triton.cdiv(n_rows, tile["CHUNK"])
    has_w = weight is not None
    part = torch.empty((n_chunks, d) if has_w else (1,), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(n_chunks,)](
        x, weight if has_w else x, dy, rstd, dx, part, n_rows,
        D=d, HAS_WEIGHT=has_w, ROWS=tile["ROWS"], BLOCK_D=tile["BLOCK_D"], TILES=tile["TILES"],
        num_warps=tile["num_warps"], enable_fp_fusion=False,
    )
    dw = None
    if has_w:
        dw = torch.empty_like(weight)
        block = min(BLOCK_SUM, tile["BLOCK_D"])
        _sum_partials_kernel[(triton.cdiv(d, block),)](
            part, dw, n_chunks, D=d, BLOCK=block, GROUP=GROUP, num_warps=4, enable_fp_fusion=False
        )
    return dx, dw


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, tile):
        y, rstd = _forward(x, weight, eps, tile)
        ctx.save_for_backward(x, weight, rstd)
        ctx.tile = tile
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(x, weight, rstd, dy, ctx.tile)
        return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Strict `F.rms_norm(x, (x.shape[-1],), weight, eps)` (see the module contract)."""
    tile = _validate(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps, tile)


# ------------------------------------------------------------------------------------------------ reference
def reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The float32 torch reference (float64 in, float64 out for a truth): the contract's math, differentiable."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    rstd = 1.0 / torch.sqrt((xf * xf).sum(-1, keepdim=True) / x.shape[-1] + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(acc)
    return y


registry.register("rms_norm", run=rms_norm, check=check)
