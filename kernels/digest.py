"""Device checksum of a tensor's bytes: the two mod-p lanes of h3lab's `device-v1` hash scheme, in one Triton pass.

Not a transformer operator (nothing registers it in the op table): it is the capture primitive of sealed
trajectories and first-drift localisation (`h3lab.run.trajectory.device_lanes`), which hash every operator boundary and
the weights on the accelerator, so only 16 bytes per tensor ever reach the host.

Contract
--------
math        the tensor's bytes are read as unsigned 16-bit words w_i, i = 0 .. n-1 (an odd byte count is padded with
            one zero byte by the caller). For lane k in {0, 1}:
                L_k = sum_i (w_i * c_k(i) mod p) mod p,   p = 2^31 - 1,
                c_k(i) = low 31 bits of splitmix64(i + seed_k) in int64 wrap-around arithmetic
            (x += seed; x *= M1; x ^= x >> 30; x *= M2; x ^= x >> 27; x *= M3; x ^= x >> 31; arithmetic shifts).
            Every quantity is an exact integer, so the lanes do not depend on any summation order: this kernel
            returns exactly what the torch formulation (`reference_lanes`) returns, on any launch geometry.
reduction   per program: ITERS tiles of BLOCK words, each term reduced mod p with Mersenne folds (exact: the fold
            (x & p) + (x >> 31) preserves x mod p, a final conditional subtract lands in [0, p)); each lane's
            (BLOCK,) int64 accumulator holds < ITERS * 2^31 per slot and its `tl.sum` < BLOCK * ITERS * 2^31 < 2^63.
            The per-program partials (int64, one row per program) are folded mod p and summed on the device by torch
            (< 2^31 partials each < 2^31: no overflow), then reduced mod p.
tiles       BLOCK = 1024 words, ITERS = 16 (16 Ki words, 32 KiB, per program), num_warps = 4.
refused     tensors that are not 1-D int16 word views; other devices than CUDA or the interpreter (the caller falls
            back to `reference_lanes` on a plain CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h3kernels import registry

P = (1 << 31) - 1
LANE_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344)
# splitmix64 multipliers as signed int64 (int64 multiplication wraps modulo 2^64).
M1 = 0x9E3779B97F4A7C15 - (1 << 64)
M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
M3 = 0x94D049BB133111EB - (1 << 64)
BLOCK = 1024
ITERS = 16
REFERENCE_CHUNK = 1 << 22  # words per step of the torch formulation (bounds its int64 temporaries)


def _seed_offset(lane: int) -> int:
    return LANE_SEEDS[lane] & ((1 << 62) - 1)


@triton.jit
def _fold(x):
    """x mod p for 0 <= x < 2^62, p = 2^31 - 1 (two Mersenne folds, one conditional subtract)."""
    x = (x & 0x7FFFFFFF) + (x >> 31)
    x = (x & 0x7FFFFFFF) + (x >> 31)
    return tl.where(x >= 0x7FFFFFFF, x - 0x7FFFFFFF, x)


@triton.jit
def _coefficient(i, seed, m1, m2, m3):
    x = (i + seed) * m1
    x = x ^ (x >> 30)
    x = x * m2
    x = x ^ (x >> 27)
    x = x * m3
    x = x ^ (x >> 31)
    return x & 0x7FFFFFFF


@triton.jit
def _lanes_kernel(words_ptr, part_ptr, n, seed0, seed1, m1, m2, m3, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc0 = tl.zeros([BLOCK], dtype=tl.int64)
    acc1 = tl.zeros([BLOCK], dtype=tl.int64)
    for it in range(ITERS):  # constexpr trip count
        i = (pid * ITERS + it) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        w = tl.load(words_ptr + i, mask=i < n, other=0).to(tl.int64) & 0xFFFF  # unsigned 16-bit word, 0 past n
        acc0 += _fold(w * _coefficient(i, seed0, m1, m2, m3))
        acc1 += _fold(w * _coefficient(i, seed1, m1, m2, m3))
    tl.store(part_ptr + pid * 2, tl.sum(acc0, axis=0))
    tl.store(part_ptr + pid * 2 + 1, tl.sum(acc1, axis=0))


def lanes(words: torch.Tensor) -> tuple[int, int]:
    """(L_0, L_1) of the 1-D int16 word view `words` (see the module contract); one device -> host transfer."""
    if not isinstance(words, torch.Tensor) or words.dtype != torch.int16 or words.dim() != 1:
        raise ValueError(f"digest.lanes: words must be a 1-D int16 tensor, got {getattr(words, 'dtype', type(words))}")
    registry.check_device(words, op="digest.lanes")
    n = words.numel()
    if n == 0:
        return (0, 0)
    words = words.contiguous()
    programs = triton.cdiv(n, BLOCK * ITERS)
    part = torch.empty((programs, 2), dtype=torch.int64, device=words.device)
    _lanes_kernel[(programs,)](
        words, part, n, _seed_offset(0), _seed_offset(1), M1, M2, M3, BLOCK=BLOCK, ITERS=ITERS, num_warps=4
    )
    total = (part % P).sum(0) % P  # < 2^31 partials, each < 2^31: exact in int64
    return tuple(int(v) for v in total.cpu().tolist())


# ------------------------------------------------------------------------------------------------ reference
def _reference_coefficients(index: torch.Tensor, lane: int) -> torch.Tensor:
    x = index + _seed_offset(lane)
    x = x * M1
    x = x ^ (x >> 30)
    x = x * M2
    x = x ^ (x >> 27)
    x = x * M3
    x = x ^ (x >> 31)
    return x & P


def reference_lanes(words: torch.Tensor) -> tuple[int, int]:
    """The same lanes with plain torch integer ops (any device; the CPU path of `device_lanes`)."""
    lanes_ = [torch.zeros((), dtype=torch.int64, device=words.device) for _ in LANE_SEEDS]
    for start in range(0, words.numel(), REFERENCE_CHUNK):
        w = words[start : start + REFERENCE_CHUNK].to(torch.int64) & 0xFFFF
        index = torch.arange(start, start + w.numel(), dtype=torch.int64, device=words.device)
        for k in range(len(lanes_)):
            # w < 2^16, c < 2^31: each product < 2^47; each reduced term < 2^31, and a chunk sums < 2^22 terms.
            lanes_[k] = (lanes_[k] + ((w * _reference_coefficients(index, k)) % P).sum()) % P
    return tuple(int(v) for v in torch.stack(lanes_).cpu().tolist())
