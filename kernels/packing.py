"""Strict packed-row copies: `pack_rows(seq_len, (text_idx, text), (video_idx, video), (audio_idx, audio))` and
`select_rows(x, index)`.

pack_rows
---------
math        out (B, seq_len, D) in text's dtype; out[:, text_idx[n]] = text[:, n], out[:, video_idx[n]] =
            round(video[:, n]), out[:, audio_idx[n]] = round(audio[:, n]), `round` the cast to text's dtype (nearest,
            ties to even, exactly `.to(text.dtype)`). Bit-equal to the reference.
layout rule the three index sets must be int64, in [0, seq_len), each without duplicates, pairwise disjoint, and
            together cover every packed row exactly once (the released layout does). Coverage makes the reference's
            zero fill unobservable, so strict writes each packed row once, from its single source: a gather over
            packed rows through a (part, position) map built from the indices (integer metadata). Rows never
            accumulate, so no order question arises.
backward    d text = dout[:, text_idx]; d video = dout[:, video_idx] cast to video's dtype; likewise audio: one
            gather per part, atomic-free.
select_rows
-----------
math        x (B, S, C) -> (B, N, C), out[:, n] = x[:, index[n]] (bit-equal copy).
backward    dx = zeros with dx[:, index[n]] = dy[:, n]: written as a gather over the S rows of dx through the inverse
            map (row s reads dy row inv[s], or writes zeros where no n selects s). The indices must be unique, so no
            row ever accumulates; duplicates are refused.
common      (ROWS destination rows, BLOCK_D columns) tiles; BLOCK_D = min(next_pow2(D), 1024), ROWS =
            clamp(2048 // BLOCK_D, 1, 64). No arithmetic but the declared cast. Index checks run on the host: one
            device sync per new index tensor, the result and the derived maps cached while the index tensors are
            unchanged (`_index_cache.py`).
refused     row tensors not 3-D with a unit last stride (other strides are served), dtypes other than float32 /
            bfloat16 / float16, B / D mismatches across parts, index tensors not int64 1-D contiguous or of the
            wrong length, out of range, duplicated, overlapping or not covering; empty outputs; mixed devices; CPU
            without TRITON_INTERPRET=1.
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
BLOCK = 1024
PARTS = ("text", "video", "audio")
_CACHE = IndexCache()


# ---------------------------------------------------------------------------------------------------- kernels
@lean
@triton.jit
def _pack_kernel(
    t_ptr, v_ptr, a_ptr, part_ptr, pos_ptr, out_ptr, n_rows, seq_len,
    t_sb, t_sn, v_sb, v_sn, a_sb, a_sn,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat b * seq_len + s
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = (cols < D)[None, :]
    b = (rows // seq_len).to(tl.int64)
    s = rows - b * seq_len
    part = tl.load(part_ptr + s, mask=row_ok, other=-1)  # 0 text, 1 video, 2 audio: one live source per row
    n = tl.load(pos_ptr + s, mask=row_ok, other=0)  # row inside that part
    c = cols[None, :]
    xt = tl.load(t_ptr + (b * t_sb + n * t_sn)[:, None] + c, mask=(part == 0)[:, None] & col_ok, other=0.0)
    xv = tl.load(v_ptr + (b * v_sb + n * v_sn)[:, None] + c, mask=(part == 1)[:, None] & col_ok, other=0.0)
    xa = tl.load(a_ptr + (b * a_sb + n * a_sn)[:, None] + c, mask=(part == 2)[:, None] & col_ok, other=0.0)
    DT = out_ptr.dtype.element_ty
    sel = part[:, None]
    x = tl.where(sel == 0, xt.to(tl.float32), tl.where(sel == 1, xv.to(tl.float32), xa.to(tl.float32)))
    tl.store(out_ptr + tile_offsets(rows, D, cols, 1), round_to(x, DT).to(DT), mask=row_ok[:, None] & col_ok)


@lean
@triton.jit
def _gather_rows_kernel(
    src_ptr, index_ptr, dst_ptr, n_rows, n_dst, n_src, src_sb, src_sn,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dst[b, j] = src[b, index[j]] cast to dst's dtype, or zeros where index[j] < 0 (indices are validated on the
    host; one outside [0, n_src) is also masked, so no read can leave src). dst is contiguous."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # flat b * n_dst + j
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = (cols < D)[None, :]
    b = (rows // n_dst).to(tl.int64)
    i = tl.load(index_ptr + (rows - b * n_dst), mask=row_ok, other=-1)
    live = (i >= 0) & (i < n_src)
    src = src_ptr + (b * src_sb + tl.where(live, i, 0) * src_sn)[:, None] + cols[None, :]
    x = tl.load(src, mask=live[:, None] & col_ok, other=0.0)
    DT = dst_ptr.dtype.element_ty
    dst = dst_ptr + tile_offsets(rows, D, cols, 1)
    tl.store(dst, round_to(x.to(tl.float32), DT).to(DT), mask=row_ok[:, None] & col_ok)


def _block(d: int) -> int:
    return min(BLOCK, triton.next_power_of_2(d))


def _rows(d: int) -> int:
    return max(1, min(64, 2048 // _block(d)))


def _gather(src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, len(index), D) rows of src (zeros where index < 0), in `dtype`."""
    if src.stride(2) != 1:
        src = src.contiguous()
    b, n_src, d = src.shape
    n = index.shape[0]
    out = torch.empty((b, n, d), dtype=dtype, device=src.device)
    _gather_rows_kernel[(triton.cdiv(b * n, _rows(d)), triton.cdiv(d, _block(d)))](
        src, index, out, b * n, n, n_src, src.stride(0), src.stride(1),
        D=d, ROWS=_rows(d), BLOCK_D=_block(d), enable_fp_fusion=False,
    )
    return out


# ------------------------------------------------------------------------------------------------ validation
def _check_rows(op: str, name: str, rows) -> None:
    if not isinstance(rows, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: {name} must be a tensor, got {type(rows).__name__}")
    if rows.dtype not in DTYPES:
        raise registry.StrictUnsupported(f"{op}: {name} dtype {rows.dtype} not served (float32, bfloat16, float16)")
    if rows.dim() != 3:
        raise registry.StrictUnsupported(f"{op}: {name} shape {list(rows.shape)} must be (B, N, D)")
    if rows.shape[0] == 0 or rows.shape[2] == 0:
        raise registry.StrictUnsupported(f"{op}: {name} shape {list(rows.shape)} is empty")
    if rows.stride(2) != 1:
        raise registry.StrictUnsupported(f"{op}: {name} last-axis stride {rows.stride(2)} must be 1")


def _check_index_tensor(op: str, name: str, index, length: int | None) -> None:
    if not isinstance(index, torch.Tensor):
        raise registry.StrictUnsupported(f"{op}: {name} must be a tensor, got {type(index).__name__}")
    if index.dtype != torch.int64:
        raise registry.StrictUnsupported(f"{op}: {name} dtype {index.dtype} must be int64")
    if index.dim() != 1 or (length is not None and index.shape[0] != length):
        want = f"({length},)" if length is not None else "(N,)"
        raise registry.StrictUnsupported(f"{op}: {name} shape {list(index.shape)} must be {want}")
    if not index.is_contiguous():
        raise registry.StrictUnsupported(f"{op}: {name} strides {index.stride()} are not contiguous")


def _first_duplicate(index: torch.Tensor) -> int | None:
    if index.numel() < 2:
        return None
    s = torch.sort(index).values
    dup = s[1:][s[1:] == s[:-1]]
    return int(dup[0]) if dup.numel() else None


def _unpack_parts(text, video, audio):
    parts = []
    for name, part in zip(PARTS, (text, video, audio)):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise registry.StrictUnsupported(f"pack_rows: {name} must be an (index, rows) pair")
        parts.append((name, part[0], part[1]))
    return parts


def _validate_pack(seq_len, text, video, audio):
    op = "pack_rows"
    parts = _unpack_parts(text, video, audio)
    registry.check_device(*[t for _, i, r in parts for t in (i, r) if isinstance(t, torch.Tensor)], op=op)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise registry.StrictUnsupported(f"{op}: seq_len={seq_len!r} must be a positive integer")
    for name, idx, rows in parts:
        _check_rows(op, f"{name} rows", rows)
        _check_index_tensor(op, f"{name}_idx", idx, rows.shape[1])
    b, d = parts[0][2].shape[0], parts[0][2].shape[2]
    for name, _, rows in parts[1:]:
        if rows.shape[0] != b or rows.shape[2] != d:
            raise registry.StrictUnsupported(
                f"{op}: {name} rows shape {list(rows.shape)} must match text's batch {b} and width {d}"
            )
    total = sum(idx.shape[0] for _, idx, _ in parts)
    if total != seq_len:
        raise registry.StrictUnsupported(
            f"{op}: the parts hold {total} rows but seq_len={seq_len}; the layout must cover every packed row exactly once"
        )
    idxs = tuple(idx for _, idx, _ in parts)
    return parts, _CACHE.get(idxs, ("pack", seq_len), lambda: _check_layout(op, seq_len, parts))


def _check_layout(op: str, seq_len: int, parts) -> dict:
    """The copy-once rule; returns the source map. One device sync on the good path."""
    flat = torch.cat([idx for _, idx, _ in parts])
    # all indices sorted together must be exactly 0..seq_len-1
    if bool((torch.sort(flat).values == torch.arange(seq_len, device=flat.device)).all()):
        part, pos = _source_map(seq_len, [idx for _, idx, _ in parts])
        return {"part": part, "pos": pos}
    # Diagnose which rule failed (error path only).
    for name, idx, _ in parts:
        if idx.numel():
            lo, hi = torch.stack([idx.min(), idx.max()]).tolist()
            if lo < 0 or hi >= seq_len:
                bad = lo if lo < 0 else hi
                raise registry.StrictUnsupported(f"{op}: {name}_idx value {bad} out of range (0 <= index < seq_len={seq_len})")
        dup = _first_duplicate(idx)
        if dup is not None:
            raise registry.StrictUnsupported(f"{op}: {name}_idx repeats packed row {dup}; each row must be copied once")
    for i in range(3):
        for j in range(i + 1, 3):
            (ni, ii, _), (nj, ij, _) = parts[i], parts[j]
            both = ii[torch.isin(ii, ij)]
            if both.numel():
                raise registry.StrictUnsupported(f"{op}: packed row {int(both[0])} is claimed by both {ni}_idx and {nj}_idx")
    raise registry.StrictUnsupported(f"{op}: the layout does not cover every packed row exactly once")  # pragma: no cover


def _validate_select(x, index):
    op = "select_rows"
    registry.check_device(*[t for t in (x, index) if isinstance(t, torch.Tensor)], op=op)
    _check_rows(op, "x", x)
    _check_index_tensor(op, "index", index, None)
    if index.shape[0] == 0:
        raise registry.StrictUnsupported(f"{op}: index is empty (no rows selected)")
    s = x.shape[1]

    def build() -> dict:
        lo, hi = torch.stack([index.min(), index.max()]).tolist()
        if lo < 0 or hi >= s:
            bad = lo if lo < 0 else hi
            raise registry.StrictUnsupported(f"{op}: index value {bad} out of range for {s} rows (0 <= index < {s})")
        dup = _first_duplicate(index)
        if dup is not None:
            raise registry.StrictUnsupported(
                f"{op}: index repeats row {dup}; strict needs unique rows (its backward scatters without accumulation)"
            )
        return {}

    return _CACHE.get((index,), ("select", s), build)


def check_pack_rows(seq_len, text, video, audio) -> dict:
    parts, _ = _validate_pack(seq_len, text, video, audio)
    d = parts[0][2].shape[2]
    return {
        "kernel_id": "h3kernels.packing.pack_rows.v1", "tile": f"BLOCK_D={_block(d)},ROWS={_rows(d)}",
        "acc_dtype": "none(copy)",
    }


def check_select_rows(x, index) -> dict:
    _validate_select(x, index)
    d = x.shape[2]
    return {
        "kernel_id": "h3kernels.packing.select_rows.v1", "tile": f"BLOCK_D={_block(d)},ROWS={_rows(d)}",
        "acc_dtype": "none(copy)",
    }


# ------------------------------------------------------------------------------------------- autograd + runs
def _source_map(seq_len: int, idxs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed row s -> (part, row inside the part); a valid layout writes every entry exactly once."""
    device = idxs[0].device
    part = torch.full((seq_len,), -1, dtype=torch.int32, device=device)
    pos = torch.zeros((seq_len,), dtype=torch.int64, device=device)
    for p, idx in enumerate(idxs):
        part[idx] = p
        pos[idx] = torch.arange(idx.shape[0], dtype=torch.int64, device=device)
    return part, pos


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, seq_len, entry, t_idx, t_rows, v_idx, v_rows, a_idx, a_rows):
        b, _, d = t_rows.shape
        part, pos = entry["part"], entry["pos"]
        out = torch.empty((b, seq_len, d), dtype=t_rows.dtype, device=t_rows.device)
        _pack_kernel[(triton.cdiv(b * seq_len, _rows(d)), triton.cdiv(d, _block(d)))](
            t_rows, v_rows, a_rows, part, pos, out, b * seq_len, seq_len,
            t_rows.stride(0), t_rows.stride(1), v_rows.stride(0), v_rows.stride(1), a_rows.stride(0), a_rows.stride(1),
            D=d, ROWS=_rows(d), BLOCK_D=_block(d), enable_fp_fusion=False,
        )
        ctx.save_for_backward(t_idx, v_idx, a_idx)
        ctx.dtypes = (t_rows.dtype, v_rows.dtype, a_rows.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        idxs = ctx.saved_tensors
        grads = []
        for k, (idx, dtype) in enumerate(zip(idxs, ctx.dtypes)):
            need = ctx.needs_input_grad[3 + 2 * k]
            grads += [None, _gather(dout, idx, dtype) if need else None]
        return (None, None, *grads)


class _Select(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, entry):
        ctx.save_for_backward(index)
        ctx.rows = x.shape[1]
        ctx.entry = entry
        return _gather(x, index, x.dtype)

    @staticmethod
    def backward(ctx, dy):
        (index,) = ctx.saved_tensors
        rows = ctx.rows

        def make():
            inverse = torch.full((rows,), -1, dtype=torch.int64, device=index.device)
            inverse[index] = torch.arange(index.shape[0], dtype=torch.int64, device=index.device)  # unique: no races
            return inverse

        return _gather(dy, lazy(ctx.entry, "inverse", make), dy.dtype), None, None


def pack_rows(seq_len: int, text, video, audio) -> torch.Tensor:
    """Strict packed index copy (see the module contract)."""
    _, entry = _validate_pack(seq_len, text, video, audio)
    return _Pack.apply(seq_len, entry, text[0], text[1], video[0], video[1], audio[0], audio[1])


def select_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Strict `x.index_select(1, index)` with unique indices (see the module contract)."""
    entry = _validate_select(x, index)
    return _Select.apply(x, index, entry)


# ------------------------------------------------------------------------------------------------ references
def reference_pack_rows(seq_len, text, video, audio):
    """The reference copy (zero fill, then text, video, audio index_copy in text's dtype)."""
    out = text[1].new_zeros((text[1].shape[0], seq_len, text[1].shape[-1]))
    for idx, rows in (text, video, audio):
        out = out.index_copy(1, idx, rows.to(text[1].dtype))
    return out


def reference_select_rows(x, index):
    return x.index_select(1, index)


registry.register("pack_rows", run=pack_rows, check=check_pack_rows)
registry.register("select_rows", run=select_rows, check=check_select_rows)
