"""Strict attention: the `attention` op, non-causal unmasked softmax(Q K^T / sqrt(D)) V over one packed document.

Contract
--------
Math      q, k, v (B, S, H, D) -> o (B, S, H, D); for each (b, h) and query row i,
          o[i] = sum_j softmax_j(q[i] . k[j] / sqrt(D)) v[j]. dtypes bfloat16 or float32 (all three the same).
Logits    s2[i, j] = fp32(q[i] . k[j]) * qk_scale with qk_scale = fp32(log2(e) / sqrt(D)): base-2 logits, so
          exp(x / sqrt(D)) is computed as exp2(s2): CUDA's exp2f (libdevice __nv_exp2f, max 2 ulp; Triton
          links libdevice in flush-to-zero mode, so it is one ex2.approx.ftz.f32, the same instruction as
          tl.exp2: the sweep's exp_triton / exp_ftz variants are byte-equal) on the GPU, numpy's exp2 in the
          interpreter; log2 likewise (__nv_log2f). The q . k dot has a float32 accumulator
          (tensor core for bf16, IEEE float32 for float32, never TF32); D is zero-padded to
          BLOCK_D = max(16, next power of two of D).
Order     flash-style online softmax with float32 (m, l, acc) per query row. Keys are visited in the fixed order
          t = 0, 1, ..., S-1 of `key_order` (default identity: packed order) in BLOCK_N tiles, never split
          (no split-KV, no atomics). Per tile: m' = max(m, rowmax(s2)); alpha = exp2(m - m');
          p = exp2(s2 - m'); l = l * alpha + rowsum(p); acc = acc * alpha + dot(p as the input dtype, v).
          Full tiles run unmasked; the one tail tile (S % BLOCK_N keys) gets s2 = -inf for its missing keys
          (p = 0 exactly; on a full tile the mask was the identity, so this split keeps the bytes). bf16 on CUDA
          in packed order reads K/V tiles through device-side TMA descriptors of each (b, h)'s (S, D) slab (rows
          past S read as zeros and are masked); a key_order, the interpreter, float32 or a stride/alignment TMA
          cannot take read them through pointers, the same values. Finally o = div_rn(acc, l) (IEEE division),
          one round-to-nearest-even cast to the input dtype; lse2 = m + log2(l) (float32, base 2) is saved.
Cast pts  p (and dS in the backward) are cast to the input dtype right before each tensor-core dot (float32 stays
          float32); o, dq, dk, dv are cast once at the end.
FMA       The bf16 forward is compiled with enable_fp_fusion=True (`FORWARD`): the compiler contracts its
          multiply-adds -- s2 - m' with s2 = dot * qk_scale, l * alpha + rowsum(p) -- into fused multiply-adds,
          one rounding each instead of two (IEEE fusedMultiplyAdd; no reassociation, no approximation). It is
          deterministic and the same instruction stream for every row, so every invariance below holds; it does
          tie the GPU bytes to the compiler's contraction choices as well as to its dot and exp code (a Triton
          upgrade may change them; the interpreter has no contraction). It is on for the longest clips' sake:
          4.2 % faster at 109,205 rows, where it equals torch's SDPA
          (`benchmarks/results/attention_fp_fusion_109k.json`), 0.6 % at 37,853. The backward and the float32
          forward keep enable_fp_fusion=False (no mul+add contraction outside dot).
Tiles     fixed per dtype (`TILES`), never from S, B or the device:
            bf16  forward 128 queries x BLOCK_N 128 keys (8 warps, 3 stages); backward dK/dV 128 keys x 32-query
                  steps, dQ 128 queries x 32-key steps (8 warps, 3 stages)
            fp32  forward 64 x 32 (4 warps, 2 stages); backward dK/dV 64 x 32, dQ 64 x 32 (4 warps, 2 stages)
          BLOCK_N (forward), the dQ key step and the dK/dV query step fix the reduction orders; the other block
          sizes only group independent rows. Tiles chosen on the H200 by `benchmark_attention.py --sweep-tiles`;
          the forward's loop (`FORWARD`: split tail, unmasked D, TMA) by `--sweep`, which times byte-keeping and
          byte-changing variants against cuDNN (`benchmarks/results/attention_sweep.json`: at 37,853 rows TMA
          takes the forward from 91.3 to 72.6 ms, byte-equal; a pre-scaled q, a reciprocal or BLOCK_N 64 change
          bytes and gain little or lose, so none is adopted; fused multiply-add is, see FMA).
Backward  deterministic flash backward, no atomics: delta[i] = rowsum(fp32(o[i]) * fp32(do[i]));
          dK/dV: one program per (key block, b, h) loops over all query rows in `key_order` order in fixed tiles:
          p^T = exp2(s2^T - lse2), dv += dot(p^T, do), ds^T = p^T * (dot(v, do^T) - delta), dk += dot(ds^T, q);
          dQ: one program per (query block, b, h) loops over the keys in `key_order` order in fixed tiles:
          dq += dot(ds, k). dk, dq are multiplied by 1/sqrt(D) (float32) once at the end.
Invariance A query row's output depends only on that row, and on all K/V rows in visiting order: batch size, batch
          position, other batch items and other query rows never change its bytes. dK/dV/dQ are per (b, h), so
          other batch items never change them either. Two runs are bit-identical.
Permutation If packed rows are permuted consistently (q, k, v by the same p), outputs are the permuted outputs *only*
          if keys are still visited in canonical order: pass key_order = the permuted positions of the canonical
          rows (argsort of p). Then attention(q[:, p], k[:, p], v[:, p], key_order)[:, argsort(p)] equals
          attention(q, k, v) bit for bit, and so do the gradients. The op-table signature has no key_order, so
          the runtime visits packed order unless it calls `attention` here with the layout's canonical order.
Layout    any strides for q, k, v (and the incoming gradient): a (B, S, H, D) view of a larger buffer is read in
          place (last-dim stride 1 is the fast path). Outputs are contiguous (B, S, H, D).
Interpreter (CPU, TRITON_INTERPRET=1): bf16 tiles are widened to float32 before each dot (exact) and bf16 casts are
          rounded to nearest even by bit arithmetic (the interpreter truncates); tile loop, visiting order and cast
          points are the GPU's; the order inside one dot is numpy's, so CPU bytes are not promised equal to GPU's.
Refused   not 4-D, shapes differ, dtypes other than bf16/fp32 or mixed, mixed devices, empty (any dim 0), D > 128,
          B*H > 65535 (grid limit), CPU without the interpreter, key_order not an int64 (S,) permutation (checked
          on the host once per key_order tensor, cached while it is unchanged: `_index_cache.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from . import registry
from ._index_cache import IndexCache
from ._offsets import tile_offsets
from .gemm import cast_rne, mma

MAX_HEAD_DIM = 128
_MAX_GRID_Y = 65535
_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttentionTiles:
    """Fixed launch config of one dtype; `describe()` is the provenance string recorded in the trace."""

    fwd_m: int  # query rows per forward program
    fwd_n: int  # keys per forward step (fixes the softmax order)
    fwd_warps: int
    fwd_stages: int
    dkdv_n: int  # keys per dK/dV program
    dkdv_m: int  # query rows per dK/dV step (fixes the dK/dV order)
    dq_m: int  # query rows per dQ program
    dq_n: int  # keys per dQ step (fixes the dQ order)
    bwd_warps: int
    bwd_stages: int

    def describe(self) -> str:
        return (
            f"fwd BM{self.fwd_m}xBN{self.fwd_n}-w{self.fwd_warps}s{self.fwd_stages}; "
            f"dkdv BN{self.dkdv_n}xBM{self.dkdv_m}; dq BM{self.dq_m}xBN{self.dq_n}-w{self.bwd_warps}s{self.bwd_stages}"
        )


TILES = {
    torch.bfloat16: AttentionTiles(128, 128, 8, 3, 128, 32, 128, 32, 8, 3),
    torch.float32: AttentionTiles(64, 32, 4, 2, 64, 32, 64, 32, 4, 2),
}


@dataclass(frozen=True)
class ForwardVariant:
    """How the forward kernel runs its key loop (`benchmarks/benchmark_attention.py --sweep` times the others).
    Byte-keeping knobs (the per-row order over keys and every rounding unchanged): `split_tail` (full BLOCK_N tiles
    unmasked, then one masked tail tile), `even_d` (no D mask when D == BLOCK_D), `tma` (K/V tiles through
    device-side TMA descriptors; CUDA, packed order, last-dim stride 1 only), `loop_stages` / `warp_specialize`
    (`tl.range` pipelining of the full-tile loop). Byte-changing knobs: `fp_fusion` (FMA contraction: part of the bf16
    contract, see the module's FMA paragraph); exploration only: `exp` "triton"/"ftz",
    `prescale_q`, `reciprocal`."""

    split_tail: bool = False
    even_d: bool = False
    tma: bool = False
    loop_stages: int | None = None
    warp_specialize: bool = False
    lookahead: bool = False
    exp: str = "libdevice"
    prescale_q: bool = False
    reciprocal: bool = False
    fp_fusion: bool = False

    def __post_init__(self) -> None:
        if self.lookahead and not self.split_tail:
            raise ValueError("ForwardVariant(lookahead=True) needs split_tail=True: the lookahead loop runs over the "
                             "full tiles before the masked tail (without it the kernel would run the plain loop)")

    def describe(self) -> str:
        parts = [name for name in ("split_tail", "even_d", "tma", "warp_specialize", "lookahead", "prescale_q",
                                   "reciprocal", "fp_fusion") if getattr(self, name)]
        if self.loop_stages is not None:
            parts.append(f"loop_stages{self.loop_stages}")
        if self.exp != "libdevice":
            parts.append(f"exp_{self.exp}")
        return "+".join(parts) or "baseline"


FORWARD = {torch.bfloat16: ForwardVariant(split_tail=True, even_d=True, tma=True, fp_fusion=True),
           torch.float32: ForwardVariant()}
PREPROCESS_BLOCK_M = 64


# ------------------------------------------------------------------------------------------------- kernels
@triton.jit
def _exp2(x, INTERPRETED: tl.constexpr):
    """2**x: CUDA's exp2f (libdevice __nv_exp2f) on the GPU, numpy's exp2 in the interpreter."""
    if INTERPRETED:
        return tl.exp2(x)
    else:
        return libdevice.exp2(x)


@triton.jit
def _log2(x, INTERPRETED: tl.constexpr):
    """log2(x): CUDA's log2f (libdevice __nv_log2f) on the GPU, numpy's log2 in the interpreter."""
    if INTERPRETED:
        return tl.log2(x)
    else:
        return libdevice.log2(x)


@triton.jit
def _visit_rows(order_ptr, t, S, HAS_ORDER: tl.constexpr):
    """Packed row of visiting positions t (clamped to row 0 past the end; those lanes are zeroed by the caller)."""
    valid = t < S
    if HAS_ORDER:
        rows = tl.load(order_ptr + t, mask=valid, other=0)
    else:
        rows = tl.where(valid, t, 0)
    return rows.to(tl.int64), valid


@triton.jit
def _exp2_fwd(x, EXP: tl.constexpr, INTERPRETED: tl.constexpr):
    """2**x in the forward: EXP "libdevice" (the contract: CUDA's exp2f), "triton" (Triton's own math.exp2
    lowering) or "ftz" (ex2.approx.ftz.f32: subnormal results flushed to zero). Exploration knobs of the sweep;
    the interpreter always uses numpy's exp2."""
    if INTERPRETED:
        return tl.exp2(x)
    elif EXP == "ftz":
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    elif EXP == "triton":
        return tl.exp2(x)
    else:
        return libdevice.exp2(x)


@triton.jit
def _fwd_step(q, kT, v, acc, l_i, m_i, kv_ok, scale, MASKED: tl.constexpr, EXP: tl.constexpr,
              INTERPRETED: tl.constexpr):
    """One BLOCK_N tile of the online softmax (the contract's per-tile update); MASKED sets s2 = -inf where not
    kv_ok (only the tail tile needs it: on a full tile the select is the identity)."""
    s2 = _fwd_scores(q, kT, scale, INTERPRETED)
    return _fwd_update(s2, v, acc, l_i, m_i, kv_ok, MASKED, EXP, INTERPRETED)


@triton.jit
def _fwd_scores(q, kT, scale, INTERPRETED: tl.constexpr):
    """s2 = fp32(q . k) * qk_scale for one BLOCK_N tile (the contract's base-2 logits)."""
    return mma(q, kT, tl.zeros((q.shape[0], kT.shape[1]), dtype=tl.float32), "ieee", INTERPRETED) * scale


@triton.jit
def _fwd_update(s2, v, acc, l_i, m_i, kv_ok, MASKED: tl.constexpr, EXP: tl.constexpr, INTERPRETED: tl.constexpr):
    """The online-softmax update of one tile from its logits s2 (`_fwd_step` after the scores)."""
    if MASKED:
        s2 = tl.where(kv_ok[None, :], s2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s2, axis=1))
    alpha = _exp2_fwd(m_i - m_new, EXP, INTERPRETED)
    p = _exp2_fwd(s2 - m_new[:, None], EXP, INTERPRETED)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = mma(cast_rne(p, v.dtype, INTERPRETED), v, acc, "ieee", INTERPRETED)
    return acc, l_i, m_new


@triton.jit
def _fwd_kv(k_base, v_base, kd, vd, order_ptr, n0, offs_n, offs_d, d_ok, S, sks, skd, svs, svd,
            HAS_ORDER: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """(kT (D, N), v (N, D), kv_ok (N,)) of the keys at visiting positions n0 + offs_n. TMA: through the (S, D)
    descriptors of this (b, h) (rows past S read as zeros); else pointers, rows past S clamped to row 0."""
    if TMA:
        kT = tl.trans(kd.load([n0, 0]))
        v = vd.load([n0, 0])
        kv_ok = (n0 + offs_n) < S
    else:
        if MASKED:
            kv_rows, kv_ok = _visit_rows(order_ptr, n0 + offs_n, S, HAS_ORDER)
        else:
            kv_ok = (n0 + offs_n) < S
            if HAS_ORDER:
                kv_rows = tl.load(order_ptr + n0 + offs_n).to(tl.int64)
            else:
                kv_rows = (n0 + offs_n).to(tl.int64)
        k_ptrs = k_base + kv_rows[None, :] * sks + offs_d[:, None] * skd
        v_ptrs = v_base + kv_rows[:, None] * svs + offs_d[None, :] * svd
        if EVEN_D:
            kT = tl.load(k_ptrs)  # (D, N)
            v = tl.load(v_ptrs)  # (N, D)
        else:
            kT = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    return kT, v, kv_ok


@triton.jit(do_not_specialize=["S"])
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, order_ptr,
    S, H, D, qk_scale,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sob, sos, soh, sod,
    HAS_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr, EVEN_D: tl.constexpr, SPLIT_TAIL: tl.constexpr, TMA: tl.constexpr,
    LOOP_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EXP: tl.constexpr, PRESCALE_Q: tl.constexpr,
    RECIPROCAL: tl.constexpr, LOOKAHEAD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rows = (offs_m % S).to(tl.int64)  # past-the-end query rows wrap onto valid ones and are never stored
    q_base = q_ptr + b * sqb + h * sqh
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh

    q = tl.load(q_base + rows[:, None] * sqs + offs_d[None, :] * sqd, mask=d_ok[None, :], other=0.0)  # (M, D)
    scale = qk_scale
    if PRESCALE_Q:  # exploration only (changes bytes): q * qk_scale rounded to the input dtype once
        q = (q.to(tl.float32) * qk_scale).to(q.dtype)
        scale = 1.0
    kd = k_base
    vd = v_base
    if TMA:
        kd = tl.make_tensor_descriptor(k_base, shape=[S, D], strides=[sks, 1], block_shape=[BLOCK_N, BLOCK_D])
        vd = tl.make_tensor_descriptor(v_base, shape=[S, D], strides=[svs, 1], block_shape=[BLOCK_N, BLOCK_D])
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    n_full = 0
    if SPLIT_TAIL:
        n_full = (S // BLOCK_N) * BLOCK_N
    if LOOKAHEAD:  # byte-keeping: tile j+1's scores are computed before tile j's update (same ops, same order)
        if n_full > 0:
            kT, v_next, kv_ok = _fwd_kv(k_base, v_base, kd, vd, order_ptr, 0, offs_n, offs_d, d_ok, S, sks, skd,
                                        svs, svd, HAS_ORDER, TMA, False, EVEN_D)
            s_next = _fwd_scores(q, kT, scale, INTERPRETED)
            for n0 in tl.range(BLOCK_N, n_full, BLOCK_N, num_stages=LOOP_STAGES):
                s2 = s_next
                v = v_next
                kT, v_next, kv_ok = _fwd_kv(k_base, v_base, kd, vd, order_ptr, n0, offs_n, offs_d, d_ok, S, sks,
                                            skd, svs, svd, HAS_ORDER, TMA, False, EVEN_D)
                s_next = _fwd_scores(q, kT, scale, INTERPRETED)
                acc, l_i, m_i = _fwd_update(s2, v, acc, l_i, m_i, kv_ok, False, EXP, INTERPRETED)
            acc, l_i, m_i = _fwd_update(s_next, v_next, acc, l_i, m_i, kv_ok, False, EXP, INTERPRETED)
    else:
        for n0 in tl.range(0, n_full, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=WARP_SPECIALIZE):
            kT, v, kv_ok = _fwd_kv(k_base, v_base, kd, vd, order_ptr, n0, offs_n, offs_d, d_ok, S, sks, skd, svs,
                                   svd, HAS_ORDER, TMA, False, EVEN_D)
            acc, l_i, m_i = _fwd_step(q, kT, v, acc, l_i, m_i, kv_ok, scale, False, EXP, INTERPRETED)
    for n0 in range(n_full, S, BLOCK_N):  # SPLIT_TAIL: the one masked tail tile (if S % BLOCK_N); else every tile
        kT, v, kv_ok = _fwd_kv(k_base, v_base, kd, vd, order_ptr, n0, offs_n, offs_d, d_ok, S, sks, skd, svs, svd,
                               HAS_ORDER, TMA, True, EVEN_D)
        acc, l_i, m_i = _fwd_step(q, kT, v, acc, l_i, m_i, kv_ok, scale, True, EXP, INTERPRETED)

    if RECIPROCAL:  # exploration only (changes bytes): acc * (1 / l)
        out = acc * (1.0 / l_i)[:, None]
    else:
        out = tl.math.div_rn(acc, l_i[:, None])
    row_ok = offs_m < S
    o_ptrs = o_ptr + b * sob + h * soh + tile_offsets(offs_m, sos, offs_d, sod)
    tl.store(o_ptrs, cast_rne(out, o_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + bh.to(tl.int64) * S + offs_m, m_i + _log2(l_i, INTERPRETED), mask=row_ok)


@triton.jit(do_not_specialize=["S"])
def _attn_bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr, S, H, D,
    sob, sos, soh, sod, sdb, sds, sdh, sdd,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta[b, h, i] = sum_d fp32(o) * fp32(do) (tl.sum over the padded D axis)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < S) & (offs_d[None, :] < D)
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(o_ptr + b * sob + h * soh + rows * sos + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(do_ptr + b * sdb + h * sdh + rows * sds + offs_d[None, :] * sdd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + bh.to(tl.int64) * S + offs_m, delta, mask=offs_m < S)


@triton.jit(do_not_specialize=["S"])
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, order_ptr,
    S, H, D, qk_scale, sm_scale,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd,
    sgb, sgs, sgh, sgd,  # dk and dv share one contiguous layout
    HAS_ORDER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rows = (offs_n % S).to(tl.int64)  # this program's keys; past-the-end rows wrap and are never stored
    k = tl.load(k_ptr + b * skb + h * skh + rows[:, None] * sks + offs_d[None, :] * skd, mask=d_ok[None, :], other=0.0)
    v = tl.load(v_ptr + b * svb + h * svh + rows[:, None] * svs + offs_d[None, :] * svd, mask=d_ok[None, :], other=0.0)
    q_base = q_ptr + b * sqb + h * sqh
    do_base = do_ptr + b * sdb + h * sdh
    stat_base = bh.to(tl.int64) * S

    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for m0 in range(0, S, BLOCK_M):
        q_rows, q_ok = _visit_rows(order_ptr, m0 + offs_m, S, HAS_ORDER)
        qT = tl.load(q_base + q_rows[None, :] * sqs + offs_d[:, None] * sqd, mask=d_ok[:, None], other=0.0)  # (D, M)
        do = tl.load(do_base + q_rows[:, None] * sds + offs_d[None, :] * sdd, mask=d_ok[None, :], other=0.0)  # (M, D)
        lse = tl.load(lse_ptr + stat_base + q_rows)
        delta = tl.load(delta_ptr + stat_base + q_rows)
        s2T = mma(k, qT, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), "ieee", INTERPRETED) * qk_scale
        pT = tl.where(q_ok[None, :], _exp2(s2T - lse[None, :], INTERPRETED), 0.0)  # (N, M)
        dv = mma(cast_rne(pT, do.dtype, INTERPRETED), do, dv, "ieee", INTERPRETED)
        dpT = mma(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32), "ieee", INTERPRETED)
        dsT = pT * (dpT - delta[None, :])
        dk = mma(cast_rne(dsT, qT.dtype, INTERPRETED), tl.trans(qT), dk, "ieee", INTERPRETED)

    dk = dk * sm_scale
    out = b * sgb + h * sgh + tile_offsets(offs_n, sgs, offs_d, sgd)
    mask = (offs_n[:, None] < S) & d_ok[None, :]
    tl.store(dk_ptr + out, cast_rne(dk, dk_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    tl.store(dv_ptr + out, cast_rne(dv, dv_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit(do_not_specialize=["S"])
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, order_ptr,
    S, H, D, qk_scale, sm_scale,
    sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, sdb, sds, sdh, sdd,
    sgb, sgs, sgh, sgd,
    HAS_ORDER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rows = (offs_m % S).to(tl.int64)  # this program's queries; past-the-end rows wrap and are never stored
    q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :] * sqd, mask=d_ok[None, :], other=0.0)
    do = tl.load(do_ptr + b * sdb + h * sdh + rows[:, None] * sds + offs_d[None, :] * sdd, mask=d_ok[None, :],
                 other=0.0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * S + rows)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * S + rows)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh

    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for n0 in range(0, S, BLOCK_N):
        kv_rows, kv_ok = _visit_rows(order_ptr, n0 + offs_n, S, HAS_ORDER)
        kT = tl.load(k_base + kv_rows[None, :] * sks + offs_d[:, None] * skd, mask=d_ok[:, None], other=0.0)  # (D, N)
        vT = tl.load(v_base + kv_rows[None, :] * svs + offs_d[:, None] * svd, mask=d_ok[:, None], other=0.0)  # (D, N)
        s2 = mma(q, kT, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), "ieee", INTERPRETED) * qk_scale
        p = tl.where(kv_ok[None, :], _exp2(s2 - lse[:, None], INTERPRETED), 0.0)  # (M, N)
        dp = mma(do, vT, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), "ieee", INTERPRETED)
        ds = p * (dp - delta[:, None])
        dq = mma(cast_rne(ds, kT.dtype, INTERPRETED), tl.trans(kT), dq, "ieee", INTERPRETED)

    dq = dq * sm_scale
    out = dq_ptr + b * sgb + h * sgh + tile_offsets(offs_m, sgs, offs_d, sgd)
    tl.store(out, cast_rne(dq, dq_ptr.dtype.element_ty, INTERPRETED), mask=(offs_m[:, None] < S) & d_ok[None, :])


# ------------------------------------------------------------------------------------------------ launchers
def _block_d(D: int) -> int:
    return max(16, triton.next_power_of_2(D))


def _scales(D: int) -> tuple[float, float]:
    """(qk_scale, sm_scale): log2(e)/sqrt(D) and 1/sqrt(D), rounded to float32 when passed to the kernel."""
    sm_scale = 1.0 / math.sqrt(D)
    return sm_scale * math.log2(math.e), sm_scale


def _tma_ok(t: torch.Tensor) -> bool:
    """K/V can be read through a (S, D) TMA descriptor per (b, h): last-dim stride 1, 16-byte aligned rows and base."""
    size = t.element_size()
    return (t.stride(3) == 1 and (t.stride(1) * size) % 16 == 0 and (t.stride(0) * size) % 16 == 0
            and (t.stride(2) * size) % 16 == 0 and t.data_ptr() % 16 == 0)


def _tma_scratch(size: int, alignment: int, stream):
    """Global scratch for device-side tensor descriptors (triton.set_allocator)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _forward(q, k, v, order, variant: ForwardVariant | None = None, tiles: AttentionTiles | None = None):
    """(o, lse2) of the forward kernel; `variant` / `tiles` default to the contract's (FORWARD, TILES); others are
    for the sweep only. No checks."""
    B, S, H, D = q.shape
    tiles = TILES[q.dtype] if tiles is None else tiles
    variant = FORWARD[q.dtype] if variant is None else variant
    interpreted = q.device.type == "cpu"
    block_d = _block_d(D)
    tma = variant.tma and not interpreted and order is None and _tma_ok(k) and _tma_ok(v)
    if tma:
        triton.set_allocator(_tma_scratch)
    o = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    qk_scale, _ = _scales(D)
    grid = (triton.cdiv(S, tiles.fwd_m), B * H)
    _attn_fwd_kernel[grid](
        q, k, v, o, lse, order if order is not None else lse,
        S, H, D, qk_scale,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        HAS_ORDER=order is not None, BLOCK_M=tiles.fwd_m, BLOCK_N=tiles.fwd_n, BLOCK_D=block_d,
        INTERPRETED=interpreted, EVEN_D=variant.even_d and D == block_d, SPLIT_TAIL=variant.split_tail,
        TMA=tma, LOOP_STAGES=variant.loop_stages, WARP_SPECIALIZE=variant.warp_specialize, EXP=variant.exp,
        PRESCALE_Q=variant.prescale_q, RECIPROCAL=variant.reciprocal, LOOKAHEAD=variant.lookahead,
        num_warps=tiles.fwd_warps, num_stages=tiles.fwd_stages, enable_fp_fusion=variant.fp_fusion,
    )
    return o, lse


def _backward(q, k, v, o, lse, do, order):
    B, S, H, D = q.shape
    tiles = TILES[q.dtype]
    block_d = _block_d(D)
    interpreted = q.device.type == "cpu"
    qk_scale, sm_scale = _scales(D)
    delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    _attn_bwd_preprocess_kernel[(triton.cdiv(S, PREPROCESS_BLOCK_M), B * H)](
        o, do, delta, S, H, D, *o.stride(), *do.stride(),
        BLOCK_M=PREPROCESS_BLOCK_M, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False,
    )
    dq = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    order_arg = order if order is not None else delta
    common = dict(HAS_ORDER=order is not None, BLOCK_D=block_d, INTERPRETED=interpreted,
                  num_warps=tiles.bwd_warps, num_stages=tiles.bwd_stages, enable_fp_fusion=False)
    _attn_bwd_dkdv_kernel[(triton.cdiv(S, tiles.dkdv_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, order_arg, S, H, D, qk_scale, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(),
        BLOCK_N=tiles.dkdv_n, BLOCK_M=tiles.dkdv_m, **common,
    )
    _attn_bwd_dq_kernel[(triton.cdiv(S, tiles.dq_m), B * H)](
        q, k, v, do, lse, delta, dq, order_arg, S, H, D, qk_scale, sm_scale,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        BLOCK_M=tiles.dq_m, BLOCK_N=tiles.dq_n, **common,
    )
    return dq, dk, dv


def _validate(q, k, v, key_order=None) -> None:
    """Raise StrictUnsupported (one line: value and rule) for any call the kernel does not serve."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise registry.StrictUnsupported(f"attention: {name} is {type(t).__name__}, must be a torch.Tensor")
    registry.check_device(q, k, v, key_order if isinstance(key_order, torch.Tensor) else None, op="attention")
    if q.dim() != 4:
        raise registry.StrictUnsupported(f"attention: q has shape {tuple(q.shape)}, must be 4-D (B, S, H, D)")
    if k.shape != q.shape or v.shape != q.shape:
        raise registry.StrictUnsupported(
            f"attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be equal (B, S, H, D)"
        )
    if q.dtype not in _DTYPES:
        raise registry.StrictUnsupported(f"attention: dtype {q.dtype} is not supported (bfloat16 or float32)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise registry.StrictUnsupported(f"attention: mixed dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}")
    B, S, H, D = q.shape
    if q.numel() == 0:
        raise registry.StrictUnsupported(f"attention: empty input {tuple(q.shape)}; strict refuses empty tensors")
    if D > MAX_HEAD_DIM:
        raise registry.StrictUnsupported(f"attention: head_dim {D} exceeds the limit {MAX_HEAD_DIM}")
    if B * H > _MAX_GRID_Y:
        raise registry.StrictUnsupported(f"attention: B*H = {B * H} exceeds the grid limit {_MAX_GRID_Y}")
    if key_order is not None:
        if not isinstance(key_order, torch.Tensor) or key_order.dtype != torch.int64 or tuple(key_order.shape) != (S,):
            if isinstance(key_order, torch.Tensor):
                desc = f"{key_order.dtype} {tuple(key_order.shape)}"
            else:
                desc = type(key_order).__name__
            raise registry.StrictUnsupported(f"attention: key_order is {desc}, must be an int64 tensor of shape ({S},)")
        _PERMUTATIONS.get((key_order,), ("permutation", S), lambda: _check_permutation(key_order, S))


_PERMUTATIONS = IndexCache()  # key_order tensors checked once (a host sync), not once per block and call


def _check_permutation(key_order: torch.Tensor, S: int) -> dict:
    if not torch.equal(torch.sort(key_order).values, torch.arange(S, device=key_order.device)):
        raise registry.StrictUnsupported(f"attention: key_order is not a permutation of 0..{S - 1}")
    return {}


# ------------------------------------------------------------------------------------------------- autograd
class _AttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, order):
        o, lse = _forward(q, k, v, order)
        ctx.save_for_backward(q, k, v, o, lse, order)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, order = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, o, lse, do.to(q.dtype), order)
        return dq, dk, dv, None


# ----------------------------------------------------------------------------------------------- public ops
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_order: torch.Tensor | None = None) -> torch.Tensor:
    """Strict `attention`: (B, S, H, D) x3 -> (B, S, H, D), autograd-aware. `key_order` (S,) int64: the order in
    which packed rows are visited as keys (and as queries in dK/dV); default packed order."""
    _validate(q, k, v, key_order)
    order = None if key_order is None else key_order.contiguous()
    return _AttentionFn.apply(q, k, v, order)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 torch reference (the math, not the order): softmax(q k^T / sqrt(D)) v, float32 in and out."""
    q, k, v = (t.float().permute(0, 2, 1, 3) for t in (q, k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(scores, dim=-1), v).permute(0, 2, 1, 3)


# ------------------------------------------------------------------------------------------------- registry
def check(q, k, v, key_order=None) -> dict:
    _validate(q, k, v, key_order)
    order = "packed" if key_order is None else "canonical"
    return {
        "kernel_id": f"h3kernels.attention.flash_fixed_kv.{str(q.dtype).replace('torch.', '')}.keys_{order}",
        "tile": TILES[q.dtype].describe(),
        "forward": FORWARD[q.dtype].describe(),  # the loop and, on CUDA, the FMA contraction (module docstring)
        "acc_dtype": "float32",
    }


registry.register("attention", run=attention, check=check)
