"""Strict AdaLN row-gathered ops: `modulate(x, scale, shift, index)` and `gated_residual(residual, gate, index, y)`.

Each packed row s of x (B, S, D) reads table row `index[s]` of the (R, D) tables (`timestep_index * 3 + token_tag`
in the blocks, `timestep_index` in norm_out). R is small (3 x the number of distinct timesteps).

Contract
--------
math        modulate:       out = round(round(x * round(1 + scale[i])) + shift[i])
            gated_residual: out = round(residual + round(gate[i] * y))
            `round` rounds to the activation dtype (nearest, ties to even); every step is computed in float32 from
            the exact upcast operands. That is torch's own evaluation of the same expression on bfloat16 / float16
            tensors (one rounding per torch op), so the forward is **bit-equal** to the reference op in every served
            dtype (in float32, `round` is the identity and no FMA contraction happens: `enable_fp_fusion=False`).
accumulator float32 for the table gradients.
forward     elementwise over (ROWS packed rows, BLOCK_D columns) tiles; no reduction, so row, batch and launch
            invariance are structural.
backward    dx (modulate)  = round(dy * round(1 + scale[i]));   dy_branch (gated) = round(dy * gate[i]);
            d residual     = dy (the same tensor).
            d scale[r] = sum dy * x, d shift[r] = sum dy, d gate[r] = sum dy * y, over the rows (b, s) with
            index[s] == r, float32, cast once to the table dtype. Fixed order, no atomics: the rows of table row r
            are listed batch-major, then by ascending packed position (a stable sort of `index`); the list is cut
            into chunks of CHUNK consecutive entries; stage 1 loads a chunk as one (CHUNK, BLOCK_D) tile and reduces
            it with one `tl.sum(axis=0)` (a tree fixed by CHUNK, BLOCK_D and num_warps) into a float32 partial;
            stage 2 adds a table row's partials in chunk order (GROUP partials per `tl.sum` tree step, the steps
            sequential). The order depends on the index values and B only, never on launch geometry.
tiles       forward: BLOCK_D = min(next_pow2(D), 1024), ROWS = clamp(2048 // BLOCK_D, 1, 64); table reduction:
            BLOCK_D = min(next_pow2(D), 128), CHUNK = 32, GROUP = 16; num_warps = 4 everywhere.
index       int64, shape (S,), 0 <= index < R, checked on the host (one device sync per new index tensor: the check
            and the stable sort are cached per tensor object while its `_version` is unchanged, so an in-place write
            forces a re-check; see `_index_cache.py`). The kernels also clamp the table row, so no read can leave the table.
refused     dtypes other than float32 / bfloat16 / float16 or mixed among the tensors; x / residual / y not (B, S, D)
            contiguous; tables not (R, D) with unit column stride (row-strided views, e.g. `chunk` of the AdaLN
            projection, are served); index not int64 (S,) or out of range; empty tensors; mixed devices; CPU without
            TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import registry
from h3kernels._launch import lean
from h3kernels._offsets import tile_offsets
from h3kernels._index_cache import IndexCache, lazy
from h3kernels._strict_math import round_to

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_FWD = 1024
BLOCK_TABLE = 128
CHUNK = 32
GROUP = 16


# ---------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _gather_tile(index_ptr, rows, row_ok, S, R, cols, D: tl.constexpr):
    """Offsets of a (ROWS, BLOCK_D) tile of packed rows and of the table rows they read, and the tile mask."""
    # table row of packed row s = rows % S; validated on the host, clamped so no read can leave the table
    t = tl.load(index_ptr + rows % S, mask=row_ok, other=0)
    t = tl.minimum(tl.maximum(t, 0), R - 1)
    mask = row_ok[:, None] & (cols < D)[None, :]
    offs = tile_offsets(rows, D, cols, 1)
    return offs, t.to(tl.int64)[:, None], mask


@triton.jit
def _modulate_tile(x, scale_ptr, shift_ptr, t, scale_stride, shift_stride, cols, mask, DT: tl.constexpr):
    """round(round(x * round(1 + scale[t])) + shift[t]) of a float32 tile x whose rows read table rows t (from
    `_gather_tile`): the contract's rounding sequence, shared with the fused `norm_modulate`."""
    sc = tl.load(scale_ptr + t * scale_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(shift_ptr + t * shift_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = round_to(x * round_to(1.0 + sc, DT), DT)  # x * (1 + scale[i])
    return round_to(y + sh, DT)  # ... + shift[i]


@lean
@triton.jit
def _modulate_fwd_kernel(
    x_ptr, scale_ptr, shift_ptr, index_ptr, out_ptr, n_rows, S, R, scale_stride, shift_stride,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat b * S + s
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs, t, mask = _gather_tile(index_ptr, rows, rows < n_rows, S, R, cols, D)
    DT = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = _modulate_tile(x, scale_ptr, shift_ptr, t, scale_stride, shift_stride, cols, mask, DT)
    tl.store(out_ptr + offs, y.to(DT), mask=mask)


@lean
@triton.jit
def _gated_residual_fwd_kernel(
    res_ptr, gate_ptr, index_ptr, y_ptr, out_ptr, n_rows, S, R, gate_stride,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs, t, mask = _gather_tile(index_ptr, rows, rows < n_rows, S, R, cols, D)
    DT = out_ptr.dtype.element_ty
    res = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + t * gate_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = round_to(res + round_to(g * y, DT), DT)  # residual + gate[i] * y
    tl.store(out_ptr + offs, out.to(DT), mask=mask)


@lean
@triton.jit
def _row_scale_kernel(
    dy_ptr, table_ptr, index_ptr, out_ptr, n_rows, S, R, table_stride,
    D: tl.constexpr, ADD_ONE: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out = round(dy * f(table[index[s]])), f = round(1 + .) for modulate's dx, identity for gated_residual's dy."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs, t, mask = _gather_tile(index_ptr, rows, rows < n_rows, S, R, cols, D)
    DT = out_ptr.dtype.element_ty
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    f = tl.load(table_ptr + t * table_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD_ONE:
        f = round_to(1.0 + f, DT)
    tl.store(out_ptr + offs, round_to(dy * f, DT).to(DT), mask=mask)


@lean
@triton.jit
def _table_partial_kernel(
    dy_ptr, x_ptr, order_ptr, offsets_ptr, part_x_ptr, part_1_ptr, S, B, max_chunks,
    D: tl.constexpr, WITH_X: tl.constexpr, WITH_ONE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Chunk c of table row r: part_x = sum of dy * x, part_1 = sum of dy over the chunk's CHUNK list entries,
    loaded as one (CHUNK, BLOCK_D) tile and reduced by one `tl.sum(axis=0)`. Entry k of row r's list is
    (b, s) = (k // n_r, order[start + k % n_r]): batch-major, then ascending packed position."""
    c = tl.program_id(0)
    r = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    start = tl.load(offsets_ptr + r)
    n_r = tl.load(offsets_ptr + r + 1) - start
    total = n_r * B
    n_div = tl.maximum(n_r, 1)
    k = c * CHUNK + tl.arange(0, CHUNK)  # (CHUNK,) list entries of this chunk
    live = k < total
    b = k // n_div
    s = tl.load(order_ptr + start + (k - b * n_div), mask=live, other=0)
    offs = tile_offsets(tl.cast(b, tl.int64) * S + s, D, cols, 1)
    mask = live[:, None] & (cols < D)[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = (r.to(tl.int64) * max_chunks + c) * D + cols
    # a vector mask from the scalar condition by comparison, never `vector & scalar` (Triton 3.9's interpreter
    # mis-types that broadcast)
    store_ok = cols < D * (c * CHUNK < total).to(tl.int32)
    if WITH_X:
        xv = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(part_x_ptr + out, tl.sum(dy * xv, axis=0), mask=store_ok)
    if WITH_ONE:
        tl.store(part_1_ptr + out, tl.sum(dy, axis=0), mask=store_ok)


@lean
@triton.jit
def _table_reduce_kernel(
    part_ptr, offsets_ptr, out_ptr, B, max_chunks,
    D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
):
    """out[r] = sum of table row r's chunk partials, GROUP per tree step, steps in chunk order; one cast."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    n_chunks = tl.cdiv((tl.load(offsets_ptr + r + 1) - tl.load(offsets_ptr + r)) * B, CHUNK)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # a while loop, not `range(n_chunks)`: a runtime trip count breaks `range` in Triton 3.6's interpreter
    c0 = n_chunks * 0
    while c0 < n_chunks:
        ch = c0 + tl.arange(0, GROUP)
        mask = (ch < n_chunks)[:, None] & ok[None, :]
        offs = (r.to(tl.int64) * max_chunks + ch)[:, None] * D + cols[None, :]
        acc += tl.sum(tl.load(part_ptr + offs, mask=mask, other=0.0), axis=0)
        c0 += GROUP
    DT = out_ptr.dtype.element_ty
    tl.store(out_ptr + r.to(tl.int64) * D + cols, round_to(acc, DT).to(DT), mask=ok)


# ------------------------------------------------------------------------------------------- index handling
_CACHE = IndexCache()


def _check_index(op: str, index, seq_len: int, n_table: int) -> dict:
    """Validate `index` (int64 (S,), values in [0, R)); returns its cache entry."""
    if not isinstance(index, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: index must be a tensor, got {type(index).__name__}")
    if index.dtype != torch.int64:
        raise registry.StrictUnsupported(f"{op}: index dtype {index.dtype} must be int64")
    if tuple(index.shape) != (seq_len,):
        raise registry.StrictUnsupported(f"{op}: index shape {list(index.shape)} must be ({seq_len},), one per row")
    if not index.is_contiguous():
        raise registry.StrictUnsupported(f"{op}: index strides {index.stride()} are not contiguous")

    def build() -> dict:
        lo, hi = torch.stack([index.min(), index.max()]).tolist()  # one device sync per new index tensor
        if lo < 0 or hi >= n_table:
            bad = lo if lo < 0 else hi
            raise registry.StrictUnsupported(
                f"{op}: index value {bad} out of range for a table of {n_table} rows (0 <= index < {n_table})"
            )
        return {}

    return _CACHE.get((index,), (n_table,), build)


def _plan(index: torch.Tensor, n_table: int, entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, offsets): packed positions grouped by table row (stable: ascending s), and row r's segment
    [offsets[r], offsets[r+1]) of `order`. Integer metadata only, deterministic."""
    def make():
        sorted_index, order = torch.sort(index, stable=True)
        rows = torch.arange(n_table + 1, device=index.device, dtype=torch.int64)
        return order.contiguous(), torch.searchsorted(sorted_index, rows).to(torch.int64).contiguous()

    return lazy(entry, "plan", make)


def _check_rows(op: str, name: str, t, dtype=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise registry.StrictUnsupported(f"{op}: {name} dtype {t.dtype} not served (float32, bfloat16, float16)")
    if dtype is not None and t.dtype != dtype:
        raise registry.StrictUnsupported(f"{op}: {name} dtype {t.dtype} differs from the activation dtype {dtype}")
    if t.dim() != 3 or t.numel() == 0:
        raise registry.StrictUnsupported(f"{op}: {name} shape {list(t.shape)} must be a non-empty (B, S, D)")
    if not t.is_contiguous():
        raise registry.StrictUnsupported(f"{op}: {name} of shape {list(t.shape)} strides {t.stride()} is not contiguous")


def _check_table(op: str, name: str, t, dtype, d: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise registry.StrictUnsupported(f"{op}: {name} dtype {t.dtype} differs from the activation dtype {dtype}")
    if t.dim() != 2 or t.shape[1] != d or t.shape[0] == 0:
        raise registry.StrictUnsupported(f"{op}: {name} shape {list(t.shape)} must be a non-empty (R, {d}) table")
    if t.stride(1) != 1:
        raise registry.StrictUnsupported(f"{op}: {name} column stride {t.stride(1)} must be 1")


def _validate_modulate(x, scale, shift, index, op: str = "modulate") -> dict:
    """The index cache entry, or StrictUnsupported; `op` names the caller in messages (the fused norm_modulate)."""
    tensors = [t for t in (x, scale, shift, index) if isinstance(t, torch.Tensor)]
    registry.check_device(*tensors, op=op)
    _check_rows(op, "x", x)
    _check_table(op, "scale", scale, x.dtype, x.shape[2])
    _check_table(op, "shift", shift, x.dtype, x.shape[2])
    if scale.shape[0] != shift.shape[0]:
        raise registry.StrictUnsupported(f"{op}: scale has {scale.shape[0]} rows but shift has {shift.shape[0]}")
    return _check_index(op, index, x.shape[1], scale.shape[0])


def _validate_gated(residual, gate, index, y) -> dict:
    op = "gated_residual"
    tensors = [t for t in (residual, gate, index, y) if isinstance(t, torch.Tensor)]
    registry.check_device(*tensors, op=op)
    _check_rows(op, "residual", residual)
    _check_rows(op, "y", y, residual.dtype)
    if y.shape != residual.shape:
        raise registry.StrictUnsupported(f"{op}: y shape {list(y.shape)} differs from residual {list(residual.shape)}")
    _check_table(op, "gate", gate, residual.dtype, residual.shape[2])
    return _check_index(op, index, residual.shape[1], gate.shape[0])


def _info(name: str) -> dict:
    return {
        "kernel_id": f"h3kernels.modulate.{name}.v1",
        "tile": f"ROWS*BLOCK_D=2048,BLOCK_D<={BLOCK_FWD},bwd:BLOCK_D<={BLOCK_TABLE},CHUNK={CHUNK},GROUP={GROUP}",
        "acc_dtype": "float32",
    }


def check_modulate(x, scale, shift, index) -> dict:
    _validate_modulate(x, scale, shift, index)
    return _info("modulate")


def check_gated_residual(residual, gate, index, y) -> dict:
    _validate_gated(residual, gate, index, y)
    return _info("gated_residual")


# ------------------------------------------------------------------------------------------------- launchers
def _block(d: int, cap: int) -> int:
    return min(cap, triton.next_power_of_2(d))


def _fwd_tile(x: torch.Tensor) -> dict:
    """Launch of the elementwise kernels: (ROWS, BLOCK_D) tiles; ROWS * BLOCK_D ~ 2048 elements."""
    d = x.shape[2]
    block_d = _block(d, BLOCK_FWD)
    rows = max(1, min(64, 2048 // block_d))
    n_rows = x.shape[0] * x.shape[1]
    return {"grid": (triton.cdiv(n_rows, rows), triton.cdiv(d, block_d)), "n_rows": n_rows, "ROWS": rows, "BLOCK_D": block_d}


def _row_scale(dy: torch.Tensor, table: torch.Tensor, index: torch.Tensor, add_one: bool) -> torch.Tensor:
    dy = dy.contiguous()
    out = torch.empty_like(dy)
    t = _fwd_tile(dy)
    _row_scale_kernel[t["grid"]](
        dy, table, index, out, t["n_rows"], dy.shape[1], table.shape[0], table.stride(0),
        D=dy.shape[2], ADD_ONE=add_one, ROWS=t["ROWS"], BLOCK_D=t["BLOCK_D"], enable_fp_fusion=False,
    )
    return out


def _table_grads(dy, x, index, entry, n_table: int, dtype, with_x: bool, with_one: bool):
    """Fixed-order per-table-row sums of dy * x (if with_x) and dy (if with_one), cast to dtype."""
    order, offsets = _plan(index, n_table, entry)
    b, s, d = dy.shape
    max_chunks = triton.cdiv(b * s, CHUNK)
    shape = (n_table, max_chunks, d)
    dev = dy.device
    part_x = torch.empty(shape if with_x else (1,), dtype=torch.float32, device=dev)
    part_1 = torch.empty(shape if with_one else (1,), dtype=torch.float32, device=dev)
    block = _block(d, BLOCK_TABLE)
    _table_partial_kernel[(max_chunks, n_table, triton.cdiv(d, block))](
        dy, x if with_x else dy, order, offsets, part_x, part_1, s, b, max_chunks,
        D=d, WITH_X=with_x, WITH_ONE=with_one, CHUNK=CHUNK, BLOCK_D=block, enable_fp_fusion=False,
    )
    outs = []
    for flag, part in ((with_x, part_x), (with_one, part_1)):
        if not flag:
            outs.append(None)
            continue
        out = torch.empty((n_table, d), dtype=dtype, device=dev)
        _table_reduce_kernel[(n_table, triton.cdiv(d, block))](
            part, offsets, out, b, max_chunks, D=d, CHUNK=CHUNK, BLOCK_D=block, GROUP=GROUP, enable_fp_fusion=False,
        )
        outs.append(out)
    return outs


class _Modulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, shift, index, entry):
        out = torch.empty_like(x)
        t = _fwd_tile(x)
        _modulate_fwd_kernel[t["grid"]](
            x, scale, shift, index, out, t["n_rows"], x.shape[1], scale.shape[0], scale.stride(0), shift.stride(0),
            D=x.shape[2], ROWS=t["ROWS"], BLOCK_D=t["BLOCK_D"], enable_fp_fusion=False,
        )
        ctx.save_for_backward(x, scale, index)
        ctx.entry = entry
        return out

    @staticmethod
    def backward(ctx, dy):
        x, scale, index = ctx.saved_tensors
        need_x, need_scale, need_shift = ctx.needs_input_grad[:3]
        dx = _row_scale(dy, scale, index, add_one=True) if need_x else None
        dscale = dshift = None
        if need_scale or need_shift:
            dscale, dshift = _table_grads(
                dy.contiguous(), x, index, ctx.entry, scale.shape[0], scale.dtype, need_scale, need_shift
            )
        return dx, dscale, dshift, None, None


class _GatedResidual(torch.autograd.Function):
    @staticmethod
    def forward(ctx, residual, gate, index, y, entry):
        out = torch.empty_like(residual)
        t = _fwd_tile(residual)
        _gated_residual_fwd_kernel[t["grid"]](
            residual, gate, index, y, out, t["n_rows"], residual.shape[1], gate.shape[0], gate.stride(0),
            D=residual.shape[2], ROWS=t["ROWS"], BLOCK_D=t["BLOCK_D"], enable_fp_fusion=False,
        )
        ctx.save_for_backward(gate, index, y)
        ctx.entry = entry
        return out

    @staticmethod
    def backward(ctx, dout):
        gate, index, y = ctx.saved_tensors
        need_res, need_gate, _, need_y = ctx.needs_input_grad[:4]
        dy_branch = _row_scale(dout, gate, index, add_one=False) if need_y else None
        dgate = None
        if need_gate:
            dgate, _ = _table_grads(dout.contiguous(), y, index, ctx.entry, gate.shape[0], gate.dtype, True, False)
        return (dout if need_res else None), dgate, None, dy_branch, None


def modulate(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Strict `x * (1 + scale[index]) + shift[index]` (see the module contract)."""
    entry = _validate_modulate(x, scale, shift, index)
    return _Modulate.apply(x, scale, shift, index, entry)


def gated_residual(residual: torch.Tensor, gate: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Strict `residual + gate[index] * y` (see the module contract)."""
    entry = _validate_gated(residual, gate, index, y)
    return _GatedResidual.apply(residual, gate, index, y, entry)


# ------------------------------------------------------------------------------------------------ references
def reference_modulate(x, scale, shift, index):
    """float32 reference (float64 in -> float64): the same math with no intermediate rounding."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(acc) * (1.0 + scale.to(acc).index_select(0, index)) + shift.to(acc).index_select(0, index)


def reference_gated_residual(residual, gate, index, y):
    acc = torch.float64 if residual.dtype == torch.float64 else torch.float32
    return residual.to(acc) + gate.to(acc).index_select(0, index) * y.to(acc)


def _modulate_checked(x, scale, shift, index) -> torch.Tensor:
    """`modulate` on a call `check_modulate` accepted: only the index entry is looked up again (strict dispatch)."""
    return _Modulate.apply(x, scale, shift, index, _check_index("modulate", index, x.shape[1], scale.shape[0]))


def _gated_residual_checked(residual, gate, index, y) -> torch.Tensor:
    entry = _check_index("gated_residual", index, residual.shape[1], gate.shape[0])
    return _GatedResidual.apply(residual, gate, index, y, entry)


registry.register("modulate", run=modulate, check=check_modulate, run_checked=_modulate_checked)
registry.register("gated_residual", run=gated_residual, check=check_gated_residual,
                  run_checked=_gated_residual_checked)
