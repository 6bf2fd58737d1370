"""64-bit element offsets, shared by every strict kernel that addresses a tile of rows.

Contract: `tile_offsets(rows, row_stride, cols, col_stride)` returns the (R, C) int64 element offsets
rows[:, None] * row_stride + cols[None, :] * col_stride, and `flat_offsets(pid, BLOCK)` the (BLOCK,) int64 offsets
pid * BLOCK + arange(BLOCK). Both operands are widened to int64 *before* the products (`tl.cast`, which also takes a
constexpr, e.g. a stride of 1 that Triton specialised), so an offset past 2**31 - 1 never wraps: a tensor of 2**31
elements or more (1344x768x362f's FFN activations are 3.1e9) is addressed correctly. Row and column indices
themselves stay below 2**31 (int32 grid arithmetic). Offsets choose addresses only; no arithmetic on the data
changes, so the bytes of every kernel are those of its int32 addressing wherever that did not wrap.
`tests/kernels/test_offsets.py` checks both helpers past 2**31 in a tiny kernel, and the strided-view kernels
(GEMM, attention, packing, modulation tables) on views whose rows lie past 2**31 elements of a lazily allocated
buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_offsets(rows, row_stride, cols, col_stride):
    """int64 (R, C) offsets rows[:, None] * row_stride + cols[None, :] * col_stride."""
    return tl.cast(rows, tl.int64)[:, None] * row_stride + tl.cast(cols, tl.int64)[None, :] * col_stride


@triton.jit
def flat_offsets(pid, BLOCK: tl.constexpr):
    """int64 (BLOCK,) offsets pid * BLOCK + arange(BLOCK) of program `pid`'s flat block."""
    return tl.cast(pid, tl.int64) * BLOCK + tl.arange(0, BLOCK)
