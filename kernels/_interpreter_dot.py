"""The interpreter's dot, made independent of a row's position in its tile (CPU, TRITON_INTERPRET=1 only).

Triton's interpreter evaluates `tl.dot(a, b, acc)` as `np.matmul(a, b) + acc`, so on the CPU the strict kernels'
products are whatever the BLAS under numpy computes. OpenBLAS picks its sgemm kernel by CPU model, and some of those
kernels round a row differently by its position in the tile: measured on an AMD EPYC (OpenBLAS 0.3.30, the Haswell
kernel), rows 6-11 of every 12 of a tile came out one ulp off the same row placed at rows 0-5, so a request's bytes
depended on where its rows fell in the batch (tests/strict's batch-1 vs item-of-batch-3 failed there).

`install()` replaces the interpreter builder's `create_dot` with a dot whose arithmetic is the same for every output
element on every CPU: each product a[m, k] * b[k, n] rounded to the accumulator dtype (exact for the float32-widened
bfloat16 tiles the strict kernels pass), the K products added in index order k = 0, 1, ... by numpy's elementwise
adds (IEEE round to nearest; no FMA contraction, no pairwise or blocked reordering: the reduced axis is never the
innermost loop), then the accumulator added last, as `np.matmul(a, b) + acc` does. Nothing changes on the GPU: the
compiled kernels never reach the interpreter builder. Only float32 / float64 operands are served this way; any other
dtype keeps Triton's own implementation.
"""

from __future__ import annotations

import os

import numpy as np

_K_CHUNK = 32  # products formed K_CHUNK at a time, to bound the (M, K_CHUNK, N) temporary; the add order is unchanged


def ordered_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc + a @ b over the last two axes, each output element summed over K in index order, in acc's dtype."""
    dtype = acc.dtype
    a = a.astype(dtype, copy=False)
    b = b.astype(dtype, copy=False)
    k_total = a.shape[-1]
    out = np.zeros(np.broadcast_shapes(a.shape[:-1] + (1,), b.shape[:-2] + (1, b.shape[-1])), dtype=dtype)
    for k0 in range(0, k_total, _K_CHUNK):
        prod = a[..., :, k0:k0 + _K_CHUNK, None] * b[..., None, k0:k0 + _K_CHUNK, :]  # (..., M, Kc, N), rounded
        for k in range(prod.shape[-2]):
            out += prod[..., k, :]
    return out + acc


def install() -> bool:
    """Patch the interpreter builder when TRITON_INTERPRET=1; idempotent. True when the ordered dot is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_h3_ordered", False):
        return True
    triton_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype.kind == "f" and b.data.dtype.kind == "f" and a.data.dtype.itemsize >= 4 \
                and b.data.dtype.itemsize >= 4 and d.data.dtype.itemsize >= 4:
            return interpreter.TensorHandle(ordered_dot(a.data, b.data, d.data), d.dtype.scalar)
        return triton_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._h3_ordered = True
    builder.create_dot = create_dot
    return True
