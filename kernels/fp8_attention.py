"""FP8 e4m3 attention forward for `--mode fast` (h3lab/execution/fast.py). NOT a strict kernel: it registers no op and promises
no bytes (the reduction order follows the launch geometry like any flash kernel; only its accuracy is a contract).

Contract
--------
`attention_fp8(q, k, v, key_order=None)`: q, k, v (B, S, H, D) bfloat16 on one device, unit stride on D (any other
strides: H3's projections' unflattened views are read in place), D in HEAD_DIMS; non-causal, unmasked attention with
scale 1/sqrt(D), the keys visited in `key_order` (S,) int64 when given (the packed rows' canonical order; it only
reorders the sum) -> out (B, S, H, D) bfloat16, contiguous, so `out.flatten(2, 3)` is a free view.
Arithmetic, per (batch, head):
  K, V    quantised by `quantize_blocks` in one pass each: per block of BLOCK_N key rows one float32 scale
          s = max(amax, AMAX_FLOOR) / 448 and e4m3 codes of x / s (`fp8_quant.scaled_code`: div_rn, round to
          nearest even; the same bytes as torch's cast of the same quotient). K codes (B*H, S_pad, D), V codes
          transposed (B*H, D, S_pad) (the PV product's B operand must be K-major for FP8 wgmma), S_pad a multiple of
          BLOCK_N, padding codes 0.
  Q       quantised inside the kernel, one scale per block of BLOCK_M query rows (same rule).
  S       tl.dot of the e4m3 codes, float32 accumulation, times s_q * s_k[block] / sqrt(D) * log2(e) (one float32
          scalar per key block); keys past S are -inf.
  softmax online in float32 with exp2 (row max, rescale of the running sum and accumulator by exp2(m_old - m_new)).
  P       exp2(S - m) * P_SCALE (256, exact: keeps P's small probabilities out of e4m3's subnormals) rounded to e4m3;
          the running sum l adds the unrounded P.
  PV      tl.dot(P codes, V codes) with float32 accumulation; V's per-block scale is folded into the rescale factor
          (the accumulator holds the sum over the scale of the latest block: one multiply per block, as softmax needs).
  out     acc * s_v[last] / (l * P_SCALE), rounded once to bfloat16.
Accuracy (the bound tests/kernels/test_fp8_attention.py checks against float32 SDPA on fresh random inputs, unit-RMS
q and k as the QK-norm makes them): relative L2 under 0.08; against `attention_fp8_reference` (the same block
quantisation of Q, K, V emulated in float32 torch, P unquantised) under 0.04.
Interpreter: Triton's CPU interpreter has no FP8 dot, so with TRITON_INTERPRET=1 (UPCAST) the codes are decoded to
float32 (`e4m3_decode`, exact) and multiplied in float32, and Q and P are rounded by `fp8_quant.e4m3_code` (round to
nearest even, as the GPU's cvt.rn); the values multiplied are the same e4m3 values the GPU's FP8 dot multiplies.
Refused (ValueError, one line naming the value and the rule): other dtypes, ranks, mismatched shapes or devices, a
head_dim outside HEAD_DIMS, a non-unit D stride, a key_order of the wrong dtype or length.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .fp8_quant import AMAX_FLOOR, FP8_MAX, e4m3_code, row_scale, scaled_code

HEAD_DIMS = (32, 64, 128)
P_SCALE = 256.0
LOG2E = 1.4426950408889634
# launch defaults for the H200 (the fastest of six in
# benchmarks/results/fp8_attention_sweep.json at 2,066 / 7,272 / 37,853 rows)
CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def e4m3_decode(c):
    """uint8 float8_e4m3fn code -> its float32 value (exact; the NaN code is not expected: inputs are clamped)."""
    c = c.to(tl.int32)
    neg = (c & 0x80) != 0
    e = (c >> 3) & 0xF
    m = c & 0x7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    return tl.where(neg, -value, value)


@triton.jit
def _quantize_blocks_kernel(x_ptr, c_ptr, s_ptr, S, S_pad, H, NBLK, stride_b, stride_s, stride_h,
                            D: tl.constexpr, BLOCK: tl.constexpr, TRANSPOSE: tl.constexpr,
                            FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    ok = rows[:, None] < S
    x = tl.load(x_ptr + b * stride_b + h * stride_h + rows[:, None].to(tl.int64) * stride_s + cols[None, :],
                mask=ok, other=0.0).to(tl.float32)
    scale = row_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0), FP8_MAX, AMAX_FLOOR)
    code = scaled_code(x, scale, FP8_MAX)  # masked rows are 0 -> code 0 (the padding)
    if TRANSPOSE:
        dst = c_ptr + bh * D * S_pad + cols[None, :].to(tl.int64) * S_pad + rows[:, None]
    else:
        dst = c_ptr + bh * S_pad * D + rows[:, None].to(tl.int64) * D + cols[None, :]
    tl.store(dst, code)
    tl.store(s_ptr + bh * NBLK + blk, scale)


@triton.jit
def _to_e4m3(x, UPCAST: tl.constexpr):
    """float32 x (|x| <= 448) rounded to e4m3: the FP8 operand on the GPU, its exact float32 value when UPCAST."""
    if UPCAST:
        return e4m3_decode(e4m3_code(x))
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _codes(c, UPCAST: tl.constexpr):
    if UPCAST:
        return e4m3_decode(c)
    else:
        return c


@triton.jit
def _attend_block(acc, l_i, m_i, vs_prev, q8, k_base, v_base, ks_base, vs_base, j, S, S_pad, qk_scale,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr,
                  P_SCALE: tl.constexpr):
    offs_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = _codes(tl.load(k_base + offs_n[:, None].to(tl.int64) * D + offs_d[None, :]), UPCAST)  # (BLOCK_N, D)
    s = tl.dot(q8, tl.trans(k)) * (tl.load(ks_base + j) * qk_scale)
    if MASK:
        s = tl.where(offs_n[None, :] < S, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    vs = tl.load(vs_base + j)
    vt = _codes(tl.load(v_base + offs_d[:, None].to(tl.int64) * S_pad + offs_n[None, :]), UPCAST)  # (D, BLOCK_N)
    acc = acc * (alpha * (vs_prev / vs))[:, None]
    acc = tl.dot(_to_e4m3(p * P_SCALE, UPCAST), tl.trans(vt), acc)
    return acc, l_i, m_new, vs


@triton.jit
def _attention_fp8_kernel(q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, o_ptr, S, S_pad, H, NBLK,
                          stride_qb, stride_qs, stride_qh, qk_scale,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                          P_SCALE: tl.constexpr, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    row_ok = offs_m[:, None] < S
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qs + offs_d[None, :],
                mask=row_ok, other=0.0).to(tl.float32)
    sq = row_scale(tl.max(tl.max(tl.abs(q), axis=1), axis=0), FP8_MAX, AMAX_FLOOR)
    q8 = _to_e4m3(tl.minimum(tl.maximum(q / sq, -FP8_MAX), FP8_MAX), UPCAST)
    qk_scale = qk_scale * sq
    k_base = k_ptr + bh * S_pad * D
    v_base = v_ptr + bh * D * S_pad
    ks_base = ks_ptr + bh * NBLK
    vs_base = vs_ptr + bh * NBLK
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    vs = tl.load(vs_base)
    n_full = S // BLOCK_N
    for j in range(0, n_full):
        acc, l_i, m_i, vs = _attend_block(acc, l_i, m_i, vs, q8, k_base, v_base, ks_base, vs_base, j, S, S_pad,
                                          qk_scale, D, BLOCK_N, False, UPCAST, P_SCALE)
    if n_full * BLOCK_N < S:
        acc, l_i, m_i, vs = _attend_block(acc, l_i, m_i, vs, q8, k_base, v_base, ks_base, vs_base, n_full, S, S_pad,
                                          qk_scale, D, BLOCK_N, True, UPCAST, P_SCALE)
    out = acc * (vs / (l_i * P_SCALE))[:, None]
    o_base = o_ptr + (b * S * H + h) * D  # out is (B, S, H, D) contiguous
    tl.store(o_base + offs_m[:, None].to(tl.int64) * (H * D) + offs_d[None, :], out.to(tl.bfloat16), mask=row_ok)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_order: torch.Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.bfloat16 or t.dim() != 4:
            raise ValueError(f"attention_fp8: {name} is {t.dtype} of rank {t.dim()}: must be bfloat16 (B, S, H, D)")
        if t.shape != q.shape or t.device != q.device:
            raise ValueError(f"attention_fp8: {name} has shape {list(t.shape)} on {t.device}: must match q's "
                             f"{list(q.shape)} on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"attention_fp8: {name} has stride {t.stride(-1)} on head_dim: must be 1")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"attention_fp8: head_dim {q.shape[-1]} is not supported: must be one of {HEAD_DIMS}")
    if q.shape[1] < 1:
        raise ValueError("attention_fp8: a sequence of 0 rows: must have at least one")
    if key_order is not None and (key_order.dtype != torch.int64 or tuple(key_order.shape) != (q.shape[1],)):
        raise ValueError(f"attention_fp8: key_order is {key_order.dtype} {list(key_order.shape)}: must be int64 of "
                         f"shape ({q.shape[1]},)")


def quantize_blocks(x: torch.Tensor, block: int, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, S, H, D) -> (codes float8_e4m3fn (B*H, S_pad, D), or (B*H, D, S_pad) when `transpose`; scales float32
    (B*H, ceil(S / block))), one scale per block of `block` rows of a head (see the module contract)."""
    B, S, H, D = x.shape
    nblk = triton.cdiv(S, block)
    s_pad = nblk * block
    shape = (B * H, D, s_pad) if transpose else (B * H, s_pad, D)
    codes = torch.empty(shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((B * H, nblk), dtype=torch.float32, device=x.device)
    _quantize_blocks_kernel[(nblk, B * H)](x, codes.view(torch.uint8), scales, S, s_pad, H, nblk, x.stride(0),
                                           x.stride(1), x.stride(2), D=D, BLOCK=block, TRANSPOSE=transpose,
                                           FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR, num_warps=4)
    return codes, scales


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_order: torch.Tensor | None = None,
                  config: dict | None = None) -> torch.Tensor:
    """(B, S, H, D) bfloat16 attention through e4m3 Q/K/P/V (see the module contract); `config` overrides CONFIG
    (BLOCK_M, BLOCK_N, num_warps, num_stages: the sweep's knobs)."""
    _check(q, k, v, key_order)
    cfg = {**CONFIG, **(config or {})}
    upcast = _interpreted()
    if upcast:  # the interpreter runs small tiles (same arithmetic per element)
        cfg = {**cfg, "BLOCK_M": min(cfg["BLOCK_M"], 32), "BLOCK_N": min(cfg["BLOCK_N"], 32)}
    if key_order is not None:
        k, v = k.index_select(1, key_order), v.index_select(1, key_order)
    B, S, H, D = q.shape
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    kc, ks = quantize_blocks(k, bn, transpose=False)
    vc, vs = quantize_blocks(v, bn, transpose=True)
    if upcast:
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    out = torch.empty((B, S, H, D), dtype=torch.bfloat16, device=q.device)
    grid = (triton.cdiv(S, bm), B * H)
    _attention_fp8_kernel[grid](q, kc, ks, vc, vs, out, S, kc.shape[1], H, ks.shape[1], q.stride(0), q.stride(1),
                                q.stride(2), LOG2E / math.sqrt(D),
                                D=D, BLOCK_M=bm, BLOCK_N=bn, UPCAST=upcast, P_SCALE=P_SCALE, FP8_MAX=FP8_MAX,
                                AMAX_FLOOR=AMAX_FLOOR, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def quantize_blocks_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 torch emulation of `quantize_blocks` (transpose=False): (codes (B*H, S_pad, D), scales)."""
    B, S, H, D = x.shape
    nblk = -(-S // block)
    t = torch.zeros(B, H, nblk * block, D, dtype=torch.float32, device=x.device)
    t[:, :, :S] = x.permute(0, 2, 1, 3).float()
    t = t.reshape(B * H, nblk, block, D)
    amax = torch.clamp(t.abs().amax(dim=(2, 3)), min=AMAX_FLOOR)
    scale = amax / torch.full_like(amax, FP8_MAX)
    codes = torch.clamp(t / scale[:, :, None, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(B * H, nblk * block, D), scale


def attention_fp8_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int, block_n: int,
                            key_order: torch.Tensor | None = None) -> torch.Tensor:
    """float32 SDPA on Q, K, V quantised per block exactly as the kernel does (P not quantised), bfloat16 out."""
    if key_order is not None:
        k, v = k.index_select(1, key_order), v.index_select(1, key_order)
    B, S, H, D = q.shape

    def dequant(x, block):
        c, s = quantize_blocks_reference(x, block)
        return (c.float().reshape(B * H, -1, block, D) * s[:, :, None, None]).reshape(B, H, -1, D)[:, :, :S]

    out = torch.nn.functional.scaled_dot_product_attention(dequant(q, block_m), dequant(k, block_n),
                                                           dequant(v, block_n))
    return out.permute(0, 2, 1, 3).to(torch.bfloat16).contiguous()
