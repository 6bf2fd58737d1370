"""Strict GEMM: the `linear` and `linear_tree` ops (y = x @ weight.T + bias), forward and backward.

Contract
--------
Math      y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); x (..., K) is flattened to (M, K) rows, w is (N, K),
          x.dtype == w.dtype == bias.dtype in {bfloat16, float32}; y has x's dtype and shape (..., N).
Tiles     one fixed config per (op, dtype), never autotuned and never chosen from M (`LINEAR_TILES`, `TREE_TILES`):
            linear      bf16  BLOCK 128x256x64, GROUP_M 8, 8 warps, 3 stages, persistent, TMA
                        fp32  BLOCK 128x64x32,  GROUP_M 8, 4 warps, 3 stages, persistent, TMA, tf32x3
            linear_tree bf16  BLOCK 128x128x64, GROUP_M 8, 8 warps, 4 stages, persistent, TMA, TMA slots
                        fp32  BLOCK 128x64x32,  GROUP_M 8, 4 warps, 3 stages, persistent, TMA, tf32x3
          BLOCK_K fixes the reduction order; BLOCK_M/BLOCK_N only group independent outputs. Persistent: one
          program per SM loops over output tiles (which program computes a tile never changes its values). TMA:
          operands that are row-major, or transposes of row-major, and 16-byte aligned are read through tensor
          descriptors, others through pointers; both read the same tiles in the same order into the same dot
          (bit-equal; checked on the H200 by `benchmarks/benchmark_gemm.py --sweep`).
Reduction `linear`: each output element owns one float32 accumulator; the K axis is visited in BLOCK_K tiles in
          ascending order, acc = dot(x_tile, w_tile^T, acc): the tensor core for bf16 operands; for float32
          operands the tile's `precision`, "ieee" (FMA, never TF32) or "tf32x3" (the tensor core's three-TF32
          split, hi*hi + hi*lo + lo*hi, never single TF32). The contract's float32 tiles are tf32x3. On the H200
          (benchmarks/results/gemm_fp32.json, the LoRA factor products at 2,066 rows) its error against a float64
          truth is within 0.92x of cuBLAS float32's on every product (0.97x in a second run,
          gemm_fp32_contract_tile.json). FMA with one accumulator reached 5.3x (on the weight gradients and the
          long-K narrow products), and tf32x3 is 2.7x faster than FMA. No atomics.
          `linear_tree`: K is cut into 8 equal chunks (K % 8 == 0, else refused); chunk c covers
          [c*K/8, (c+1)*K/8) and is reduced like `linear` (BLOCK_K tiles ascending, from zero) into its own float32
          partial p_c; the partials are combined in float32 by the fixed binary tree
          ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)). Finished subtrees (p0 + p1, the left half, p4 + p5)
          wait in a float32 scratch slot of the program (exact), so at most two accumulators are live. A TP2/4/8
          rank owning 4/2/1 consecutive chunks computes its subtree with `tree_partial`, and `tree_combine`
          finishes the same tree: TP1 bytes.
          TMA slots (`Tile.slot_tma`, the bf16 tree tile on CUDA): the finished subtrees are parked through a TMA
          descriptor over the scratch (`_desc_stash`: a bulk store, then `cp.async.bulk.wait_group 0` so its writes
          are complete before the barrier and the slot's TMA load) instead of a pointer store: float32 in, float32
          out, the same adds (bytes checked on the H200 against the chunk loops, gemm_tree_slot_tma.json). A local
          sm_90 compile (scripts/kernel_resources.py, no GPU needed) shows why it pays: the pointer slots keep a
          128x128 tensor of 64-bit slot addresses and two layout conversions live across the loops, and the kernel
          spills (paired: 226 spill stores at 8 chunks, 0 at 2); through the descriptor, 150 at 4 stages (58 at
          3 stages, which run slower). Measured (H200, interleaved in one run per pair of row counts): 1.53x /
          1.33x cuBLAS on o_proj / ffn_down at 37,853 rows, the paired schedule before it 1.73x / 1.55x (1.42-1.73x
          and 1.44-1.55x over three runs); 1.72x / 1.43x at 12,369 (paired 1.77x / 1.44x); 1.40x / 1.39x at 7,272
          (1.47x / 1.42x); 1.97x / 1.54x at 2,066 (2.04x / 1.60x; gemm_tree_slot_tma_small.json). The ceiling at
          this tile, one plain K loop with no tree, is 1.05-1.54x; `linear`'s 128x256 tile reaches 1.02-1.17x but
          cannot hold a finished subtree beside its accumulator: a one-accumulator schedule parking every partial
          in scratch (130-148 TFLOP/s) and one K loop over all chunks with the adds at chunk ends (103-134 TFLOP/s)
          were byte-equal and far slower (gemm_tree_stash_all.json, gemm_tree_flat_held3.json), so were
          not kept.
          Paired chunks (`Tile.paired`, the bf16 tree tile before): chunks 2j and 2j+1 accumulate in ONE loop over
          their BLOCK_K tiles, iteration k adding chunk 2j's tile k into p_2j and chunk 2j+1's tile k into
          p_(2j+1). Each partial sees exactly the dots it sees chunk by chunk (same tiles, same ascending order,
          from zero), so the bytes are the chunk-by-chunk loops' (CPU: tests/kernels/test_gemm.py; H200:
          benchmark_gemm.py --schedules and the 512x512x22f forward hash); a tile has 4 loops instead of 8 (half
          the pipeline drains) and two independent MMA chains in flight. Twice the operand bytes per stage:
          3 stages fit the shared memory where 4 chunk-by-chunk stages did. Measured (gemm_tree_schedules.json, H200): 2-7% over
          the chunk-by-chunk loops at 2,066 rows, 0-2% at 12,369; still 1.4-2.1x cuBLAS, whose tiles are wider
          than the two live 128x128 float32 accumulators of the tree allow in registers.
Narrow    a float32 product whose weight has N <= SPLIT_MAX_N outputs over K >= SPLIT_MIN_K (K a multiple of
          8*BLOCK_K; `splits(dtype, N, K)`, the weight's shape only, never M) is the 8-chunk tree with TREE_TILES,
          its chunks in parallel programs (`_gemm_partials_kernel`) and `_tree_combine_kernel` finishing it (the
          adds of `tree_combine`, in one launch): bytes equal to
          the one-program tree, so a narrow `linear` equals `linear_tree` there. This applies to the forward and to
          dX (a LoRA factor x @ A^T and its backward dY @ B: 64 outputs over thousands of K would fill a quarter of
          the GPU's SMs); dW never splits.
Epilogue  bias (cast to float32) is added once after the reduction, then one round-to-nearest-even cast to the
          output dtype. Kernels are compiled with enable_fp_fusion=False: no multiply-add contraction outside dot.
Backward  (same kernel and tiles as `linear` for the dtype, for both ops: the tree is a forward-only split)
          dX = dY @ W     reduction over N in BLOCK_K tiles, ascending (the Narrow rule may apply); dX rows are
                          row-invariant.
          dW = dY^T @ X   reduction over the M rows in fixed BLOCK_K-row chunks in ascending row order, one float32
                          accumulator per element (no split over rows, so no atomics and no merge).
          dB = sum_m dY   row r is added to lane r % 64 of a (64, 128) float32 tile, row chunks ascending, then the
                          64 lanes are summed by tl.sum's fixed tree.
          Each gradient is cast once to its input's dtype. Two backward runs are bit-identical.
Invariance Row m of y (and of dX) depends only on row m of x (of dY) and the weights: batch size, batch position,
          row count and other rows never change its bytes (rows past M are wrapped onto valid rows, or read as 0 by
          TMA, and never stored).
Interpreter (CPU, TRITON_INTERPRET=1): numpy cannot multiply bfloat16, so bf16 tiles are widened to float32 before
          the dot (exact: a bf16 x bf16 product fits in float32), and the final bf16 rounding is done on the bits
          (the interpreter's cast truncates). Tile loop, chunking, tree and cast points are the GPU's; the order
          inside one tile's dot is numpy's, so CPU bytes are not promised equal to GPU bytes.
Refused   dtypes other than bf16/fp32, mixed dtypes or devices, empty tensors, weight not 2-D, x.shape[-1] != K,
          bias not (N,), K % 8 != 0 for `linear_tree`, CPU tensors without the interpreter. Any strides are
          accepted (x is flattened with reshape, which copies only when it must).
Addressing 64-bit: every element offset (row * stride, chunk * stride) is formed in int64 and TMA descriptors take
          64-bit strides, so tensors of 2**31 elements or more are served (the FFN up-projection of 1344x768x362f,
          109,205 rows x 28,672, is 3.1e9 elements). Offsets change no arithmetic: the bytes are those of the int32
          kernels wherever both ran. Tile coordinates are int32 per axis (rows and columns < 2**31 each).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import registry
from ._launch import lean
from ._offsets import tile_offsets
from ._strict_math import round_to

TREE_CHUNKS = 8
_DTYPES = (torch.bfloat16, torch.float32)
PRECISIONS = ("ieee", "tf32x3")  # float32 operands: FMA, or the tensor core's three-TF32 split


@dataclass(frozen=True)
class Tile:
    """A fixed launch config; `describe()` is the provenance string recorded in the trace."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    persistent: bool = True  # one program per SM looping over output tiles (else one program per tile)
    tma: bool = True  # read aligned row-major operands through TMA descriptors (else always pointers)
    precision: str = "ieee"  # float32 operands: "ieee" (FMA) or "tf32x3" (three TF32 tensor-core products)
    paired: bool = True  # a tree's chunk pairs accumulate in one K loop (`_paired_chunks`; else one loop per chunk)
    slot_tma: bool = False  # the scratch slots through a TMA descriptor (`_desc_stash`; CUDA with TMA operands only)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"Tile precision {self.precision!r} is not one of {PRECISIONS}")

    def describe(self, split: bool = False) -> str:
        flags = ("-persistent" if self.persistent else "") + ("-tma" if self.tma else "")
        flags += "" if self.precision == "ieee" else f"-{self.precision}"
        flags += "" if self.paired else "-chunkloops"  # the schedule before the paired loops (same bytes)
        flags += "-slottma" if self.slot_tma else ""
        flags += f"-split{TREE_CHUNKS}" if split else ""
        shape = f"BM{self.block_m}xBN{self.block_n}xBK{self.block_k}-G{self.group_m}"
        return f"{shape}-w{self.num_warps}s{self.num_stages}{flags}"


LINEAR_TILES = {
    torch.bfloat16: Tile(128, 256, 64, 8, 8, 3, persistent=True, tma=True),
    torch.float32: Tile(128, 64, 32, 8, 4, 3, persistent=True, tma=True, precision="tf32x3"),
}
TREE_TILES = {
    torch.bfloat16: Tile(128, 128, 64, 8, 8, 4, persistent=True, tma=True, paired=False, slot_tma=True),
    # float32 keeps the chunk-by-chunk loops (its paired schedule is byte-equal but unmeasured on the GPU)
    torch.float32: Tile(128, 64, 32, 8, 4, 3, persistent=True, tma=True, precision="tf32x3", paired=False),
}
ROWSUM_BLOCK_M, ROWSUM_BLOCK_N = 64, 128  # dB: (row lanes, columns) of one program
# Narrow float32 outputs over a long K (a LoRA factor x @ A^T, its backward dY @ B) give too few output tiles to
# fill the GPU: there the 8 tree chunks run in parallel programs. The rule reads the weight's shape only, never M.
SPLIT_MAX_N = 128
SPLIT_MIN_K = 2048


# ------------------------------------------------------------------------------------------------- kernels
@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b with a float32 accumulator. bf16 operands use the tensor core; float32 operands use PRECISION:
    "ieee" (FMA, never TF32) or "tf32x3" (the tensor core's three-TF32 split, hi*hi + hi*lo + lo*hi). INTERPRETED
    (interpreter only) widens bf16 tiles to float32 first, which is exact; there every dot is numpy's float32."""
    if INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        return tl.dot(a, b, acc, input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 -> DTYPE, round to nearest even (the GPU's cvt.rn). Triton's interpreter truncates float32 -> bf16,
    so there the value is first rounded exactly by `_strict_math.round_to` and the cast is then exact."""
    if INTERPRETED:
        x = round_to(x, DTYPE)
    return x.to(DTYPE)


@triton.jit
def _tiles_at(x_src, w_src, off_m, off_n, k, stride_xk, stride_wk, mask_k,
              USE_TMA: tl.constexpr, X_TRANS: tl.constexpr, W_TRANS: tl.constexpr, EVEN_K: tl.constexpr):
    """The operand tiles at absolute K offset k, exactly as `_chunk` reads them: x (BLOCK_M, BLOCK_K) and
    w^T (BLOCK_K, BLOCK_N); pointer loads mask lanes past the chunk's end (`mask_k`) to 0."""
    if USE_TMA:
        if X_TRANS:
            a = x_src.load([k, off_m]).T
        else:
            a = x_src.load([off_m, k])
        if W_TRANS:
            b = w_src.load([k, off_n])
        else:
            b = w_src.load([off_n, k]).T
    else:
        x_ptrs = x_src + tl.cast(k, tl.int64) * stride_xk
        w_ptrs = w_src + tl.cast(k, tl.int64) * stride_wk
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=mask_k[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
    return a, b


@triton.jit
def _chunk(x_src, w_src, off_m, off_n, c, CHUNK_K, stride_xk, stride_wk,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, X_TRANS: tl.constexpr, W_TRANS: tl.constexpr,
           PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """Partial p_c: float32 (BLOCK_M, BLOCK_N) = sum over k in chunk c, i.e. [c*CHUNK_K, (c+1)*CHUNK_K), of
    x[m, k] * w[n, k], in BLOCK_K tiles ascending, from zero. USE_TMA: x_src/w_src are tensor descriptors over x
    (M, K) and w (N, K), or over their row-major transposes (K, M) / (K, N) when X_TRANS / W_TRANS, and the tile
    starts at (off_m, off_n) (out-of-range elements read as 0); else they are pointer blocks at k = 0,
    x (BLOCK_M, BLOCK_K) and w (BLOCK_K, BLOCK_N)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = c * CHUNK_K
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, CHUNK_K, BLOCK_K):
        # chunk tail (pointer loads only): masked lanes load 0 and add exact zeros
        a, b = _tiles_at(x_src, w_src, off_m, off_n, k_lo + k, stride_xk, stride_wk, offs_k < CHUNK_K - k,
                         USE_TMA, X_TRANS, W_TRANS, EVEN_K)
        acc = mma(a, b, acc, PRECISION, INTERPRETED)
    return acc


@triton.jit
def _paired_chunks(x_src, w_src, off_m, off_n, c, CHUNK_K, stride_xk, stride_wk,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, X_TRANS: tl.constexpr, W_TRANS: tl.constexpr,
                   PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """(p_c, p_(c+1)) in one loop: iteration k reads chunk c's and chunk c+1's tile at in-chunk offset k and adds
    each into its own float32 accumulator (from zero). Per accumulator these are `_chunk`'s operations in
    `_chunk`'s order (the same tiles, masks and dot, BLOCK_K tiles ascending), so each partial has `_chunk`'s
    bytes; the two chains are independent, so the loop has no chunk boundary to drain and twice the work in
    flight per iteration."""
    left = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    right = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = c * CHUNK_K
    offs_k = tl.arange(0, BLOCK_K)
    for k in range(0, CHUNK_K, BLOCK_K):
        mask_k = offs_k < CHUNK_K - k  # the chunk tail (pointer loads only), as in `_chunk`
        a, b = _tiles_at(x_src, w_src, off_m, off_n, k_lo + k, stride_xk, stride_wk, mask_k,
                         USE_TMA, X_TRANS, W_TRANS, EVEN_K)
        a2, b2 = _tiles_at(x_src, w_src, off_m, off_n, k_lo + CHUNK_K + k, stride_xk, stride_wk, mask_k,
                           USE_TMA, X_TRANS, W_TRANS, EVEN_K)
        left = mma(a, b, left, PRECISION, INTERPRETED)
        right = mma(a2, b2, right, PRECISION, INTERPRETED)
    return left, right


@triton.jit
def _stash(slot_ptr, tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Park a finished float32 subtree (BLOCK_M, BLOCK_N) in a scratch slot of this program, so the next pair of
    chunks runs with two live accumulators instead of up to four. float32 in, float32 out: the bytes do not change.
    The barriers order the slot's accesses across the program's threads."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.debug_barrier()
    tl.store(slot_ptr + offs, tile)
    tl.debug_barrier()


@triton.jit
def _unstash(slot_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    return tl.load(slot_ptr + offs, cache_modifier=".cg")


@triton.jit
def _pair(x_src, w_src, off_m, off_n, c, CHUNK_K, stride_xk, stride_wk,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, X_TRANS: tl.constexpr, W_TRANS: tl.constexpr,
          PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, PAIRED: tl.constexpr):
    """p_c + p_(c+1), left operand first (two live accumulators). PAIRED: both partials accumulate in ONE loop over
    the chunk's BLOCK_K tiles (`_paired_chunks`), else chunk c's loop, then chunk c+1's. Same bytes either way."""
    if PAIRED:
        left, right = _paired_chunks(x_src, w_src, off_m, off_n, c, CHUNK_K, stride_xk, stride_wk,
                                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION,
                                     INTERPRETED)
        return left + right
    left = _chunk(x_src, w_src, off_m, off_n, c, CHUNK_K, stride_xk, stride_wk,
                  BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED)
    right = _chunk(x_src, w_src, off_m, off_n, c + 1, CHUNK_K, stride_xk, stride_wk,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED)
    return left + right


@triton.jit
def _desc_stash(desc, row0, tile):
    """Park a float32 subtree through the scratch's TMA descriptor and wait until the bulk store has completed
    (`cp.async.bulk.wait_group 0`: its writes done, not only its shared-memory reads), so a later load sees it."""
    desc.store([row0, 0], tile)
    tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, $1;", "=r,r", [row0], dtype=tl.int32,
                              is_pure=False, pack=1)
    tl.debug_barrier()


@triton.jit
def _park(slot_ptr, desc, row0, tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLOT_TMA: tl.constexpr):
    """Park a finished float32 subtree in this program's slot: through the scratch's TMA descriptor (its rows
    row0 .. row0 + BLOCK_M) or through pointers (`_stash`). The same float32 values either way."""
    if SLOT_TMA:
        _desc_stash(desc, row0, tile)
    else:
        _stash(slot_ptr, tile, BLOCK_M, BLOCK_N)


@triton.jit
def _fetch(slot_ptr, desc, row0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLOT_TMA: tl.constexpr):
    """The subtree `_park` left in the slot."""
    if SLOT_TMA:
        return desc.load([row0, 0])
    else:
        return _unstash(slot_ptr, BLOCK_M, BLOCK_N)


@triton.jit
def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(off_m, off_n) of output tile number `tile` in the grouped order (GROUP_M row tiles share a column sweep,
    for L2 reuse). The order only schedules: which program computes a tile, and when, never changes its values."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_pid_n
    first_m = (tile // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((tile % group) % group_m)
    pid_n = (tile % group) // group_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _sources(x_ptr, w_ptr, x_desc, w_desc, offs_m, offs_n, M, N, stride_xm, stride_xk, stride_wn, stride_wk,
             BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr):
    """The operands `_chunk` reads: the descriptors, or pointer blocks at k = 0 whose rows/cols past the end are
    wrapped onto valid ones (loaded, never stored), so a valid row's arithmetic is the same wherever it sits."""
    if USE_TMA:
        x_src = x_desc
        w_src = w_desc
    else:
        rows = offs_m % M
        cols = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        x_src = x_ptr + tile_offsets(rows, stride_xm, offs_k, stride_xk)  # (BLOCK_M, BLOCK_K)
        w_src = w_ptr + tile_offsets(offs_k, stride_wk, cols, stride_wn)  # (BLOCK_K, BLOCK_N)
    return x_src, w_src


@lean
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr, w_ptr, x_desc, w_desc, b_ptr, y_ptr,  # x (M, K), w (N, K) (pointers or descriptors), bias (N,), y (M, N)
    scratch_ptr,  # float32 (n_programs, 2, BLOCK_M, BLOCK_N): per-program slots for finished subtrees (tree only)
    M, N, CHUNK_K, n_programs,  # K = N_CHUNKS * CHUNK_K; n_programs = grid size (persistent loop stride)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    scratch_desc,  # SLOT_TMA: a TMA descriptor over the scratch as (n_programs * 2 * BLOCK_M, BLOCK_N) rows
    HAS_BIAS: tl.constexpr, N_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, X_TRANS: tl.constexpr, W_TRANS: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr, PAIRED: tl.constexpr, SLOT_TMA: tl.constexpr,
):
    # persistent: program p computes output tiles p, p + n_programs, ...
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), n_programs):
        off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        x_src, w_src = _sources(x_ptr, w_ptr, x_desc, w_desc, offs_m, offs_n, M, N,
                                stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_K, USE_TMA)
        cols = offs_n % N

        # the declared tree ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), each add's left operand computed
        # first; finished subtrees wait in the program's scratch slots, so at most two accumulators are live
        slot0 = scratch_ptr + tl.program_id(0).to(tl.int64) * (2 * BLOCK_M * BLOCK_N)
        slot1 = slot0 + BLOCK_M * BLOCK_N
        if N_CHUNKS == 1:
            acc = _chunk(x_src, w_src, off_m, off_n, 0, CHUNK_K, stride_xk, stride_wk,
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED)
        elif N_CHUNKS == 2:
            acc = _pair(x_src, w_src, off_m, off_n, 0, CHUNK_K, stride_xk, stride_wk,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED, PAIRED)
        else:
            tl.static_assert(N_CHUNKS == 4 or N_CHUNKS == 8, "N_CHUNKS must be 1, 2, 4 or 8")
            row0 = tl.program_id(0) * (2 * BLOCK_M)  # SLOT_TMA: this program's two slots in the descriptor's rows
            s = _pair(x_src, w_src, off_m, off_n, 0, CHUNK_K, stride_xk, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                      EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED, PAIRED)  # p0 + p1
            _park(slot0, scratch_desc, row0, s, BLOCK_M, BLOCK_N, SLOT_TMA)
            s = _pair(x_src, w_src, off_m, off_n, 2, CHUNK_K, stride_xk, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                      EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED, PAIRED)  # p2 + p3
            acc = _fetch(slot0, scratch_desc, row0, BLOCK_M, BLOCK_N, SLOT_TMA) + s  # (p0 + p1) + (p2 + p3)
            if N_CHUNKS == 8:
                _park(slot0, scratch_desc, row0, acc, BLOCK_M, BLOCK_N, SLOT_TMA)
                s = _pair(x_src, w_src, off_m, off_n, 4, CHUNK_K, stride_xk, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED, PAIRED)  # p4 + p5
                _park(slot1, scratch_desc, row0 + BLOCK_M, s, BLOCK_M, BLOCK_N, SLOT_TMA)
                s = _pair(x_src, w_src, off_m, off_n, 6, CHUNK_K, stride_xk, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED, PAIRED)  # p6 + p7
                s = _fetch(slot1, scratch_desc, row0 + BLOCK_M, BLOCK_M, BLOCK_N, SLOT_TMA) + s  # (p4+p5) + (p6+p7)
                acc = _fetch(slot0, scratch_desc, row0, BLOCK_M, BLOCK_N, SLOT_TMA) + s

        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + cols).to(tl.float32)[None, :]  # bias (BLOCK_N,) in float32, once
        y_ptrs = y_ptr + tile_offsets(offs_m, stride_ym, offs_n, stride_yn)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptrs, cast_rne(acc, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@lean
@triton.jit(do_not_specialize=["M"])
def _gemm_partials_kernel(
    x_ptr, w_ptr, x_desc, w_desc, p_ptr,  # x (M, K), w (N, K) (pointers or descriptors), partials (N_CHUNKS, M, N)
    M, N, CHUNK_K, n_programs,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_pc, stride_pm, stride_pn,
    N_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, X_TRANS: tl.constexpr, W_TRANS: tl.constexpr,
    PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """The tree's chunk partials, each in its own program: work item i is chunk i % N_CHUNKS of output tile
    i // N_CHUNKS, reduced by `_chunk` exactly as `_gemm_kernel` reduces it (same tiles, order and dot), stored
    in float32. `_combine_partials` then adds them in the declared tree: the bytes of the one-program tree."""
    for item in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N) * N_CHUNKS, n_programs):
        c = item % N_CHUNKS
        off_m, off_n = _tile_origin(item // N_CHUNKS, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        x_src, w_src = _sources(x_ptr, w_ptr, x_desc, w_desc, offs_m, offs_n, M, N,
                                stride_xm, stride_xk, stride_wn, stride_wk, BLOCK_K, USE_TMA)
        acc = _chunk(x_src, w_src, off_m, off_n, c, CHUNK_K, stride_xk, stride_wk,
                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, USE_TMA, X_TRANS, W_TRANS, PRECISION, INTERPRETED)
        p_ptrs = p_ptr + tl.cast(c, tl.int64) * stride_pc + tile_offsets(offs_m, stride_pm, offs_n, stride_pn)
        tl.store(p_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@lean
@triton.jit(do_not_specialize=["M"])
def _tree_combine_kernel(p_ptr, b_ptr, y_ptr, M, N, stride_pc, stride_pm, stride_pn, stride_ym, stride_yn,
                         HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    """y = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)) [+ bias], cast once: `tree_combine`'s float32 adds in
    its order, in one launch instead of one torch op per add."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = p_ptr + tile_offsets(offs_m, stride_pm, offs_n, stride_pn)
    pc = tl.cast(stride_pc, tl.int64)  # c * stride_pc passes 2**31 before stride_pc does (tl.cast: may be constexpr)
    p0 = tl.load(ptrs, mask=mask, other=0.0)
    p1 = tl.load(ptrs + pc, mask=mask, other=0.0)
    p2 = tl.load(ptrs + 2 * pc, mask=mask, other=0.0)
    p3 = tl.load(ptrs + 3 * pc, mask=mask, other=0.0)
    left = (p0 + p1) + (p2 + p3)
    p4 = tl.load(ptrs + 4 * pc, mask=mask, other=0.0)
    p5 = tl.load(ptrs + 5 * pc, mask=mask, other=0.0)
    p6 = tl.load(ptrs + 6 * pc, mask=mask, other=0.0)
    p7 = tl.load(ptrs + 7 * pc, mask=mask, other=0.0)
    acc = left + ((p4 + p5) + (p6 + p7))
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + tile_offsets(offs_m, stride_ym, offs_n, stride_yn)
    tl.store(y_ptrs, cast_rne(acc, y_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@lean
@triton.jit(do_not_specialize=["M"])
def _row_sum_kernel(dy_ptr, out_ptr, M, N, stride_m, stride_n,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """out[n] = sum_m dy[m, n]: row r goes to lane r % BLOCK_M, row chunks ascending, then tl.sum over lanes."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + offs_m
        mask = (rows[:, None] < M) & (offs_n[None, :] < N)
        ptrs = dy_ptr + tile_offsets(rows, stride_m, offs_n, stride_n)
        tile = tl.load(ptrs, mask=mask, other=0.0)
        acc += tile.to(tl.float32)
    tl.store(out_ptr + offs_n, cast_rne(tl.sum(acc, axis=0), out_ptr.dtype.element_ty, INTERPRETED), mask=offs_n < N)


# ------------------------------------------------------------------------------------------------ launchers
def _descriptor(t: torch.Tensor, block_rows: int, block_k: int):
    """A TMA descriptor reading tiles of the (rows, K) operand `t`: (descriptor, transposed) over `t` itself when it
    is row-major, over `t.T` (block (block_k, block_rows)) when that is; None when neither is, or when a stride or
    the base is not 16-byte aligned."""
    size = t.element_size()
    for src, block, trans in ((t, [block_rows, block_k], False), (t.t(), [block_k, block_rows], True)):
        if src.stride(1) == 1 and (src.stride(0) * size) % 16 == 0 and src.data_ptr() % 16 == 0:
            return TensorDescriptor.from_tensor(src, block), trans
    return None


def _plan_operands(x: torch.Tensor, w: torch.Tensor, n_chunks: int, tile: Tile, use_tma: bool | None):
    """(x_desc, w_desc, chunk_k, even_k) for x (M, K) @ w (N, K)^T with K in `n_chunks` chunks: descriptors for
    operands that are row-major (or transposes of row-major) and 16-byte aligned, unless the chunks are not whole
    BLOCK_K tiles; (None, None, ...) means pointers. `use_tma=False` forces pointers, True requires descriptors."""
    chunk_k = x.shape[1] // n_chunks
    even_k = chunk_k % tile.block_k == 0
    x_desc = w_desc = None
    if use_tma is None:
        use_tma = None if tile.tma else False
    if use_tma is not False and (n_chunks == 1 or even_k):
        x_desc = _descriptor(x, tile.block_m, tile.block_k)
        w_desc = _descriptor(w, tile.block_n, tile.block_k)
    if x_desc is None or w_desc is None:
        if use_tma:
            raise ValueError(f"TMA requested but operands x {tuple(x.stride())}, w {tuple(w.stride())} do not allow it")
        x_desc = w_desc = None
    return x_desc, w_desc, chunk_k, even_k


def _n_programs(x: torch.Tensor, items: int, tile: Tile) -> int:
    return items if x.device.type == "cpu" or not tile.persistent else min(items, _num_sms(x.device))


def _launch_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, n_chunks: int,
                 tile: Tile, use_tma: bool | None = None) -> torch.Tensor:
    """out (M, N) = x (M, K) @ w (N, K)^T [+ bias], K split into `n_chunks` tree chunks reduced in one program per
    output tile; any strides. No checks. Descriptor and pointer paths visit the same tiles in the same order with
    the same dot (`_plan_operands`)."""
    M, K = x.shape
    N = w.shape[0]
    x_desc, w_desc, chunk_k, even_k = _plan_operands(x, w, n_chunks, tile, use_tma)
    tma = x_desc is not None
    n_programs = _n_programs(x, triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n), tile)
    scratch = out  # unused unless the tree has 4 or 8 chunks
    if n_chunks >= 4:
        scratch = torch.empty((n_programs, 2, tile.block_m, tile.block_n), dtype=torch.float32, device=x.device)
    slot_tma = tile.slot_tma and tma and n_chunks >= 4 and x.device.type == "cuda"
    scratch_desc = scratch  # the kernel reads it only under SLOT_TMA
    if slot_tma:
        scratch_desc = TensorDescriptor.from_tensor(scratch.view(-1, tile.block_n), [tile.block_m, tile.block_n])
    _gemm_kernel[(n_programs,)](
        x, w, x_desc[0] if tma else x, w_desc[0] if tma else w, bias if bias is not None else out, out, scratch,
        M, N, chunk_k, n_programs,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        scratch_desc,
        HAS_BIAS=bias is not None, N_CHUNKS=n_chunks,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        EVEN_K=even_k, USE_TMA=tma, X_TRANS=tma and x_desc[1], W_TRANS=tma and w_desc[1],
        PRECISION=tile.precision, INTERPRETED=x.device.type == "cpu",  # CPU means the interpreter
        PAIRED=tile.paired, SLOT_TMA=slot_tma,
        num_warps=tile.num_warps, num_stages=tile.num_stages, enable_fp_fusion=False,
    )
    return out


def _launch_partials(x: torch.Tensor, w: torch.Tensor, tile: Tile, use_tma: bool | None = None) -> torch.Tensor:
    """The TREE_CHUNKS float32 chunk partials (TREE_CHUNKS, M, N) of x (M, K) @ w (N, K)^T, one work item per
    (output tile, chunk) so that narrow outputs fill the GPU. No checks; K % TREE_CHUNKS == 0."""
    M, K = x.shape
    N = w.shape[0]
    x_desc, w_desc, chunk_k, even_k = _plan_operands(x, w, TREE_CHUNKS, tile, use_tma)
    tma = x_desc is not None
    parts = torch.empty((TREE_CHUNKS, M, N), dtype=torch.float32, device=x.device)
    items = triton.cdiv(M, tile.block_m) * triton.cdiv(N, tile.block_n) * TREE_CHUNKS
    n_programs = _n_programs(x, items, tile)
    _gemm_partials_kernel[(n_programs,)](
        x, w, x_desc[0] if tma else x, w_desc[0] if tma else w, parts,
        M, N, chunk_k, n_programs,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), parts.stride(0), parts.stride(1), parts.stride(2),
        N_CHUNKS=TREE_CHUNKS,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m,
        EVEN_K=even_k, USE_TMA=tma, X_TRANS=tma and x_desc[1], W_TRANS=tma and w_desc[1],
        PRECISION=tile.precision, INTERPRETED=x.device.type == "cpu",
        num_warps=tile.num_warps, num_stages=tile.num_stages, enable_fp_fusion=False,
    )
    return parts


def splits(dtype: torch.dtype, n: int, k: int) -> bool:
    """True when a float32 product with a weight of N = n outputs over K = k runs its 8 tree chunks in parallel
    programs (`SPLIT_MAX_N`, `SPLIT_MIN_K`; whole BLOCK_K tiles per chunk). A property of the weight's shape and
    dtype only: the row count M never decides it, so rows stay batch-invariant."""
    block_k = TREE_TILES[torch.float32].block_k  # the tiles the split runs with (`_product`)
    return (dtype == torch.float32 and n <= SPLIT_MAX_N and k >= SPLIT_MIN_K
            and k % (TREE_CHUNKS * block_k) == 0)


@functools.lru_cache(maxsize=None)
def _num_sms_cached(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    return _num_sms_cached(device.index if device.index is not None else torch.cuda.current_device())


def _gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n_chunks: int, tile: Tile,
          out_dtype: torch.dtype, use_tma: bool | None = None, split: bool = False) -> torch.Tensor:
    """x (M, K) @ w (N, K)^T [+ bias] cast once to out_dtype. `split`: the 8-chunk tree with its chunks in parallel
    programs and `_combine_partials` finishing it (bytes equal to n_chunks = 8 in one program)."""
    if split:
        return _combine_partials(_launch_partials(x, w, tile, use_tma), bias, out_dtype)
    out = torch.empty((x.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    return _launch_gemm(x, w, bias, out, n_chunks, tile, use_tma)


COMBINE_BLOCK_M, COMBINE_BLOCK_N = 64, 64


def _combine_partials(parts: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`tree_combine(list(parts), bias, out_dtype)` for the (8, M, N) float32 partials, as one kernel (same adds,
    same order, one cast: the same bytes)."""
    _, M, N = parts.shape
    out = torch.empty((M, N), dtype=out_dtype, device=parts.device)
    grid = (triton.cdiv(M, COMBINE_BLOCK_M), triton.cdiv(N, COMBINE_BLOCK_N))
    _tree_combine_kernel[grid](
        parts, bias if bias is not None else out, out, M, N, parts.stride(0), parts.stride(1), parts.stride(2),
        out.stride(0), out.stride(1), HAS_BIAS=bias is not None, BLOCK_M=COMBINE_BLOCK_M, BLOCK_N=COMBINE_BLOCK_N,
        INTERPRETED=parts.device.type == "cpu", num_warps=4, enable_fp_fusion=False,
    )
    return out


def _row_sum(dy: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    M, N = dy.shape
    out = torch.empty((N,), dtype=out_dtype, device=dy.device)
    _row_sum_kernel[(triton.cdiv(N, ROWSUM_BLOCK_N),)](
        dy, out, M, N, dy.stride(0), dy.stride(1), BLOCK_M=ROWSUM_BLOCK_M, BLOCK_N=ROWSUM_BLOCK_N,
        INTERPRETED=dy.device.type == "cpu",
        num_warps=4, enable_fp_fusion=False,
    )
    return out


def _validate(op: str, x, weight, bias, n_chunks: int) -> None:
    """Raise StrictUnsupported (one line: value and rule) for any call the kernel does not serve."""
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise registry.StrictUnsupported(f"{op}: {name} is {type(t).__name__}, must be a torch.Tensor")
    registry.check_device(x, weight, bias, op=op)
    if weight.dim() != 2:
        raise registry.StrictUnsupported(f"{op}: weight has shape {tuple(weight.shape)}, must be 2-D (N, K)")
    if x.dim() < 1:
        raise registry.StrictUnsupported(f"{op}: x is 0-D, must be (..., K)")
    if x.dtype not in _DTYPES:
        raise registry.StrictUnsupported(f"{op}: x dtype {x.dtype} is not supported (bfloat16 or float32)")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        dts = [str(t.dtype) for t in (x, weight, bias) if t is not None]
        raise registry.StrictUnsupported(f"{op}: mixed dtypes {dts}; x, weight and bias must share one dtype")
    N, K = weight.shape
    if x.shape[-1] != K:
        raise registry.StrictUnsupported(f"{op}: x.shape[-1] = {x.shape[-1]} does not match weight K = {K}")
    if bias is not None and tuple(bias.shape) != (N,):
        raise registry.StrictUnsupported(f"{op}: bias has shape {tuple(bias.shape)}, must be ({N},)")
    if x.numel() == 0 or weight.numel() == 0:
        raise registry.StrictUnsupported(
            f"{op}: empty input (x {tuple(x.shape)}, weight {tuple(weight.shape)}); strict refuses empty tensors"
        )
    if K % n_chunks != 0:
        raise registry.StrictUnsupported(
            f"{op}: K = {K} is not a multiple of {n_chunks} (the fixed K-chunk tree needs equal chunks)"
        )


# ------------------------------------------------------------------------------------------------- autograd
def _product(x2d: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n_chunks: int, tile: Tile,
             out_dtype: torch.dtype) -> torch.Tensor:
    """x2d @ w^T [+ bias] as the op's arithmetic: a narrow float32 weight (`splits`) runs the 8-chunk tree with
    parallel chunks (TREE_TILES), else `n_chunks` chunks in one program per tile with `tile`."""
    if splits(x2d.dtype, w.shape[0], w.shape[1]):
        return _gemm(x2d, w, bias, TREE_CHUNKS, TREE_TILES[x2d.dtype], out_dtype, split=True)
    return _gemm(x2d, w, bias, n_chunks, tile, out_dtype)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, n_chunks, tile):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return _product(x2d, weight, bias, n_chunks, tile, x2d.dtype)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        tile = LINEAR_TILES[x2d.dtype]
        dy = dy.to(x2d.dtype)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _product(dy, weight.t(), None, 1, tile, x2d.dtype)  # (M, N) @ (N, K): "w" = W^T viewed (K, N)
        if ctx.needs_input_grad[1]:
            dw = _gemm(dy.t(), x2d.t(), None, 1, tile, weight.dtype)  # (N, M) @ (M, K): reduce over rows, never split
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = _row_sum(dy, weight.dtype)
        return dx, dw, db, None, None


def _apply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n_chunks: int, tile: Tile) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    y = _LinearFn.apply(x2d, weight, bias, n_chunks, tile)
    return y.reshape(*x.shape[:-1], weight.shape[0])


# ----------------------------------------------------------------------------------------------- public ops
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Strict `linear`: x (..., K) @ weight (N, K)^T + bias (N,) -> (..., N), autograd-aware."""
    _validate("linear", x, weight, bias, 1)
    return _apply(x, weight, bias, 1, LINEAR_TILES[x.dtype])


def linear_tree(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Strict `linear_tree`: as `linear`, K reduced as the fixed 8-chunk binary tree (K % 8 == 0)."""
    _validate("linear_tree", x, weight, bias, TREE_CHUNKS)
    return _apply(x, weight, bias, TREE_CHUNKS, TREE_TILES[x.dtype])


def tree_partial(x: torch.Tensor, weight: torch.Tensor, n_chunks: int) -> torch.Tensor:
    """The float32 subtree a tensor-parallel rank owns: x (..., K_r) and its weight slice (N, K_r) holding
    `n_chunks` (1, 2 or 4; 8 is TP1) consecutive chunks of the full K. Same kernel and tiles as `linear_tree`, no
    bias, no cast, forward only. Returns (..., N) float32."""
    if n_chunks not in (1, 2, 4, 8):
        raise registry.StrictUnsupported(f"tree_partial: n_chunks = {n_chunks}, must be 1, 2, 4 or 8")
    _validate("tree_partial", x, weight, None, n_chunks)
    x2d = x.reshape(-1, x.shape[-1])
    out = _gemm(x2d, weight, None, n_chunks, TREE_TILES[x.dtype], torch.float32)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def tree_combine(partials: list[torch.Tensor], bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Finish the tree from the 1, 2, 4 or 8 rank subtrees in rank order (pairwise float32 adds, left to right
    within each level), add bias in float32, cast once: bit-equal to `linear_tree` on the full K."""
    level = list(partials)
    if len(level) not in (1, 2, 4, 8) or any(p.dtype != torch.float32 for p in level):
        raise registry.StrictUnsupported(
            f"tree_combine: {len(level)} partials of dtypes {sorted({str(p.dtype) for p in level})}; "
            "need 1, 2, 4 or 8 float32 partials"
        )
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    acc = level[0]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 torch reference of both ops (the math, not the order): float32 in, float32 out."""
    return torch.nn.functional.linear(
        x.float(), weight.float(), None if bias is None else bias.float()
    )


# ------------------------------------------------------------------------------------------------- registry
def _provenance(op: str, dtype: torch.dtype, weight: torch.Tensor, tree: bool) -> dict:
    split = splits(dtype, weight.shape[0], weight.shape[1])
    tile = TREE_TILES[dtype] if tree or split else LINEAR_TILES[dtype]
    return dict(_provenance_of(op, dtype, tree or split, tile, split))  # a copy: a caller may add keys


@functools.lru_cache(maxsize=256)
def _provenance_of(op: str, dtype: torch.dtype, tree: bool, tile: Tile, split: bool) -> dict:
    """The provenance dict of one (op, dtype, tree, tile, split): built once (the trace copies its fields)."""
    return {
        "kernel_id": f"h3kernels.gemm.{op}.{'tree8' if tree else 'kloop'}.{str(dtype).replace('torch.', '')}",
        "tile": tile.describe(split=split),
        "acc_dtype": "float32",
    }


def check_linear(x, weight, bias=None) -> dict:
    _validate("linear", x, weight, bias, 1)
    return _provenance("linear", x.dtype, weight, tree=False)


def check_linear_tree(x, weight, bias=None) -> dict:
    _validate("linear_tree", x, weight, bias, TREE_CHUNKS)
    return _provenance("linear_tree", x.dtype, weight, tree=True)


def _linear_checked(x, weight, bias=None) -> torch.Tensor:
    """`linear` on a call `check_linear` accepted (strict dispatch validates once)."""
    return _apply(x, weight, bias, 1, LINEAR_TILES[x.dtype])


def _linear_tree_checked(x, weight, bias=None) -> torch.Tensor:
    return _apply(x, weight, bias, TREE_CHUNKS, TREE_TILES[x.dtype])


registry.register("linear", run=linear, check=check_linear, run_checked=_linear_checked)
registry.register("linear_tree", run=linear_tree, check=check_linear_tree, run_checked=_linear_tree_checked)
